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
          (kernels/tp_all_reduce.py).
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
from kvrewrite.passes.utils import clean_up

logger = logging.getLogger(__name__)

LINEAR = torch.ops.aten.linear.default


def insert_tensor_parallel_all_reduce(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    if ctx.tp <= 1:
        return gm
    graph = gm.graph
    # the capture wraps the HF model as `model` (capture._StaticCacheWrapper): its weights are model.<name>
    wanted = {f"model.{name}" for name in ctx.tp_row_parallel}
    seen = set()
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.target not in wanted:
            continue
        for user in list(node.users):
            if user.op != "call_function" or user.target is not LINEAR or user.args[1] is not node or user.kwargs:
                raise RewriteError(f"{ctx.where(node=user)}: the row-parallel weight {node.target} is read by "
                                   f"something else than aten.linear(x, weight[, bias])")
            x, bias = user.args[0], (user.args[2] if len(user.args) > 2 else None)
            with graph.inserting_before(user):
                partial = graph.call_function(LINEAR, (x, node))
                if ctx.tp_all_reduce == "one_shot":
                    summed = out = graph.call_function(torch.ops.kvrewrite.tp_all_reduce.default,
                                                       (partial, ctx.tp_group))
                else:
                    summed = graph.call_function(torch.ops._c10d_functional.all_reduce.default,
                                                 (partial, "sum", ctx.tp_group))
                    out = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (summed,))
                if bias is not None:
                    out = graph.call_function(torch.ops.aten.add.Tensor, (out, bias))
            for new in dict.fromkeys((partial, summed, out)):  # summed is out for the one-shot op
                new.meta["nn_module_stack"] = user.meta.get("nn_module_stack", {})
            user.replace_all_uses_with(out)
            graph.erase_node(user)
            ctx.counters["insert_tensor_parallel_all_reduce"] += 1
        seen.add(node.target)
    missing = sorted(wanted - seen)
    if missing:
        raise RewriteError(f"{ctx.where()}: no aten.linear reads the row-parallel weights {missing[:4]}"
                           f"{' ...' if len(missing) > 4 else ''}: the graph does not match the sharding")
    logger.debug("%s: %d all-reduces", ctx.where(), ctx.counters["insert_tensor_parallel_all_reduce"])
    return clean_up(gm)
