"""kvrewrite::kmeans_cluster on the CPU (the reference) against a naive float64 k-means written here in plain loops
from the spec, and the properties of the CSR index it writes.

Keys are "planted" (plant()): each due row's points get random unit directions, one per cluster, times random norms
plus small noise, and the spec's initial points get distinct directions: labels are then unambiguous (cosines ~1
against the own direction, well below against the others), so labels, sizes, starts and members must match exactly
and centroids within the dtype's rounding. One unplanted fp32 case runs real k-means dynamics.
"""
import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from kvrewrite.kernels import kmeans_cluster as km

OP = torch.ops.kvrewrite.kmeans_cluster.default
BASE = ("keys", "values", "bias", "slot_pos", "fill", "budget")
METHOD = ("centroids", "cluster_size", "cluster_start", "members", "n_clusters", "cluster_end")
FIELDS = BASE + METHOD
NO_LIMIT = 2**62
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}  # one rounding of the mean, the sum order aside


@dataclass(frozen=True)
class Args:
    n_sink: int = 2
    tokens_per_cluster: int = 6
    window: int = 8
    window_clusters: int = 3
    iters: int = 4
    seed: int = 0

    def kwargs(self):
        return dict(n_sink=self.n_sink, tokens_per_cluster=self.tokens_per_cluster, window=self.window,
                    window_clusters=self.window_clusters, iters=self.iters, seed=self.seed)


def make_state(B, H, C, D, K, fills, pads=None, threshold=None, dtype=torch.float32, seed=0):
    """Random keys, rows [pad_b, fill) valid (bias 0; left padding -inf), a fresh cluster index (the method's
    reset values), budget threshold = the smallest fill unless given."""
    g = torch.Generator().manual_seed(seed)
    fill = torch.tensor(fills, dtype=torch.int64).reshape(B, H)
    bias = torch.full((B, H, C), -math.inf)
    for b in range(B):
        for h in range(H):
            bias[b, h, (pads[b] if pads else 0):int(fill[b, h])] = 0.0
    return dict(
        keys=torch.randn(B, H, C, D, generator=g).to(dtype), values=torch.randn(B, H, C, D, generator=g).to(dtype),
        bias=bias, slot_pos=torch.arange(C).expand(B, H, C).clone(), fill=fill,
        budget=torch.tensor([NO_LIMIT, int(fill.min()) if threshold is None else threshold]),
        centroids=torch.zeros(B, H, K, D, dtype=dtype), cluster_size=torch.zeros(B, H, K, dtype=torch.int32),
        cluster_start=torch.zeros(B, H, K, dtype=torch.int32), members=torch.full((B, H, C), -1, dtype=torch.int32),
        n_clusters=torch.zeros(B, H, dtype=torch.int32), cluster_end=torch.zeros(B, H, dtype=torch.int64))


def call(s, a: Args, **kw):
    OP(*(s[f] for f in FIELDS), **a.kwargs(), **kw)


def clone(s):
    return {f: t.clone() for f, t in s.items()}


# -- the spec in plain Python ----------------------------------------------------------------------------
def naive_mix32(x):
    x %= 2**32
    x ^= x >> 16
    x = x * 0x7FEB352D % 2**32
    x ^= x >> 15
    x = x * 0x846CA68B % 2**32
    return x ^ (x >> 16)


def naive_init(L, n, seed, h, offset):
    mix = naive_mix32
    r = [mix(mix(mix(mix(seed % 2**32) ^ h) ^ offset) ^ k) for k in range(n)]
    lo = [k * L // n for k in range(n + 1)]
    return [lo[k] + r[k] % (lo[k + 1] - lo[k]) for k in range(n)]


def plan(s, a: Args, clamp=False):
    """{(b, h): (prefill, sinks, points, n, offset)} of the rows due, by the spec's rule."""
    out = {}
    B, H, C, _ = s["keys"].shape
    K = s["centroids"].shape[2]
    for b in range(B):
        for h in range(H):
            f, ce, nc = int(s["fill"][b, h]), int(s["cluster_end"][b, h]), int(s["n_clusters"][b, h])
            pre = ce == 0
            if f < int(s["budget"][1]) or not (pre or f - ce >= a.window):
                continue
            valid = [j for j in range(0 if pre else ce, min(f, C)) if s["bias"][b, h, j] > -math.inf]
            sinks, points = (valid[:a.n_sink], valid[a.n_sink:]) if pre else ([], valid)
            L = len(points)
            n = -(-L // a.tokens_per_cluster) if pre else min(a.window_clusters, L)
            if clamp:
                n = max(0, min(n, K - nc))
            out[b, h] = (pre, sinks, points, n, int(s["cluster_size"][b, h, :nc].sum()))
    return out


def plant(s, a: Args, seed=1, noise=0.02, clamp=False, head_offset=0) -> Args:
    """Well-separated keys for the points of every due row (module docstring), one direction per initial point
    (distinct: one per stratum; of the op called with head_offset); returns `a`."""
    g = torch.Generator().manual_seed(seed)
    D = s["keys"].shape[3]
    rows = plan(s, a, clamp)
    for (b, h), (_, _, points, n, offset) in rows.items():
        if n == 0:
            continue
        L = len(points)
        dirs = F.normalize(torch.randn(n, D, generator=g), dim=-1)
        label = torch.randint(0, n, (L,), generator=g)
        label[naive_init(L, n, a.seed, head_offset + h, offset)] = torch.arange(n)
        norm = 0.5 + 1.5 * torch.rand(L, 1, generator=g)
        x = norm * (dirs[label] + noise * torch.randn(L, D, generator=g))
        s["keys"][b, h, points] = x.to(s["keys"].dtype)
    return a


def naive_kmeans(x, init, iters, dtype):
    """Float64 k-means of the points x [L, D] (exact values of the keys): plain loops, centroids rounded to dtype
    after each update. Returns (centroids [n, D] float64, labels)."""
    cent = [x[i].clone() for i in init]

    def assign():
        labels = []
        for xi in x:
            best, lab = -math.inf, 0
            for k, c in enumerate(cent):
                score = float(xi @ c) / (float(c.norm()) + 1e-8)
                if score > best:
                    best, lab = score, k
            labels.append(lab)
        return labels

    for _ in range(iters):
        labels = assign()
        for k in range(len(cent)):
            mine = [x[i] for i in range(len(x)) if labels[i] == k]
            if mine:
                cent[k] = (sum(mine) / len(mine)).to(dtype).double()
    return torch.stack(cent) if cent else x[:0], assign()


def expected(s, a: Args, clamp=False):
    """The state after the op, by the naive k-means (rows not due unchanged)."""
    want = clone(s)
    for (b, h), (pre, sinks, points, n, offset) in plan(s, a, clamp).items():
        nc = int(s["n_clusters"][b, h])
        if pre:
            want["members"][b, h, :a.n_sink] = torch.tensor(sinks + [-1] * (a.n_sink - len(sinks)))
        if n > 0:
            x = s["keys"][b, h, points].double()
            cent, labels = naive_kmeans(x, naive_init(len(points), n, a.seed, h, offset), a.iters, s["keys"].dtype)
            pos = a.n_sink + offset
            for k in range(n):
                mine = [points[i] for i in range(len(points)) if labels[i] == k]
                want["centroids"][b, h, nc + k] = cent[k].to(s["keys"].dtype)
                want["cluster_size"][b, h, nc + k] = len(mine)
                want["cluster_start"][b, h, nc + k] = pos
                want["members"][b, h, pos:pos + len(mine)] = torch.tensor(mine, dtype=torch.int32)
                pos += len(mine)
        want["n_clusters"][b, h] = nc + n
        want["cluster_end"][b, h] = s["fill"][b, h]
    return want


def want_labels(state, b, h):
    """The label of every clustered slot of row (b, h), in slot order, read off the CSR index."""
    label = {}
    for k in range(int(state["n_clusters"][b, h])):
        start, size = int(state["cluster_start"][b, h, k]), int(state["cluster_size"][b, h, k])
        label.update({int(j): k for j in state["members"][b, h, start:start + size]})
    return [label[j] for j in sorted(label)]


def assert_state(got, want, dtype, what=""):
    for f in FIELDS:
        if f == "centroids":
            torch.testing.assert_close(got[f], want[f], **TOL[dtype], msg=lambda m: f"{what} centroids: {m}")
        else:
            assert torch.equal(got[f], want[f]), f"{what}: {f} differs\n got {got[f]}\nwant {want[f]}"


def append_tokens(s, m, seed):
    """m decode tokens appended to every row (random keys; planted later)."""
    g = torch.Generator().manual_seed(seed)
    B, H, C, D = s["keys"].shape
    for b in range(B):
        for h in range(H):
            f = int(s["fill"][b, h])
            s["keys"][b, h, f:f + m] = torch.randn(m, D, generator=g).to(s["keys"].dtype)
            s["bias"][b, h, f:f + m] = 0.0
    s["fill"] += m


# -- tests -----------------------------------------------------------------------------------------------
CASES = [  # B, H, C, D, K, fills, pads, threshold, dtype
    (1, 1, 40, 16, 12, [[40]], None, None, torch.float32),
    (2, 3, 48, 16, 16, [[48, 30, 41], [45, 48, 20]], [0, 5], 40, torch.bfloat16),  # rows due and not
    (2, 2, 64, 32, 16, [[64, 57], [60, 64]], [3, 0], None, torch.float16),
]


@pytest.mark.parametrize("B,H,C,D,K,fills,pads,threshold,dtype", CASES, ids=lambda v: str(v))
def test_prefill_matches_naive_float64(B, H, C, D, K, fills, pads, threshold, dtype):
    s = make_state(B, H, C, D, K, fills, pads, threshold, dtype, seed=C)
    a = plant(s, Args(seed=C))
    want = expected(s, a)
    call(s, a)
    assert_state(s, want, dtype)


def test_unplanted_fp32_matches_naive_float64():
    """Random Gaussian keys: clusters move over the iterations (no near-ties in this fixed draw)."""
    s = make_state(1, 2, 60, 8, 16, [[60, 52]], dtype=torch.float32, seed=3)
    a = Args(n_sink=3, tokens_per_cluster=10, iters=6, seed=5)
    want = expected(s, a)
    x, init = s["keys"][0, 0, 3:].double(), naive_init(57, 6, a.seed, 0, 0)
    assert naive_kmeans(x, init, 0, torch.float32)[1] != want_labels(want, 0, 0)  # the iterations moved labels
    call(s, a)
    assert_state(s, want, torch.float32)


def test_properties_of_the_index():
    """Sinks = the first n_sink valid slots; members after them a permutation of the clustered slots grouped by
    cluster in slot order; sizes sum to L; starts = offset + exclusive cumsum; every member's cluster is the float64
    cosine argmax against the final centroids; rows not due untouched bit for bit."""
    s = make_state(2, 2, 56, 16, 20, [[56, 50], [40, 56]], pads=[0, 7], threshold=45, seed=4)
    a = plant(s, Args(n_sink=4, tokens_per_cluster=5, seed=9))
    rows = plan(s, a)
    before = clone(s)
    call(s, a)
    for b in range(2):
        for h in range(2):
            if (b, h) not in rows:
                for f in FIELDS[:4] + METHOD:
                    assert torch.equal(s[f][b, h], before[f][b, h]), (f, b, h)
                continue
            _, sinks, points, n, _ = rows[b, h]
            valid = [j for j in range(int(s["fill"][b, h])) if before["bias"][b, h, j] > -math.inf]
            assert s["members"][b, h, :4].tolist() == valid[:4] == sinks
            size, start = s["cluster_size"][b, h, :n], s["cluster_start"][b, h, :n]
            L = len(points)
            assert int(size.sum()) == L and int(s["n_clusters"][b, h]) == n and int(s["cluster_end"][b, h]) == \
                int(s["fill"][b, h])
            assert torch.equal(start, 4 + size.cumsum(0) - size)
            mem = s["members"][b, h, 4:4 + L]
            assert sorted(mem.tolist()) == points
            cent = s["centroids"][b, h, :n].double()
            cent = cent / (cent.norm(dim=-1, keepdim=True) + 1e-8)
            for k in range(n):
                mine = mem[int(start[k]) - 4:int(start[k] + size[k]) - 4]
                assert mine.tolist() == sorted(mine.tolist())
                scores = s["keys"][b, h, mine.long()].double() @ cent.T
                assert (scores.argmax(dim=1) == k).all()
            assert (s["members"][b, h, 4 + L:] == -1).all()


def test_prefill_then_two_windows_append():
    """Prefill clustering, then two window clusterings of `window` new tokens each: ids, member offsets and
    cluster_end append; a call in between (window not full) changes nothing."""
    a = Args(n_sink=2, tokens_per_cluster=6, window=8, window_clusters=3, iters=3, seed=2)
    s = make_state(1, 2, 60, 16, 12, [[30, 30]], pads=[3], dtype=torch.bfloat16, seed=6)
    a = plant(s, a)
    want = expected(s, a)
    call(s, a)
    assert_state(s, want, torch.bfloat16, "prefill")
    n0 = s["n_clusters"].clone()
    assert (n0 == 5).all()  # 30 - 3 padding - 2 sinks = 25 points, ceil(25 / 6)
    for step in range(2):
        append_tokens(s, 5, seed=10 + step)
        before = clone(s)
        call(s, a)  # 5 < window new tokens: not due
        assert all(torch.equal(s[f], before[f]) for f in FIELDS)
        append_tokens(s, 3, seed=20 + step)
        a = plant(s, a, seed=30 + step)
        want = expected(s, a)
        call(s, a)
        assert_state(s, want, torch.bfloat16, f"window {step}")
        assert (s["n_clusters"] == n0 + 3 * (step + 1)).all()
        assert (s["cluster_end"] == 30 + 8 * (step + 1)).all()
        k = int(s["n_clusters"][0, 0]) - 1
        assert int(s["cluster_start"][0, 0, k] + s["cluster_size"][0, 0, k]) == 2 + 25 + 8 * (step + 1)  # no gap


def test_small_rows():
    """L = 0 (only sinks, or fewer valid slots than n_sink: -1 entries), L < window_clusters, L < n_sink."""
    a = Args(n_sink=4, tokens_per_cluster=3, window=4, window_clusters=5, iters=2, seed=1)
    s = make_state(1, 3, 20, 16, 8, [[4, 2, 6]], threshold=1, seed=8)
    a = plant(s, a)
    want = expected(s, a)
    call(s, a)
    assert_state(s, want, torch.float32)
    assert s["members"][0, 1, :4].tolist() == [0, 1, -1, -1] and s["members"][0, 0, :4].tolist() == [0, 1, 2, 3]
    assert s["n_clusters"].tolist() == [[0, 0, 1]] and s["cluster_end"].tolist() == [[4, 2, 6]]
    # window of 4 new slots, 2 of them padding: L = 2 < window_clusters -> 2 singleton clusters
    append_tokens(s, 4, seed=3)
    for h, pads in enumerate(([5, 7], [3, 5], [7, 9])):
        s["bias"][0, h, pads] = -math.inf
    a = plant(s, a)
    assert [plan(s, a)[0, h][3] for h in range(3)] == [2, 2, 2]
    want = expected(s, a)
    call(s, a)
    assert_state(s, want, torch.float32)
    assert s["cluster_size"][0, 2, 1:3].tolist() == [1, 1]


def test_initialisation():
    """init_points is the spec's formula, one point in each stratum [floor(k L / n), floor((k+1) L / n)) so never a
    repeat (also where n does not divide L, and for n = L), reproducible, seed- and head-dependent; with iters = 0
    the centroids are the keys of those points."""
    assert km.init_points(80, 10, 7, 3, 11) == naive_init(80, 10, 7, 3, 11)
    idx = km.init_points(80, 10, 7, 3, 11)
    assert len(set(idx)) == 10 and all(8 * k <= i < 8 * (k + 1) for k, i in enumerate(idx))
    for L, n in ((83, 10), (161, 3), (7, 7), (1000, 13), (5, 1)):
        for seed in range(50):
            pts = km.init_points(L, n, seed, seed % 3, seed)
            assert pts == naive_init(L, n, seed, seed % 3, seed)
            assert all(k * L // n <= i < (k + 1) * L // n for k, i in enumerate(pts)), (L, n, seed, pts)
    assert km.init_points(80, 10, 8, 3, 11) != idx and km.init_points(80, 10, 7, 2, 11) != idx
    assert km.init_points(80, 10, 2**32 + 7, 3, 11) == idx  # seed mod 2^32
    s = make_state(1, 2, 40, 16, 8, [[40, 40]], seed=2)
    a = Args(n_sink=0, tokens_per_cluster=5, iters=0, seed=123)
    runs = []
    for seed in (123, 123, 124):
        t = clone(s)
        call(t, replace(a, seed=seed))
        runs.append(t)
    assert all(torch.equal(runs[0][f], runs[1][f]) for f in FIELDS)
    assert not torch.equal(runs[0]["centroids"], runs[2]["centroids"])
    for h in range(2):
        idx = km.init_points(40, 8, 123, h, 0)
        assert torch.equal(runs[0]["centroids"][0, h], s["keys"][0, h, idx])


def test_head_offset_hashes_the_layers_head():
    """Tensor parallelism: the state of heads [h0:] run with head_offset=h0 gives what the whole state gives for
    those heads, bit for bit; head_offset=0 is the default; another head_offset draws other initial points."""
    h0 = 2
    s = make_state(2, 4, 30, 8, 6, [[30, 27, 30, 24], [30, 30, 29, 30]], pads=[0, 2], threshold=25, seed=11)
    a = Args(n_sink=2, tokens_per_cluster=6, iters=2, seed=4)
    full, zero, shifted = clone(s), clone(s), clone(s)
    call(full, a)
    call(zero, a, head_offset=0)
    call(shifted, a, head_offset=h0)
    part = {f: t if f == "budget" else t[:, h0:].contiguous() for f, t in clone(s).items()}
    call(part, a, head_offset=h0)
    for f in FIELDS:
        assert torch.equal(zero[f], full[f]), f
        assert torch.equal(part[f], full[f] if f == "budget" else full[f][:, h0:]), f
    assert not torch.equal(shifted["centroids"], full["centroids"])


@pytest.mark.parametrize("head_offset", [-1, 2**31])
def test_bad_head_offset_is_named(head_offset):
    s = make_state(1, 1, 24, 16, 6, [[24]])
    with pytest.raises(ValueError, match=f"kvrewrite::kmeans_cluster: head_offset must be an int in \\[0, 2\\*\\*31\\), "
                                         f"got {head_offset}"):
        call(s, Args(), head_offset=head_offset)


def test_too_many_clusters_raise():
    s = make_state(1, 1, 40, 16, 4, [[40]])
    with pytest.raises(ValueError, match="kmeans_cluster: row \\(b=0, h=0\\) needs 0 \\+ 7 clusters, more than K = 4"):
        call(s, Args())


@pytest.mark.parametrize("field,bad,message", [
    ("centroids", lambda t: t.float(), "centroids must be torch.bfloat16"),
    ("cluster_size", lambda t: t.long(), "cluster_size must be torch.int32"),
    ("members", lambda t: t[..., :-1], "members must be torch.int32 \\[1, 2, 24\\]"),
    ("cluster_end", lambda t: t.int(), "cluster_end must be torch.int64"),
    ("n_clusters", lambda t: t[:, :1], "n_clusters must be torch.int32 \\[1, 2\\]"),
    ("bias", lambda t: t.double(), "bias must be torch.float32"),
    ("fill", lambda t: t[0], "fill must be torch.int64 \\[1, 2\\]"),
    ("cluster_start", lambda t: t[..., :3], "cluster_start must be torch.int32 \\[1, 2, 6\\]"),
])
def test_bad_inputs_are_named(field, bad, message):
    s = make_state(1, 2, 24, 16, 6, [[24, 24]], dtype=torch.bfloat16)
    s[field] = bad(s[field])
    with pytest.raises(ValueError, match=f"kvrewrite::kmeans_cluster: {message}"):
        call(s, Args())


def test_bad_arguments_are_named():
    s = make_state(1, 1, 24, 16, 6, [[24]])
    with pytest.raises(ValueError, match="kmeans_cluster: expected n_sink >= 0, tokens_per_cluster >= 1"):
        call(s, Args(tokens_per_cluster=0))
    s["keys"] = s["keys"][0]
    with pytest.raises(ValueError, match="kmeans_cluster: keys must be a floating \\[B, Hkv, C, D\\]"):
        call(s, Args())


def test_opcheck():
    s = make_state(2, 2, 32, 16, 8, [[32, 20], [32, 32]], pads=[0, 3], threshold=25, seed=5)
    a = plant(s, Args())
    torch.library.opcheck(OP, tuple(s[f] for f in FIELDS), a.kwargs())
