"""Replace SDPA over the dense cache with kvrewrite::clustered_attention over the slot state.

Matches:  the attention node of every located site (aten.scaled_dot_product_attention).
Emits:    kvrewrite.clustered_attention(q, l<i>_keys, l<i>_values, l<i>_bias, l<i>_slot_pos,
          cache_position, scale, window[, softcap]) with the SDPA's q and scale (and the soft cap
          normalize_eager_attention found, Gemma-2); the HF mask, repeat_kv and the
          dense-cache views become dead and are removed. In a decode graph, layers without a window
          also get past_only=True: the step's token is appended (cache_append) before the attention and
          compression keeps slot_pos = the max of the merged tokens', so no used slot lies after the
          query, and the CUDA kernel need not read slot_pos. Prefill chunks attend causally within the
          chunk (they need the positions); windowed layers read them for the window test anyway.
Skips:    nothing; sliding-window layers get window = their config window (exact, not compressed).
Requires: replace_kv_cache_update (state inputs exist).
"""
import logging

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.passes.utils import clean_up

logger = logging.getLogger(__name__)


def replace_sdpa_with_clustered_attention(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    graph = gm.graph
    cache_position = next(n for n in graph.nodes if n.op == "placeholder" and n.name == "cache_position")
    count = 0
    for layer, site in sorted(ctx.sites.items()):
        sdpa, s = site.attention, site.state
        window = ctx.layers[layer].window
        kwargs = {"past_only": True} if ctx.graph_kind == "decode" and window == 0 else {}
        if site.softcap:
            kwargs["softcap"] = site.softcap
        with graph.inserting_before(sdpa):
            attn = graph.call_function(
                torch.ops.kvrewrite.clustered_attention.default,
                (sdpa.args[0], s["keys"], s["values"], s["bias"], s["slot_pos"], cache_position, site.scale, window),
                kwargs,
            )
        attn.meta.update({k: v for k, v in sdpa.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        attn.meta["kvrewrite"] = {"layer": layer, "role": "attention"}
        sdpa.replace_all_uses_with(attn)
        graph.erase_node(sdpa)
        site.attention = site.output = attn
        count += 1
    ctx.counters["replace_sdpa_with_clustered_attention"] += count
    logger.debug("replace_sdpa_with_clustered_attention: replaced %d attention nodes", count)
    return clean_up(gm)
