"""Capture: HF causal LM + static cache -> two ATen graphs (prefill chunk [B, T], decode step [B, 1]).

The model is exported with `torch.export` (non-strict) around a `transformers.StaticCache` whose
tensors are registered as buffers of a thin wrapper, so every layer shows up as

    index_copy_(hf_cache_<i>_keys, 2, pos, k_rot); index_copy_(hf_cache_<i>_values, 2, pos, v)
    scaled_dot_product_attention(q, <view of hf_cache_<i>_keys>, <view of ..._values>, mask, scale=...)

(or the eager matmul-softmax-matmul form). The passes then replace those nodes. Every cache layer is
captured as a plain static layer (sliding-window ones too: their window, read off HF's mask, is enforced
by the rewritten attention), as transformers' own executorch wrapper does.

Per-layer facts come from the model as it runs, never from config attribute names (Falcon, GPT-2 and
others spell them differently): KV heads and head dim from the keys a one-token eager forward caches,
query heads from the captured attention's q, and each layer's sliding window from the attention mask HF
builds (kvrewrite/masks.py). RoPE whose frequencies depend on the sequence length is traced on its
original frequencies (kvrewrite/rope.py; apply bounds max_length accordingly).
"""
import logging
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from kvrewrite.context import LayerInfo
from kvrewrite.errors import RewriteError
from kvrewrite.masks import SDPA, attention_windows
from kvrewrite.rope import original_frequencies

logger = logging.getLogger(__name__)

# Model types the family matrix of tests/families.py checks against HF (tests/test_verify.py keeps the two equal);
# apply verifies any other type on a reduced copy first (kvrewrite/verification.py)
SUPPORTED_MODELS = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "phi", "starcoder2", "gemma",
    "gemma2", "gemma3_text", "olmo", "olmo2", "granite", "stablelm", "cohere", "gpt_neox", "glm4", "smollm3",
    "falcon", "gpt2", "gptj",
})
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
    tp: int = 1  # tensor-parallel ranks: > 1 is one rank's capture (kvrewrite/tensor_parallel.py capture_rank)
    tp_rank: int = 0  # that rank: its KV heads of each layer start at tp_rank * the layer's (rank's) Hkv
    tp_group: str = ""  # the torch.distributed group its all-reduces run on
    tp_row_parallel: tuple = ()  # its row-parallel weight names, summed over the ranks
    tp_vocab_parallel: str = ""  # its lm_head weight when split by vocabulary rows (logits gathered), else ""


def model_tag(model) -> str:
    cfg = model.config
    name = getattr(cfg, "_name_or_path", "") or ""
    return f"{cfg.model_type}:{name}" if name else f"{cfg.model_type}-{cfg.num_hidden_layers}l"


def text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


@torch.no_grad()
def kv_shapes(model) -> list:
    """[(Hkv, D)] per layer: the shape of the keys a one-token eager forward caches (a DynamicCache), so MQA,
    GQA and per-layer head dims are what the model really stores, whatever its config calls them."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    was_training = model.training
    model.eval()
    try:
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    finally:
        model.train(was_training)
    shapes = []
    for i, layer in enumerate(cache.layers):
        k = getattr(layer, "keys", None)
        if not isinstance(k, torch.Tensor) or k.dim() != 4:
            raise RewriteError(f"{model_tag(model)}: layer {i}: the model cached no [B, Hkv, T, D] keys "
                               f"(found {type(k).__name__}); only attention KV caches can be rewritten")
        shapes.append((int(k.shape[1]), int(k.shape[3])))
    if not shapes:
        raise RewriteError(f"{model_tag(model)}: a forward with a DynamicCache cached nothing; is it a decoder "
                           f"with a KV cache?")
    return shapes


def refuse_alibi(model, tag: str) -> None:
    """RewriteError for ALiBi (Bloom; Falcon and MPT with alibi set): an additive per-head position bias on the
    scores that the slot state does not carry. (With SDPA the mask probe would catch it too; Bloom and MPT
    run eager attention, whose bias lives outside the mask, so the config says it first.)"""
    cfg = text_config(model)
    if cfg.model_type == "bloom" or getattr(cfg, "alibi", False) or getattr(getattr(cfg, "attn_config", None), "alibi", False):
        raise RewriteError(f"{tag}: ALiBi position bias (an additive per-head bias on the attention scores) is not "
                           f"supported: the KV slot state keeps no per-slot position bias")


def layer_infos(model) -> list:
    """Per-layer facts without a capture: KV shapes from kv_shapes, query heads from the config, no windows
    (benchmarks of random full-attention models use this; capture reads every fact off the graphs)."""
    heads = text_config(model).num_attention_heads
    return [LayerInfo(i, heads, hkv, d) for i, (hkv, d) in enumerate(kv_shapes(model))]


class _StaticCacheWrapper(torch.nn.Module):
    """Holds the model and a StaticCache whose tensors are registered buffers (so export sees them)."""

    def __init__(self, model, batch_size: int, max_cache_len: int, shapes: list):
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        # every layer a plain static layer (sliding and chunked ones too: the rewrite enforces the window it
        # reads off the mask), one per layer the model caches, each sized by the keys it really stores
        self.cache.layers = [StaticLayer(max_cache_len) for _ in shapes]
        for layer, (hkv, d) in zip(self.cache.layers, shapes):
            empty = torch.zeros(batch_size, hkv, 0, d, dtype=model.dtype, device=model.device)
            layer.lazy_initialization(empty, empty)
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
    tag = model_tag(model)
    refuse_alibi(model, tag)
    shapes = kv_shapes(model)
    wrapper = _StaticCacheWrapper(model, batch_size, prefill_chunk, shapes)
    graphs, inputs = {}, {}
    grads = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    model.eval().requires_grad_(False)
    try:
        with original_frequencies(model):
            for kind, T in (("prefill", prefill_chunk), ("decode", 1)):
                ids = torch.zeros(batch_size, T, dtype=torch.long, device=model.device)
                pos = torch.arange(T, device=model.device).expand(batch_size, T)
                cpos = torch.arange(T, device=model.device)
                inputs[kind] = dict(zip(GRAPH_INPUTS, (ids, pos, cpos)))
                with torch.no_grad():
                    try:
                        ep = torch.export.export(wrapper, (ids, pos, cpos), strict=False)
                    except Exception as e:
                        raise RewriteError(f"{tag}: torch.export could not capture the {kind} graph "
                                           f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
                graphs[kind] = _to_plain_graph_module(ep.module())
    finally:
        for p, g in grads.items():
            p.requires_grad_(g)
        model.train(was_training)
    return Captured(
        graphs=graphs,
        layers=read_layer_facts(graphs["prefill"], inputs["prefill"], shapes, tag, model),
        model_tag=tag,
        cache_buffers=tuple(name for _, _, name in wrapper._names),
        batch_size=batch_size,
        prefill_chunk=prefill_chunk,
        dtype=model.dtype,
        device=model.device,
        vocab_size=model.config.get_text_config().vocab_size,
    )


def read_layer_facts(gm: fx.GraphModule, inputs: dict, shapes: list, tag: str, model) -> list:
    """LayerInfo per layer from the captured prefill graph: query heads from each attention's q, the window
    from its mask (kvrewrite/masks.py), KV heads and head dim from `shapes` (kv_shapes)."""
    from kvrewrite.context import RewriteContext
    from kvrewrite.passes.normalize_eager_attention import normalize_eager_attention

    probe = normalize_eager_attention(copy_graph_module(gm), RewriteContext(tag, None, []))
    windows = attention_windows(probe, inputs, layer_of, tag, getattr(text_config(model), "layer_types", None))
    q_heads = {}
    for node in probe.graph.nodes:
        if node.op == "call_function" and node.target == SDPA:
            q = node.args[0].meta.get("val")
            if q is not None and q.dim() == 4:
                q_heads[layer_of(node)] = int(q.shape[1])
    infos = []
    for i, (hkv, d) in enumerate(shapes):
        # a layer without an attention site keeps the config's head count here: locate_attention_sites
        # then names it as a layer without a site
        heads = q_heads.get(i, getattr(text_config(model), "num_attention_heads", hkv))
        infos.append(LayerInfo(i, heads, hkv, d, windows.get(i, 0)))
    return infos


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
        m = _LAYER.search(path)
        if m:
            return int(m.group(1))
    return None


# the first numbered module of a path is the decoder layer: model.layers.3, transformer.h.3,
# gpt_neox.layers.3 (an MoE layer's experts.<j> come after it)
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
