"""kvrewrite::select_clusters against a naive float64 sort-and-take written here (clusterkv_spec.md, "Op 2").

The naive version ranks each row's valid clusters by a Python sort on (-score, id), takes them until the budget,
trims the last, then lays the taken members out cluster by cluster in id order. States are built like
kmeans_cluster leaves them (padding first, the sinks, clusters' members grouped in `members`, a window); the
queries and centroids are dyadic (k / 64, |k| <= 64: exact in bf16 and fp16, and every fp32 dot product and group
sum is exact), so fp32 scores equal the float64 ones and the whole index is compared exactly. One test draws
Gaussian data and compares the selected slot sets.
"""
import math

import pytest
import torch

from kvrewrite.kernels import select_clusters as sc  # registers kvrewrite::select_clusters
from kvrewrite.kernels.select_clusters import reference_select_clusters

OP = torch.ops.kvrewrite.select_clusters.default
IMPLS = {"op": lambda *a, **k: OP(*a, **k), "reference": reference_select_clusters}
ARGS = ("fill", "budget", "centroids", "cluster_size", "cluster_start", "members", "n_clusters", "cluster_end")


def dyadic(shape, gen, dtype):
    return (torch.randint(-64, 65, shape, generator=gen).float() / 64).to(dtype)


def make_state(B, Hkv, K, D, *, n_sink=4, window=8, n_used=None, max_size=6, empty=0.2, budget=20, dtype=torch.bfloat16,
               seed=0, short_rows=(), gaussian=False):
    """A ClusterKV layer state as kmeans_cluster leaves it, per row (b, h): 0-2 padding slots, n_sink sinks,
    n_used clusters (random, or n_used[b][h]) of 1..max_size members (a share `empty` of size 0) over the next
    slots in random assignment, then a window of 0..window unclustered slots. Unused cluster ids have NaN
    centroids (never read). Rows in short_rows hold fewer valid slots than n_sink: no cluster, sinks padded with
    -1. Returns a dict of the op's state arguments; C fits the largest row."""
    g = torch.Generator().manual_seed(seed)
    C = 2 + n_sink + K * max_size + window + 1
    st = dict(
        centroids=(torch.randn(B, Hkv, K, D, generator=g) if gaussian else dyadic((B, Hkv, K, D), g, torch.float32)),
        cluster_size=torch.zeros(B, Hkv, K, dtype=torch.int32),
        cluster_start=torch.zeros(B, Hkv, K, dtype=torch.int32),
        members=torch.full((B, Hkv, C), -1, dtype=torch.int32),
        n_clusters=torch.zeros(B, Hkv, dtype=torch.int32),
        cluster_end=torch.zeros(B, Hkv, dtype=torch.int64),
        fill=torch.zeros(B, Hkv, dtype=torch.int64),
        budget=torch.tensor([budget, 0]),
    )
    for b in range(B):
        for h in range(Hkv):
            pad = int(torch.randint(0, 3, (), generator=g))
            if (b, h) in short_rows:
                n_valid = int(torch.randint(0, n_sink, (), generator=g)) if n_sink else 0
                st["members"][b, h, :n_valid] = torch.arange(pad, pad + n_valid, dtype=torch.int32)
                st["fill"][b, h] = st["cluster_end"][b, h] = pad + n_valid
                st["centroids"][b, h] = math.nan
                continue
            n = int(torch.randint(0, K + 1, (), generator=g)) if n_used is None else n_used[b][h]
            size = torch.randint(1, max_size + 1, (n,), generator=g)
            size[torch.rand(n, generator=g) < empty] = 0
            L = int(size.sum())
            first = pad + n_sink
            st["members"][b, h, :n_sink] = torch.arange(pad, first, dtype=torch.int32)
            slots = first + torch.randperm(L, generator=g)  # cluster k's members: a random set, in slot order
            start = n_sink + torch.cumsum(size, 0) - size
            for k in range(n):
                st["members"][b, h, start[k]:start[k] + size[k]] = slots[start[k] - n_sink:][:size[k]].sort().values.int()
            st["cluster_size"][b, h, :n] = size.int()
            st["cluster_start"][b, h, :n] = start.int()
            st["n_clusters"][b, h] = n
            st["centroids"][b, h, n:] = math.nan
            st["cluster_end"][b, h] = first + L
            st["fill"][b, h] = first + L + int(torch.randint(0, window + 1, (), generator=g))
    st["centroids"] = st["centroids"].to(dtype)
    return st


def make_q(B, Hq, D, dtype, seed, gaussian=False):
    """[B, Hq, 1, D], a transposed view of [B, 1, Hq, D] as the models hand it over."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, Hq, D, generator=g) if gaussian else dyadic((B, 1, Hq, D), g, torch.float32)
    return q.to(dtype).transpose(1, 2)


def call(fn, q, st, n_sink, max_selected, window, per_query_head):
    return fn(q, *(st[a] for a in ARGS), n_sink=n_sink, max_selected=max_selected, window=window,
              per_query_head=per_query_head)


def naive_rows(q, st, n_sink, max_selected, window, per_query_head):
    """[B, Hsel] lists of (sinks, taken members, window), and the taken {cluster: count} of each row."""
    B, Hq = q.shape[:2]
    Hkv, K = st["centroids"].shape[1:3]
    G = Hq // Hkv
    b_sel = min(max(int(st["budget"][0]) - n_sink, 0), max_selected)
    out, takes = [], []
    for b in range(B):
        out.append([])
        takes.append([])
        for s in range(Hq if per_query_head else Hkv):
            h = s // G if per_query_head else s
            qv = q[b, s, 0].double() if per_query_head else sum(q[b, h * G + g, 0].double() for g in range(G))
            n = min(int(st["n_clusters"][b, h]), K)
            size = st["cluster_size"][b, h].tolist()
            ranked = sorted((k for k in range(n) if size[k] > 0),
                            key=lambda k: (-float(qv @ st["centroids"][b, h, k].double()), k))
            take, left = {}, b_sel
            for k in ranked:
                if left == 0:
                    break
                take[k] = min(size[k], left)
                left -= take[k]
            middle = []
            for k in sorted(take):  # cluster-id order
                first = int(st["cluster_start"][b, h, k])
                middle += st["members"][b, h, first:first + take[k]].tolist()
            cend, fill = int(st["cluster_end"][b, h]), int(st["fill"][b, h])
            win = list(range(cend, fill))
            assert len(win) <= window
            out[b].append((st["members"][b, h, :n_sink].tolist(), middle, win))
            takes[b].append(take)
    return out, takes


def naive_index(q, st, n_sink, max_selected, window, per_query_head):
    rows, _ = naive_rows(q, st, n_sink, max_selected, window, per_query_head)
    return torch.tensor([[sink + mid + [-1] * (max_selected - len(mid)) + win + [-1] * (window - len(win))
                          for sink, mid, win in r] for r in rows], dtype=torch.int32)


CASES = [  # B, Hq, Hkv, K, D, n_sink, max_selected, window, budget
    (2, 4, 2, 9, 16, 4, 12, 5, 10),  # trimming in most rows
    (1, 3, 1, 17, 16, 0, 40, 3, 25),  # no sinks; G = 3
    (2, 6, 3, 12, 64, 2, 7, 0, 100),  # budget clamped to max_selected; no window
    (1, 8, 2, 30, 16, 5, 200, 9, 500),  # budget above every clustered token
    (2, 2, 2, 6, 16, 3, 10, 4, 2),  # budget < n_sink: B_sel = 0
    (1, 4, 4, 0, 16, 2, 6, 3, 9),  # K = 0
]


@pytest.mark.parametrize("impl", IMPLS.keys())
@pytest.mark.parametrize("per_query_head", [True, False], ids=["per_q", "shared"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-K{}-D{}-s{}-m{}-w{}-b{}".format(*c))
def test_matches_naive(case, dtype, per_query_head, impl):
    B, Hq, Hkv, K, D, n_sink, max_selected, window, budget = case
    seed = hash(case) % 1000
    st = make_state(B, Hkv, K, D, n_sink=n_sink, window=window, budget=budget, dtype=dtype, seed=seed)
    q = make_q(B, Hq, D, dtype, seed)
    got = call(IMPLS[impl], q, st, n_sink, max_selected, window, per_query_head)
    Hsel = Hq if per_query_head else Hkv
    assert got.dtype == torch.int32 and got.shape == (B, Hsel, n_sink + max_selected + window) and got.is_contiguous()
    assert torch.equal(got, naive_index(q, st, n_sink, max_selected, window, per_query_head))


def test_gaussian_scores_select_the_naive_sets():
    """Gaussian q and centroids (fp32 dot products round, unlike float64's): the slot set of each segment equals
    the naive float64 selection (no near-tie at the budget's edge for these seeds)."""
    for seed, per_query_head in [(1, True), (2, False), (3, True)]:
        st = make_state(2, 2, 40, 64, n_sink=3, window=6, budget=60, dtype=torch.float32, seed=seed, gaussian=True)
        q = make_q(2, 8, 64, torch.float32, seed, gaussian=True)
        got = call(OP, q, st, 3, 64, 6, per_query_head)
        rows, _ = naive_rows(q, st, 3, 64, 6, per_query_head)
        for b, r in enumerate(rows):
            for s, (sink, mid, win) in enumerate(r):
                row = got[b, s].tolist()
                assert row[:3] == sink and row[3 + 64:][:len(win)] == win
                assert sorted(x for x in row[3:3 + 64] if x >= 0) == sorted(mid), (b, s)


def test_full_budget_lists_every_valid_slot_once():
    """B_sel >= every clustered token: the index is exactly the row's valid slots (no padding), each once."""
    n_sink, window = 4, 8
    st = make_state(2, 3, 20, 16, n_sink=n_sink, window=window, budget=10**6, seed=4, short_rows=[(1, 2)])
    max_selected = int(st["cluster_size"].sum(-1).max())
    q = make_q(2, 6, 16, torch.bfloat16, 4)
    for per_query_head in (True, False):
        got = call(OP, q, st, n_sink, max_selected, window, per_query_head)
        for b in range(2):
            for s in range(got.shape[1]):
                h = s // 2 if per_query_head else s
                listed = [x for x in got[b, s].tolist() if x >= 0]
                pad = int(st["members"][b, h, 0]) if st["members"][b, h, 0] >= 0 else int(st["fill"][b, h])
                assert sorted(listed) == list(range(pad, int(st["fill"][b, h]))), (b, s)
                assert len(set(listed)) == len(listed)


def test_paper_example():
    """notes §1.6 (Fig. 8): labels k0->2, k1->0, k2->1, k3->1, k4->1, k5->2 give sizes [1, 3, 2] and sorted indices
    [1, 2, 3, 4, 0, 5]. Scores c0 > c2 > c1: B = 3 takes clusters 0 and 2 whole (laid out in id order), B = 2
    trims cluster 2 to its first member, B = 5 takes 0, 2 and cluster 1's first two."""
    st = make_state(1, 1, 3, 16, n_sink=0, window=0, n_used=[[0]], seed=0)
    st["members"][0, 0, :6] = torch.tensor([1, 2, 3, 4, 0, 5], dtype=torch.int32)
    st["cluster_size"][0, 0] = torch.tensor([1, 3, 2], dtype=torch.int32)
    st["cluster_start"][0, 0] = torch.tensor([0, 1, 4], dtype=torch.int32)
    st["n_clusters"][0, 0] = 3
    st["centroids"][0, 0] = 0.0
    st["centroids"][0, 0, :, 0] = torch.tensor([3.0, 1.0, 2.0])
    st["fill"][0, 0] = st["cluster_end"][0, 0] = 6
    q = torch.ones(1, 1, 1, 16)
    st["centroids"] = st["centroids"].float()
    for budget, want in [(3, [1, 0, 5, -1, -1, -1]), (2, [1, 0, -1, -1, -1, -1]), (5, [1, 2, 3, 0, 5, -1]),
                         (0, [-1] * 6), (9, [1, 2, 3, 4, 0, 5])]:
        st["budget"][0] = budget
        for impl in IMPLS.values():
            assert call(impl, q, st, 0, 6, 0, True)[0, 0].tolist() == want, budget


def test_ties_go_to_the_lower_id_and_empty_clusters_never_count():
    """Equal scores: the lower id first, so the trimmed cluster is the higher one; a size-0 cluster with the top
    score takes nothing and does not shift anyone's place; -0.0 and +0.0 scores tie."""
    st = make_state(1, 1, 5, 16, n_sink=1, window=2, n_used=[[0]], seed=0)
    sizes = [2, 3, 0, 3, 2]
    start = [1, 3, 6, 6, 9]
    st["members"][0, 0, :11] = torch.arange(11, dtype=torch.int32) + 100
    st["cluster_size"][0, 0] = torch.tensor(sizes, dtype=torch.int32)
    st["cluster_start"][0, 0] = torch.tensor(start, dtype=torch.int32)
    st["n_clusters"][0, 0] = 5
    st["centroids"] = torch.zeros(1, 1, 5, 16)
    st["centroids"][0, 0, :, 0] = torch.tensor([1.0, 2.0, 9.0, 2.0, 1.0])  # 1 and 3 tie at the top; 2 is empty
    st["fill"][0, 0] = st["cluster_end"][0, 0] = 200
    q = torch.zeros(1, 1, 1, 16)
    q[..., 0] = 1.0
    for budget, middle in [(1 + 4, [103, 104, 105, 106]),  # cluster 1 whole, tie-mate 3 trimmed to its first
                           (1 + 7, [101, 103, 104, 105, 106, 107, 108]),  # 1, 3, then 0 (ties 0/4: lower id 0) trimmed
                           (1 + 9, [101, 102, 103, 104, 105, 106, 107, 108, 109])]:  # 0 whole, 4 trimmed
        st["budget"][0] = budget
        for impl in IMPLS.values():
            got = call(impl, q, st, 1, 10, 2, True)[0, 0].tolist()
            assert got == [100] + middle + [-1] * (10 - len(middle)) + [-1, -1], budget
    # -0.0 and +0.0 scores tie (q = -0.0: +-0.0 products and sums): the lower ids win
    st["budget"][0] = 1 + 3
    st["centroids"][0, 0] = torch.tensor([-1.0, 1.0, 1.0, -1.0, 1.0])[:, None].expand(5, 16)
    for impl in IMPLS.values():
        got = call(impl, torch.full_like(q, -0.0), st, 1, 10, 2, True)[0, 0].tolist()
        assert got[1:4] == [101, 102, 103], got


def test_no_clusters_and_zero_budget():
    """n_clusters 0 (a row before its prefill clustering) and B_sel 0: the selected segment is all -1; the sinks and
    the window are still listed."""
    st = make_state(2, 2, 6, 16, n_sink=2, window=5, n_used=[[0, 3], [4, 0]], budget=40, seed=5)
    q = make_q(2, 4, 16, torch.bfloat16, 5)
    for impl in IMPLS.values():
        got = call(impl, q, st, 2, 30, 5, False)
        assert torch.equal(got, naive_index(q, st, 2, 30, 5, False))
        assert (got[0, 0, 2:32] == -1).all() and (got[1, 1, 2:32] == -1).all()
        st["budget"][0] = 2  # = n_sink: nothing selected anywhere
        got = call(impl, q, st, 2, 30, 5, True)
        assert (got[..., 2:32] == -1).all() and torch.equal(got, naive_index(q, st, 2, 30, 5, True))
        st["budget"][0] = 40


def test_window_lengths():
    """Every unclustered length 0..window: the window segment lists cluster_end .. fill - 1 ascending, then -1;
    a longer one is a ValueError of the reference (the kernel writes the first `window`)."""
    window = 6
    st = make_state(1, 1, 4, 16, n_sink=2, window=0, seed=6)
    q = make_q(1, 2, 16, torch.bfloat16, 6)
    cend = int(st["cluster_end"][0, 0])
    for n in range(window + 1):
        st["fill"][0, 0] = cend + n
        for impl in IMPLS.values():
            got = call(impl, q, st, 2, 5, window, True)
            want = list(range(cend, cend + n)) + [-1] * (window - n)
            assert got[0, 0, 7:].tolist() == want and got[0, 1, 7:].tolist() == want, n
    st["fill"][0, 0] = cend + window + 1
    for impl in IMPLS.values():
        with pytest.raises(ValueError, match="more than window = 6"):
            call(impl, q, st, 2, 5, window, True)


def test_shared_selection_ranks_by_the_summed_group_query():
    """per_query_head False: one selection per KV head by the fp32 sum of its G queries. Head 0 alone prefers
    cluster 0, head 1 cluster 1 strongly: the sum prefers cluster 1, which is what the shared row takes."""
    st = make_state(1, 1, 2, 16, n_sink=0, window=0, n_used=[[0]], seed=0)
    st["members"][0, 0, :4] = torch.tensor([10, 11, 20, 21], dtype=torch.int32)
    st["cluster_size"][0, 0] = torch.tensor([2, 2], dtype=torch.int32)
    st["cluster_start"][0, 0] = torch.tensor([0, 2], dtype=torch.int32)
    st["n_clusters"][0, 0] = 2
    st["centroids"] = torch.zeros(1, 1, 2, 16, dtype=torch.bfloat16)
    st["centroids"][0, 0, 0, 0] = st["centroids"][0, 0, 1, 1] = 1.0
    st["fill"][0, 0] = st["cluster_end"][0, 0] = 30
    st["budget"][0] = 2
    q = torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16)
    q[0, 0, 0, :2] = torch.tensor([1.0, 0.5])  # head 0: cluster 0 (1.0 > 0.5)
    q[0, 1, 0, :2] = torch.tensor([-1.0, 2.0])  # head 1: cluster 1; the sum (0, 2.5): cluster 1
    for impl in IMPLS.values():
        assert call(impl, q, st, 0, 2, 0, True)[0].tolist() == [[10, 11], [20, 21]]
        assert call(impl, q, st, 0, 2, 0, False)[0].tolist() == [[20, 21]]


def test_bad_inputs_raise_value_errors():
    st = make_state(1, 2, 5, 16, seed=7)
    q = make_q(1, 4, 16, torch.bfloat16, 7)
    kw = dict(n_sink=4, max_selected=8, window=8, per_query_head=True)

    def with_(**changes):
        args = {**st, "q": q, **changes}
        return [args["q"]] + [args[a] for a in ARGS]

    bad = [
        (with_(q=q.expand(1, 4, 2, 16)), r"q must be \[B, Hq, 1, D\] \(decode, T = 1\)"),
        (with_(q=q[:, :3]), "Hq must be a multiple of Hkv"),
        (with_(centroids=st["centroids"][..., :8]), "centroids must be"),
        (with_(q=q.int()), "q and centroids must be fp16/bf16/fp32"),
        (with_(cluster_size=st["cluster_size"].long()), "cluster_size must be int32"),
        (with_(cluster_start=st["cluster_start"][..., :3]), "cluster_start must be int32"),
        (with_(members=st["members"].long()), "members must be int32"),
        (with_(members=st["members"][..., :0]), "members has no slots"),
        (with_(n_clusters=st["n_clusters"].long()), "n_clusters must be int32"),
        (with_(fill=st["fill"].int()), "fill must be int64"),
        (with_(cluster_end=st["cluster_end"][:, :1]), "cluster_end must be int64"),
        (with_(budget=st["budget"][:1]), "budget must be int64 \\[2\\]"),
    ]
    for impl in IMPLS.values():
        for args, match in bad:
            with pytest.raises(ValueError, match=match):
                impl(*args, **kw)
        with pytest.raises(ValueError, match=r"n_sink must be in \[0, C="):
            impl(*with_(), **dict(kw, n_sink=10**6))
        with pytest.raises(ValueError, match="max_selected and window must be >= 0"):
            impl(*with_(), **dict(kw, window=-1))
    if sc.triton is not None:
        with pytest.raises(ValueError, match="one CUDA device"):
            sc.triton_select_clusters(*with_(), **kw)


def test_opcheck():
    for per_query_head, dtype in [(True, torch.bfloat16), (False, torch.float32)]:
        st = make_state(2, 2, 7, 16, n_sink=3, window=4, budget=15, dtype=dtype, seed=8)
        q = make_q(2, 6, 16, dtype, 8)
        torch.library.opcheck(OP, (q, *(st[a] for a in ARGS)),
                              dict(n_sink=3, max_selected=9, window=4, per_query_head=per_query_head))
