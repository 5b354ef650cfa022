"""FX passes that turn a captured HF graph into one reading and updating a clustered KV cache.

PASSES is the order (to reorder, edit the list); TP_PASSES the order with tensor parallelism (tp > 1).
Every pass is `(gm, ctx) -> gm`, one per file, with a docstring stating what it matches and emits.
`run_passes` lints after each pass and can dump the graph before/after each one.
"""
import logging
import os

from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.passes.fuse_attention_observation import fuse_attention_observation
from kvrewrite.passes.fuse_glu_into_gemv import fuse_glu_into_gemv
from kvrewrite.passes.fuse_projections import fuse_projections
from kvrewrite.passes.fuse_rms_norm_into_gemv import fuse_rms_norm_into_gemv
from kvrewrite.passes.fuse_rms_norm_into_tp_all_reduce import fuse_rms_norm_into_tp_all_reduce
from kvrewrite.passes.insert_cache_compression import insert_cache_compression
from kvrewrite.passes.insert_tensor_parallel_all_reduce import insert_tensor_parallel_all_reduce
from kvrewrite.passes.insert_vocab_parallel_all_gather import insert_vocab_parallel_all_gather
from kvrewrite.passes.locate_attention_sites import locate_attention_sites
from kvrewrite.passes.normalize_eager_attention import normalize_eager_attention
from kvrewrite.passes.remove_dead_cache_buffers import remove_dead_cache_buffers
from kvrewrite.passes.replace_linear_with_gemv import replace_linear_with_gemv
from kvrewrite.passes.replace_kv_cache_update import replace_kv_cache_update
from kvrewrite.passes.replace_sdpa_with_clustered_attention import replace_sdpa_with_clustered_attention
from kvrewrite.passes.utils import deferred_recompile

logger = logging.getLogger(__name__)

PASSES = [
    normalize_eager_attention,
    locate_attention_sites,
    replace_kv_cache_update,
    replace_sdpa_with_clustered_attention,
    insert_cache_compression,
    remove_dead_cache_buffers,
    fuse_attention_observation,
    fuse_projections,  # opt-in (ctx.fuse_projections)
    replace_linear_with_gemv,  # opt-in (ctx.gemv), decode graphs only
    fuse_rms_norm_into_gemv,  # with replace_linear_with_gemv (ctx.gemv): the RMSNorm before a gemv, into it
    fuse_glu_into_gemv,  # with replace_linear_with_gemv: act(gate) * up into the down projection's gemv
]
# tp > 1 (kvrewrite/tensor_parallel.py): the all-reduces and the logits' all-gather go in first, on the captured
# linears (before GEMV replaces them), the norms after a sum go into it last (on gemv_rms_norm); tp=1 runs PASSES,
# untouched
TP_PASSES = [insert_tensor_parallel_all_reduce, insert_vocab_parallel_all_gather, *PASSES,
             fuse_rms_norm_into_tp_all_reduce]


def run_passes(gm: fx.GraphModule, ctx: RewriteContext, passes=None, dump_dir=None) -> fx.GraphModule:
    """Run `passes` (default PASSES) in order, linting after each; optionally dump the graph text
    before and after each pass into dump_dir (<graph_kind>_<i>_{before,after}_<pass>.txt). The module's code is
    generated once, after the last pass (passes/utils.deferred_recompile)."""
    with deferred_recompile():
        for i, p in enumerate(PASSES if passes is None else passes):
            if dump_dir:
                _dump(gm, dump_dir, f"{ctx.graph_kind}_{i:02d}_before_{p.__name__}.txt")
            gm = p(gm, ctx)
            gm.graph.lint()
            if dump_dir:
                _dump(gm, dump_dir, f"{ctx.graph_kind}_{i:02d}_after_{p.__name__}.txt")
            logger.debug("%s: ran %s", ctx.where(), p.__name__)
    gm.recompile()
    return gm


def _dump(gm: fx.GraphModule, dump_dir, name: str) -> None:
    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, name), "w") as f:
        f.write(str(gm.graph))
