"""kvrewrite.kernels.kcenter.greedy_kcenter against the naive float64 greedy and the brute-force k-center optimum
(tests/kernels/clustergen_naive.py; docs/contracts/clustergen.md §1.6, §1.13, §3.3)."""
import math

import numpy as np
import pytest
import torch

from kvrewrite.kernels.kcenter import greedy_kcenter
from tests.kernels import clustergen_naive as N


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equals_naive_greedy(dtype):
    rng = np.random.default_rng(0)
    Nr, P, D = 6, 13, 3
    pts = torch.tensor(rng.normal(size=(Nr, P, D)) * rng.uniform(0.5, 4, size=(Nr, 1, 1))).to(dtype)
    valid = torch.tensor(rng.random((Nr, P)) < 0.7)
    valid[0] = True
    valid[1, :5] = False
    for k in (1, 3, 5, 20):
        order, radius = greedy_kcenter(pts, valid, k)
        assert order.shape == (Nr, min(k, P)) and order.dtype == torch.int64 and radius.dtype == torch.float32
        for n in range(Nr):
            idx = valid[n].nonzero().squeeze(1).tolist()
            want, r = N.greedy_naive([pts[n, i].double().numpy() for i in idx], k)
            got = order[n].tolist()
            assert got[:len(want)] == [idx[i] for i in want] and all(g == -1 for g in got[len(want):]), (n, k)
            assert math.isclose(float(radius[n]), r, rel_tol=1e-5, abs_tol=1e-6), (n, k)


def test_two_approximation_of_the_brute_force_optimum():
    rng = np.random.default_rng(1)
    worst = 0.0
    for trial in range(60):
        P = int(rng.integers(3, 11))
        k = int(rng.integers(1, min(P, 4) + 1))
        pts = rng.normal(size=(P, 2)) * rng.uniform(0.2, 3, size=(P, 1))
        _, r = greedy_kcenter(torch.tensor(pts)[None], torch.ones(1, P, dtype=torch.bool), k)
        opt = N.brute_kcenter(list(pts), k)
        assert opt - 1e-6 <= float(r[0]) <= 2 * opt + 1e-6, (trial, float(r[0]), opt)
        worst = max(worst, float(r[0]) / opt if opt > 0 else 1.0)
    assert worst > 1.05  # the instances are not trivially solved by the greedy (the test could see a bad bound)


def test_ties_go_to_the_lowest_index_and_duplicates():
    pts = torch.tensor([[[0.0], [-1.0], [1.0], [0.0], [1.0]]])
    order, r = greedy_kcenter(pts, torch.ones(1, 5, dtype=torch.bool), 5)
    assert order.tolist() == [[0, 1, 2, 3, 4]] and float(r[0]) == 0.0  # -1 and 1 tie at 1: index 1 first
    order, r = greedy_kcenter(pts, torch.ones(1, 5, dtype=torch.bool), 2)
    assert order.tolist() == [[0, 1]] and float(r[0]) == 1.0


def test_tensor_k_per_row_and_k_max():
    rng = np.random.default_rng(2)
    pts = torch.tensor(rng.normal(size=(3, 8, 2)), dtype=torch.float32)
    valid = torch.ones(3, 8, dtype=torch.bool)
    valid[2] = False  # no valid point: no centre, radius 0
    k = torch.tensor([2, 5, 3])
    order, radius = greedy_kcenter(pts, valid, k, k_max=6)
    assert order.shape == (3, 6)
    for n, kn in enumerate((2, 5)):
        o, r = greedy_kcenter(pts[n:n + 1], valid[n:n + 1], kn)
        assert order[n].tolist() == o[0].tolist() + [-1] * (6 - kn) and float(radius[n]) == float(r[0])
    assert order[2].tolist() == [-1] * 6 and float(radius[2]) == 0.0
    assert greedy_kcenter(pts, valid, k)[0].shape == (3, 8)  # default k_max: P
    assert math.isinf(float(greedy_kcenter(pts, valid, 0)[1][0]))


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), 1), "points must be"),
    ((torch.zeros(2, 3, 1), torch.ones(2, 3), 1), "valid must be"),
    ((torch.zeros(2, 3, 1), torch.ones(2, 3, dtype=torch.bool), torch.ones(3, dtype=torch.int64)), "tensor k must"),
    ((torch.zeros(2, 3, 1), torch.ones(2, 3, dtype=torch.bool), -1), "must be >= 0"),
])
def test_bad_inputs_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        greedy_kcenter(*args)
