"""ClusterKV's three ops as ONNX functions of the domain "kvrewrite" (onnxscript, opset 18); onnx_ops.py
lists them with the others (FUNCTIONS, SYMBOLIC) and docs/deploy.md has their table.

    kvrewrite::kmeans_cluster(keys, values, bias, slot_pos, fill, budget, centroids, cluster_size,
                              cluster_start, members, n_clusters, cluster_end;
                              n_sink, tokens_per_cluster, window, window_clusters, iters, seed, head_offset)
        -> (centroids, cluster_size, cluster_start, members, n_clusters, cluster_end)
        the functional form of the in-place op (kvrewrite.export.functional); values and slot_pos are
        inputs by the op's schema and not read. Calls kvrewrite::mix32 (also in the model).
    kvrewrite::select_clusters(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters,
                               cluster_end; n_sink, max_selected, window, per_query_head) -> index (int32)
    kvrewrite::indexed_attention(q, keys, values, bias, index; scale, softcap) -> out

Each body is the reference computation (kvrewrite/kernels/<op>.py, reference_<op>) over all rows at once:

- kmeans_cluster: the due rule from fill, budget[1], cluster_end and `window` (rows not due come back as they
  were); the row's valid slots packed in slot order (CumSum ranks, ScatterElements), the first n_sink of a
  prefill row its sinks, the rest the points; C_new = ceil(L / tokens_per_cluster) or min(window_clusters, L)
  (clamped to the free ids, as the CUDA kernel; the reference raises there, which the method's K never reaches);
  the seeded stratified initialisation with the 32-bit mixer in int64 arithmetic (no value reaches 2^48: a
  product by a 32-bit constant is split at 16 bits, so no runtime's overflow behaviour is relied on); a Loop of
  iters + 1 rounds: the cosine assignment (MatMul, / (|c| + 1e-8), ArgMax: ties to the lower id) and, in all but
  the last, the update: the sums by ScatterElements(add) in point order (index_add_'s order: the same fp32
  sums), / the count, rounded to the centroids' dtype, empty clusters keep theirs; the members by a stable sort
  of the labels (TopK of the distinct keys label * C + point); the writes at ids n_clusters.. and member offset
  n_sink + the points clustered before.
- select_clusters: the selection query (a query head's, or the fp32 sum of the group's: a ReduceSum over the
  group), scores by MatMul, the stable descending order by TopK (ties to the lower id), takes by CumSum, the
  owner of each output position (searchsorted) in O(max_selected + K) by marks and a CumSum, then the index layout
  (sinks, taken members in cluster-id order, -1, the window, -1). A window longer than `window` is cut to its
  first `window` slots (the CUDA kernel's behaviour; the reference raises).
- indexed_attention: GatherElements of the listed keys, values and biases (-1: masked, its value zeroed), fp32
  MatMul / softcap / softmax as the reference.

Exactness: integer outputs are exact; the float sums follow the reference's order where it is sequential
(the k-means update). The dot products (MatMul against torch's matmul/einsum) and the norms may round
differently by an ulp, which can only change a label or a selection at a near-tie (two scores within ~1e-6
relative); on the tests' random inputs every output equals the reference's.
"""
from typing import TypeVar, Union

from onnxscript import BFLOAT16, FLOAT, FLOAT16, INT32, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

kv = Opset("kvrewrite", 1)  # the domain of onnx_ops.py (DOMAIN), version 1
TFloat = TypeVar("TFloat", bound=Union[FLOAT, FLOAT16, BFLOAT16])


@script(kv, default_opset=op)
def mix32(x: INT64) -> INT64:
    """kmeans_cluster's 32-bit mixer on values in [0, 2^32), in int64: x ^= x >> 16; x *= 0x7feb352d (mod 2^32);
    x ^= x >> 15; x *= 0x846ca68b (mod 2^32); x ^= x >> 16. x * c mod 2^32 = (lo * c + ((hi * c) mod 2^16) * 2^16)
    mod 2^32 with x = hi * 2^16 + lo: every product stays below 2^48."""
    s15 = op.Constant(value_int=32768)
    s16 = op.Constant(value_int=65536)
    m16 = op.Constant(value_int=65535)
    m32 = op.Constant(value_int=4294967295)
    c1 = op.Constant(value_int=2146121005)  # 0x7feb352d
    c2 = op.Constant(value_int=2221713035)  # 0x846ca68b
    x = op.BitwiseXor(x, op.Div(x, s16))
    x = op.BitwiseAnd(op.Add(op.Mul(op.BitwiseAnd(x, m16), c1),
                             op.Mul(op.BitwiseAnd(op.Mul(op.Div(x, s16), c1), m16), s16)), m32)
    x = op.BitwiseXor(x, op.Div(x, s15))
    x = op.BitwiseAnd(op.Add(op.Mul(op.BitwiseAnd(x, m16), c2),
                             op.Mul(op.BitwiseAnd(op.Mul(op.Div(x, s16), c2), m16), s16)), m32)
    return op.BitwiseXor(x, op.Div(x, s16))


@script(kv, default_opset=op)
def kmeans_cluster(keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, fill: INT64, budget: INT64,
                   centroids: TFloat, cluster_size: INT32, cluster_start: INT32, members: INT32, n_clusters: INT32,
                   cluster_end: INT64, n_sink: int, tokens_per_cluster: int, window: int, window_clusters: int,
                   iters: int, seed: int, head_offset: int = 0) -> tuple[TFloat, INT32, INT32, INT32, INT32, INT64]:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    neg_one = op.Constant(value_int=-1)
    neg_inf = op.Constant(value_float=float("-inf"))
    C = op.Shape(keys, start=2, end=3)  # [1]
    H = op.Shape(keys, start=1, end=2)
    K = op.Shape(centroids, start=2, end=3)
    rows = op.Shape(fill)  # [B, H]
    ar = op.Range(zero, op.Squeeze(C), one)  # [C]
    kr = op.Range(zero, op.Squeeze(K), one)  # [K]
    nc = op.Cast(n_clusters, to=INT64.dtype)
    ns = op.Constant(value_int=n_sink)
    # the due rule, per row: prefill clustering (cluster_end == 0) or window clustering (>= window new slots)
    prefill = op.Equal(cluster_end, zero)
    due = op.And(op.GreaterOrEqual(fill, op.Gather(budget, one)),
                 op.Or(prefill, op.GreaterOrEqual(op.Sub(fill, cluster_end), op.Constant(value_int=window))))
    lo = op.Where(prefill, zero, op.Min(cluster_end, C))
    hi = op.Min(fill, C)
    valid = op.And(op.And(op.GreaterOrEqual(ar, op.Unsqueeze(lo, [2])), op.Less(ar, op.Unsqueeze(hi, [2]))),
                   op.Greater(bias, neg_inf))  # [B, H, C]
    vi = op.Cast(valid, to=INT64.dtype)
    n_valid = op.ReduceSum(vi, op.Constant(value_ints=[2]), keepdims=0)  # [B, H]
    # the valid slots packed in slot order: vpack[r] = the slot of valid rank r (r < n_valid)
    dest = op.Where(valid, op.Sub(op.CumSum(vi, two), one), op.Add(ar, C))
    ar_rows = op.Expand(ar, op.Concat(rows, C, axis=0))
    base = op.Expand(op.Concat(ar, ar, axis=0), op.Concat(rows, op.Add(C, C), axis=0))
    vpack = op.Slice(op.ScatterElements(base, dest, ar_rows, axis=2), op.Constant(value_ints=[0]), C,
                     op.Constant(value_ints=[2]))
    shift = op.Where(prefill, op.Min(ns, n_valid), zero)  # a prefill row's sinks are not points
    L = op.Sub(n_valid, shift)  # [B, H]
    tpc = op.Constant(value_int=tokens_per_cluster)
    n = op.Where(prefill, op.Div(op.Sub(op.Add(L, tpc), one), tpc), op.Min(op.Constant(value_int=window_clusters), L))
    n = op.Min(n, op.Max(op.Sub(K, nc), zero))  # clamped to the free ids (the CUDA kernel's rule)
    offset = op.ReduceSum(op.Where(op.Less(kr, op.Unsqueeze(nc, [2])), op.Cast(cluster_size, to=INT64.dtype), zero),
                          op.Constant(value_ints=[2]), keepdims=0)  # points clustered before, [B, H]
    # the points: pts[i] = the slot of point i (i < L), X their keys in fp32
    last = op.Sub(C, one)
    pts = op.GatherElements(vpack, op.Min(op.Add(ar, op.Unsqueeze(shift, [2])), last), axis=2)
    is_pt = op.Less(ar, op.Unsqueeze(L, [2]))  # [B, H, C]
    X = op.Cast(op.GatherElements(keys, op.Expand(op.Unsqueeze(pts, [3]), op.Shape(keys)), axis=2), to=FLOAT.dtype)
    # initialisation: centroid k = point lo_k + r_k mod (lo_{k+1} - lo_k), lo_k = k L // n
    seed32 = op.BitwiseAnd(op.Constant(value_int=seed), op.Constant(value_int=4294967295))
    hs = op.Add(op.Range(zero, op.Squeeze(H), one), op.Constant(value_int=head_offset))  # the layer's head index
    r = mix32(op.BitwiseXor(mix32(op.BitwiseXor(mix32(seed32), hs)), offset))  # [B, H]
    r = mix32(op.BitwiseXor(op.Unsqueeze(r, [2]), kr))  # [B, H, K]
    n3 = op.Unsqueeze(op.Max(n, one), [2])
    L3 = op.Unsqueeze(L, [2])
    lo_k = op.Div(op.Mul(kr, L3), n3)
    width = op.Max(op.Sub(op.Div(op.Mul(op.Add(kr, one), L3), n3), lo_k), one)
    first = op.Min(op.Add(lo_k, op.Mod(r, width)), last)  # [B, H, K] (k >= n: unused)
    D = op.Shape(keys, start=3, end=4)
    KD = op.Concat(rows, K, D, axis=0)
    cent = op.GatherElements(X, op.Expand(op.Unsqueeze(first, [3]), KD), axis=2)  # [B, H, K, D] fp32 of keys
    used_k = op.Less(kr, op.Unsqueeze(n, [2]))  # [B, H, K]
    used4 = op.Unsqueeze(used_k, [2])  # [B, H, 1, K]
    K1 = op.Add(K, one)  # cluster ids + a bucket K for the non-points
    zsum = op.Expand(op.Constant(value_float=0.0), op.Concat(rows, K1, D, axis=0))
    zcnt = op.Expand(zero, op.Concat(rows, K1, axis=0))
    ones = op.Expand(one, op.Concat(rows, C, axis=0))
    n_iter = op.Constant(value_int=iters)
    label = op.Expand(zero, op.Concat(rows, C, axis=0))
    # iters rounds of (assignment, update), then the final assignment: iters + 1 assignments, no last update
    for i in range(op.Add(n_iter, one)):
        norm = op.Sqrt(op.ReduceSum(op.Mul(cent, cent), op.Constant(value_ints=[3]), keepdims=0))  # [B, H, K]
        S = op.Div(op.MatMul(X, op.Transpose(cent, perm=[0, 1, 3, 2])),
                   op.Unsqueeze(op.Add(norm, op.Constant(value_float=1e-8)), [2]))  # [B, H, C, K]
        label = op.ArgMax(op.Where(used4, S, neg_inf), axis=3, keepdims=0, select_last_index=0)  # [B, H, C]
        tgt = op.Where(is_pt, label, K)
        sums = op.ScatterElements(zsum, op.Expand(op.Unsqueeze(tgt, [3]), op.Shape(X)), X, axis=2, reduction="add")
        count = op.ScatterElements(zcnt, tgt, ones, axis=2, reduction="add")
        sums = op.Slice(sums, op.Constant(value_ints=[0]), K, op.Constant(value_ints=[2]))
        count = op.Slice(count, op.Constant(value_ints=[0]), K, op.Constant(value_ints=[2]))
        mean = op.Div(sums, op.Unsqueeze(op.Cast(op.Max(count, one), to=FLOAT.dtype), [3]))
        mean = op.Cast(op.CastLike(mean, centroids), to=FLOAT.dtype)  # rounded to the centroids' dtype
        moved = op.And(op.Greater(count, zero), op.Less(i, n_iter))
        cent = op.Where(op.Unsqueeze(moved, [3]), mean, cent)
    # the final assignment's clusters: sizes, starts, and the points in (label, slot) order
    tgt = op.Where(is_pt, label, K)
    size = op.Slice(op.ScatterElements(zcnt, tgt, ones, axis=2, reduction="add"), op.Constant(value_ints=[0]), K,
                    op.Constant(value_ints=[2]))  # [B, H, K]
    m0 = op.Add(ns, offset)  # [B, H]: member offset of this clustering
    start = op.Sub(op.Add(op.Unsqueeze(m0, [2]), op.CumSum(size, two)), size)
    _, order = op.TopK(op.Add(op.Mul(tgt, C), ar), C, axis=2, largest=0, sorted=1)  # distinct keys: a stable sort
    ordered = op.GatherElements(pts, order, axis=2)  # [B, H, C]: slot of the t-th member (t < L)
    # members: a prefill row's sinks (the first n_sink valid slots, -1 past them), then the new clusters' members
    writes = op.Unsqueeze(op.And(due, op.Greater(n, zero)), [2])
    m64 = op.Cast(members, to=INT64.dtype)
    sinks = op.Where(op.Less(ar, op.Unsqueeze(n_valid, [2])), vpack, neg_one)
    m64 = op.Where(op.And(op.Unsqueeze(op.And(due, prefill), [2]), op.Less(ar, ns)), sinks, m64)
    t = op.Sub(ar, op.Unsqueeze(m0, [2]))
    put = op.And(writes, op.And(op.GreaterOrEqual(t, zero), op.Less(t, L3)))
    m64 = op.Where(put, op.GatherElements(ordered, op.Min(op.Max(t, zero), last), axis=2), m64)
    # cluster ids n_clusters .. n_clusters + n - 1 take the new clusters 0 .. n - 1
    src = op.Sub(kr, op.Unsqueeze(nc, [2]))  # [B, H, K]
    new_id = op.And(writes, op.And(op.GreaterOrEqual(src, zero), op.Less(src, op.Unsqueeze(n, [2]))))
    srcc = op.Min(op.Max(src, zero), op.Sub(K, one))
    moved_c = op.GatherElements(cent, op.Expand(op.Unsqueeze(srcc, [3]), KD), axis=2)
    centroids2 = op.Where(op.Unsqueeze(new_id, [3]), op.CastLike(moved_c, centroids), centroids)
    size2 = op.Where(new_id, op.Cast(op.GatherElements(size, srcc, axis=2), to=INT32.dtype), cluster_size)
    start2 = op.Where(new_id, op.Cast(op.GatherElements(start, srcc, axis=2), to=INT32.dtype), cluster_start)
    n_clusters2 = op.Where(due, op.Cast(op.Add(nc, n), to=INT32.dtype), n_clusters)
    cluster_end2 = op.Where(due, fill, cluster_end)
    return centroids2, size2, start2, op.Cast(m64, to=INT32.dtype), n_clusters2, cluster_end2


@script(kv, default_opset=op)
def select_clusters(q: TFloat, fill: INT64, budget: INT64, centroids: TFloat, cluster_size: INT32,
                    cluster_start: INT32, members: INT32, n_clusters: INT32, cluster_end: INT64, n_sink: int,
                    max_selected: int, window: int, per_query_head: int) -> INT32:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    neg_one = op.Constant(value_int=-1)
    B = op.Shape(q, start=0, end=1)
    Hq = op.Shape(q, start=1, end=2)
    D = op.Shape(q, start=3, end=4)
    Hkv = op.Shape(centroids, start=1, end=2)
    K = op.Shape(centroids, start=2, end=3)
    G = op.Div(Hq, Hkv)
    # P query heads per selection row: 1 (per query head) or the group (its fp32 sum ranks the clusters)
    P = op.Where(op.Greater(op.Constant(value_int=per_query_head), zero), one, G)
    Hsel = op.Div(Hq, P)
    qvec = op.ReduceSum(op.Reshape(op.Cast(q, to=FLOAT.dtype), op.Concat(B, Hsel, P, D, axis=0)),
                        op.Constant(value_ints=[2]), keepdims=1)  # [B, Hsel, 1, D]
    head = op.Div(op.Mul(op.Range(zero, op.Squeeze(Hsel), one), P), G)  # [Hsel]: the KV head of each row
    cent = op.Cast(op.Gather(centroids, head, axis=1), to=FLOAT.dtype)  # [B, Hsel, K, D]
    score = op.Squeeze(op.MatMul(qvec, op.Transpose(cent, perm=[0, 1, 3, 2])), [2])  # [B, Hsel, K]
    size = op.Cast(op.Gather(cluster_size, head, axis=1), to=INT64.dtype)
    ncl = op.Cast(op.Gather(n_clusters, head, axis=1), to=INT64.dtype)  # [B, Hsel]
    kr = op.Range(zero, op.Squeeze(K), one)
    w = op.Where(op.And(op.Less(kr, op.Unsqueeze(ncl, [2])), op.Greater(size, zero)), size, zero)
    b_sel = op.Min(op.Max(op.Sub(op.Gather(budget, zero), op.Constant(value_int=n_sink)), zero),
                   op.Constant(value_int=max_selected))
    _, order = op.TopK(score, K, axis=2, largest=1, sorted=1)  # descending, ties: the lower id first
    ws = op.GatherElements(w, order, axis=2)
    take_sorted = op.Min(ws, op.Max(op.Sub(b_sel, op.Sub(op.CumSum(ws, two), ws)), zero))
    take = op.ScatterElements(op.Mul(w, zero), order, take_sorted, axis=2)  # back in id order
    incl = op.CumSum(take, two)  # id-order output offsets
    excl = op.Sub(incl, take)
    M = op.Constant(value_int=max_selected)
    p = op.Range(zero, M, one)  # [M]
    # the cluster holding output position p (searchsorted(incl, p, right=True) for p < the total taken), in
    # O(M + K): the taken clusters' ids packed in id order; a 1 at each taken cluster's first position (distinct:
    # takes are > 0), so a CumSum over the positions counts the taken clusters begun by p, i.e. p's owner's rank
    taken = op.Greater(take, zero)
    rows = op.Shape(take, start=0, end=2)  # [B, Hsel]
    K1 = op.Squeeze(K)
    to_rank = op.Where(taken, op.Sub(op.CumSum(op.Cast(taken, to=INT64.dtype), two), one), op.Add(kr, K))
    ids = op.Slice(op.ScatterElements(op.Expand(op.Concat(kr, kr, axis=0), op.Concat(rows, op.Add(K, K), axis=0)),
                                      to_rank, op.Expand(kr, op.Shape(take)), axis=2),
                   op.Constant(value_ints=[0]), K, op.Constant(value_ints=[2]))  # [B, Hsel, K]: k of rank r
    M1 = op.Unsqueeze(M, [0])
    marks = op.ScatterElements(op.Expand(zero, op.Concat(rows, op.Add(M1, K), axis=0)),
                               op.Where(taken, excl, op.Add(kr, M)), op.Cast(taken, to=INT64.dtype), axis=2)
    began = op.CumSum(op.Slice(marks, op.Constant(value_ints=[0]), M1, op.Constant(value_ints=[2])), two)
    owner = op.GatherElements(ids, op.Min(op.Max(op.Sub(began, one), zero), op.Sub(K1, one)), axis=2)  # [B, Hsel, M]
    start = op.Cast(op.Gather(cluster_start, head, axis=1), to=INT64.dtype)
    src = op.Sub(op.Add(op.GatherElements(start, owner, axis=2), p), op.GatherElements(excl, owner, axis=2))
    total = op.Slice(incl, op.Sub(K, one), K, op.Constant(value_ints=[2]))  # [B, Hsel, 1]
    used = op.Less(p, total)
    memb = op.Cast(op.Gather(members, head, axis=1), to=INT64.dtype)  # [B, Hsel, C]
    middle = op.Where(used, op.GatherElements(memb, op.Where(used, src, zero), axis=2), neg_one)
    sinks = op.Slice(memb, op.Constant(value_ints=[0]), op.Unsqueeze(op.Constant(value_int=n_sink), [0]),
                     op.Constant(value_ints=[2]))
    slot = op.Add(op.Unsqueeze(op.Gather(cluster_end, head, axis=1), [2]),
                  op.Range(zero, op.Constant(value_int=window), one))
    win = op.Where(op.Less(slot, op.Unsqueeze(op.Gather(fill, head, axis=1), [2])), slot, neg_one)
    return op.Cast(op.Concat(sinks, middle, win, axis=2), to=INT32.dtype)


@script(kv, default_opset=op)
def indexed_attention(q: TFloat, keys: TFloat, values: TFloat, bias: FLOAT, index: INT32, scale: float,
                      softcap: float = 0.0) -> TFloat:
    zero = op.Constant(value_int=0)
    neg_inf = op.Constant(value_float=float("-inf"))
    fzero = op.Constant(value_float=0.0)
    B = op.Shape(q, start=0, end=1)
    Hq = op.Shape(q, start=1, end=2)
    T = op.Shape(q, start=2, end=3)
    D = op.Shape(q, start=3, end=4)
    Hkv = op.Shape(keys, start=1, end=2)
    Hsel = op.Shape(index, start=1, end=2)
    S = op.Shape(index, start=2, end=3)
    G = op.Div(Hq, Hkv)
    per = op.Div(Hsel, Hkv)  # slot lists per KV head: 1 (shared by the group) or G
    idx = op.Cast(index, to=INT64.dtype)
    valid = op.Reshape(op.GreaterOrEqual(idx, zero), op.Concat(B, Hkv, per, S, axis=0))  # [B, Hkv, per, S]
    flat = op.Reshape(op.Max(idx, zero), op.Concat(B, Hkv, op.Mul(per, S), axis=0))
    flat4 = op.Expand(op.Unsqueeze(flat, [3]), op.Concat(B, Hkv, op.Mul(per, S), D, axis=0))
    shape5 = op.Concat(B, Hkv, per, S, D, axis=0)
    k_sel = op.Reshape(op.Cast(op.GatherElements(keys, flat4, axis=2), to=FLOAT.dtype), shape5)
    v_sel = op.Reshape(op.Cast(op.GatherElements(values, flat4, axis=2), to=FLOAT.dtype), shape5)
    v_sel = op.Where(op.Unsqueeze(valid, [4]), v_sel, fzero)  # a -1 entry's gathered slot 0 weighs nothing
    b_sel = op.Where(valid, op.Reshape(op.GatherElements(bias, flat, axis=2), op.Shape(valid)), neg_inf)
    qf = op.Reshape(op.Cast(q, to=FLOAT.dtype), op.Concat(B, Hkv, G, T, D, axis=0))
    scaled = op.Mul(op.MatMul(qf, op.Transpose(k_sel, perm=[0, 1, 2, 4, 3])),
                    op.Constant(value_float=scale))  # [B, Hkv, G, T, S] (per broadcast to G)
    cap = op.Constant(value_float=softcap)
    capping = op.Greater(cap, fzero)
    cap_safe = op.Where(capping, cap, op.Constant(value_float=1.0))
    capped = op.Where(capping, op.Mul(op.Tanh(op.Div(scaled, cap_safe)), cap_safe), scaled)
    logits = op.Where(op.Unsqueeze(valid, [3]), op.Add(capped, op.Unsqueeze(b_sel, [3])), neg_inf)
    top = op.ReduceMax(logits, op.Constant(value_ints=[-1]), keepdims=1)
    row_max = op.Where(op.IsInf(top), fzero, top)
    p = op.Exp(op.Sub(logits, row_max))
    denom = op.ReduceSum(p, op.Constant(value_ints=[-1]), keepdims=1)
    out = op.Div(op.MatMul(p, v_sel), op.Max(denom, op.Constant(value_float=1.1754943508222875e-38)))
    return op.CastLike(op.Reshape(out, op.Concat(B, Hq, T, D, axis=0)), q)


FUNCTIONS = {"kmeans_cluster": kmeans_cluster, "select_clusters": select_clusters,
             "indexed_attention": indexed_attention}
CALLS = {"kmeans_cluster": ("mix32",)}  # functions whose bodies call other kvrewrite functions
HELPERS = {"mix32": mix32}
