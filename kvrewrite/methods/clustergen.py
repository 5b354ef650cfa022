"""ClusterGen (= SubGen, arXiv 2402.06082), Algorithm 1: keys streamed into radius-delta clusters with t uniform key
samples each (the softmax denominator), values into an l2-weighted reservoir of s samples (the numerator); output
z / tau. Notes: shared/notes/004-clustergen.md; the contract with every decision: docs/contracts/clustergen.md.

Per row (b, KV head) of a full-attention layer, the cache holds `n_sink` first tokens and the last `window` tokens
exactly; every older token has been folded, in position order, into the sketch (kvrewrite::clustergen_fold, `interval`
tokens at a time, and the whole prompt but sinks and window at the end of prefill):
  - leader clustering (Alg. 1 lines 11-20): a key joins the nearest representative within delta, else opens a
    cluster with itself as representative (never moved); each cluster keeps t uniform samples of its keys and its
    count n_i; the denominator is tau = sum_i (n_i / t) sum_{k in S_i} e^{z(k)};
  - the value reservoir (lines 23-27): s slots, each an independent sample of a folded token with probability
    ||v||^2 / mu (mu = the sum of ||v||^2 over folded tokens); the numerator is z = sum_j mu / (s ||v_j||^2) e^{z(k_j)} v_j.
The attention (kvrewrite::sketch_attention) computes (exact numerator + z) / (exact denominator + tau) in one pass over
the slots: a key sample is a slot in the denominator only (weight log(n_i / t)), a value sample one in the numerator
only (weight log(mu / (s ||v||^2))), an exact token one in both (the `role` state).

Decisions (docs/contracts/clustergen.md §1 has the reasons):
- B counts slots per KV head: n_sink + window + M clusters x t key samples + s value samples; the sketch gets
  S = B - n_sink - window slots, s = round(value_share * S), M = (S - s) // t (the rest unused). Sized on the device
  from the generation's B.
- Keys as the attention uses them (post-RoPE, the logit scale * q.k); Euclidean distances in fp32.
- delta per (layer, row, KV head), calibrated once at the row's first fold: greedy k-center picks
  round(cluster_target * M) centres among the folded keys; delta = their covering radius (x 1.001), which opens about
  that many clusters on real keys (twice the radius provably opens at most that many, but opened one per head on
  SmolLM2), leaving the rest for decoding.
- Overflow (all M clusters open, a key farther than delta from every representative): force-assigned to the nearest
  (counted per row in the `n_forced` state).
- Reservoirs drawn once per fold with the law of Algorithm 1's per-token coin flips (one uniform per slot), from a
  counter-based hash keyed by (seed, layer, KV head, tokens folded so far, slot): reproducible, no host state, and a
  left-padded row draws what the same prompt alone draws.
- Output z / tau as the theorem's estimator (not self-normalised); numerator and denominator each get their own shift.
- Refused on layers with a logit soft cap (Gemma-2): Algorithm 1 estimates sums of e^{q.k}, not of a capped logit.
"""
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvrewrite.kernels.clustergen_fold import sketch_sizes as fold_sizes
from kvrewrite.methods.base import Method
from kvrewrite.state import StateField


@dataclass(frozen=True)
class ClusterShape:
    """The shape [B, Hkv, M_max, D] of the representatives: M_max = ceil((1 - value_share) C / t) + 1 bounds the
    clusters of any generation (a value, so that two equal methods have equal state fields)."""

    value_share: float
    t: int
    with_d: bool = True

    def __call__(self, B: int, Hkv: int, C: int, D: int) -> tuple:
        m = math.ceil((1.0 - self.value_share) * C / self.t) + 1
        return (B, Hkv, m, D) if self.with_d else (B, Hkv, m)


def sketch_sizes(b: int, n_sink: int, window: int, t: int, value_share: float) -> tuple[int, int, int]:
    """(S, s, M) of a generation with B = b: the sketch's slots, its value samples, its clusters (contract §1.5), as
    the fold op computes them on the device (kvrewrite/kernels/clustergen_fold.py, the one formula)."""
    S, s, M, _ = fold_sizes(torch.tensor([b, 0]), n_sink, window, t, value_share, 0.5)
    return int(S), int(s), int(M)


@dataclass
class ClusterGenMethod(Method):
    """Sinks and a recent window exact; older tokens in leader clusters (denominator) and an l2 value reservoir
    (numerator).

    Args:
        budget: B slots per KV head (an int), or a fraction of n + Γ (a float in (0, 1]).
        interval: g, tokens that leave the window are folded into the sketch g at a time.
        n_sink: first tokens kept exactly.
        window: last tokens kept exactly.
        t: key samples per cluster.
        value_share: the fraction of the sketch's slots that hold value samples (s).
        cluster_target: the fraction of the M clusters delta is calibrated to open on the prompt.
        seed: the reservoirs' random stream.
    """

    name: ClassVar[str] = "clustergen"
    softcap_refusal: ClassVar[str] = ("ClusterGen estimates sums of exp(q.k) (Algorithm 1), not of a capped logit; "
                                      "use another method for this model")
    budget: float | int = 0.2
    n_sink: int = 4
    window: int = 32
    t: int = 8
    value_share: float = 0.5
    cluster_target: float = 0.5
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        cls = type(self).__name__
        for field, low in (("n_sink", 0), ("window", 0), ("t", 1), ("seed", 0)):
            v = getattr(self, field)
            if not (isinstance(v, int) and v >= low):
                raise ValueError(f"{cls}.{field} must be an int >= {low}, got {v!r}")
        if self.seed >= 2**32:
            raise ValueError(f"{cls}.seed must be < 2**32 (the hash is 32-bit), got {self.seed!r}")
        for field in ("value_share", "cluster_target"):
            v = getattr(self, field)
            if not (isinstance(v, (int, float)) and 0 < v < 1):
                raise ValueError(f"{cls}.{field} must be a number in (0, 1), got {v!r}")
            setattr(self, field, float(v))

    # -- state -------------------------------------------------------------------------------------------
    def state_fields(self, layer):
        return {
            "role": StateField(("B", "Hkv", "C"), torch.int8, 0),
            "rep": StateField(ClusterShape(self.value_share, self.t), None, 0.0),
            "count": StateField(ClusterShape(self.value_share, self.t, with_d=False), torch.int32, 0),
            "n_clusters": StateField(("B", "Hkv"), torch.int64, 0),
            "mu": StateField(("B", "Hkv"), torch.float32, 0.0),
            "delta": StateField(("B", "Hkv"), torch.float32, -1.0),
            "n_seen": StateField(("B", "Hkv"), torch.int64, 0),
            "n_forced": StateField(("B", "Hkv"), torch.int64, 0),
        }

    # -- the ops -----------------------------------------------------------------------------------------
    def attention_call(self, layer):
        return torch.ops.kvrewrite.sketch_attention.default, {}

    def compression_call(self, layer):
        return torch.ops.kvrewrite.clustergen_fold.default, {
            "n_sink": self.n_sink, "window": self.window, "t": self.t, "value_share": self.value_share,
            "cluster_target": self.cluster_target, "seed": self.seed, "layer": layer.index,
        }

    # -- sizes and schedule ------------------------------------------------------------------------------
    @property
    def exact(self) -> int:
        """Exact slots a row keeps after a fold: the sinks and the window."""
        return self.n_sink + self.window

    def targets(self, layer, n_prompt: int, max_new_tokens: int, prompt_slots: int = 0):
        """(B, n_sink + window + g): the op reads B to size the sketch; a row folds once its exact part reaches
        the threshold."""
        return self.target(n_prompt, max_new_tokens), self.exact + self.interval

    def after_compression(self, fill: int, valid: int, target: int, threshold: int):
        """A fold keeps the sinks and the window exact (the sketch lives past the exact slots)."""
        kept = min(valid, self.exact)
        return kept, kept, threshold

    def capacity(self, layer, max_length: int, prefill_chunk: int) -> int:
        """Exact part (sinks + window + g - 1 + a chunk) plus the largest sketch: never clamped to the full length,
        since the sketch region must not meet the exact slots."""
        return self.max_target(max_length) + self.interval - 1 + prefill_chunk

    def check_generation(self, n_prompt: int, max_new_tokens: int) -> None:
        b = self.target(n_prompt, max_new_tokens)
        S, s, M = sketch_sizes(b, self.n_sink, self.window, self.t, self.value_share)
        if M < 1 or s < 1:
            raise ValueError(f"clustergen: {self.describe_target(n_prompt, max_new_tokens)} leaves a sketch of {S} "
                             f"slots after n_sink={self.n_sink} and window={self.window}: {s} value samples "
                             f"(value_share={self.value_share}) and {M} clusters of t={self.t} key samples; it needs "
                             "at least one of each: raise the budget, or lower n_sink, window or t")
