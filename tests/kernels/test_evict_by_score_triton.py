"""evict_by_score's Triton kernels on the CPU, through Triton's interpreter, against reference_evict_by_score bit for
bit (every state field, NaN payloads included).

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_evict_by_score_triton.py`
(with Triton installed; it is skipped otherwise, e.g. on the CPU CI). The tuning knobs are set small in some cases
(chunks of 8 slots, moves in 4-slot blocks) so that a few dozen slots cross every chunk and block boundary: the
select kernel's chunked passes and carries, the holes and movers passes, several move blocks a row. States come in
temporal order (order all 0) and shuffled (a random layout behind `order`), with the slots past the fill poisoned
(NaN keys and values, garbage positions). The GPU test (test_score_ops_gpu.py) runs the same kernels compiled.
"""
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvrewrite.kernels.evict_by_score import (  # noqa: E402
    _kth_largest, _kth_largest_chunked, reference_evict_by_score, triton_evict_by_score)
from tests.kernels.evict_by_score_naive import same  # noqa: E402
from tests.kernels.test_evict_by_score import FIELDS, append, scored_state, state_args  # noqa: E402

SMALL = dict(select_chunk=8, move_slots=4, move_columns=32)  # many chunks and blocks on a few dozen slots


def poisoned(s):
    """s with the slots past each row's fill poisoned: NaN keys and values, positions -7 (bias -inf stays: the
    state's invariant), so a read of one that the rule does not make shows up."""
    C = s["bias"].shape[-1]
    past = torch.arange(C) >= s["fill"][..., None]
    s["keys"].masked_fill_(past[..., None], math.nan)
    s["values"].masked_fill_(past[..., None], math.nan)
    s["slot_pos"].masked_fill_(past, -7)
    return s


def check(s, settings, **knobs):
    want = {f: t.clone() for f, t in s.items()}
    got = {f: t.clone() for f, t in s.items()}
    reference_evict_by_score(*state_args(want), *settings)
    triton_evict_by_score(*state_args(got), *settings, **knobs)
    bad = [f for f in FIELDS if not same(got[f], want[f])]
    assert not bad, f"{bad} differ from the reference (fill {s['fill'].tolist()} -> {want['fill'].tolist()})"


CASES = [  # B, H, C, D, fills, target, threshold, pads, dtype
    (2, 3, 37, 16, [[37, 30, 9], [33, 37, 29]], 17, 29, [0, 3], torch.bfloat16),  # odd C, rows due and not
    (1, 2, 64, 64, [[64, 50]], 20, 40, [5], torch.float16),
    (2, 1, 45, 128, [[45], [41]], 12, 40, [0, 2], torch.float32),
    (1, 2, 16, 16, [[16, 16]], 12, 16, [9], torch.float32),  # 7 valid <= target: only the padding goes
]
SETTINGS = [  # n_recent, recent_ratio, pool, reset_score: snapkv-like, h2o-like, mixed, all recent (no older kept)
    (3, 0.0, 7, True), (0, 0.5, 1, False), (2, 0.25, 3, False), (50, 0.0, 1, True),
]


@pytest.mark.parametrize("knobs", [{}, SMALL, dict(SMALL, chunked_select=True)], ids=["default", "small", "chunked"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda v: str(v))
@pytest.mark.parametrize("B,H,C,D,fills,target,threshold,pads,dtype", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("shuffled", [False, True], ids=["in_order", "shuffled"])
def test_matches_reference(B, H, C, D, fills, target, threshold, pads, dtype, settings, knobs, shuffled):
    s = scored_state(B, H, C, D, fills, target, threshold, pads=pads, seed=C + D, dtype=dtype, shuffled=shuffled)
    check(poisoned(s), settings, **knobs)


@pytest.mark.parametrize("settings", [(2, 0.0, 3, True), (0, 0.5, 1, False)], ids=lambda v: str(v))
def test_calls_in_a_row_with_appends(settings):
    """Compressions with tokens appended in between, the kernels' state fed back each time: it stays the
    reference's, bit for bit, as the layout drifts from temporal order."""
    got = scored_state(2, 2, 30, 16, [[24, 20], [24, 22]], 10, 20, pads=[0, 3], seed=5, ties=True,
                       dtype=torch.bfloat16)
    want = {f: t.clone() for f, t in got.items()}
    for step in range(3):
        reference_evict_by_score(*state_args(want), *settings)
        triton_evict_by_score(*state_args(got), *settings, **SMALL)
        bad = [f for f in FIELDS if not same(got[f], want[f])]
        assert not bad, f"call {step}: {bad} differ from the reference"
        append([got, want], 12, seed=step)
    assert not bool((got["order"] == 0).all())


@pytest.mark.parametrize("settings", [(0, 0.5, 1, False), (1, 0.0, 3, True), (0, 0.0, 7, False)],
                         ids=lambda v: str(v))
def test_ties_and_padding_inside_rows(settings):
    """Integer scores (many ties at the threshold, to the earlier slot) and padding slots scattered in the rows."""
    s = scored_state(2, 2, 50, 16, [[50, 47], [44, 50]], 20, 44, seed=7, ties=True, shuffled=True)
    g = torch.Generator().manual_seed(8)
    s["bias"].masked_fill_(torch.rand(2, 2, 50, generator=g) < 0.2, -math.inf)
    check(s, settings, **SMALL)


@pytest.mark.parametrize("kind", ["special", "mostly_minus_inf", "all_minus_inf"])
def test_special_scores(kind):
    """NaN, +-inf, -0.0 in the scores. With fewer than B - R older scores above -inf the threshold is -inf, and the
    reference's sort then ranks the row's other slots (recent, padding, past the fill) among the -inf ones."""
    s = scored_state(2, 2, 40, 16, [[40, 38], [36, 40]], 16, 36, pads=[0, 3], seed=9, shuffled=True)
    g = torch.Generator().manual_seed(10)
    if kind == "special":
        values = torch.tensor([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, -math.nan, 2.5])
        s["score"] = values[torch.randint(0, len(values), (2, 2, 40), generator=g)]
    else:
        share = 0.85 if kind == "mostly_minus_inf" else 1.0
        s["score"] = s["score"].masked_fill(torch.rand(2, 2, 40, generator=g) < share, -math.inf)
    s["bias"][0, 0, 7] = -math.inf  # a padding slot among the older ones
    for settings in [(0, 0.5, 1, False), (2, 0.0, 3, False)]:
        check(s, settings, **SMALL)


def test_mostly_padding_and_not_due_limit():
    """Most of a row is padding (more holes than a move block, the row's every kept slot a mover), and a state
    whose budget is the NO_LIMIT default (never due)."""
    s = scored_state(1, 2, 60, 16, [[60, 60]], 10, 50, seed=11)
    s["bias"][0, 0, 3:45] = -math.inf
    check(s, (2, 0.0, 3, False), **SMALL)
    s["budget"].copy_(torch.tensor([2**62, 2**62]))
    check(s, (2, 0.5, 1, True), **SMALL)


def test_ratio_rounding_uses_float64():
    """R = floor(recent_ratio * B) from the float64 product, as the reference computes it: 0.7 * 10 rounds to 7.0
    (exact: 6.99999...; Triton would pass 0.7 as fp32, 0.69999999 * 10 -> 6)."""
    s = scored_state(1, 1, 24, 16, [[24]], 10, 20, seed=12)
    check(s, (0, 0.7, 1, False))


@triton.jit
def _kth_probe(KEYS, OUT, n_old, K, S: tl.constexpr, CH: tl.constexpr, POOLED: tl.constexpr):
    """One row's _kth_largest and _kth_largest_chunked results, (thr, need, n_eq) each, into OUT[0:3] and OUT[3:6]."""
    a, b, c = _kth_largest(KEYS, n_old, K, S, POOLED)
    d, e, f = _kth_largest_chunked(KEYS, n_old, K, S, CH, POOLED)
    tl.store(OUT + 0, a)
    tl.store(OUT + 1, b)
    tl.store(OUT + 2, c)
    tl.store(OUT + 3, d)
    tl.store(OUT + 4, e)
    tl.store(OUT + 5, f)


def _kth_both(keys, n_old, K, S, CH, pooled):
    out = torch.zeros(6, dtype=torch.int32)
    _kth_probe[(1,)](keys, out, n_old, K, S=S, CH=CH, POOLED=pooled)
    return out[:3].tolist(), out[3:].tolist()


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled-keys", "fp32-scores"])
def test_chunked_bisection_matches_the_register_one(pooled):
    """_kth_largest_chunked (EMS's slot table past MAX_SLOTS) gives _kth_largest's (thr, need, n_eq) bit for bit: ties
    at the threshold, -inf's and NaN's among the keys, K past the keys above -inf (thr -inf, where n_eq counts the
    lanes past n_old too), rows shorter and longer than a chunk."""
    g = torch.Generator().manual_seed(3)
    S = 64
    for trial in range(24):
        n_old = int(torch.randint(1, S + 1, (1,), generator=g))
        vals = torch.randint(-4, 5, (S,), generator=g).float()  # many ties
        vals[torch.rand(S, generator=g) < 0.15] = -math.inf
        if trial % 4 == 0:
            vals[torch.rand(S, generator=g) < 0.1] = math.nan
        if pooled:  # int32 keys as the pooled callers store them, -inf's order key the least
            keys = vals.nan_to_num(nan=9.0, neginf=-1e9).to(torch.int32)
            keys[vals == -math.inf] = -2139095041  # _order_key(-inf)
        else:
            keys = vals
        above = int((vals[:n_old] > -math.inf).sum())
        for K in sorted({1, max(1, above // 2), max(1, above), above + 3}):
            for CH in (8, 32):
                reg, chunked = _kth_both(keys, n_old, K, S, CH, pooled)
                assert reg == chunked, (trial, n_old, K, CH, reg, chunked)
