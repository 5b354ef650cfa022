"""Golden graph diffs: what one pass changed, as stable text (not a pass).

    before = snapshot(gm)          # passes mutate the graph in place: snapshot first
    gm = some_pass(gm, ctx)
    print(graph_diff(before, gm, "tiny-llama / decode / some_pass"))

The text lists the change in op counts (deltas: the totals include HF code no pass touches), then
the removed and added nodes and the redirected uses ("uses of X -> Y"): layer 0 and the graph inputs
in full, other layers and the nodes outside any layer (HF's mask construction, cache bookkeeping)
only as counts. Nodes are paired by their graph name, which passes never change. The text is
normalized so that it survives torch/transformers upgrades: node names lose their numeric suffix
(`add_12` -> `add`), shapes come from meta["val"] (symbolic dims print as s0), floats print with
six significant digits, devices as `<device>`, and stack traces and source locations are never read.
"""
import re
from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx

from kvrewrite.capture import layer_of

_DTYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
}
_LAYER_IN_NAME = re.compile(r"^(?:l|hf_cache_|.*_layers_)(\d+)_")


@dataclass(frozen=True)
class NodeRecord:
    """One node, rendered: `name = target(args) :: dtype[shape]`, plus its layer (None: outside layers)."""

    name: str  # the graph's own name (unique in the graph); the key that pairs before and after
    op: str
    target: str  # "aten.add.Tensor", or "placeholder" / "get_attr" / "output"
    text: str  # normalized rendering
    wiring: str  # the arguments with the graph's own names: differs iff the node was rewired or edited
    layer: int | None
    inputs: tuple = ()  # (graph name, normalized name) of every input node, in argument order
    text_no_inputs: str = ""  # the arguments with every input node as "%": tells rewiring from editing


class Snapshot:
    """The rendered nodes of a graph at one moment (cheap; holds no reference to the graph)."""

    def __init__(self, graph):
        if isinstance(graph, Snapshot):  # Snapshot(snapshot) is the same snapshot
            self.records = graph.records
            return
        graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
        self.records = {n.name: _record(n) for n in graph.nodes}


def snapshot(gm) -> Snapshot:
    """Record every node of `gm` (a GraphModule or Graph) before a pass mutates it."""
    return Snapshot(gm)


def op_counts(graph) -> Counter:
    """Nodes per target, named as in the golden text ("aten.add.Tensor", "placeholder", "get_attr")."""
    return Counter(r.target for r in Snapshot(graph).records.values())


def graph_diff(before, after, title: str) -> str:
    """The golden text of what changed between `before` and `after` (Snapshots, Graphs or GraphModules)."""
    b, a = Snapshot(before), Snapshot(after)
    removed = [r for n, r in b.records.items() if n not in a.records or a.records[n].target != r.target]
    added = [r for n, r in a.records.items() if n not in b.records or b.records[n].target != r.target]
    rewired, changed = {}, []  # rewired: (layer, old input, new input) -> None (ordered set)
    for name, old in b.records.items():
        new = a.records.get(name)
        if new is None or new.target != old.target or new.wiring == old.wiring:
            continue
        pairs = _input_changes(old, new)
        if pairs is None:
            changed.append((old, new))
        for pair in pairs or ():
            rewired[(old.layer, *pair)] = None

    lines = [f"# golden: {title}",
             "# auto-generated; regenerate: KVREWRITE_UPDATE_GOLDEN=1 python -m pytest tests/passes"]
    # Deltas, not absolute counts: the totals include HF code the pass never touches.
    count_b, count_a = op_counts(b), op_counts(a)
    deltas = sorted((t, count_a[t] - count_b[t]) for t in count_b.keys() | count_a.keys() if count_a[t] != count_b[t])
    if not deltas and not rewired and not changed:
        return "\n".join(lines + ["[no change]"]) + "\n"
    width = max((len(t) for t, _ in deltas), default=0)
    for i, (t, d) in enumerate(deltas):
        lines.append(f"{'[op counts]' if i == 0 else '':<15}{t:<{width}} {d:+d}")
    for label, entries in (("[removed]", removed), ("[added]", added)):
        lines += [f"{label:<15}{_where(r.layer):<8}{r.text}" for r in entries if _in_full(r)]
    lines += [f"{'[rewired]':<15}{_where(l):<8}uses of {o} -> {n}" for l, o, n in rewired if _in_full_layer(l)]
    for old, new in changed:
        if _in_full(old):
            lines += [f"{'[changed]':<15}{_where(old.layer):<8}{old.text}", f"{'':<23}-> {new.text}"]
    # Everything else in counts only: other layers, and the computation outside any layer (HF's
    # mask construction, cache bookkeeping), whose exact spelling changes with transformers releases.
    groups = {r.layer for r in removed + added + [o for o, _ in changed] if not _in_full(r)}
    groups |= {l for l, _, _ in rewired if not _in_full_layer(l)}
    for i, layer in enumerate(sorted(groups, key=lambda l: -1 if l is None else l)):
        parts = [f"-{n} {t}" for t, n in sorted(Counter(r.target for r in removed if r.layer == layer and not _in_full(r)).items())]
        parts += [f"+{n} {t}" for t, n in sorted(Counter(r.target for r in added if r.layer == layer and not _in_full(r)).items())]
        n_rewired = sum(1 for l, _, _ in rewired if l == layer)
        n_changed = sum(1 for o, _ in changed if o.layer == layer and not _in_full(o))
        parts += [f"{n} {what}" for n, what in ((n_rewired, "rewired"), (n_changed, "changed")) if n]
        lines.append(f"{'[counts only]' if i == 0 else '':<15}{_where(layer):<8}{', '.join(parts)}")
    return "\n".join(lines) + "\n"


def _input_changes(old: NodeRecord, new: NodeRecord):
    """The (old input, new input) pairs of a node whose uses were redirected; None if more changed."""
    if len(old.inputs) != len(new.inputs) or old.text_no_inputs != new.text_no_inputs:
        return None
    return [(o[1], n[1]) for o, n in zip(old.inputs, new.inputs) if o[0] != n[0]]


def _in_full_layer(layer) -> bool:
    return layer == 0


def _in_full(rec: NodeRecord) -> bool:
    """Layer 0 and the graph inputs are listed node by node."""
    return rec.layer == 0 or (rec.layer is None and rec.op == "placeholder")


def _where(layer) -> str:
    return "-" if layer is None else f"layer{layer}"


def _record(node: fx.Node) -> NodeRecord:
    target = node.op if node.op in ("placeholder", "get_attr", "output") else _target_name(node.target)
    if node.op in ("placeholder", "get_attr"):
        text = f"{_name(node)} = {node.op}"
    else:
        args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
        text = f"{_name(node)} = {target}({', '.join(args)})"
    val = _val(node.meta.get("val"))
    if val:
        text += f" :: {val}"
    wiring = repr((node.args, node.kwargs))  # Node reprs are the graph's own (unique) names
    inputs = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: inputs.append((n.name, _name(n))))
    no_inputs = repr(fx.node.map_arg((node.args, node.kwargs), lambda n: "%"))
    return NodeRecord(node.name, node.op, target, text, wiring, _layer(node), tuple(inputs), no_inputs)


def _layer(node: fx.Node):
    kv = node.meta.get("kvrewrite")
    if isinstance(kv, dict) and "layer" in kv:
        return kv["layer"]
    layer = layer_of(node)
    if layer is None and node.op in ("placeholder", "get_attr"):
        m = _LAYER_IN_NAME.match(node.name)
        layer = int(m.group(1)) if m else None
    return layer


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.name().split("::")
        return f"{ns}.{name}" if "." in name else f"{ns}.{name}.default"
    return getattr(target, "__name__", None) or str(target)  # Python callables (symbolic_trace graphs)


def _name(node: fx.Node) -> str:
    # Placeholders and buffers have meaningful names (input_ids, l0_keys, hf_cache_0_keys); the
    # names of computed nodes carry a trace-order suffix that moves with every upstream change.
    return node.name if node.op in ("placeholder", "get_attr") else re.sub(r"_\d+$", "", node.name)


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return _name(a)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_arg(v)}" for k, v in a.items()) + "}"
    if isinstance(a, bool) or a is None:
        return str(a)
    if isinstance(a, float):
        return f"{a:.6g}"
    if isinstance(a, torch.dtype):
        return _DTYPES.get(a, str(a).replace("torch.", ""))
    if isinstance(a, torch.device):
        return "<device>"
    if isinstance(a, (torch.layout, torch.memory_format)):
        return str(a).replace("torch.", "")
    return str(a)


def _val(v) -> str:
    if isinstance(v, torch.Tensor):
        dims = ",".join(str(d) for d in v.shape)
        return f"{_DTYPES.get(v.dtype, str(v.dtype).replace('torch.', ''))}[{dims}]"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_val(x) or "?" for x in v) + ")"
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return str(v)
    return ""
