"""kvrewrite::kvmerger_compress against a naive float64 row-by-row Python implementation of its contract (the module
docstring; docs/contracts/kvmerger.md), plus the properties the contract lists."""
import itertools
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels.clustered_attention import reference_clustered_attention

OP = torch.ops.kvrewrite.kvmerger_compress.default
FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "budget", "score", "degree", "deficit")
MUTATED = ("keys", "values", "bias", "slot_pos", "fill", "score", "degree", "deficit")
NEG = -math.inf


def make_state(B, H, C, D, fills, target, threshold, pads=(), run_len=4, noise=0.05, degrees=True, seed=0):
    """Rows of planted runs of near-identical keys (run lengths 1..run_len), random values and scores, degrees 1..3
    (bias log d) or all 1; pads[b] leading padding slots (bias -inf) in batch row b; garbage past the fill."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, C, D, generator=g)
    for b, h in itertools.product(range(B), range(H)):
        j = 0
        while j < C:
            n = int(torch.randint(1, run_len + 1, (1,), generator=g))
            keys[b, h, j:j + n] = keys[b, h, j] + noise * torch.randn(min(n, C - j), D, generator=g)
            j += n
    deg = (torch.randint(1, 4, (B, H, C), generator=g, dtype=torch.int32) if degrees
           else torch.ones(B, H, C, dtype=torch.int32))
    s = {"keys": keys, "values": torch.randn(B, H, C, D, generator=g), "bias": deg.float().log(),
         "slot_pos": (100 + torch.arange(C)).expand(B, H, C).contiguous(), "fill": torch.as_tensor(fills).long(),
         "budget": torch.tensor([target, threshold]), "score": torch.rand(B, H, C, generator=g), "degree": deg,
         "deficit": torch.zeros(B, H, dtype=torch.long)}
    for b, h in itertools.product(range(B), range(H)):
        s["bias"][b, h, int(s["fill"][b, h]):] = NEG
        if b < len(pads):
            s["bias"][b, h, :pads[b]] = NEG
    return s


def clone(s):
    return {k: v.clone() for k, v in s.items()}


def call(s, **opts):
    OP(*(s[f] for f in FIELDS), **opts)


DEFAULTS = dict(recent_ratio=0.34, hh_ratio=0.24, n_sink=0, epsilon=0.75, sigma=5.0, sigma_mode="fixed",
                values_mode="scale", reading="chain", budget_mode="exact")


# -- the naive implementation of the contract ---------------------------------------------------------
def cos64(a, b):
    na, nb = a.norm(), b.norm()
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


def _runs_above(k, eps):
    """Lengths of the maximal runs of the rows of k whose adjacent float64 cosines exceed eps, in order."""
    runs, n = [], 1
    for i in range(len(k) - 1):
        if cos64(k[i], k[i + 1]) > eps:
            n += 1
        else:
            runs.append(n)
            n = 1
    return runs + [n]


def naive_row(K, V, bias, pos, score, deg, fill, Bt, o):
    """[(key, value, bias, slot_pos, score, degree)] the row keeps, in order; float64 Python loops."""
    K, V = K.double(), V.double()
    slots = [j for j in range(fill) if bias[j] > NEG]
    N = len(slots)
    unchanged = [(K[j], V[j], float(bias[j]), int(pos[j]), float(score[j]), int(deg[j])) for j in slots]
    if N <= Bt:
        return unchanged
    n_s = min(o["n_sink"], Bt)
    n_r = min(math.floor(o["recent_ratio"] * Bt), Bt - n_s)
    n_h = min(math.floor(o["hh_ratio"] * Bt), Bt - n_s - n_r)
    prot = set(range(min(n_s, N))) | set(range(max(0, N - n_r), N))
    rest = sorted((r for r in range(N) if r not in prot), key=lambda r: (-float(score[slots[r]]), r))
    prot |= set(rest[:n_h])
    merg = [r not in prot for r in range(N)]
    k = [K[j] for j in slots]
    joinable = [i for i in range(N - 1) if merg[i] and merg[i + 1]]
    c = {i: cos64(k[i], k[i + 1]) for i in joinable}
    by_c = sorted(joinable, key=lambda i: (-c[i], i))
    J = N - Bt
    if len(joinable) < J:
        joined = set(joinable)
    elif o["reading"] == "chain" and o["budget_mode"] == "exact":
        joined = set(by_c[:J])
    elif o["reading"] == "chain":
        joined = {i for i in joinable if c[i] > o["epsilon"]}
        for i in by_c:
            if len(joined) >= J:
                break
            joined.add(i)
    else:
        joined, anchor = set(), None
        for r in range(N - 1, -1, -1):
            if not merg[r]:
                anchor = None
            elif anchor is not None and cos64(k[anchor], k[r]) > o["epsilon"]:
                joined.add(r)
            else:
                anchor = r
        for i in by_c:
            if N - len(joined) <= Bt:
                break
            joined.add(i)
    items, r = [], 0  # lists of ranks: protected slots alone, sets as runs of joined pairs
    while r < N:
        run = [r]
        while r in joined:
            r += 1
            run.append(r)
        items.append(run)
        r += 1
    n_evict = len(items) - Bt
    if n_evict > 0:  # the fallback: the set items with the lowest summed score go, ties the earlier
        sets = [t for t in range(len(items)) if merg[items[t][0]]]
        ssum = {t: sum(float(score[slots[r]]) for r in items[t]) for t in sets}
        gone = set(sorted(sets, key=lambda t: (ssum[t], t))[:n_evict])
        items = [it for t, it in enumerate(items) if t not in gone]
    out = []
    for it in items:
        if len(it) == 1:
            out.append(unchanged[it[0]])
            continue
        js = [slots[r] for r in it]
        p = max(js, key=lambda j: (float(score[j]), -j))
        dist = [float(((K[p] - K[j]) ** 2).sum()) for j in js]
        if o["sigma_mode"] == "fixed":
            sig = o["sigma"]
        elif o["sigma_mode"] == "distance":
            sig = sum(math.sqrt(x) for x in dist) / (math.sqrt(2) * len(js))
        else:
            sig = o["sigma"]
            for _ in range(10):
                sig = sum(math.exp(-x / (2 * sig * sig)) if sig > 0 else 1.0 for x in dist) / (math.sqrt(2) * len(js))
        gs = [math.exp(-x / (2 * sig * sig)) if sig > 0 else 1.0 for x in dist]
        d = [int(deg[j]) for j in js]
        tot = sum(g * di for g, di in zip(gs, d))
        w = [g * di / tot for g, di in zip(gs, d)]
        assert abs(sum(w) - 1) < 1e-12
        kk = sum(wi * K[j] for wi, j in zip(w, js))
        DS = sum(d)
        if o["values_mode"] == "scale":
            vv, bb = DS * sum(wi * V[j] / di for wi, j, di in zip(w, js, d)), 0.0
        else:
            vv, bb = sum(wi * V[j] for wi, j in zip(w, js)), math.log(DS)
        out.append((kk, vv, bb, int(pos[p]), sum(float(score[j]) for j in js), DS))
    return out


def check_against_naive(before, after, o, atol=2e-5):
    B, H = before["fill"].shape
    Bt, thr = (int(x) for x in before["budget"])
    C = before["keys"].shape[2]
    for b, h in itertools.product(range(B), range(H)):
        if int(before["fill"][b, h] + before["deficit"][b, h]) < thr:  # untouched, bit for bit
            assert all(torch.equal(before[f][b, h], after[f][b, h]) for f in MUTATED), (b, h)
            continue
        exp = naive_row(*(before[f][b, h] for f in ("keys", "values", "bias", "slot_pos", "score", "degree")),
                        int(before["fill"][b, h]), Bt, o)
        n = len(exp)
        assert int(after["fill"][b, h]) == n, (b, h)
        n_valid = sum(1 for j in range(int(before["fill"][b, h])) if before["bias"][b, h, j] > NEG)
        assert int(after["deficit"][b, h]) == min(n_valid + int(before["deficit"][b, h]), Bt) - n, (b, h)
        ek, ev, eb, ep, es, ed = zip(*exp)
        torch.testing.assert_close(after["keys"][b, h, :n].double(), torch.stack(ek), atol=atol, rtol=1e-5)
        torch.testing.assert_close(after["values"][b, h, :n].double(), torch.stack(ev), atol=atol, rtol=1e-5)
        for f, want in (("bias", eb), ("score", es)):
            torch.testing.assert_close(after[f][b, h, :n].double(), torch.tensor(want, dtype=torch.double),
                                       atol=atol, rtol=0)
        assert after["slot_pos"][b, h, :n].tolist() == list(ep), (b, h)
        assert after["degree"][b, h, :n].tolist() == list(ed), (b, h)
        # freed slots: bias -inf, score 0, degree 1; keys, values, slot_pos as they were (as evict_by_score)
        assert bool((after["bias"][b, h, n:] == NEG).all() and (after["score"][b, h, n:] == 0).all())
        assert bool((after["degree"][b, h, n:] == 1).all())
        for f in ("keys", "values", "slot_pos"):
            assert torch.equal(after[f][b, h, n:], before[f][b, h, n:]), (f, b, h)
        assert n <= C


@pytest.fixture(scope="module")
def state():
    # rows: due with padding, due, not due (fill 14 < 18), due at the threshold, one row holding <= Bt valid slots
    return make_state(2, 3, 24, 8, [[22, 24, 14], [18, 21, 20]], 10, 18, pads=(0, 11))


@pytest.mark.parametrize("reading,budget_mode", [("chain", "exact"), ("chain", "epsilon"), ("anchor", "exact"),
                                                 ("anchor", "epsilon")])
@pytest.mark.parametrize("sigma_mode,values_mode,n_sink", [("fixed", "scale", 0), ("distance", "bias", 2),
                                                           ("paper", "scale", 1), ("fixed", "bias", 0),
                                                           ("distance", "scale", 0), ("paper", "bias", 3)])
def test_matches_naive(state, reading, budget_mode, sigma_mode, values_mode, n_sink):
    o = dict(DEFAULTS, reading=reading, budget_mode=budget_mode, sigma_mode=sigma_mode, values_mode=values_mode,
             n_sink=n_sink, epsilon=0.5, sigma=0.3 if sigma_mode != "paper" else 5.0)
    after = clone(state)
    call(after, **o)
    check_against_naive(state, after, o)
    Bt = int(state["budget"][0])
    due = state["fill"] + state["deficit"] >= state["budget"][1]
    valid = (state["bias"] > NEG) & (torch.arange(24) < state["fill"][..., None])
    over = due & (valid.sum(-1) > Bt)
    if reading == "chain" and budget_mode == "exact":  # every head holds exactly Bt
        assert bool((after["fill"][over] == Bt).all())
    assert bool((after["fill"][due] <= Bt).all())
    if n_sink == 3:  # P = 8 of Bt = 10: too few joinable pairs, the fallback evicts (test_fallback_...)
        return
    # degree and score conservation over each due row's kept slots
    kept = torch.arange(24) < after["fill"][..., None]
    before_deg = (state["degree"] * valid).sum(-1)
    assert torch.equal((after["degree"] * kept).sum(-1)[due], before_deg[due])
    torch.testing.assert_close((after["score"] * kept).sum(-1)[due], (state["score"] * valid).sum(-1)[due])


def test_epsilon_mode_adapts(state):
    """budget_mode "epsilon" at a low epsilon joins more than needed: heads hold fewer than Bt; "exact" holds Bt."""
    o = dict(DEFAULTS, budget_mode="epsilon", epsilon=-0.5, recent_ratio=0.0, hh_ratio=0.0)
    after = clone(state)
    call(after, **o)
    check_against_naive(state, after, o)
    assert int(after["fill"][0, 0]) < 10
    # the deficit (10 - fill) makes the row due when fill + deficit reaches the threshold, as the host mirror expects
    assert int(after["deficit"][0, 0]) == 10 - int(after["fill"][0, 0]) > 0
    after["budget"].copy_(torch.tensor([10, 10]))  # fill + deficit = 10 >= 10: due (fill alone is not)
    again = clone(after)
    call(again, **o)
    check_against_naive(after, again, o)
    assert int(again["deficit"][0, 0]) == 10 - int(again["fill"][0, 0]) > 0  # the host mirror still says 10


def test_fallback_evicts_lowest_summed_score():
    """Protected heavy hitters split the mergeable slots into runs too short to reach Bt by joins alone."""
    s = make_state(1, 2, 16, 4, [[16, 16]], 4, 16, degrees=False, seed=3)
    s["score"][0, :, 1:12:2] = 10.0  # every other slot a heavy hitter: no two mergeable slots are adjacent
    o = dict(DEFAULTS, recent_ratio=0.0, hh_ratio=0.5)  # H = 2 of Bt = 4
    for reading in ("chain", "anchor"):
        after = clone(s)
        call(after, **dict(o, reading=reading))
        check_against_naive(s, after, dict(o, reading=reading))
        assert after["fill"].tolist() == [[4, 4]]


def test_sets_are_the_maximal_runs():
    """chain/epsilon with J small: the sets are exactly the maximal runs of adjacent pairs with cos > epsilon
    (brute force over the planted runs), nothing protected."""
    s = make_state(1, 2, 20, 16, [[20, 20]], 1, 20, run_len=5, noise=0.01, degrees=False, seed=5)
    o = dict(DEFAULTS, budget_mode="epsilon", epsilon=0.9, recent_ratio=0.0, hh_ratio=0.0)
    after = clone(s)
    call(after, **o)
    for h in range(2):
        runs = _runs_above(s["keys"][0, h].double(), 0.9)
        if len(runs) > 1:  # J = 19 joins would need every pair (Bt = 1): fewer above epsilon -> more joins
            assert int(after["fill"][0, h]) == 1
    # with Bt above the run count, exactly the runs
    s["budget"].copy_(torch.tensor([19, 20]))
    for h in range(2):
        after = clone(s)
        call(after, **o)
        runs = _runs_above(s["keys"][0, h].double(), 0.9)
        assert len(runs) < 19
        assert after["degree"][0, h, :int(after["fill"][0, h])].tolist() == runs


def test_protected_never_merged(state):
    o = dict(DEFAULTS, n_sink=2)
    after = clone(state)
    call(after, **o)
    b, h = 0, 1  # due, 24 valid slots, Bt 10: sinks 2, recent floor(3.4) = 3, heavy floor(2.4) = 2
    n = int(after["fill"][b, h])
    pos = after["slot_pos"][b, h, :n].tolist()
    for p in (100, 101, 121, 122, 123):  # sinks and recent slots, verbatim
        i = pos.index(p)
        assert torch.equal(after["keys"][b, h, i], state["keys"][b, h, p - 100])
        assert int(after["degree"][b, h, i]) == int(state["degree"][b, h, p - 100])
    heavy = sorted(range(2, 21), key=lambda j: -float(state["score"][b, h, j]))[:2]
    for j in heavy:
        assert torch.equal(after["keys"][b, h, pos.index(100 + j)], state["keys"][b, h, j])


@pytest.mark.parametrize("values_mode,factor", [("bias", 1.0), ("scale", None)])
def test_weights_sum_to_one(values_mode, factor):
    """One set whose members share a value (degrees 1): "bias" stores that value, "scale" |S| times it."""
    s = make_state(1, 1, 8, 4, [[8]], 1, 8, degrees=False, seed=7)
    s["values"][:] = torch.tensor([1.0, -2.0, 0.5, 3.0])
    after = clone(s)
    call(after, **dict(DEFAULTS, recent_ratio=0.0, hh_ratio=0.0, values_mode=values_mode, sigma=1.0))
    assert int(after["fill"]) == 1 and int(after["degree"][0, 0, 0]) == 8
    torch.testing.assert_close(after["values"][0, 0, 0], s["values"][0, 0, 0] * (factor or 8.0))


def test_identical_keys_bias_mode_is_exact():
    """Runs of identical keys merged with values="bias": attention over the compressed cache = dense attention."""
    g = torch.Generator().manual_seed(11)
    C, D = 16, 8
    runs = [3, 1, 4, 2, 1, 5]
    base = torch.randn(len(runs), D, generator=g)
    keys = torch.cat([base[i].expand(n, D) for i, n in enumerate(runs)])[None, None].contiguous()
    s = {"keys": keys, "values": torch.randn(1, 1, C, D, generator=g), "bias": torch.zeros(1, 1, C),
         "slot_pos": torch.arange(C).view(1, 1, C).clone(), "fill": torch.tensor([[C]]),
         "deficit": torch.zeros(1, 1, dtype=torch.long),
         "budget": torch.tensor([len(runs), C]), "score": torch.rand(1, 1, C, generator=g),
         "degree": torch.ones(1, 1, C, dtype=torch.int32)}
    after = clone(s)
    call(after, **dict(DEFAULTS, recent_ratio=0.0, hh_ratio=0.0, values_mode="bias"))
    assert after["degree"][0, 0, :len(runs)].tolist() == runs
    q = torch.randn(1, 2, 3, D, generator=g)
    cp = torch.tensor([C, C + 1, C + 2])
    dense = reference_clustered_attention(q, s["keys"], s["values"], s["bias"], s["slot_pos"], cp, 0.3, 0)
    merged = reference_clustered_attention(q, after["keys"], after["values"], after["bias"], after["slot_pos"], cp,
                                           0.3, 0)
    torch.testing.assert_close(merged, dense, atol=1e-5, rtol=1e-5)


def test_left_padding_invariance():
    """A row with 5 leading padding slots ends as the same prompt alone (padding never kept)."""
    s = make_state(2, 2, 24, 8, [[19, 19], [24, 24]], 8, 19, seed=13)
    for f in ("keys", "values", "bias", "slot_pos", "score", "degree"):
        s[f][1, :, 5:] = s[f][0, :, :19]
    s["bias"][1, :, :5] = NEG
    s["fill"][1] = 24
    for reading in ("chain", "anchor"):
        after = clone(s)
        call(after, **dict(DEFAULTS, reading=reading, n_sink=1))
        assert torch.equal(after["fill"][0], after["fill"][1])
        n = int(after["fill"][0, 0])
        for f in ("keys", "values", "bias", "slot_pos", "score", "degree"):
            assert torch.equal(after[f][0, :, :n], after[f][1, :, :n]), f


def test_compacts_when_under_budget(state):
    """A due row with N <= Bt valid slots only packs them (epsilon mode joins nothing there)."""
    s = clone(state)
    s["budget"].copy_(torch.tensor([24, 14]))
    after = clone(s)
    call(after, **dict(DEFAULTS, budget_mode="epsilon", epsilon=-1.0))
    check_against_naive(s, after, dict(DEFAULTS, budget_mode="epsilon", epsilon=-1.0))
    assert int(after["fill"][1, 1]) == 21 - 11


@pytest.mark.parametrize("change,match", [
    ({"score": torch.zeros(1, 1, 8, dtype=torch.float64)}, "score must be torch.float32"),
    ({"degree": torch.ones(1, 1, 8)}, "degree must be torch.int32"),
    ({"degree": torch.ones(1, 1, 7, dtype=torch.int32)}, r"degree must be .*\[1, 1, 8\]"),
    ({"recent_ratio": 0.7, "hh_ratio": 0.5}, "recent_ratio \\+ hh_ratio <= 1"),
    ({"hh_ratio": -0.1}, "recent_ratio and hh_ratio must be in"),
    ({"n_sink": -1}, "n_sink must be >= 0"),
    ({"epsilon": 1.0}, "epsilon must be a cosine threshold"),
    ({"sigma": 0.0}, "sigma must be a finite number > 0"),
    ({"sigma_mode": "mean"}, "sigma_mode must be one of"),
    ({"values_mode": "avg"}, "values_mode must be one of"),
    ({"reading": "greedy"}, "reading must be one of"),
    ({"budget_mode": "adaptive"}, "budget_mode must be one of"),
    ({"fill": torch.zeros(1, 1, dtype=torch.int32)}, "fill must be torch.int64"),
    ({"deficit": torch.zeros(1, 1, dtype=torch.int32)}, r"deficit must be torch.int64 \[B, Hkv\] = \[1, 1\]"),
])
def test_errors(change, match):
    s = make_state(1, 1, 8, 4, [[8]], 4, 8)
    opts = dict(DEFAULTS)
    for k, v in change.items():
        (s if k in s else opts)[k] = v
    with pytest.raises(ValueError, match=match):
        call(s, **opts)
