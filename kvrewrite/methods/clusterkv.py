"""ClusterKV: recallable selection by semantic clusters. Based on https://arxiv.org/abs/2412.03213.

Nothing is evicted: every token's keys and values stay in the layer's state. After the prompt, each KV head's
keys (post-RoPE, as the cache holds them) are clustered by k-means; at every decode step each selection head
scores the cluster centroids against its query (inner product), takes clusters in descending score until the
budget, trims the last one, and attends only to the sinks, the selected tokens and the tokens generated since
the last clustering. Every `interval` (m) decode tokens those tokens are clustered alone and appended.

State per compressed layer (methods/clusterkv.py's state_fields; docs/methods.md has the layout): `centroids`
[B, Hkv, K, D] (the model's dtype), `cluster_size` and `cluster_start` [B, Hkv, K] int32, `members` [B, Hkv, C]
int32 (the sinks, then every clustered slot grouped by cluster: the paper's sorted indices), `n_clusters` [B, Hkv]
int32 and `cluster_end` [B, Hkv] int64 (slots from there on are not clustered yet). K = max_clusters(C).
Ops: kvrewrite::kmeans_cluster at the end of the step (the "compression" op: due after the prompt's last chunk
and every m decode tokens; it never drops a slot), kvrewrite::select_clusters before the attention of a decode
step, and kvrewrite::indexed_attention over the selected slots (prefill chunks attend densely, as the paper).

Decisions where the paper leaves room (docs/methods.md, "ClusterKV", gives the reasons at more length):
- Budget: B counts the sinks and the cluster-selected tokens (B - n_sink of them), like the authors'
  accuracy path (the one the paper's LongBench numbers come from); the tokens generated since the last
  clustering (at most m) are attended in full on top, as both of the authors' paths do. So a step attends
  to at most B + m tokens; B >= every token of the row is exactly full attention.
- Clusters: C0 = ceil(L / 80) for the L prompt tokens past the sinks of a row (the paper's L / 80: 400 at 32k),
  C+ = 4 every m = 320 generated tokens (the paper; the authors' code uses 8), fixed at 20 iterations (the
  authors' cap; a converged k-means is a fixed point, so the cap only matters when it has not converged).
- Initialisation: one key in each of C disjoint strata of the sequence (stratum k = [floor(k L / C),
  floor((k+1) L / C)), a seeded hash picks the point), so no repeats (the authors' randint with replacement
  repeats keys and leaves clusters empty); differs per KV head; reproducible for a seed and independent of the
  batch row's padding.
- Empty clusters keep their centroid (the authors' code); they have size 0 and are never selected.
- Trimming keeps the last cluster's leading members in slot order (the authors' kernel).
- GQA (the paper has MHA only): clusters per KV head; `select_per="query_head"` ranks the centroids per query
  head, as the authors' code (each query head its own slot list); `"kv_head"` ranks them once per KV head by the
  group's summed query (the authors' "qavg" option) and the group shares one gather. Default "query_head", by
  measurement: on Qwen2.5-0.5B (G = 7), 2k context, budget 0.2, it keeps more of the true top-k (recall 0.59 vs
  0.55), a smaller attention error (0.15 vs 0.22) and NLL (+0.017 vs +0.032), and on an H100 (Llama-3.1-8B shape,
  B = 1) it decoded 3% faster end to end at 32k and 128k; "kv_head" is the faster choice at batch 8 (2x per
  layer) and with offload="cpu" (13 vs 24 ms/token at 32k), where it reads a quarter of the rows.
- Layers 0 and 1 attend to everything (`dense_layers`, the paper follows Quest); they own no cluster state.
- Batch rows are clustered independently; with left padding a row's sinks are its first n_sink real tokens.
- Memory is not what the budget saves: cache_bytes() counts the full KV plus the index (centroids, 3 ints per
  cluster, one int32 per slot).
- offload="cpu" (the paper's CPU offload, the authors' zero-copy variant): the clustered layers' keys and values
  are allocated in page-locked host memory mapped into the GPU (kvrewrite/offload.py) and handed to the graphs as
  CUDA tensors, so every op, CUDA graph and torch.compile runs unchanged and reads over PCIe only what it touches.
  Everything else stays on the GPU (dense layers, bias, slot_pos, the index). Inside the step graphs (and their
  CUDA graphs): the decode gathers of the selected rows, cache_append's writes, k-means' copy of its points, the
  prefill chunks' dense attention; outside: only the allocation and registration (at apply) and, per generation,
  the reset's zero-fill of the host keys/values (GPU writes over PCIe). No GPU cache of the last step's rows (the
  paper's R = 1). H100, Llama-3.1-8B shape, 32k, B = 1, budget 1024: decode 8.4-9.0 -> 23.6-24.1 ms/token with
  per-query-head selection, 8.8 -> 13.0 with select_per="kv_head"; peak GPU memory 19.7 -> 15.6 GiB (4.0 GiB of
  KV on the host). Prefill is the weak part: a 1024-token chunk's dense attention reads every slot once per
  query block over the bus, ~100x its device time (243 vs 2.4 ms per layer at 34k slots): minutes for a 32k
  prompt (docs/methods.md, "ClusterKV", has the fix to build).

What B counts: tokens attended per step and KV head (or query head), the n_sink sinks included and the at most m
not-yet-clustered recent tokens not.
"""
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvrewrite.methods.base import Method
from kvrewrite.state import StateField

SELECT_PER = ("query_head", "kv_head")
OFFLOAD = (None, "cpu")


@dataclass
class ClusterKVMethod(Method):
    """Attend, at each decode step, to the clusters of keys whose centroids best match the query; keep every token.

    Args:
        budget: B tokens attended per step and head from the clustered history, the sinks included (an int > n_sink),
            or a fraction of n + Γ (a float in (0, 1]); the recent unclustered tokens (<= interval) come on top.
        interval: m, the generated tokens clustered together (every m decode steps).
        n_sink: first tokens of each row, never clustered, always attended.
        tokens_per_cluster: the prompt gets ceil(L / tokens_per_cluster) clusters (L its tokens past the sinks).
        window_clusters: C+, clusters of each m generated tokens.
        iters: k-means iterations (assignment + update), then one last assignment.
        dense_layers: the first layers (by model layer index) that attend to every token.
        select_per: "query_head" (each query head ranks the clusters of its KV head) or "kv_head" (the group's
            summed query ranks them once; one slot list per KV head).
        seed: the k-means initialisation's seed.
        offload: None (every state tensor on the model's device) or "cpu": the clustered layers' keys and values
            in pinned host memory that the GPU reads in place (kvrewrite/offload.py; a CUDA model only).
    """

    name: ClassVar[str] = "clusterkv"
    budget: float | int = 1024
    interval: int = 320
    n_sink: int = 16
    tokens_per_cluster: int = 80
    window_clusters: int = 4
    iters: int = 20
    dense_layers: int = 2
    select_per: str = "query_head"
    seed: int = 0
    offload: str | None = None

    def __post_init__(self):
        super().__post_init__()
        for name, low in (("n_sink", 0), ("tokens_per_cluster", 1), ("window_clusters", 1), ("iters", 1),
                          ("dense_layers", 0), ("seed", 0)):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= low):
                raise ValueError(f"ClusterKVMethod.{name} must be an int >= {low}, got {v!r}")
        if self.select_per not in SELECT_PER:
            raise ValueError(f"ClusterKVMethod.select_per must be one of {SELECT_PER}, got {self.select_per!r}")
        if self.offload not in OFFLOAD:
            raise ValueError(f"ClusterKVMethod.offload must be None (keys and values on the model's device) or 'cpu' "
                             f"(the clustered layers' keys and values in pinned host memory), got {self.offload!r}")
        if self.budget_in_slots and self.budget <= self.n_sink:
            raise ValueError(f"ClusterKVMethod.budget ({self.budget} tokens) must exceed n_sink={self.n_sink}: the "
                             f"sinks count inside the budget")

    def compressed(self, layer) -> bool:
        """Does this (full-attention) layer select by clusters? The first dense_layers attend to everything."""
        return layer.index >= self.dense_layers

    def host_fields(self, layer) -> tuple:
        """The base state fields kept in pinned host memory (kvrewrite.offload): with offload="cpu" a clustered
        layer's keys and values, the full KV its decode steps read a few selected rows of. bias and slot_pos stay
        on the GPU: 12 bytes per slot next to 4 * D for 16-bit K and V (2% at D = 128), and a prefill chunk's dense
        attention and every k-means read them whole. The dense layers read every row each step: on the GPU."""
        return ("keys", "values") if self.offload == "cpu" and self.compressed(layer) else ()

    def max_clusters(self, C: int) -> int:
        """K, the static cluster capacity of a row of C slots: the prompt's clusters plus C+ per m generated tokens."""
        return max(1, math.ceil(C / self.tokens_per_cluster) + self.window_clusters * (C // self.interval))

    def state_fields(self, layer):
        if not self.compressed(layer):
            return {}
        K = self.max_clusters
        return {
            "centroids": StateField(lambda B, H, C, D: (B, H, K(C), D), None, 0.0),
            "cluster_size": StateField(lambda B, H, C, D: (B, H, K(C)), torch.int32, 0),
            "cluster_start": StateField(lambda B, H, C, D: (B, H, K(C)), torch.int32, 0),
            "members": StateField(("B", "Hkv", "C"), torch.int32, -1),
            "n_clusters": StateField(("B", "Hkv"), torch.int32, 0),
            "cluster_end": StateField(("B", "Hkv"), torch.int64, 0),
        }

    def compression_call(self, layer):
        if not self.compressed(layer):
            return None
        return torch.ops.kvrewrite.kmeans_cluster.default, {
            "n_sink": self.n_sink, "tokens_per_cluster": self.tokens_per_cluster, "window": self.interval,
            "window_clusters": self.window_clusters, "iters": self.iters, "seed": self.seed,
        }

    def select_call(self, layer, max_length: int):
        if not self.compressed(layer):
            return None
        return torch.ops.kvrewrite.select_clusters.default, {
            "n_sink": self.n_sink, "max_selected": max(0, self.max_target(max_length) - self.n_sink),
            "window": self.interval, "per_query_head": self.select_per == "query_head",
        }

    def targets(self, layer, n_prompt: int, max_new_tokens: int, prompt_slots: int = 0):
        """(B, the prompt's slots): the selection budget, and the fill at which the prompt is clustered (the end
        of the last prefill chunk); the op then clusters every m generated tokens (after_compression)."""
        if not self.compressed(layer):
            return super().targets(layer, n_prompt, max_new_tokens, prompt_slots)
        return self.target(n_prompt, max_new_tokens), prompt_slots

    def after_compression(self, fill: int, valid: int, target: int, threshold: int):
        """Clustering keeps every slot; the next one is due m tokens later."""
        return fill, valid, fill + self.interval

    def capacity(self, layer, max_length: int, prefill_chunk: int) -> int:
        return max_length + prefill_chunk - 1  # every token stays (the prompt is left-padded to whole chunks)

    def check_generation(self, n_prompt: int, max_new_tokens: int) -> None:
        b = self.target(n_prompt, max_new_tokens)
        if b <= self.n_sink:
            raise ValueError(f"clusterkv: {self.describe_target(n_prompt, max_new_tokens)} leaves nothing to select "
                             f"past the n_sink={self.n_sink} sinks (the budget counts them); raise the budget or "
                             f"lower n_sink")
