"""Find the pre-RoPE key of a layer in a captured graph: the key before the rotary embedding rotates it.

Some methods compare keys without their positions (EMS's redundancy, "w.o. pos"). The captured graph only
hands the cache write the rotated key k_post [B, Hkv, T, D]; the key before the rotation is in the graph
too, at the top of a "rotary region" of elementwise and layout ops that mix the key with position tables
(cos / sin and their casts). Families spell that region many ways (half-split or interleaved rotation,
partial rotary, RoPE before or after the head transpose, qk-norm before it), so the finder reads the
graph's data flow rather than matching one spelling:

1. a **table** depends on a position input (position_ids / cache_position) and not on input_ids;
2. the **tail**: the layout ops (permute, view, to, ...) directly above k_post; r is the first other node;
3. the **region**: nodes reachable upward from r through rotary ops, never entering a table;
4. td(n): n is a table, or n is in the region and an input has td. td(r) false: no RoPE (NoPE layers,
   absolute-position models), k_pre = k_post;
5. F: region nodes without td that feed a region node with td (the rotation's key-side inputs);
6. X: the last region node, in graph order, that is an ancestor-or-self of every node of F and has r's shape;
7. k_pre: the tail re-applied to X, so that it has k_post's layout and dtype.

qk-norm families (Qwen3, OLMo-2, Cohere, Gemma-3) get the key after the norm: the norm is no rotary op, so
the region stops there, and the normed key carries no position. docs: docs/contracts/ems.md section 4.
"""
import operator

import torch
from torch import fx

from kvrewrite.capture import layer_of
from kvrewrite.errors import RewriteError

POSITION_INPUTS = ("position_ids", "cache_position")
TOKEN_INPUT = "input_ids"

_aten = torch.ops.aten
LAYOUT_OPS = frozenset({_aten.permute, _aten.transpose, _aten.view, _aten.reshape, _aten._unsafe_view, _aten.contiguous,
                        _aten.clone, _aten.alias, _aten.to, _aten._to_copy})
ROTARY_OPS = LAYOUT_OPS | frozenset({
    _aten.mul, _aten.add, _aten.sub, _aten.neg, _aten.cat, _aten.stack, _aten.slice, _aten.select, _aten.split,
    _aten.split_with_sizes, _aten.chunk, _aten.unbind, _aten.unsqueeze, _aten.squeeze, _aten.flatten, _aten.expand,
    _aten.type_as, _aten.copy, _aten.where,
})


def _packet(node: fx.Node):
    return getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None


def _is_layout(node: fx.Node) -> bool:
    return _packet(node) in LAYOUT_OPS


def _is_rotary(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target is operator.getitem or _packet(node) in ROTARY_OPS)


def _tables(graph: fx.Graph) -> set:
    """The nodes that depend on a position input and not on input_ids (cos, sin, their casts, gathered tables)."""
    on_pos, on_ids = set(), set()
    for n in graph.nodes:
        if n.op == "placeholder":
            if n.name in POSITION_INPUTS:
                on_pos.add(n)
            elif n.name == TOKEN_INPUT:
                on_ids.add(n)
            continue
        inputs = n.all_input_nodes
        if any(a in on_pos for a in inputs):
            on_pos.add(n)
        if any(a in on_ids for a in inputs):
            on_ids.add(n)
    return on_pos - on_ids


def _describe(nodes) -> str:
    return ", ".join(f"'{n.name}'" for n in nodes) or "none"


def find_pre_rope_key(gm: fx.GraphModule, k_post: fx.Node, where: str = "") -> tuple[fx.Node, list]:
    """(X, tail): X the pre-RoPE key in the layout of the node below k_post's layout ops, and tail those layout
    ops (nodes of the graph, in application order from X's side to k_post) that take X to k_post's layout.

    With no rotation above k_post (a NoPE layer, an absolute-position model), X is k_post and the tail is empty.
    `where` prefixes the error (e.g. RewriteContext.where(layer, node); default: the layer k_post belongs to).
    Raises RewriteError when the rotation is found but no single node of r's shape feeds all of its key-side
    inputs."""
    tail, r = [], k_post
    while _is_layout(r):
        tail.append(r)
        r = r.args[0]
    tail.reverse()
    tables = _tables(gm.graph)
    region, stack = set(), [r]
    while stack:
        n = stack.pop()
        if n in region or n in tables or not _is_rotary(n):
            continue
        region.add(n)
        stack.extend(n.all_input_nodes)
    td = set(tables)
    for n in gm.graph.nodes:  # topological order: inputs first
        if n in region and any(a in td for a in n.all_input_nodes):
            td.add(n)
    if r not in td:
        return k_post, []
    key_side = [u for u in region if u not in td and any(v in region and v in td for v in u.users)]
    shape = _shape(r)

    def ancestors(n):  # ancestor-or-self within the region
        seen, todo = set(), [n]
        while todo:
            x = todo.pop()
            if x in seen or x not in region:
                continue
            seen.add(x)
            todo.extend(x.all_input_nodes)
        return seen

    common = set.intersection(*(ancestors(f) for f in key_side)) if key_side else set()
    candidates = [n for n in gm.graph.nodes if n in common and shape is not None and _shape(n) == shape]
    if not candidates:
        where = where or f"layer {layer_of(k_post)}"
        raise RewriteError(
            f"{where}: cannot find the pre-RoPE key of '{k_post.name}': the rotary region above '{r.name}' "
            f"(shape {shape}) has key-side inputs {_describe(sorted(key_side, key=lambda n: n.name))} but no node of "
            f"that shape feeds all of them (an unknown RoPE spelling; kvrewrite/passes/pre_rope.py)")
    return candidates[-1], tail


def pre_rope_key(gm: fx.GraphModule, k_post: fx.Node, where: str = "") -> fx.Node:
    """The node computing the pre-RoPE key in k_post's layout [B, Hkv, T, D]: find_pre_rope_key's X with copies of
    its tail applied. The copies go right after k_post, where every argument of the tail already exists."""
    node, tail = find_pre_rope_key(gm, k_post, where)
    if not tail:
        return node
    at = k_post
    for t in tail:
        with gm.graph.inserting_after(at):
            node = at = gm.graph.call_function(t.target, (node, *t.args[1:]), dict(t.kwargs))
        node.meta.update({k: v for k, v in t.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
    return node


def _shape(node: fx.Node):
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
