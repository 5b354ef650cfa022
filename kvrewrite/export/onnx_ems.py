"""EMS's ops as ONNX functions of the domain "kvrewrite" (onnxscript, opset 18); onnx_ops.py lists them with the others
(FUNCTIONS, SYMBOLIC) and docs/deploy.md has their rows. Each body is the op's reference (kvrewrite/kernels/ems_*.py,
expanded_attention*.py) in standard ONNX ops, every row at once, static shapes; the state ops are the functional
forms (kvrewrite.export.functional): they return what the in-place ops write.

    kvrewrite::ems_append(keys, bias, fill, k_pre, cache_position, token_valid, entry_start, raw_keys, lut, key_scale,
                          token_pos, slot_order, slot_fill) -> (entry_start, raw_keys, lut, key_scale, token_pos,
                                                               slot_order, slot_fill)
        ScatterElements at entries fill - T + t and slots slot_fill + t. raw_keys with 0 entries (pos "with") stays
        empty: the keys are scattered into raw_keys ++ k_pre and the first |raw_keys| entries kept (no If).
    kvrewrite::ems_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo,
                             s_loc_past, s_loc_cur, slot_fill, win_count; scale, past_only, softcap, l_win)
        -> (out, s_glo, s_loc_past, s_loc_cur, win_count)
        the expanded attention: s = scale q·keys per entry (fp32 MatMul), gathered per slot (GatherElements by lut,
        keys never), times key_scale, capped (softcap > 0), masked (live and causal per entry); the softmax's
        probabilities summed back per entry (ScatterElements add) before the MatMul with the values. The statistics
        exp(z - lse) summed over the group's queries (all of them: s_glo; the last l_win: the prefill's s_loc_past),
        then the fold of ems_attention.py (T > 1: set the local window; T = 1: add, rotate at l_win).
    kvrewrite::ems_compress(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale,
                            token_pos, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, gamma; l_win, pool, tau,
                            merging) -> the fifteen fields it writes
        due = fill >= budget[1], then the four stages, each a function of its own (the op's stages are registered
        ops too): kvrewrite::ems_score (alpha in float64, the pooled sum a Loop over the kernel's offsets in the
        reference's order), ems_partition (TopK: a stable descending sort, ties to the earlier entry), ems_redundancy
        (two fp32 cosine MatMuls, clamped, masked to the centres; the smallest centre at the maximum), ems_merge
        (group sums in float64 by kvrewrite::ems_segment_sum: a stable sort by target and differenced CumSums, as the
        reference; the LUT cap and the layout by TopK sorts, CumSum ranks and ScatterElements). gamma is a float64
        [gamma] input (N_tbm = floor((gamma - 1) B) needs the reference's double; inf: no cap); merging = 1 iff
        tau < 1 (decided in double at export: an fp32 tau may round to 1).

Where a function may differ from the reference: fp32 products and norms in another summation order (MatMul,
ReduceSum against torch's einsum, matmul and norm; an ulp apart), so the attention's floats agree within ~1e-6, and a
discrete decision (a rank between two pooled scores, a cosine product against tau or against another centre's) could
go the other way only where two values lie within an ulp of each other; the tests' inputs have no such near-ties and
their discrete results are compared exactly. The bodies are references: the attention writes the [G·T, R] slot
probabilities out, the redundancy a [C, C] product per row, the merge sorts every row: fine on onnxruntime for small
models, a native kernel's job at scale.
"""
from typing import TypeVar, Union

from onnxscript import BFLOAT16, BOOL, DOUBLE, FLOAT, FLOAT16, INT32, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

kv = Opset("kvrewrite", 1)  # the domain of onnx_ops.py (DOMAIN), version 1
TFloat = TypeVar("TFloat", bound=Union[FLOAT, FLOAT16, BFLOAT16])


@script(kv, default_opset=op)
def ems_append(keys: TFloat, bias: FLOAT, fill: INT64, k_pre: TFloat, cache_position: INT64, token_valid: BOOL,
               entry_start: INT32, raw_keys: TFloat, lut: INT32, key_scale: FLOAT, token_pos: INT32,
               slot_order: INT32, slot_fill: INT64) -> tuple[INT32, TFloat, INT32, FLOAT, INT32, INT32, INT64]:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    T = op.Shape(k_pre, start=2, end=3)
    ar = op.Range(zero, op.Squeeze(T), one)  # [T]
    e = op.Add(op.Sub(op.Unsqueeze(fill, [2]), T), ar)  # [B, H, T] the new entries
    j = op.Add(op.Unsqueeze(slot_fill, [2]), ar)  # [B, H, T] their slots
    lut2 = op.ScatterElements(lut, j, op.Cast(e, to=INT32.dtype), axis=2)
    key_scale2 = op.ScatterElements(key_scale, j, op.Expand(op.Constant(value_float=1.0), op.Shape(j)), axis=2)
    pos = op.Expand(op.Reshape(op.Cast(cache_position, to=INT32.dtype), op.Constant(value_ints=[1, 1, -1])),
                    op.Shape(j))
    token_pos2 = op.ScatterElements(token_pos, j, pos, axis=2)
    slot_order2 = op.ScatterElements(slot_order, j, op.Cast(j, to=INT32.dtype), axis=2)
    entry_start2 = op.ScatterElements(entry_start, e, op.Cast(j, to=INT32.dtype), axis=2)
    # raw_keys: scattered into raw_keys ++ k_pre, the first Craw entries kept (Craw = 0: nothing, pos "with")
    Craw = op.Shape(raw_keys, start=2, end=3)
    k_raw = op.CastLike(k_pre, raw_keys)
    ext = op.Concat(raw_keys, k_raw, axis=2)
    at = op.Where(op.Greater(Craw, zero), e, op.Add(Craw, ar))
    at4 = op.Expand(op.Unsqueeze(at, [3]), op.Shape(k_raw))
    raw2 = op.Slice(op.ScatterElements(ext, at4, k_raw, axis=2), op.Constant(value_ints=[0]), Craw,
                    op.Constant(value_ints=[2]))
    slot_fill2 = op.Add(slot_fill, T)
    return entry_start2, raw2, lut2, key_scale2, token_pos2, slot_order2, slot_fill2


@script(kv, default_opset=op)
def ems_attention(q: TFloat, keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, cache_position: INT64,
                  entry_start: INT32, lut: INT32, key_scale: FLOAT, s_glo: FLOAT, s_loc_past: FLOAT, s_loc_cur: FLOAT,
                  slot_fill: INT64, win_count: INT64, scale: float, past_only: int = 0, softcap: float = 0.0,
                  l_win: int = 1) -> tuple[TFloat, FLOAT, FLOAT, FLOAT, INT64]:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    neg_inf = op.Constant(value_float=float("-inf"))
    fzero = op.Constant(value_float=0.0)
    last_axis = op.Constant(value_ints=[-1])
    B = op.Shape(q, start=0, end=1)
    Hq = op.Shape(q, start=1, end=2)
    T = op.Shape(q, start=2, end=3)
    D = op.Shape(q, start=3, end=4)
    Hkv = op.Shape(keys, start=1, end=2)
    C = op.Shape(keys, start=2, end=3)
    R = op.Shape(lut, start=2, end=3)
    G = op.Div(Hq, Hkv)
    GT = op.Mul(G, T)
    qf = op.Reshape(op.Cast(q, to=FLOAT.dtype), op.Concat(B, Hkv, GT, D, axis=0))  # row g*T + t
    s = op.Mul(op.MatMul(qf, op.Transpose(op.Cast(keys, to=FLOAT.dtype), perm=[0, 1, 3, 2])),
               op.Constant(value_float=scale))  # [B, Hkv, GT, C] per entry
    lut64 = op.Cast(lut, to=INT64.dtype)
    e = op.Max(lut64, zero)  # free slots read entry 0, masked below
    shape4 = op.Concat(B, Hkv, GT, R, axis=0)
    e4 = op.Expand(op.Unsqueeze(e, [2]), shape4)
    z = op.Mul(op.GatherElements(s, e4, axis=3), op.Unsqueeze(key_scale, [2]))  # [B, Hkv, GT, R]
    cap = op.Constant(value_float=softcap)
    capping = op.Greater(cap, fzero)
    cap_safe = op.Where(capping, cap, op.Constant(value_float=1.0))
    z = op.Where(capping, op.Mul(op.Tanh(op.Div(z, cap_safe)), cap_safe), z)
    ar_r = op.Range(zero, op.Squeeze(R), one)
    live = op.And(op.And(op.Less(ar_r, op.Unsqueeze(slot_fill, [2])), op.GreaterOrEqual(lut64, zero)),
                  op.Greater(op.GatherElements(bias, e, axis=2), neg_inf))  # [B, Hkv, R]
    qp = op.Reshape(op.Tile(cache_position, G), op.Constant(value_ints=[1, 1, -1, 1]))
    causal = op.LessOrEqual(op.Unsqueeze(op.GatherElements(slot_pos, e, axis=2), [2]), qp)  # [B, Hkv, GT, R]
    visible = op.And(op.Unsqueeze(live, [2]), causal)
    z = op.Where(visible, z, neg_inf)
    top = op.ReduceMax(z, last_axis, keepdims=1)
    m = op.Where(op.IsInf(top), fzero, top)
    p = op.Exp(op.Sub(z, m))
    denom = op.ReduceSum(p, last_axis, keepdims=1)
    lse = op.Add(m, op.Log(denom))  # -inf where nothing is visible
    P = op.ScatterElements(op.Expand(fzero, op.Concat(B, Hkv, GT, C, axis=0)), e4, p, axis=3, reduction="add")
    tiny = op.Constant(value_float=1.1754943508222875e-38)
    grouped = op.Div(op.MatMul(P, op.Cast(values, to=FLOAT.dtype)), op.Max(denom, tiny))
    out = op.CastLike(op.Reshape(grouped, op.Concat(B, Hq, T, D, axis=0)), q)
    # statistics: p = exp(z - lse) on the visible slots, summed over the group's queries (and the last l_win ones)
    prob = op.Where(visible, op.Exp(op.Sub(z, lse)), fzero)
    tot = op.ReduceSum(prob, op.Constant(value_ints=[2]), keepdims=0)  # [B, Hkv, R]
    t_of_row = op.Mod(op.Range(zero, op.Squeeze(GT), one), op.Squeeze(T))
    lw = op.Constant(value_int=l_win)
    recent_rows = op.GreaterOrEqual(t_of_row, op.Sub(op.Squeeze(T), op.Min(lw, op.Squeeze(T))))
    rec = op.ReduceSum(op.Where(op.Reshape(recent_rows, op.Constant(value_ints=[1, 1, -1, 1])), prob, fzero),
                       op.Constant(value_ints=[2]), keepdims=0)
    glo2 = op.Add(s_glo, tot)
    cur = op.Add(s_loc_cur, tot)
    count = op.Add(win_count, one)
    rotate = op.Equal(count, lw)  # [B, Hkv]
    rot3 = op.Unsqueeze(rotate, [2])
    prefill = op.Greater(T, one)
    past2 = op.Where(prefill, rec, op.Where(rot3, cur, s_loc_past))
    cur2 = op.Where(op.Or(prefill, rot3), fzero, cur)
    count2 = op.Where(op.Or(prefill, rotate), zero, count)
    return out, glo2, past2, cur2, count2


@script(kv, default_opset=op)
def ems_score(bias: FLOAT, fill: INT64, lut: INT32, slot_order: INT32, s_glo: FLOAT, s_loc_past: FLOAT,
              s_loc_cur: FLOAT, slot_fill: INT64, due: BOOL, l_win: int, pool: int) -> tuple[FLOAT, FLOAT]:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    neg_inf = op.Constant(value_float=float("-inf"))
    fzero = op.Constant(value_float=0.0)
    dzero = op.Cast(op.Constant(value_float=0.0), to=DOUBLE.dtype)
    axis2 = op.Constant(value_ints=[2])
    C = op.Shape(bias, start=2, end=3)
    R = op.Shape(lut, start=2, end=3)
    rows = op.Shape(fill)
    ar_c = op.Range(zero, op.Squeeze(C), one)
    ar_r = op.Range(zero, op.Squeeze(R), one)
    lut64 = op.Cast(lut, to=INT64.dtype)
    e = op.Clip(lut64, zero, op.Sub(op.Squeeze(C), one))
    fill3 = op.Unsqueeze(fill, [2])
    live = op.And(op.And(op.Less(ar_r, op.Unsqueeze(slot_fill, [2])), op.GreaterOrEqual(lut64, zero)),
                  op.And(op.Greater(op.GatherElements(bias, e, axis=2), neg_inf),
                         op.Less(lut64, fill3)))
    loc = op.Add(s_loc_past, s_loc_cur)
    den = op.ReduceSum(op.Cast(op.Where(live, s_glo, fzero), to=DOUBLE.dtype), axis2, keepdims=1)
    num = op.ReduceSum(op.Cast(op.Where(live, loc, fzero), to=DOUBLE.dtype), axis2, keepdims=1)
    none = op.Equal(den, dzero)
    done = op.Cast(op.Constant(value_float=1.0), to=DOUBLE.dtype)
    alpha = op.Cast(op.Where(none, dzero, op.Div(num, op.Where(none, done, den))),
                    to=FLOAT.dtype)
    g = op.Where(live, op.Max(op.Mul(alpha, s_glo), loc), fzero)
    valid = op.And(op.Less(ar_c, fill3), op.Greater(bias, neg_inf))
    from_end = op.CumSum(op.Cast(valid, to=INT64.dtype), two, reverse=1)
    window = op.And(valid, op.LessOrEqual(from_end, op.Constant(value_int=l_win)))
    pooled_slot = op.And(live, op.Not(op.GatherElements(window, e, axis=2)))
    # P in token-position order: walk slot_order, pack the pooled slots by their rank
    so64 = op.Cast(slot_order, to=INT64.dtype)
    order = op.Clip(so64, zero, op.Sub(op.Squeeze(R), one))
    in_p = op.And(op.And(op.Less(ar_r, op.Unsqueeze(slot_fill, [2])), op.GreaterOrEqual(so64, zero)),
                  op.GatherElements(pooled_slot, order, axis=2))
    rank = op.Sub(op.CumSum(op.Cast(in_p, to=INT64.dtype), two), one)
    dest = op.Where(in_p, rank, R)
    RR = op.Concat(rows, op.Add(R, one), axis=0)
    packed = op.Slice(op.ScatterElements(op.Expand(fzero, RR), dest, op.GatherElements(g, order, axis=2), axis=2),
                      op.Constant(value_ints=[0]), R, axis2)
    k = op.Constant(value_int=pool)
    h = op.Reshape(op.Div(op.Sub(k, one), two), op.Constant(value_ints=[1]))
    z1 = op.Constant(value_ints=[0])
    padded = op.Pad(packed, op.Concat(z1, z1, h, z1, z1, h, axis=0))
    acc = op.Expand(fzero, op.Shape(packed))
    for o in range(k):  # k = i - h .. i + h, in increasing k, from 0: the reference's order of summation
        acc = op.Add(acc, op.Slice(padded, op.Reshape(o, [1]), op.Add(op.Reshape(o, [1]), R), axis2))
    pooled = op.Div(acc, op.Cast(k, to=FLOAT.dtype))
    spot = op.Where(in_p, order, R)
    back = op.GatherElements(pooled, op.Clip(rank, zero, op.Sub(op.Squeeze(R), one)), axis=2)
    g_pooled = op.Slice(op.ScatterElements(op.Expand(neg_inf, RR), spot, back, axis=2), op.Constant(value_ints=[0]), R,
                        axis2)
    d = op.Unsqueeze(due, [2])
    return op.Where(d, g, fzero), op.Where(op.And(d, pooled_slot), g_pooled, neg_inf)


@script(kv, default_opset=op)
def ems_tbm_count(budget: INT64, gamma: DOUBLE) -> INT64:
    """N_tbm = floor((gamma - 1) * budget[0]) in float64, capped at 2^40 (gamma = inf: 2^40, i.e. every candidate
    and no LUT cap)."""
    bt = op.Cast(op.Gather(budget, op.Constant(value_int=0)), to=DOUBLE.dtype)
    dgamma = op.Gather(gamma, op.Constant(value_int=0))
    n = op.Floor(op.Mul(op.Sub(dgamma, op.Cast(op.Constant(value_float=1.0), to=DOUBLE.dtype)), bt))
    return op.Cast(op.Min(n, op.Cast(op.Constant(value_float=1099511627776.0), to=DOUBLE.dtype)), to=INT64.dtype)


@script(kv, default_opset=op)
def ems_partition(bias: FLOAT, fill: INT64, entry_start: INT32, g_pooled: FLOAT, due: BOOL, budget: INT64,
                  gamma: DOUBLE, l_win: int) -> INT32:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    neg_inf = op.Constant(value_float=float("-inf"))
    C = op.Shape(bias, start=2, end=3)
    R = op.Shape(g_pooled, start=2, end=3)
    rows = op.Shape(fill)
    ar_c = op.Range(zero, op.Squeeze(C), one)
    ar_rows = op.Expand(ar_c, op.Concat(rows, C, axis=0))
    bt = op.Gather(budget, zero)
    lw = op.Constant(value_int=l_win)
    valid = op.And(op.Less(ar_c, op.Unsqueeze(fill, [2])), op.Greater(bias, neg_inf))
    vi = op.Cast(valid, to=INT64.dtype)
    window = op.And(valid, op.LessOrEqual(op.CumSum(vi, two, reverse=1), lw))
    cand = op.And(valid, op.Not(window))
    head = op.Clip(op.Cast(entry_start, to=INT64.dtype), zero, op.Max(op.Sub(op.Squeeze(R), one), zero))
    key = op.Where(cand, op.GatherElements(g_pooled, head, axis=2), neg_inf)
    _, order = op.TopK(key, C, axis=2, largest=1, sorted=1)  # descending; ties: the earlier entry
    cs = op.Sub(op.CumSum(op.Cast(op.GatherElements(cand, order, axis=2), to=INT64.dtype), two), one)
    place = op.ScatterElements(ar_rows, order, cs, axis=2)  # rank among the candidates
    n_imp = op.Max(op.Sub(bt, lw), zero)
    n_tbm = ems_tbm_count(budget, gamma)
    ranked = op.Where(op.Less(place, n_imp), op.Constant(value_int=2),
                      op.Where(op.Less(place, op.Add(n_imp, n_tbm)), op.Constant(value_int=3),
                               op.Constant(value_int=4)))
    over = op.Greater(op.ReduceSum(vi, op.Constant(value_ints=[2]), keepdims=1), bt)
    cls = op.Where(window, one, op.Where(cand, op.Where(over, ranked, two), zero))
    return op.Cast(op.Where(op.Unsqueeze(due, [2]), cls, zero), to=INT32.dtype)


@script(kv, default_opset=op)
def ems_redundancy(keys: TFloat, values: TFloat, raw_keys: TFloat, cls: INT32, due: BOOL, tau: float,
                   merging: int) -> INT32:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    fzero = op.Constant(value_float=0.0)
    fone = op.Constant(value_float=1.0)
    last = op.Constant(value_ints=[-1])
    C = op.Shape(keys, start=2, end=3)
    ar_c = op.Range(zero, op.Squeeze(C), one)
    # the redundancy keys: raw_keys when it holds entries, else keys (raw_keys ++ keys, the first C entries)
    a = op.Cast(op.Slice(op.Concat(raw_keys, keys, axis=2), op.Constant(value_ints=[0]), C,
                         op.Constant(value_ints=[2])),
                to=FLOAT.dtype)
    v = op.Cast(values, to=FLOAT.dtype)
    na = op.Sqrt(op.ReduceSum(op.Mul(a, a), last, keepdims=1))  # [B, H, C, 1]
    nv = op.Sqrt(op.ReduceSum(op.Mul(v, v), last, keepdims=1))
    den_a = op.Mul(na, op.Transpose(na, perm=[0, 1, 3, 2]))  # [B, H, d, c]
    den_v = op.Mul(nv, op.Transpose(nv, perm=[0, 1, 3, 2]))
    cos_a = op.Where(op.Greater(den_a, fzero),
                     op.Div(op.MatMul(a, op.Transpose(a, perm=[0, 1, 3, 2])), op.Where(op.Greater(den_a, fzero), den_a,
                                                                                       fone)), fzero)
    cos_v = op.Where(op.Greater(den_v, fzero),
                     op.Div(op.MatMul(v, op.Transpose(v, perm=[0, 1, 3, 2])), op.Where(op.Greater(den_v, fzero), den_v,
                                                                                       fone)), fzero)
    r = op.Mul(op.Max(cos_a, fzero), op.Max(cos_v, fzero))
    c64 = op.Cast(cls, to=INT64.dtype)
    centre = op.Unsqueeze(op.Equal(c64, op.Constant(value_int=2)), [2])  # [B, H, 1, c]
    r = op.Where(centre, r, op.Constant(value_float=float("-inf")))
    best = op.ReduceMax(r, last, keepdims=1)
    arg = op.ReduceMin(op.Where(op.And(centre, op.Equal(r, best)), ar_c, C), last, keepdims=0)  # the smallest centre
    ok = op.And(op.GreaterOrEqual(op.Squeeze(best, [3]), op.Constant(value_float=tau)), op.Less(arg, C))
    ok = op.And(ok, op.Greater(op.Constant(value_int=merging), zero))
    neg = op.Constant(value_int=-1)
    kept = op.Or(op.Equal(c64, one), op.Equal(c64, op.Constant(value_int=2)))
    dest = op.Where(op.Equal(c64, op.Constant(value_int=3)), op.Where(ok, arg, neg), op.Where(kept, ar_c, neg))
    return op.Cast(op.Where(op.Unsqueeze(due, [2]), dest, neg), to=INT32.dtype)


@script(kv, default_opset=op)
def ems_segment_sum(x: DOUBLE, tgt: INT64) -> tuple[DOUBLE, INT64]:
    """Sums of x [B, H, C, K] over the entries with the same target tgt [B, H, C] (-1: none), at the target's index,
    and the group sizes: the entries sorted by target (TopK ascending: stable), a CumSum, differenced (the reference's
    _segment_sum, the same order of summation)."""
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    C = op.Shape(tgt, start=2, end=3)
    rows = op.Shape(tgt, start=0, end=2)
    key = op.Where(op.GreaterOrEqual(tgt, zero), tgt, C)
    _, order = op.TopK(key, C, axis=2, largest=0, sorted=1)
    xshape = op.Shape(x)
    xo = op.GatherElements(x, op.Expand(op.Unsqueeze(order, [3]), xshape), axis=2)
    has = op.Unsqueeze(op.Less(op.GatherElements(key, order, axis=2), C), [3])
    xo = op.Where(has, xo, op.Cast(op.Constant(value_float=0.0), to=DOUBLE.dtype))
    K = op.Shape(x, start=3, end=4)
    dzero = op.Cast(op.Constant(value_float=0.0), to=DOUBLE.dtype)
    cs = op.Concat(op.Expand(dzero, op.Concat(rows, op.Constant(value_ints=[1]), K, axis=0)), op.CumSum(xo, two),
                   axis=2)
    C1 = op.Add(C, one)
    size = op.Slice(op.ScatterElements(op.Expand(zero, op.Concat(rows, C1, axis=0)), key,
                                       op.Expand(one, op.Shape(key)), axis=2, reduction="add"),
                    op.Constant(value_ints=[0]), C, op.Constant(value_ints=[2]))
    first = op.Sub(op.CumSum(size, two), size)
    kshape = op.Concat(rows, C, K, axis=0)
    hi = op.GatherElements(cs, op.Expand(op.Unsqueeze(op.Add(first, size), [3]), kshape), axis=2)
    lo = op.GatherElements(cs, op.Expand(op.Unsqueeze(first, [3]), kshape), axis=2)
    return op.Sub(hi, lo), size


@script(kv, default_opset=op)
def ems_merge(keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, fill: INT64, budget: INT64,
              entry_start: INT32, raw_keys: TFloat, lut: INT32, key_scale: FLOAT, token_pos: INT32, slot_order: INT32,
              s_glo: FLOAT, s_loc_past: FLOAT, s_loc_cur: FLOAT, slot_fill: INT64, g: FLOAT, g_pooled: FLOAT,
              cls: INT32, dest: INT32, due: BOOL, gamma: DOUBLE) -> tuple[TFloat, TFloat, FLOAT, INT64, INT64, INT32,
                                                                         TFloat, INT32, FLOAT, INT32, INT32, FLOAT,
                                                                         FLOAT, FLOAT, INT64]:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    neg = op.Constant(value_int=-1)
    neg_inf = op.Constant(value_float=float("-inf"))
    fzero = op.Constant(value_float=0.0)
    dzero = op.Cast(op.Constant(value_float=0.0), to=DOUBLE.dtype)
    done = op.Cast(op.Constant(value_float=1.0), to=DOUBLE.dtype)
    axis2 = op.Constant(value_ints=[2])
    last = op.Constant(value_ints=[-1])
    start0 = op.Constant(value_ints=[0])
    C = op.Shape(keys, start=2, end=3)
    R = op.Shape(lut, start=2, end=3)
    rows = op.Shape(fill)
    RC = op.Concat(rows, C, axis=0)
    RR = op.Concat(rows, R, axis=0)
    ar_c = op.Range(zero, op.Squeeze(C), one)
    ar_r = op.Range(zero, op.Squeeze(R), one)
    due3 = op.Unsqueeze(due, [2])
    c64 = op.Cast(cls, to=INT64.dtype)
    # live slots and their entries
    lut64 = op.Cast(lut, to=INT64.dtype)
    e_of = op.Clip(lut64, zero, op.Sub(op.Squeeze(C), one))
    live = op.And(op.And(op.Less(ar_r, op.Unsqueeze(slot_fill, [2])), op.GreaterOrEqual(lut64, zero)),
                  op.And(op.Greater(op.GatherElements(bias, e_of, axis=2), neg_inf),
                         op.Less(lut64, op.Unsqueeze(fill, [2]))))
    kept = op.And(due3, op.Or(op.Equal(c64, one), op.Equal(c64, two)))
    tgt = op.Where(due3, op.Cast(dest, to=INT64.dtype), neg)
    slot_tgt = op.Where(live, op.GatherElements(tgt, e_of, axis=2), neg)
    alive = op.GreaterOrEqual(slot_tgt, zero)
    tgt_c = op.Max(slot_tgt, zero)
    tgt_e = op.Max(tgt, zero)
    # 2. weights: each entry's g summed over its (contiguous) slots in float64, by a differenced CumSum
    live_i = op.Cast(live, to=INT64.dtype)
    cnt = op.ScatterElements(op.Expand(zero, RC), e_of, live_i, axis=2, reduction="add")
    cs = op.Concat(op.Expand(dzero, op.Concat(rows, op.Constant(value_ints=[1]), axis=0)),
                   op.CumSum(op.Cast(op.Where(live, g, fzero), to=DOUBLE.dtype), two), axis=2)
    start = op.Clip(op.Cast(entry_start, to=INT64.dtype), zero, op.Squeeze(R))
    w = op.Where(op.Greater(cnt, zero),
                 op.Sub(op.GatherElements(cs, op.Min(op.Add(start, cnt), R), axis=2),
                        op.GatherElements(cs, start, axis=2)), dzero)
    w_sum, size = ems_segment_sum(op.Unsqueeze(w, [3]), tgt)
    zero_w = op.LessOrEqual(op.GatherElements(op.Squeeze(w_sum, [3]), tgt_e, axis=2), dzero)
    w = op.Where(zero_w, op.Cast(cnt, to=DOUBLE.dtype), w)
    w4 = op.Unsqueeze(w, [3])
    w_sum4, _ = ems_segment_sum(w4, tgt)
    # 3. merge (at the centres' old indices): unit directions weighted, renormalised; values weighted means
    merged = op.And(kept, op.GreaterOrEqual(size, two))
    m4 = op.Unsqueeze(merged, [3])
    kd = op.Cast(keys, to=DOUBLE.dtype)
    kn = op.Sqrt(op.ReduceSum(op.Mul(kd, kd), last, keepdims=1))
    ku = op.Where(op.Greater(kn, dzero), op.Div(kd, op.Where(op.Greater(kn, dzero), kn, done)), dzero)
    mk, _ = ems_segment_sum(op.Mul(w4, ku), tgt)
    mkn = op.Sqrt(op.ReduceSum(op.Mul(mk, mk), last, keepdims=1))
    mku = op.Div(mk, op.Where(op.Greater(mkn, dzero), mkn, done))
    # the Where in float64, then one cast to the model dtype: the stored key whose norm the key scales divide by
    # (onnxruntime's CPU runs a float16 Where in float32 through inserted casts, and the norm below then saw the
    # unrounded float64 direction)
    new_keys = op.CastLike(op.Where(m4, op.Where(op.Greater(mkn, dzero), mku, kd), kd), keys)
    vs, _ = ems_segment_sum(op.Mul(w4, op.Cast(values, to=DOUBLE.dtype)), tgt)
    new_values = op.Where(m4, op.CastLike(op.Div(vs, op.Where(op.Greater(w_sum4, dzero), w_sum4, done)), values),
                          values)
    # raw keys: computed on raw_keys ++ keys (the first C entries: raw_keys, or keys when it is empty), the first
    # Craw entries returned
    Craw = op.Shape(raw_keys, start=2, end=3)
    rk = op.Slice(op.Concat(raw_keys, keys, axis=2), start0, C, axis2)
    rd = op.Cast(rk, to=DOUBLE.dtype)
    rn = op.Sqrt(op.ReduceSum(op.Mul(rd, rd), last, keepdims=1))
    ru = op.Where(op.Greater(rn, dzero), op.Div(rd, op.Where(op.Greater(rn, dzero), rn, done)), dzero)
    mr, _ = ems_segment_sum(op.Mul(w4, ru), tgt)
    mrn = op.Sqrt(op.ReduceSum(op.Mul(mr, mr), last, keepdims=1))
    mru = op.Div(mr, op.Where(op.Greater(mrn, dzero), mrn, done))
    new_raw = op.Where(m4, op.CastLike(op.Where(op.Greater(mrn, dzero), mru, rd), keys), rk)
    nkd = op.Cast(new_keys, to=DOUBLE.dtype)
    new_norm = op.Sqrt(op.ReduceSum(op.Mul(nkd, nkd), last, keepdims=0))
    n_j = op.Mul(op.Cast(key_scale, to=DOUBLE.dtype), op.GatherElements(op.Squeeze(kn, [3]), e_of, axis=2))
    nn_j = op.GatherElements(new_norm, tgt_c, axis=2)
    scale_m = op.Cast(op.Where(op.Greater(nn_j, dzero), op.Div(n_j, op.Where(op.Greater(nn_j, dzero), nn_j, done)),
                               done), to=FLOAT.dtype)
    new_scale = op.Where(op.And(alive, op.GatherElements(merged, tgt_c, axis=2)), scale_m, key_scale)
    # 4. the LUT cap: drop the lowest-g_pooled non-head slots of centres (ties: the later token first)
    n_live = op.ReduceSum(op.Cast(alive, to=INT64.dtype), axis2, keepdims=1)
    heads = op.GatherElements(op.Cast(entry_start, to=INT64.dtype), tgt_c, axis=2)
    cand = op.And(op.And(alive, op.Equal(op.GatherElements(c64, tgt_c, axis=2), two)), op.Not(op.Equal(ar_r, heads)))
    bt = op.Gather(budget, zero)
    n_drop = op.Max(op.Sub(n_live, op.Add(bt, ems_tbm_count(budget, gamma))), zero)
    _, by_pos = op.TopK(op.Cast(token_pos, to=INT64.dtype), R, axis=2, largest=1, sorted=1)
    dkey = op.GatherElements(op.Where(cand, g_pooled, op.Constant(value_float=float("inf"))), by_pos, axis=2)
    _, sub_order = op.TopK(dkey, R, axis=2, largest=0, sorted=1)
    order = op.GatherElements(by_pos, sub_order, axis=2)
    crank = op.Sub(op.CumSum(op.Cast(op.GatherElements(cand, order, axis=2), to=INT64.dtype), two), one)
    rank = op.ScatterElements(op.Expand(ar_r, RR), order, crank, axis=2)
    alive = op.And(alive, op.Not(op.And(cand, op.Less(rank, n_drop))))
    # 5. layout: entries packed in ascending old index
    kept_i = op.Cast(kept, to=INT64.dtype)
    new_idx = op.Sub(op.CumSum(kept_i, two), one)
    n_kept = op.ReduceSum(kept_i, axis2, keepdims=1)
    e_dst = op.Where(kept, new_idx, op.Add(ar_c, C))
    base = op.Expand(op.Concat(ar_c, ar_c, axis=0), op.Concat(rows, op.Add(C, C), axis=0))
    e_src = op.Slice(op.ScatterElements(base, e_dst, op.Expand(ar_c, RC), axis=2), start0, C, axis2)
    live_e = op.Less(ar_c, n_kept)
    e_src4 = op.Expand(op.Unsqueeze(e_src, [3]), op.Shape(keys))
    # slots: sorted by (new entry, its own slots first then d ascending, old slot)
    new_e = op.GatherElements(new_idx, tgt_c, axis=2)
    sub = op.Where(op.Equal(e_of, tgt_c), zero, op.Add(e_of, one))
    C1 = op.Add(C, one)
    skey = op.Where(alive, op.Add(op.Mul(new_e, C1), sub), op.Mul(C1, C1))
    _, s_src = op.TopK(skey, R, axis=2, largest=0, sorted=1)
    n_slots = op.ReduceSum(op.Cast(alive, to=INT64.dtype), axis2, keepdims=1)
    live_s = op.Less(ar_r, n_slots)
    new_pos = op.ScatterElements(op.Expand(ar_r, RR), s_src, op.Expand(ar_r, RR), axis=2)  # old slot -> new slot
    new_lut = op.Where(live_s, op.GatherElements(new_e, s_src, axis=2), neg)
    at = op.Where(live_s, new_lut, C)
    RC1 = op.Concat(rows, C1, axis=0)
    cnt_new = op.Slice(op.ScatterElements(op.Expand(zero, RC1), at, op.Expand(one, op.Shape(at)), axis=2,
                                          reduction="add"), start0, C, axis2)
    new_start = op.Where(live_e, op.Sub(op.CumSum(cnt_new, two), cnt_new), zero)
    tp_new = op.Where(live_s, op.Cast(op.GatherElements(token_pos, s_src, axis=2), to=INT64.dtype), zero)
    pos_max = op.Slice(op.ScatterElements(op.Expand(neg, RC1), at, tp_new, axis=2, reduction="max"), start0, C, axis2)
    so64 = op.Cast(slot_order, to=INT64.dtype)
    o = op.Clip(so64, zero, op.Sub(op.Squeeze(R), one))
    keep_o = op.And(op.And(op.Less(ar_r, op.Unsqueeze(slot_fill, [2])), op.GreaterOrEqual(so64, zero)),
                    op.GatherElements(alive, o, axis=2))
    o_dst = op.Where(keep_o, op.Sub(op.CumSum(op.Cast(keep_o, to=INT64.dtype), two), one), R)
    RR1 = op.Concat(rows, op.Add(R, one), axis=0)
    new_order = op.Slice(op.ScatterElements(op.Expand(neg, RR1), o_dst, op.GatherElements(new_pos, o, axis=2),
                                            axis=2), start0, R, axis2)
    # every field: the due rows' new value, the others' as they were
    d4 = op.Unsqueeze(due3, [3])
    keys2 = op.Where(d4, op.GatherElements(new_keys, e_src4, axis=2), keys)
    values2 = op.Where(d4, op.GatherElements(new_values, e_src4, axis=2), values)
    raw_full = op.Where(d4, op.GatherElements(new_raw, e_src4, axis=2), rk)
    raw2 = op.Slice(op.Concat(raw_full, raw_keys, axis=2), start0, Craw, axis2)
    bias2 = op.Where(due3, op.Where(live_e, fzero, neg_inf), bias)
    slot_pos2 = op.Where(due3, op.Where(live_e, pos_max, op.GatherElements(slot_pos, e_src, axis=2)), slot_pos)
    entry_start2 = op.Where(due3, op.Cast(new_start, to=INT32.dtype), entry_start)
    fill2 = op.Where(due, op.Squeeze(n_kept, [2]), fill)
    slot_fill2 = op.Where(due, op.Squeeze(n_slots, [2]), slot_fill)
    lut2 = op.Where(due3, op.Cast(new_lut, to=INT32.dtype), lut)
    key_scale2 = op.Where(due3, op.Where(live_s, op.GatherElements(new_scale, s_src, axis=2),
                                         op.Constant(value_float=1.0)), key_scale)
    token_pos2 = op.Where(due3, op.Cast(tp_new, to=INT32.dtype), token_pos)
    slot_order2 = op.Where(due3, op.Cast(new_order, to=INT32.dtype), slot_order)
    glo2 = op.Where(due3, op.Where(live_s, op.GatherElements(s_glo, s_src, axis=2), fzero), s_glo)
    past2 = op.Where(due3, op.Where(live_s, op.GatherElements(s_loc_past, s_src, axis=2), fzero), s_loc_past)
    cur2 = op.Where(due3, op.Where(live_s, op.GatherElements(s_loc_cur, s_src, axis=2), fzero), s_loc_cur)
    return (keys2, values2, bias2, slot_pos2, fill2, entry_start2, raw2, lut2, key_scale2, token_pos2, slot_order2,
            glo2, past2, cur2, slot_fill2)


@script(kv, default_opset=op)
def ems_compress(keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, fill: INT64, budget: INT64,
                 entry_start: INT32, raw_keys: TFloat, lut: INT32, key_scale: FLOAT, token_pos: INT32,
                 slot_order: INT32, s_glo: FLOAT, s_loc_past: FLOAT, s_loc_cur: FLOAT, slot_fill: INT64,
                 gamma: DOUBLE, l_win: int, pool: int, tau: float,
                 merging: int) -> tuple[TFloat, TFloat, FLOAT, INT64, INT64, INT32, TFloat, INT32, FLOAT, INT32, INT32,
                                        FLOAT, FLOAT, FLOAT, INT64]:
    due = op.GreaterOrEqual(fill, op.Gather(budget, op.Constant(value_int=1)))
    g, g_pooled = ems_score(bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due, l_win=l_win,
                            pool=pool)
    cls = ems_partition(bias, fill, entry_start, g_pooled, due, budget, gamma, l_win=l_win)
    dest = ems_redundancy(keys, values, raw_keys, cls, due, tau=tau, merging=merging)
    k2, v2, b2, sp2, f2, es2, r2, l2, ks2, tp2, so2, gl2, pa2, cu2, sf2 = ems_merge(
        keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos, slot_order, s_glo,
        s_loc_past, s_loc_cur, slot_fill, g, g_pooled, cls, dest, due, gamma)
    return k2, v2, b2, sp2, f2, es2, r2, l2, ks2, tp2, so2, gl2, pa2, cu2, sf2


FUNCTIONS = {"ems_append": ems_append, "ems_attention": ems_attention, "ems_compress": ems_compress,
             "ems_score": ems_score, "ems_partition": ems_partition, "ems_redundancy": ems_redundancy,
             "ems_merge": ems_merge}
# functions whose bodies call other kvrewrite functions (every function the body reaches: not transitive)
CALLS = {"ems_compress": ("ems_score", "ems_partition", "ems_redundancy", "ems_merge", "ems_tbm_count",
                          "ems_segment_sum"),
         "ems_partition": ("ems_tbm_count",), "ems_merge": ("ems_tbm_count", "ems_segment_sum")}
HELPERS = {"ems_score": ems_score, "ems_partition": ems_partition, "ems_redundancy": ems_redundancy,
           "ems_merge": ems_merge, "ems_tbm_count": ems_tbm_count, "ems_segment_sum": ems_segment_sum}
