"""kvrewrite::ems_merge against the float64 naive model (tests/kernels/ems_naive.py) and the properties of
docs/contracts/ems.md §6.9 / §9."""
import itertools
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from tests.kernels import ems_naive as N

OPS = torch.ops.kvrewrite
STATE = N.STATE_FIELDS
NEG = -math.inf


def stages(s, bt, l_win, pool, gamma, tau, due=None):
    """ems_score -> ems_partition -> ems_redundancy on s; returns (g, g_pooled, cls, dest, due)."""
    due = torch.ones(s["fill"].shape, dtype=torch.bool) if due is None else due
    budget = torch.tensor([bt, bt + 1])
    g, gp = OPS.ems_score(s["bias"], s["fill"], s["lut"], s["slot_order"], s["s_glo"], s["s_loc_past"],
                          s["s_loc_cur"], s["slot_fill"], due, l_win=l_win, pool=pool)
    cls = OPS.ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, budget, l_win=l_win, gamma=gamma)
    dest = OPS.ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau=tau)
    return g, gp, cls, dest, due


def merge(s, bt, l_win=2, pool=3, gamma=2.0, tau=0.2, due=None):
    g, gp, cls, dest, due = stages(s, bt, l_win, pool, gamma, tau, due)
    s["budget"] = torch.tensor([bt, bt + 1])
    OPS.ems_merge(*(s[f] for f in STATE), g, gp, cls, dest, due, gamma=gamma)
    return cls, dest


def rescore(s, rows, seed):
    """New random scores for every live slot of the state and the same on the naive tokens (matched by position)."""
    g = torch.Generator().manual_seed(seed)
    for b, h in itertools.product(range(s["fill"].shape[0]), range(s["fill"].shape[1])):
        toks = {t.pos: t for e in rows[b][h] for t in e.members}
        for j in range(int(s["slot_fill"][b, h])):
            x = torch.rand(3, generator=g) * torch.tensor([4.0, 1.0, 1.0])
            s["s_glo"][b, h, j], s["s_loc_past"][b, h, j], s["s_loc_cur"][b, h, j] = x
            t = toks[int(s["token_pos"][b, h, j])]
            t.s_glo, t.s_loc_past, t.s_loc_cur = (float(v) for v in x.double())


def grow(s, rows, n, seed, pos0, dup=0.3):
    """Append n fresh tokens (some copies of surviving entries) to the state and the naive rows."""
    fresh = N.random_rows(len(rows), len(rows[0]), n, s["keys"].shape[-1], seed=seed, pos0=pos0, dup=dup)
    B, H = len(rows), len(rows[0])
    k = torch.stack([torch.stack([torch.stack([e.key.float() for e in fresh[b][h]]) for h in range(H)])
                     for b in range(B)])
    r = torch.stack([torch.stack([torch.stack([e.raw.float() for e in fresh[b][h]]) for h in range(H)])
                     for b in range(B)])
    v = torch.stack([torch.stack([torch.stack([e.value.float() for e in fresh[b][h]]) for h in range(H)])
                     for b in range(B)])
    N.append_state(s, k, r, v, list(range(pos0, pos0 + n)))
    for b, h in itertools.product(range(B), range(H)):
        rows[b][h] += fresh[b][h]


def naive_step(rows, bt, l_win, pool, gamma, tau, pos):
    return [[N.compress(r, bt, l_win, pool, gamma, tau, pos)[0] for r in rb] for rb in rows]


@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("gamma,tau", [(2.0, 0.2), (1.5, 0.0), (math.inf, 0.1), (1.0, 0.2), (3.0, 1.0)])
def test_three_rounds_match_naive_model(pos, gamma, tau):
    """Three compressions with appends between: the state equals the naive model's after each (layout, merged
    keys/values/raw keys, key_scale through ||a_j keys[lut_j]|| = n_j, scores), and the invariants hold."""
    bt, l_win = 7, 2
    rows = N.random_rows(2, 2, 14, 8, pads=(0, 3), seed=1, dup=0.3)
    s = N.to_state(rows, 24, 48, pos=pos)
    norms, merged = {}, []
    for rnd in range(3):
        for b, h in itertools.product(range(2), range(2)):
            norms.update({(b, h, t.pos): float(t.k_post.norm()) for e in rows[b][h] for t in e.members})
        cls, dest = merge(s, bt, l_win=l_win, gamma=gamma, tau=tau)
        rows = naive_step(rows, bt, l_win, 3, gamma, tau, pos)
        N.check_invariants(s, l_win=l_win, r_max=N.counts(bt, l_win, gamma)[2], bt=bt)
        N.assert_rows_close(N.from_state(s), rows, rtol=1e-5)
        # ||key_scale_j keys[lut_j]|| == n_j, the token's own key norm
        for b, h in itertools.product(range(2), range(2)):
            for j in range(int(s["slot_fill"][b, h])):
                got = float((s["key_scale"][b, h, j] * s["keys"][b, h, int(s["lut"][b, h, j])]).norm())
                assert got == pytest.approx(norms[(b, h, int(s["token_pos"][b, h, j]))], rel=1e-6)
        merged.append(bool((s["slot_fill"] > s["fill"]).any()))
        if tau == 1 or gamma == 1:  # no TBM or all to the zero class: pure eviction
            assert torch.equal(s["slot_fill"], s["fill"]) and (s["key_scale"] == 1).all()
        grow(s, rows, 6, seed=10 + rnd, pos0=100 + 10 * rnd)
        rescore(s, rows, seed=20 + rnd)
    assert any(merged) == (tau < 1 and gamma > 1)


def test_unmerged_entries_unchanged_bit_for_bit():
    rows = N.random_rows(1, 2, 16, 8, seed=2, dup=0.4)
    rows = naive_step(rows, 7, 2, 3, 2.0, 0.0, "without")  # some entries are merged already (key_scale != 1)
    for b, h in itertools.product(range(1), range(2)):
        rows[b][h] += N.random_rows(1, 1, 8, 8, seed=3 + h, pos0=100, dup=0.3)[0][0]
    s = N.to_state(rows, 24, 48)
    old = {k: v.clone() for k, v in s.items()}
    cls, dest = merge(s, 7, tau=0.5)
    for h in range(2):
        new_idx = 0
        for e in range(int(old["fill"][0, h])):
            if int(cls[0, h, e]) not in (1, 2):
                continue
            merged = bool(((dest[0, h] == e) & (cls[0, h] == 3)).any())
            if not merged:
                for f in ("keys", "values", "raw_keys"):
                    assert torch.equal(s[f][0, h, new_idx], old[f][0, h, e]), (h, e, f)
                lo, n = int(old["entry_start"][0, h, e]), (old["lut"][0, h] == e).sum()
                nlo = int(s["entry_start"][0, h, new_idx])
                assert torch.equal(s["key_scale"][0, h, nlo:nlo + n], old["key_scale"][0, h, lo:lo + n])
            new_idx += 1
    assert (cls == 3).any() and ((dest >= 0) & (cls == 3)).any()


def test_identical_tokens_merge_exactly():
    """A group of identical tokens merges into the centre: every slot's expanded key and value are the original
    ones (up to rounding)."""
    rows = N.random_rows(1, 1, 10, 8, seed=4)
    for i in (1, 2, 3):  # copies of entry 0 with low scores: TBM, merged into entry 0 at tau 0.99
        rows[0][0][i] = N.single(rows[0][0][0].key.float(), rows[0][0][0].raw.float(), rows[0][0][0].value.float(), i,
                                 s_glo=0.0, s_loc_past=0.0, s_loc_cur=0.0)
    rows[0][0][0].members[0].s_glo = 100.0
    s = N.to_state(rows, 12, 12)
    cls, dest = merge(s, 6, pool=1, gamma=2.0, tau=0.99)
    assert dest[0, 0, 1:4].tolist() == [0, 0, 0]
    k = rows[0][0][0].key.float()
    assert torch.allclose(s["keys"][0, 0, 0], k / k.norm(), rtol=1e-6)  # stored: the unit direction
    assert torch.allclose(s["values"][0, 0, 0], rows[0][0][0].value.float(), rtol=1e-6)
    expanded = s["key_scale"][0, 0, :4, None] * s["keys"][0, 0, 0]
    assert torch.allclose(expanded, k.expand(4, -1), rtol=1e-6, atol=1e-6)  # every slot's key: the original one
    assert s["token_pos"][0, 0, :4].tolist() == [0, 1, 2, 3] and s["lut"][0, 0, :4].tolist() == [0] * 4


def test_zero_weight_group_weighs_slot_counts():
    """Scores all 0: the weights fall back to the slot counts (an unweighted mean)."""
    rows = N.random_rows(1, 1, 8, 4, seed=5)
    for e in rows[0][0]:
        t = e.members[0]
        t.s_glo = t.s_loc_past = t.s_loc_cur = 0.0
    s = N.to_state(rows, 8, 16)
    cls, dest = merge(s, 4, l_win=1, pool=1, gamma=2.0, tau=0.0)
    want = naive_step(rows, 4, 1, 1, 2.0, 0.0, "without")
    N.assert_rows_close(N.from_state(s), want)
    groups = [[i for i in range(8) if int(dest[0, 0, i]) == c] for c in range(8) if int(cls[0, 0, c]) == 2]
    big = max(groups, key=len)
    assert len(big) >= 2
    c = big[0]
    new_c = sum(1 for i in range(c) if int(cls[0, 0, i]) in (1, 2))
    mean = torch.stack([rows[0][0][i].value for i in big]).mean(0).float()
    assert torch.allclose(s["values"][0, 0, new_c], mean, rtol=1e-5)


def test_zero_class_frees_its_slots():
    rows = N.random_rows(1, 2, 12, 4, seed=6)
    s = N.to_state(rows, 12, 24)
    cls, dest = merge(s, 5, gamma=2.0, tau=1.0)
    assert (cls == 3).sum() == 2 * 5 and (dest[cls == 3] == -1).all()
    assert s["fill"].tolist() == [[5, 5]] and s["slot_fill"].tolist() == [[5, 5]]
    N.check_invariants(s, l_win=2, bt=5)
    kept = [[i for i in range(12) if int(cls[0, h, i]) in (1, 2)] for h in range(2)]
    for h in range(2):
        assert s["token_pos"][0, h, :5].tolist() == kept[h]


def test_lut_cap_drops_lowest_member_slots():
    """gamma = 1.25: R_max = 10 for Bt 8; the third round must drop member slots (never a head, never the window),
    the lowest pooled first, exactly as the naive model."""
    bt, l_win, gamma = 8, 2, 1.25
    rows = N.random_rows(1, 2, 12, 4, seed=7, dup=0.2)
    s = N.to_state(rows, 24, 48)
    capped = False
    for rnd in range(4):
        g, gp, cls, dest, due = stages(s, bt, l_win, 3, gamma, 0.0)
        live = sum(int(((s["lut"][0, h] >= 0) & (dest[0, h].gather(0, s["lut"][0, h].long().clamp(0)) >= 0)).sum())
                   for h in range(2))
        heads = [{int(s["token_pos"][0, h, int(s["entry_start"][0, h, e])]) for e in range(int(s["fill"][0, h]))
                  if int(cls[0, h, e]) in (1, 2)} for h in range(2)]
        OPS.ems_merge(*(s[f] for f in STATE[:5]), torch.tensor([bt, bt + 1]), *(s[f] for f in STATE[6:]), g, gp, cls,
                      dest, due, gamma=gamma)
        rows = naive_step(rows, bt, l_win, 3, gamma, 0.0, "without")
        N.check_invariants(s, l_win=l_win, r_max=10, bt=bt)
        N.assert_rows_close(N.from_state(s), rows)
        if live > 2 * 10:
            capped = True
            assert s["slot_fill"].tolist() == [[10, 10]]
        for h in range(2):  # every head survives as the first slot of its entry
            assert {int(s["token_pos"][0, h, int(s["entry_start"][0, h, e])]) for e in range(bt)} == heads[h]
        grow(s, rows, 5, seed=30 + rnd, pos0=100 + 10 * rnd)
        rescore(s, rows, seed=40 + rnd)
    assert capped


def test_rows_not_due_untouched_bit_for_bit():
    rows = N.random_rows(2, 2, 12, 4, pads=(0, 2), seed=8, dup=0.3)
    s = N.to_state(rows, 16, 24)
    old = {k: v.clone() for k, v in s.items()}
    due = torch.tensor([[True, False], [False, True]])
    merge(s, 5, tau=0.1, due=due)
    for f in STATE:
        if f == "budget":
            continue
        assert torch.equal(s[f][~due], old[f][~due]), f
    assert s["fill"][due].tolist() == [5, 5]


def test_errors():
    s = N.to_state(N.random_rows(1, 1, 6, 4), 8, 8)
    g, gp, cls, dest, due = stages(s, 4, 1, 1, 2.0, 0.5)
    with pytest.raises(ValueError, match="dest must be torch.int32"):
        OPS.ems_merge(*(s[f] for f in STATE), g, gp, cls, dest.long(), due, gamma=2.0)
    with pytest.raises(ValueError, match="key_scale must be torch.float32"):
        OPS.ems_merge(*(s[f] if f != "key_scale" else s[f].double() for f in STATE), g, gp, cls, dest, due,
                      gamma=2.0)
    with pytest.raises(ValueError, match="raw_keys must be"):
        OPS.ems_merge(*(s[f] if f != "raw_keys" else s[f][:, :, :3] for f in STATE), g, gp, cls, dest, due,
                      gamma=2.0)


def test_opcheck():
    s = N.to_state(N.random_rows(1, 2, 10, 4, seed=9, dup=0.3), 12, 24)
    s["budget"] = torch.tensor([5, 6])
    g, gp, cls, dest, due = stages(s, 5, 2, 3, 2.0, 0.1, torch.tensor([[True, False]]))
    torch.library.opcheck(OPS.ems_merge.default, (*(s[f] for f in STATE), g, gp, cls, dest, due), dict(gamma=2.0))


def hand_state():
    """One row: e0 merged (tokens 0 head, 1, 2), e1 = token 3, e2 merged (tokens 4 head, 6), e3 = token 5."""
    g = torch.Generator().manual_seed(12)
    r = lambda: torch.randn(4, generator=g, dtype=torch.float64)  # noqa: E731
    tok = lambda p: N.Token(p, 1.0 + p / 10)  # noqa: E731
    row = [N.Entry(N._unit(r()), N._unit(r()), r(), [tok(0), tok(1), tok(2)], merged=True),
           N.Entry(r(), r(), r(), [tok(3)]),
           N.Entry(N._unit(r()), N._unit(r()), r(), [tok(4), tok(6)], merged=True),
           N.Entry(r(), r(), r(), [tok(5)])]
    return row, N.to_state([[row]], 6, 8)


def call_merge(s, g, gp, cls, dest, bt, gamma):
    t = lambda x, dt: torch.tensor([[x]], dtype=dt)  # noqa: E731
    s["budget"] = torch.tensor([bt, bt + 1])
    OPS.ems_merge(*(s[f] for f in STATE), t(g, torch.float32), t(gp, torch.float32), t(cls, torch.int32),
                  t(dest, torch.int32), torch.tensor([[True]]), gamma=gamma)


def test_lut_cap_tie_goes_to_the_later_token_never_a_head():
    """e2 merges into e1: 7 live slots, Bt 3, gamma 2: R_max = 3 + 3 = 6, one slot dropped. The head token 0 has
    the lowest pooled score but is never a candidate (nor is the window's token 5); tokens 1 and 4 tie at 1.0 and
    the later one (4) goes."""
    row, s = hand_state()
    slot_gp = [-5.0, 1.0, 2.0, 3.0, 1.0, 2.5, float("-inf"), float("-inf")]  # slots: tokens 0 1 2 | 3 | 4 6 | 5
    call_merge(s, [1.0] * 8, slot_gp, [2, 2, 3, 1, 0, 0], [0, 1, 1, 3, -1, -1], 3, 2.0)
    assert s["slot_fill"].tolist() == [[6]] and s["fill"].tolist() == [[3]]
    assert s["token_pos"][0, 0, :6].tolist() == [0, 1, 2, 3, 6, 5]
    assert s["lut"][0, 0, :6].tolist() == [0, 0, 0, 1, 1, 2]
    assert s["entry_start"][0, 0, :3].tolist() == [0, 3, 5] and s["slot_pos"][0, 0, :3].tolist() == [2, 6, 5]
    assert s["slot_order"][0, 0, :6].tolist() == [0, 1, 2, 3, 5, 4]
    N.check_invariants(s, l_win=1, r_max=6, bt=3)


def test_zero_weights_fall_back_to_slot_counts():
    """Every g 0: the group {e1 (1 slot), e2 (2 slots)} weighs 1 : 2."""
    row, s = hand_state()
    call_merge(s, [0.0] * 8, [0.0] * 6 + [float("-inf")] * 2, [2, 2, 3, 1, 0, 0], [0, 1, 1, 3, -1, -1], 3, 4.0)
    want = (row[1].value + 2 * row[2].value) / 3
    assert torch.allclose(s["values"][0, 0, 1].double(), want, rtol=1e-6)
    assert s["token_pos"][0, 0, :6].tolist() == [0, 1, 2, 3, 4, 6]
