"""ems_partition's Triton kernel compiled on CUDA against the reference (on the same GPU): exact codes on fresh
random EMS states (tests/kernels/test_ems_score_gpu.py's `synthetic_state`, g_pooled from the reference ems_score),
with planted ties, candidates at -inf, gamma in {1, 1.5, 4, inf}, budgets below and above the valid count; and the
float64 naive model on a naive-built state."""
import itertools
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import _ems_rank_kernels as kk
from kvrewrite.kernels import ems_partition as op_file
from kvrewrite.kernels.ems_partition import reference_ems_partition
from kvrewrite.kernels.ems_score import reference_ems_score
from tests.kernels import ems_naive as N
from tests.kernels.poisoned import poisoned
from tests.kernels.test_ems_score_gpu import ARGS, synthetic_state

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(kk.triton is None, reason="needs Triton"),
]

FILLS = [[1031, 700, 1031, 0], [990, 1031, 64, 1]]
SLOTS = [[4001, 2100, 1031, 0], [3333, 4100, 100, 1]]


def run_both(s, gp, due, bt, l_win, gamma, **knobs):
    budget = torch.tensor([bt, bt + 1], device="cuda")
    args = (s["bias"], s["fill"], s["entry_start"], gp, due, budget, l_win, gamma)
    got = poisoned(lambda: kk.triton_ems_partition(*args, **knobs), s["bias"].numel() * 4)
    want = reference_ems_partition(*args)
    assert torch.equal(got, want), ((got != want).sum().item(), got[got != want][:8], want[got != want][:8])
    return got


@pytest.mark.parametrize("gamma", [1.0, 1.5, 4.0, math.inf])
@pytest.mark.parametrize("bt", [33, 300, 901, 2000])  # 33: N_imp 1; 2000: V <= Bt in every row
def test_matches_reference(gamma, bt):
    s = synthetic_state(2, 4, 1031, 4111, FILLS, SLOTS, pads=(0, 17), seed=int(bt + 10 * gamma if gamma < 9 else bt))
    due = torch.tensor([[True, False, True, True], [True, True, True, True]], device="cuda")
    gp = reference_ems_score(*(s[f] for f in ARGS), due, 32, 7)[1]
    cls = run_both(s, gp, due, bt, 32, gamma)
    assert (cls[0, 1] == 0).all()
    n = [(cls[0, 0] == c).sum().item() for c in range(5)]
    assert n[1] == 32 and (n[2] == min(bt - 32, 1031 - 32))


@pytest.mark.parametrize("gamma", [1.5, math.inf])
def test_a_row_past_max_entries(gamma):
    """C = 33000 > MAX_ENTRIES (the kernel refused it before stop 41: the op ran its reference): the thresholds'
    bisections chunked, codes equal to the reference's, ties planted."""
    C = kk.MAX_ENTRIES + 232
    s = synthetic_state(1, 2, C, C + 500, [[C, C - 3000]], [[C + 500, C - 2000]], seed=21)
    g = torch.Generator(device="cuda").manual_seed(22)
    gp = torch.randint(0, 9, (1, 2, C + 500), generator=g, device="cuda").float() / 8
    due = torch.ones(1, 2, dtype=torch.bool, device="cuda")
    for bt in (6000, 29000):
        run_both(s, gp, due, bt, 32, gamma)


@pytest.mark.parametrize("gamma", [1.0, 4.0, math.inf])
def test_planted_ties_and_minus_inf(gamma):
    s = synthetic_state(2, 3, 1500, 3000, [[1500, 1200, 999], [1400, 777, 1500]],
                        [[3000, 2000, 999], [2900, 1500, 2500]], pads=(9, 0), seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    gp = torch.randint(0, 5, (2, 3, 3000), generator=g, device="cuda").float() / 4  # 5 values: ties everywhere
    gp[torch.rand(2, 3, 3000, generator=g, device="cuda") < 0.1] = float("-inf")
    due = torch.ones(2, 3, dtype=torch.bool, device="cuda")
    for bt, l_win in itertools.product((40, 500, 1100), (1, 32)):
        run_both(s, gp, due, bt, l_win, gamma)


@pytest.mark.parametrize("chunk,window_chunk", [(64, 8), (256, 64), (4096, 128)])
def test_tuning_knobs_give_the_same_result(chunk, window_chunk):
    s = synthetic_state(1, 3, 777, 2999, [[777, 500, 390]], [[2999, 1200, 390]], pads=(5,), seed=3)
    due = torch.ones(1, 3, dtype=torch.bool, device="cuda")
    gp = reference_ems_score(*(s[f] for f in ARGS), due, 32, 7)[1]
    run_both(s, gp, due, 300, 32, 4.0, chunk=chunk, window_chunk=window_chunk)


def test_matches_the_naive_model():
    from tests.kernels.test_ems_score import merged_rows
    rows = merged_rows(seed=1)
    s = {f: t.cuda() for f, t in N.to_state(rows, 32, 48).items()}
    due = torch.ones(2, 2, dtype=torch.bool, device="cuda")
    gp = reference_ems_score(*(s[f] for f in ARGS), due, 3, 3)[1]
    for bt, gamma in ((8, 2.0), (6, 4.0), (8, math.inf), (30, 2.0)):
        cls = run_both(s, gp, due, bt, 3, gamma)
        for b, h in itertools.product(range(2), range(2)):
            want = N.partition(rows[b][h], N.score(rows[b][h], 3, 3)[1], bt, 3, gamma)
            assert cls[b, h, :len(want)].tolist() == want


def test_score_then_partition_in_a_cuda_graph():
    from kvrewrite.kernels._ems_rank_kernels import triton_ems_score
    s = synthetic_state(2, 2, 900, 3000, [[900, 800], [860, 600]], [[3000, 1900], [2800, 600]], seed=5)
    due = torch.tensor([[True, True], [False, True]], device="cuda")
    budget = torch.tensor([500, 532], device="cuda")
    a = [s[f] for f in ARGS]

    def step():
        gp = triton_ems_score(*a, due, 32, 7)[1]
        return kk.triton_ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, budget, 32, 4.0)
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    s2 = synthetic_state(2, 2, 900, 3000, [[899, 700], [860, 601]], [[2900, 1700], [2800, 601]], pads=(4,), seed=6)
    for f in ARGS + ("entry_start",):
        s[f].copy_(s2[f])
    budget.copy_(torch.tensor([300, 332]))
    graph.replay()
    gp = reference_ems_score(*a, due, 32, 7)[1]
    assert torch.equal(out, reference_ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, budget, 32, 4.0))


def test_the_op_runs_the_kernel_on_cuda(monkeypatch):
    monkeypatch.setattr(op_file, "KERNELS_CHECKED_ON_GPU", True)
    s = synthetic_state(1, 2, 200, 700, [[200, 150]], [[700, 400]], seed=7)
    due = torch.ones(1, 2, dtype=torch.bool, device="cuda")
    gp = reference_ems_score(*(s[f] for f in ARGS), due, 32, 7)[1]
    calls = []
    real = kk.triton_ems_partition
    monkeypatch.setattr(kk, "triton_ems_partition", lambda *a, **k: calls.append(1) or real(*a, **k))
    budget = torch.tensor([100, 101], device="cuda")
    got = torch.ops.kvrewrite.ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, budget, l_win=32,
                                            gamma=4.0)
    want = reference_ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, budget, 32, 4.0)
    assert calls and torch.equal(got, want)
