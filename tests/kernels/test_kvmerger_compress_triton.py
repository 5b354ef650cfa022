"""kvmerger_compress's Triton kernels on the CPU, through Triton's interpreter, against a naive float64 python-loop
implementation of the contract (tests/kernels/kvmerger_naive.py).

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_kvmerger_compress_triton.py`
(with Triton installed; skipped otherwise). Small tuning knobs (chunks of 8 slots, 4-pair cosine blocks, 4-slot merge
and copy blocks) make a few dozen slots cross every chunk and block boundary; odd C and D.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels._kvmerger_kernels import triton_kvmerger_compress  # noqa: E402
from tests.kernels.kvmerger_naive import make_state, naive_kvmerger  # noqa: E402

SMALL = dict(chunk=8, cos_slots=4, merge_slots=4, copy_slots=4)
FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "score", "degree")
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def run_both(s, budget, opts, knobs=SMALL):
    """(kernel state, naive state, naive info, original state)."""
    orig = {f: t.clone() for f, t in s.items()}
    got = {f: t.clone() for f, t in s.items()}
    triton_kvmerger_compress(*(got[f] for f in FIELDS[:5]), budget, got["score"], got["degree"], **opts, **knobs)
    want, info = naive_kvmerger(*(orig[f] for f in FIELDS[:5]), budget, orig["score"], orig["degree"], **opts)
    return got, want, info, orig


def check(got, want, orig, budget):
    dtype = orig["keys"].dtype
    tol = TOL[dtype]
    due = orig["fill"] >= budget[1]
    for f in FIELDS:  # rows not due: bit for bit
        assert torch.equal(got[f][~due], orig[f][~due]), f"{f} changed in a row not due"
    for f in ("fill", "slot_pos", "degree"):
        assert torch.equal(got[f], want[f]), f"{f}: got {got[f][due]}, want {want[f][due]}"
    assert torch.equal(torch.isinf(got["bias"]), torch.isinf(want["bias"])), "bias -inf pattern"
    fin = ~torch.isinf(want["bias"])
    torch.testing.assert_close(got["bias"][fin], want["bias"][fin], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["score"], want["score"], atol=1e-4, rtol=1e-5)
    for f in ("keys", "values"):
        torch.testing.assert_close(got[f].double(), want[f].double(), atol=tol, rtol=tol, msg=f)


STATE = dict(B=2, H=2, C=37, D=13)
FILLS = [[37, 30], [22, 36]]  # row (1, 0) is below the threshold: not due
BUDGET = torch.tensor([14, 25])


@pytest.mark.parametrize("budget_mode", ["exact", "epsilon"])
@pytest.mark.parametrize("sigma_mode,values_mode", [("fixed", "scale"), ("distance", "bias"), ("paper", "scale"),
                                                    ("fixed", "bias"), ("distance", "scale"), ("paper", "bias")])
def test_matches_naive(budget_mode, sigma_mode, values_mode):
    s = make_state(**STATE, fills=FILLS, seed=1)
    opts = dict(n_recent=3, n_heavy=2, n_sink=1, epsilon=0.9, sigma=0.7, sigma_mode=sigma_mode,
                values_mode=values_mode, budget_mode=budget_mode)
    got, want, info, orig = run_both(s, BUDGET, opts)
    check(got, want, orig, BUDGET)
    assert any(len(st) > 1 for i in info.values() for st in i["sets"]), "no set was merged: the test is too weak"
    for (b, h), i in info.items():  # conservation of degree and score (no fallback eviction here)
        assert not i["fallback"]
        valid = (orig["bias"][b, h] > float("-inf")) & (torch.arange(37) < orig["fill"][b, h])
        assert int(got["degree"][b, h].sum() - (37 - got["fill"][b, h])) == int(orig["degree"][b, h][valid].sum())
        torch.testing.assert_close(got["score"][b, h].sum(), orig["score"][b, h][valid].sum())
    for (b, h), i in info.items():
        if i["N"] > 14:
            if budget_mode == "exact":
                assert int(got["fill"][b, h]) == 14
            else:
                assert int(got["fill"][b, h]) <= 14


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_keys(dtype):
    s = make_state(**STATE, fills=FILLS, dtype=dtype, seed=2)
    opts = dict(n_recent=2, n_heavy=2, epsilon=0.75, sigma=5.0)
    got, want, info, orig = run_both(s, BUDGET, opts)
    check(got, want, orig, BUDGET)


def test_fallback_evicts_lowest_sets():
    """Many protected slots split the runs: fewer joinable pairs than joins; the lowest-score sets go."""
    s = make_state(B=1, H=2, C=29, D=6, fills=[[29, 27]], seed=3, pad_frac=0.0)
    budget = torch.tensor([12, 20])
    opts = dict(n_recent=2, n_heavy=7, n_sink=1)
    got, want, info, orig = run_both(s, budget, opts)
    assert all(i["fallback"] for i in info.values()), "the fallback was not reached: the test is too weak"
    check(got, want, orig, budget)
    assert (got["fill"] == 12).all()


def test_small_budget_all_protected():
    s = make_state(B=1, H=1, C=19, D=5, fills=[[19]], seed=4)
    budget = torch.tensor([4, 10])
    got, want, info, orig = run_both(s, budget, dict(n_recent=2, n_heavy=2))
    check(got, want, orig, budget)


def test_under_budget_only_compacts_and_resets_poison():
    """N <= Bt: padding dropped, order kept, slots past fill (garbage) emptied (bias -inf, degree 1, score 0; keys,
    values and slot_pos are left: an empty slot is never read)."""
    s = make_state(B=1, H=2, C=21, D=7, fills=[[15, 12]], seed=5, pad_frac=0.3)
    budget = torch.tensor([16, 10])
    got, want, info, orig = run_both(s, budget, dict(n_recent=2, n_heavy=2))
    check(got, want, orig, budget)
    for h in range(2):
        n = int(got["fill"][0, h])
        assert (got["bias"][0, h, n:] == float("-inf")).all()
        assert (got["degree"][0, h, n:] == 1).all() and (got["score"][0, h, n:] == 0).all()


def test_ratio_form_equals_counts():
    """R = floor(recent_ratio * Bt) and H = floor(hh_ratio * Bt) computed on the device."""
    s = make_state(**STATE, fills=FILLS, seed=6)
    a = {f: t.clone() for f, t in s.items()}
    b = {f: t.clone() for f, t in s.items()}
    triton_kvmerger_compress(*(a[f] for f in FIELDS[:5]), BUDGET, a["score"], a["degree"], recent_ratio=0.34,
                             hh_ratio=0.24, **SMALL)  # Bt 14: R 4, H 3
    triton_kvmerger_compress(*(b[f] for f in FIELDS[:5]), BUDGET, b["score"], b["degree"], n_recent=4, n_heavy=3,
                             **SMALL)
    for f in FIELDS:
        assert torch.equal(a[f], b[f]), f


def test_padded_row_equals_alone():
    """Left padding: a padded row compresses to the same slots as its prompt alone (degrees, keys...)."""
    s = make_state(B=1, H=1, C=30, D=9, fills=[[30]], seed=7, pad_frac=0.0, left_pad=6)
    alone = {f: t.clone() for f, t in s.items()}
    for f in ("keys", "values", "bias", "slot_pos", "score", "degree"):
        alone[f][0, 0, :24] = s[f][0, 0, 6:].clone()
    alone["fill"][0, 0] = 24
    budget = torch.tensor([10, 20])
    opts = dict(n_recent=2, n_heavy=2)
    triton_kvmerger_compress(*(s[f] for f in FIELDS[:5]), budget, s["score"], s["degree"], **opts, **SMALL)
    triton_kvmerger_compress(*(alone[f] for f in FIELDS[:5]), budget, alone["score"], alone["degree"], **opts, **SMALL)
    n = int(s["fill"][0, 0])
    assert n == int(alone["fill"][0, 0]) == 10
    for f in FIELDS[:4] + FIELDS[5:]:  # the kept slots; past fill only the emptying (keys etc. stay as they were)
        assert torch.equal(s[f][0, 0, :n], alone[f][0, 0, :n]), f
    for f in ("bias", "score", "degree"):
        assert torch.equal(s[f][0, 0, n:], alone[f][0, 0, n:]), f


def test_default_knobs_same_result():
    s = make_state(**STATE, fills=FILLS, seed=8)
    a = {f: t.clone() for f, t in s.items()}
    b = {f: t.clone() for f, t in s.items()}
    opts = dict(n_recent=3, n_heavy=2, sigma_mode="distance")
    triton_kvmerger_compress(*(a[f] for f in FIELDS[:5]), BUDGET, a["score"], a["degree"], **opts, **SMALL)
    triton_kvmerger_compress(*(b[f] for f in FIELDS[:5]), BUDGET, b["score"], b["degree"], **opts)
    for f in FIELDS:
        assert torch.equal(a[f], b[f]), f


def test_identical_keys_sigma_zero():
    """A run of identical keys with sigma_mode "distance" (sigma 0: g = 1, weights = degrees)."""
    s = make_state(B=1, H=1, C=17, D=4, fills=[[17]], seed=9, pad_frac=0.0, runs=0)
    s["keys"][0, 0, 3:9] = s["keys"][0, 0, 3]
    budget = torch.tensor([11, 10])
    got, want, info, orig = run_both(s, budget, dict(n_recent=1, sigma_mode="distance"))
    check(got, want, orig, budget)
    run = orig["keys"][0, 0, 3]
    at = [i for i in range(11) if torch.equal(got["keys"][0, 0, i], run)]
    assert len(at) == 1 and int(got["degree"][0, 0, at[0]]) >= int(orig["degree"][0, 0, 3:9].sum())
    assert not torch.isnan(got["keys"]).any()


@pytest.mark.parametrize("bad,err", [(dict(reading="tree"), ValueError), (dict(sigma_mode="x"), ValueError),
                                     (dict(values_mode="x"), ValueError), (dict(budget_mode="x"), ValueError),
                                     (dict(n_recent=-1), ValueError), (dict(hh_ratio=1.5), ValueError)])
def test_errors(bad, err):
    s = make_state(B=1, H=1, C=8, D=4, fills=[[8]])
    with pytest.raises(err, match="triton_kvmerger_compress"):
        triton_kvmerger_compress(*(s[f] for f in FIELDS[:5]), torch.tensor([4, 4]), s["score"], s["degree"], **bad)
    s["degree"] = s["degree"].long()
    with pytest.raises(ValueError, match="degree"):
        triton_kvmerger_compress(*(s[f] for f in FIELDS[:5]), torch.tensor([4, 4]), s["score"], s["degree"])


def test_epsilon_joins_more_than_needed():
    """budget_mode "epsilon" with a low epsilon: every pair above it joins, heads end below the budget."""
    s = make_state(**STATE, fills=FILLS, seed=10)
    opts = dict(n_recent=2, n_heavy=1, epsilon=0.0, budget_mode="epsilon")
    got, want, info, orig = run_both(s, BUDGET, opts)
    check(got, want, orig, BUDGET)
    due = orig["fill"] >= BUDGET[1]
    assert (got["fill"][due] < 14).any(), "no head went below the budget: the test is too weak"


@pytest.mark.parametrize("budget_mode", ["exact", "epsilon"])
@pytest.mark.parametrize("epsilon,budget,fallback", [(0.9, 14, False), (-0.2, 14, False), (0.9, 8, True)])
def test_anchor_reading(budget_mode, epsilon, budget, fallback):
    """reading "anchor": the backward anchor pass, then the largest boundary cosines, then the fallback."""
    s = make_state(**STATE, fills=FILLS, seed=16)
    b = torch.tensor([budget, 25])
    opts = dict(n_recent=2, n_heavy=2 if budget > 8 else 4, n_sink=1, epsilon=epsilon, reading="anchor",
                budget_mode=budget_mode, sigma_mode="distance", values_mode="bias")
    got, want, info, orig = run_both(s, b, opts)
    check(got, want, orig, b)
    assert any(len(st) > 1 for i in info.values() for st in i["sets"])
    assert any(i["fallback"] for i in info.values()) == fallback
    if epsilon < 0:  # the anchor pass joins more than needed: heads below the budget
        assert (got["fill"][orig["fill"] >= 25] < budget).any()


def test_a_row_past_max_slots():
    """C = 32769 > MAX_SLOTS (the kernels refused it before stop 41): the bisections take their chunked form by
    default and the result is the naive model's."""
    s = make_state(B=1, H=1, C=32769, D=3, fills=[[40]], seed=6)
    budget = torch.tensor([14, 20])
    got, want, info, orig = run_both(s, budget, dict(n_recent=3, n_heavy=2, n_sink=1), knobs={})
    check(got, want, orig, budget)


@pytest.mark.parametrize("sigma_mode,values_mode,seed", [("fixed", "scale", 3), ("distance", "bias", 4),
                                                         ("paper", "scale", 5)])
def test_kernel_matches_the_ops_reference(sigma_mode, values_mode, seed):
    """The op's CUDA path runs these kernels for reading "chain" + budget_mode "exact" (deficit stays 0): they equal
    reference_kvmerger_compress (the CPU path, written separately from the same contract) on the same state,
    given the method's ratios."""
    from kvrewrite.kernels.kvmerger_compress import reference_kvmerger_compress

    s = make_state(**STATE, fills=FILLS, seed=seed)
    opts = dict(n_sink=1, epsilon=0.75, sigma=0.7, sigma_mode=sigma_mode, values_mode=values_mode, reading="chain",
                budget_mode="exact")
    got = {f: t.clone() for f, t in s.items()}
    triton_kvmerger_compress(*(got[f] for f in FIELDS[:5]), BUDGET, got["score"], got["degree"], recent_ratio=0.25,
                             hh_ratio=0.2, **opts, **SMALL)
    want = {f: t.clone() for f, t in s.items()}
    deficit = torch.zeros(2, 2, dtype=torch.int64)
    reference_kvmerger_compress(*(want[f] for f in FIELDS[:5]), BUDGET, want["score"], want["degree"], deficit, 0.25,
                                0.2, opts["n_sink"], opts["epsilon"], opts["sigma"], sigma_mode, values_mode, "chain",
                                "exact")
    assert int(deficit.abs().sum()) == 0
    check(got, want, s, BUDGET)


@pytest.mark.parametrize("sigma_mode,values_mode", [("fixed", "scale"), ("paper", "bias"), ("distance", "scale")])
def test_sets_within_and_over_one_member_tile(sigma_mode, values_mode):
    """The merge launch takes a set of <= MEMBER_STEP members as one register tile and a larger one by a loop over
    member chunks: both against the naive, in one call."""
    from kvrewrite.kernels._kvmerger_kernels import MEMBER_STEP

    s = make_state(1, 2, 61, 13, fills=[[61, 58]], seed=5, pad_frac=0.0, runs=2, run_len=26, noise=0.01)
    budget = torch.tensor([12, 40])
    opts = dict(n_recent=2, n_heavy=1, sigma=0.7, sigma_mode=sigma_mode, values_mode=values_mode)
    got, want, info, orig = run_both(s, budget, opts)
    check(got, want, orig, budget)
    sizes = [len(st) for i in info.values() for st in i["sets"]]
    assert max(sizes) > MEMBER_STEP and any(1 < n <= MEMBER_STEP for n in sizes), sizes


CHUNKED = dict(SMALL, chunked_select=True)  # the bisections as rows past MAX_SLOTS run them, forced at this size


@pytest.mark.parametrize("sigma_mode,values_mode", [("fixed", "scale"), ("paper", "bias")])
def test_chunked_bisections_match_naive(sigma_mode, values_mode):
    """The heavy-hitter, join and fallback selections with _kth_largest_chunked (keys read from memory in chunks of
    8): the naive model's result, as with the bisection in registers."""
    s = make_state(**STATE, fills=FILLS, seed=1)
    opts = dict(n_recent=3, n_heavy=2, n_sink=1, epsilon=0.9, sigma=0.7, sigma_mode=sigma_mode,
                values_mode=values_mode)
    got, want, info, orig = run_both(s, BUDGET, opts, knobs=CHUNKED)
    check(got, want, orig, BUDGET)
    assert any(len(st) > 1 for i in info.values() for st in i["sets"])
    s = make_state(B=1, H=2, C=29, D=6, fills=[[29, 27]], seed=3, pad_frac=0.0)
    budget = torch.tensor([12, 20])
    got, want, info, orig = run_both(s, budget, dict(n_recent=2, n_heavy=7, n_sink=1), knobs=CHUNKED)
    assert all(i["fallback"] for i in info.values())
    check(got, want, orig, budget)
