"""Chelsea: chunked soft matching + degree-weighted merge + log-degree bias.

Based on "Efficient Long-Context LLM Inference via KV Cache Clustering",
https://arxiv.org/abs/2506.11418 (Alg. 1, Sec. 5). The compression itself is the op
kvrewrite::chelsea_compress (kvrewrite/kernels/chelsea_compress.py); attention adds log n_j.

Decisions where the paper is silent or ambiguous (each tested in tests/methods/test_chelsea.py):
- r is the fraction of the middle (compressible) region removed per CSM round: n_merge =
  floor(r * M), at least 1, at most what is left above B (the last round lands exactly on B).
  Only this reading fits the paper's bound r <= 0.5 and "at most half per step".
- The schedule step i counts rounds inside one compression call and restarts at 0 for each call
  (decode-time calls remove about g slots, one round). Defaults are the paper's Llama-3 setting
  (r_init 0.35, alpha 0.1, m 2); the floor "r > 0" is r_min = 0.1 (ours), so the post-prefill
  compression needs a bounded number of rounds.
- g (interval) is not given: 32. Γ is max_new_tokens of the generation.
- Chunks start at the first middle slot; the last may be shorter; the A/B alternation restarts in
  each chunk (A = 1st, 3rd, ...).
- Every CSM round re-chunks the middle it is given: chunks of `chunk` slots over the current (already
  shrunken) middle, so boundaries move between rounds and a slot can meet, in a later round, a slot
  that sat in a neighbouring chunk before. The paper never discusses boundaries across rounds, but
  each step is one Chunked Soft Matching of the current cache: Alg. 1 carries only K, V, N, s between
  calls (`K,V,N,s = Chelsea(K,V,N,s,n1,n2,r,c)`, no chunk layout), "the sequence is divided into
  chunks while preserving the attention sinks and recent tokens", "multiple clustering steps are
  required", and c is the chunk size of a CSM over a sequence of length n (Table 1: cost 1/4 ncd).
  Fixed boundaries would shrink every chunk to ~c (1 - r)^i slots, away from the c the paper sets
  (256) and ablates (Table 4), and across calls they cannot hold anyway (the recent window slides
  into the middle). The Triton kernels do the same (chunks over the current M every round).
- Merged slots keep temporal order: the centroid takes its B slot's place (paper §8.5 reading).
- Keys are post-RoPE, as stored in HF caches; similarity is cosine in fp32; merging in fp32.
- GQA: clustering per KV head; every query head of the group sees the same log n.
- Padding slots (left-padded batches) are dropped at the first compression, never merged.
- The prompt is prefilled in chunks; a chunk attends to the compressed past, so only B + g + chunk
  slots per layer ever exist (the paper prefills exactly, then compresses; with prefill_chunk >=
  the prompt length, kvrewrite does the same).
- Outlier heads (`outlier_heads={layer: [kv heads]}`) are never compressed; the other heads'
  budget is lowered so the total stays R (R' = (R*H - H_out) / (H - H_out), H counting KV heads of
  full-attention layers), the paper's "reallocate the budget". With a budget in slots (an int B) the
  same total B * H is shared: B' = (B*H - H_out * (n + Γ)) / (H - H_out), the outlier heads holding
  every token. A layer holding an outlier head allocates full capacity for all its heads (static
  shapes): cache_bytes() shows that cost.
- What B counts: every slot of a compressed KV head, sinks and recent window included (merged
  slots count once whatever their degree).
"""
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvrewrite.methods.base import Method


@dataclass
class ChelseaMethod(Method):
    """Chelsea KV-cache clustering.

    Args:
        budget: B slots per KV head (an int >= 1), or R, the fraction of n + Γ kept per KV head (a float in
            (0, 1]); sinks, recent window and merged slots all count (each merged slot once).
        n_sink: attention-sink slots never merged (paper: 16).
        n_recent: most recent slots never merged (paper: 64).
        chunk: chunk size c of the soft matching (paper: 256); every round re-chunks the current middle.
        r_init, r_alpha, r_steps, r_min: schedule r_i = max(r_init - r_alpha * min(r_steps, i), r_min).
        interval: g, compress when a row holds B + g slots.
        outlier_heads: {layer: [kv head, ...]} kept uncompressed.
    """

    name: ClassVar[str] = "chelsea"
    budget: float | int = 0.2
    n_sink: int = 16
    n_recent: int = 64
    chunk: int = 256
    r_init: float = 0.35
    r_alpha: float = 0.1
    r_steps: int = 2
    r_min: float = 0.1
    outlier_heads: dict = field(default_factory=dict)
    _kv_heads_total: int = field(default=0, init=False, repr=False)  # set by bind()

    def __post_init__(self):
        super().__post_init__()
        for f in ("n_sink", "n_recent"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 0):
                raise ValueError(f"ChelseaMethod.{f} must be an int >= 0, got {getattr(self, f)!r}")
        if not (isinstance(self.chunk, int) and self.chunk >= 2):
            raise ValueError(f"ChelseaMethod.chunk must be an int >= 2, got {self.chunk!r}")
        if not 0 < self.r_init <= 0.5:
            raise ValueError(f"ChelseaMethod.r_init must be in (0, 0.5], got {self.r_init!r}")
        if not 0 < self.r_min <= 0.5:
            raise ValueError(f"ChelseaMethod.r_min must be in (0, 0.5] (the paper keeps r > 0), got {self.r_min!r}")
        if self.r_alpha < 0 or not isinstance(self.r_steps, int) or self.r_steps < 0:
            raise ValueError(f"ChelseaMethod: r_alpha must be >= 0 and r_steps an int >= 0, got {self.r_alpha!r}, {self.r_steps!r}")
        self.outlier_heads = {int(k): sorted(int(h) for h in v) for k, v in (self.outlier_heads or {}).items()}

    def bind(self, layers) -> None:
        """Check outlier heads against the model's layers; remember the KV-head count for R'."""
        full = {l.index: l for l in layers if not l.window}
        for layer, heads in self.outlier_heads.items():
            if layer not in full:
                raise ValueError(f"ChelseaMethod.outlier_heads: layer {layer} is not a full-attention layer of this model")
            bad = [h for h in heads if not 0 <= h < full[layer].num_kv_heads]
            if bad:
                raise ValueError(f"ChelseaMethod.outlier_heads: layer {layer} has no KV heads {bad}")
        self._kv_heads_total = sum(l.num_kv_heads for l in full.values())
        if not self.budget_in_slots and self.compressed_budget() <= 0:
            raise ValueError(f"ChelseaMethod: {self.n_outliers} outlier heads leave no budget at R={self.budget}")

    @property
    def n_outliers(self) -> int:
        return sum(len(v) for v in self.outlier_heads.values())

    def compressed_budget(self) -> float:
        """R' of the compressed heads (a fractional budget), so that the total over all KV heads stays R."""
        h, o = self._kv_heads_total, self.n_outliers
        return self.budget if not o else (self.budget * h - o) / (h - o)

    def target(self, n_prompt, max_new_tokens):
        h, o = self._kv_heads_total, self.n_outliers
        if self.budget_in_slots:  # B' of the compressed heads, the total B * H shared with the uncompressed ones
            if not o:
                return self.budget
            return max(1, round((self.budget * h - o * (n_prompt + max_new_tokens)) / (h - o)))
        return max(1, round(self.compressed_budget() * (n_prompt + max_new_tokens)))

    def capacity(self, layer, max_length, prefill_chunk):
        if self.outlier_heads.get(layer.index):
            return max_length + prefill_chunk - 1
        return super().capacity(layer, max_length, prefill_chunk)

    def compression_call(self, layer):
        return torch.ops.kvrewrite.chelsea_compress.default, {
            "n_sink": self.n_sink,
            "n_recent": self.n_recent,
            "chunk": self.chunk,
            "r_init": float(self.r_init),
            "r_alpha": float(self.r_alpha),
            "r_steps": self.r_steps,
            "r_min": float(self.r_min),
            "outlier_heads": self.outlier_heads.get(layer.index, []),
        }

    def check_generation(self, n_prompt, max_new_tokens):
        b = self.target(n_prompt, max_new_tokens)
        if b < self.n_sink + self.n_recent + 2:
            raise ValueError(
                f"chelsea: {self.describe_target(n_prompt, max_new_tokens)} cannot hold the {self.n_sink} sink + "
                f"{self.n_recent} recent tokens plus a compressible middle; raise the budget or lower n_sink / n_recent"
            )
