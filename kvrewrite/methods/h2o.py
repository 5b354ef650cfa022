"""H2O: heavy hitters by accumulated attention + a recent window. Based on https://arxiv.org/abs/2306.14048.

State: `score` [B, Hkv, C] fp32 per full-attention layer, the attention each slot has received, plus the
pending queries of the fused op's deferred decode statistics and `order`, the slots' temporal order
(methods.base.evicting_state_fields).
Observation (kvrewrite::accumulate_attention, mode "all", right after the attention of every prefill
chunk and decode step): score_j += sum over the step's queries and the G query heads of the KV head of
their softmax probability on slot j. Compression (kvrewrite::evict_by_score, at the end of the step
on rows at B + g slots): keep the R = floor(recent_ratio * B) most recent slots and the B - R older
slots with the largest score; scores move with their slots and keep accumulating (never reset).

Decisions where the paper leaves room, or where kvrewrite differs:
- Budget split: the paper's heavy and recent budgets are half and half of the cache ("20% = 10% heavy
  hitters + 10% recent"), its code takes each as int(ratio * length); here R = floor(recent_ratio * B)
  and the heavy hitters get the other B - R (the odd slot when B is odd).
- The score counts every query since the token arrived, prompt included: the prompt's causal attention
  (each prompt token's score sums the attention of the later prompt tokens), then one row per decode
  step. Slots that arrived later have had fewer queries: that is H2O's accumulated score as the paper
  and its code define it (no normalisation by age); the recent window protects the newest slots.
- GQA: the G query heads of a KV head share its slots, so their attention is summed (one score per KV
  head; the paper's models are MHA, G = 1).
- Eviction runs every g = `interval` tokens back to B (the paper evicts one token per decode step: set
  interval=1 for that), and during a chunked prefill after each chunk (the paper prefills exactly; with
  prefill_chunk >= the prompt, kvrewrite does too). Between compressions a row holds up to B + g - 1.
- Padding slots get no attention and are dropped at the first compression.
- Ties in the score go to the earlier slot.

What B counts: every slot of a KV head, the R recent ones and the B - R heavy hitters.
"""
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvrewrite.methods.base import Method, evicting_state_fields


@dataclass
class H2OMethod(Method):
    """Keep the most recent tokens and the heavy hitters (largest accumulated attention), B slots in all.

    Args:
        budget: B slots per KV head (an int >= 1), or a fraction of n + Γ (a float in (0, 1]); B counts the
            recent window and the heavy hitters together.
        recent_ratio: the fraction of B kept as the recent window (floor(recent_ratio * B) slots); the paper's
            half and half is 0.5.
        interval: g, evict when a row holds B + g slots (the paper evicts every step: 1).
    """

    name: ClassVar[str] = "h2o"
    budget: float | int = 0.2
    recent_ratio: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.recent_ratio, (int, float)) and 0 <= self.recent_ratio <= 1):
            raise ValueError(f"H2OMethod.recent_ratio must be a number in [0, 1], got {self.recent_ratio!r}")
        self.recent_ratio = float(self.recent_ratio)

    def state_fields(self, layer):
        return evicting_state_fields(layer)

    def observe_call(self, layer):
        return torch.ops.kvrewrite.accumulate_attention.default, {"stats_mode": "all"}

    def compression_call(self, layer):
        return torch.ops.kvrewrite.evict_by_score.default, {
            "n_recent": 0, "recent_ratio": self.recent_ratio, "pool": 1, "reset_score": False,
        }
