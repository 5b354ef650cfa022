"""kvrewrite::evict_to_budget: rows at the threshold keep n_sink first + (target - n_sink) last valid slots."""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.state import allocate_layer_state

OP = torch.ops.kvrewrite.evict_to_budget.default
FIELDS = ("keys", "values", "bias", "slot_pos", "fill")


def filled_state(B, Hkv, C, D, fills, target, threshold, dtype=torch.float32, pads=None, seed=0):
    """Row (b, h) holds fills[b][h] tokens in order, positions 100.. (pads[b] leading padding slots,
    bias -inf); degrees vary so that bias must travel with its slot; slots past the fill are garbage."""
    g = torch.Generator().manual_seed(seed)
    s = allocate_layer_state(B, Hkv, C, D, dtype, "cpu")
    s["keys"].copy_(torch.randn(B, Hkv, C, D, generator=g))
    s["values"].copy_(torch.randn(B, Hkv, C, D, generator=g))
    s["bias"].copy_(torch.randint(1, 4, (B, Hkv, C), generator=g).float().log())
    s["slot_pos"].copy_(100 + torch.arange(C))
    s["fill"].copy_(torch.as_tensor(fills))
    for b in range(B):
        for h in range(Hkv):
            s["bias"][b, h, int(s["fill"][b, h]):] = -math.inf
            if pads is not None:
                s["bias"][b, h, : pads[b]] = -math.inf
    s["budget"].copy_(torch.tensor([target, threshold]))
    return s


def call(s, n_sink):
    OP(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], s["budget"], n_sink)


def expected_row(before, b, h, target, n_sink):
    """The kept (key, value, bias, pos) of a row, computed from the valid slots by position."""
    n = int(before["fill"][b, h])
    valid = (before["bias"][b, h, :n] > -math.inf).nonzero().squeeze(1)
    L = len(valid)
    if L > target:
        sink = min(n_sink, target)
        valid = torch.cat([valid[:sink], valid[L - (target - sink):]])
    return {f: before[f][b, h, valid] for f in ("keys", "values", "bias", "slot_pos")}, len(valid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_sink", [0, 4])
def test_rows_at_threshold_keep_sinks_and_recent(n_sink, dtype):
    target, threshold = 10, 14
    fills = [[14, 13], [20, 9]]  # at, below, above (a prefill chunk overshoots), below
    s = filled_state(2, 2, 24, 8, fills, target, threshold, dtype)
    before = {k: v.clone() for k, v in s.items()}
    call(s, n_sink)
    for b in range(2):
        for h in range(2):
            f = fills[b][h]
            if f < threshold:  # untouched, bit-for-bit (garbage beyond the fill included)
                for name in FIELDS:
                    assert torch.equal(s[name][b, h], before[name][b, h]), (b, h, name)
                continue
            assert int(s["fill"][b, h]) == target
            exp, L = expected_row(before, b, h, target, n_sink)
            assert L == target
            for name, val in exp.items():
                assert torch.equal(s[name][b, h, :target], val), (b, h, name)
            # positions: the first n_sink tokens and the last target - n_sink, in order
            pos = s["slot_pos"][b, h, :target].tolist()
            assert pos == list(range(100, 100 + n_sink)) + list(range(100 + f - (target - n_sink), 100 + f))
            assert (s["bias"][b, h, target:] == -math.inf).all()


def test_padding_slots_are_dropped_first():
    """Left padding (bias -inf inside the fill) never takes a sink or a recent slot."""
    target, threshold, n_sink = 6, 9, 2
    s = filled_state(2, 1, 16, 4, [[12], [9]], target, threshold, pads=[3, 5])
    before = {k: v.clone() for k, v in s.items()}
    call(s, n_sink)
    # row 0: 9 valid tokens at positions 103..111 -> sinks 103,104 + last 4
    assert s["slot_pos"][0, 0, :6].tolist() == [103, 104, 108, 109, 110, 111]
    # row 1: 4 valid tokens (105..108) < target: all kept, packed, fill 4
    assert int(s["fill"][1, 0]) == 4
    assert s["slot_pos"][1, 0, :4].tolist() == [105, 106, 107, 108]
    assert torch.equal(s["keys"][1, 0, :4], before["keys"][1, 0, 5:9])
    assert (s["bias"][:, :, :4] > -math.inf).all()
    assert (s["bias"][1, 0, 4:] == -math.inf).all() and (s["bias"][0, 0, 6:] == -math.inf).all()


def test_n_sink_at_least_target():
    s = filled_state(1, 1, 12, 4, [[10]], 3, 8)
    call(s, 5)
    assert int(s["fill"][0, 0]) == 3 and s["slot_pos"][0, 0, :3].tolist() == [100, 101, 102]


def test_repeated_eviction_is_streaming():
    """Append-then-evict with interval 1 keeps exactly sinks + the latest window at every step."""
    n_sink, target = 2, 5
    s = filled_state(1, 1, 8, 4, [[0]], target, target + 1)
    for t in range(20):
        k = torch.full((1, 1, 1, 4), float(t))
        torch.ops.kvrewrite.cache_append(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k, k,
                                         torch.tensor([t]), torch.ones(1, 1, dtype=torch.bool))
        call(s, n_sink)
        n = int(s["fill"][0, 0])
        exp = list(range(t + 1)) if t < target else [0, 1] + list(range(t - 2, t + 1))
        assert s["slot_pos"][0, 0, :n].tolist() == exp
        assert s["keys"][0, 0, :n, 0].tolist() == [float(p) for p in exp]


def test_opcheck():
    s = filled_state(2, 2, 16, 8, [[12, 5], [16, 9]], 6, 9, torch.bfloat16, pads=[0, 2])
    torch.library.opcheck(OP, (s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], s["budget"], 2))
