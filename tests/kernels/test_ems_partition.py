"""kvrewrite::ems_partition against the float64 naive model (tests/kernels/ems_naive.py) and the properties of
docs/contracts/ems.md §6.7 / §9, plus the batching lemma of §7."""
import itertools
import math
import random

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from tests.kernels import ems_naive as N
from tests.kernels.test_ems_score import merged_rows

OP = torch.ops.kvrewrite.ems_partition.default
SCORE = torch.ops.kvrewrite.ems_score.default
SCORE_ARGS = ("bias", "fill", "lut", "slot_order", "s_glo", "s_loc_past", "s_loc_cur", "slot_fill")


def run(s, bt, l_win=3, pool=3, gamma=2.0, due=None, g_pooled=None):
    due = torch.ones(s["fill"].shape, dtype=torch.bool) if due is None else due
    if g_pooled is None:
        g_pooled = SCORE(*(s[f] for f in SCORE_ARGS), due, l_win=l_win, pool=pool)[1]
    budget = torch.tensor([bt, bt + 1])
    return OP(s["bias"], s["fill"], s["entry_start"], g_pooled, due, budget, l_win=l_win, gamma=gamma)


@pytest.mark.parametrize("bt,gamma", [(8, 2.0), (8, 1.0), (8, 1.5), (8, math.inf), (6, 3.0), (30, 2.0)])
def test_matches_naive_model(bt, gamma):
    rows = merged_rows(seed=1)
    s = N.to_state(rows, 32, 48)
    cls = run(s, bt, gamma=gamma)
    for b, h in itertools.product(range(2), range(2)):
        _, gp = N.score(rows[b][h], 3, 3)
        want = N.partition(rows[b][h], gp, bt, 3, gamma)
        assert cls[b, h, :len(want)].tolist() == want
        assert (cls[b, h, len(want):] == 0).all()
        n = [want.count(c) for c in range(5)]
        assert n[1] == 3
        if bt < 30:
            assert n[2] == bt - 3
            assert n[3] == (n[3] + n[4] if math.isinf(gamma) else min(math.floor((gamma - 1) * bt), n[3] + n[4]))
        else:  # V <= Bt: everything kept
            assert n[3] == n[4] == n[0] == 0


def test_v_at_most_bt_keeps_all_but_padding():
    rows = N.random_rows(2, 1, 10, 4, pads=(0, 3), seed=7)
    s = N.to_state(rows, 12, 12)
    cls = run(s, 10, l_win=2)
    assert cls[0, 0].tolist() == [2] * 8 + [1, 1] + [0, 0]
    assert cls[1, 0].tolist() == [0] * 3 + [2] * 5 + [1, 1] + [0, 0]


def test_ties_go_to_the_earlier_entry():
    rows = N.random_rows(1, 1, 10, 4, seed=2)
    s = N.to_state(rows, 12, 12)
    gp = torch.full((1, 1, 12), float("-inf"))
    gp[0, 0, :7] = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0, 0.5, 1.0])
    cls = run(s, 5, l_win=2, gamma=1.5, g_pooled=gp)  # N_imp 3, N_tbm 2, 2 evicted
    # ranking: 1, 2, 4 (2.0), 0, 6 (1.0), 3, 5 (0.5); the window is entries 8, 9; entry 7 is a candidate at -inf
    assert cls[0, 0, :10].tolist() == [3, 2, 2, 4, 2, 4, 3, 4, 1, 1]


def test_gamma_one_and_inf():
    rows = merged_rows(seed=3)
    s = N.to_state(rows, 32, 48)
    assert not (run(s, 8, gamma=1.0) == 3).any()
    cls = run(s, 8, gamma=math.inf)
    assert not (cls == 4).any() and (cls == 3).any()


def test_rows_not_due_are_free():
    s = N.to_state(merged_rows(seed=4), 32, 48)
    due = torch.tensor([[False, True], [True, False]])
    cls = run(s, 8, due=due)
    assert (cls[~due] == 0).all() and torch.equal(cls[due], run(s, 8)[due])


def test_batching_lemma():
    """Frozen scores: g sequential 'add one candidate, remove the minimum centre' steps leave exactly the top N_imp
    of the union (ties: the earlier entry is the larger), which is what one batched ems_partition keeps."""
    rnd = random.Random(5)
    for trial in range(60):
        n_imp, g = rnd.randint(1, 6), rnd.randint(1, 8)
        n = n_imp + g
        scores = [float(rnd.randint(0, 4)) for _ in range(n)]  # many ties
        better = lambda a, b: (scores[a], -a) > (scores[b], -b)  # noqa: E731
        centres = list(range(n_imp))
        for x in range(n_imp, n):
            centres.append(x)
            worst = centres[0]
            for c in centres[1:]:
                if better(worst, c):
                    worst = c
            centres.remove(worst)
        top = sorted(range(n), key=lambda i: (-scores[i], i))[:n_imp]
        assert sorted(centres) == sorted(top), (trial, scores)
        # the op: n candidates + a 1-token window, Bt = n_imp + 1 (gamma = 1: the rest evicted)
        rows = N.random_rows(1, 1, n + 1, 4, seed=trial)
        s = N.to_state(rows, n + 1, n + 1)
        gp = torch.full((1, 1, n + 1), float("-inf"))
        gp[0, 0, :n] = torch.tensor(scores)
        cls = run(s, n_imp + 1, l_win=1, gamma=1.0, g_pooled=gp)
        assert [i for i in range(n) if cls[0, 0, i] == 2] == sorted(top)


def test_errors():
    s = N.to_state(N.random_rows(1, 1, 4, 4), 8, 8)
    with pytest.raises(ValueError, match="gamma must be"):
        run(s, 3, l_win=1, gamma=0.5)
    with pytest.raises(ValueError, match="entry_start must be torch.int32"):
        s["entry_start"] = s["entry_start"].long()
        run(s, 3, l_win=1)


def test_opcheck():
    s = N.to_state(merged_rows(seed=6), 32, 48)
    due = torch.tensor([[True, False], [True, True]])
    gp = SCORE(*(s[f] for f in SCORE_ARGS), due, l_win=3, pool=3)[1]
    torch.library.opcheck(OP, (s["bias"], s["fill"], s["entry_start"], gp, due, torch.tensor([8, 9])),
                          dict(l_win=3, gamma=2.0))
