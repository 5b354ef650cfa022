"""Replace the decode graph's matrix-vector products with kvrewrite::gemv. Opt-in.

Matches:  in decode graphs only, aten.linear nodes whose weight (and bias, if any) are get_attr tensors,
          the weight 2-D with unit stride along K, whose input's traced value is one row (batch_size 1,
          one token; kernels/gemv.py) of one dtype of fp16/bf16/fp32 with the weight: every projection,
          the fused ones of passes/fuse_projections.py, and the lm_head.
Emits:    kvrewrite::gemv(x, weight, bias, constant_weight) in place of each: the same function (F.linear on the
          CPU). constant_weight is True where no node of the graph writes the weight's get_attr (utils.written_sources:
          only the state is written), so the kernel may load its first weight tile before it waits for the
          kernel before it (kernels/_pdl.py, "Constant weights").
Why:      a batch-1 decode step is a string of matrix-vector products that read every weight once;
          cuBLAS runs them as split-K GEMMs plus a reduction kernel, the Triton GEMV is 1.07-1.57x as fast
          on an H100 in one launch (kernels/gemv.py, docs/bench/gemv_h100.json): a batch-1 decode step of
          Llama-3.1-8B at 32k went from 6.83 to 6.24 ms (docs/bench.md).
Opt-in:   `kvrewrite.apply(..., gemv=True)`: the results differ from cuBLAS's by rounding (a different
          summation order), and the gain is measured on the H100 shapes of Llama-3.1-8B only.
Requires: runs after fuse_projections (so the fused matmuls are replaced too); prefill graphs are left
          alone (a chunk has batch_size x prefill_chunk rows: a GEMM), and so are decode graphs of batch_size > 1
          (the kernel re-reads the weights per row; cuBLAS was faster from 2 rows on).
"""
import logging

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.kernels.gemv import input_problem
from kvrewrite.passes.utils import attr_tensor, clean_up, written_sources

logger = logging.getLogger(__name__)

LINEAR = torch.ops.aten.linear.default


def _fits(gm: fx.GraphModule, node: fx.Node) -> bool:
    """The linear node's weight and bias are get_attr tensors and, with its input's traced value, are what
    kvrewrite::gemv takes (its own input_problem decides)."""
    x, w_node = node.args[0], node.args[1]
    b_node = node.args[2] if len(node.args) > 2 else None
    if node.kwargs or not isinstance(x, fx.Node) or w_node.op != "get_attr" or \
            (b_node is not None and b_node.op != "get_attr"):
        return False
    w, b, val = attr_tensor(gm, w_node), attr_tensor(gm, b_node), x.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(val.numel(), int):  # a symbolic size is not known to fit
        return False
    return input_problem(val, w, b) is None


def replace_linear_with_gemv(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    if not ctx.gemv or ctx.graph_kind != "decode":
        return gm
    graph = gm.graph
    written = {n.target for n in written_sources(gm) if n.op == "get_attr"}  # one attr may have several nodes
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not LINEAR or not _fits(gm, node):
            continue
        x, w_node = node.args[:2]
        b_node = node.args[2] if len(node.args) > 2 else None
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.kvrewrite.gemv.default,
                                      (x, w_node, b_node, w_node.target not in written))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        ctx.counters["replace_linear_with_gemv"] += 1
    logger.debug("%s: %d linear nodes -> kvrewrite::gemv", ctx.where(), ctx.counters["replace_linear_with_gemv"])
    return clean_up(gm)
