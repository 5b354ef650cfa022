"""ems_partition's Triton kernel on the CPU, through Triton's interpreter, against the reference (exact codes) and
the float64 naive model (tests/kernels/ems_naive.py).

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_ems_partition_triton.py`
(with Triton installed; skipped otherwise). Chunks of 8 entries and a 4-entry window search cross every chunk
boundary; ties are planted (quantised scores) so the cumsum tie ranks carry across chunks.
"""
import itertools
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels._ems_rank_kernels import triton_ems_partition  # noqa: E402
from kvrewrite.kernels.ems_partition import reference_ems_partition  # noqa: E402
from kvrewrite.kernels.ems_score import reference_ems_score  # noqa: E402
from tests.kernels import ems_naive as N  # noqa: E402
from tests.kernels.test_ems_score import merged_rows  # noqa: E402

ARGS = ("bias", "fill", "lut", "slot_order", "s_glo", "s_loc_past", "s_loc_cur", "slot_fill")
SMALL = dict(chunk=8, window_chunk=4)


def both(s, gp, due, bt, l_win, gamma, knobs=SMALL):
    budget = torch.tensor([bt, bt + 1])
    got = triton_ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, budget, l_win, gamma, **knobs)
    want = reference_ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, budget, l_win, gamma)
    assert torch.equal(got, want), (got, want)
    return got


@pytest.mark.parametrize("bt,gamma", [(8, 2.0), (8, 1.0), (8, 1.5), (8, math.inf), (6, 4.0), (30, 2.0), (3, 2.0)])
def test_matches_reference_and_naive(bt, gamma):
    rows = merged_rows(seed=1)
    s = N.to_state(rows, 32, 48)
    due = torch.tensor([[True, True], [True, False]])
    gp = reference_ems_score(*(s[f] for f in ARGS), due, 3, 3)[1]
    cls = both(s, gp, due, bt, 3, gamma)
    for b, h in itertools.product(range(2), range(2)):
        if not due[b, h]:
            assert (cls[b, h] == 0).all()
            continue
        want = N.partition(rows[b][h], N.score(rows[b][h], 3, 3)[1], bt, 3, gamma)
        assert cls[b, h, :len(want)].tolist() == want


@pytest.mark.parametrize("knobs", [SMALL, dict(SMALL, chunked_select=True)], ids=["registers", "chunked"])
@pytest.mark.parametrize("gamma", [1.0, 1.5, math.inf])
def test_planted_ties_and_minus_inf_candidates(gamma, knobs):
    """Ties everywhere and -inf candidates, with the thresholds' bisection in registers and chunked (as rows past
    MAX_ENTRIES run it)."""
    rows = merged_rows(seed=2)
    s = N.to_state(rows, 32, 48)
    due = torch.ones(2, 2, dtype=torch.bool)
    g = torch.Generator().manual_seed(3)
    gp = torch.randint(0, 3, (2, 2, 48), generator=g).float()  # 3 values: ties everywhere
    gp[torch.rand(2, 2, 48, generator=g) < 0.2] = float("-inf")  # candidates ranked at -inf, in entry order
    for bt in (5, 7, 9):
        both(s, gp, due, bt, 2, gamma, knobs)


def test_hand_made_ties():
    """tests/kernels/test_ems_partition.py's hand-made ranking: 1, 2, 4 (2.0), 0, 6 (1.0), 3, 5 (0.5), 7 (-inf)."""
    rows = N.random_rows(1, 1, 10, 4, seed=2)
    s = N.to_state(rows, 12, 12)
    gp = torch.full((1, 1, 12), float("-inf"))
    gp[0, 0, :7] = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0, 0.5, 1.0])
    cls = both(s, gp, torch.ones(1, 1, dtype=torch.bool), 5, 2, 1.5)
    assert cls[0, 0, :10].tolist() == [3, 2, 2, 4, 2, 4, 3, 4, 1, 1]
