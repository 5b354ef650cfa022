"""KVMerger's compression op as an ONNX function of the domain "kvrewrite" (onnxscript, opset 18); onnx_ops.py lists
it with the others (FUNCTIONS, SYMBOLIC) and docs/deploy.md has its row.

    kvrewrite::kvmerger_compress(keys, values, bias, slot_pos, fill, budget, score, degree, deficit, ratios;
                                 n_sink, epsilon, sigma, sigma_mode, values_mode, reading, budget_mode)
        -> (keys, values, bias, slot_pos, fill, score, degree, deficit)
        the functional form of the in-place op (kvrewrite.export.functional). ratios: float64 [recent_ratio,
        hh_ratio] (the counts floor(ratio * B) need the reference's doubles; ONNX float attributes are float32);
        the string options as ints, their index in the op module's tuples: sigma_mode 0 "fixed" / 1 "distance" /
        2 "paper" (SIGMA_MODES), values_mode 0 "scale" / 1 "bias", reading 0 "chain" / 1 "anchor", budget_mode
        0 "exact" / 1 "epsilon". Calls kvrewrite::top_flags (also in the model).

The body is the reference computation (kvrewrite/kernels/kvmerger_compress.py, reference_kvmerger_compress) over
all rows at once, on [B, Hkv, C] tensors: the due rule (fill + deficit >= budget[1]); the valid slots packed in
slot order (CumSum ranks, one ScatterElements for the permutation, GatherElements); sinks and the recent window by
rank, the heavy hitters by TopK of the score (kvrewrite::top_flags: the eligible entries by key descending, ties to
the lower index as the reference's stable sorts, the first `count` flagged); the adjacent cosines c_r of ranks r
and r + 1 (the last rank pairs with nothing); the joins: "chain" the top J (or max(J, #c > epsilon)) joinable
pairs by top_flags; "anchor" a Loop over the C - 1 pairs from the last backwards carrying each row's anchor key
(the reading is sequential by definition: one iteration per pair, every row at once; a zero-trip Loop when the
reading is "chain"), then the most similar remaining pairs up to J; items (protected slots and sets) by a CumSum of
the set starts; per-item sums by ScatterElements(add) in rank order (index_add_'s order: the same fp32 sums for
the scores, degrees and counts), the pivot by ScatterElements(max, then min of the rank); sigma per sigma_mode
(Where over the three; "paper"'s 10 iterations a Loop that runs zero times otherwise); the Gaussian and degree
weights, the merged keys and values by ScatterElements(add); the fallback eviction by top_flags of the negated set
scores; the kept items packed by CumSum + ScatterElements; freed slots emptied as the reference does (bias -inf,
score 0, degree 1; keys, values and slot_pos left), rows not due passed through Where (bit for bit).

Exactness: every integer output (fill, deficit, degree, slot_pos), the layout (which slots hold what) and the
scores are computed as the reference computes them. The cosines and distances are fp32 sums over D (ReduceSum and
Sqrt against torch's sum and norm: they may differ by an ulp), so a join decision could differ where two cosines
(or a cosine and epsilon) are within ~1e-7 of each other; no test input has such a near-tie. The merged keys and
values go through Exp and Log of the runtime, whose last bits may differ from torch's: 1e-6 on fp32 outputs.
"""
from typing import TypeVar, Union

from onnxscript import BFLOAT16, BOOL, DOUBLE, FLOAT, FLOAT16, INT32, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

kv = Opset("kvrewrite", 1)  # the domain of onnx_ops.py (DOMAIN), version 1
TFloat = TypeVar("TFloat", bound=Union[FLOAT, FLOAT16, BFLOAT16])


@script(kv, default_opset=op)
def top_flags(key: FLOAT, eligible: BOOL, count: INT64) -> BOOL:
    """Along axis 2: the eligible entries ranked by key descending (ties: the lower index), the first `count`
    (broadcast against [B, H, 1]) of each row flagged: the reference's _top_flags. TopK over the key with the
    ineligible entries at -inf, then the rank among the eligible ones in that order (a CumSum), so an eligible
    entry whose key is -inf still ranks after every finite one and before none of the ineligible ones."""
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    C = op.Shape(key, start=2, end=3)
    masked = op.Where(eligible, key, op.Constant(value_float=float("-inf")))
    _, order = op.TopK(masked, C, axis=2, largest=1, sorted=1)
    el = op.Cast(op.GatherElements(eligible, order, axis=2), to=INT64.dtype)  # eligibility in ranking order
    take = op.Mul(el, op.Cast(op.Less(op.Sub(op.CumSum(el, two), one), count), to=INT64.dtype))
    return op.Greater(op.ScatterElements(el, order, take, axis=2), op.Constant(value_int=0))  # back in index order


@script(kv, default_opset=op)
def kvmerger_compress(keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, fill: INT64, budget: INT64,
                      score: FLOAT, degree: INT32, deficit: INT64, ratios: DOUBLE, n_sink: int, epsilon: float,
                      sigma: float, sigma_mode: int, values_mode: int, reading: int,
                      budget_mode: int) -> tuple[TFloat, TFloat, FLOAT, INT64, INT64, FLOAT, INT32, INT64]:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    neg_inf = op.Constant(value_float=float("-inf"))
    fzero = op.Constant(value_float=0.0)
    fone = op.Constant(value_float=1.0)
    axis2 = op.Constant(value_ints=[2])
    axis3 = op.Constant(value_ints=[3])
    start0 = op.Constant(value_ints=[0])
    C = op.Shape(keys, start=2, end=3)  # [1]
    D = op.Shape(keys, start=3, end=4)
    C1 = op.Add(C, one)  # the item ids and a spare id C for the ranks past N
    rows = op.Shape(fill)  # [B, H]
    ar = op.Range(zero, op.Squeeze(C), one)  # [C]
    ar_rows = op.Expand(ar, op.Concat(rows, C, axis=0))
    base2 = op.Expand(op.Concat(ar, ar, axis=0), op.Concat(rows, op.Add(C, C), axis=0))
    target = op.Gather(budget, zero)
    due = op.GreaterOrEqual(op.Add(fill, deficit), op.Gather(budget, one))  # [B, H]
    due3 = op.Unsqueeze(due, [2])
    # -- pack the valid slots by rank: valid first, then the others, each in slot order (the reference's sort)
    valid = op.And(op.Less(ar, op.Unsqueeze(fill, [2])), op.Greater(bias, neg_inf))
    vi = op.Cast(valid, to=INT64.dtype)
    N = op.ReduceSum(vi, axis2, keepdims=1)  # [B, H, 1]
    dest = op.Where(valid, op.Sub(op.CumSum(vi, two), one), op.Add(N, op.Sub(op.CumSum(op.Sub(one, vi), two), one)))
    perm = op.ScatterElements(ar_rows, dest, ar_rows, axis=2)  # perm[r] = the slot of rank r
    perm4 = op.Expand(op.Unsqueeze(perm, [3]), op.Shape(keys))
    Kx = op.GatherElements(keys, perm4, axis=2)
    Vx = op.GatherElements(values, perm4, axis=2)
    bx = op.GatherElements(bias, perm, axis=2)
    px = op.GatherElements(slot_pos, perm, axis=2)
    sx = op.GatherElements(score, perm, axis=2)
    dx = op.GatherElements(degree, perm, axis=2)
    live = op.Less(ar, N)
    over = op.Greater(N, target)  # rows that merge (the others only pack)
    # -- protected: sinks, recent window, heavy hitters; the counts from the target (floor of float64 products)
    td = op.Cast(target, to=DOUBLE.dtype)
    n_s = op.Min(op.Constant(value_int=n_sink), target)
    n_r = op.Min(op.Cast(op.Floor(op.Mul(op.Gather(ratios, zero), td)), to=INT64.dtype), op.Sub(target, n_s))
    n_h = op.Min(op.Cast(op.Floor(op.Mul(op.Gather(ratios, one), td)), to=INT64.dtype),
                 op.Sub(op.Sub(target, n_s), n_r))
    sink = op.And(live, op.Less(ar, n_s))
    recent = op.And(op.And(live, op.Not(sink)), op.GreaterOrEqual(ar, op.Sub(N, n_r)))
    heavy = top_flags(sx, op.And(op.And(live, op.Not(sink)), op.Not(recent)), n_h)
    mergeable = op.And(op.And(live, op.Not(op.Or(op.Or(sink, recent), heavy))), over)
    # -- the pairs (r, r + 1): joinable when both are mergeable; cosines in fp32 (a zero-norm key: 0)
    last = op.Sub(C, one)
    nxt = op.Min(op.Add(ar, one), last)
    joinable = op.And(op.And(mergeable, op.Gather(mergeable, nxt, axis=2)), op.Less(ar, last))
    Kf = op.Cast(Kx, to=FLOAT.dtype)
    norm = op.Sqrt(op.ReduceSum(op.Mul(Kf, Kf), axis3, keepdims=0))  # [B, H, C]
    den = op.Mul(norm, op.Gather(norm, nxt, axis=2))
    dot = op.ReduceSum(op.Mul(Kf, op.Gather(Kf, nxt, axis=2)), axis3, keepdims=0)
    pos_den = op.Greater(den, fzero)
    c = op.Where(pos_den, op.Div(dot, op.Where(pos_den, den, fone)), fzero)
    eps = op.Constant(value_float=epsilon)
    J = op.Max(op.Sub(N, target), zero)  # joins needed [B, H, 1]
    # -- reading "chain": the J (budget_mode "epsilon": at least every pair above epsilon) most similar pairs
    n_above = op.ReduceSum(op.Cast(op.And(joinable, op.Greater(c, eps)), to=INT64.dtype), axis2, keepdims=1)
    by_eps = op.Greater(op.Constant(value_int=budget_mode), zero)
    chain = top_flags(c, joinable, op.Where(by_eps, op.Max(J, n_above), J))
    # -- reading "anchor": from the last pair backwards, r joins the set to its right iff cos(anchor, k_r) >
    # epsilon, the anchor being the set's right-most member; then the most similar remaining pairs up to J
    anchored = op.Greater(op.Constant(value_int=reading), zero)
    a_join = op.Less(ar_rows, zero)  # all False
    anchor = op.Gather(Kf, last, axis=2)  # [B, H, 1, D]
    anchor_n = op.Gather(norm, last, axis=2)  # [B, H, 1]
    n_pairs = op.Squeeze(op.Where(anchored, last, zero))
    for i in range(n_pairs):
        r = op.Sub(op.Sub(last, one), i)  # [1]: C - 2 down to 0
        k_r = op.Gather(Kf, r, axis=2)
        n_r_ = op.Gather(norm, r, axis=2)
        a_den = op.Mul(anchor_n, n_r_)
        a_dot = op.ReduceSum(op.Mul(anchor, k_r), axis3, keepdims=0)
        a_pos = op.Greater(a_den, fzero)
        a_cos = op.Where(a_pos, op.Div(a_dot, op.Where(a_pos, a_den, fone)), fzero)
        j = op.And(op.Gather(joinable, r, axis=2), op.Greater(a_cos, eps))  # [B, H, 1]
        a_join = op.Or(a_join, op.And(j, op.Equal(ar, r)))
        anchor = op.Where(op.Unsqueeze(j, [3]), anchor, k_r)
        anchor_n = op.Where(j, anchor_n, n_r_)
    extra = op.Max(op.Sub(J, op.ReduceSum(op.Cast(a_join, to=INT64.dtype), axis2, keepdims=1)), zero)
    a_join = op.Or(a_join, top_flags(c, op.And(joinable, op.Not(a_join)), extra))
    join = op.Or(op.And(anchored, a_join), op.And(op.Not(anchored), chain))  # join[r]: r with r + 1
    # -- items: every protected slot and every set (a run of joined pairs), in rank order
    prv = op.Max(op.Sub(ar, one), zero)
    joined_left = op.And(op.Gather(join, prv, axis=2), op.Greater(ar, zero))
    start = op.And(live, op.Not(joined_left))
    si = op.Cast(start, to=INT64.dtype)
    item = op.Sub(op.CumSum(si, two), one)
    n_items = op.ReduceSum(si, axis2, keepdims=1)
    tgt = op.Where(live, item, C)  # each rank's item; the ranks past N to the spare id C
    first = op.Slice(op.ScatterElements(base2, op.Where(start, item, op.Add(ar, C)), ar_rows, axis=2), start0, C,
                     axis2)  # first[i]: the rank of item i's first member
    is_set = op.And(op.GatherElements(mergeable, first, axis=2), op.Less(ar, n_items))
    RC1 = op.Concat(rows, C1, axis=0)
    zf = op.Expand(fzero, RC1)
    zi = op.Expand(zero, RC1)
    count = op.ScatterElements(zi, tgt, op.Expand(one, op.Shape(tgt)), axis=2, reduction="add")  # [B, H, C + 1]
    item_score = op.ScatterElements(zf, tgt, sx, axis=2, reduction="add")
    # -- the fallback: too few joinable pairs, the set items with the lowest summed score go (ties: the earlier)
    keep = op.Less(ar, n_items)
    n_evict = op.Mul(op.Max(op.Sub(n_items, target), zero), op.Cast(over, to=INT64.dtype))
    item_score_c = op.Slice(item_score, start0, C, axis2)
    keep = op.And(keep, op.Not(top_flags(op.Neg(item_score_c), op.And(is_set, keep), n_evict)))
    # -- pivots: the largest score of each item, ties the earlier member
    smax = op.ScatterElements(op.Expand(neg_inf, RC1), tgt, sx, axis=2, reduction="max")
    is_max = op.And(op.Equal(sx, op.GatherElements(smax, tgt, axis=2)), live)
    first_max = op.ScatterElements(op.Expand(C, RC1), tgt, op.Where(is_max, ar_rows, C), axis=2, reduction="min")
    pivot = op.Min(first_max, last)  # [B, H, C + 1]: a rank
    KD1 = op.Concat(rows, C1, D, axis=0)
    Kp = op.GatherElements(Kf, op.Expand(op.Unsqueeze(pivot, [3]), KD1), axis=2)  # [B, H, C + 1, D]
    tgt4 = op.Expand(op.Unsqueeze(tgt, [3]), op.Shape(Kf))
    diff = op.Sub(op.GatherElements(Kp, tgt4, axis=2), Kf)
    dist = op.ReduceSum(op.Mul(diff, diff), axis3, keepdims=0)  # ||k_p - k_i||^2 of each member [B, H, C]
    # -- sigma per item: "fixed", "distance" or "paper" (10 rounds of the printed Eq. 6)
    sig0 = op.Constant(value_float=sigma)
    denom = op.Mul(op.Constant(value_float=1.4142135623730951), op.Cast(op.Max(count, one), to=FLOAT.dtype))
    s_dist = op.Div(op.ScatterElements(zf, tgt, op.Sqrt(dist), axis=2, reduction="add"), denom)
    mode = op.Constant(value_int=sigma_mode)
    tiny = op.Constant(value_float=1.1754943508222875e-38)
    two_f = op.Constant(value_float=2.0)
    s_paper = op.Expand(sig0, RC1)
    n_rounds = op.Squeeze(op.Where(op.Equal(mode, two), op.Constant(value_ints=[10]), op.Constant(value_ints=[0])))
    for it in range(n_rounds):
        sm = op.GatherElements(s_paper, tgt, axis=2)
        gm = op.Where(op.Greater(sm, fzero), op.Exp(op.Div(op.Neg(dist), op.Max(op.Mul(op.Mul(two_f, sm), sm), tiny))),
                      fone)
        s_paper = op.Div(op.ScatterElements(zf, tgt, gm, axis=2, reduction="add"), denom)
    s_item = op.Where(op.Equal(mode, zero), op.Expand(sig0, RC1), op.Where(op.Equal(mode, one), s_dist, s_paper))
    s = op.GatherElements(s_item, tgt, axis=2)
    g = op.Where(op.Greater(s, fzero), op.Exp(op.Div(op.Neg(dist), op.Max(op.Mul(op.Mul(two_f, s), s), tiny))), fone)
    # -- weights w_i = g_i d_i / sum g d; merged key, value, bias, degree, score, position
    d = op.Cast(dx, to=FLOAT.dtype)
    gd = op.Mul(g, d)
    w = op.Div(gd, op.GatherElements(op.ScatterElements(zf, tgt, gd, axis=2, reduction="add"), tgt, axis=2))
    Dsum = op.ScatterElements(zi, tgt, op.Cast(dx, to=INT64.dtype), axis=2, reduction="add")
    Dsum_f = op.Cast(Dsum, to=FLOAT.dtype)
    zf4 = op.Expand(fzero, KD1)
    w4 = op.Unsqueeze(w, [3])
    k_new = op.ScatterElements(zf4, tgt4, op.Mul(w4, Kf), axis=2, reduction="add")
    Vf = op.Cast(Vx, to=FLOAT.dtype)
    by_bias = op.Greater(op.Constant(value_int=values_mode), zero)
    v_scaled = op.Mul(op.Unsqueeze(Dsum_f, [3]),
                      op.ScatterElements(zf4, tgt4, op.Mul(op.Unsqueeze(op.Div(w, d), [3]), Vf), axis=2,
                                         reduction="add"))
    v_mean = op.ScatterElements(zf4, tgt4, op.Mul(w4, Vf), axis=2, reduction="add")
    v_new = op.Where(by_bias, v_mean, v_scaled)
    b_new = op.Where(by_bias, op.Log(Dsum_f), op.Expand(fzero, RC1))
    # -- each item's output (items 0 .. C - 1): its first member unless it merged (>= 2 members)
    merged = op.Slice(op.GreaterOrEqual(count, two), start0, C, axis2)
    merged4 = op.Unsqueeze(merged, [3])
    first4 = op.Expand(op.Unsqueeze(first, [3]), op.Shape(Kx))
    out_k = op.Where(merged4, op.CastLike(op.Slice(k_new, start0, C, axis2), keys),
                     op.GatherElements(Kx, first4, axis=2))
    out_v = op.Where(merged4, op.CastLike(op.Slice(v_new, start0, C, axis2), values),
                     op.GatherElements(Vx, first4, axis=2))
    out_b = op.Where(merged, op.Slice(b_new, start0, C, axis2), op.GatherElements(bx, first, axis=2))
    out_p = op.Where(merged, op.GatherElements(px, op.Slice(pivot, start0, C, axis2), axis=2),
                     op.GatherElements(px, first, axis=2))
    out_s = op.Where(merged, item_score_c, op.GatherElements(sx, first, axis=2))
    out_d = op.Where(merged, op.Cast(op.Slice(Dsum, start0, C, axis2), to=INT32.dtype),
                     op.GatherElements(dx, first, axis=2))
    # -- pack the kept items to the front, write the due rows; the others pass through
    ki = op.Cast(keep, to=INT64.dtype)
    n_kept = op.ReduceSum(ki, axis2, keepdims=1)
    take = op.Slice(op.ScatterElements(base2, op.Where(keep, op.Sub(op.CumSum(ki, two), one), op.Add(ar, C)),
                                       ar_rows, axis=2), start0, C, axis2)  # the item of each destination slot
    kept = op.And(due3, op.Less(ar, n_kept))
    freed = op.And(due3, op.Not(kept))
    kept4 = op.Unsqueeze(kept, [3])
    take4 = op.Expand(op.Unsqueeze(take, [3]), op.Shape(keys))
    keys2 = op.Where(kept4, op.GatherElements(out_k, take4, axis=2), keys)
    values2 = op.Where(kept4, op.GatherElements(out_v, take4, axis=2), values)
    slot_pos2 = op.Where(kept, op.GatherElements(out_p, take, axis=2), slot_pos)
    bias2 = op.Where(kept, op.GatherElements(out_b, take, axis=2), op.Where(freed, neg_inf, bias))
    score2 = op.Where(kept, op.GatherElements(out_s, take, axis=2), op.Where(freed, fzero, score))
    degree2 = op.Where(kept, op.GatherElements(out_d, take, axis=2),
                       op.Where(freed, op.Cast(one, to=INT32.dtype), degree))
    N2 = op.Squeeze(N, [2])
    kept2 = op.Squeeze(n_kept, [2])
    fill2 = op.Where(due, kept2, fill)
    deficit2 = op.Where(due, op.Sub(op.Min(op.Add(N2, deficit), target), kept2), deficit)
    return keys2, values2, bias2, slot_pos2, fill2, score2, degree2, deficit2


FUNCTIONS = {"kvmerger_compress": kvmerger_compress}
CALLS = {"kvmerger_compress": ("top_flags",)}  # functions whose bodies call other kvrewrite functions
HELPERS = {"top_flags": top_flags}
