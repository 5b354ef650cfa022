"""RewriteContext: what the passes share (model tag, method, layer facts, counters)."""
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerInfo:
    """Static facts of one decoder layer, read from the model config and checked against the graph.

    window: the sliding window of the layer (0 for full attention); such layers stay exact.
    """

    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int = 0


@dataclass
class AttentionSite:
    """Where one layer's attention lives in the graph (filled by locate_attention_sites)."""

    layer: int
    attention: object  # fx.Node: the SDPA node
    key_update: object  # fx.Node: index_copy_ into the key cache
    value_update: object  # fx.Node: index_copy_ into the value cache
    key_buffer: str  # attribute name of the dense key cache buffer
    value_buffer: str
    scale: float
    softcap: float = 0.0  # cap of the scores (cap * tanh(s / cap)), 0 for none (normalize_eager_attention)
    state: dict = field(default_factory=dict)  # state placeholders, filled by replace_kv_cache_update
    output: object = None  # fx.Node: the clustered_attention node


@dataclass
class RewriteContext:
    """Carried through the passes. `graph_kind` is "prefill" or "decode"; `method` a Method instance;
    `compress` False builds the decode variant without compression ops (see runtime.HostSchedule)."""

    model_tag: str
    method: object
    layers: list
    graph_kind: str = "decode"
    compress: bool = True
    cache_buffers: tuple = ()  # names of every buffer that belongs to the captured HF cache
    fuse_projections: bool = False  # run passes/fuse_projections.py (opt-in: it rebinds the model's weights)
    fused_weights: dict = field(default_factory=dict)  # the capture's fused projections, shared by its graphs
    gemv: bool = False  # run passes/replace_linear_with_gemv.py (opt-in: rounding differs from cuBLAS)
    tp: int = 1  # tensor-parallel ranks (kvrewrite/tensor_parallel.py); > 1 runs insert_tensor_parallel_all_reduce
    tp_group: str = ""  # the torch.distributed group name of the all-reduces
    tp_rank: int = 0  # this rank: its first KV head of a layer is tp_rank * Hkv (the rank's), the head_offset of ops
    tp_row_parallel: tuple = ()  # the HF model's row-parallel weight names (o_proj, down_proj), summed over ranks
    tp_vocab_parallel: str = ""  # the lm_head weight split by vocabulary rows, its logits gathered ("" if whole)
    tp_all_reduce: str = "collective"  # "one_shot": kvrewrite::tp_all_reduce (tensor_parallel.prepare_all_reduce)
    max_length: int = 0  # the longest prompt + generation the state is sized for (Method.select_call's sizes)
    sites: dict = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)

    def where(self, layer=None, node=None) -> str:
        """Prefix for error messages: model, graph, layer and node."""
        parts = [f"{self.model_tag} ({self.graph_kind}{'' if self.compress else ' without compression'} graph)"]
        if layer is not None:
            parts.append(f"layer {layer}")
        if node is not None:
            parts.append(f"node '{node.name}' ({node.target})")
        return ": ".join(parts)
