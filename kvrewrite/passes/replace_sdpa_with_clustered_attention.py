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
          When the method observes the queries (Method.observe_call, e.g. H2O's and SnapKV's attention
          scores), its op follows each full-attention layer's attention, called with (q, l<i>_keys,
          l<i>_bias, l<i>_slot_pos, cache_position, *the method's state fields, scale=, window=,
          **the method's options), in every graph (prefill, both decode variants): it updates the
          method's state, which only the compression op at the end of the step reads.
          When the method selects slots per query (Method.select_call, ClusterKV), a decode graph's
          full-attention layer gets instead index = <select op>(q, l<i>_fill, l<i>_budget, *the method's
          state fields its schema names, **options) and kvrewrite.indexed_attention(q, l<i>_keys, l<i>_values,
          l<i>_bias, index, scale[, softcap]): attention over the selected slots only (every indexed slot
          is in the query's past, so no position test). Prefill chunks attend over every slot.
          When the method brings its own attention (Method.attention_call, EMS), its op replaces
          clustered_attention on every full-attention layer in every graph, called with (q, l<i>_keys,
          l<i>_values, l<i>_bias, l<i>_slot_pos, cache_position, *the method's state fields its schema names,
          scale=, past_only=, softcap=, **options) (role "<method>_attention").
Skips:    nothing; sliding-window layers get window = their config window (exact, not compressed, not
          observed).
Errors:   an observing method on a layer with a logit soft cap (Gemma-2): the statistics ops compute the
          uncapped softmax, so they would rank slots by the wrong probabilities; a method with an
          attention_call and an observe_call or select_call (its attention op would bypass them); a method whose
          attention op cannot model a soft cap (Method.softcap_refusal, e.g. ClusterGen's estimator) on such a layer.
Requires: replace_kv_cache_update (state inputs exist).
"""
import logging

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.errors import RewriteError
from kvrewrite.host import layer_state_fields
from kvrewrite.passes.utils import clean_up, named_fields

logger = logging.getLogger(__name__)


def replace_sdpa_with_clustered_attention(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    graph = gm.graph
    cache_position = next(n for n in graph.nodes if n.op == "placeholder" and n.name == "cache_position")
    count = 0
    for layer, site in sorted(ctx.sites.items()):
        sdpa, s = site.attention, site.state
        info = ctx.layers[layer]
        window = info.window
        select = ctx.method.select_call(info, ctx.max_length) if ctx.graph_kind == "decode" and window == 0 else None
        own = _method_attention_call(ctx, layer, sdpa, site.softcap) if window == 0 else None
        kwargs = {"past_only": True} if ctx.graph_kind == "decode" and window == 0 else {}
        if site.softcap:
            kwargs["softcap"] = site.softcap
        with graph.inserting_before(sdpa):
            if own is not None:
                attn = _method_attention(graph, ctx, layer, site, own, cache_position)
            elif select is None:
                attn = graph.call_function(
                    torch.ops.kvrewrite.clustered_attention.default,
                    (sdpa.args[0], s["keys"], s["values"], s["bias"], s["slot_pos"], cache_position, site.scale,
                     window),
                    kwargs,
                )
            else:
                attn = _selected_attention(graph, ctx, layer, site, select)
        attn.meta.update({k: v for k, v in sdpa.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        # indexed attention reads other arguments than clustered_attention's (eval/fidelity.py reads those)
        role = f"{ctx.method.name}_attention" if own is not None else \
            "attention" if select is None else "selected_attention"
        attn.meta["kvrewrite"] = {"layer": layer, "role": role}
        sdpa.replace_all_uses_with(attn)
        graph.erase_node(sdpa)
        site.attention = site.output = attn
        _insert_observation(graph, ctx, layer, site, cache_position)
        count += 1
    ctx.counters["replace_sdpa_with_clustered_attention"] += count
    logger.debug("replace_sdpa_with_clustered_attention: replaced %d attention nodes", count)
    return clean_up(gm)


def _method_attention_call(ctx: RewriteContext, layer: int, sdpa, softcap: float = 0.0):
    """The method's attention_call of a full-attention layer, or None; RewriteError when the method also observes or
    selects (its attention op replaces clustered_attention, which those hooks pair with), or when the layer caps its
    logits and the method's attention cannot (Method.softcap_refusal names why)."""
    info = ctx.layers[layer]
    call = ctx.method.attention_call(info)
    if call is None:
        return None
    if softcap and ctx.method.softcap_refusal:
        raise RewriteError(f"{ctx.where(layer, sdpa)}: method {ctx.method.name!r} cannot run on this layer, which caps "
                           f"its logits (softcap={softcap}): {ctx.method.softcap_refusal}")
    other = [name for name, c in (("observe_call", ctx.method.observe_call(info)),
                                  ("select_call", ctx.method.select_call(info, ctx.max_length))) if c is not None]
    if other:
        raise RewriteError(f"{ctx.where(layer, sdpa)}: method {ctx.method.name!r} has an attention_call and "
                           f"{' and '.join(other)}; its attention op replaces clustered_attention, which those hooks "
                           f"pair with: compute the statistics or the selection inside the attention op instead")
    return call


def _method_attention(graph, ctx: RewriteContext, layer: int, site, call, cache_position) -> fx.Node:
    """The method's attention op over the layer's state, in place of clustered_attention."""
    op, kwargs = call
    s, q = site.state, site.attention.args[0]
    fields = named_fields(op, {name: s[name] for name in layer_state_fields(ctx.layers[layer], ctx.method)})
    return graph.call_function(op, (q, s["keys"], s["values"], s["bias"], s["slot_pos"], cache_position, *fields),
                               {"scale": site.scale, "past_only": ctx.graph_kind == "decode",
                                "softcap": float(site.softcap), **kwargs})


def _selected_attention(graph, ctx: RewriteContext, layer: int, site, select) -> fx.Node:
    """index = the method's selection op, then kvrewrite.indexed_attention over the indexed slots."""
    op, kwargs = select
    s, q = site.state, site.attention.args[0]
    fields = named_fields(op, {name: s[name] for name in layer_state_fields(ctx.layers[layer], ctx.method)})
    index = graph.call_function(op, (q, s["fill"], s["budget"], *fields), kwargs)
    index.meta["kvrewrite"] = {"layer": layer, "role": "select"}
    index.meta["nn_module_stack"] = site.attention.meta.get("nn_module_stack", {})
    softcap = {"softcap": site.softcap} if site.softcap else {}
    return graph.call_function(torch.ops.kvrewrite.indexed_attention.default,
                               (q, s["keys"], s["values"], s["bias"], index, site.scale), softcap)


def _insert_observation(graph, ctx: RewriteContext, layer: int, site, cache_position) -> None:
    """The method's observation op right after the layer's attention (none for windowed layers)."""
    info = ctx.layers[layer]
    call = None if info.window else ctx.method.observe_call(info)
    if call is None:
        return
    if site.softcap:
        raise RewriteError(f"{ctx.where(layer, site.attention)}: method {ctx.method.name!r} observes the attention "
                           f"probabilities, but this layer caps its logits (softcap={site.softcap}), which the "
                           f"statistics ops do not model")
    op, kwargs = call
    s, attn = site.state, site.attention
    fields = named_fields(op, {name: s[name] for name in layer_state_fields(info, ctx.method)})
    with graph.inserting_after(attn):
        node = graph.call_function(op, (attn.args[0], s["keys"], s["bias"], s["slot_pos"], cache_position, *fields),
                                   {"scale": site.scale, "window": info.window, **kwargs})
    node.meta["kvrewrite"] = {"layer": layer, "role": "observe"}
    node.meta["nn_module_stack"] = attn.meta.get("nn_module_stack", {})
