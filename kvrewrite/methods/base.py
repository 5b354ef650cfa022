"""Method: a compression policy. It decides what to keep; passes and ops decide how it runs.

A method says
  (1) which op the rewrite inserts at the end of each step to compress a full-attention layer's
      state (`compression_call`);
  (2) what state it owns besides the base state (`state_fields`, e.g. H2O's accumulated scores);
  (3) which op, if any, observes the layer's queries right after its attention to update that state
      (`observe_call`, e.g. attention column sums);
  (4) how many slots a layer needs (`capacity`, static, fixed at apply time);
  (5) the per-generation target and threshold (`targets`), written into each layer's `budget` state
      so that one captured graph serves every prompt length;
  (6) optionally, an op right after the layer's cache append that reads the step's pre-RoPE keys
      (`append_call`), and an op that replaces the layer's attention (`attention_call`), e.g. EMS's
      token table and its attention over it.
docs/methods.md describes the interface and what a new method touches.

Budget convention (all methods): B slots per KV head of every full-attention layer, everything the
method keeps counted (sinks, recent window, observation window, merged slots). `budget` is either
  - an int >= 1: B = budget slots, whatever the prompt length; or
  - a float in (0, 1]: a fraction of n + Γ, B = max(1, round(budget * (n + Γ))), n the longest
    prompt of the batch and Γ = max_new_tokens (Chelsea Alg. 1's convention).
A row is compressed back to B once it holds B + g slots (g = `interval`), so between compressions
it holds at most B + g - 1. Sliding-window layers keep their window and ignore the budget.
"""
import math
import numbers
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from kvrewrite.host import shrink_to_target
from kvrewrite.state import NO_LIMIT, StateField, full_length


def check_budget(owner: str, budget) -> None:
    """ValueError naming the field unless `budget` is a float in (0, 1] (a fraction) or an int >= 1 (slots)."""
    if isinstance(budget, bool):
        raise ValueError(f"{owner}.budget must be a number, not a bool, got {budget!r}")
    ok = isinstance(budget, numbers.Real) and (budget >= 1 if isinstance(budget, numbers.Integral) else 0 < budget <= 1)
    if not ok:
        hint = ""
        if isinstance(budget, numbers.Real) and not isinstance(budget, numbers.Integral) and math.isfinite(budget) \
                and budget > 1 and budget == int(budget):
            hint = f"; for {int(budget)} slots pass the int {int(budget)}"
        raise ValueError(f"{owner}.budget must be a float in (0, 1] (a fraction of n + max_new_tokens) or an int >= 1 "
                         f"(slots per KV head), got {budget!r}{hint}")


@dataclass
class Method:
    """Base class. Subclasses are dataclasses with their paper's defaults as fields."""

    name: ClassVar[str] = ""
    # why the method's attention_call cannot run on a layer that caps its logits (Gemma-2), "" if it can: the rewrite
    # then refuses such a layer with a RewriteError naming it and this reason
    softcap_refusal: ClassVar[str] = ""
    budget: float | int = 1.0  # int: slots per KV head; float in (0, 1]: fraction of n + Γ
    interval: int = 32  # g: compress every g appended tokens (amortises the compression)

    def __post_init__(self):
        # bool is an int subclass: budget=True would pass as 1 slot, n_sink=True as 1 (every subclass's fields)
        for f in fields(self):
            kind = {int: "an int", "int": "an int", float: "a number", "float": "a number"}.get(f.type)
            if kind and f.init and isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{type(self).__name__}.{f.name} must be {kind}, not a bool, "
                                 f"got {getattr(self, f.name)!r}")
        check_budget(type(self).__name__, self.budget)
        if isinstance(self.budget, numbers.Integral):
            self.budget = int(self.budget)
        if not (isinstance(self.interval, int) and self.interval >= 1):
            raise ValueError(f"{type(self).__name__}.interval must be an int >= 1, got {self.interval!r}")

    @property
    def budget_in_slots(self) -> bool:
        """True when `budget` counts slots (an int), False when it is a fraction of n + Γ."""
        return isinstance(self.budget, numbers.Integral)

    # -- the plug-in surface (docs/methods.md) ----------------------------------------------------------
    def compression_call(self, layer):
        """(op overload, kwargs) to insert at the end of the step for a full-attention layer, or None for no
        compression. The op is called with the layer's base state (keys, values, bias, slot_pos, fill, budget),
        then the method state fields its schema names (in `state_fields` order), then the kwargs; it must only touch rows whose
        fill reached the threshold budget[1] and leave them with min(valid slots, budget[0]) slots."""
        raise NotImplementedError

    def state_fields(self, layer) -> dict:
        """{name: kvrewrite.state.StateField} of the state this method owns in a full-attention layer (buffers
        l<i>_<name>), allocated with the base state and reset to each field's reset value at every generation."""
        return {}

    def observe_call(self, layer):
        """(op overload, kwargs) to insert right after a full-attention layer's attention in every graph, or None.
        The op is called with (q, keys, bias, slot_pos, cache_position, *the state fields its schema names, in
        `state_fields` order), scale=, window= (the attention's) and the kwargs, and updates the method's state in
        place."""
        return None

    def select_call(self, layer, max_length: int):
        """(op overload, kwargs) of a selection op that runs before a full-attention layer's attention in the
        decode graphs of a model sized for max_length tokens, or None (the default: attention over every slot).
        The op is called with (q, fill, budget, *the state fields its schema names, in `state_fields` order) and
        the kwargs and returns an int32 index
        [B, Hkv or Hq, S] of slots (-1: none); the layer's attention then becomes kvrewrite::indexed_attention
        over those slots (ClusterKV). Prefill chunks keep the attention over every slot."""
        return None

    def append_call(self, layer):
        """(op overload, kwargs) to insert right after a full-attention layer's cache_append in every graph, or None
        (the default). The op is called with (keys, bias, fill, k_pre, cache_position, token_valid, *the state fields
        its schema names, in `state_fields` order) and the kwargs, after the append (fill has grown by the step's T
        tokens), and updates the method's state in place; k_pre [B, Hkv, T, D] is the step's keys before the rotary
        embedding (kvrewrite.passes.pre_rope; the keys themselves where the layer has none). EMS's token table."""
        return None

    def attention_call(self, layer):
        """(op overload, kwargs) of the op that replaces a full-attention layer's clustered_attention in every graph,
        or None (the default). It is called with (q, keys, values, bias, slot_pos, cache_position, *the state fields
        its schema names, in `state_fields` order), scale=, past_only= (True in decode graphs: every slot is in the
        query's past), softcap= (0.0: none) and the kwargs, and returns the attention output [B, Hq, T, D] in q's
        dtype, as clustered_attention; it may update the method's state in place (EMS's attention over expanded
        slots and its statistics). A method cannot combine it with observe_call or select_call (RewriteError)."""
        return None

    def host_fields(self, layer) -> tuple:
        """Base state fields ("keys", "values") of a layer kept in page-locked host memory that the kernels read in
        place (kvrewrite.offload); default none. ClusterKV's offload="cpu" overrides it."""
        return ()

    def after_compression(self, fill: int, valid: int, target: int, threshold: int) -> tuple[int, int, int]:
        """The host mirror of the compression op on a due row (kvrewrite.host.HostSchedule): (fill, valid,
        threshold) after it. Default: min(valid, target) slots kept, the threshold unchanged; a method whose op
        keeps every slot and is due again later (ClusterKV) overrides it."""
        return shrink_to_target(fill, valid, target, threshold)

    # -- sizes ------------------------------------------------------------------------------------------
    def target(self, n_prompt: int, max_new_tokens: int) -> int:
        """B, the slots per KV head kept after a compression, for one generation."""
        if self.budget_in_slots:
            return self.budget
        return max(1, round(self.budget * (n_prompt + max_new_tokens)))

    def targets(self, layer, n_prompt: int, max_new_tokens: int, prompt_slots: int = 0) -> tuple[int, int]:
        """(target, threshold) of a full-attention layer for one generation; prompt_slots: the slots the prompt
        fills (its length padded to whole prefill chunks; ClusterKV's threshold)."""
        if self.compression_call(layer) is None:
            return NO_LIMIT, NO_LIMIT
        b = self.target(n_prompt, max_new_tokens)
        return b, b + self.interval

    def max_target(self, max_length: int) -> int:
        """The largest B any generation of at most max_length tokens can ask for."""
        return self.budget if self.budget_in_slots else math.ceil(self.budget * max_length)

    def capacity(self, layer, max_length: int, prefill_chunk: int) -> int:
        """Static slots of a full-attention layer: the most a row can hold at any point."""
        full = full_length(max_length, prefill_chunk)
        if self.compression_call(layer) is None:
            return full
        return min(full, self.max_target(max_length) + self.interval - 1 + prefill_chunk)

    def describe_target(self, n_prompt: int, max_new_tokens: int) -> str:
        """'budget 0.2 x (n=30 + max_new_tokens=10) = 8 slots' or 'budget 8 slots', for error messages."""
        b = self.target(n_prompt, max_new_tokens)
        if self.budget_in_slots:
            return f"budget {self.budget} slots" + (f" ({b} for the compressed heads)" if b != self.budget else "")
        return f"budget {self.budget} x (n={n_prompt} + max_new_tokens={max_new_tokens}) = {b} slots"

    def check_generation(self, n_prompt: int, max_new_tokens: int) -> None:
        """Raise ValueError if this generation cannot run under the method's settings."""


def observed_state_fields(layer) -> dict:
    """The state of a method whose statistics op is kvrewrite::accumulate_attention (H2O, SnapKV): `score` [B, Hkv, C]
    fp32, what it accumulates, and the pending queries of the fused op's deferred decode statistics
    (kvrewrite::observed_attention: `pending_q` fp32 [B, Hkv, P, G, D] and `pending_lse` fp32 [B, Hkv, P, G], +inf
    when empty; P = pending_entries(G), 3 for G = 4), which only that op reads. They are P * G * (D + 1) * 4 bytes
    per row and KV head, next to the score's 4 bytes per slot."""
    from kvrewrite.kernels.observed_attention import pending_entries

    G = layer.num_heads // layer.num_kv_heads
    P = pending_entries(G)
    return {
        "score": StateField(("B", "Hkv", "C"), torch.float32, 0.0),
        "pending_q": StateField(("B", "Hkv", P, G, "D"), torch.float32, 0.0),
        "pending_lse": StateField(("B", "Hkv", P, G), torch.float32, float("inf")),
    }


def evicting_state_fields(layer) -> dict:
    """The state of a method whose compression op is kvrewrite::evict_by_score (H2O, SnapKV): observed_state_fields
    plus `order` int32 [B, Hkv, C], each row's slots in temporal order (slot of the r-th oldest minus r), which the
    op keeps instead of packing the kept slots in order, so that a compression moves only the slots it frees room
    for (its module docstring). Reset 0: an empty or fresh row is in slot order, and cache_append's slots at the
    fill need no entry. 4 bytes per slot, next to the score's 4."""
    return {**observed_state_fields(layer), "order": StateField(("B", "Hkv", "C"), torch.int32, 0)}
