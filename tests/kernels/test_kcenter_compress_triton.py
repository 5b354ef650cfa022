"""kcenter_compress's Triton kernels on the CPU, through Triton's interpreter, against the op's reference (bit for
bit: the greedy's decisions, the packed layout, every field) and the naive float64 greedy of
tests/kernels/clustergen_naive.py (the order of the centres).

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_kcenter_compress_triton.py`
(with Triton installed; skipped otherwise). The interpreter runs programs one after another, so the select launch has
one program per row here (programs=1); the exchange between several programs of a row runs on the GPU
(tests/kernels/test_kcenter_compress_gpu.py). Small lookaheads make a round end early (the bound U is reached) as well
as run several steps. Integer keys make every distance exact, so ties are real ties and must break the same way.
"""
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels._kcenter_kernels import triton_kcenter_compress  # noqa: E402
from kvrewrite.kernels.kcenter_compress import reference_kcenter_compress  # noqa: E402
from tests.kernels import clustergen_naive as N  # noqa: E402
from tests.kernels.test_kcenter_compress import make_state  # noqa: E402

FIELDS = ("keys", "values", "bias", "slot_pos", "fill")


def run_both(s, recent_ratio, **knobs):
    """(kernel state, reference state, order [rows, C] (-1 where not written), rounds [rows] (-1 likewise))."""
    got = {f: t.clone() for f, t in s.items()}
    want = {f: t.clone() for f, t in s.items()}
    B, H, C, _ = s["keys"].shape
    order = torch.full((B * H, C), -1, dtype=torch.int32)
    rounds = torch.full((B * H,), -1, dtype=torch.int32)
    triton_kcenter_compress(*(got[f] for f in FIELDS), got["budget"], recent_ratio=recent_ratio, order=order,
                            rounds=rounds, **knobs)
    reference_kcenter_compress(*(want[f] for f in FIELDS), want["budget"], recent_ratio)
    for f in FIELDS:
        assert torch.equal(got[f], want[f]), f"{f}: kernel {got[f]} reference {want[f]}"
    return got, want, order, rounds


def check_order(s, order, recent_ratio):
    """Each due row's centres (in the order chosen) = the naive float64 greedy over its candidates."""
    target, threshold = (int(x) for x in s["budget"])
    B, H, C, _ = s["keys"].shape
    n_rows = 0
    for b in range(B):
        for h in range(H):
            valid = [j for j in range(int(s["fill"][b, h])) if s["bias"][b, h, j] > -math.inf]
            if s["fill"][b, h] < threshold or len(valid) <= target:
                continue
            ell = math.floor(recent_ratio * target)
            cand = valid[:len(valid) - ell]
            want, _ = N.greedy_naive([s["keys"][b, h, j].double().numpy() for j in cand], target - ell)
            got = order[b * H + h, :len(want)].tolist()
            assert got == [cand[i] for i in want], (b, h, got, want)
            n_rows += 1
    return n_rows


@pytest.mark.parametrize("recent_ratio,lookahead", [(0.5, 8), (0.25, 1), (0.0, 3), (1.0, 8)])
def test_matches_reference_and_naive(recent_ratio, lookahead):
    """Rows at, above and below the threshold, left padding, a row with fewer valid slots than B, B = 7 (odd)."""
    fills = [[16, 13], [21, 9]]
    s = make_state(2, 2, 24, 8, fills, 7, 16, pads=[0, 15], seed=1)
    _, _, order, _ = run_both(s, recent_ratio, lookahead=lookahead)
    assert check_order(s, order, recent_ratio) == 1  # row (0, 0) selects (k = 0 at recent_ratio 1)


@pytest.mark.parametrize("lookahead", [1, 2, 8])
def test_integer_keys_exact_ties(lookahead):
    """Small integer keys (exact fp32 distances: many exact ties) and duplicates of the start point."""
    s = make_state(2, 3, 40, 5, [[40, 33, 38], [37, 40, 20]], 12, 30, pads=[3, 0], seed=7, integer=True)
    s["keys"][0, 0, 3:9] = s["keys"][0, 0, 3]
    _, _, order, rounds = run_both(s, 0.34, lookahead=lookahead)
    assert check_order(s, order, 0.34) == 5  # every row but (1, 2) (below the threshold)
    k = 12 - math.floor(0.34 * 12)
    due = rounds >= 0
    assert (rounds[due] >= 1).all() and (rounds[due] <= k).all()


def test_lookahead_takes_several_steps_per_round():
    """Well spread points: a round of lookahead 8 chooses several centres (fewer rounds than centres), and the
    result does not depend on the lookahead."""
    s = make_state(1, 2, 64, 16, [[64, 64]], 40, 64, seed=3)
    got8, _, order8, rounds8 = run_both(s, 0.25, lookahead=8)
    _, _, order1, rounds1 = run_both(s, 0.25, lookahead=1)
    assert torch.equal(order8, order1)
    k = 40 - 10
    assert (rounds8 < k // 2).all() and (rounds1 <= k).all(), (rounds8, rounds1)


def test_few_valid_slots_keep_all_and_nothing_due():
    s = make_state(2, 1, 16, 4, [[12], [16]], 10, 12, pads=[4, 7], seed=3)
    s["bias"][1, 0, 9] = -math.inf  # a hole
    got, _, _, _ = run_both(s, 0.5)
    assert got["fill"].tolist() == [[8], [8]]
    s = make_state(1, 2, 10, 4, [[5, 9]], 4, 10, seed=4)
    got, _, _, _ = run_both(s, 0.5)
    for f in FIELDS:
        assert torch.equal(got[f], s[f])


def test_bad_knobs_are_named():
    s = make_state(1, 1, 8, 4, [[8]], 4, 8)
    args = tuple(s[f] for f in FIELDS) + (s["budget"],)
    with pytest.raises(ValueError, match="programs=2 off CUDA"):
        triton_kcenter_compress(*args, recent_ratio=0.5, programs=2)
    for T in (0, 128):  # the list holds programs * (T + 1) <= LIST_SLOTS (128) words
        with pytest.raises(ValueError, match="lookahead must be"):
            triton_kcenter_compress(*args, recent_ratio=0.5, lookahead=T)
    with pytest.raises(ValueError, match="order must be int32"):
        triton_kcenter_compress(*args, recent_ratio=0.5, order=torch.zeros(1, 8, dtype=torch.int64))


def test_keys_reread_every_step():
    """resident=False: the slice's and the list's keys are re-read each step in column chunks (the path of slices
    too large for registers): the same state."""
    s = make_state(1, 2, 40, 5, [[40, 33]], 12, 30, seed=8, integer=True)
    _, _, order, _ = run_both(s, 0.34, lookahead=2, resident=False)
    assert check_order(s, order, 0.34) == 2
