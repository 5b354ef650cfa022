"""ems_score's Triton kernels on the CPU, through Triton's interpreter: bit for bit against the reference, and
against the float64 naive model (tests/kernels/ems_naive.py).

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_ems_score_triton.py`
(with Triton installed; skipped otherwise). Blocks of 8 slots and a 4-entry window search make the tiny rows cross
every block boundary (the pooling halo, the rank prefix, the alpha partials).
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels._ems_rank_kernels import triton_ems_score  # noqa: E402
from kvrewrite.kernels.ems_score import reference_ems_score  # noqa: E402
from tests.kernels import ems_naive as N  # noqa: E402
from tests.kernels.test_ems_score import merged_rows  # noqa: E402

ARGS = ("bias", "fill", "lut", "slot_order", "s_glo", "s_loc_past", "s_loc_cur", "slot_fill")
SMALL = dict(block=8, window_chunk=4)


def both(s, due, l_win, pool, **knobs):
    a = [s[f] for f in ARGS]
    got = triton_ems_score(*a, due, l_win, pool, **(knobs or SMALL))
    want = reference_ems_score(*a, due, l_win, pool)
    for x, y, name in zip(got, want, ("g", "g_pooled")):
        assert torch.equal(x, y), (name, x, y)
    return got


@pytest.mark.parametrize("pool", [1, 3, 7])
@pytest.mark.parametrize("l_win", [1, 3, 40])  # 40: more than a row's valid entries, all are the window
def test_matches_reference_bitwise_and_naive(pool, l_win):
    rows = merged_rows(seed=pool + l_win)
    s = N.to_state(rows, C=32, R=48)
    due = torch.tensor([[True, True], [False, True]])
    g, gp = both(s, due, l_win, pool)
    for b, h in ((0, 0), (0, 1), (1, 1)):
        want_g, want_gp = N.score(rows[b][h], l_win, pool)
        slot = {int(s["token_pos"][b, h, j]): j for j in range(int(s["slot_fill"][b, h]))}
        for t in (t for e in rows[b][h] if e.valid for t in e.members):
            assert float(g[b, h, slot[t.pos]]) == pytest.approx(want_g[id(t)], rel=1e-6)
            assert float(gp[b, h, slot[t.pos]]) == pytest.approx(want_gp[id(t)], rel=1e-6)
    assert (g[1, 0] == 0).all() and (gp[1, 0] == float("-inf")).all()


def test_empty_rows_zero_sums_and_one_block():
    rows = merged_rows(seed=9)
    s = N.to_state(rows, C=32, R=48)
    for f in ("fill", "slot_fill"):
        s[f][0, 1] = 0  # an empty row
    s["s_glo"][1, 0].zero_()  # sum s_glo = 0: alpha 0
    due = torch.ones(2, 2, dtype=torch.bool)
    both(s, due, 3, 3)
    both(s, due, 3, 7, block=64, window_chunk=64)
