"""ems_merge's Triton kernels on the CPU, through Triton's interpreter (fp32), against the reference and the float64
naive model (tests/kernels/ems_naive.py): three successive merges with appends between, gamma in {1, 1.5 (the cap
drops), 2, inf}, tau in {0, 0.2, 1}, pos with/without, padding, rows not due. Small blocks (8 entries, 16 slots,
4 members per step) make a few dozen entries and slots cross every block boundary.

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_ems_merge_triton.py`
(with Triton installed; skipped otherwise).
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

from kvrewrite.kernels._ems_merge_kernels import triton_ems_merge  # noqa: E402
from kvrewrite.kernels.ems_merge import reference_ems_merge  # noqa: E402
from tests.kernels import ems_naive as N  # noqa: E402
from tests.kernels.test_ems_merge import grow, naive_step, rescore, stages  # noqa: E402

STATE = N.STATE_FIELDS
SMALL = dict(entry_block=8, group_chunk=8, chunk=16, merge_block=4, member_step=4, slot_block=16, move_slots=8,
             move_columns=4)
# the cap's bisection as it runs past MAX_SLOTS slots (keys read from memory in chunks of 16), forced at these sizes
CHUNKED = dict(SMALL, chunked_select=True)
KNOBS = {"registers": SMALL, "chunked": CHUNKED}
EXACT = ("bias", "slot_pos", "fill", "entry_start", "lut", "token_pos", "slot_order", "s_glo", "s_loc_past",
         "s_loc_cur", "slot_fill")


def merge_both(s, bt, l_win, pool, gamma, tau, due=None, knobs=SMALL):
    """Run the stages' references, then the kernel on s and the reference on a copy; returns the copy."""
    g, gp, cls, dest, due = stages(s, bt, l_win, pool, gamma, tau, due)
    s["budget"] = torch.tensor([bt, bt + 1])
    ref = {f: t.clone() for f, t in s.items()}
    old = {f: t.clone() for f, t in s.items()}
    reference_ems_merge(*(ref[f] for f in STATE), g, gp, cls, dest, due, gamma)
    triton_ems_merge(*(s[f] for f in STATE), g, gp, cls, dest, due, gamma, **knobs)
    return ref, old


def compare(s, ref, old):
    """Discrete fields and scores exactly, floats to 1e-6; keys/values/raw_keys of the kept entries [0, fill) only:
    the freed entries' rows are never read (§6.9.6: "left as they are"; the kernels leave them, the reference
    leaves there a merged centre's new row when the centre's old index is freed)."""
    for f in EXACT:
        assert torch.equal(s[f], ref[f]), f
    torch.testing.assert_close(s["key_scale"], ref["key_scale"], rtol=1e-6, atol=1e-6)
    kept = torch.arange(s["keys"].shape[2]) < s["fill"][..., None]
    for f in ("keys", "values", "raw_keys"):
        if s[f].shape[2]:
            torch.testing.assert_close(s[f][kept], ref[f][kept], rtol=1e-6, atol=1e-6, msg=f)
            assert torch.equal(s[f][~kept], old[f][~kept]), f  # freed: as they were


@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("gamma,tau", [(2.0, 0.2), (1.5, 0.0), (math.inf, 0.2), (1.0, 0.2), (4.0, 1.0)])
def test_three_rounds_match_reference_and_naive(pos, gamma, tau):
    bt, l_win = 7, 2
    rows = N.random_rows(2, 2, 14, 8, pads=(0, 3), seed=1, dup=0.3)
    s = N.to_state(rows, 27, 45, pos=pos)
    merged = False
    for rnd in range(3):
        norms = {(b, h, t.pos): float(t.k_post.norm()) for b, h in itertools.product(range(2), range(2))
                 for e in rows[b][h] for t in e.members}
        ref, old = merge_both(s, bt, l_win, 3, gamma, tau)
        compare(s, ref, old)
        rows = naive_step(rows, bt, l_win, 3, gamma, tau, pos)
        N.check_invariants(s, l_win=l_win, r_max=N.counts(bt, l_win, gamma)[2], bt=bt)
        N.assert_rows_close(N.from_state(s), rows, rtol=1e-5)
        for b, h in itertools.product(range(2), range(2)):
            for j in range(int(s["slot_fill"][b, h])):
                got = float((s["key_scale"][b, h, j] * s["keys"][b, h, int(s["lut"][b, h, j])]).norm())
                assert got == pytest.approx(norms[(b, h, int(s["token_pos"][b, h, j]))], rel=1e-6)
        merged |= bool((s["slot_fill"] > s["fill"]).any())
        grow(s, rows, 6, seed=10 + rnd, pos0=100 + 10 * rnd)
        rescore(s, rows, seed=20 + rnd)
    assert merged == (tau < 1 and gamma > 1)


@pytest.mark.parametrize("knobs", KNOBS.values(), ids=KNOBS.keys())
def test_rows_not_due_untouched_and_cap(knobs):
    """Rows not due bit for bit; gamma 1.25 makes the cap drop member slots (the tie rule by the reference), with
    the bisection in registers and chunked."""
    rows = N.random_rows(2, 2, 12, 4, pads=(0, 2), seed=8, dup=0.3)
    s = N.to_state(rows, 16, 24)
    old = {k: v.clone() for k, v in s.items()}
    due = torch.tensor([[True, False], [False, True]])
    ref, _ = merge_both(s, 5, 2, 3, 2.0, 0.1, due=due, knobs=knobs)
    compare(s, ref, old)
    for f in STATE:
        if f != "budget":
            assert torch.equal(s[f][~due], old[f][~due]), f
    bt, l_win, gamma = 8, 2, 1.25
    rows = N.random_rows(1, 2, 12, 4, seed=7, dup=0.2)
    s = N.to_state(rows, 24, 48)
    capped = False
    for rnd in range(4):
        ref, old = merge_both(s, bt, l_win, 3, gamma, 0.0, knobs=knobs)
        compare(s, ref, old)
        rows = naive_step(rows, bt, l_win, 3, gamma, 0.0, "without")
        N.assert_rows_close(N.from_state(s), rows)
        capped |= bool((s["slot_fill"] == 10).all())
        grow(s, rows, 5, seed=30 + rnd, pos0=100 + 10 * rnd)
        rescore(s, rows, seed=40 + rnd)
    assert capped


@pytest.mark.parametrize("knobs", KNOBS.values(), ids=KNOBS.keys())
def test_cap_ties_and_zero_weights(knobs):
    """The hand-made row of test_ems_merge: the cap's tie goes to the later token; zero scores weigh slot counts."""
    from tests.kernels.test_ems_merge import hand_state
    t = lambda x, dt: torch.tensor([[x]], dtype=dt)  # noqa: E731
    for g, gp, gamma in (([1.0] * 8, [-5.0, 1.0, 2.0, 3.0, 1.0, 2.5, -math.inf, -math.inf], 2.0),
                         ([0.0] * 8, [0.0] * 6 + [-math.inf] * 2, 4.0)):
        row, s = hand_state()
        s["budget"] = torch.tensor([3, 4])
        args = (t(g, torch.float32), t(gp, torch.float32), t([2, 2, 3, 1, 0, 0], torch.int32),
                t([0, 1, 1, 3, -1, -1], torch.int32), torch.tensor([[True]]), gamma)
        ref = {f: x.clone() for f, x in s.items()}
        old = {f: x.clone() for f, x in s.items()}
        reference_ems_merge(*(ref[f] for f in STATE), *args)
        triton_ems_merge(*(s[f] for f in STATE), *args, **knobs)
        compare(s, ref, old)
