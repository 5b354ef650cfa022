"""Helpers shared by the passes."""
import contextlib
import functools

import torch
from torch import fx

from kvrewrite.errors import RewriteError

# View-like ops HF puts between a cache buffer and the attention (repeat_kv, slicing, dtype casts).
VIEW_OPS = {
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.contiguous.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten.to.device,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.repeat_interleave.self_int,
}
INDEX_COPY = (torch.ops.aten.index_copy_.default, torch.ops.aten.index_copy.default)


def trace_to_source(node: fx.Node) -> fx.Node:
    """Follow view-like ops (and in-place updates, which return their first argument) upwards."""
    while node.op == "call_function" and (node.target in VIEW_OPS or node.target in INDEX_COPY):
        node = node.args[0]
    return node


def add_placeholder(gm: fx.GraphModule, name: str) -> fx.Node:
    """Append a graph input after the existing ones (placeholders must stay first)."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(name)
    return node


_deferring_recompile = False


@contextlib.contextmanager
def deferred_recompile():
    """Inside, clean_up leaves the lint and the module's code to the caller: run_passes lints after every pass and
    recompiles once after the last. Why: recompiling generates the Python code of the whole graph (~0.25-0.37 s for
    SmolLM2's 30 layers on a 2-core CPU) and a graph meets ~5 passes that edit it; no pass runs the module or reads
    its code. Measured: apply on SmolLM2-135M 8.7 -> 4.7 s a method."""
    global _deferring_recompile
    before, _deferring_recompile = _deferring_recompile, True
    try:
        yield
    finally:
        _deferring_recompile = before


def clean_up(gm: fx.GraphModule) -> fx.GraphModule:
    """Dead-code elimination, lint and recompile (the end of every pass that edits the graph; the lint and the
    recompile are the caller's inside deferred_recompile)."""
    gm.graph.eliminate_dead_code()
    if not _deferring_recompile:
        gm.graph.lint()
        gm.recompile()
    return gm


def attr_tensor(gm: fx.GraphModule, node):
    """The tensor a get_attr node names (a weight, a bias), or None for None."""
    return None if node is None else functools.reduce(getattr, node.target.split("."), gm)


def written_sources(gm: fx.GraphModule) -> set:
    """The placeholder and get_attr nodes that some call of the graph writes in place (an argument its schema marks
    as written, traced up through views): the state. A get_attr not in it is a constant of the graph (a weight)."""
    written = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for arg, value in zip(schema.arguments, all_args(node)):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node):
                source = trace_to_source(value)
                if source.op in ("placeholder", "get_attr"):
                    written.add(source)
    return written


def val_shape(node) -> tuple:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if val is not None else ()


def named_fields(op, fields: dict) -> list:
    """The values of `fields` ({name: node}, a method's state) whose names the op's schema has, in their order: the
    method state an op receives (an op takes what it names, e.g. evict_by_score the score and not the pending
    query only kvrewrite::observed_attention reads)."""
    names = {a.name for a in op._schema.arguments}
    return [v for k, v in fields.items() if k in names]


def all_args(node) -> list:
    """A call's arguments in schema order, positional (kwargs folded in, omitted ones at their defaults)."""
    schema = node.target._schema
    out = list(node.args)
    for a in schema.arguments[len(node.args):]:
        if a.name not in node.kwargs and not a.has_default_value():
            raise ValueError(f"node '{node.name}' ({node.target}) lacks its argument '{a.name}'")
        out.append(node.kwargs[a.name] if a.name in node.kwargs else a.default_value)
    return out


def weight_linears(gm: fx.GraphModule, targets, ctx, what: str) -> tuple:
    """([(get_attr node, aten.linear node)], get_attr targets found): every aten.linear(x, weight[, bias]) whose
    weight is a get_attr of one of `targets`, in graph order; RewriteError naming the weight (the `what` weight: the
    tensor-parallel passes' "row-parallel", "vocab-parallel") when anything else reads it."""
    pairs, found = [], set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in targets:
            continue
        found.add(node.target)
        for user in node.users:
            if (user.op != "call_function" or user.target is not torch.ops.aten.linear.default
                    or user.args[1] is not node or user.kwargs):
                raise RewriteError(f"{ctx.where(node=user)}: the {what} weight {node.target} is read by something "
                                   f"else than aten.linear(x, weight[, bias])")
            pairs.append((node, user))
    return pairs, found
