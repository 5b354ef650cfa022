"""Insert each layer's compression op at the end of the graph, in layer order.

Matches:  the clustered_attention node of every site.
Emits:    what the method asks for (Method.compression_call), e.g. kvrewrite.chelsea_compress on the
          layer's base state (keys, values, bias, slot_pos, fill, budget) followed by the method's own
          state fields that the op's schema names (Method.state_fields, e.g. evict_by_score's score); for
          sliding-window layers, kvrewrite.evict_to_budget(n_sink=0), which keeps exactly the window. The ops mutate the state and run only on rows whose fill reached the
          threshold in l<i>_budget, so the same graph serves every step (no host sync).
Tensor parallel (ctx.tp > 1): an op whose schema has `head_offset` (kmeans_cluster, clustergen_fold: their seeded
          hashes key on the KV head) gets the rank's first head, tp_rank * Hkv, so each head draws what it draws at
          tp=1; at tp=1 the argument is left out (its default, 0).
Skips:    full-attention layers of the `full` method (no op is emitted); every layer when
          ctx.compress is False: the plain decode-step variant, which the runtime runs on steps where
          its host-side schedule knows no layer is due (so non-compressing steps launch nothing extra).
Where:    just before the graph's output, after every attention (the ops only touch their own layer's
          state, which nothing reads later in the step, so eager results are the same as right after
          the attention). Under torch.compile this placement is what lets Inductor run the op in
          place: functionalization turns it into auto_functionalized_v2 over the appended state, with
          no data edge to the attention that reads that state, and Inductor's reorder_for_locality
          (on by default) sinks the attention (with its whole chain) to just before its first user,
          i.e. past a compression op placed right after it. The reinplace pass then sees the state
          read after the op and clones the layer's whole keys/values/bias/slot_pos around it (and
          copies them back): >= 4 GB per compressing step at 32k. At the end of the graph nothing
          follows the ops, so they are reinplaced (tests/test_compile.py checks the output code).
Requires: replace_sdpa_with_clustered_attention.
"""
import logging

import torch
from torch import fx

from kvrewrite.context import RewriteContext
from kvrewrite.host import layer_state_fields
from kvrewrite.passes.utils import clean_up, named_fields

logger = logging.getLogger(__name__)


def takes_head_offset(op) -> bool:
    """Whether the op's schema has a `head_offset` argument (ops that hash the KV head's index)."""
    return any(a.name == "head_offset" for a in op._schema.arguments)


def insert_cache_compression(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    count = 0
    for layer, site in sorted(ctx.sites.items()) if ctx.compress else ():
        info = ctx.layers[layer]
        if info.window:
            call = (torch.ops.kvrewrite.evict_to_budget.default, {"n_sink": 0})
        else:
            call = ctx.method.compression_call(info)
        if call is None:
            continue
        op, kwargs = call
        if ctx.tp > 1 and takes_head_offset(op):  # the rank's heads hash as tp=1's (module docstring)
            kwargs = dict(kwargs, head_offset=ctx.tp_rank * info.num_kv_heads)
        s = site.state
        fields = named_fields(op, {name: s[name] for name in layer_state_fields(info, ctx.method)})
        with graph.inserting_before(output):
            node = graph.call_function(
                op, (s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], s["budget"], *fields), kwargs
            )
        node.meta["kvrewrite"] = {"layer": layer, "role": "compression"}
        node.meta["nn_module_stack"] = site.output.meta.get("nn_module_stack", {})
        count += 1
    ctx.counters["insert_cache_compression"] += count
    logger.debug("insert_cache_compression: %d compression ops", count)
    return clean_up(gm)
