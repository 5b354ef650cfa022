"""Join the vocabulary-parallel logits of the ranks (tp > 1 with a split lm_head only).

Matches:  the aten.linear nodes whose weight is the get_attr of ctx.tp_vocab_parallel (the lm_head weight that
          kvrewrite/tensor_parallel.py split by vocabulary rows: this rank's Vl = V / tp rows); one per graph.
Emits:    linear(x, w[, b]) -> kvrewrite::tp_all_gather(., ctx.tp_group, ctx.tp): [..., Vl] -> [..., V], the
          columns in rank order, what the whole lm_head gave; the linear keeps its (split) bias. Whatever followed
          the lm_head (a final soft-capping, a logit scale) reads the whole logits as before.
Errors:   a vocab-parallel weight that no linear reads, or one read by something else than a linear:
          RewriteError naming it.
Requires: nothing of the other passes; runs before replace_linear_with_gemv (which replaces aten.linear by the
          decode GEMV, the gathered linear included).
"""
import logging

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.errors import RewriteError
import kvrewrite.kernels.tp_all_gather  # noqa: F401  (registers kvrewrite::tp_all_gather)
from kvrewrite.passes.utils import clean_up, weight_linears

logger = logging.getLogger(__name__)


def insert_vocab_parallel_all_gather(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    if ctx.tp <= 1 or not ctx.tp_vocab_parallel:
        return gm
    graph = gm.graph
    wanted = f"model.{ctx.tp_vocab_parallel}"  # the capture wraps the HF model as `model`
    pairs, _ = weight_linears(gm, {wanted}, ctx, "vocab-parallel")
    for _, user in pairs:
        with graph.inserting_after(user):
            joined = graph.call_function(torch.ops.kvrewrite.tp_all_gather.default, (user, ctx.tp_group, ctx.tp))
        user.replace_all_uses_with(joined, delete_user_cb=lambda n: n is not joined)
        joined.meta["nn_module_stack"] = user.meta.get("nn_module_stack", {})
        val = user.meta.get("val")
        if isinstance(val, torch.Tensor):  # the whole vocabulary's logits: later passes match on shapes
            joined.meta["val"] = val.new_empty((*val.shape[:-1], val.shape[-1] * ctx.tp))
        ctx.counters["insert_vocab_parallel_all_gather"] += 1
    if not pairs:
        raise RewriteError(f"{ctx.where()}: no aten.linear reads the vocab-parallel weight {wanted}: the graph does "
                           f"not match the sharding")
    logger.debug("%s: %d logits all-gathers", ctx.where(), len(pairs))
    return clean_up(gm)
