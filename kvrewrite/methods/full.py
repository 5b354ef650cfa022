"""The `full` method: no compression. The rewritten model must reproduce HF's logits."""
from dataclasses import dataclass
from typing import ClassVar

from kvrewrite.methods.base import Method


@dataclass
class FullMethod(Method):
    """Keep every token (budget is fixed at 1). The proof that capture and passes are right."""

    name: ClassVar[str] = "full"

    def __post_init__(self):
        super().__post_init__()
        if self.budget != 1:
            raise ValueError(f"FullMethod keeps every token: budget must be 1, got {self.budget!r}")

    def compression_call(self, layer):
        return None
