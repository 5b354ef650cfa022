"""Sum the row-parallel projections' partial outputs over the tensor-parallel ranks (tp > 1 only).

Matches:  aten.linear nodes whose weight is a get_attr of one of ctx.tp_row_parallel (the o_proj and down_proj
          weights kvrewrite/tensor_parallel.py sliced by input columns); exactly two per decoder layer.
Emits:    linear(x, w) -> _c10d_functional.all_reduce(., "sum", ctx.tp_group) -> _c10d_functional.wait_tensor,
          then `+ bias` when the linear had one: the bias is added once, after the sum, so every rank runs the
          same graph (adding it on rank 0 only would give the ranks different graphs for the same result).
          The functional collectives are graph ops that torch.compile (Inductor) and CUDA graphs keep; the
          same graph runs on gloo (CPU) and NCCL (GPU).
          With ctx.tp_all_reduce == "one_shot" (apply's tp_all_reduce, tensor_parallel.prepare_all_reduce):
          linear(x, w) -> kvrewrite::tp_all_reduce(., ctx.tp_group) instead, one kernel over symmetric memory
          (kernels/tp_all_reduce.py); where the linear has no bias and its only user is the residual add
          (aten.add of it and a tensor of its shape and dtype), the add folds into the op:
          kvrewrite::tp_all_reduce(linear(x, w), ctx.tp_group, residual), which sums and adds in one kernel (one
          fewer kernel than the add fused into the next GEMV's norm: measured, stop 44, docs/tensor-parallel.md).
          Every new node carries the linear's `val` (shape, dtype), which later passes match on: without it
          fuse_rms_norm_into_gemv could not fold an add left after the sum into the next GEMV, and Inductor ran it
          as a kernel of its own (63 per 8B step at tp=2 before stop 44, ~1.3 us each plus a launch gap).
Errors:   a row-parallel weight that no linear reads, or one read by something else than a linear (the
          sharding and the graph disagree): RewriteError naming it.
Requires: nothing of the other passes; runs before replace_linear_with_gemv (which replaces aten.linear).
"""
import logging

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.errors import RewriteError
import kvrewrite.kernels.tp_all_reduce  # noqa: F401  (registers kvrewrite::tp_all_reduce)
from kvrewrite.passes.utils import clean_up, weight_linears

logger = logging.getLogger(__name__)

LINEAR = torch.ops.aten.linear.default


def _residual_add(linear: fx.Node) -> fx.Node | None:
    """The linear's only user when it is aten.add(linear, r) or add(r, linear) of two tensors of one shape and dtype
    (the residual add after o_proj and down_proj), else None."""
    if len(linear.users) != 1:
        return None
    add = next(iter(linear.users))
    if add.op != "call_function" or add.target is not torch.ops.aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    a, b = add.args
    if not all(isinstance(n, fx.Node) for n in (a, b)) or (a is linear) == (b is linear):
        return None
    vals = [n.meta.get("val") for n in (a, b, add)]
    if not all(isinstance(v, torch.Tensor) for v in vals) or len({(tuple(v.shape), v.dtype) for v in vals}) != 1:
        return None
    return add


def _other(add: fx.Node, linear: fx.Node) -> fx.Node:
    return add.args[1] if add.args[0] is linear else add.args[0]


def insert_tensor_parallel_all_reduce(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    if ctx.tp <= 1:
        return gm
    graph = gm.graph
    # the capture wraps the HF model as `model` (capture._StaticCacheWrapper): its weights are model.<name>
    wanted = {f"model.{name}" for name in ctx.tp_row_parallel}
    pairs, seen = weight_linears(gm, wanted, ctx, "row-parallel")
    for node, user in pairs:
        x, bias = user.args[0], (user.args[2] if len(user.args) > 2 else None)
        add = _residual_add(user) if ctx.tp_all_reduce == "one_shot" and bias is None else None
        with graph.inserting_before(user if add is None else add):  # the add comes after its residual
            partial = graph.call_function(LINEAR, (x, node))
            if ctx.tp_all_reduce == "one_shot":
                args = (partial, ctx.tp_group) if add is None else (partial, ctx.tp_group, _other(add, user))
                summed = out = graph.call_function(torch.ops.kvrewrite.tp_all_reduce.default, args)
            else:
                summed = graph.call_function(torch.ops._c10d_functional.all_reduce.default,
                                             (partial, "sum", ctx.tp_group))
                out = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (summed,))
            if bias is not None:
                out = graph.call_function(torch.ops.aten.add.Tensor, (out, bias))
        for new in dict.fromkeys((partial, summed, out)):  # summed is out for the one-shot op
            new.meta["nn_module_stack"] = user.meta.get("nn_module_stack", {})
            if "val" in user.meta:  # the linear's shape and dtype: later passes match on them (the residual
                new.meta["val"] = user.meta["val"]  # add fuse_rms_norm_into_gemv folds into the next GEMV)
        if add is not None:
            add.replace_all_uses_with(out)
            graph.erase_node(add)
            ctx.counters["insert_tensor_parallel_all_reduce.residual"] += 1
        user.replace_all_uses_with(out)
        graph.erase_node(user)
        ctx.counters["insert_tensor_parallel_all_reduce"] += 1
    missing = sorted(wanted - seen)
    if missing:
        raise RewriteError(f"{ctx.where()}: no aten.linear reads the row-parallel weights {missing[:4]}"
                           f"{' ...' if len(missing) > 4 else ''}: the graph does not match the sharding")
    logger.debug("%s: %d all-reduces", ctx.where(), ctx.counters["insert_tensor_parallel_all_reduce"])
    return clean_up(gm)
