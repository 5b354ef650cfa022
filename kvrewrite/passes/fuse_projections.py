"""Fuse the linear projections that read one input into one matmul (q/k/v; gate/up). Opt-in.

Matches:  groups of >= 2 aten.linear nodes with the same input node whose weights are get_attr tensors
          of one dtype, device and in_features, with get_attr biases on all of them or on none
          (Llama, Mistral, Qwen2/3, Gemma-3: q/k/v and gate/up; Phi-3 ships them fused already).
Emits:    one aten.linear over the weights (and biases) concatenated along the output rows, and an
          aten.slice of its last dim in place of each original output.
Why:      a decode step reads every weight once and is bandwidth-bound. On an H100 (bf16, batch 1)
          the 4096x1024 k/v GEMVs run at 34% of the copy bandwidth, q's 4096x4096 at 69%, the fused
          6144x4096 at 77% (docs/bench.md); and every matmul costs a launch and a split-K reduction.
Memory:   the fused tensors are made once per capture (ctx.fused_weights, shared by the three graphs
          and every `apply` on the capture), and the model's own parameters are rebound as row views
          into them (`param.data = fused[rows]`): no weight is held twice, and the HF model computes
          exactly what it did (same values). The catch: the model's parameters now share storage, which
          safetensors' save refuses (`save_pretrained` before applying, or with safe_serialization=False).
          That side effect on the user's model is why the pass runs only with `fuse_projections=True`.
Requires: nothing (it only touches linear nodes); runs last.
"""
import logging
from functools import reduce

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.passes.utils import clean_up

logger = logging.getLogger(__name__)

LINEAR = torch.ops.aten.linear.default


def _attr(gm: fx.GraphModule, target: str):
    return reduce(getattr, target.split("."), gm)


def _groups(gm: fx.GraphModule) -> list:
    """Linear nodes by input, in graph order; only groups that can be fused (module docstring)."""
    by_input = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is LINEAR and node.kwargs == {}:
            w = node.args[1]
            b = node.args[2] if len(node.args) > 2 else None
            if w.op != "get_attr" or (b is not None and b.op != "get_attr"):
                continue
            by_input.setdefault(node.args[0], []).append(node)
    groups = []
    for nodes in by_input.values():
        if len(nodes) < 2:
            continue
        ws = [_attr(gm, n.args[1].target) for n in nodes]
        has_bias = {len(n.args) > 2 and n.args[2] is not None for n in nodes}
        same = len({(w.dtype, w.device, w.dim(), w.shape[-1]) for w in ws}) == 1 and ws[0].dim() == 2
        if same and len(has_bias) == 1:
            groups.append(nodes)
    return groups


def _fused_tensors(gm: fx.GraphModule, nodes: list, ctx: RewriteContext):
    """(index in the capture, fused weight, fused bias or None, row ranges) of a group; made once per capture,
    originals rebound."""
    key = tuple(n.args[1].target for n in nodes)
    if key not in ctx.fused_weights:
        ws = [_attr(gm, n.args[1].target) for n in nodes]
        bs = [_attr(gm, n.args[2].target) for n in nodes] if len(nodes[0].args) > 2 and nodes[0].args[2] is not None \
            else None
        with torch.no_grad():
            fw = torch.cat([w.detach() for w in ws], dim=0)
            fb = torch.cat([b.detach() for b in bs], dim=0) if bs else None
        ranges, start = [], 0
        for w in ws:
            ranges.append((start, start + w.shape[0]))
            start += w.shape[0]
        # the originals become views into the fused rows: no weight is stored twice
        for i, (a, z) in enumerate(ranges):
            ws[i].data = fw[a:z]
            if bs:
                bs[i].data = fb[a:z]
        ctx.fused_weights[key] = (fw, fb, ranges)
    return (list(ctx.fused_weights).index(key), *ctx.fused_weights[key])


def fuse_projections(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    if not ctx.fuse_projections:
        return gm
    graph = gm.graph
    fused = 0
    for nodes in _groups(gm):
        index, fw, fb, ranges = _fused_tensors(gm, nodes, ctx)
        name = f"kvrewrite_fused_{index}"
        if not hasattr(gm, f"{name}_weight"):
            gm.register_buffer(f"{name}_weight", fw, persistent=False)
            if fb is not None:
                gm.register_buffer(f"{name}_bias", fb, persistent=False)
        first = nodes[0]
        with graph.inserting_before(first):
            w = graph.get_attr(f"{name}_weight")
            args = (first.args[0], w) if fb is None else (first.args[0], w, graph.get_attr(f"{name}_bias"))
            out = graph.call_function(LINEAR, args)
            out.meta["nn_module_stack"] = first.meta.get("nn_module_stack", {})
            for node, (a, z) in zip(nodes, ranges):
                piece = graph.call_function(torch.ops.aten.slice.Tensor, (out, -1, a, z))
                piece.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
                node.replace_all_uses_with(piece)
        for node in nodes:
            graph.erase_node(node)
        fused += 1
        ctx.counters["fuse_projections"] += 1
    logger.debug("%s: fused %d projection groups", ctx.where(), fused)
    return clean_up(gm)
