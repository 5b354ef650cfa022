"""SnapKV (https://arxiv.org/abs/2404.14469): the observation window + the older tokens it attends to most.

With the prompt in one prefill chunk kvrewrite runs the paper's algorithm: after the prefill each KV head keeps
its last w tokens and the B - w older ones with the largest max-pooled attention from the last w queries
(averaged over the query heads of the KV head). That is checked against a float64 implementation over HF's
own attention probabilities (eager, unpadded rows). Decode-time re-compression is checked through the state the
compression op receives: the scores restart at every compression and then sum the decode queries since.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import kvrewrite
from kvrewrite.methods import make_method
from kvrewrite.methods.snapkv import SnapKVMethod
from tests.kernels.evict_by_score_naive import temporal
from tests.families import tiny_model

N_PROMPT, PAD_ROW1, CHUNK = 30, 5, 32
W, KERNEL = 4, 7


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def captured(llama):
    """The whole (left-padded) prompt in one prefill chunk: the paper's exact prefill, then compression."""
    from kvrewrite.capture import capture

    return capture(llama, batch_size=2, prefill_chunk=CHUNK)


def _prompt():
    ids = torch.randint(3, 128, (2, N_PROMPT), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :PAD_ROW1] = 0
    return ids, mask


def paper_selection(llama, ids, B, w, kernel):
    """Per layer, per row, per KV head: the prompt indices SnapKV keeps (float64, HF eager attention), and the
    pooled scores of the older tokens (for near-ties)."""
    m = copy.deepcopy(llama).double()
    m.set_attn_implementation("eager")
    Hkv = llama.config.num_key_value_heads
    with torch.no_grad():
        att = m(ids, output_attentions=True).attentions
    out = []
    for a in att:  # [1, Hq, n, n]
        n = a.shape[-1]
        obs = a[0, :, n - w:, :n - w].sum(dim=1).view(Hkv, -1, n - w).mean(dim=1)  # [Hkv, n - w]
        pooled = F.max_pool1d(obs[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
        heads = []
        for h in range(Hkv):
            order = sorted(range(n - w), key=lambda i: (-float(pooled[h, i]), i))
            heads.append((sorted(order[:B - w]) + list(range(n - w, n)), pooled[h]))
        out.append(heads)
    return out


@pytest.mark.parametrize("budget,B", [(14, 14), (0.4, 14)], ids=["int", "fraction"])
def test_prefill_keeps_the_window_and_the_top_pooled_scores(llama, captured, budget, B):
    """Batch 2 (row 1 left-padded), the prompt in one chunk: every KV head keeps exactly B slots, the w-token
    window and the B - w older tokens with the largest pooled scores (fractions: round(0.4 * (30 + 5)) = 14)."""
    rw = kvrewrite.apply(llama, "snapkv", budget=budget, window=W, kernel=KERNEL, interval=4, max_length=64,
                         captured=captured)
    ids, mask = _prompt()
    rw.prefill(ids, mask, max_new_tokens=5)
    for b in range(2):
        pad = int((mask[b] == 0).sum())
        expected = paper_selection(llama, ids[b:b + 1, pad:], B, W, KERNEL)
        for info, heads in zip(rw.layers, expected):
            st = temporal(rw.layer_state(info.index))
            assert torch.equal(st["fill"][b], torch.full_like(st["fill"][b], B))
            assert bool((st["score"][b] == 0).all())  # the window restarts after the compression
            for h, (kept, pooled) in enumerate(heads):
                got = (st["slot_pos"][b, h, :B] - pad).tolist()
                assert got[B - W:] == kept[B - W:]
                if got != kept:  # only a float64-vs-fp32 near-tie at the boundary may differ
                    kth = sorted(pooled.tolist(), reverse=True)[B - W - 1]
                    diff = set(got) ^ set(kept)
                    assert all(abs(float(pooled[i]) - kth) < 1e-6 for i in diff), (info.index, b, h, got, kept)


def test_decode_recompression_restarts_the_window(llama, captured):
    """Decode steps add one unit of attention per query (averaged over the group) to the scores, which restart
    at 0 after each compression: the state the compression op receives sums to the queries since the last one,
    and the kept slots are the window + top pooled older slots (tests/kernels/test_evict_by_score.expected_row)."""
    from tests.kernels.evict_by_score_naive import expected_row
    from tests.methods.score_spy import spy_compressions

    rw = kvrewrite.apply(llama, "snapkv", budget=12, window=W, kernel=KERNEL, interval=3, max_length=64,
                         captured=captured)
    ids, mask = _prompt()
    logits = rw.prefill(ids, mask, max_new_tokens=10)
    compressions = 0
    for _ in range(9):
        due = rw.schedule.due(1)
        with spy_compressions(rw) as seen:
            logits = rw.decode_step(logits.argmax(-1))
        if not due:
            continue
        compressions += 1
        for info in rw.layers:
            before, kw = seen[info.index]
            before = temporal(before)
            assert kw == {"n_recent": W, "recent_ratio": 0.0, "pool": KERNEL, "reset_score": True}
            torch.testing.assert_close(before["score"].sum(-1), torch.full((2, 2), 3.0), atol=1e-5, rtol=0)
            st = temporal(rw.layer_state(info.index))
            assert bool((st["score"] == 0).all()) and torch.equal(st["fill"], torch.full_like(st["fill"], 12))
            for b in range(2):
                for h in range(2):
                    kept = expected_row(before, b, h, 12, W, 0.0, KERNEL)
                    assert st["slot_pos"][b, h, :12].tolist() == before["slot_pos"][b, h, kept].tolist()
    assert compressions == 3


def test_generation_too_small_for_the_window():
    m = SnapKVMethod(budget=0.1, window=32)
    with pytest.raises(ValueError, match=r"snapkv: budget 0\.1 x .* = 30 slots cannot hold the 32-slot observation"):
        m.check_generation(250, 50)
    with pytest.raises(ValueError, match=r"snapkv: budget 32 slots cannot hold the 32-slot observation window"):
        SnapKVMethod(budget=32).check_generation(1000, 10)
    SnapKVMethod(budget=33).check_generation(1000, 10)


@pytest.mark.parametrize("kw,field", [(dict(budget=0), "budget"), (dict(budget=1.5), "budget"),
                                      (dict(window=0), "window"), (dict(window=True), "window"),
                                      (dict(kernel=4), "kernel"), (dict(kernel=0), "kernel")])
def test_config_errors(kw, field):
    with pytest.raises(ValueError, match=rf"SnapKVMethod\.{field}"):
        SnapKVMethod(**kw)
    with pytest.raises(ValueError, match=field):
        make_method("snapkv", **kw)


def test_calls_state_and_targets():
    from kvrewrite.context import LayerInfo

    m = SnapKVMethod(budget=1024)
    layer = LayerInfo(0, 32, 8, 128, 0)
    assert m.targets(layer, 30000, 500) == (1024, 1056)  # g = w = 32 by default
    op, kw = m.compression_call(layer)
    assert op is torch.ops.kvrewrite.evict_by_score.default
    assert kw == {"n_recent": 32, "recent_ratio": 0.0, "pool": 7, "reset_score": True}
    assert m.observe_call(layer) == (torch.ops.kvrewrite.accumulate_attention.default, {"stats_mode": "window", "last": 32})
    assert list(m.state_fields(layer)) == ["score", "pending_q", "pending_lse", "order"]
    assert math.isclose(SnapKVMethod().budget, 0.2)
