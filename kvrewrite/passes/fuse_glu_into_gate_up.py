"""Move a gated MLP's act(gate) * up from the down projection's prologue into the gate/up projection's epilogue:
kvrewrite::gemv_rms_norm_glu. Opt-in twice: with gemv, and while kernels/gemv_rms_norm_glu.FUSE is on.

Matches:  in decode graphs with ctx.gemv (tp = 1), kvrewrite::gemv_glu(a, b, w, bias, act, c) whose a and b are
          aten.slice.Tensor(y, -1, 0, I) and aten.slice.Tensor(y, -1, I, 2I), each read only by it, y the output
          (getitem 0) of a kvrewrite::gemv_rms_norm whose weight has 2I rows and which nothing else reads: the fused
          gate/up projection (passes/fuse_projections.py) behind its RMSNorm (passes/fuse_rms_norm_into_gemv.py), in
          front of the down projection (passes/fuse_glu_into_gemv.py), as Llama-like families' decode graphs hold it.
Emits:    z, h = kvrewrite::gemv_rms_norm_glu(x, residual, norm_weight, eps, weight, bias, unit_offset, act, c') (c'
          the gate/up's constant_weight) and kvrewrite::gemv(z, w, bias, c) for the gemv_glu; the gemv_rms_norm's
          h users read the new h. On the CPU both ops run the aten ops they replace, in their order: the graph
          computes the same bits.
Why:      gemv_glu's every program recomputes act(gate) * up over all of K from both halves of the row; the epilogue
          computes each element once (kernels/gemv_rms_norm_glu.py). Not yet timed on a GPU, hence FUSE.
Requires: runs after fuse_glu_into_gemv and fuse_rms_norm_into_gemv (it rewrites their nodes). Off at tp > 1, where
          fuse_rms_norm_into_tp_all_reduce puts the post-attention norm into the sum instead (TP_PASSES runs it
          last, on the gemv_rms_norm this pass would take).
"""
import logging
import operator

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.kernels import gemv_rms_norm_glu as glu_op
from kvrewrite.passes.utils import all_args, clean_up, traced_value

logger = logging.getLogger(__name__)

GEMV = torch.ops.kvrewrite.gemv.default
GEMV_GLU = torch.ops.kvrewrite.gemv_glu.default
GEMV_RMS_NORM = torch.ops.kvrewrite.gemv_rms_norm.default
OP = torch.ops.kvrewrite.gemv_rms_norm_glu.default
SLICE = torch.ops.aten.slice.Tensor


def _slice_bounds(node, source):
    """(start, end) of node = aten.slice.Tensor(source, last dim, start, end, step 1) with one user, else None."""
    if (not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not SLICE or node.kwargs
            or len(node.users) != 1 or len(node.args) not in (4, 5) or node.args[0] is not source):
        return None
    val = node.meta.get("val")
    dim = node.args[1]
    if not (dim == -1 or (isinstance(val, torch.Tensor) and dim == val.dim() - 1)):
        return None
    if len(node.args) == 5 and node.args[4] != 1:
        return None
    return node.args[2], node.args[3]


def _match(gm: fx.GraphModule, glu: fx.Node):
    """(norm node, its getitem 0, the two slices) when glu's inputs are the halves of a gemv_rms_norm's output, else
    None."""
    a, b = glu.args[0], glu.args[1]
    y = a.args[0] if isinstance(a, fx.Node) and a.args else None
    if not (isinstance(y, fx.Node) and y.op == "call_function" and y.target is operator.getitem and y.args[1] == 0):
        return None
    norm = y.args[0]
    if not (isinstance(norm, fx.Node) and norm.op == "call_function" and norm.target is GEMV_RMS_NORM):
        return None
    if any(u.op != "call_function" or u.target is not operator.getitem or (u is not y and u.args[1] != 1)
           for u in norm.users):
        return None
    weight = traced_value(gm, all_args(norm)[4])
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] % 2:
        return None
    half = int(weight.shape[0]) // 2
    if _slice_bounds(a, y) != (0, half) or _slice_bounds(b, y) not in ((half, 2 * half), (half, 2**63 - 1)):
        return None
    if set(y.users) != {a, b} or glu.args[0] is not a or glu.args[1] is not b:
        return None
    return norm, y, a, b


def fuse_glu_into_gate_up(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    if not glu_op.FUSE or not ctx.gemv or ctx.graph_kind != "decode" or ctx.tp > 1:
        return gm
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not GEMV_GLU:
            continue
        found = _match(gm, node)
        if found is None:
            continue
        norm, y, a, b = found
        x, residual, norm_weight, eps, weight, bias, unit_offset, constant = all_args(norm)
        _, _, w_down, b_down, act, c_down = all_args(node)
        vals = [traced_value(gm, n) if isinstance(n, fx.Node) else n for n in (x, residual, norm_weight, weight, bias)]
        if any(isinstance(n, fx.Node) and v is None for n, v in zip((x, residual, norm_weight, weight, bias), vals)):
            continue  # unknown values are not known to fit
        if glu_op.input_problem(*vals, act) is not None:
            continue
        with graph.inserting_before(norm):  # where the norm was: its h may be read before the gemv_glu
            fused = graph.call_function(OP, (x, residual, norm_weight, eps, weight, bias, unit_offset, act, constant))
            z = graph.call_function(operator.getitem, (fused, 0))
            h = graph.call_function(operator.getitem, (fused, 1))
        with graph.inserting_before(node):
            down = graph.call_function(GEMV, (z, w_down, b_down, c_down))
        down.meta.update(node.meta)
        node.replace_all_uses_with(down)
        for user in list(norm.users):
            if user is not y:  # the getitem 1 of h (the next residual)
                user.replace_all_uses_with(h)
                graph.erase_node(user)
        for dead in (node, a, b, y, norm):
            graph.erase_node(dead)
        ctx.counters["fuse_glu_into_gate_up"] += 1
    logger.debug("%s: %d gate/up + act * up -> kvrewrite::gemv_rms_norm_glu", ctx.where(),
                 ctx.counters["fuse_glu_into_gate_up"])
    return clean_up(gm)
