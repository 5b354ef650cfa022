"""Capture: HF causal LM + static cache -> two ATen graphs (prefill chunk [B, T], decode step [B, 1]).

The model is exported with `torch.export` (non-strict) around a `transformers.StaticCache` whose
tensors are registered as buffers of a thin wrapper, so every layer shows up as

    index_copy_(hf_cache_<i>_keys, 2, pos, k_rot); index_copy_(hf_cache_<i>_values, 2, pos, v)
    scaled_dot_product_attention(q, <view of hf_cache_<i>_keys>, <view of ..._values>, mask, scale=...)

(or the eager matmul-softmax-matmul form). The passes then replace those nodes. Sliding-window cache
layers are captured as plain static layers (their window is read from the config and enforced by the
rewritten attention), as transformers' own executorch wrapper does.
"""
import logging
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from kvrewrite.context import LayerInfo

logger = logging.getLogger(__name__)

SUPPORTED_MODELS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gemma3")
GRAPH_INPUTS = ("input_ids", "position_ids", "cache_position")


@dataclass
class Captured:
    """The captured graphs and the facts the passes and the runtime need."""

    graphs: dict  # {"prefill": GraphModule, "decode": GraphModule}
    layers: list  # [LayerInfo]
    model_tag: str
    cache_buffers: tuple  # buffer names of the captured HF cache (keys, values, bookkeeping)
    batch_size: int
    prefill_chunk: int
    dtype: torch.dtype
    device: torch.device
    vocab_size: int
    fused_weights: dict = field(default_factory=dict)  # passes/fuse_projections.py: made once, shared by every apply


def model_tag(model) -> str:
    cfg = model.config
    name = getattr(cfg, "_name_or_path", "") or ""
    return f"{cfg.model_type}:{name}" if name else f"{cfg.model_type}-{cfg.num_hidden_layers}l"


def layer_infos(model) -> list:
    """Per-layer head counts and sliding windows, from the (text) config."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or 0
    return [
        LayerInfo(i, heads, kv_heads, head_dim, window if t == "sliding_attention" else 0) for i, t in enumerate(types)
    ]


class _StaticCacheWrapper(torch.nn.Module):
    """Holds the model and a StaticCache whose tensors are registered buffers (so export sees them)."""

    def __init__(self, model, batch_size: int, max_cache_len: int):
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        self.model = model
        layers = layer_infos(model)
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        for i, layer in enumerate(self.cache.layers):
            if type(layer) is not StaticLayer:  # sliding-window layers: the rewrite enforces the window
                self.cache.layers[i] = StaticLayer(max_cache_len)
        self.cache.early_initialization(batch_size, layers[0].num_kv_heads, layers[0].head_dim, model.dtype, model.device)
        self._names = []
        for i, layer in enumerate(self.cache.layers):
            for attr, value in vars(layer).items():
                if isinstance(value, torch.Tensor):
                    name = f"hf_cache_{i}_{attr}"
                    self.register_buffer(name, value, persistent=False)
                    self._names.append((layer, attr, name))

    def forward(self, input_ids, position_ids, cache_position):
        # Point the cache at this module's buffers, so non-strict export traces them as buffers.
        for layer, attr, name in self._names:
            setattr(layer, attr, getattr(self, name))
        for layer in self.cache.layers:
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length.copy_(cache_position[0])
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            cache_position=cache_position,
            past_key_values=self.cache,
            use_cache=True,
        )
        return out.logits


def _to_plain_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop export's pytree calling convention, input guards and dtype assertions (the latter are
    side-effecting nodes that would keep dead mask arithmetic alive): the passes own the graph."""
    graph = gm.graph
    for node in list(graph.nodes):
        if (node.op == "call_module" and node.target == "_guards_fn") or (
            node.op == "call_function" and node.target == torch.ops.aten._assert_tensor_metadata.default
        ):
            graph.erase_node(node)
    graph.set_codegen(fx.graph.CodeGen())
    out = next(n for n in graph.nodes if n.op == "output")
    if isinstance(out.args[0], (tuple, list)) and len(out.args[0]) == 1:
        out.args = (out.args[0][0],)
    graph.eliminate_dead_code()  # export leaves a few dead nodes (HF mask setup, unused rotary buffers)
    return fx.GraphModule(gm, graph, class_name="CapturedGraph")  # a plain module: no export pre-hooks


def check_causal_lm(model) -> None:
    """ValueError unless `model` looks like a Hugging Face causal LM (has config and generation_config)."""
    if not hasattr(model, "config") or not hasattr(model, "generation_config"):
        raise ValueError(f"kvrewrite.apply: expected a Hugging Face causal LM, got {type(model).__name__}")


def capture(model, *, batch_size: int, prefill_chunk: int) -> Captured:
    """Export `model` into a prefill-chunk graph ([B, prefill_chunk]) and a decode-step graph ([B, 1])."""
    check_causal_lm(model)
    mt = model.config.model_type
    if mt not in SUPPORTED_MODELS:
        logger.warning("kvrewrite: model type %r is outside SUPPORTED_MODELS %s; trying anyway", mt, SUPPORTED_MODELS)
    layers = layer_infos(model)
    wrapper = _StaticCacheWrapper(model, batch_size, max_cache_len=prefill_chunk)
    graphs = {}
    grads = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    model.eval().requires_grad_(False)
    try:
        for kind, T in (("prefill", prefill_chunk), ("decode", 1)):
            ids = torch.zeros(batch_size, T, dtype=torch.long, device=model.device)
            pos = torch.arange(T, device=model.device).expand(batch_size, T)
            cpos = torch.arange(T, device=model.device)
            with torch.no_grad():
                ep = torch.export.export(wrapper, (ids, pos, cpos), strict=False)
            graphs[kind] = _to_plain_graph_module(ep.module())
    finally:
        for p, g in grads.items():
            p.requires_grad_(g)
        model.train(was_training)
    return Captured(
        graphs=graphs,
        layers=layers,
        model_tag=model_tag(model),
        cache_buffers=tuple(name for _, _, name in wrapper._names),
        batch_size=batch_size,
        prefill_chunk=prefill_chunk,
        dtype=model.dtype,
        device=model.device,
        vocab_size=model.config.get_text_config().vocab_size,
    )


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph can be rewritten independently; parameters and buffers stay shared."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(fx.graph.CodeGen())
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def layer_of(node) -> int | None:
    """The decoder layer a node belongs to, from its nn_module_stack (None outside layers)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        m = re.search(r"layers\.(\d+)(\.|$)", path)
        if m:
            return int(m.group(1))
    return None
