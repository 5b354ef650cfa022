"""Fuse each layer's attention and the method's attention statistics into one kvrewrite::observed_attention.

Matches:  a kvrewrite.accumulate_attention node (role "observe", H2O's and SnapKV's statistics) and the
          kvrewrite.clustered_attention node of the same layer, when they read the same q, keys, bias,
          slot_pos, cache_position, scale and window, and the attention has no soft cap.
Emits:    kvrewrite.observed_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, score,
          pending_q, pending_lse, fill, mode, last, past_only, defer) where the attention was (role
          "observed_attention"); both nodes go. defer=True in the decode graph without compression ops: there
          each step's statistics wait for a later step (the pending queries, up to pending_entries(G) of them,
          folded together on the way by a later step's attention kernel); every graph that compresses folds them at once, so each compression reads
          the score accumulate_attention would have left. On CUDA the statistics come from the attention
          kernel itself, one pass over the keys instead of three (docs/methods.md has the measurements).
Skips:    observe ops other than accumulate_attention (a method's own statistics op stays where it is), and a
          method's own attention op (Method.attention_call, which never comes with an observe op).
Errors:   an accumulate_attention node with no matching attention node (a pass broke the pairing), or a
          layer whose state lacks the pending queries (methods.base.observed_state_fields declares it).
Requires: replace_sdpa_with_clustered_attention.
"""
import logging

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.errors import RewriteError
from kvrewrite.passes.utils import all_args, clean_up

logger = logging.getLogger(__name__)

ATTENTION = torch.ops.kvrewrite.clustered_attention.default
OBSERVE = torch.ops.kvrewrite.accumulate_attention.default
FUSED = torch.ops.kvrewrite.observed_attention.default


def _args(node: fx.Node) -> dict:
    """The call's arguments by schema name, defaults filled in."""
    return {a.name: v for a, v in zip(node.target._schema.arguments, all_args(node))}


def fuse_attention_observation(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    graph = gm.graph
    attention = {n.meta["kvrewrite"]["layer"]: n for n in graph.nodes
                 if n.op == "call_function" and n.target == ATTENTION}
    count = 0
    for obs in [n for n in graph.nodes if n.op == "call_function" and n.target == OBSERVE]:
        layer = obs.meta["kvrewrite"]["layer"]
        attn = attention.get(layer)
        o, a = _args(obs), _args(attn) if attn is not None else {}
        shared = ("q", "keys", "bias", "slot_pos", "cache_position", "scale", "window")
        if attn is None or a["softcap"] or any(o[k] is not a[k] and o[k] != a[k] for k in shared):
            raise RewriteError(f"{ctx.where(layer, obs)}: the statistics op reads no attention of its layer "
                               f"(fuse_attention_observation expects the pairing replace_sdpa_with_clustered_attention "
                               f"makes)")
        state = ctx.sites[layer].state if layer in ctx.sites else {}
        if "pending_q" not in state or "pending_lse" not in state:
            raise RewriteError(f"{ctx.where(layer, obs)}: method {ctx.method.name!r} observes with accumulate_attention "
                               f"but its state has no pending_q / pending_lse (declare them with "
                               f"kvrewrite.methods.base.observed_state_fields)")
        defer = ctx.graph_kind == "decode" and not ctx.compress
        with graph.inserting_before(attn):
            fused = graph.call_function(FUSED, (
                a["q"], a["keys"], a["values"], a["bias"], a["slot_pos"], a["cache_position"], a["scale"],
                a["window"], o["score"], state["pending_q"], state["pending_lse"], state["fill"], o["stats_mode"],
                o["last"], a["past_only"], defer))
        fused.meta.update({k: v for k, v in attn.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        fused.meta["kvrewrite"] = {"layer": layer, "role": "observed_attention"}
        attn.replace_all_uses_with(fused)
        graph.erase_node(obs)
        graph.erase_node(attn)
        site = ctx.sites.get(layer)
        if site is not None:
            site.attention = site.output = fused
        count += 1
    ctx.counters["fuse_attention_observation"] += count
    logger.debug("fuse_attention_observation: fused %d attention + statistics pairs", count)
    return clean_up(gm)
