"""Fuse the RMSNorm that follows a tensor-parallel sum into the sum's kernel: kvrewrite::tp_all_reduce_rms_norm.

Matches:  in decode graphs with ctx.gemv, tp > 1 and ctx.tp_all_reduce == "one_shot", a kvrewrite::tp_all_reduce node
          h = tp_all_reduce(x, group[, residual]) read as x by kvrewrite::gemv_rms_norm nodes without a residual
          (fuse_rms_norm_into_gemv put them there: post_attention_layernorm before gate/up, the next layer's
          input_layernorm before q/k/v, the model's norm before the lm_head), all with one norm weight, eps and
          unit_offset, and none of whose second output (h, empty without a residual) is read.
Emits:    h, n = kvrewrite::tp_all_reduce_rms_norm(x, group, residual, norm_weight, eps, unit_offset) in the sum's
          place (getitems), and kvrewrite::gemv(n, weight, bias, constant_weight) for each of those GEMVs; the sum's
          other readers (the next residual) read h.
Why:      the norm ran inside the GEMV, which could start only once the sum completed: on two H200s (8B, tp=2) the
          gate/up and q/k/v GEMVs took 13 us a layer over their weights' time. In the sum's one program (it holds the
          row) the norm is a few more instructions, and the plain GEMV after it loads its first constant-weight tiles
          while the sum meets the peers (kernels/tp_all_reduce_rms_norm.py).
Requires: runs after fuse_rms_norm_into_gemv (TP_PASSES' last). Anything else stays as it is (an optimisation, never
          a refusal); a sum whose row the op cannot take in one kernel runs there in two steps (the op's Paths).
          The op module's IN_GRAPHS = False turns the pass off (the A/B baseline).
"""
import logging
import operator

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.kernels import tp_all_reduce_rms_norm as _op  # registers kvrewrite::tp_all_reduce_rms_norm
from kvrewrite.passes.utils import all_args, clean_up

logger = logging.getLogger(__name__)

SUM = torch.ops.kvrewrite.tp_all_reduce.default
NORM_GEMV = torch.ops.kvrewrite.gemv_rms_norm.default
GEMV = torch.ops.kvrewrite.gemv.default
OP = torch.ops.kvrewrite.tp_all_reduce_rms_norm.default


def _outputs(node: fx.Node) -> dict | None:
    """{index: getitem node} of a tuple-returning node, None when anything else reads it."""
    items = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        items[user.args[1]] = user
    return items


def _source(node):
    """A get_attr node's target (two get_attr nodes of one weight are one norm), else the node."""
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else node


def _after(node: fx.Node, other: fx.Node) -> bool:
    """Whether node comes after other in their graph: a walk forward from other (asked only of a norm weight that is
    no get_attr, none in HF's graphs, so no graph-wide index is built per sum)."""
    walk = other.next
    while walk.op != "root":
        if walk is node:
            return True
        walk = walk.next
    return False


def _norm_gemvs(summed: fx.Node) -> list:
    """[(gemv_rms_norm node, its args, its y getitem)] that read summed as x without a residual, one norm among them,
    their h output unread; [] when any of those readers differs."""
    found = []
    for user in summed.users:
        if user.op != "call_function" or user.target is not NORM_GEMV:
            continue
        args = all_args(user)
        outs = _outputs(user)
        if args[0] is not summed or args[1] is not None or outs is None or set(outs) - {0} or 0 not in outs:
            return []
        found.append((user, args, outs[0]))
    norms = {(_source(args[2]), float(args[3]), bool(args[6])) for _, args, _ in found}
    return found if len(norms) == 1 else []


def fuse_rms_norm_into_tp_all_reduce(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    if (ctx.tp <= 1 or not ctx.gemv or ctx.graph_kind != "decode" or ctx.tp_all_reduce != "one_shot"
            or not _op.IN_GRAPHS):
        return gm
    graph = gm.graph
    for summed in [n for n in graph.nodes if n.op == "call_function" and n.target is SUM]:
        found = _norm_gemvs(summed)
        if not found:
            continue
        x, group, residual = all_args(summed)
        _, _, nw, eps, _, _, unit_offset, _ = found[0][1]
        if nw.op != "get_attr" and _after(nw, summed):
            continue  # a norm weight computed after the sum (none in HF's graphs): left alone
        with graph.inserting_before(summed):
            if nw.op == "get_attr":  # a get_attr of its own, before the op (the GEMV's may come after the sum)
                nw = graph.get_attr(nw.target)
            op = graph.call_function(OP, (x, group, residual, nw, float(eps), bool(unit_offset)))
            h = graph.call_function(operator.getitem, (op, 0))
            n = graph.call_function(operator.getitem, (op, 1))
        val = summed.meta.get("val")
        op.meta.update(summed.meta)
        h.meta.update(summed.meta)
        n.meta.update(summed.meta)
        if isinstance(val, torch.Tensor):
            op.meta["val"] = (val, val)
        for node, args, y in found:
            _, _, _, _, weight, bias, _, constant_weight = args
            with graph.inserting_before(node):
                gemv = graph.call_function(GEMV, (n, weight, bias, constant_weight))
            gemv.meta.update(y.meta)
            y.replace_all_uses_with(gemv)
            graph.erase_node(y)
            graph.erase_node(node)
            ctx.counters["fuse_rms_norm_into_tp_all_reduce.gemvs"] += 1
        summed.replace_all_uses_with(h)
        graph.erase_node(summed)
        ctx.counters["fuse_rms_norm_into_tp_all_reduce"] += 1
    logger.debug("%s: %d sums + RMSNorm -> kvrewrite::tp_all_reduce_rms_norm", ctx.where(),
                 ctx.counters["fuse_rms_norm_into_tp_all_reduce"])
    return clean_up(gm)
