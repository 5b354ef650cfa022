"""The kvrewrite ops as ONNX functions of the custom domain "kvrewrite" (onnxscript).

Each function's body is the op's reference computation in standard ONNX ops (opset 18), so the
exported model carries it as a model-local FunctionProto: onnxruntime runs (inlines) it as it is, and a backend
with a native kernel for kvrewrite::<op> can substitute its own by domain and name. The state ops
are the functional forms (kvrewrite.export.functional): they return the updated
(keys, values, bias, slot_pos, fill) instead of writing them.

    kvrewrite::clustered_attention(q, keys, values, bias, slot_pos, cache_position; scale, window, past_only, softcap)
        -> out
        past_only (0/1, default 0): the producer's promise that no used slot lies after a query; the function
        body computes the same either way (it applies the causal mask), a native kernel may skip the positions.
        softcap (float, default 0 = none): logits softcap * tanh(scale * q·k / softcap), the bias and mask added
        after (Gemma-2); the node carries it only when > 0, so the graphs of other models are as before.
    kvrewrite::cache_append(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid)
        -> (keys, values, bias, slot_pos, fill)
    kvrewrite::evict_to_budget(keys, values, bias, slot_pos, fill, budget; n_sink) -> (keys, ..., fill)
    kvrewrite::chelsea_compress(keys, values, bias, slot_pos, fill, budget, rates;
                                n_sink, n_recent, chunk, r_steps, outlier_mask) -> (keys, ..., fill)
        rates: float64 [r_init, r_alpha, r_min, 1e-9] (ONNX float attributes are float32, the merge
        count floor(r * M + 1e-9) needs the reference's doubles); outlier_mask: bit h = KV head h.
    kvrewrite::accumulate_attention(q, keys, bias, slot_pos, cache_position, score; scale, window, window_mode,
                                    last) -> score
        window_mode 0: mode "all" (score += column sums over every query and the group); 1: mode "window"
        (the last `last` queries, averaged over the group; set when T > 1, added when T = 1).
    kvrewrite::evict_by_score(keys, values, bias, slot_pos, fill, budget, score, order, ratio;
                              n_recent, pool, reset_score) -> (keys, ..., fill, score, order)
        ratio: float64 [recent_ratio] (the recent count floor(recent_ratio * B) needs the reference's double);
        order: int32, the slots' temporal order (kvrewrite/kernels/evict_by_score.py).

    kvrewrite::kmeans_cluster, select_clusters, indexed_attention (ClusterKV): kvrewrite/export/onnx_clusterkv.py.
    kvrewrite::kvmerger_compress, and the helper top_flags it calls (KVMerger): kvrewrite/export/onnx_kvmerger.py.
    kvrewrite::sketch_attention (ClusterGen) and kcenter_compress (clustergen-kcenter): onnx_clustergen.py
    (kvrewrite::clustergen_fold has none: onnx_export.UNSUPPORTED).
    kvrewrite::ems_append, ems_attention, ems_compress (EMS) and the stages ems_compress calls (ems_score,
    ems_partition, ems_redundancy, ems_merge, with the helpers ems_tbm_count and ems_segment_sum): onnx_ems.py.

Numerics: attention computes in fp32 (MatMul instead of the reference's einsum: rounding only), and so
does accumulate_attention (exp(l - max) / sum instead of exp(l - lse): rounding only); cache_append,
evict_to_budget and evict_by_score are scatters, gathers and ranks, exact (TopK breaks ties toward the
lower index, the reference's stable sort does the same). chelsea_compress follows the
reference step by step, all rows at once: the valid slots are packed, then a Loop runs CSM rounds
while some due row is above its target, each row with its own length and merge count (masks replace
the reference's grouping of rows by length); the edge ranking is TopK (ties to the earlier edge, as
pinned_ties()), the star sums are ScatterElements(add) in ranking order, like scatter_add. On the
tests' random states it matches the reference bit for bit.
"""
from typing import TypeVar, Union

import torch
from onnxscript import BFLOAT16, BOOL, DOUBLE, FLOAT, FLOAT16, INT32, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

import kvrewrite.export.functional  # noqa: F401  (registers kvrewrite_export::)
from kvrewrite.export import onnx_clustergen, onnx_clusterkv, onnx_ems, onnx_kvmerger
from kvrewrite.kernels.kvmerger_compress import BUDGET_MODES, READINGS, SIGMA_MODES, VALUES_MODES

DOMAIN = "kvrewrite"
kv = Opset(DOMAIN, 1)
TFloat = TypeVar("TFloat", bound=Union[FLOAT, FLOAT16, BFLOAT16])  # q, keys, values: the model dtype


@script(kv, default_opset=op)
def clustered_attention(q: TFloat, keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, cache_position: INT64,
                        scale: float, window: int, past_only: int = 0, softcap: float = 0.0) -> TFloat:
    neg_inf = op.Constant(value_float=float("-inf"))
    B = op.Shape(q, start=0, end=1)
    Hq = op.Shape(q, start=1, end=2)
    T = op.Shape(q, start=2, end=3)
    D = op.Shape(q, start=3, end=4)
    Hkv = op.Shape(keys, start=1, end=2)
    G = op.Div(Hq, Hkv)
    qf = op.Reshape(op.Cast(q, to=FLOAT.dtype), op.Concat(B, Hkv, op.Mul(G, T), D, axis=0))  # row g*T + t
    kf = op.Cast(keys, to=FLOAT.dtype)
    vf = op.Cast(values, to=FLOAT.dtype)
    sc = op.Constant(value_float=scale)
    scaled = op.Mul(op.MatMul(qf, op.Transpose(kf, perm=[0, 1, 3, 2])), sc)
    # soft cap (softcap > 0): softcap * tanh(scaled / softcap), HF's order; at 0 Where keeps `scaled` as is
    cap = op.Constant(value_float=softcap)
    fzero = op.Constant(value_float=0.0)
    capping = op.Greater(cap, fzero)
    cap_safe = op.Where(capping, cap, op.Constant(value_float=1.0))
    capped = op.Where(capping, op.Mul(op.Tanh(op.Div(scaled, cap_safe)), cap_safe), scaled)
    raw = op.Add(capped, op.Unsqueeze(bias, [2]))
    qp = op.Reshape(op.Tile(cache_position, G), op.Constant(value_ints=[1, 1, -1, 1]))
    sp = op.Unsqueeze(slot_pos, [2])
    w = op.Constant(value_int=window)
    zero = op.Constant(value_int=0)
    in_window = op.Or(op.LessOrEqual(w, zero), op.Greater(sp, op.Sub(qp, w)))
    visible = op.And(op.LessOrEqual(sp, qp), in_window)
    logits = op.Where(visible, raw, neg_inf)
    top = op.ReduceMax(logits, op.Constant(value_ints=[-1]), keepdims=1)
    row_max = op.Where(op.IsInf(top), op.Constant(value_float=0.0), top)
    p = op.Exp(op.Sub(logits, row_max))
    denom = op.ReduceSum(p, op.Constant(value_ints=[-1]), keepdims=1)
    tiny = op.Constant(value_float=1.1754943508222875e-38)
    grouped = op.Div(op.MatMul(p, vf), op.Max(denom, tiny))
    out = op.Reshape(grouped, op.Concat(B, Hq, T, D, axis=0))
    return op.CastLike(out, q)


@script(kv, default_opset=op)
def cache_append(keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, fill: INT64, k_new: TFloat, v_new: TFloat,
                 cache_position: INT64, token_valid: BOOL) -> tuple[TFloat, TFloat, FLOAT, INT64, INT64]:
    T = op.Shape(k_new, start=2, end=3)
    ar = op.Range(op.Constant(value_int=0), op.Squeeze(T), op.Constant(value_int=1))
    idx = op.Add(op.Unsqueeze(fill, [2]), ar)  # [B, Hkv, T]
    idx4 = op.Expand(op.Unsqueeze(idx, [3]), op.Shape(k_new))
    keys2 = op.ScatterElements(keys, idx4, op.CastLike(k_new, keys), axis=2)
    values2 = op.ScatterElements(values, idx4, op.CastLike(v_new, values), axis=2)
    tok_bias = op.Where(token_valid, op.Constant(value_float=0.0), op.Constant(value_float=float("-inf")))
    new_bias = op.Expand(op.Unsqueeze(tok_bias, [1]), op.Shape(idx))
    bias2 = op.ScatterElements(bias, idx, new_bias, axis=2)
    pos = op.Expand(op.Reshape(cache_position, op.Constant(value_ints=[1, 1, -1])), op.Shape(idx))
    slot_pos2 = op.ScatterElements(slot_pos, idx, pos, axis=2)
    fill2 = op.Add(fill, T)
    return keys2, values2, bias2, slot_pos2, fill2


@script(kv, default_opset=op)
def evict_to_budget(keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, fill: INT64, budget: INT64,
                    n_sink: int) -> tuple[TFloat, TFloat, FLOAT, INT64, INT64]:
    one = op.Constant(value_int=1)
    C = op.Shape(keys, start=2, end=3)
    ar = op.Range(op.Constant(value_int=0), op.Squeeze(C), one)  # [C]
    fill3 = op.Unsqueeze(fill, [2])  # [B, H, 1]
    valid = op.And(op.Less(ar, fill3), op.Greater(bias, op.Constant(value_float=float("-inf"))))
    vi = op.Cast(valid, to=INT64.dtype)
    rank = op.Sub(op.CumSum(vi, op.Constant(value_int=2)), one)
    L = op.ReduceSum(vi, op.Constant(value_ints=[2]), keepdims=1)
    target = op.Gather(budget, op.Constant(value_int=0))
    threshold = op.Gather(budget, op.Constant(value_int=1))
    ns = op.Min(op.Constant(value_int=n_sink), target)
    ends = op.Or(op.Less(rank, ns), op.GreaterOrEqual(rank, op.Sub(L, op.Sub(target, ns))))
    keep = op.And(valid, op.Or(op.Not(op.Greater(L, target)), ends))
    ki = op.Cast(keep, to=INT64.dtype)
    new_pos = op.Sub(op.CumSum(ki, op.Constant(value_int=2)), one)
    L_new = op.ReduceSum(ki, op.Constant(value_ints=[2]), keepdims=1)
    # source slot of every destination slot: kept slots scatter to their packed place, the others
    # to a unique place past C; destinations past the packed ones keep their own slot.
    dest = op.Where(keep, new_pos, op.Add(ar, C))
    rows = op.Shape(fill)  # [B, H]
    base = op.Expand(op.Concat(ar, ar, axis=0), op.Concat(rows, op.Add(C, C), axis=0))
    src_ext = op.ScatterElements(base, dest, op.Expand(ar, op.Concat(rows, C, axis=0)), axis=2)
    packed = op.Slice(src_ext, op.Constant(value_ints=[0]), C, op.Constant(value_ints=[2]))
    due = op.GreaterOrEqual(fill3, threshold)
    src = op.Where(due, packed, ar)
    src4 = op.Expand(op.Unsqueeze(src, [3]), op.Shape(keys))
    keys2 = op.GatherElements(keys, src4, axis=2)
    values2 = op.GatherElements(values, src4, axis=2)
    slot_pos2 = op.GatherElements(slot_pos, src, axis=2)
    cleared = op.And(due, op.GreaterOrEqual(ar, L_new))
    bias2 = op.Where(cleared, op.Constant(value_float=float("-inf")), op.GatherElements(bias, src, axis=2))
    fill2 = op.Where(op.Squeeze(due, [2]), op.Squeeze(L_new, [2]), fill)
    return keys2, values2, bias2, slot_pos2, fill2


# Per round and row: M = L - n_sink - n_recent middle slots; chunk id and A/B parity of each middle slot;
# cosine similarities of every A to the B of its chunk (one [C, C] product, masked); best edge per A;
# rank of the edges (TopK); the first m = min(n_merge, edges) merge into their B (ScatterElements add,
# max for the position); the middle of merging rows becomes (sum n k) / sum n; survivors are repacked.
@script(kv, default_opset=op)
def chelsea_compress(keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, fill: INT64, budget: INT64,
                     rates: DOUBLE, n_sink: int, n_recent: int, chunk: int, r_steps: int,
                     outlier_mask: int) -> tuple[TFloat, TFloat, FLOAT, INT64, INT64]:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    neg_inf = op.Constant(value_float=float("-inf"))
    fzero = op.Constant(value_float=0.0)
    C = op.Shape(keys, start=2, end=3)
    H = op.Shape(keys, start=1, end=2)
    ar = op.Range(zero, op.Squeeze(C), one)  # [C]
    rows = op.Shape(fill)  # [B, H]
    CC = op.Concat(rows, op.Add(C, C), axis=0)
    RC = op.Concat(rows, C, axis=0)
    ar_rows = op.Expand(ar, RC)  # [B, H, C]
    base = op.Expand(op.Concat(ar, ar, axis=0), CC)
    target = op.Gather(budget, zero)
    threshold = op.Gather(budget, one)
    r_init = op.Gather(rates, zero)
    r_alpha = op.Gather(rates, one)
    r_min = op.Gather(rates, two)
    eps = op.Gather(rates, op.Constant(value_int=3))
    hs = op.Range(zero, op.Squeeze(H), one)
    bit = op.Mod(op.Div(op.Constant(value_int=outlier_mask), op.Pow(two, hs)), two)  # [H]
    due = op.And(op.GreaterOrEqual(fill, threshold), op.Equal(bit, zero))  # [B, H]
    # the valid slots of every row, packed at the front in slot (temporal) order
    valid = op.And(op.Less(ar, op.Unsqueeze(fill, [2])), op.Greater(bias, neg_inf))
    vi = op.Cast(valid, to=INT64.dtype)
    dest0 = op.Where(valid, op.Sub(op.CumSum(vi, two), one), op.Add(ar, C))
    src0 = op.Slice(op.ScatterElements(base, dest0, ar_rows, axis=2), op.Constant(value_ints=[0]), C,
                    op.Constant(value_ints=[2]))
    src04 = op.Expand(op.Unsqueeze(src0, [3]), op.Shape(keys))
    K = op.Cast(op.GatherElements(keys, src04, axis=2), to=FLOAT.dtype)
    V = op.Cast(op.GatherElements(values, src04, axis=2), to=FLOAT.dtype)
    n = op.Round(op.Exp(op.GatherElements(bias, src0, axis=2)))
    pos = op.GatherElements(slot_pos, src0, axis=2)
    L = op.ReduceSum(vi, op.Constant(value_ints=[2]), keepdims=0)  # [B, H]
    active = op.And(due, op.Greater(L, target))
    i = op.Constant(value_int=0)
    ns = op.Constant(value_int=n_sink)
    nr = op.Constant(value_int=n_recent)
    ch = op.Constant(value_int=chunk)
    rs = op.Constant(value_int=r_steps)
    go = op.Greater(op.ReduceMax(op.Cast(active, to=INT64.dtype), keepdims=0), zero)
    while go:
        M = op.Sub(op.Sub(L, ns), nr)  # [B, H]
        r = op.Max(op.Sub(r_init, op.Mul(r_alpha, op.Cast(op.Min(rs, i), to=DOUBLE.dtype))), r_min)
        nm = op.Cast(op.Floor(op.Add(op.Mul(r, op.Cast(M, to=DOUBLE.dtype)), eps)), to=INT64.dtype)
        nm = op.Min(op.Max(nm, one), op.Sub(L, target))
        q = op.Sub(ar, ns)  # [C]
        in_mid = op.And(op.GreaterOrEqual(q, zero), op.Less(q, op.Unsqueeze(M, [2])))  # [B, H, C]
        qc = op.Max(q, zero)
        cid = op.Div(qc, ch)
        par = op.Mod(op.Mod(qc, ch), two)
        is_a = op.And(in_mid, op.Equal(par, zero))
        is_b = op.And(in_mid, op.Equal(par, one))
        norm = op.Max(op.Sqrt(op.ReduceSum(op.Mul(K, K), op.Constant(value_ints=[3]), keepdims=1)),
                      op.Constant(value_float=1e-12))
        Kn = op.Div(K, norm)
        S = op.MatMul(Kn, op.Transpose(Kn, perm=[0, 1, 3, 2]))  # [B, H, C, C]
        same = op.Equal(op.Unsqueeze(cid, [1]), op.Unsqueeze(cid, [0]))  # [C, C]
        pair = op.And(op.And(op.Unsqueeze(is_a, [3]), op.Unsqueeze(is_b, [2])), same)
        Sm = op.Where(pair, S, neg_inf)
        best = op.ReduceMax(Sm, op.Constant(value_ints=[3]), keepdims=0)  # [B, H, C]
        arg = op.ArgMax(Sm, axis=3, keepdims=0, select_last_index=0)
        finite = op.Not(op.IsInf(best))
        nf = op.ReduceSum(op.Cast(finite, to=INT64.dtype), op.Constant(value_ints=[2]), keepdims=0)
        m = op.Where(active, op.Min(nm, nf), zero)  # [B, H]
        upd = op.Greater(m, zero)
        _, order = op.TopK(best, C, axis=2, largest=1, sorted=1)  # edges by similarity, ties to the earlier
        rank = op.ScatterElements(ar_rows, order, ar_rows, axis=2)
        sel = op.And(finite, op.Less(rank, op.Unsqueeze(m, [2])))
        sel_o = op.GatherElements(sel, order, axis=2)  # in ranking order
        tgt = op.Where(sel_o, op.GatherElements(arg, order, axis=2), order)  # unselected: add 0 to itself
        tgt4 = op.Expand(op.Unsqueeze(tgt, [3]), op.Shape(K))
        o4 = op.Expand(op.Unsqueeze(order, [3]), op.Shape(K))
        sel4 = op.Unsqueeze(sel_o, [3])
        w = op.Unsqueeze(n, [3])
        Ks = op.Mul(K, w)
        Vs = op.Mul(V, w)
        Ks2 = op.ScatterElements(Ks, tgt4, op.Where(sel4, op.GatherElements(Ks, o4, axis=2), fzero), axis=2,
                                 reduction="add")
        Vs2 = op.ScatterElements(Vs, tgt4, op.Where(sel4, op.GatherElements(Vs, o4, axis=2), fzero), axis=2,
                                 reduction="add")
        n2 = op.ScatterElements(n, tgt, op.Where(sel_o, op.GatherElements(n, order, axis=2), fzero), axis=2,
                                reduction="add")
        pos2 = op.ScatterElements(pos, tgt, op.Where(sel_o, op.GatherElements(pos, order, axis=2),
                                                    op.Constant(value_int=-1)), axis=2, reduction="max")
        change = op.And(in_mid, op.Unsqueeze(upd, [2]))  # the middle of the rows that merge this round
        change4 = op.Unsqueeze(change, [3])
        n2w = op.Unsqueeze(n2, [3])
        Kc = op.Where(change4, op.Div(Ks2, n2w), K)
        Vc = op.Where(change4, op.Div(Vs2, n2w), V)
        nc = op.Where(change, n2, n)
        pc = op.Where(change, pos2, pos)
        keep = op.And(op.Less(ar, op.Unsqueeze(L, [2])), op.Not(sel))
        dest = op.Where(keep, op.Sub(op.CumSum(op.Cast(keep, to=INT64.dtype), two), one), op.Add(ar, C))
        src = op.Slice(op.ScatterElements(base, dest, ar_rows, axis=2), op.Constant(value_ints=[0]), C,
                       op.Constant(value_ints=[2]))
        src4 = op.Expand(op.Unsqueeze(src, [3]), op.Shape(K))
        K = op.GatherElements(Kc, src4, axis=2)
        V = op.GatherElements(Vc, src4, axis=2)
        n = op.GatherElements(nc, src, axis=2)
        pos = op.GatherElements(pc, src, axis=2)
        L = op.Sub(L, m)
        i = op.Add(i, one)
        active = op.And(upd, op.Greater(L, target))
        go = op.Greater(op.ReduceMax(op.Cast(active, to=INT64.dtype), keepdims=0), zero)
    due3 = op.Unsqueeze(due, [2])
    written = op.And(due3, op.Less(ar, op.Unsqueeze(L, [2])))
    written4 = op.Unsqueeze(written, [3])
    keys2 = op.Where(written4, op.CastLike(K, keys), keys)
    values2 = op.Where(written4, op.CastLike(V, values), values)
    bias2 = op.Where(written, op.Log(n), op.Where(due3, neg_inf, bias))
    slot_pos2 = op.Where(written, pos, slot_pos)
    fill2 = op.Where(due, L, fill)
    return keys2, values2, bias2, slot_pos2, fill2



@script(kv, default_opset=op)
def accumulate_attention(q: TFloat, keys: TFloat, bias: FLOAT, slot_pos: INT64, cache_position: INT64, score: FLOAT,
                         scale: float, window: int, window_mode: int, last: int) -> FLOAT:
    neg_inf = op.Constant(value_float=float("-inf"))
    fzero = op.Constant(value_float=0.0)
    B = op.Shape(q, start=0, end=1)
    Hq = op.Shape(q, start=1, end=2)
    T = op.Shape(q, start=2, end=3)
    D = op.Shape(q, start=3, end=4)
    Hkv = op.Shape(keys, start=1, end=2)
    G = op.Div(Hq, Hkv)
    qf = op.Reshape(op.Cast(q, to=FLOAT.dtype), op.Concat(B, Hkv, op.Mul(G, T), D, axis=0))  # row g*T + t
    kf = op.Cast(keys, to=FLOAT.dtype)
    sc = op.Constant(value_float=scale)
    raw = op.Add(op.Mul(op.MatMul(qf, op.Transpose(kf, perm=[0, 1, 3, 2])), sc), op.Unsqueeze(bias, [2]))
    qp = op.Reshape(op.Tile(cache_position, G), op.Constant(value_ints=[1, 1, -1, 1]))
    sp = op.Unsqueeze(slot_pos, [2])
    w = op.Constant(value_int=window)
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    in_window = op.Or(op.LessOrEqual(w, zero), op.Greater(sp, op.Sub(qp, w)))
    logits = op.Where(op.And(op.LessOrEqual(sp, qp), in_window), raw, neg_inf)
    top = op.ReduceMax(logits, op.Constant(value_ints=[-1]), keepdims=1)
    row_max = op.Where(op.IsInf(top), fzero, top)
    e = op.Exp(op.Sub(logits, row_max))
    denom = op.ReduceSum(e, op.Constant(value_ints=[-1]), keepdims=1)
    p = op.Div(e, op.Max(denom, op.Constant(value_float=1.1754943508222875e-38)))  # a row seeing nothing: 0
    # weight of row g*T + t: 1 (mode all) or [t >= T - last] / G (mode window)
    t = op.Range(zero, op.Squeeze(op.Mul(G, T)), one)
    t = op.Mod(t, T)
    windowed = op.Constant(value_int=window_mode)
    in_last = op.Cast(op.GreaterOrEqual(t, op.Sub(T, op.Constant(value_int=last))), to=FLOAT.dtype)
    weight = op.Where(op.Greater(windowed, zero), op.Div(in_last, op.Cast(G, to=FLOAT.dtype)),
                      op.Constant(value_float=1.0))
    stat = op.ReduceSum(op.Mul(p, op.Unsqueeze(weight, [1])), op.Constant(value_ints=[2]), keepdims=0)  # [B, Hkv, C]
    replace = op.And(op.Greater(windowed, zero), op.Greater(T, one))
    return op.Where(replace, stat, op.Add(score, stat))


@script(kv, default_opset=op)
def evict_by_score(keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, fill: INT64, budget: INT64,
                   score: FLOAT, order: INT32, ratio: DOUBLE, n_recent: int, pool: int,
                   reset_score: int) -> tuple[TFloat, TFloat, FLOAT, INT64, INT64, FLOAT, INT32]:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    neg_inf = op.Constant(value_float=float("-inf"))
    fzero = op.Constant(value_float=0.0)
    C = op.Shape(keys, start=2, end=3)
    ar = op.Range(zero, op.Squeeze(C), one)  # [C]
    arC = op.Add(ar, C)  # past the slots: where the scatters below put what they drop
    rows = op.Shape(fill)  # [B, H]
    RC = op.Concat(rows, C, axis=0)
    CC = op.Concat(rows, op.Add(C, C), axis=0)
    ar_rows = op.Expand(ar, RC)
    fill3 = op.Unsqueeze(fill, [2])
    target = op.Gather(budget, zero)
    threshold = op.Gather(budget, one)
    due = op.GreaterOrEqual(fill3, threshold)  # [B, H, 1]
    # the row in temporal order: rank r is slot r + order[r]
    slot = op.Add(ar, op.Cast(order, to=INT64.dtype))
    valid = op.And(op.Less(ar, fill3), op.Greater(op.GatherElements(bias, slot, axis=2), neg_inf))
    vi = op.Cast(valid, to=INT64.dtype)
    rank = op.Sub(op.CumSum(vi, two), one)  # rank among the valid slots, oldest first
    L = op.ReduceSum(vi, op.Constant(value_ints=[2]), keepdims=1)
    scaled = op.Mul(op.Gather(ratio, zero), op.Cast(target, to=DOUBLE.dtype))
    recent = op.Min(op.Add(op.Constant(value_int=n_recent), op.Cast(op.Floor(scaled), to=INT64.dtype)), target)
    n_old = op.Max(op.Sub(L, recent), zero)
    old = op.And(valid, op.Less(rank, n_old))
    s = op.Where(old, op.GatherElements(score, slot, axis=2), neg_inf)
    # max-pool the older slots' scores in temporal order: pack them, take the max over `pool` neighbours
    # (a [C, pool] index window, out-of-range neighbours -inf), read each slot's pooled score back
    dest = op.Where(old, rank, arC)
    packed = op.Slice(op.ScatterElements(op.Expand(neg_inf, CC), dest, s, axis=2), op.Constant(value_ints=[0]), C,
                      op.Constant(value_ints=[2]))
    k = op.Constant(value_int=pool)
    offs = op.Sub(op.Range(zero, k, one), op.Div(k, two))  # [pool]
    nb = op.Add(op.Unsqueeze(ar, [1]), op.Unsqueeze(offs, [0]))  # [C, pool]
    inside = op.And(op.GreaterOrEqual(nb, zero), op.Less(nb, C))
    window = op.Gather(packed, op.Clip(nb, zero, op.Squeeze(op.Sub(C, one))), axis=2)  # [B, H, C, pool]
    pooled = op.ReduceMax(op.Where(inside, window, neg_inf), op.Constant(value_ints=[3]), keepdims=0)
    s = op.Where(old, op.GatherElements(pooled, op.Max(rank, zero), axis=2), neg_inf)
    _, top = op.TopK(s, C, axis=2, largest=1, sorted=1)  # ties: the lower index (the earlier rank) first
    place = op.ScatterElements(ar_rows, top, ar_rows, axis=2)
    keep = op.And(valid, op.Or(op.GreaterOrEqual(rank, n_old), op.Less(place, op.Sub(target, recent))))
    over = op.Greater(L, target)  # (no Where on bools: onnxruntime has no bool kernel for it)
    keep = op.And(op.Or(op.And(over, keep), op.And(op.Not(over), valid)), due)  # by rank
    ki = op.Cast(keep, to=INT64.dtype)
    L_new = op.ReduceSum(ki, op.Constant(value_ints=[2]), keepdims=1)
    # compaction: the kept slots at or past L_new (movers, slot order) fill the slots below it not kept (holes)
    kept_at = op.ScatterElements(op.Expand(zero, RC), slot, ki, axis=2)  # by slot
    below = op.Less(ar, L_new)
    hole = op.And(below, op.Equal(kept_at, zero))
    mover = op.And(op.Not(below), op.Equal(kept_at, one))
    hole_dest = op.Where(hole, op.Sub(op.CumSum(op.Cast(hole, to=INT64.dtype), two), one), arC)
    holes = op.Slice(op.ScatterElements(op.Expand(zero, CC), hole_dest, ar_rows, axis=2),
                     op.Constant(value_ints=[0]), C, op.Constant(value_ints=[2]))  # the j-th hole at j
    nth = op.Max(op.Sub(op.CumSum(op.Cast(mover, to=INT64.dtype), two), one), zero)
    to_hole = op.GatherElements(holes, nth, axis=2)
    base = op.Expand(op.Concat(ar, ar, axis=0), CC)
    src = op.Slice(op.ScatterElements(base, op.Where(mover, to_hole, arC), ar_rows, axis=2),
                   op.Constant(value_ints=[0]), C, op.Constant(value_ints=[2]))
    # order: the j-th kept rank's new slot minus j below L_new, 0 past it (rows not due keep theirs)
    new_rank = op.Where(keep, op.Sub(op.CumSum(ki, two), one), arC)
    delta = op.Sub(op.GatherElements(op.Where(mover, to_hole, ar), slot, axis=2), new_rank)
    new_order = op.Slice(op.ScatterElements(op.Expand(zero, CC), new_rank, delta, axis=2),
                         op.Constant(value_ints=[0]), C, op.Constant(value_ints=[2]))
    order2 = op.Where(due, op.Cast(new_order, to=INT32.dtype), order)
    src4 = op.Expand(op.Unsqueeze(src, [3]), op.Shape(keys))
    freed = op.And(due, op.GreaterOrEqual(ar, L_new))
    keys2 = op.GatherElements(keys, src4, axis=2)
    values2 = op.GatherElements(values, src4, axis=2)
    slot_pos2 = op.GatherElements(slot_pos, src, axis=2)
    bias2 = op.Where(freed, neg_inf, op.GatherElements(bias, src, axis=2))
    moved = op.Where(freed, fzero, op.GatherElements(score, src, axis=2))
    restart = op.And(due, op.Greater(op.Constant(value_int=reset_score), zero))
    score2 = op.Where(restart, fzero, moved)
    fill2 = op.Where(op.Squeeze(due, [2]), op.Squeeze(L_new, [2]), fill)
    return keys2, values2, bias2, slot_pos2, fill2, score2, order2


FUNCTIONS = {"clustered_attention": clustered_attention, "cache_append": cache_append,
             "evict_to_budget": evict_to_budget, "chelsea_compress": chelsea_compress,
             "accumulate_attention": accumulate_attention, "evict_by_score": evict_by_score,
             **onnx_clusterkv.FUNCTIONS, **onnx_kvmerger.FUNCTIONS, **onnx_clustergen.FUNCTIONS,
             **onnx_ems.FUNCTIONS}
# functions whose bodies call other kvrewrite functions
CALLS = {**onnx_clusterkv.CALLS, **onnx_kvmerger.CALLS, **onnx_clustergen.CALLS, **onnx_ems.CALLS}
HELPERS = {**onnx_clusterkv.HELPERS, **onnx_kvmerger.HELPERS, **onnx_clustergen.HELPERS, **onnx_ems.HELPERS}


def fixed_proto(fn):
    """fn's FunctionProto with every Loop's outer outputs put in the order of its body's outputs:
    onnxscript 0.7 names the outer outputs of a `while` in set order, not in the carried order."""
    proto = fn.to_function_proto()
    for node in proto.node:
        if node.op_type != "Loop":
            continue
        body = next(a.g for a in node.attribute if a.name == "body")
        carried = [i.name.rsplit("_", 1)[0] for i in body.input[2:]]
        by_var = {o.rsplit("_", 1)[0]: o for o in node.output}
        if sorted(by_var) != sorted(carried) or len(by_var) != len(node.output):
            raise RuntimeError(f"cannot match the Loop outputs {list(node.output)} to its carried values {carried}")
        del node.output[:]
        node.output.extend(by_var[v] for v in carried)
    return proto


def function_protos(names=None) -> list:
    """The FunctionProtos the exported models carry (domain "kvrewrite", version 1), all or `names`, with the
    helper functions their bodies call (kmeans_cluster's mix32, kvmerger_compress's top_flags, ems_compress's
    stages)."""
    picked = [name for name in FUNCTIONS if names is None or name in names]
    helpers = sorted({h for name in picked for h in CALLS.get(name, ())} - set(picked))  # each function once
    return [fixed_proto(FUNCTIONS[name]) for name in picked] + [fixed_proto(HELPERS[h]) for h in helpers]


# -- the nodes: torch.onnx.ops.symbolic emits a "kvrewrite::<op>" node during export -------------------
# (the functions are attached to the model afterwards: torch.onnx.export's opset conversion inlines every
# model-local function it finds, which would dissolve the custom-domain nodes into plain ONNX)

def _state_like(*tensors):
    return dict(dtypes=[t.dtype for t in tensors], shapes=[t.shape for t in tensors], version=1)


def sym_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only=False,
                            softcap=0.0):
    attrs = {"scale": float(scale), "window": int(window), "past_only": int(past_only)}
    if softcap:  # 0 (no cap) is the function's default: the node stays as it was before the attribute existed
        attrs["softcap"] = float(softcap)
    return torch.onnx.ops.symbolic(f"{DOMAIN}::clustered_attention", [q, keys, values, bias, slot_pos, cache_position],
                                   attrs, dtype=q.dtype, shape=q.shape, version=1)


def sym_cache_append(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid):
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::cache_append", [keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid],
        {}, **_state_like(keys, values, bias, slot_pos, fill)))


def sym_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink):
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::evict_to_budget", [keys, values, bias, slot_pos, fill, budget], {"n_sink": int(n_sink)},
        **_state_like(keys, values, bias, slot_pos, fill)))


def sym_chelsea_compress(keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps,
                         r_min, outlier_mask):
    # the rates travel as a float64 tensor: ONNX float attributes are float32, and n_merge = floor(r * M + 1e-9)
    # must see the reference's double-precision r
    rates = torch.tensor([r_init, r_alpha, r_min, 1e-9], dtype=torch.float64, device=keys.device)
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::chelsea_compress", [keys, values, bias, slot_pos, fill, budget, rates],
        {"n_sink": int(n_sink), "n_recent": int(n_recent), "chunk": int(chunk), "r_steps": int(r_steps),
         "outlier_mask": int(outlier_mask)}, **_state_like(keys, values, bias, slot_pos, fill)))


def sym_accumulate_attention(q, keys, bias, slot_pos, cache_position, score, scale, window, mode, last=0):
    attrs = {"scale": float(scale), "window": int(window), "window_mode": int(mode == "window"), "last": int(last)}
    return torch.onnx.ops.symbolic(f"{DOMAIN}::accumulate_attention", [q, keys, bias, slot_pos, cache_position, score],
                                   attrs, dtype=score.dtype, shape=score.shape, version=1)


def sym_evict_by_score(keys, values, bias, slot_pos, fill, budget, score, order, n_recent, recent_ratio=0.0, pool=1,
                       reset_score=False):
    # the ratio travels as a float64 tensor: floor(recent_ratio * B) must see the reference's double
    ratio = torch.tensor([recent_ratio], dtype=torch.float64, device=keys.device)
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::evict_by_score", [keys, values, bias, slot_pos, fill, budget, score, order, ratio],
        {"n_recent": int(n_recent), "pool": int(pool), "reset_score": int(reset_score)},
        **_state_like(keys, values, bias, slot_pos, fill, score, order)))


def sym_kmeans_cluster(keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start, members,
                       n_clusters, cluster_end, n_sink, tokens_per_cluster, window, window_clusters, iters, seed,
                       head_offset=0):
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::kmeans_cluster", [keys, values, bias, slot_pos, fill, budget, centroids, cluster_size,
                                      cluster_start, members, n_clusters, cluster_end],
        {"n_sink": int(n_sink), "tokens_per_cluster": int(tokens_per_cluster), "window": int(window),
         "window_clusters": int(window_clusters), "iters": int(iters), "seed": int(seed),
         "head_offset": int(head_offset)},
        **_state_like(centroids, cluster_size, cluster_start, members, n_clusters, cluster_end)))


def sym_select_clusters(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters, cluster_end,
                        n_sink, max_selected, window, per_query_head):
    Hsel = q.shape[1] if per_query_head else centroids.shape[1]
    return torch.onnx.ops.symbolic(
        f"{DOMAIN}::select_clusters", [q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters,
                                       cluster_end],
        {"n_sink": int(n_sink), "max_selected": int(max_selected), "window": int(window),
         "per_query_head": int(per_query_head)},
        dtype=torch.int32, shape=(q.shape[0], Hsel, n_sink + max_selected + window), version=1)


def sym_indexed_attention(q, keys, values, bias, index, scale, softcap=0.0):
    attrs = {"scale": float(scale)}
    if softcap:  # 0 (no cap) is the function's default
        attrs["softcap"] = float(softcap)
    return torch.onnx.ops.symbolic(f"{DOMAIN}::indexed_attention", [q, keys, values, bias, index], attrs,
                                   dtype=q.dtype, shape=q.shape, version=1)


def sym_kvmerger_compress(keys, values, bias, slot_pos, fill, budget, score, degree, deficit, recent_ratio=0.34,
                          hh_ratio=0.24, n_sink=0, epsilon=0.75, sigma=5.0, sigma_mode="fixed", values_mode="scale",
                          reading="chain", budget_mode="exact"):
    # the ratios travel as a float64 tensor: floor(ratio * B) must see the reference's doubles; the string options
    # as their index in the op module's tuples (onnx_kvmerger's docstring)
    ratios = torch.tensor([recent_ratio, hh_ratio], dtype=torch.float64, device=keys.device)
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::kvmerger_compress", [keys, values, bias, slot_pos, fill, budget, score, degree, deficit, ratios],
        {"n_sink": int(n_sink), "epsilon": float(epsilon), "sigma": float(sigma),
         "sigma_mode": SIGMA_MODES.index(sigma_mode), "values_mode": VALUES_MODES.index(values_mode),
         "reading": READINGS.index(reading), "budget_mode": BUDGET_MODES.index(budget_mode)},
        **_state_like(keys, values, bias, slot_pos, fill, score, degree, deficit)))


def sym_sketch_attention(q, keys, values, bias, slot_pos, cache_position, role, scale, past_only=False, softcap=0.0):
    if softcap:  # the op itself refuses a cap (ClusterGen refuses capped layers): a graph cannot hold one
        raise ValueError(f"kvrewrite::sketch_attention: softcap must be 0, got {softcap}; the ONNX function has none")
    return torch.onnx.ops.symbolic(f"{DOMAIN}::sketch_attention",
                                   [q, keys, values, bias, slot_pos, cache_position, role],
                                   {"scale": float(scale), "past_only": int(past_only)}, dtype=q.dtype, shape=q.shape,
                                   version=1)


def sym_kcenter_compress(keys, values, bias, slot_pos, fill, budget, recent_ratio=0.5):
    # the ratio travels as a float64 tensor: floor(recent_ratio * B) must see the reference's double
    ratio = torch.tensor([recent_ratio], dtype=torch.float64, device=keys.device)
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::kcenter_compress", [keys, values, bias, slot_pos, fill, budget, ratio], {},
        **_state_like(keys, values, bias, slot_pos, fill)))


def sym_ems_append(keys, bias, fill, k_pre, cache_position, token_valid, entry_start, raw_keys, lut, key_scale,
                   token_pos, slot_order, slot_fill):
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::ems_append", [keys, bias, fill, k_pre, cache_position, token_valid, entry_start, raw_keys, lut,
                                  key_scale, token_pos, slot_order, slot_fill], {},
        **_state_like(entry_start, raw_keys, lut, key_scale, token_pos, slot_order, slot_fill)))


def sym_ems_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past,
                      s_loc_cur, slot_fill, win_count, scale, past_only, softcap, l_win):
    like = _state_like(q, s_glo, s_loc_past, s_loc_cur, win_count)
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::ems_attention", [q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale,
                                     s_glo, s_loc_past, s_loc_cur, slot_fill, win_count],
        {"scale": float(scale), "past_only": int(past_only), "softcap": float(softcap), "l_win": int(l_win)}, **like))


def sym_ems_compress(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
                     slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, l_win, pool, gamma, tau):
    # gamma travels as a float64 tensor (N_tbm = floor((gamma - 1) * B) must see the reference's double; inf allowed);
    # merging = tau < 1, decided here in double (a float32 tau attribute may round to 1)
    gam = torch.tensor([gamma], dtype=torch.float64, device=keys.device)
    written = (keys, values, bias, slot_pos, fill, entry_start, raw_keys, lut, key_scale, token_pos, slot_order, s_glo,
               s_loc_past, s_loc_cur, slot_fill)
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::ems_compress", [keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale,
                                    token_pos, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, gam],
        {"l_win": int(l_win), "pool": int(pool), "tau": float(tau), "merging": int(tau < 1)}, **_state_like(*written)))


SYMBOLIC = {
    torch.ops.kvrewrite_export.ems_append.default: sym_ems_append,
    torch.ops.kvrewrite_export.ems_attention.default: sym_ems_attention,
    torch.ops.kvrewrite_export.ems_compress.default: sym_ems_compress,
    torch.ops.kvrewrite.sketch_attention.default: sym_sketch_attention,
    torch.ops.kvrewrite_export.kcenter_compress.default: sym_kcenter_compress,
    torch.ops.kvrewrite_export.kvmerger_compress.default: sym_kvmerger_compress,
    torch.ops.kvrewrite_export.kmeans_cluster.default: sym_kmeans_cluster,
    torch.ops.kvrewrite.select_clusters.default: sym_select_clusters,
    torch.ops.kvrewrite.indexed_attention.default: sym_indexed_attention,
    torch.ops.kvrewrite_export.accumulate_attention.default: sym_accumulate_attention,
    torch.ops.kvrewrite_export.evict_by_score.default: sym_evict_by_score,
    torch.ops.kvrewrite.clustered_attention.default: sym_clustered_attention,
    torch.ops.kvrewrite_export.cache_append.default: sym_cache_append,
    torch.ops.kvrewrite_export.evict_to_budget.default: sym_evict_to_budget,
    torch.ops.kvrewrite_export.chelsea_compress.default: sym_chelsea_compress,
}
