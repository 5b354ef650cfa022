"""Remove the captured HF cache: its buffers, their reads and the bookkeeping writes into them.

Matches:  get_attr nodes of ctx.cache_buffers, in-place ops (copy_, add_, index_copy_) whose
          first argument is such a buffer or a view of it (HF's cumulative_length bookkeeping).
Emits:    nothing; the buffers are deleted from the module, so the dense cache never exists.
Errors:   a cache buffer still read by live computation (a site the rewrite missed).
Requires: replace_sdpa_with_clustered_attention.
"""
import logging

from torch import fx

from kvrewrite.capture import layer_of
from kvrewrite.context import RewriteContext
from kvrewrite.errors import RewriteError
from kvrewrite.passes.utils import VIEW_OPS, clean_up

logger = logging.getLogger(__name__)


def _mutates_first_arg(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.arguments and schema.arguments[0].alias_info and schema.arguments[0].alias_info.is_write)


def remove_dead_cache_buffers(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    graph = gm.graph
    cache = set(ctx.cache_buffers)
    buffers = [n for n in graph.nodes if n.op == "get_attr" and n.target in cache]
    aliases = set(buffers)  # the buffers and views of them (e.g. a no-op .to(dtype))
    for node in list(graph.nodes):
        if node.op != "call_function" or not node.args or node.args[0] not in aliases:
            continue
        if _mutates_first_arg(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target in VIEW_OPS:
            aliases.add(node)
    graph.eliminate_dead_code()
    for buf in [n for n in graph.nodes if n.op == "get_attr" and n.target in cache]:
        if buf.users:
            user = next(iter(buf.users))
            raise RewriteError(
                f"{ctx.where(layer_of(user), user)}: still reads the dense cache buffer '{buf.target}' after the rewrite"
            )
        graph.erase_node(buf)
    # Count what left the module: dead get_attr nodes are already gone after eliminate_dead_code
    # above (and after the DCE of earlier passes), so counting erased nodes would report 0.
    removed = 0
    for name in cache:
        if hasattr(gm, name):
            delattr(gm, name)
            removed += 1
    ctx.counters["remove_dead_cache_buffers"] += removed
    logger.debug("remove_dead_cache_buffers: removed %d cache buffers", removed)
    return clean_up(gm)
