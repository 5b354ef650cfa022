"""kvrewrite::clustergen_fold against the float64 naive models (tests/kernels/clustergen_naive.py) and the laws of
docs/contracts/clustergen.md §1.6-1.9 / §4. Statistical tests draw over many seeds (the seed kwarg) and over
identical heads (kv_head is in the hash: independent draws of the same row); their seeds are fixed, so they cannot
flake, and their bounds are 5 sigma."""
import itertools
import math

import numpy as np
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels._hash import clustergen_hash24, mix32_tensor
from kvrewrite.kernels.clustergen_fold import MUTATED
from kvrewrite.kernels.kcenter import greedy_kcenter
from kvrewrite.kernels.kmeans_cluster import mix32
from tests.kernels import clustergen_naive as N

OP = torch.ops.kvrewrite.clustergen_fold.default
Z = 5.0  # sigma of the statistical bounds


# -- fixtures ------------------------------------------------------------------------------------------------
def tokens(L, D, rng, dtype=torch.float32, groups=0, spread=0.3):
    """L (key, value) pairs as float64 numpy arrays of dtype-rounded values; keys Gaussian, or around `groups`
    centres 8 apart (groups > 0)."""
    if groups:
        centres = rng.normal(size=(groups, D)) * 8
        keys = centres[rng.integers(0, groups, L)] + spread * rng.normal(size=(L, D))
    else:
        keys = rng.normal(size=(L, D))
    vals = rng.normal(size=(L, D))
    rnd = lambda x: torch.tensor(x).to(dtype).double().numpy()  # noqa: E731
    return rnd(keys), rnd(vals)


def rows_of(p, B, H, keys, vals, pos0=0, delta=None):
    rows = [[N.Row(p, h) for h in range(H)] for _ in range(B)]
    for r in itertools.chain(*rows):
        if delta is not None:
            r.delta = delta
        for n in range(len(keys)):
            r.append(pos0 + n, keys[n], vals[n])
    return rows


def fold(st, p, threshold):
    st["budget"][1] = threshold
    OP(*(st[f] for f in N.STATE), **p.kwargs())


def decode(st, rows, p, keys, vals, pos0):
    """Append the g = len(keys) tokens to every row of the state and of the naive rows, then fold at the due
    threshold n_sink + window + g (the host schedule)."""
    B, H = len(rows), len(rows[0])
    for n, (b, h) in itertools.product(range(len(keys)), itertools.product(range(B), range(H))):
        N.append_state(st, b, h, pos0 + n, keys[n], vals[n])
        rows[b][h].append(pos0 + n, keys[n], vals[n])
    fold(st, p, p.n_sink + p.window + len(keys))


def assert_row(got, want, where):
    assert got.keys() == want.keys(), where
    for k, w in want.items():
        g = got[k]
        if k == "reps":
            assert len(g) == len(w) and all(np.array_equal(a, b) for a, b in zip(g, w)), f"{where}: reps"
        elif k in ("mu", "delta"):
            assert math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-6), f"{where}: {k} {g} != {w}"
        elif k == "bias":
            g, w = np.array(g), np.array(w)
            assert np.array_equal(np.isinf(g), np.isinf(w)) and np.allclose(g[~np.isinf(g)], w[~np.isinf(w)],
                                                                            rtol=1e-5, atol=1e-5), f"{where}: bias"
        else:
            assert g == w, f"{where}: {k} {g} != {w}"


def same_bits(a, b):
    """a and b hold the same bits (NaNs included)."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


def check_all(st, rows, p, where):
    for b, h in itertools.product(range(len(rows)), range(len(rows[0]))):
        assert_row(N.read_row(st, b, h, p), rows[b][h].view(), f"{where} row {(b, h)}")


CASES = {  # name: (Params, dtype, groups, pads, g, decode keys far from the prompt's: new clusters, overflow)
    "gauss-fp32-padded": (N.Params(Bt=15, n_sink=1, window=2, t=2, seed=3, layer=1), torch.float32, 0, (0, 3), 2,
                          False),
    "groups-bf16": (N.Params(Bt=20, n_sink=2, window=3, t=3, value_share=0.4, cluster_target=0.7, seed=9),
                    torch.bfloat16, 4, (2, 0), 3, True),
    "groups-overflow": (N.Params(Bt=12, n_sink=1, window=1, t=2, cluster_target=0.5, seed=5, layer=7),
                        torch.float32, 6, (0, 0), 2, True),
    "no-sink-no-window": (N.Params(Bt=10, n_sink=0, window=0, t=1, value_share=0.3, seed=11), torch.float32, 3,
                          (1, 0), 1, False),
}


# -- exact comparison with the one-shot naive model ---------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_matches_naive_prefill_then_decode_folds(name):
    p, dtype, groups, pads, g, far = CASES[name]
    rng = np.random.default_rng(len(name))
    B, H, D, L = 2, 2, 4, 14
    keys, vals = tokens(L + 5 * g, D, rng, dtype, groups)
    if far:
        keys[L:] = torch.tensor(keys[L:] + 60 * rng.normal(size=(5 * g, D))).to(dtype).double().numpy()
    vals[3] = 0.0  # a zero value: never sampled (w = 0), bias -inf if it were
    rows = [[N.Row(p, h) for h in range(H)] for _ in range(B)]
    for b, h in itertools.product(range(B), range(H)):  # rows differ: each its own slice of the stream
        for n in range(L):
            rows[b][h].append(n, keys[(n + 3 * (2 * b + h)) % L], vals[(n + 3 * (2 * b + h)) % L])
    C = max(pads) + L + p.S
    st = N.to_state(rows, C, D, p.M + 1, pads=pads, dtype=dtype)
    fold(st, p, 0)
    for r in itertools.chain(*rows):
        r.fold_hash()
    check_all(st, rows, p, f"{name} prefill")
    assert int(st["n_clusters"].min()) >= 1
    for step in range(5):  # 5 decode folds of g tokens
        lo = L + step * g
        decode(st, rows, p, keys[lo:lo + g], vals[lo:lo + g], lo)
        for r in itertools.chain(*rows):
            r.fold_hash()
        check_all(st, rows, p, f"{name} decode fold {step}")
    assert (st["fill"] == min(p.n_sink + p.window, L)).all()
    if name == "groups-overflow":
        assert int(st["n_forced"].min()) > 0


def test_all_zero_values_take_the_last_folded_token():
    p = N.Params(Bt=8, n_sink=0, window=1, t=1)
    rng = np.random.default_rng(0)
    keys, vals = tokens(6, 4, rng)
    rows = rows_of(p, 1, 2, keys, vals * 0)
    st = N.to_state(rows, 6 + p.S, 4, p.M)
    fold(st, p, 0)
    for r in itertools.chain(*rows):
        r.fold_hash()
    check_all(st, rows, p, "zero values")
    got = N.read_row(st, 0, 1, p)
    assert got["vsamp"] == [4] * p.s and got["mu"] == 0.0
    assert all(b == -math.inf for b, r in zip(got["bias"], got["role"]) if r == 2)


def test_rows_not_due_untouched_bit_for_bit():
    p = N.Params(Bt=12, n_sink=1, window=2, t=2)
    rng = np.random.default_rng(1)
    keys, vals = tokens(12, 4, rng)
    rows = [[N.Row(p, h) for h in range(3)]]
    for h, n in enumerate((12, 7, 10)):  # fills 14, 9, 12 (2 pads each); threshold 10: row 1 is not due
        for i in range(n):
            rows[0][h].append(i, keys[i], vals[i])
    st = N.to_state(rows, 14 + p.S, 4, p.M, pads=[2])
    st["keys"][0, 1, 9:] = float("nan")  # slots a fold must not read or write
    before = {f: x.clone() for f, x in st.items()}
    fold(st, p, 10)
    for f in N.STATE:
        if f == "budget":
            continue
        assert same_bits(before[f][0, 1], st[f][0, 1]), f"{f} of the row not due changed"
    for h in (0, 2):
        rows[0][h].fold_hash()
        assert_row(N.read_row(st, 0, h, p), rows[0][h].view(), f"due row {h}")


def test_left_padded_row_equals_the_same_tokens_alone():
    p = N.Params(Bt=14, n_sink=2, window=2, t=2, seed=21)
    rng = np.random.default_rng(2)
    keys, vals = tokens(20, 4, rng, groups=3)
    rows = rows_of(p, 2, 2, keys[:12], vals[:12])
    C = 4 + 12 + p.S
    st = N.to_state(rows, C, 4, p.M, pads=[4, 0])
    fold(st, p, 0)
    for step in range(3):
        decode(st, rows, p, keys[12 + 2 * step:14 + 2 * step], vals[12 + 2 * step:14 + 2 * step], 12 + 2 * step)
    n_kept = int(st["fill"][0, 0])
    keep = torch.cat([torch.arange(n_kept), torch.arange(C - p.S, C)])
    for f in N.STATE:
        if f == "budget":
            continue
        a, b = st[f][0], st[f][1]
        if a.dim() >= 2 and a.shape[1] == C:
            a, b = a[:, keep], b[:, keep]
        assert torch.equal(a, b), f"{f}: the padded row differs from the same tokens alone"


# -- invariants -----------------------------------------------------------------------------------------------
def test_overflow_force_assigns_and_counts():
    """6 groups 8 apart, delta preset to 1 (no calibration), M = 2 clusters: keys of the other groups are forced;
    every key is within delta of its leader except the forced ones, and n_forced counts exactly the keys farther
    than delta from every final leader."""
    p = N.Params(Bt=10, n_sink=0, window=1, t=2, value_share=0.5)
    assert p.M == 2
    rng = np.random.default_rng(3)
    keys, vals = tokens(16, 4, rng, groups=6, spread=0.1)
    rows = rows_of(p, 1, 2, keys, vals, delta=1.0)
    st = N.to_state(rows, 16 + p.S, 4, p.M + 1)
    fold(st, p, 0)
    for r in itertools.chain(*rows):
        r.fold_hash()
    check_all(st, rows, p, "overflow")
    r = rows[0][0]
    reps = st["rep"][0, 0, :2].double().numpy()
    far = [min(N.d2(r.key[x], c) for c in reps) > 1.0 for x in range(15)]
    assert sum(far) == int(st["n_forced"][0, 0]) == len(r.forced) > 0
    for x in range(15):
        assert (x in r.forced) or N.d2(r.key[x], r.key[r.reps[r.leader_of[x]]]) <= 1.0


def test_leader_ties_and_the_inclusive_radius():
    """Integer keys (exact distances), delta preset to 2: a key at exactly delta joins (the algorithm's <=), a key
    equidistant from two leaders joins the lower index, a key just beyond opens a cluster."""
    p = N.Params(Bt=12, n_sink=0, window=0, t=1, value_share=0.5)
    xs = [0, 4, 2, 6, 9, 11]  # leaders 0, 4; 2 ties (d^2 = 4 to both); 6 at delta of 4; 9 opens; 11 at delta of 9
    keys = np.array([[x, 0.0] for x in xs])
    rows = rows_of(p, 1, 1, keys, np.ones((6, 2)), delta=2.0)
    st = N.to_state(rows, 6 + p.S, 2, p.M)
    fold(st, p, 0)
    rows[0][0].fold_hash()
    check_all(st, rows, p, "ties")
    assert st["count"][0, 0, :3].tolist() == [2, 2, 2] and int(st["n_clusters"][0, 0]) == 3
    assert st["rep"][0, 0, :3, 0].tolist() == [0.0, 4.0, 9.0]


@pytest.mark.parametrize("seed", range(6))
def test_calibration_radius(seed):
    """First fold: delta = 1.001 r, r the greedy k-center radius with M_target centres (contract §1.6: 2 r would bound the
    clusters by M_target but opened one cluster per head on SmolLM2; r lands near M_target), as in the naive model."""
    rng = np.random.default_rng(seed)
    ct = (0.25, 0.5, 1.0)[seed % 3]
    p = N.Params(Bt=24, n_sink=1, window=1, t=1, value_share=0.25, cluster_target=ct)
    L = 20
    keys, vals = tokens(L, 3, rng, groups=int(rng.integers(2, 9)), spread=float(rng.uniform(0.2, 3)))
    rows = rows_of(p, 1, 1, keys, vals)
    st = N.to_state(rows, L + p.S, 3, p.M)
    fold(st, p, 0)
    nc, delta = int(st["n_clusters"][0, 0]), float(st["delta"][0, 0])
    F = torch.tensor(keys[1:L - 1])[None]
    r = greedy_kcenter(F, torch.ones(1, L - 2, dtype=torch.bool), p.M_target)[1]
    assert delta == float(r[0] * 1.001)
    assert math.isclose(delta, 1.001 * N.greedy_naive(list(keys[1:L - 1]), p.M_target)[1], rel_tol=1e-5)
    assert 1 <= nc <= p.M


def test_few_keys_calibrate_delta_zero():
    p = N.Params(Bt=20, n_sink=1, window=1, t=1, value_share=0.25, cluster_target=1.0)  # M_target = M = 14
    rng = np.random.default_rng(4)
    keys, vals = tokens(8, 3, rng)
    keys[5] = keys[2]  # a duplicate joins its twin's cluster (distance 0 <= 0)
    rows = rows_of(p, 1, 1, keys, vals)
    st = N.to_state(rows, 8 + p.S, 3, p.M)
    fold(st, p, 0)
    assert float(st["delta"][0, 0]) == 0.0 and int(st["n_clusters"][0, 0]) == 5
    assert st["count"][0, 0, :5].tolist() == [1, 2, 1, 1, 1]


# -- laws (statistics over seeds) ----------------------------------------------------------------------------
H_STAT = 8  # identical heads: independent draws of the same row


def sample(p, keys, vals, seeds, L, decode_g=0, delta=None):
    """The state of H_STAT identical rows after a prefill fold of the first L tokens (and, with decode_g, one
    decode fold of the next g), for each seed; yields the state."""
    rows = rows_of(p, 1, H_STAT, keys[:L], vals[:L], delta=delta)
    st0 = N.to_state(rows, L + p.S, keys.shape[1], p.M + 1)
    for seed in seeds:
        ps = N.Params(**{**p.__dict__, "seed": seed})
        st = {f: x.clone() for f, x in st0.items()}
        fold(st, ps, 0)
        if decode_g:
            for h in range(H_STAT):
                for n in range(L, L + decode_g):
                    N.append_state(st, 0, h, n, keys[n], vals[n])
            fold(st, ps, p.n_sink + p.window + decode_g)
        yield st


def within(count, n, prob, z=Z):
    return abs(count - n * prob) <= z * math.sqrt(n * prob * (1 - prob)) + 1


def test_value_slots_law_over_two_folds():
    """Inclusion frequency of token i in a value slot = ||v_i||^2 / mu over every folded token, after a prefill fold
    (tokens 1..6) and a decode fold (7..9); a zero value is never drawn."""
    p = N.Params(Bt=12, n_sink=1, window=1, t=1, value_share=0.5)
    rng = np.random.default_rng(5)
    keys, _ = tokens(11, 4, rng)
    w = np.array([1, 1, 2, 4, 0.5, 3, 0, 6, 1.5, 2.5, 1])
    vals = np.zeros((11, 4))
    vals[:, 0] = np.sqrt(w)
    counts, n = np.zeros(11), 0
    for st in sample(p, keys, vals, range(100), 8, decode_g=3):
        for h in range(H_STAT):
            for x in N.read_row(st, 0, h, p)["vsamp"]:
                counts[x] += 1
                n += 1
    folded = list(range(1, 10))
    mu = w[folded].sum()
    assert counts[0] == counts[10] == 0 and counts[6] == 0
    for i in folded:
        assert within(counts[i], n, w[i] / mu), f"token {i}: {counts[i]} of {n}, expected {n * w[i] / mu:.1f}"


def test_key_samples_law_over_three_folds():
    """Key-sample frequency of member m of cluster i = 1 / n_i, with members from a prefill fold and two decode
    folds (delta preset, two groups)."""
    p = N.Params(Bt=11, n_sink=0, window=1, t=4, value_share=0.25)
    assert p.M == 2
    rng = np.random.default_rng(6)
    A, Bc = rng.normal(size=4) * 8, rng.normal(size=4) * 8
    grp = [0, 1, 0, 0, 1, 0, 1, 0, 0, 1]  # tokens 0..9; token 9 stays in the window
    keys = np.array([(A, Bc)[gi] + 0.1 * rng.normal(size=4) for gi in grp])
    vals = rng.normal(size=(10, 4))
    members = {0: [i for i in range(9) if grp[i] == 0], 1: [i for i in range(9) if grp[i] == 1]}
    counts = {i: np.zeros(10) for i in (0, 1)}
    rows = rows_of(p, 1, H_STAT, keys[:5], vals[:5], delta=1.0)
    st0 = N.to_state(rows, 5 + p.S, 4, p.M)
    n = 0
    for seed in range(100):
        ps = N.Params(**{**p.__dict__, "seed": seed})
        st = {f: x.clone() for f, x in st0.items()}
        fold(st, ps, 0)           # folds 0..3
        for lo, hi in ((5, 8), (8, 10)):
            for h, x in itertools.product(range(H_STAT), range(lo, hi)):
                N.append_state(st, 0, h, x, keys[x], vals[x])
            fold(st, ps, p.window + hi - lo)
        for h in range(H_STAT):
            got = N.read_row(st, 0, h, p)
            assert got["counts"] == [6, 3]
            for i in (0, 1):
                for x in got["ksamp"][i]:
                    counts[i][x] += 1
        n += H_STAT * p.t
    for i in (0, 1):
        assert counts[i].sum() == n
        for x in members[i]:
            assert within(counts[i][x], n, 1 / len(members[i])), f"cluster {i} member {x}: {counts[i][x]} of {n}"


def estimates(st, h, q):
    """(z, tau) of row (0, h): z = sum over value slots of e^{bias + q.k} v, tau = sum over key slots of
    e^{bias + q.k} (float64; the sketch alone)."""
    k, v = st["keys"][0, h].double(), st["values"][0, h].double()
    logit = st["bias"][0, h].double() + k @ q
    e = torch.where(st["bias"][0, h] > -math.inf, logit.exp(), 0.0)
    return ((e * (st["role"][0, h] == 2))[:, None] * v).sum(0), (e * (st["role"][0, h] == 1)).sum()


def test_numerator_and_denominator_unbiased():
    p = N.Params(Bt=8, n_sink=0, window=0, t=1, value_share=0.5)
    rng = np.random.default_rng(7)
    keys, vals = tokens(6, 4, rng)
    vals *= np.array([0.3, 1, 2, 0.5, 1.5, 1])[:, None]  # spread weights
    q = torch.tensor(rng.normal(size=4) * 0.7)
    k, v = torch.tensor(keys), torch.tensor(vals)
    z_true, tau_true = ((k @ q).exp()[:, None] * v).sum(0), (k @ q).exp().sum()
    zs, taus = [], []
    for st in sample(p, keys, vals, range(150), 6, delta=1.5):
        for h in range(H_STAT):
            z, tau = estimates(st, h, q)
            zs.append(z)
            taus.append(tau)
    for name, x, truth in (("z", torch.stack(zs), z_true), ("tau", torch.stack(taus)[:, None], tau_true[None])):
        se = x.std(0) / math.sqrt(len(x))
        dev = ((x.mean(0) - truth) / se).abs()
        assert (dev <= Z).all(), f"{name}: mean off by {dev.tolist()} standard errors"


def rms_error(p, keys, vals, q, seeds, delta, which):
    k, v = torch.tensor(keys), torch.tensor(vals)
    truth = ((k @ q).exp()[:, None] * v).sum(0) if which == "z" else (k @ q).exp().sum()
    err = []
    for st in sample(p, keys, vals, seeds, len(keys), delta=delta):
        for h in range(H_STAT):
            est = estimates(st, h, q)[0 if which == "z" else 1]
            err.append(float((est - truth).square().sum()))
    return math.sqrt(sum(err) / len(err))


def test_error_falls_as_s_and_t_grow():
    """RMS error of z with s = 2 vs s = 8 value samples, and of tau with t = 1 vs t = 4 key samples (one cluster):
    both ratios ~ sqrt(4) = 2 (the bound's 1 / sqrt(s) shape); bounds [1.5, 2.6] are > 5 sigma of the ratio's
    spread over these 800 draws each, and fail for correlated slots (ratio 1)."""
    rng = np.random.default_rng(8)
    keys, vals = tokens(16, 4, rng)
    q = torch.tensor(rng.normal(size=4) * 0.5)
    common = dict(n_sink=0, window=0, value_share=0.5)
    e2 = rms_error(N.Params(Bt=4, t=1, **common), keys, vals, q, range(100), 0.0, "z")   # s = 2
    e8 = rms_error(N.Params(Bt=16, t=1, **common), keys, vals, q, range(100), 0.0, "z")  # s = 8
    assert 1.5 <= e2 / e8 <= 2.6, (e2, e8)
    t1 = rms_error(N.Params(Bt=2, t=1, **common), keys, vals, q, range(100), 100.0, "tau")  # one cluster, t = 1
    t4 = rms_error(N.Params(Bt=8, t=4, **common), keys, vals, q, range(100), 100.0, "tau")  # t = 4
    assert 1.5 <= t1 / t4 <= 2.6, (t1, t4)


def test_batch_fold_has_the_law_of_token_by_token_folds():
    """One batch fold of the prompt (the op, hash uniforms) against Algorithm 1 token by token (naive coins):
    the same leaders, delta and counts exactly; the frequency of every (slot, token) pair within 5 sigma of a
    two-sample test."""
    p = N.Params(Bt=14, n_sink=1, window=1, t=2, value_share=0.5, cluster_target=1.0)
    rng = np.random.default_rng(9)
    L = 10
    keys, vals = tokens(L, 4, rng, groups=3, spread=1.0)
    S = p.M * p.t + p.s
    op_counts, coin_counts = np.zeros((S, L)), np.zeros((S, L))
    runs = 0
    for st in sample(p, keys, vals, range(100), L):
        for h in range(H_STAT):
            got = N.read_row(st, 0, h, p)
            for j, x in enumerate(list(itertools.chain(*got["ksamp"])) + got["vsamp"]):
                op_counts[j if j < len(got["ksamp"]) * p.t else p.M * p.t + j - len(got["ksamp"]) * p.t, x] += 1
            runs += 1
    coins = np.random.default_rng(10)
    for _ in range(runs):
        r = rows_of(p, 1, 1, keys, vals)[0][0]
        r.fold_coins(coins)
        view = r.view()
        for j, x in enumerate(list(itertools.chain(*view["ksamp"])) + view["vsamp"]):
            coin_counts[j if j < len(view["ksamp"]) * p.t else p.M * p.t + j - len(view["ksamp"]) * p.t, x] += 1
    for f in ("n_clusters", "counts", "n_forced", "exact"):
        assert got[f] == view[f], f
    assert all(np.array_equal(a, b) for a, b in zip(got["reps"], view["reps"]))
    assert math.isclose(got["delta"], view["delta"], rel_tol=1e-6)
    assert got["n_clusters"] >= 2
    for j, x in itertools.product(range(S), range(L)):
        a, b = op_counts[j, x] / runs, coin_counts[j, x] / runs
        pool = (a + b) / 2
        assert abs(a - b) <= Z * math.sqrt(pool * (1 - pool) * 2 / runs) + 1e-12, f"slot {j} token {x}: {a} vs {b}"


# -- head_offset (tensor parallelism) ------------------------------------------------------------------------
def test_head_offset_hashes_the_model_layers_heads():
    """A rank's state (the layer's heads [h0:], numbered from 0 there) folded with head_offset = h0 is the full
    state's fold of those heads bit for bit; head_offset = 0 is the default; another offset draws other samples
    (every head holds the same tokens: the head index alone tells their draws apart)."""
    p = N.Params(Bt=12, n_sink=1, window=1, t=2, seed=4, layer=2)
    rng = np.random.default_rng(13)
    keys, vals = tokens(14, 4, rng, groups=3)
    st0 = N.to_state(rows_of(p, 2, 3, keys, vals), 14 + p.S, 4, p.M + 1)
    run = lambda st, **kw: OP(*(st[f] for f in N.STATE), **p.kwargs(**kw))  # noqa: E731
    full, zero, other = ({f: x.clone() for f, x in st0.items()} for _ in range(3))
    run(full)
    run(zero, head_offset=0)
    run(other, head_offset=1)
    for h0 in (1, 2):
        part = {f: x.clone() if f == "budget" else x[:, h0:].contiguous() for f, x in st0.items()}
        run(part, head_offset=h0)
        for f in MUTATED:
            assert same_bits(part[f], full[f][:, h0:]), f"head_offset {h0}: {f}"
    assert all(same_bits(zero[f], full[f]) for f in MUTATED)
    vslot = full["role"] == 2
    assert vslot.any() and not torch.equal(other["slot_pos"][vslot], full["slot_pos"][vslot])


# -- hash, errors, opcheck -----------------------------------------------------------------------------------
def test_mix32_tensor_equals_mix32():
    rng = np.random.default_rng(11)
    xs = [0, 1, 2 ** 16 - 1, 2 ** 16, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 40 + 5, -1, -(2 ** 31), 2 ** 62]
    xs += rng.integers(-(2 ** 62), 2 ** 62, 20000).tolist() + list(range(5000))
    got = mix32_tensor(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [mix32(x) for x in xs]
    heads, seen, j = torch.arange(3)[:, None, None], torch.tensor([0, 7, 2 ** 33])[None, :, None], torch.arange(-2, 9)
    h24 = clustergen_hash24(123456789, 5, heads, seen, j)
    p = N.Params(Bt=1, seed=123456789, layer=5)
    want = [[[N.hash24(p, a, b, c) for c in j.tolist()] for b in seen.flatten().tolist()] for a in range(3)]
    assert h24.tolist() == want


def small_state():
    p = N.Params(Bt=10, n_sink=1, window=1, t=2)
    rng = np.random.default_rng(12)
    keys, vals = tokens(7, 4, rng)
    return p, N.to_state(rows_of(p, 1, 2, keys, vals), 7 + p.S, 4, p.M)


@pytest.mark.parametrize("field,change,match", [
    ("keys", lambda x: x[..., :3], "values must be"),
    ("bias", lambda x: x.double(), "bias must be"),
    ("role", lambda x: x.long(), "role must be"),
    ("rep", lambda x: x.double(), "rep must be"),
    ("count", lambda x: x.long(), "count must be"),
    ("mu", lambda x: x[:, :1], "mu must be"),
    ("delta", lambda x: x.double(), "delta must be"),
    ("n_forced", lambda x: x.int(), "n_forced must be"),
    ("budget", lambda x: x[:1], "budget must be"),
])
def test_bad_fields_are_named(field, change, match):
    p, st = small_state()
    st[field] = change(st[field])
    with pytest.raises(ValueError, match=match):
        OP(*(st[f] for f in N.STATE), **p.kwargs())


@pytest.mark.parametrize("over,match", [
    (dict(t=0), "t must be"), (dict(n_sink=-1), "n_sink must be"), (dict(window=-2), "window must be"),
    (dict(value_share=1.0), "value_share must be"), (dict(cluster_target=0.0), "cluster_target must be"),
    (dict(layer=-1), "layer must be"), (dict(t=9), "M >= 1"), (dict(value_share=0.01), "s >= 1"),
    (dict(head_offset=-1), r"head_offset must be an int in \[0, 2\*\*31\), got -1"),
    (dict(head_offset=2 ** 31), "head_offset must be"),
])
def test_bad_options_are_named(over, match):
    p, st = small_state()
    with pytest.raises(ValueError, match=match):
        OP(*(st[f] for f in N.STATE), **p.kwargs(**over))


def test_state_too_small_is_refused():
    p, st = small_state()
    st["rep"], st["count"] = st["rep"][:, :, :1], st["count"][:, :, :1]
    with pytest.raises(ValueError, match="state is too small"):
        OP(*(st[f] for f in N.STATE), **p.kwargs())
    p, st = small_state()
    st["fill"][0, 1] = st["keys"].shape[2] - p.S + 1
    with pytest.raises(ValueError, match="reaches into the sketch region"):
        OP(*(st[f] for f in N.STATE), **p.kwargs())


def test_opcheck():
    p, st = small_state()
    torch.library.opcheck(OP, tuple(st[f] for f in N.STATE), p.kwargs())


def test_fold_launches_specialise_the_head_dimension():
    """Every Triton launch of the fold lets Triton specialise D (no `do_not_specialize` names it): unspecialised, the
    kernels compiled for any D, with scalar loads and 168-255 registers a thread, 1.9-3.5x slower on an H200
    (docs/bench.md "Stop 63 runs"). Read from the source, so the check runs without Triton."""
    import ast
    import pathlib

    import kvrewrite.kernels._clustergen_fold_kernels as kk

    tree = ast.parse(pathlib.Path(kk.__file__).read_text())
    kernels = {}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_cg_")):
        for dec in fn.decorator_list:
            if (isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "triton_jit"
                    and "D" in [a.arg for a in fn.args.args]):
                names = [ast.literal_eval(kw.value) for kw in dec.keywords if kw.arg == "do_not_specialize"]
                kernels[fn.name] = names[0] if names else []
    assert len(kernels) == 5, sorted(kernels)  # calibration, distances, resolve, reservoirs, pack (split has no D)
    assert not [k for k, names in kernels.items() if "D" in names]


def test_fold_launches_compile_for_hopper_without_spills():
    """The five key-reading launches at their defaults, compiled for sm_90 for the measured layout (bf16, D 128;
    kvrewrite/bench/occupancy.py, no GPU needed): no stack (no spill), and the reservoirs and pack at <= 64 registers
    (40 here; 168 when D was unspecialised). A Triton or launch change that spills fails here."""
    pytest.importorskip("triton")
    from kvrewrite.bench.occupancy import clustergen_fold_resources

    got = clustergen_fold_resources(128, "bf16")
    assert set(got) == {"_cg_calib_kernel", "_cg_dist_kernel", "_cg_resolve_kernel", "_cg_reservoir_kernel",
                        "_cg_pack_kernel"}
    assert all(stack == 0 for _, stack, _ in got.values()), got
    assert got["_cg_reservoir_kernel"][0] <= 64 and got["_cg_pack_kernel"][0] <= 64, got
