"""Find every layer's attention site: the SDPA node, its KV-update nodes and the cache buffers.

Matches:  aten.scaled_dot_product_attention whose key/value trace back (through repeat_kv's
          unsqueeze/expand/reshape and other view ops) to get_attr nodes of captured HF cache
          buffers, and the aten.index_copy_ nodes that write those buffers.
Emits:    nothing; records ctx.sites[layer] and node.meta["kvrewrite"] = {"layer", "role"}.
Skips:    nothing. Sliding-window layers are located too (ctx.layers carries their window; the
          rewritten attention enforces it exactly).
Requires: capture (ctx.cache_buffers) and normalize_eager_attention (eager attention is SDPA now).
Errors:   a layer without a site, a site without its two cache writes, a cache buffer written but
          never attended, or no site at all (with the attention-like targets seen).
"""
import logging

import torch
from torch import fx

from kvrewrite.capture import layer_of
from kvrewrite.context import AttentionSite, RewriteContext
from kvrewrite.errors import RewriteError
from kvrewrite.passes.normalize_eager_attention import SOFTCAP_META
from kvrewrite.passes.utils import INDEX_COPY, trace_to_source, val_shape

logger = logging.getLogger(__name__)
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _cache_writes(buffer_node: fx.Node) -> list:
    return [u for u in buffer_node.users if u.op == "call_function" and u.target in INDEX_COPY and u.args[0] is buffer_node]


def locate_attention_sites(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    cache = set(ctx.cache_buffers)
    sites = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != SDPA:
            continue
        layer = layer_of(node)
        if layer is None:
            raise RewriteError(f"{ctx.where(node=node)}: attention outside a decoder layer (no numbered module such "
                               f"as 'layers.<i>' or 'h.<i>' in its module path)")
        src = {}
        for role, arg in (("key", node.args[1]), ("value", node.args[2])):
            buf = trace_to_source(arg)
            if buf.op != "get_attr" or buf.target not in cache:
                raise RewriteError(
                    f"{ctx.where(layer, node)}: expected the {role} to be read from a static cache buffer, "
                    f"found '{buf.name}' ({buf.op} {buf.target}); was the model captured with a static cache?"
                )
            writes = _cache_writes(buf)
            if len(writes) != 1:
                raise RewriteError(
                    f"{ctx.where(layer, node)}: expected one index_copy_ into the {role} cache '{buf.target}', "
                    f"found {len(writes)}"
                )
            src[role] = (buf, writes[0])
        if layer in sites:
            raise RewriteError(f"{ctx.where(layer, node)}: a second attention in the same layer")
        info = ctx.layers[layer]
        q_shape, k_shape = val_shape(node.args[0]), val_shape(src["key"][1].args[3])
        if len(q_shape) != 4 or q_shape[1] != info.num_heads or k_shape[1] != info.num_kv_heads or k_shape[3] != info.head_dim:
            raise RewriteError(
                f"{ctx.where(layer, node)}: expected q [B, {info.num_heads}, T, {info.head_dim}] and new keys "
                f"[B, {info.num_kv_heads}, T, {info.head_dim}], got {q_shape} and {k_shape}"
            )
        scale = node.kwargs.get("scale")
        if scale is None:
            scale = info.head_dim**-0.5
        if node.kwargs.get("dropout_p", 0.0) or (len(node.args) > 4 and node.args[4]):
            raise RewriteError(f"{ctx.where(layer, node)}: attention dropout is not supported (call model.eval())")
        sites[layer] = AttentionSite(
            layer=layer,
            attention=node,
            key_update=src["key"][1],
            value_update=src["value"][1],
            key_buffer=src["key"][0].target,
            value_buffer=src["value"][0].target,
            scale=float(scale),
            softcap=float(node.meta.get(SOFTCAP_META, 0.0)),
        )
        node.meta["kvrewrite"] = {"layer": layer, "role": "attention"}
        src["key"][1].meta["kvrewrite"] = {"layer": layer, "role": "key_update"}
        src["value"][1].meta["kvrewrite"] = {"layer": layer, "role": "value_update"}

    if not sites:
        seen = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and
                       any(w in str(n.target) for w in ("attention", "softmax", "bmm", "matmul"))})
        raise RewriteError(
            f"{ctx.where()}: found no attention site reading a static KV cache; attention-like ops seen: "
            f"{seen or 'none'} (captured without a static cache, or an unsupported attention implementation?)"
        )
    missing = [info.index for info in ctx.layers if info.index not in sites]
    if missing:
        raise RewriteError(f"{ctx.where(missing[0])}: no attention site found for layers {missing}")
    attended = {s.key_buffer for s in sites.values()} | {s.value_buffer for s in sites.values()}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in INDEX_COPY:
            buf = node.args[0]
            if buf.op == "get_attr" and buf.target in cache and buf.target not in attended:
                raise RewriteError(f"{ctx.where(layer_of(node), node)}: cache buffer '{buf.target}' is written but never attended")
    ctx.sites = sites
    ctx.counters["locate_attention_sites"] += len(sites)
    logger.debug("locate_attention_sites: %d sites", len(sites))
    return gm
