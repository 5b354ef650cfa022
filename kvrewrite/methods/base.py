"""Method: a compression policy. It decides what to keep; passes and ops decide how it runs.

A method says (1) which op the rewrite inserts after each full-attention layer's attention
(`compression_call`), (2) how many slots a layer needs (`capacity`, static, fixed at apply time)
and (3) the per-generation target and threshold (`targets`), written into each layer's `budget`
state so that one captured graph serves every prompt length.

Budget convention (all methods, after Chelsea Alg. 1): B = round(budget * (n + Γ)) slots per KV
head, n the longest prompt of the batch and Γ = max_new_tokens; a row is compressed back to B once
it holds B + g slots, so between compressions it holds at most B + g - 1.
"""
import math
from dataclasses import dataclass, fields
from typing import ClassVar

from kvrewrite.state import NO_LIMIT


@dataclass
class Method:
    """Base class. Subclasses are dataclasses with their paper's defaults as fields."""

    name: ClassVar[str] = ""
    budget: float = 1.0
    interval: int = 32  # g: compress every g appended tokens (amortises the compression)

    def __post_init__(self):
        # bool is an int subclass: budget=True would pass as 1.0, n_sink=True as 1 (every subclass's fields)
        for f in fields(self):
            kind = {int: "an int", "int": "an int", float: "a number", "float": "a number"}.get(f.type)
            if kind and f.init and isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{type(self).__name__}.{f.name} must be {kind}, not a bool, "
                                 f"got {getattr(self, f.name)!r}")
        if not (isinstance(self.budget, (int, float)) and 0 < self.budget <= 1):
            raise ValueError(f"{type(self).__name__}.budget must be in (0, 1], got {self.budget!r}")
        if not (isinstance(self.interval, int) and self.interval >= 1):
            raise ValueError(f"{type(self).__name__}.interval must be an int >= 1, got {self.interval!r}")

    def compression_call(self, layer):
        """(op overload, kwargs) to insert after the layer's attention, or None for no compression."""
        raise NotImplementedError

    def target(self, n_prompt: int, max_new_tokens: int) -> int:
        return max(1, round(self.budget * (n_prompt + max_new_tokens)))

    def targets(self, layer, n_prompt: int, max_new_tokens: int) -> tuple[int, int]:
        """(target, threshold) of a full-attention layer for one generation."""
        if self.compression_call(layer) is None:
            return NO_LIMIT, NO_LIMIT
        b = self.target(n_prompt, max_new_tokens)
        return b, b + self.interval

    def capacity(self, layer, max_length: int, prefill_chunk: int) -> int:
        """Static slots of a full-attention layer: the most a row can hold at any point."""
        full = max_length + prefill_chunk - 1  # the prompt is left-padded to a whole number of chunks
        if self.compression_call(layer) is None:
            return full
        return min(full, math.ceil(self.budget * max_length) + self.interval - 1 + prefill_chunk)

    def check_generation(self, n_prompt: int, max_new_tokens: int) -> None:
        """Raise ValueError if this generation cannot run under the method's settings."""
