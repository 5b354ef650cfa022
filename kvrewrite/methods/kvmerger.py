"""KVMerger: protect a recent window and heavy hitters, merge runs of adjacent similar keys by Gaussian-kernel weights.
Based on https://arxiv.org/abs/2407.08454 (notes: shared/notes/001-kvmerger.md; the lead's contract: issue 16).

State per full-attention layer: H2O's (`score` [B, Hkv, C] fp32, the attention each slot has received, plus the
pending queries of the fused op's deferred decode statistics: methods.base.observed_state_fields) and `degree`
[B, Hkv, C] int32, reset 1: the tokens a slot stands for (a fresh slot 1, a merged slot the sum of its members');
`deficit` [B, Hkv] int64, reset 0: the slots a row holds below min(valid, B) after a compression ("epsilon" and
"anchor" may keep fewer than B), added to the op's due test so that the device is due exactly when the host
schedule (kvrewrite.host.HostSchedule, which assumes min(valid, B)) runs the compressing step.
Observation: kvrewrite::accumulate_attention, mode "all", exactly as H2O (observe_call is H2O's).
Compression: kvrewrite::kvmerger_compress at the end of the step, on rows at B + g slots (its docstring has the
rule): the first n_sink slots, the R = floor(recent_ratio * B) most recent and the H = floor(hh_ratio * B) other
slots with the largest score are kept as they are; the rest are partitioned into sets of adjacent slots (never
across a protected one) and each set becomes one slot: the Gaussian-kernel (on the key distance to the pivot, the
member with the largest score) and degree weighted average of its keys and values.

Decisions where the paper leaves room (the contract's, and mine where it is silent):
- Budget: the paper reaches an *average* ratio by picking the recent/top-k fractions at a fixed epsilon, so a head's
  length varies. Here B bounds every head (the state is static): budget_mode "exact" (default) joins the B - N
  most similar adjacent pairs, i.e. the paper's chain linkage at the per-row epsilon that leaves exactly B slots;
  "epsilon" joins every pair with cos > epsilon and more only if needed to reach B (the paper's adaptive ratio,
  capped at B). epsilon is unused in "exact" chain mode.
- Fractions: recent_ratio 0.34 and hh_ratio 0.24 of B are the paper's 17% + 12% of a 50% budget ("0.17%" read
  as 17%: the notes §4 show only that reading is self-consistent).
- Set identification (Alg. 1): reading "chain" (default; a pair joins on its own cosine, the literal lines 6-8) or
  "anchor" (each set's right-most member is its anchor; "anchor" is always <= B, in both budget modes).
- Too few joinable pairs (small B with many protected slots splitting the runs): all are joined, then the set
  slots with the lowest summed score are evicted until B remain (the method's fallback; the paper never evicts).
- sigma: "fixed" 5.0 (default; the paper's ablation optimum, which it says the computed sigma fluctuates around),
  "distance" (mean distance to the pivot / sqrt(2)), "paper" (the printed Eq. 6, circular: 10 fixed-point
  iterations from sigma; it collapses below 1 since sum g_i <= |S|, an ablation).
- Values: "scale" (default, as issue 16 asks) is the paper's literal |S| multiplier, generalised to re-merges: a slot
  stores d times its mean value; "bias" averages values and adds log(degree) to the slot's logit (Chelsea's
  proportional attention), exact for identical keys. Measured (docs/results-notes.md): "scale" collapses at budget
  0.2 (SmolLM2 NLL +3.89 nats/token, Qwen +2.36) and costs +0.16 at 0.5, "bias" +0.093 and +0.013: use "bias".
- Weights include the degree (w_i ~ g_i d_i): a re-merged slot stands for d_i tokens (the paper merges once, d = 1).
- Re-merging: every g = `interval` tokens (after prefill chunks too), as H2O; the paper compresses once after the
  prompt. Merged keys are post-RoPE averages (nothing is re-rotated); a merged slot keeps the pivot's position.
- Sinks: n_sink = 0 (the paper's heavy hitters catch them); n_sink > 0 protects the first valid slots too, counted
  in B. When n_sink exceeds B's room the op clamps in order: sinks, recent, heavy hitters (P <= B) [my decision:
  a clamp keeps every B valid instead of an error for small fractional budgets].
- GQA: one score per KV head (the G query heads' attention summed), as H2O. Padding slots are dropped at the first
  compression and never kept. Ties (scores, cosines) go to the earlier slot.

What B counts: every slot of a KV head: the sinks, the recent window, the heavy hitters and the merged set slots.
"""
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvrewrite.kernels.kvmerger_compress import BUDGET_MODES, READINGS, SIGMA_MODES, VALUES_MODES
from kvrewrite.methods.base import Method, observed_state_fields
from kvrewrite.state import StateField


@dataclass
class KVMergerMethod(Method):
    """Keep the sinks, a recent window and the heavy hitters; merge the other slots in sets of adjacent similar keys.

    Args:
        budget: B slots per KV head (an int >= 1), or a fraction of n + Γ (a float in (0, 1]); B counts every kept
            slot (sinks, recent, heavy hitters, merged sets).
        interval: g, re-merge when a row holds B + g slots.
        epsilon: the cosine threshold of a join (strict >), used by budget_mode "epsilon" and reading "anchor".
        recent_ratio: fraction of B kept as the recent window (floor).
        hh_ratio: fraction of B kept as heavy hitters by accumulated attention (floor); recent_ratio + hh_ratio <= 1.
        n_sink: first valid slots of each row always kept (counted in B); the paper has none.
        reading: "chain" (a pair joins on its own cosine) or "anchor" (on the cosine to the set's right-most member).
        budget_mode: "exact" (every head holds B) or "epsilon" (every pair above epsilon joins; <= B).
        sigma_mode: "fixed" (sigma), "distance" (from the members' distances) or "paper" (the printed Eq. 6).
        sigma: the Gaussian kernel's width ("fixed"), the start of "paper"'s iteration.
        values: "scale" (the paper's |S| multiplier) or "bias" (mean values + log-degree logit bias).
    """

    name: ClassVar[str] = "kvmerger"
    budget: float | int = 0.2
    epsilon: float = 0.75
    recent_ratio: float = 0.34
    hh_ratio: float = 0.24
    n_sink: int = 0
    reading: str = "chain"
    budget_mode: str = "exact"
    sigma_mode: str = "fixed"
    sigma: float = 5.0
    values: str = "scale"

    def __post_init__(self):
        super().__post_init__()
        cls = type(self).__name__
        for f in ("recent_ratio", "hh_ratio"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and 0 <= v <= 1):
                raise ValueError(f"{cls}.{f} must be a number in [0, 1], got {v!r}")
            setattr(self, f, float(v))
        if self.recent_ratio + self.hh_ratio > 1:
            raise ValueError(f"{cls}: recent_ratio + hh_ratio must be <= 1 (fractions of the budget), got "
                             f"{self.recent_ratio} + {self.hh_ratio}")
        if not (isinstance(self.epsilon, (int, float)) and -1 <= self.epsilon < 1):
            raise ValueError(f"{cls}.epsilon must be a cosine threshold in [-1, 1), got {self.epsilon!r}")
        self.epsilon = float(self.epsilon)
        if not (isinstance(self.sigma, (int, float)) and 0 < self.sigma < float("inf")):
            raise ValueError(f"{cls}.sigma must be a finite number > 0, got {self.sigma!r}")
        self.sigma = float(self.sigma)
        if not (isinstance(self.n_sink, int) and self.n_sink >= 0):
            raise ValueError(f"{cls}.n_sink must be an int >= 0, got {self.n_sink!r}")
        for f, allowed in (("reading", READINGS), ("budget_mode", BUDGET_MODES), ("sigma_mode", SIGMA_MODES),
                           ("values", VALUES_MODES)):
            if getattr(self, f) not in allowed:
                raise ValueError(f"{cls}.{f} must be one of {allowed}, got {getattr(self, f)!r}")

    def state_fields(self, layer):
        return {**observed_state_fields(layer), "degree": StateField(("B", "Hkv", "C"), torch.int32, 1),
                "deficit": StateField(("B", "Hkv"), torch.int64, 0)}

    def observe_call(self, layer):
        return torch.ops.kvrewrite.accumulate_attention.default, {"stats_mode": "all"}

    def compression_call(self, layer):
        return torch.ops.kvrewrite.kvmerger_compress.default, {
            "recent_ratio": self.recent_ratio, "hh_ratio": self.hh_ratio, "n_sink": self.n_sink,
            "epsilon": self.epsilon, "sigma": self.sigma, "sigma_mode": self.sigma_mode, "values_mode": self.values,
            "reading": self.reading, "budget_mode": self.budget_mode,
        }
