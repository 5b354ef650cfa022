"""kvrewrite::chelsea_compress at the op level: which rows it touches and the shape of what it leaves.

The algorithm's properties (exactness, degrees, schedule, partition, ranking, merge rule) are tested in
tests/methods/test_chelsea.py; here: rows below the threshold and outlier heads are untouched bit for
bit, rows at the threshold end with exactly `target` packed slots, padding slots disappear.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.state import allocate_layer_state

OP = torch.ops.kvrewrite.chelsea_compress.default
FIELDS = ("keys", "values", "bias", "slot_pos", "fill")
# n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min
SMALL = dict(n_sink=2, n_recent=3, chunk=8, r_init=0.35, r_alpha=0.1, r_steps=2, r_min=0.1)


def filled_state(B, Hkv, C, D, fills, target, threshold, dtype=torch.float32, pads=None, seed=0):
    """Row (b, h) holds fills[b][h] exact tokens (bias 0) at positions 0.., the first pads[b] of them
    padding (bias -inf); the slots past the fill hold garbage."""
    g = torch.Generator().manual_seed(seed)
    s = allocate_layer_state(B, Hkv, C, D, dtype, "cpu")
    s["keys"].copy_(torch.randn(B, Hkv, C, D, generator=g))
    s["values"].copy_(torch.randn(B, Hkv, C, D, generator=g))
    s["bias"].zero_()
    s["slot_pos"].copy_(torch.arange(C))
    s["fill"].copy_(torch.as_tensor(fills))
    for b in range(B):
        for h in range(Hkv):
            s["bias"][b, h, int(s["fill"][b, h]):] = -math.inf
            if pads is not None:
                s["bias"][b, h, : pads[b]] = -math.inf
    s["budget"].copy_(torch.tensor([target, threshold]))
    return s


def call(s, outlier_heads=(), **kw):
    a = {**SMALL, **kw}
    OP(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], s["budget"], a["n_sink"], a["n_recent"],
       a["chunk"], a["r_init"], a["r_alpha"], a["r_steps"], a["r_min"], list(outlier_heads))


def degrees(s, b, h):
    n = int(s["fill"][b, h])
    return s["bias"][b, h, :n].exp().round()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_below_threshold_untouched_rows_at_threshold_hit_target(dtype):
    target, threshold = 12, 20
    fills = [[20, 19, 31], [7, 26, 20]]  # at, just below, over (prefill chunk), far below, over, at
    s = filled_state(2, 3, 32, 16, fills, target, threshold, dtype)
    before = {k: v.clone() for k, v in s.items()}
    call(s)
    for b in range(2):
        for h in range(3):
            if fills[b][h] < threshold:
                for name in FIELDS:
                    assert torch.equal(s[name][b, h], before[name][b, h]), (b, h, name)
                continue
            assert int(s["fill"][b, h]) == target
            assert int((s["bias"][b, h] > -math.inf).sum()) == target  # packed, nothing valid past the fill
            assert (s["bias"][b, h, target:] == -math.inf).all()
            assert int(degrees(s, b, h).sum()) == fills[b][h]  # every token is still represented
            assert s["keys"][b, h].dtype == dtype


def test_outlier_heads_untouched():
    target, threshold = 10, 16
    s = filled_state(2, 4, 24, 8, [[16, 16, 20, 16], [16, 16, 16, 24]], target, threshold)
    before = {k: v.clone() for k, v in s.items()}
    call(s, outlier_heads=[1, 3])
    for b in range(2):
        for h in range(4):
            if h in (1, 3):
                for name in FIELDS:
                    assert torch.equal(s[name][b, h], before[name][b, h]), (b, h, name)
            else:
                assert int(s["fill"][b, h]) == target


def test_padding_slots_dropped_not_merged():
    """Left-padded rows: the pads vanish (never merged into a token: degrees count real tokens only)."""
    target, threshold = 10, 18
    s = filled_state(2, 2, 24, 8, [[18, 18], [18, 18]], target, threshold, pads=[0, 5])
    call(s)
    for h in range(2):
        assert int(degrees(s, 0, h).sum()) == 18
        assert int(degrees(s, 1, h).sum()) == 13  # 18 slots, 5 of them pads
        assert (s["slot_pos"][1, h, :target] >= 5).all()  # no slot stands for a pad position
        assert int(s["fill"][1, h]) == target
    # rows with too few real tokens to need merging: pads dropped, packed, nothing merged
    s = filled_state(1, 1, 24, 8, [[18]], 10, 18, pads=[12])
    before = {k: v.clone() for k, v in s.items()}
    call(s)
    assert int(s["fill"][0, 0]) == 6
    assert torch.equal(s["keys"][0, 0, :6], before["keys"][0, 0, 12:18])
    assert s["slot_pos"][0, 0, :6].tolist() == list(range(12, 18))
    assert (s["bias"][0, 0, :6] == 0).all() and (s["bias"][0, 0, 6:] == -math.inf).all()


def test_repeated_calls_keep_target():
    """Decode-time compression: append g tokens, compress back to target, again and again."""
    target, g = 12, 4
    s = filled_state(1, 2, 12 + g, 8, [[0, 0]], target, target + g)
    gen = torch.Generator().manual_seed(3)
    for t in range(40):
        k = torch.randn(1, 2, 1, 8, generator=gen)
        torch.ops.kvrewrite.cache_append(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k, k,
                                         torch.tensor([t]), torch.ones(1, 1, dtype=torch.bool))
        call(s)
        n = t + 1
        exp_fill = n if n < target + g else target + (n - target) % g
        assert (s["fill"] == exp_fill).all(), t
        for h in range(2):
            assert int(degrees(s, 0, h).sum()) == n


def test_opcheck():
    s = filled_state(2, 2, 24, 8, [[18, 12], [20, 18]], 10, 18, torch.bfloat16, pads=[0, 3])
    a = SMALL
    torch.library.opcheck(OP, (s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], s["budget"], a["n_sink"],
                               a["n_recent"], a["chunk"], a["r_init"], a["r_alpha"], a["r_steps"], a["r_min"], [1]))


def test_a_target_below_sink_plus_recent_is_refused_not_looped_on():
    # rows of 4 slots over a target of 3 < n_sink 2 + n_recent 3: the CPU op names it (it used to loop forever,
    # the empty middle's concatenation growing the rows)
    s = filled_state(1, 1, 16, 4, [[4]], target=3, threshold=4)
    with pytest.raises(ValueError, match="target of 3 slots cannot hold the 2 sink \\+ 3 recent"):
        call(s)


def test_reset_refuses_a_budget_the_method_cannot_run_with():
    from tests.families import tiny_model

    # callers that fill the state themselves (the bench's synthetic fill) get a prefill's refusal from reset
    rw = kvrewrite.apply(tiny_model("llama"), "chelsea", 0.1, max_length=128, prefill_chunk=16, n_sink=16, n_recent=64)
    with pytest.raises(ValueError, match="cannot hold the 16 sink \\+ 64 recent"):
        rw.reset(64, 32)
