"""H2O (https://arxiv.org/abs/2306.14048): recent window + heavy hitters by accumulated attention.

One capture of a tiny llama (batch 2, chunks of 8) serves the module. The accumulated scores are checked
against a dense float64 recomputation: the HF model (in float64, eager attention) over the whole sequence
(prompt + the tokens fed), whose attention probabilities summed over every real query and the query heads
of each KV head are what H2O's score of every kept token must be when nothing has been evicted.
"""
import copy
import math

import pytest
import torch

import kvrewrite
from kvrewrite.kernels.observed_attention import fold_pending
from kvrewrite.methods import make_method
from kvrewrite.methods.h2o import H2OMethod
from tests.kernels.evict_by_score_naive import temporal

CHUNK = 8
N_PROMPT, PAD_ROW1 = 21, 4  # left-padded to 3 chunks of 8; row 1 has 4 more padding tokens
# fp32 scores (sums of <= 30 probabilities over 2 query heads) vs the float64 recomputation: the fp32
# forward differs by ~1e-6 relative; a wrong group, mask, query set or slot moves a score by >= 1e-2
TOL = dict(atol=2e-4, rtol=1e-4)


def _prompt(n=N_PROMPT):
    ids = torch.randint(3, 128, (2, n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :PAD_ROW1] = 0
    return ids, mask


def _run(rw, ids, mask, steps):
    """Prefill + `steps` greedy decode steps; returns the tokens fed to the decode steps [2, steps]."""
    logits = rw.prefill(ids, mask, max_new_tokens=steps + 1)
    fed = []
    for _ in range(steps):
        fed.append(logits.argmax(-1))
        logits = rw.decode_step(fed[-1])
    return torch.stack(fed, 1)


def dense_scores(llama, seq, mask):
    """Per layer, float64 [B, Hkv, N]: the attention each position of `seq` [B, N] received from every query
    after it, summed over the query heads of its KV head (HF eager attention, one unpadded row at a time:
    HF's padded rows attend to nothing, which eager softmax turns into NaN from the second layer on)."""
    m = copy.deepcopy(llama).double()
    m.set_attn_implementation("eager")
    Hkv = llama.config.num_key_value_heads
    B, N = seq.shape
    out = [torch.zeros(B, Hkv, N, dtype=torch.float64) for _ in range(llama.config.num_hidden_layers)]
    for b in range(B):
        pad = int((mask[b] == 0).sum())
        with torch.no_grad():
            att = m(seq[b:b + 1, pad:], output_attentions=True).attentions
        for layer, a in enumerate(att):  # [1, Hq, n, n]
            out[layer][b, :, pad:] = a[0].view(Hkv, -1, N - pad, N - pad).sum(dim=(1, 2))
    return out


def test_scores_are_the_dense_attention_history(llama, captured):
    """Prompt (batch 2, left-padded, 3 chunks) + 6 decode steps with a budget that never evicts: every valid
    slot's score equals the column sum of the whole dense softmax history; padding and empty slots hold 0."""
    rw = kvrewrite.apply(llama, "h2o", budget=60, max_length=64, captured=captured)
    ids, mask = _prompt()
    fed = _run(rw, ids, mask, 6)
    seq, full_mask = torch.cat([ids, fed], 1), torch.cat([mask, torch.ones_like(fed)], 1)
    for info, dense in zip(rw.layers, dense_scores(llama, seq, full_mask)):
        st = rw.layer_state(info.index)
        valid = st["bias"] > -math.inf
        assert int(st["fill"].min()) == 24 + 6  # nothing evicted (3 chunks + 6 steps)
        assert torch.equal(valid.sum(-1), full_mask.sum(-1)[:, None].expand_as(valid.sum(-1)))
        pos = st["slot_pos"].clamp(min=0)
        expected = torch.gather(dense, 2, pos).masked_fill(~valid, 0.0)
        # the decode graph defers each step's statistics to a later step: the last query (entry c - 1 mod P) is
        # pending, with those since the last step at c mod P == 0 (c: the next step's cache position)
        c = rw._next_cache_position.reshape(1)
        assert torch.isfinite(st["pending_lse"][:, :, int(c - 1) % st["pending_lse"].shape[2]]).all()
        score = st["score"].clone()
        fold_pending(st["keys"], st["bias"], st["slot_pos"], c, score, st["pending_q"], st["pending_lse"],
                     info.head_dim**-0.5, 0, "all")
        torch.testing.assert_close(score.double(), expected, **TOL)
        assert float(expected.max()) > 1.0  # the attention sink gathers more than one query's worth
    # the scores are state: counted by cache_bytes, reset by the next generation
    assert rw.cache_bytes()["kvrewrite"] == sum(t.numel() * t.element_size() for t in rw.state_tensors())
    assert any(t is rw.l1_score for t in rw.state_tensors())
    rw.prefill(ids[:, :8], mask[:, :8], max_new_tokens=1)  # each real query adds G = 2 (its 2 heads' softmax)
    torch.testing.assert_close(rw.l1_score.sum(-1), torch.tensor([[16.0, 16.0], [8.0, 8.0]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("budget,B", [(12, 12), (0.4, 12)], ids=["int", "fraction"])
def test_budget_exact_per_head_recent_half_and_heaviest_rest(llama, captured, budget, B):
    """After every compression each KV head of each row holds exactly B slots: its floor(B / 2) most recent tokens
    and the B - floor(B / 2) older ones with the largest score, as the state the compression op received says
    (int budgets count slots, fractions take round(0.4 * (21 + 9)) = 12)."""
    from tests.kernels.evict_by_score_naive import expected_row
    from tests.methods.score_spy import spy_compressions

    rw = kvrewrite.apply(llama, "h2o", budget=budget, interval=3, max_length=64, captured=captured)
    ids, mask = _prompt()
    logits = rw.prefill(ids, mask, max_new_tokens=9)
    R = B // 2
    for info in rw.layers:
        st = temporal(rw.layer_state(info.index))
        assert torch.equal(st["fill"], torch.full_like(st["fill"], B))
        assert bool((st["bias"][:, :, :B] == 0).all())  # B real tokens, no padding left
        last = torch.arange(N_PROMPT - R, N_PROMPT).expand(2, st["fill"].shape[1], R)
        assert torch.equal(st["slot_pos"][:, :, B - R:B], last)
    compressions = 0
    for _ in range(8):
        due = rw.schedule.due(1)
        with spy_compressions(rw) as seen:
            logits = rw.decode_step(logits.argmax(-1))
        if not due:
            continue
        compressions += 1
        for info in rw.layers:
            before, kw = seen[info.index]
            before = temporal(before)
            assert kw == {"n_recent": 0, "recent_ratio": 0.5, "pool": 1, "reset_score": False}
            st = temporal(rw.layer_state(info.index))
            assert torch.equal(st["fill"], torch.full_like(st["fill"], B))
            for b in range(2):
                for h in range(st["fill"].shape[1]):
                    kept = expected_row(before, b, h, B, 0, 0.5, 1)
                    assert len(kept) == B
                    assert st["slot_pos"][b, h, :B].tolist() == before["slot_pos"][b, h, kept].tolist()
                    assert kept[B - R:] == list(range(int(before["fill"][b, h]) - R, int(before["fill"][b, h])))
    assert compressions >= 2


@pytest.mark.parametrize("kw,field", [(dict(budget=0), "budget"), (dict(budget=2.0), "budget"),
                                      (dict(budget=True), "budget"), (dict(recent_ratio=1.5), "recent_ratio"),
                                      (dict(recent_ratio="0.5"), "recent_ratio"), (dict(interval=0), "interval")])
def test_config_errors(kw, field):
    with pytest.raises(ValueError, match=rf"H2OMethod\.{field}"):
        H2OMethod(**kw)
    with pytest.raises(ValueError, match=field):
        make_method("h2o", **kw)


def test_calls_state_and_targets():
    from kvrewrite.context import LayerInfo

    m = H2OMethod(budget=100, recent_ratio=0.25, interval=5)
    layer = LayerInfo(0, 4, 2, 16, 0)
    assert m.targets(layer, 3000, 1000) == (100, 105)  # an int budget counts slots, whatever n
    assert m.capacity(layer, 4096, 256) == 100 + 5 - 1 + 256
    assert H2OMethod(budget=0.25).targets(layer, 300, 100) == (100, 132)
    op, kw = m.compression_call(layer)
    assert op is torch.ops.kvrewrite.evict_by_score.default
    assert kw == {"n_recent": 0, "recent_ratio": 0.25, "pool": 1, "reset_score": False}
    assert m.observe_call(layer) == (torch.ops.kvrewrite.accumulate_attention.default, {"stats_mode": "all"})
    assert list(m.state_fields(layer)) == ["score", "pending_q", "pending_lse", "order"]
