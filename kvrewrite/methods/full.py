"""The `full` method: no compression. The rewritten model must reproduce HF's logits."""
from dataclasses import dataclass
from typing import ClassVar

from kvrewrite.methods.base import Method


@dataclass
class FullMethod(Method):
    """Keep every token. The proof that capture and passes are right.

    Args:
        budget: fixed at 1.0 (the float: every token); an int would count slots, so 1 (one slot) is refused.
    """

    name: ClassVar[str] = "full"

    def __post_init__(self):
        super().__post_init__()
        if self.budget != 1 or self.budget_in_slots:
            raise ValueError(f"FullMethod keeps every token: budget must be 1.0 (the default), got {self.budget!r}"
                             + (" (an int counts slots per KV head)" if self.budget_in_slots else ""))

    def compression_call(self, layer):
        return None
