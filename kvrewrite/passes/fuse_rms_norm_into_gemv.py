"""Fuse the residual add and the RMSNorm before a decode GEMV into it: kvrewrite::gemv_rms_norm. Comes with gemv.

Matches:  in decode graphs with ctx.gemv, HF's aten spellings of RMSNorm whose output feeds only kvrewrite::gemv
          nodes (as their x, through aten.alias nodes or not), every node, constant and user count checked:
            Llama/Mistral/Qwen/Phi:  h32 = to(h, f32); r = rsqrt(mean(pow(h32, 2), [-1], True) + eps)
                                     out = mul(norm_weight, to(mul(h32, r), h.dtype))
            Gemma:                   out = type_as(mul(mul(h32, r), add(to(norm_weight, f32), 1.0)), h)
          h32 may have more users only where h is fp32 (to(h, f32) is h itself). The norm's input h is
          fused too where it is aten.add(a, b) of two tensors of h's shape and dtype (the residual add).
Emits:    y, h' = kvrewrite::gemv_rms_norm(a, b, norm_weight, eps, weight, bias, unit_offset, constant_weight) per gemv
          (getitems; constant_weight is the gemv's):
          the gemv's uses read y, the add's other users read h'. With several gemv users (q, k, v unfused) the
          first takes the add, the others (h', None, ...): one add. Without the add: (h, None, ...) each.
          On the CPU the op runs the replaced aten ops themselves: the graph computes the same bits.
Why:      a batch-1 decode step of Llama-3.1-8B runs these as 65 Inductor kernels of ~2.6 us each (~170 us of
          ~5.5 ms, docs/bench/e2e_h100_decode_profile_gemv.txt); fused, each GEMV program normalises its input
          first (kernels/gemv_rms_norm.py, docs/bench/gemv_rms_norm_h100.json). From the op's SPLIT_NORM_MIN_N
          output rows on (the gate/up projection, the lm_head), the op runs the norm as one program of its own that
          the GEMV's early weight loads overlap: still one node here, the op decides at launch.
Requires: runs after replace_linear_with_gemv (it rewrites the kvrewrite::gemv nodes that pass inserts). Anything
          that does not match exactly stays as it is (an optimisation, never a refusal).
"""
import logging
import operator

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.kernels.gemv_rms_norm import input_problem_rms
from kvrewrite.passes.utils import all_args, attr_tensor, clean_up

logger = logging.getLogger(__name__)

aten = torch.ops.aten
GEMV = torch.ops.kvrewrite.gemv.default
OP = torch.ops.kvrewrite.gemv_rms_norm.default


def _call(node, target, n_args=None) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is target and not node.kwargs
            and (n_args is None or len(node.args) == n_args))


def _only_user(node, target, n_args=None):
    """node's single user if it is a call of target, else None."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    return user if _call(user, target, n_args) else None


def _val(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _attr(gm, node):
    """A get_attr node's tensor, else the node's traced value (None for None)."""
    if node is None or node.op == "get_attr":
        return attr_tensor(gm, node)
    return _val(node)


def _other(mul, a):
    """The other argument of the binary mul with a among its arguments (either order), else None."""
    x, y = mul.args
    return y if x is a else x if y is a else None


def _match_norm(pow_node):
    """The RMSNorm around pow_node: dict(src, h32, nw, eps, unit_offset, out, nodes) or None."""
    if not _call(pow_node, aten.pow.Tensor_Scalar, 2) or pow_node.args[1] != 2:
        return None
    h32 = pow_node.args[0]
    if not _call(h32, aten.to.dtype, 2) or h32.args[1] != torch.float32:
        return None
    src = h32.args[0]
    src_val = _val(src)
    if src_val is None or src_val.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    dtype = src_val.dtype
    mean = _only_user(pow_node, aten.mean.dim, 3)
    if mean is None or list(mean.args[1]) != [-1] or mean.args[2] is not True:
        return None
    add_eps = _only_user(mean, aten.add.Tensor, 2)
    if add_eps is None or add_eps.args[0] is not mean or type(add_eps.args[1]) not in (float, int):
        return None
    rsqrt = _only_user(add_eps, aten.rsqrt.default, 1)
    mul_r = None if rsqrt is None else _only_user(rsqrt, aten.mul.Tensor, 2)
    if mul_r is None or _other(mul_r, rsqrt) is not h32 or len(mul_r.users) != 1:
        return None
    nodes = [h32, pow_node, mean, add_eps, rsqrt, mul_r]
    nxt = next(iter(mul_r.users))
    if _call(nxt, aten.to.dtype, 2) and nxt.args[0] is mul_r and nxt.args[1] == dtype:  # Llama
        out = _only_user(nxt, aten.mul.Tensor, 2)
        nw = None if out is None else _other(out, nxt)
        unit_offset = False
        nodes += [nxt, out]
    elif _call(nxt, aten.mul.Tensor, 2) and nxt.args[0] is mul_r:  # Gemma: mul(normed, add(to(w, f32), 1.0))
        add_one, to_w = nxt.args[1], None
        if _call(add_one, aten.add.Tensor, 2) and add_one.args[1] == 1 and len(add_one.users) == 1:
            to_w = add_one.args[0]
        if not (_call(to_w, aten.to.dtype, 2) and to_w.args[1] == torch.float32 and len(to_w.users) == 1):
            return None
        out = _only_user(nxt, aten.type_as.default, 2)
        if out is None or out.args[0] is not nxt or _val(out.args[1]) is None or _val(out.args[1]).dtype != dtype:
            return None
        nw, unit_offset = to_w.args[0], True
        nodes += [to_w, add_one, nxt, out]
    else:
        return None
    if out is None or not isinstance(nw, fx.Node) or _val(nw) is None:
        return None
    extra = [u for u in h32.users if u not in (pow_node, mul_r)]
    if extra and dtype != torch.float32:  # to(h, f32) of an fp16/bf16 h is a new tensor other nodes read
        return None
    return dict(src=src, h32=h32, nw=nw, eps=float(add_eps.args[1]), unit_offset=unit_offset, out=out, nodes=nodes)


def _gemv_users(out):
    """The kvrewrite::gemv nodes that read out as x (directly or through single aten.alias nodes), with the alias
    nodes on the way; None unless those are all of out's users."""
    gemvs, aliases, todo = [], [], [out]
    while todo:
        node = todo.pop()
        for user in node.users:
            if _call(user, GEMV) and user.args[0] is node and node not in user.args[1:]:
                gemvs.append(user)
            elif _call(user, aten.alias.default, 1):
                aliases.append(user)
                todo.append(user)
            else:
                return None
    return (gemvs, aliases) if gemvs else None


def _residual_add(src):
    """(a, b) where src = aten.add(a, b) of two tensors of src's shape and dtype, else None."""
    if not _call(src, aten.add.Tensor, 2):
        return None
    a, b = src.args
    va, vb, vs = _val(a), _val(b), _val(src)
    if va is None or vb is None or any(v.shape != vs.shape or v.dtype != vs.dtype for v in (va, vb)):
        return None
    return a, b


def _order(graph):
    return {n: i for i, n in enumerate(graph.nodes)}


def fuse_rms_norm_into_gemv(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    if not ctx.gemv or ctx.graph_kind != "decode":
        return gm
    graph = gm.graph
    for pow_node in [n for n in graph.nodes if _call(n, aten.pow.Tensor_Scalar, 2)]:
        norm = _match_norm(pow_node)
        found = None if norm is None else _gemv_users(norm["out"])
        if found is None:
            continue
        gemvs, _ = found  # the alias nodes die with the norm (clean_up)
        order = _order(graph)
        gemvs.sort(key=order.__getitem__)
        src, chain = norm["src"], set(norm["nodes"])
        add = _residual_add(src)
        h_users = [] if add is None else [u for u in src.users if u is not norm["h32"] and u not in chain]
        extra = [u for u in norm["h32"].users if u not in chain]  # fp32 only: they read h itself
        if add is not None and any(order[u] < order[gemvs[0]] for u in h_users + extra):
            add = None  # a reader of h before the first gemv: leave the add as it is
        x, residual = (src, None) if add is None else add
        nw_val = _val(norm["nw"])
        if any(input_problem_rms(_val(x), _val(residual), nw_val, *(_attr(gm, a) for a in all_args(g)[1:3]))
               is not None for g in gemvs):
            continue
        h_out = None
        for gemv in gemvs:
            _, weight, bias, constant_weight = all_args(gemv)
            args = (x, residual, norm["nw"], norm["eps"], weight, bias, norm["unit_offset"], constant_weight)
            with graph.inserting_before(gemv):
                op = graph.call_function(OP, args)
                y = graph.call_function(operator.getitem, (op, 0))
                h = graph.call_function(operator.getitem, (op, 1)) if residual is not None else None
            y_val = _val(gemv)
            h_val = _val(src) if residual is not None else _val(x).new_empty(0)
            op.meta.update(gemv.meta)
            op.meta["val"] = (y_val, h_val)
            y.meta.update(gemv.meta)
            if h is not None:
                h.meta.update(src.meta)
                h_out = h
            gemv.replace_all_uses_with(y)
            graph.erase_node(gemv)
            if residual is not None:  # the other gemvs read h, normalised again: one add
                x, residual = h, None
            ctx.counters["fuse_rms_norm_into_gemv"] += 1
        for user in h_users:
            user.replace_input_with(src, h_out)
        for user in extra:
            user.replace_input_with(norm["h32"], src if h_out is None else h_out)
    logger.debug("%s: %d RMSNorm + gemv -> kvrewrite::gemv_rms_norm", ctx.where(),
                 ctx.counters["fuse_rms_norm_into_gemv"])
    return clean_up(gm)
