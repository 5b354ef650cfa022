"""ClusterGen's ops as ONNX functions of the domain "kvrewrite" (onnxscript, opset 18); onnx_ops.py lists them with the
others (FUNCTIONS, SYMBOLIC) and docs/deploy.md has their rows.

    kvrewrite::sketch_attention(q, keys, values, bias, slot_pos, cache_position, role; scale, past_only) -> out
        method clustergen's attention (kvrewrite/kernels/sketch_attention.py): z = scale·q·k + bias in fp32, visible
        = bias > -inf and slot_pos <= the query's position; the numerator over roles 0 and 2 and the denominator over
        roles 0 and 1, each shifted by its own max (0 for a max over nothing); out = h·(h·N / max(Z, tiny)) with
        h = e^((m_N - m_Z) / 2), 0 where Z = 0: the reference's arithmetic in the reference's order. past_only (0/1)
        is the producer's promise (the body applies the causal test either way). No softcap attribute: the op refuses
        a cap (ClusterGen refuses capped layers), so a capped node cannot reach the export.
    kvrewrite::kcenter_compress(keys, values, bias, slot_pos, fill, budget, ratio) -> (keys, values, bias, slot_pos,
                                                                                       fill)
        method clustergen-kcenter's compression, the functional form (kvrewrite.export.functional). ratio: float64
        [recent_ratio] (ℓ = floor(recent_ratio·B) needs the reference's double). Per due row over B: the last ℓ valid
        slots, plus greedy k-center over the older ones as a Loop of k = B - ℓ steps (B and ℓ are the same for every
        row, so the trip count is the reference's k, capped at C), every row at once: the candidate farthest from
        the chosen ones (ArgMax: ties to the lowest index; the first step picks the first candidate, every distance
        still +inf), then each candidate's squared distance to its nearest centre, sum((x - c)^2) over D in fp32;
        the kept slots packed in slot order (CumSum + ScatterElements), bias 0 on them and -inf past them, fill = the
        kept count; rows not due pass through (Where, bit for bit).

kvrewrite::clustergen_fold has no function (onnx_export.UNSUPPORTED): see docs/deploy.md, "ClusterGen".

Exactness: sketch_attention's products are fp32 MatMul against the reference's einsum (summation order only: 2e-6
on outputs of magnitude ~1, relative 1e-5 where a large value weight scales the output). kcenter_compress is exact
on inputs without near-ties: the distances are fp32 sums over D in another order than torch's (an ulp apart), so
two candidates whose distances lie within an ulp could be chosen the other way; integer keys (exact distances) check
the tie rule.
"""
from typing import TypeVar, Union

from onnxscript import BFLOAT16, DOUBLE, FLOAT, FLOAT16, INT8, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

kv = Opset("kvrewrite", 1)  # the domain of onnx_ops.py (DOMAIN), version 1
TFloat = TypeVar("TFloat", bound=Union[FLOAT, FLOAT16, BFLOAT16])


@script(kv, default_opset=op)
def sketch_attention(q: TFloat, keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, cache_position: INT64,
                     role: INT8, scale: float, past_only: int = 0) -> TFloat:
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
    vf = op.Cast(values, to=FLOAT.dtype)
    b4 = op.Unsqueeze(bias, [2])  # [B, Hkv, 1, C]
    z = op.Add(op.Mul(op.MatMul(qf, op.Transpose(kf, perm=[0, 1, 3, 2])), op.Constant(value_float=scale)), b4)
    qp = op.Reshape(op.Tile(cache_position, G), op.Constant(value_ints=[1, 1, -1, 1]))
    visible = op.And(op.Greater(b4, neg_inf), op.LessOrEqual(op.Unsqueeze(slot_pos, [2]), qp))
    r = op.Unsqueeze(op.Cast(role, to=INT64.dtype), [2])
    exact = op.Equal(r, op.Constant(value_int=0))
    in_num = op.And(visible, op.Or(exact, op.Equal(r, op.Constant(value_int=2))))
    in_den = op.And(visible, op.Or(exact, op.Equal(r, op.Constant(value_int=1))))
    z_num = op.Where(in_num, z, neg_inf)
    z_den = op.Where(in_den, z, neg_inf)
    last = op.Constant(value_ints=[-1])
    top_n = op.ReduceMax(z_num, last, keepdims=1)
    top_z = op.ReduceMax(z_den, last, keepdims=1)
    m_num = op.Where(op.IsInf(top_n, detect_positive=0), fzero, top_n)  # a max over nothing counts as 0
    m_den = op.Where(op.IsInf(top_z, detect_positive=0), fzero, top_z)
    num = op.MatMul(op.Exp(op.Sub(z_num, m_num)), vf)
    den = op.ReduceSum(op.Exp(op.Sub(z_den, m_den)), last, keepdims=1)
    half = op.Exp(op.Mul(op.Sub(m_num, m_den), op.Constant(value_float=0.5)))  # e^(m_N - m_Z) in two halves
    tiny = op.Constant(value_float=1.1754943508222875e-38)
    out = op.Mul(half, op.Div(op.Mul(half, num), op.Max(den, tiny)))
    out = op.Where(op.Equal(den, fzero), fzero, out)  # no visible denominator slot: 0
    return op.CastLike(op.Reshape(out, op.Concat(B, Hq, T, D, axis=0)), q)


@script(kv, default_opset=op)
def kcenter_compress(keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, fill: INT64, budget: INT64,
                     ratio: DOUBLE) -> tuple[TFloat, TFloat, FLOAT, INT64, INT64]:
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    two = op.Constant(value_int=2)
    neg_inf = op.Constant(value_float=float("-inf"))
    inf = op.Constant(value_float=float("inf"))
    fzero = op.Constant(value_float=0.0)
    axis2 = op.Constant(value_ints=[2])
    C = op.Shape(keys, start=2, end=3)  # [1]
    rows = op.Shape(fill)  # [B, H]
    RC = op.Concat(rows, C, axis=0)
    ar = op.Range(zero, op.Squeeze(C), one)  # [C]
    ar_rows = op.Expand(ar, RC)
    target = op.Gather(budget, zero)
    due = op.GreaterOrEqual(fill, op.Gather(budget, one))  # [B, H]
    due3 = op.Unsqueeze(due, [2])
    valid = op.And(op.Less(ar, op.Unsqueeze(fill, [2])), op.Greater(bias, neg_inf))
    vi = op.Cast(valid, to=INT64.dtype)
    V = op.ReduceSum(vi, axis2, keepdims=1)  # [B, H, 1]
    rank = op.Sub(op.CumSum(vi, two), one)
    ell = op.Cast(op.Floor(op.Mul(op.Cast(target, to=DOUBLE.dtype), op.Gather(ratio, zero))), to=INT64.dtype)
    over = op.And(due3, op.Greater(V, target))
    recent = op.And(valid, op.GreaterOrEqual(rank, op.Sub(V, ell)))
    cand = op.And(op.And(valid, op.Not(recent)), over)
    # greedy k-center over the candidates: k = B - ell centres (the same k for every row), capped at C
    x = op.Cast(keys, to=FLOAT.dtype)
    KD1 = op.Concat(rows, op.Constant(value_ints=[1]), op.Shape(keys, start=3, end=4), axis=0)  # [B, H, 1, D]
    chosen = op.Less(ar_rows, zero)  # all False
    d2 = op.Expand(inf, RC)  # squared distance to the nearest chosen centre
    steps = op.Max(op.Min(op.Sub(target, ell), op.Squeeze(C)), zero)
    for i in range(steps):
        free = op.And(cand, op.Not(chosen))
        c = op.ArgMax(op.Where(free, d2, neg_inf), axis=2, keepdims=1, select_last_index=0)  # [B, H, 1]
        active = op.Greater(op.ReduceMax(op.Cast(free, to=INT64.dtype), axis2, keepdims=1), zero)
        chosen = op.Or(chosen, op.And(op.Equal(ar, c), active))
        diff = op.Sub(x, op.GatherElements(x, op.Expand(op.Unsqueeze(c, [3]), KD1), axis=2))
        dc = op.ReduceSum(op.Mul(diff, diff), op.Constant(value_ints=[3]), keepdims=0)
        d2 = op.Where(active, op.Min(d2, dc), d2)
    # kept: the recent window and the centres of rows over B, every valid slot of the others; due rows only
    # (no Where on bools: onnxruntime has no bool kernel for it)
    kept = op.And(op.Or(op.And(over, op.Or(recent, chosen)), op.And(op.Not(over), valid)), due3)
    ki = op.Cast(kept, to=INT64.dtype)
    n_kept = op.ReduceSum(ki, axis2, keepdims=1)
    dest = op.Where(kept, op.Sub(op.CumSum(ki, two), one), op.Add(ar, C))
    base = op.Expand(op.Concat(ar, ar, axis=0), op.Concat(rows, op.Add(C, C), axis=0))
    src = op.Slice(op.ScatterElements(base, dest, ar_rows, axis=2), op.Constant(value_ints=[0]), C, axis2)
    packed = op.And(due3, op.Less(ar, n_kept))
    packed4 = op.Unsqueeze(packed, [3])
    src4 = op.Expand(op.Unsqueeze(src, [3]), op.Shape(keys))
    keys2 = op.Where(packed4, op.GatherElements(keys, src4, axis=2), keys)
    values2 = op.Where(packed4, op.GatherElements(values, src4, axis=2), values)
    slot_pos2 = op.Where(packed, op.GatherElements(slot_pos, src, axis=2), slot_pos)
    bias2 = op.Where(due3, op.Where(packed, fzero, neg_inf), bias)
    fill2 = op.Where(due, op.Squeeze(n_kept, [2]), fill)
    return keys2, values2, bias2, slot_pos2, fill2


FUNCTIONS = {"sketch_attention": sketch_attention, "kcenter_compress": kcenter_compress}
CALLS = {}  # functions whose bodies call other kvrewrite functions
HELPERS = {}
