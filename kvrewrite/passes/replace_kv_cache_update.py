"""Replace each layer's pair of dense KV-cache writes with one kvrewrite::cache_append.

Matches:  the two aten.index_copy_ nodes of every located site (key and value cache writes).
Emits:    graph inputs `token_valid` [B, T] bool and, per layer, the state inputs
          l<i>_keys, l<i>_values, l<i>_bias, l<i>_slot_pos, l<i>_fill, l<i>_budget, then the method's
          own fields l<i>_<name> (Method.state_fields; none for sliding-window layers); one
          kvrewrite.cache_append(l<i>_keys, ..., l<i>_fill, k_new, v_new, cache_position, token_valid)
          per layer, where the value write was. Readers of the old writes now read the dense buffer
          itself (dead once the attention is replaced).
          When the method reads the appended tokens (Method.append_call, EMS's token table), its op follows each
          full-attention layer's cache_append, called with (l<i>_keys, l<i>_bias, l<i>_fill, k_pre,
          cache_position, token_valid, *the method's state fields its schema names, **options), where k_pre is
          the step's key before the rotary embedding (passes/pre_rope.py; computed only for such methods, so no
          other method's graph changes).
Skips:    nothing: every located layer is rewritten.
Errors:   a write not along dim 2; a layer whose pre-RoPE key cannot be found (an append_call method only).
Requires: locate_attention_sites.
"""
import logging

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.passes.pre_rope import pre_rope_key
from kvrewrite.passes.utils import clean_up, named_fields
from kvrewrite.errors import RewriteError
from kvrewrite.host import layer_state_fields
from kvrewrite.state import STATE_FIELDS

logger = logging.getLogger(__name__)


def replace_kv_cache_update(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    graph = gm.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    if "cache_position" not in placeholders:
        raise RewriteError(f"{ctx.where()}: the captured graph has no 'cache_position' input")
    cache_position = placeholders["cache_position"]
    last = list(placeholders.values())[-1]
    with graph.inserting_after(last):
        token_valid = graph.placeholder("token_valid")
    last = token_valid
    for layer in sorted(ctx.sites):
        site = ctx.sites[layer]
        for field in (*STATE_FIELDS, *layer_state_fields(ctx.layers[layer], ctx.method)):
            with graph.inserting_after(last):
                last = site.state[field] = graph.placeholder(f"l{layer}_{field}")
    count = 0
    for layer, site in sorted(ctx.sites.items()):
        k_update, v_update = site.key_update, site.value_update
        if k_update.args[1] != 2 or v_update.args[1] != 2:
            raise RewriteError(f"{ctx.where(layer, k_update)}: expected a write along dim 2 of [B, Hkv, S, D]")
        s = site.state
        with graph.inserting_after(v_update):
            append = graph.call_function(
                torch.ops.kvrewrite.cache_append.default,
                (s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k_update.args[3], v_update.args[3],
                 cache_position, token_valid),
            )
        append.meta["kvrewrite"] = {"layer": layer, "role": "cache_append"}
        append.meta["nn_module_stack"] = v_update.meta.get("nn_module_stack", {})
        _insert_method_append(gm, ctx, layer, append, k_update, cache_position, token_valid)
        for upd in (k_update, v_update):
            upd.replace_all_uses_with(upd.args[0])
            graph.erase_node(upd)
        site.key_update = site.value_update = append
        count += 1
    ctx.counters["replace_kv_cache_update"] += count
    logger.debug("replace_kv_cache_update: replaced %d KV-update pairs", count)
    return clean_up(gm)


def _insert_method_append(gm, ctx: RewriteContext, layer: int, append: fx.Node, k_update: fx.Node, cache_position,
                          token_valid) -> None:
    """The method's append op right after the layer's cache_append (none for windowed layers), reading k_pre."""
    info = ctx.layers[layer]
    call = None if info.window else ctx.method.append_call(info)
    if call is None:
        return
    op, kwargs = call
    s = ctx.sites[layer].state
    k_pre = pre_rope_key(gm, k_update.args[3], ctx.where(layer, k_update))
    fields = named_fields(op, {name: s[name] for name in layer_state_fields(info, ctx.method)})
    with gm.graph.inserting_after(append):
        node = gm.graph.call_function(op, (s["keys"], s["bias"], s["fill"], k_pre, cache_position, token_valid,
                                           *fields), kwargs)
    node.meta["kvrewrite"] = {"layer": layer, "role": "method_append"}
    node.meta["nn_module_stack"] = append.meta.get("nn_module_stack", {})
