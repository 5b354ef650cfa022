"""EMS: evict-then-merge with a Global-Local score, shared class centres and a per-token lookup table.
Based on the EMS paper (notes: shared/notes/003-ems.md; the contract: issue 17, docs/contracts/ems.md).

Every physical entry of a KV head (B of them after a compression: the L_win most recent tokens and N_imp = B - L_win
class centres) can stand for several runtime tokens ("slots", at most gamma * B): a slot j reads the entry lut[j]
with its own key norm (key_scale[j] * keys[lut[j]]: keys merged as unit directions, every token keeps its norm) and
the entry's merged value. The attention (kvrewrite::ems_attention) computes q . key once per entry and scales it per
slot, one softmax term per slot; it also folds the attention each slot received into the Global-Local statistics
(s_glo: every query so far; s_loc_past / s_loc_cur: the paper's two local-window buffers).
Compression (kvrewrite::ems_compress, on rows at B + g entries): Global-Local score g = max(alpha * s_glo, s_loc)
(alpha aligns the means), average-pooled over 7 tokens; the window kept; the top N_imp entries by their head token's
pooled score are centres; the next (gamma - 1) * B are to-be-merged: each merges, with all its slots, into its most
redundant centre (R = cos(k, k') cos(v, v'), negative cosines clamped to 0, on pre-RoPE keys by default) when
R >= tau, else into the zero class (evicted); the rest are evicted.

Decisions (the contract's table, docs/contracts/ems.md §1, with the reasons; the ones a user meets first):
- B counts entries per KV head (window + centres, a merged centre once), the paper's N_budget; the slots cost
  scalars (lut, key_scale, token position, three scores: 28 bytes each) and pos="without" stores the entries'
  pre-RoPE keys too (+50% of the entries' K/V memory, never read by the attention). rw.cache_bytes() counts all.
- pos "without" (default: the method section's raw similarity and the paper's ablations) or "with" (redundancy on
  the stored post-RoPE keys). Both attend the same post-RoPE keys: rotating every slot at its own position would
  cost more than the dense cache the method replaces.
- Merge weights: each group's summed raw Global-Local score; keys as unit directions, renormalised; values as a
  weighted mean.
- Compression every g = `interval` tokens (and after prefill chunks) when a row holds B + g entries; interval=1 is
  the paper's per-step decode exactly (with scores frozen over g steps, g add/demote steps keep the same top N_imp).
- tau >= 1 evicts every to-be-merged entry (the paper's "tau = 1: all evicted"), tau = 0 merges all of them.
- GQA: one decision per KV head, the G query heads' attention summed.
- The local window of a prefill chunk is its last L_win queries; so prefill_chunk >= window is required.
"""
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvrewrite.methods.base import Method
from kvrewrite.state import StateField

POS_MODES = ("without", "with")


@dataclass(frozen=True)
class SlotShape:
    """The shape [B, Hkv, R] of a per-slot state field: R = gamma * C runtime slots, bounded by the layer's full
    length L (a value, so that two methods with the same gamma have equal state fields)."""

    gamma: float

    def __call__(self, B: int, Hkv: int, C: int, D: int, L: int) -> tuple:
        return B, Hkv, L if math.isinf(self.gamma) else min(L, math.ceil(self.gamma * C))


@dataclass
class EMSMethod(Method):
    """Keep a local window and class centres; merge the next tokens into their most redundant centre or evict them.

    Args:
        budget: B entries per KV head (an int), or a fraction of n + Γ (a float in (0, 1]); B counts the window and
            the centres (N_imp = B - window).
        interval: g, compress when a row holds B + g entries (1: the paper's per-step schedule).
        window: L_win, the most recent tokens kept exactly and the local score's queries.
        kernel: the average pooling of the Global-Local score (odd; 1: none).
        gamma: slots per entry at most (gamma * B runtime tokens; inf: no level-1 eviction).
        tau: the redundancy threshold of a merge (>= 1: evict every to-be-merged entry).
        pos: "without" (redundancy on pre-RoPE keys) or "with" (on the stored post-RoPE keys).
    """

    name: ClassVar[str] = "ems"
    budget: float | int = 0.2
    window: int = 32
    kernel: int = 7
    gamma: float = 4.0
    tau: float = 0.6
    pos: str = "without"

    def __post_init__(self):
        super().__post_init__()
        cls = type(self).__name__
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"{cls}.window must be an int >= 1, got {self.window!r}")
        if not (isinstance(self.kernel, int) and self.kernel >= 1 and self.kernel % 2 == 1):
            raise ValueError(f"{cls}.kernel must be an odd int >= 1, got {self.kernel!r}")
        if not (isinstance(self.gamma, (int, float)) and self.gamma >= 1):
            raise ValueError(f"{cls}.gamma must be a number >= 1 (math.inf allowed), got {self.gamma!r}")
        self.gamma = float(self.gamma)
        if not (isinstance(self.tau, (int, float)) and 0 <= self.tau <= 1):
            raise ValueError(f"{cls}.tau must be a number in [0, 1], got {self.tau!r}")
        self.tau = float(self.tau)
        if self.pos not in POS_MODES:
            raise ValueError(f"{cls}.pos must be one of {POS_MODES}, got {self.pos!r}")

    # -- state -------------------------------------------------------------------------------------------
    def state_fields(self, layer):
        per_slot = SlotShape(self.gamma)
        raw = ("B", "Hkv", "C", "D") if self.pos == "without" else ("B", "Hkv", 0, "D")
        return {
            "entry_start": StateField(("B", "Hkv", "C"), torch.int32, 0),
            "raw_keys": StateField(raw, None, 0.0),
            "lut": StateField(per_slot, torch.int32, -1),
            "key_scale": StateField(per_slot, torch.float32, 1.0),
            "token_pos": StateField(per_slot, torch.int32, 0),
            "slot_order": StateField(per_slot, torch.int32, -1),
            "s_glo": StateField(per_slot, torch.float32, 0.0),
            "s_loc_past": StateField(per_slot, torch.float32, 0.0),
            "s_loc_cur": StateField(per_slot, torch.float32, 0.0),
            "slot_fill": StateField(("B", "Hkv"), torch.int64, 0),
            "win_count": StateField(("B", "Hkv"), torch.int64, 0),
        }

    # -- the ops -----------------------------------------------------------------------------------------
    def append_call(self, layer):
        return torch.ops.kvrewrite.ems_append.default, {}

    def attention_call(self, layer):
        return torch.ops.kvrewrite.ems_attention.default, {"l_win": self.window}

    def compression_call(self, layer):
        return torch.ops.kvrewrite.ems_compress.default, {"l_win": self.window, "pool": self.kernel,
                                                           "gamma": self.gamma, "tau": self.tau}

    # -- sizes -------------------------------------------------------------------------------------------
    def capacity(self, layer, max_length: int, prefill_chunk: int) -> int:
        if prefill_chunk < self.window:
            raise ValueError(f"ems: prefill_chunk={prefill_chunk} is shorter than the local window ({self.window} "
                             "queries): a chunk must hold the window's queries; raise prefill_chunk or lower window")
        return super().capacity(layer, max_length, prefill_chunk)

    def check_generation(self, n_prompt: int, max_new_tokens: int) -> None:
        b = self.target(n_prompt, max_new_tokens)
        if b <= self.window:
            raise ValueError(f"ems: {self.describe_target(n_prompt, max_new_tokens)} cannot hold the {self.window}-"
                             "token local window plus a class centre; raise the budget or lower window")
