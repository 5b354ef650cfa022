"""SnapKV: the observation window picks what to keep. Based on https://arxiv.org/abs/2404.14469.

State: `score` [B, Hkv, C] fp32 per full-attention layer, plus the pending queries of the fused op's deferred
decode statistics and `order`, the slots' temporal order (methods.base.evicting_state_fields). Observation
(kvrewrite::accumulate_attention, mode "window", right after the attention): a prefill chunk SETS score_j to the
attention slot j receives from the chunk's last w queries; a decode step ADDS its query's; both averaged over the
G query heads of the KV head. Compression (kvrewrite::evict_by_score, at the end of the step on rows at B + g slots):
keep the w most recent slots (the observation window itself) and, among the older slots, the B - w with
the largest score after max pooling over `kernel` neighbours; then the kept scores restart at 0.

Decisions where the paper leaves room, or where kvrewrite differs:
- Pooling: max pooling, kernel 7. SnapKV's code (snapkv/monkeypatch/snapkv_utils.py) implements both
  `avgpool` and `maxpool` (its class default is avgpool with kernel 5); kernel 7 with `maxpool` is what
  KVCache-Factory (PyramidKV's run_longbench.py), the common reproduction of SnapKV on LongBench, runs.
  We take max because it keeps the neighbourhood of a single strongly attended token whole (the
  "clustering" the paper pools for: a fact spans several tokens) where the average divides that peak by
  7 and can let a diffuse region outrank it; and max needs no edge convention (avg_pool1d's zero padding
  lowers the first and last 3 scores). The pooling runs over the older slots only, in temporal order,
  as the code pools the prefix without the window.
- Re-compression in decode: the paper compresses the prompt once and lets the generated tokens grow the
  cache; kvrewrite's capacity is static, so rows are compressed again every g decode steps. The rule:
  the score a decode-time compression ranks by is the attention of the decode queries since the last
  compression (the window restarts there), and g = w = 32 by default, so it is exactly the paper's
  observation window, the w most recent queries, applied again. (If the prompt's last chunk did not
  compress, its window's scores are still in the sum: the last w prompt queries plus the decode ones.)
- Chunked prefill: each chunk's last w queries are the window of the compression after that chunk (the
  paper prefills the whole prompt at once; with prefill_chunk >= the prompt, kvrewrite does too). A
  chunk shorter than w observes with all its queries.
- GQA: scores averaged over the G query heads of a KV head, one selection per KV head (the paper's code
  repeats K/V per query head and selects per query head; one set per KV head keeps the cache GQA-sized).
- The code's observation-window attention also counts the window's causal attention to itself; only the
  older slots are ranked, so it makes no difference.
- Ties in the pooled score go to the earlier slot (torch.topk leaves them unspecified).

What B counts: every slot of a KV head, the w-slot window included: B - w selected + w recent. B must
exceed w (check_generation); budgets of a few hundred slots or more are the paper's regime.
"""
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvrewrite.methods.base import Method, evicting_state_fields


@dataclass
class SnapKVMethod(Method):
    """Keep the observation window and the older tokens it attends to most, B slots in all.

    Args:
        budget: B slots per KV head (an int >= 1), or a fraction of n + Γ (a float in (0, 1]); B counts the
            w window slots and the B - w selected ones together, and must exceed w.
        window: w, the observation window in queries, and the recent slots always kept (paper: 32).
        kernel: the max-pooling kernel over the scores of the older slots, odd (paper: 7; 1 = no pooling).
        interval: g, re-compress when a row holds B + g slots (default 32 = w: see the module docstring).
    """

    name: ClassVar[str] = "snapkv"
    budget: float | int = 0.2
    window: int = 32
    kernel: int = 7

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"SnapKVMethod.window must be an int >= 1, got {self.window!r}")
        if not (isinstance(self.kernel, int) and self.kernel >= 1 and self.kernel % 2 == 1):
            raise ValueError(f"SnapKVMethod.kernel must be an odd int >= 1 (1: no pooling), got {self.kernel!r}")

    def state_fields(self, layer):
        return evicting_state_fields(layer)

    def observe_call(self, layer):
        return torch.ops.kvrewrite.accumulate_attention.default, {"stats_mode": "window", "last": self.window}

    def compression_call(self, layer):
        return torch.ops.kvrewrite.evict_by_score.default, {
            "n_recent": self.window, "recent_ratio": 0.0, "pool": self.kernel, "reset_score": True,
        }

    def check_generation(self, n_prompt, max_new_tokens):
        b = self.target(n_prompt, max_new_tokens)
        if b <= self.window:
            raise ValueError(
                f"snapkv: {self.describe_target(n_prompt, max_new_tokens)} cannot hold the {self.window}-slot "
                f"observation window plus selected tokens; raise the budget or lower window"
            )
