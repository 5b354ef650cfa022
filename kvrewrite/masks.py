"""Read each layer's attention window from the mask HF actually builds, not from config attribute names.

Families spell "this layer slides" in many ways (`layer_types`, `sliding_window` alone for Mistral v0.1,
Phi-3 and Starcoder2, `use_sliding_window` + `max_window_layers` for Qwen2, per-family defaults), and a
layer's window is whatever HF's forward passes to its attention. So the window is read off the captured
graph: the mask argument of each layer's SDPA is a pure function of `cache_position` (the capture has no
padding mask: padding is token_valid's job), and evaluating that subgraph for chosen query positions
over the captured cache's slots 0..C-1 shows which slots each position sees.

    full causal:      slot s visible to query q  <=>  s <= q
    sliding window w: slot s visible to query q  <=>  q - w < s <= q

The window is found by bisection (the smallest q that no longer sees slot 0; none below 2**31: no window),
then the hypothesis is checked row by row on positions around every edge. Any other pattern (Llama-4's
chunked attention, an additive position bias such as ALiBi, a bidirectional mask, masks that differ by
batch row or head) is a RewriteError naming the model type, the layer and what was seen: those models are
refused at apply, never rewritten into something else.
"""
import torch
from torch import fx

from kvrewrite.errors import RewriteError

SDPA = torch.ops.aten.scaled_dot_product_attention.default
NO_WINDOW_BELOW = 2**31  # no window this wide exists; a mask that still shows slot 0 here has none


def _arg(node, i, name, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


class _MaskProbe:
    """Evaluates the subgraph computing one mask node for given query positions (the prefill graph's inputs)."""

    def __init__(self, gm: fx.GraphModule, mask: fx.Node):
        keep, todo = set(), [mask]
        while todo:
            n = todo.pop()
            if n not in keep:
                keep.add(n)
                todo.extend(n.all_input_nodes)
        graph, env = fx.Graph(), {}
        for n in gm.graph.nodes:
            if n.op == "placeholder" or n in keep:
                env[n] = graph.node_copy(n, lambda x: env[x])
        graph.output(env[mask])
        self.gm = fx.GraphModule(gm, graph)
        self.inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]

    @torch.no_grad()
    def visible(self, start: int, like: dict) -> torch.Tensor:
        """[T, C] bool: slot c visible to the query at position start + t; refuses masks that are not plain."""
        T = like["cache_position"].shape[0]
        q_pos = start + torch.arange(T, dtype=torch.long)
        args = []
        for p in self.inputs:
            ref = like[p.name]
            if p.name == "cache_position":
                args.append(q_pos.to(ref.device))
            elif p.name == "position_ids":
                args.append(q_pos.to(ref.device).expand_as(ref).contiguous())
            else:
                args.append(torch.zeros_like(ref))
        m = self.gm(*args)
        if m.dtype == torch.bool:
            vis = m
        else:
            vis = m > torch.finfo(m.dtype).min / 2
            if bool((m[vis] != 0).any()):
                raise _NotAWindow("an additive bias in the attention mask (e.g. ALiBi), not only 0 / -inf")
        if vis.dim() != 4:
            raise _NotAWindow(f"a {vis.dim()}-D mask, expected [B, H, T, C]")
        first = vis[:1, :1]
        if not bool((vis == first).all()):
            raise _NotAWindow("a mask that differs between batch rows or heads")
        return first[0, 0].cpu()  # a [T, C] bool: the checks below compare it with masks built on the CPU


class _NotAWindow(Exception):
    pass


def _expected(start: int, T: int, C: int, window: int) -> torch.Tensor:
    s = torch.arange(C)[None, :]
    q = start + torch.arange(T)[:, None]
    vis = s <= q
    return vis & (s > q - window) if window else vis


def _window_of(probe: _MaskProbe, like: dict, T: int) -> int:
    """The window of one mask (0: full causal), or _NotAWindow."""
    def sees_slot0(q: int) -> bool:
        return bool(probe.visible(q, like)[0, 0])

    if not sees_slot0(0):
        raise _NotAWindow("position 0 does not see slot 0 (not a causal mask)")
    if sees_slot0(NO_WINDOW_BELOW):
        window = 0
    else:
        lo, hi = 0, NO_WINDOW_BELOW  # sees_slot0(lo) and not sees_slot0(hi): the window is hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if sees_slot0(mid) else (lo, mid)
        window = hi
    C = probe.visible(0, like).shape[-1]
    # chunks starting around every edge: the cache's end, the window's edge, and well past both
    starts = {0, 1, C - T, C - 1, C, 2 * C + 3}
    if window:
        starts |= {window + d for d in (-T - 1, -T, -2, -1, 0, 1, C - T, C, C + 1)} | {2 * window + 1, 3 * window + C // 2}
    for start in sorted(s for s in starts if s >= 0):
        got, want = probe.visible(start, like), _expected(start, T, C, window)
        if not torch.equal(got, want):
            t = int((got != want).any(dim=1).nonzero()[0])
            seen = got[t].nonzero().flatten().tolist()
            kind = f"a sliding window of {window}" if window else "full causal attention"
            raise _NotAWindow(f"position {start + t} sees slots {_ranges(seen)} of 0..{C - 1}, which is not {kind}")
    return window


def _ranges(idx: list) -> str:
    if not idx:
        return "none"
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}..{a}")
            start = b
    return ", ".join(out)


def attention_windows(gm: fx.GraphModule, example_inputs: dict, layer_of, model_tag: str, layer_types=None) -> dict:
    """{layer: window} for every SDPA node of `gm` (a captured prefill graph with eager attention normalised).

    example_inputs: {placeholder name: a tensor of its shape} (the capture's inputs).
    layer_types: the config's per-layer type names, only to name the feature in a refusal.
    """
    T = example_inputs["cache_position"].shape[0]
    windows, probes = {}, {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != SDPA:
            continue
        layer = layer_of(node)
        mask, causal = _arg(node, 3, "attn_mask"), _arg(node, 5, "is_causal", False)
        try:
            if mask is None:
                if not causal:
                    raise _NotAWindow("no mask and is_causal=False: bidirectional attention")
                window = 0
            else:
                if mask not in probes:
                    probes[mask] = _window_of(_MaskProbe(gm, mask), example_inputs, T)
                window = probes[mask]
        except _NotAWindow as e:
            kind = f" (layer type '{layer_types[layer]}')" if layer_types and layer is not None and layer < len(layer_types) else ""
            raise RewriteError(
                f"{model_tag}: layer {layer}{kind}: HF's attention mask is neither full causal attention nor a "
                f"sliding window: {e}. kvrewrite rewrites only those two kinds of attention; this model is not "
                f"supported") from None
        windows[layer] = window
    return windows
