"""ems_score's Triton kernels compiled on CUDA, bit for bit against the reference (on the same GPU) on fresh random
EMS slot tables, and against the float64 naive model (tests/kernels/ems_naive.py) on a naive-built state.

The states: `synthetic_state` builds merged slot tables of any size with tensor code (the Llama-sized ones are too
large for ems_naive.to_state's loops): ragged fills and slot counts per row, leading padding entries, merged entries
with scattered token positions, the window entries one slot each. The pooled sums follow the reference's order and
alpha is an fp64 ratio, so g and g_pooled are compared bit for bit (a last-bit difference of alpha could only come
from the fp64 partial sums' order: ~1e-16 relative, not seen).
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import _ems_rank_kernels as kk
from kvrewrite.kernels import ems_score as op_file
from kvrewrite.kernels.ems_score import reference_ems_score
from tests.kernels import ems_naive as N
from tests.kernels.poisoned import poisoned

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(kk.triton is None, reason="needs Triton"),
]

ARGS = ("bias", "fill", "lut", "slot_order", "s_glo", "s_loc_past", "s_loc_cur", "slot_fill")
NEG = float("-inf")


def synthetic_state(B, H, C, R, fills, slots, pads=(), l_win=32, seed=0, device="cuda"):
    """The score/partition inputs of an EMS state (ARGS + entry_start, token_pos, slot_pos), §3's invariants
    holding: row (b, h) holds fills[b][h] entries (the first pads[b] padding: bias -inf, scores 0) and
    slots[b][h] >= fills[b][h] slots; the extra slots go at random to the entries before the last l_win; token
    positions are a random permutation with the entries' head slots in increasing order and the window newest."""
    g = torch.Generator().manual_seed(seed)
    s = {"bias": torch.full((B, H, C), NEG), "fill": torch.zeros(B, H, dtype=torch.int64),
         "entry_start": torch.zeros(B, H, C, dtype=torch.int32), "slot_pos": torch.zeros(B, H, C, dtype=torch.int64),
         "lut": torch.full((B, H, R), -1, dtype=torch.int32), "key_scale": torch.ones(B, H, R),
         "token_pos": torch.zeros(B, H, R, dtype=torch.int32),
         "slot_order": torch.full((B, H, R), -1, dtype=torch.int32),
         "s_glo": torch.zeros(B, H, R), "s_loc_past": torch.zeros(B, H, R), "s_loc_cur": torch.zeros(B, H, R),
         "slot_fill": torch.zeros(B, H, dtype=torch.int64)}
    for b in range(B):
        for h in range(H):
            F, S = fills[b][h], slots[b][h]
            nw = min(l_win, F)
            assert F <= C and S <= R and (S == F or F > nw)
            extra = torch.bincount(torch.randint(0, max(F - nw, 1), (S - F,), generator=g), minlength=F)[:F]
            sizes = 1 + extra
            lut = torch.repeat_interleave(torch.arange(F), sizes)
            start = torch.cumsum(sizes, 0) - sizes
            pos = torch.randperm(S - nw, generator=g)
            heads = start[:F - nw]
            pos[heads] = pos[heads].sort().values
            pos = torch.cat([pos, torch.arange(S - nw, S)]) + 1000
            pad = pads[b] if b < len(pads) else 0
            s["bias"][b, h, pad:F] = 0.0
            s["fill"][b, h], s["slot_fill"][b, h] = F, S
            s["entry_start"][b, h, :F] = start.int()
            s["slot_pos"][b, h, :F] = torch.zeros(F, dtype=torch.int64).scatter_reduce(0, lut, pos, "amax")
            s["lut"][b, h, :S] = lut.int()
            s["token_pos"][b, h, :S] = pos.int()
            s["slot_order"][b, h, :S] = torch.argsort(pos).int()
            live = lut >= pad
            for f, scale in (("s_glo", 4.0), ("s_loc_past", 1.0), ("s_loc_cur", 1.0)):
                s[f][b, h, :S] = torch.where(live, torch.rand(S, generator=g) * scale, 0.0)
    return {f: t.to(device) for f, t in s.items()}


def run_both(s, due, l_win, pool, **knobs):
    a = [s[f] for f in ARGS]
    nbytes = 2 * s["lut"].numel() * 4
    got = poisoned(lambda: kk.triton_ems_score(*a, due, l_win, pool, **knobs), nbytes)
    want = reference_ems_score(*a, due, l_win, pool)
    for x, y, name in zip(got, want, ("g", "g_pooled")):
        assert torch.equal(x, y), (name, (x != y).sum().item(), x[x != y][:5], y[x != y][:5])
    return got


def test_synthetic_state_holds_the_invariants():
    s = synthetic_state(2, 2, 40, 90, [[30, 12], [40, 5]], [[80, 30], [90, 5]], pads=(0, 3), l_win=4, device="cpu")
    N.check_invariants(s, l_win=4)


@pytest.mark.parametrize("pool", [1, 3, 7])
@pytest.mark.parametrize("l_win", [1, 32, 5000])  # 5000: more than any row's valid entries, everything is window
def test_matches_reference_bitwise(pool, l_win):
    fills = [[1031, 700, 1031, 0], [990, 1031, 64, 1]]  # ragged, an empty row, a one-entry row
    slots = [[4001, 2100, 1031, 0], [3333, 4100, 100, 1]]
    s = synthetic_state(2, 4, 1031, 4111, fills, slots, pads=(0, 17), seed=pool * 7 + l_win)
    due = torch.tensor([[True, False, True, True], [True, True, True, True]], device="cuda")
    g, gp = run_both(s, due, l_win, pool)
    assert (g[0, 1] == 0).all() and (gp[0, 1] == NEG).all()
    assert (gp > NEG).sum() > 0 or l_win == 5000


@pytest.mark.parametrize("block,window_chunk", [(128, 16), (2048, 64), (4096, 8)])
def test_tuning_knobs_give_the_same_result(block, window_chunk):
    s = synthetic_state(1, 3, 777, 2999, [[777, 500, 390]], [[2999, 1200, 390]], pads=(5,), seed=3)
    run_both(s, torch.ones(1, 3, dtype=torch.bool, device="cuda"), 32, 7, block=block, window_chunk=window_chunk)


def test_zero_global_sums_and_padding_only_rows():
    s = synthetic_state(1, 3, 300, 900, [[300, 250, 40]], [[900, 600, 40]], pads=(30,), l_win=8, seed=4)
    s["s_glo"][0, 0].zero_()  # alpha 0
    s["bias"][0, 2].fill_(NEG)  # a row of padding only: nothing live
    run_both(s, torch.ones(1, 3, dtype=torch.bool, device="cuda"), 8, 7)


def test_matches_the_naive_model():
    from tests.kernels.test_ems_score import merged_rows
    rows = merged_rows(seed=8)
    s = {f: t.cuda() for f, t in N.to_state(rows, 32, 48).items()}
    g, gp = run_both(s, torch.ones(2, 2, dtype=torch.bool, device="cuda"), 3, 3)
    for b in range(2):
        for h in range(2):
            want_g, want_gp = N.score(rows[b][h], 3, 3)
            slot = {int(s["token_pos"][b, h, j]): j for j in range(int(s["slot_fill"][b, h]))}
            for t in (t for e in rows[b][h] if e.valid for t in e.members):
                assert float(g[b, h, slot[t.pos]]) == pytest.approx(want_g[id(t)], rel=1e-6)
                assert float(gp[b, h, slot[t.pos]]) == pytest.approx(want_gp[id(t)], rel=1e-6)


def test_cuda_graph_replay_on_new_state():
    s = synthetic_state(2, 2, 500, 1500, [[500, 400], [480, 300]], [[1500, 900], [1400, 300]], seed=5)
    due = torch.tensor([[True, True], [False, True]], device="cuda")
    a = [s[f] for f in ARGS]
    kk.triton_ems_score(*a, due, 32, 7)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kk.triton_ems_score(*a, due, 32, 7)
    s2 = synthetic_state(2, 2, 500, 1500, [[499, 200], [480, 301]], [[1400, 700], [1480, 301]], pads=(3,), seed=6)
    for f in ARGS:
        s[f].copy_(s2[f])
    due.copy_(torch.tensor([[True, False], [True, True]]))
    graph.replay()
    want = reference_ems_score(*a, due, 32, 7)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


def test_the_op_runs_the_kernel_on_cuda(monkeypatch):
    monkeypatch.setattr(op_file, "KERNELS_CHECKED_ON_GPU", True)
    s = synthetic_state(1, 2, 200, 700, [[200, 150]], [[700, 400]], seed=7)
    due = torch.ones(1, 2, dtype=torch.bool, device="cuda")
    calls = []
    real = kk.triton_ems_score
    monkeypatch.setattr(kk, "triton_ems_score", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = torch.ops.kvrewrite.ems_score(*(s[f] for f in ARGS), due, l_win=32, pool=7)
    want = reference_ems_score(*(s[f] for f in ARGS), due, 32, 7)
    assert calls and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert math.isinf(float(got[1].min()))
