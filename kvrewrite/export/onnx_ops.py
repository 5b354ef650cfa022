"""The kvrewrite ops as ONNX functions of the custom domain "kvrewrite" (onnxscript).

Each function's body is the op's reference computation in standard ONNX ops (opset 18), so the
exported model carries it as a model-local FunctionProto: onnxruntime runs (inlines) it as it is, and a backend
with a native kernel for kvrewrite::<op> can substitute its own by domain and name. The state ops
are the functional forms (kvrewrite.export.functional): they return the updated
(keys, values, bias, slot_pos, fill) instead of writing them.

    kvrewrite::clustered_attention(q, keys, values, bias, slot_pos, cache_position; scale, window) -> out
    kvrewrite::cache_append(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid)
        -> (keys, values, bias, slot_pos, fill)
    kvrewrite::evict_to_budget(keys, values, bias, slot_pos, fill, budget; n_sink) -> (keys, ..., fill)

Numerics: attention computes in fp32 (MatMul instead of the reference's einsum: rounding only);
cache_append and evict_to_budget are scatters and gathers, exact. chelsea_compress has no function
here (see kvrewrite/export/onnx_export.py for why).
"""
from typing import TypeVar, Union

import torch
from onnxscript import BFLOAT16, BOOL, FLOAT, FLOAT16, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

import kvrewrite.export.functional  # noqa: F401  (registers kvrewrite_export::)

DOMAIN = "kvrewrite"
kv = Opset(DOMAIN, 1)
TFloat = TypeVar("TFloat", bound=Union[FLOAT, FLOAT16, BFLOAT16])  # q, keys, values: the model dtype


@script(kv, default_opset=op)
def clustered_attention(q: TFloat, keys: TFloat, values: TFloat, bias: FLOAT, slot_pos: INT64, cache_position: INT64,
                        scale: float, window: int) -> TFloat:
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
    raw = op.Add(op.Mul(op.MatMul(qf, op.Transpose(kf, perm=[0, 1, 3, 2])), sc), op.Unsqueeze(bias, [2]))
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


FUNCTIONS = {"clustered_attention": clustered_attention, "cache_append": cache_append,
             "evict_to_budget": evict_to_budget}


def function_protos() -> list:
    """The FunctionProtos the exported models carry (domain "kvrewrite", version 1)."""
    return [f.to_function_proto() for f in FUNCTIONS.values()]


# -- the nodes: torch.onnx.ops.symbolic emits a "kvrewrite::<op>" node during export -------------------
# (the functions are attached to the model afterwards: torch.onnx.export's opset conversion inlines every
# model-local function it finds, which would dissolve the custom-domain nodes into plain ONNX)

def _state_like(*tensors):
    return dict(dtypes=[t.dtype for t in tensors], shapes=[t.shape for t in tensors], version=1)


def sym_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window):
    return torch.onnx.ops.symbolic(f"{DOMAIN}::clustered_attention", [q, keys, values, bias, slot_pos, cache_position],
                                   {"scale": float(scale), "window": int(window)}, dtype=q.dtype, shape=q.shape,
                                   version=1)


def sym_cache_append(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid):
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::cache_append", [keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid],
        {}, **_state_like(keys, values, bias, slot_pos, fill)))


def sym_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink):
    return tuple(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::evict_to_budget", [keys, values, bias, slot_pos, fill, budget], {"n_sink": int(n_sink)},
        **_state_like(keys, values, bias, slot_pos, fill)))


SYMBOLIC = {
    torch.ops.kvrewrite.clustered_attention.default: sym_clustered_attention,
    torch.ops.kvrewrite_export.cache_append.default: sym_cache_append,
    torch.ops.kvrewrite_export.evict_to_budget.default: sym_evict_to_budget,
}
