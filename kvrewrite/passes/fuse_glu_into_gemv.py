"""Fold a gated MLP's activation and product into its down projection's kvrewrite::gemv. Opt-in (with gemv).

Matches:  in decode graphs with ctx.gemv, a kvrewrite::gemv node whose input x is aten.mul.Tensor(act(a), b)
          (either operand order), act aten.silu or aten.gelu (approximate "tanh" or "none"), where the act node
          feeds only the mul and the mul only the gemv, and a and b (traced values) are what kvrewrite::gemv_glu
          takes: one row each, one shape, unit stride along K, the weight's dtype (kernels/gemv_glu.py
          input_problem decides). In the families' decode graphs: gate and up are slices of the fused gate/up
          projection (passes/fuse_projections.py; getitems of a chunk for Phi-3 and GLM-4 which ship it fused) or
          two gemvs, and the gemv is the down projection.
Emits:    kvrewrite::gemv_glu(a, b, weight, bias, act, constant_weight) in place of the gemv (the gemv's flag); the act and mul nodes are removed.
          The same function: the CPU path runs the aten ops it replaces, in their order, so a CPU graph is
          bit-identical before and after.
Why:      a batch-1 decode step computes act(gate) * up in an elementwise kernel of its own (Inductor's
          triton_poi_fused_mul_silu_slice_view: 1.5 us and a graph gap, 32 per Llama-3.1-8B step,
          docs/bench/e2e_h100_decode_profile_gemv.txt); gemv_glu computes it while loading the GEMV's input.
          Measured at the kernel level only (kernels/gemv_glu.py, docs/bench/gemv_glu_h100.json): 43.0 us vs
          44.9 eager and 42.8 with Inductor's fused act*mul kernel: a gain in eager graphs, parity (within 0.5%)
          under rw.compile. End to end (with fuse_rms_norm_into_gemv, docs/bench.md "Stop 21 runs"): one launch
          fewer per layer, 0.6% per step for both passes, the kernel time unchanged.
Requires: runs after replace_linear_with_gemv (it rewrites its gemv nodes); off with gemv=False, in prefill graphs
          and at batch_size > 1, where there are no gemv nodes.
"""
import logging
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor

from kvrewrite.context import RewriteContext
from kvrewrite.kernels.gemv_glu import input_problem
from kvrewrite.passes.utils import all_args, attr_tensor, clean_up

logger = logging.getLogger(__name__)

GEMV = torch.ops.kvrewrite.gemv.default
MUL = torch.ops.aten.mul.Tensor
GELU_APPROXIMATE = {"tanh": "gelu_tanh", "none": "gelu"}


def _act(node) -> str | None:
    """The gemv_glu act name of an activation node with one user, or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or len(node.users) != 1 or len(node.args) != 1:
        return None
    if node.target is torch.ops.aten.silu.default and not node.kwargs:
        return "silu"
    if node.target is torch.ops.aten.gelu.default and set(node.kwargs) <= {"approximate"}:
        return GELU_APPROXIMATE.get(node.kwargs.get("approximate", "none"))
    return None


def _val(gm: fx.GraphModule, node, depth: int = 4):
    """node's traced value: meta["val"], or where a pass left none (fuse_projections' linear, slices and getitems) or
    only part of one (fuse_rms_norm_into_gemv's op, whose gemv output it does not know) its target run in the fake
    mode of its inputs' values, up to `depth` nodes up (get_attr tensors taken from gm); None if unknown."""
    if not isinstance(node, fx.Node):
        return node
    val = node.meta.get("val")
    if val is not None and not (isinstance(val, (tuple, list)) and any(v is None for v in val)):
        return val
    if node.op == "get_attr":
        return attr_tensor(gm, node)
    if depth == 0 or node.op != "call_function":
        return None
    args = [_val(gm, a, depth - 1) for a in node.args]
    kwargs = {k: _val(gm, v, depth - 1) for k, v in node.kwargs.items()}
    if any(isinstance(a, fx.Node) and v is None for a, v in [*zip(node.args, args),
                                                             *((node.kwargs[k], kwargs[k]) for k in kwargs)]):
        return None
    if node.target is operator.getitem and isinstance(args[0], (tuple, list)):  # of a multi-output op's value
        return args[0][args[1]]
    mode = detect_fake_mode([a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)])
    if mode is None:
        return None

    def fake(a):
        return mode.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a

    with mode:
        return node.target(*map(fake, args), **{k: fake(v) for k, v in kwargs.items()})


def _match(gm: fx.GraphModule, gemv: fx.Node):
    """(mul, act node, a, b, act name) when gemv's input is mul(act(a), b) that gemv_glu takes, else None."""
    x, w_node, b_node, _ = all_args(gemv)
    if not isinstance(x, fx.Node) or x.op != "call_function" or x.target is not MUL or x.kwargs or len(x.users) != 1:
        return None
    for act_node, other in ((x.args[0], x.args[1]), (x.args[1], x.args[0])):
        act = _act(act_node)
        if act is None or not isinstance(other, fx.Node) or other is act_node:
            continue
        a, b = act_node.args[0], other
        vals = [_val(gm, n) if isinstance(n, fx.Node) else None for n in (a, b)]
        if not all(isinstance(v, torch.Tensor) and isinstance(v.numel(), int) for v in vals):
            continue  # unknown or symbolic sizes are not known to fit
        if input_problem(*vals, attr_tensor(gm, w_node), attr_tensor(gm, b_node), act) is None:
            return x, act_node, a, b, act
    return None


def fuse_glu_into_gemv(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    if not ctx.gemv or ctx.graph_kind != "decode":
        return gm
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not GEMV:
            continue
        found = _match(gm, node)
        if found is None:
            continue
        mul, act_node, a, b, act = found
        _, w_node, b_node, constant_weight = all_args(node)
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.kvrewrite.gemv_glu.default,
                                      (a, b, w_node, b_node, act, constant_weight))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        for dead in (node, mul, act_node):
            graph.erase_node(dead)
        ctx.counters["fuse_glu_into_gemv"] += 1
    logger.debug("%s: %d act * up -> kvrewrite::gemv_glu", ctx.where(), ctx.counters["fuse_glu_into_gemv"])
    return clean_up(gm)
