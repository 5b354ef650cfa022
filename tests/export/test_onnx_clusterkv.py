"""ClusterKV's ONNX functions (kvrewrite/export/onnx_clusterkv.py) against the ops' references, in onnxruntime, on
random states of several shapes: kmeans_cluster (prefill and window clusterings, the due rule, padding, sinks, rows
shorter than n_sink, the seeded initialisation), select_clusters (both GQA modes, budgets that trim and that take
everything, exact score ties), indexed_attention (both index layouts, -1 entries, duplicates, soft cap); fp32 and
fp16 states.

Tolerances: kmeans_cluster and select_clusters equal the reference exactly (the k-means sums run in the reference's
order; the dots and norms could only differ at near-ties, which random inputs do not have); indexed_attention
computes in fp32 like the reference (MatMul for einsum): atol 2e-6 (fp16 outputs: 1e-3, one fp16 step).
"""
import math

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from kvrewrite.kernels.indexed_attention import reference_indexed_attention  # noqa: E402
from kvrewrite.kernels.kmeans_cluster import init_points, reference_kmeans_cluster  # noqa: E402
from kvrewrite.kernels.select_clusters import reference_select_clusters  # noqa: E402
from tests.export.test_onnx import _run_function  # noqa: E402

INDEX = ("centroids", "cluster_size", "cluster_start", "members", "n_clusters", "cluster_end")


def _index_state(B, H, C, D, K, dtype=torch.float32):
    return dict(centroids=torch.zeros(B, H, K, D, dtype=dtype), cluster_size=torch.zeros(B, H, K, dtype=torch.int32),
                cluster_start=torch.zeros(B, H, K, dtype=torch.int32),
                members=torch.full((B, H, C), -1, dtype=torch.int32),
                n_clusters=torch.zeros(B, H, dtype=torch.int32), cluster_end=torch.zeros(B, H, dtype=torch.int64))


def _base(B, H, C, D, g, pad, dtype=torch.float32):
    """Keys, values, bias (left padding of pad[b] slots and a few holes: -inf), slot_pos."""
    keys, values = (torch.randn(B, H, C, D, generator=g).to(dtype) for _ in range(2))
    bias = torch.zeros(B, H, C)
    for b in range(B):
        bias[b, :, :pad[b]] = -math.inf
    bias[torch.rand(B, H, C, generator=g) < 0.05] = -math.inf
    slot_pos = torch.arange(C).expand(B, H, C).contiguous()
    return dict(keys=keys, values=values, bias=bias, slot_pos=slot_pos)


def _kmeans(base, fill, budget, index, opts, reference=True):
    """(reference outputs, ONNX outputs) of one kmeans_cluster call."""
    ref = {k: v.clone() for k, v in index.items()}
    if reference:
        reference_kmeans_cluster(*base.values(), fill, budget, *ref.values(), **opts)
    inputs = {**base, "fill": fill, "budget": budget, **index}
    out = _run_function("kmeans_cluster", inputs, [ref[k] for k in INDEX], **opts)
    return ref, dict(zip(INDEX, out))


def _assert_index_equal(got, want):
    for name in INDEX:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), f"kmeans_cluster: {name} differs\n{got[name]}\n{want[name]}"


@pytest.mark.parametrize("seed,B,H,C,D,n_sink,tpc,window,wc,iters,dtype", [
    (0, 1, 3, 24, 4, 2, 4, 4, 2, 3, torch.float32),
    (1, 2, 2, 40, 8, 4, 5, 6, 3, 5, torch.float32),     # B = 2 with padding, GQA-sized heads
    (2, 2, 3, 57, 16, 1, 7, 8, 4, 8, torch.float32),    # C not a multiple of anything, more iterations than needed
    (3, 2, 2, 33, 8, 0, 3, 5, 2, 1, torch.float32),     # no sinks, one iteration
    (4, 2, 2, 40, 8, 2, 4, 6, 2, 4, torch.float16),     # fp16 keys and centroids: means rounded to fp16
])
def test_kmeans_cluster_function(seed, B, H, C, D, n_sink, tpc, window, wc, iters, dtype):
    g = torch.Generator().manual_seed(seed)
    K = math.ceil(C / tpc) + wc * (C // window)
    pad = [int(torch.randint(0, 6, (1,), generator=g)) for _ in range(B)]
    base = _base(B, H, C, D, g, pad, dtype)
    opts = dict(n_sink=n_sink, tokens_per_cluster=tpc, window=window, window_clusters=wc, iters=iters,
                seed=1000 + seed)
    # prefill clustering: due rows at different fills, one row below the threshold, one shorter than n_sink
    threshold = C // 2
    fill = torch.randint(threshold, C - 2 * window, (B, H), generator=g)
    fill.view(-1)[-1] = threshold - 1
    if n_sink:
        base["bias"][0, 0, :] = -math.inf
        base["bias"][0, 0, pad[0] + 1] = 0.0  # a single valid slot: fewer than n_sink, no point
    budget = torch.tensor([5, threshold])
    ref, out = _kmeans(base, fill, budget, _index_state(B, H, C, D, K, dtype), opts)
    _assert_index_equal(out, ref)
    assert int((ref["n_clusters"] > 0).sum()) >= B * H - 2, "the prefill clustering clustered too few rows"
    # window clusterings on that state: due rows (>= window new slots), one row short of the window
    fill2 = ref["cluster_end"] + window + torch.randint(0, window, (B, H), generator=g)
    fill2.view(-1)[0] = ref["cluster_end"].view(-1)[0] + window - 1
    for step in range(2):
        before = ref
        ref, out = _kmeans(base, fill2, budget, before, opts)
        _assert_index_equal(out, ref)
        grew = ref["n_clusters"] > before["n_clusters"]
        if step == 0:
            assert bool(grew.any()) and not bool(grew.view(-1)[0]), "the window clusterings' due rule is not exercised"
        fill2 = torch.minimum(fill2 + window, torch.tensor(C))


def test_kmeans_cluster_function_empty_cluster_and_ties():
    """Keys with exact duplicates (ties in the assignment: the lower id) and clusters that lose every member (they
    keep their centroid): the reference and the function agree on every field."""
    g = torch.Generator().manual_seed(7)
    B, H, C, D = 2, 2, 30, 4
    base = _base(B, H, C, D, g, [0, 3])
    base["bias"].clamp_(min=-math.inf, max=0.0)
    protos = torch.randint(-2, 3, (3, D), generator=g).float()
    base["keys"] = protos[torch.randint(0, 3, (B, H, C), generator=g)]  # 3 distinct keys: ties and empty clusters
    opts = dict(n_sink=1, tokens_per_cluster=3, window=4, window_clusters=2, iters=4, seed=3)
    fill = torch.full((B, H), C)
    ref, out = _kmeans(base, fill, torch.tensor([5, C]), _index_state(B, H, C, D, 12), opts)
    _assert_index_equal(out, ref)
    assert bool((ref["cluster_size"][..., :8] == 0).any()), "no empty cluster: the case tests nothing"


def test_kmeans_initialisation_matches_init_points():
    """iters = 0: the centroids are the initial points, i.e. init_points' seeded strata (the 32-bit mixer in the
    function's int64 arithmetic, large seeds and offsets included), with the head hashed as head_offset + h (a
    tensor-parallel rank's heads)."""
    g = torch.Generator().manual_seed(11)
    B, H, C, D = 1, 3, 40, 4
    base = _base(B, H, C, D, g, [0])
    base["bias"].zero_()
    for seed, head_offset in ((0, 0), (123456789, 0), (2**32 + 5, 7), (2**40 + 77, 0), (0, 5)):
        opts = dict(n_sink=0, tokens_per_cluster=3, window=4, window_clusters=2, iters=0, seed=seed,
                    head_offset=head_offset)
        index = _index_state(B, H, C, D, 20)
        index["cluster_size"][..., 0] = torch.tensor([7, 2**20 + 3, 5], dtype=torch.int32)  # points clustered before
        index["n_clusters"][:] = 1
        index["cluster_end"][:] = 8
        fill = torch.full((B, H), 8 + 9)
        ref, out = _kmeans(base, fill, torch.tensor([4, 1]), index, opts)
        _assert_index_equal(out, ref)
        for h in range(H):
            offset = int(index["cluster_size"][0, h, 0])
            first = [8 + i for i in init_points(9, 2, seed, head_offset + h, offset)]
            assert torch.equal(ref["centroids"][0, h, 1:3], base["keys"][0, h, first])


def _clustered_state(g, B, H, C, D, K, n_sink, window, pad, dtype=torch.float32):
    """Keys and an index clustered by the reference: the prompt (C // 2 slots), then one window clustering."""
    base = _base(B, H, C, D, g, pad, dtype)
    opts = dict(n_sink=n_sink, tokens_per_cluster=3, window=window, window_clusters=2, iters=3, seed=5)
    index = _index_state(B, H, C, D, K, dtype)
    f0 = torch.full((B, H), C // 2)
    reference_kmeans_cluster(*base.values(), f0, torch.tensor([0, 1]), *index.values(), **opts)
    reference_kmeans_cluster(*base.values(), f0 + window, torch.tensor([0, 1]), *index.values(), **opts)
    return base, index


@pytest.mark.parametrize("per_query_head", [True, False], ids=["per-query-head", "per-kv-head"])
@pytest.mark.parametrize("B,Hq,Hkv,C,D,n_sink,budget,window", [
    (1, 2, 2, 30, 8, 2, 9, 4),     # MHA, the budget trims
    (2, 4, 2, 40, 8, 3, 12, 5),    # GQA, B = 2 with padding
    (2, 8, 2, 48, 16, 1, 100, 6),  # a budget above every clustered token: everything selected
    (2, 4, 1, 36, 4, 0, 7, 3),     # MQA, no sinks
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_select_clusters_function(per_query_head, B, Hq, Hkv, C, D, n_sink, budget, window, dtype):
    g = torch.Generator().manual_seed(B * 100 + C + budget)
    K = 30
    base, index = _clustered_state(g, B, Hkv, C, D, K, n_sink, window, [0, 4][:B], dtype)
    fill = index["cluster_end"] + torch.randint(0, window + 1, (B, Hkv), generator=g)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    max_selected = 16
    inputs = dict(q=q, fill=fill, budget=torch.tensor([budget, 0]), centroids=index["centroids"],
                  cluster_size=index["cluster_size"], cluster_start=index["cluster_start"], members=index["members"],
                  n_clusters=index["n_clusters"], cluster_end=index["cluster_end"])
    opts = dict(n_sink=n_sink, max_selected=max_selected, window=window)
    ref = reference_select_clusters(*inputs.values(), **opts, per_query_head=per_query_head)
    (out,) = _run_function("select_clusters", inputs, [ref], **opts, per_query_head=int(per_query_head))
    assert out.dtype == torch.int32 and out.shape == ref.shape
    assert torch.equal(out, ref), f"select_clusters differs\n{out}\n{ref}"
    middle = ref[..., n_sink:n_sink + max_selected]
    if budget - n_sink < int(index["cluster_size"].sum(-1).min()):
        assert bool((middle == -1).any()), "nothing was dropped: the case tests no selection"


def test_select_clusters_function_ties():
    """Exact score ties (integer queries and centroids): the lower cluster id first, as the reference's stable
    sort; the trimmed cluster keeps its first members."""
    B, Hq, Hkv, K, C, D = 1, 2, 1, 6, 24, 4
    centroids = torch.tensor([[1., 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [1, 0, 0, 0], [0, 1, 0, 0]])
    size = torch.tensor([3, 4, 3, 5, 3, 2], dtype=torch.int32)
    start = (2 + size.cumsum(0) - size).int()
    members = torch.cat([torch.tensor([0, 1]), torch.arange(2, 22), torch.tensor([-1, -1])]).int()
    inputs = dict(q=torch.tensor([[1., 0, 0, 0], [1., 1, 0, 0]]).view(B, Hq, 1, D), fill=torch.tensor([[22]]),
                  budget=torch.tensor([2 + 7, 0]), centroids=centroids.view(B, Hkv, K, D),
                  cluster_size=size.view(B, Hkv, K), cluster_start=start.view(B, Hkv, K),
                  members=members.view(B, Hkv, C), n_clusters=torch.tensor([[K]], dtype=torch.int32),
                  cluster_end=torch.tensor([[22]]))
    for per in (True, False):
        opts = dict(n_sink=2, max_selected=9, window=2)
        ref = reference_select_clusters(*inputs.values(), **opts, per_query_head=per)
        (out,) = _run_function("select_clusters", inputs, [ref], **opts, per_query_head=int(per))
        assert torch.equal(out, ref), f"per_query_head={per}\n{out}\n{ref}"
    # query head 0 ties clusters 0, 2, 4 (score 1): 0 and 2 whole (6), then one member of 4
    assert ref.shape == (1, 1, 13)


@pytest.mark.parametrize("per_query_head", [True, False], ids=["per-query-head", "per-kv-head"])
@pytest.mark.parametrize("B,Hq,Hkv,T,C,D,S,softcap,dtype", [
    (1, 2, 2, 1, 9, 8, 6, 0.0, torch.float32), (2, 4, 2, 1, 33, 16, 20, 0.0, torch.float32),
    (2, 8, 2, 3, 40, 16, 25, 0.0, torch.float32), (1, 4, 1, 1, 12, 8, 10, 5.0, torch.float32),
    (2, 4, 2, 1, 30, 16, 18, 0.0, torch.float16),
])
def test_indexed_attention_function(per_query_head, B, Hq, Hkv, T, C, D, S, softcap, dtype):
    g = torch.Generator().manual_seed(B * 100 + C + S)
    q = (torch.randn(B, Hq, T, D, generator=g) * (softcap or 1.0)).to(dtype)
    keys, values = (torch.randn(B, Hkv, C, D, generator=g).to(dtype) for _ in range(2))
    bias = torch.zeros(B, Hkv, C)
    bias[torch.rand(B, Hkv, C, generator=g) < 0.2] = -math.inf
    Hsel = Hq if per_query_head else Hkv
    index = torch.randint(0, C, (B, Hsel, S), generator=g, dtype=torch.int32)  # duplicates happen
    index[torch.rand(B, Hsel, S, generator=g) < 0.3] = -1
    index[0, 0, :] = -1  # a row with no entry: zeros
    ref = reference_indexed_attention(q, keys, values, bias, index, 0.3, softcap)
    attrs = dict(scale=0.3, softcap=softcap) if softcap else dict(scale=0.3)
    (out,) = _run_function("indexed_attention", dict(q=q, keys=keys, values=values, bias=bias, index=index), [ref],
                           **attrs)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # fp32 math; fp16: both round the same fp32 result (within 2e-6) to fp16, so at most one fp16 step apart
    atol = 2e-6 * max(1.0, softcap) if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out, ref, atol=atol, rtol=0)
