"""EMS end to end on the tiny models: full attention through the lookup table when nothing is compressed, compressions
at B + g that the host schedule mirrors, every token either evicted or still in the table (a valid map), tau = 1 as
pure eviction, left padding invisible, option errors.

The ops are tested against float64 naive models in tests/kernels/test_ems_*.py and test_expanded_attention*.py; here
the method wires them (pre-RoPE keys from the graph, the attention replaced, the compression at the end of the step).
"""
import pytest
import torch

import kvrewrite
from kvrewrite.methods import make_method
from kvrewrite.methods.ems import EMSMethod
from tests.methods.tiny_runs import CHUNK, N_PROMPT, PAD_ROW1, prompt, run

SMALL = dict(window=4, kernel=3, interval=3)


def _apply(llama, captured, **kw):
    return kvrewrite.apply(llama, "ems", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                           **(SMALL | kw))


def check_table(st):
    """The table is a valid map: per row, the live slots point at valid entries in order, every valid entry has a
    slot, slot_order sorts the slots by token position, token positions are distinct."""
    B, H, _ = st["lut"].shape
    for b in range(B):
        for h in range(H):
            n, f = int(st["slot_fill"][b, h]), int(st["fill"][b, h])
            lut = st["lut"][b, h, :n].long()
            assert bool((lut >= 0).all() and (lut < f).all()), "a live slot points outside the entries"
            assert bool((lut[1:] >= lut[:-1]).all()), "the table is not grouped by entry"
            assert bool((st["lut"][b, h, n:] == -1).all()), "a slot past slot_fill is not free"
            valid = torch.isfinite(st["bias"][b, h, :f])
            assert set(lut.tolist()) == set(range(f)) or not bool(valid.all()), "a valid entry has no slot"
            order = st["slot_order"][b, h, :n].long()
            assert sorted(order.tolist()) == list(range(n)), "slot_order is not a permutation"
            pos = st["token_pos"][b, h, :n][order]
            assert bool((pos[1:] > pos[:-1]).all()), "slot_order does not sort the slots by position"


@pytest.mark.parametrize("pos", ["without", "with"])
def test_budget_covering_every_token_is_full_attention(llama, captured, pos):
    """B >= every token: the op drops the padding at B + g but merges and evicts nothing, so the logits are full's."""
    ids, mask = prompt()
    full = kvrewrite.apply(llama, "full", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured)
    want, fed = run(full, ids, mask, 9)
    rw = _apply(llama, captured, budget=30, interval=1, pos=pos)
    got, _ = run(rw, ids, mask, 9, fed)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    st = rw.layer_state(0)
    assert st["fill"][:, 0].tolist() == [30, 30 - PAD_ROW1]
    assert bool((st["slot_fill"] == st["fill"]).all()), "one slot per entry when nothing merged"
    check_table(st)


@pytest.mark.parametrize("pos,tau", [("without", 0.0), ("with", 0.6), ("without", 1.0)])
def test_compressions_at_b_plus_g_keep_a_valid_table(llama, captured, pos, tau):
    """B = 10, g = 3: every layer holds B entries after each compression (the host schedule's mirror), the table
    stays a valid map, tau = 0 merges (more slots than entries), tau = 1 merges nothing (one slot per entry)."""
    ids, mask = prompt()
    rw = _apply(llama, captured, budget=10, pos=pos, tau=tau)
    rw.prefill(ids, mask, max_new_tokens=13)
    for step in range(12):
        rw.decode_step(torch.tensor([5, 7]))
        for info in rw.layers:
            st = rw.layer_state(info.index)
            fill = st["fill"]
            assert bool((fill < 10 + 3).all()), f"layer {info.index} grew past B + g at step {step}"
            assert fill.tolist() == [[f] * fill.shape[1] for f in rw.schedule.fill[info.index]]
            check_table(st)
    st = rw.layer_state(rw.layers[-1].index)
    if tau == 1.0:
        assert bool((st["slot_fill"] == st["fill"]).all()), "tau = 1 must evict, never merge"
    else:
        assert bool((st["slot_fill"] > st["fill"]).any()), "nothing was merged"
        scale = st["key_scale"][st["lut"] >= 0]
        assert bool((scale > 0).all())


def test_padded_row_equals_the_prompt_alone(llama, captured):
    """Row 1 (left-padded) of a compressing batch-2 run gives the logits of its prompt run alone."""
    ids, mask = prompt()
    rw = _apply(llama, captured, budget=10)
    got, fed = run(rw, ids, mask, 6)
    alone = kvrewrite.apply(llama, "ems", max_length=48, batch_size=1, prefill_chunk=CHUNK, budget=10, **SMALL)
    logits = [alone.prefill(ids[1:, PAD_ROW1:], mask[1:, PAD_ROW1:], max_new_tokens=7)]
    for i in range(6):
        logits.append(alone.decode_step(fed[1:, i]))
    torch.testing.assert_close(got[1:], torch.stack(logits, 1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs,err", [
    (dict(window=0), r"EMSMethod\.window must be an int >= 1, got 0"),
    (dict(kernel=4), r"EMSMethod\.kernel must be an odd int >= 1, got 4"),
    (dict(gamma=0.5), r"EMSMethod\.gamma must be a number >= 1 \(math\.inf allowed\), got 0\.5"),
    (dict(tau=1.5), r"EMSMethod\.tau must be a number in \[0, 1\], got 1\.5"),
    (dict(pos="rope"), r"EMSMethod\.pos must be one of \('without', 'with'\), got 'rope'"),
])
def test_option_errors(kwargs, err):
    with pytest.raises(ValueError, match=err):
        make_method("ems", **kwargs)


def test_budget_and_chunk_errors(llama, captured):
    with pytest.raises(ValueError, match="prefill_chunk=8 is shorter than the local window"):
        kvrewrite.apply(llama, EMSMethod(window=16), max_length=48, batch_size=2, prefill_chunk=CHUNK,
                        captured=captured)
    rw = _apply(llama, captured, budget=4)
    ids, mask = prompt()
    with pytest.raises(ValueError, match="cannot hold the 4-token local window plus a class centre"):
        rw.prefill(ids, mask, max_new_tokens=4)
    assert N_PROMPT > 4


def test_state_sizes_and_cache_bytes(llama, captured):
    """R = min(L, ceil(gamma * C)); pos="with" keeps no pre-RoPE keys."""
    for pos, raw in (("without", True), ("with", False)):
        rw = _apply(llama, captured, budget=6, pos=pos)
        st = rw.layer_state(0)
        C = st["keys"].shape[2]
        assert st["lut"].shape[2] == min(48 + CHUNK - 1, 4 * C)
        assert st["raw_keys"].shape[2] == (C if raw else 0)
