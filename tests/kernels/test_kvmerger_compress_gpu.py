"""kvmerger_compress's Triton kernels compiled on CUDA, at realistic sizes, against the naive float64 python-loop
implementation of the contract (tests/kernels/kvmerger_naive.py); and a CUDA graph capture replayed on new state and
a new budget (the counts come from the ratios on the device).

The kernels' cosines are fp32 and the naive's float64: on random keys two adjacent-pair cosines within ~1e-7 of each
other at a row's join threshold could rank the other way (about one pair in 1e4 at these sizes: not seen on the
seeds below).
"""
import pytest
import torch

from kvrewrite.kernels import _kvmerger_kernels as kk
from tests.kernels.kvmerger_naive import make_state, naive_kvmerger

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(kk.triton is None, reason="needs Triton"),
]

FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "score", "degree")
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
B, H, C, D = 2, 4, 1031, 128  # C odd: not a power of two
FILLS = [[1031, 900, 1000, 700], [1024, 1030, 650, 990]]  # rows with fill 650, 700 are not due
BUDGET = [256, 800]


def state(dtype, seed, **kw):
    return make_state(B, H, C, D, fills=FILLS, dtype=dtype, seed=seed, runs=40, run_len=8, device="cuda", **kw)


def compare(got, orig, budget, opts):
    want, info = naive_kvmerger(*(orig[f].cpu() for f in FIELDS[:5]), budget.cpu(), orig["score"].cpu(),
                                orig["degree"].cpu(), **opts)
    got = {f: t.cpu() for f, t in got.items()}
    orig = {f: t.cpu() for f, t in orig.items()}
    tol = TOL[orig["keys"].dtype]
    due = orig["fill"] >= budget[1].cpu()
    for f in FIELDS:
        assert torch.equal(got[f][~due], orig[f][~due]), f"{f} changed in a row not due"
    for f in ("fill", "slot_pos", "degree"):
        assert torch.equal(got[f], want[f]), f
    assert torch.equal(torch.isinf(got["bias"]), torch.isinf(want["bias"]))
    fin = ~torch.isinf(want["bias"])
    torch.testing.assert_close(got["bias"][fin], want["bias"][fin], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["score"], want["score"], atol=1e-3, rtol=1e-5)
    for f in ("keys", "values"):
        torch.testing.assert_close(got[f].double(), want[f].double(), atol=tol, rtol=tol, msg=f)
    return info


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("budget_mode", ["exact", "epsilon"])
@pytest.mark.parametrize("sigma_mode,values_mode", [("fixed", "scale"), ("distance", "bias"), ("paper", "scale")])
def test_matches_naive(dtype, budget_mode, sigma_mode, values_mode):
    s = state(dtype, seed=11)
    orig = {f: t.clone() for f, t in s.items()}
    budget = torch.tensor(BUDGET, device="cuda")
    opts = dict(n_sink=2, recent_ratio=0.34, hh_ratio=0.24, epsilon=0.9, sigma_mode=sigma_mode,
                values_mode=values_mode, budget_mode=budget_mode)
    kk.triton_kvmerger_compress(*(s[f] for f in FIELDS[:5]), budget, s["score"], s["degree"], **opts)
    info = compare(s, orig, budget, opts)
    sizes = [len(st) for i in info.values() for st in i["sets"]]
    assert max(sizes) > kk.MEMBER_STEP and any(1 < n <= kk.MEMBER_STEP for n in sizes), "both merge paths"


def test_fallback():
    s = state(torch.bfloat16, seed=12)
    orig = {f: t.clone() for f, t in s.items()}
    budget = torch.tensor([64, 800], device="cuda")
    opts = dict(n_recent=10, n_heavy=50, n_sink=1)
    kk.triton_kvmerger_compress(*(s[f] for f in FIELDS[:5]), budget, s["score"], s["degree"], **opts)
    info = compare(s, orig, budget, opts)
    assert any(i["fallback"] for i in info.values())


def test_a_row_past_max_slots():
    """C = 33000 > MAX_SLOTS (refused before stop 41: the op ran its reference): the kernels' bisections chunked,
    against the naive model."""
    s = make_state(1, 2, 33000, 64, fills=[[32990, 31000]], dtype=torch.bfloat16, seed=13, runs=40, run_len=8,
                   device="cuda")
    orig = {f: t.clone() for f, t in s.items()}
    budget = torch.tensor([6000, 30000], device="cuda")
    opts = dict(n_sink=2, recent_ratio=0.34, hh_ratio=0.24, epsilon=0.9)
    kk.triton_kvmerger_compress(*(s[f] for f in FIELDS[:5]), budget, s["score"], s["degree"], **opts)
    compare(s, orig, budget, opts)
    assert (s["fill"] == 6000).all()


def test_cuda_graph_replay():
    """Captured once at one budget; replayed on new state at another budget: the naive at that budget."""
    budget = torch.tensor(BUDGET, device="cuda")
    opts = dict(recent_ratio=0.34, hh_ratio=0.24)
    static = state(torch.bfloat16, seed=13)
    warm = {f: t.clone() for f, t in static.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels outside the capture
        kk.triton_kvmerger_compress(*(warm[f] for f in FIELDS[:5]), budget, warm["score"], warm["degree"], **opts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kk.triton_kvmerger_compress(*(static[f] for f in FIELDS[:5]), budget, static["score"], static["degree"],
                                    **opts)
    for seed, new_budget in ((14, [300, 800]), (15, [200, 950])):
        fresh = state(torch.bfloat16, seed=seed)
        for f in FIELDS:
            static[f].copy_(fresh[f])
        budget.copy_(torch.tensor(new_budget))
        graph.replay()
        torch.cuda.synchronize()
        compare(static, fresh, budget, opts)


@pytest.mark.parametrize("budget_mode", ["exact", "epsilon"])
def test_anchor_reading(budget_mode):
    s = state(torch.bfloat16, seed=17)
    orig = {f: t.clone() for f, t in s.items()}
    budget = torch.tensor(BUDGET, device="cuda")
    opts = dict(n_sink=1, recent_ratio=0.34, hh_ratio=0.24, epsilon=0.3, reading="anchor", budget_mode=budget_mode,
                values_mode="bias", sigma_mode="distance")
    kk.triton_kvmerger_compress(*(s[f] for f in FIELDS[:5]), budget, s["score"], s["degree"], **opts)
    info = compare(s, orig, budget, opts)
    assert any(len(st) > 1 for i in info.values() for st in i["sets"])
