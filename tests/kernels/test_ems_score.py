"""kvrewrite::ems_score against the float64 naive model (tests/kernels/ems_naive.py) and the properties of
docs/contracts/ems.md §6.6 / §9."""
import math

import pytest
import torch
import torch.nn.functional as F

import kvrewrite  # noqa: F401  (registers the ops)
from tests.kernels import ems_naive as N

OP = torch.ops.kvrewrite.ems_score.default
ARGS = ("bias", "fill", "lut", "slot_order", "s_glo", "s_loc_past", "s_loc_cur", "slot_fill")
NEG = -math.inf


def run(s, due=None, l_win=3, pool=3):
    due = torch.ones(s["fill"].shape, dtype=torch.bool) if due is None else due
    return OP(*(s[f] for f in ARGS), due, l_win=l_win, pool=pool)


def merged_rows(seed=0, pads=(0, 2)):
    """Rows holding merged entries (a naive compression at tau 0) plus 6 fresh tokens, with new random scores."""
    rows = N.random_rows(2, 2, 16, 8, pads=pads, seed=seed, dup=0.2)
    rows = [[N.compress(r, 7, 2, 3, 2.0, 0.0, "without")[0] for r in rb] for rb in rows]
    fresh = N.random_rows(2, 2, 6, 8, seed=seed + 1, pos0=100)
    g = torch.Generator().manual_seed(seed + 2)
    for b in range(2):
        for h in range(2):
            rows[b][h] += fresh[b][h]
            for e in rows[b][h]:
                for t in e.members:
                    t.s_glo, t.s_loc_past, t.s_loc_cur = (float(x) for x in torch.rand(3, generator=g).double())
    return rows


@pytest.mark.parametrize("pool", [1, 3, 7])
def test_matches_naive_model(pool):
    rows = merged_rows()
    s = N.to_state(rows, C=32, R=48)
    g, gp = run(s, pool=pool)
    for b in range(2):
        for h in range(2):
            want_g, want_gp = N.score(rows[b][h], 3, pool)
            slot = {int(s["token_pos"][b, h, j]): j for j in range(int(s["slot_fill"][b, h]))}
            live = [t for e in rows[b][h] if e.valid for t in e.members]
            assert len(live) > 6
            for t in live:
                j = slot[t.pos]
                assert float(g[b, h, j]) == pytest.approx(want_g[id(t)], rel=1e-6)
                assert float(gp[b, h, j]) == pytest.approx(want_gp[id(t)], rel=1e-6)
            dead = [slot[t.pos] for e in rows[b][h] if not e.valid for t in e.members] + \
                list(range(int(s["slot_fill"][b, h]), 48))
            assert (g[b, h, dead] == 0).all() and (gp[b, h, dead] == NEG).all()


def test_alpha_and_g_by_hand():
    """g = max(alpha s_glo, loc), alpha = sum loc / sum s_glo over the live slots; sum s_glo = 0 gives alpha 0."""
    rows = N.random_rows(1, 1, 6, 4, seed=3)
    glo, past, cur = [1.0, 2.0, 0.5, 0.0, 4.0, 0.5], [0.5, 0.0, 0.25, 1.0, 0.0, 0.25], [0.0, 0.5, 0.0, 0.0, 0.25, 0.0]
    for e, a, p, c in zip(rows[0][0], glo, past, cur):
        t = e.members[0]
        t.s_glo, t.s_loc_past, t.s_loc_cur = a, p, c
    s = N.to_state(rows, 8, 8)
    g, _ = run(s, l_win=1, pool=1)
    alpha = sum(past + cur) / sum(glo)  # 3.25 / 8
    want = [max(alpha * a, p + c) for a, p, c in zip(glo, past, cur)]
    assert g[0, 0, :6].tolist() == pytest.approx(want, rel=1e-7)
    s["s_glo"].zero_()
    g, _ = run(s, l_win=1, pool=1)
    assert g[0, 0, :6].tolist() == [p + c for p, c in zip(past, cur)]


def test_pooling_edges_and_window():
    """Pooling over P in token order with zeros counted (count_include_pad, = F.avg_pool1d); the window's slots
    are -inf and never pooled in."""
    rows = N.random_rows(1, 1, 10, 4, seed=4)
    s = N.to_state(rows, 12, 12)
    g, gp = run(s, l_win=3, pool=3)
    P = g[0, 0, :7]
    want = F.avg_pool1d(P.view(1, 1, 7), 3, 1, 1, count_include_pad=True).view(7)
    assert torch.allclose(gp[0, 0, :7], want, rtol=1e-6)
    assert float(gp[0, 0, 0]) == pytest.approx(float(P[0] + P[1]) / 3, rel=1e-7)
    assert (gp[0, 0, 7:] == NEG).all()
    g7, gp7 = run(s, l_win=3, pool=7)
    want7 = F.avg_pool1d(P.view(1, 1, 7), 7, 1, 3, count_include_pad=True).view(7)
    assert torch.allclose(gp7[0, 0, :7], want7, rtol=1e-6)
    _, gp1 = run(s, l_win=3, pool=1)
    assert torch.equal(gp1[0, 0, :7], P)


def test_pooling_follows_token_order_not_slot_order():
    """A merged entry holds slots of scattered positions: neighbours in the pool are neighbours in position."""
    rows = merged_rows(seed=5, pads=())
    s = N.to_state(rows, 32, 48)
    assert any(len(e.members) > 1 for e in rows[0][0])
    _, gp = run(s, l_win=2, pool=3)
    b = h = 0
    order = s["slot_order"][b, h, :int(s["slot_fill"][b, h])].tolist()
    pooled = [j for j in order if gp[b, h, j] > NEG]
    g, _ = run(s, l_win=2, pool=1)
    seq = [float(g[b, h, j]) for j in pooled]
    for i, j in enumerate(pooled):
        nb = sum(seq[k] for k in range(i - 1, i + 2) if 0 <= k < len(seq)) / 3
        assert float(gp[b, h, j]) == pytest.approx(nb, rel=1e-6)


def test_rows_not_due():
    rows = merged_rows(seed=6)
    s = N.to_state(rows, 32, 48)
    due = torch.tensor([[True, False], [False, True]])
    g, gp = run(s, due=due)
    g_all, gp_all = run(s)
    assert torch.equal(g[due], g_all[due]) and torch.equal(gp[due], gp_all[due])
    assert (g[~due] == 0).all() and (gp[~due] == NEG).all()


def test_errors():
    s = N.to_state(N.random_rows(1, 1, 4, 4), 8, 8)
    with pytest.raises(ValueError, match="pool must be an odd"):
        run(s, pool=2)
    with pytest.raises(ValueError, match="l_win"):
        run(s, l_win=0)
    s["s_glo"] = s["s_glo"].double()
    with pytest.raises(ValueError, match="s_glo must be torch.float32"):
        run(s)


def test_opcheck():
    s = N.to_state(merged_rows(seed=7), 32, 48)
    due = torch.tensor([[True, False], [True, True]])
    torch.library.opcheck(OP, (*(s[f] for f in ARGS), due), dict(l_win=2, pool=3))
