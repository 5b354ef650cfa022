"""StreamingLLM: attention sinks + a recent window. Based on https://arxiv.org/abs/2309.17453."""
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvrewrite.methods.base import Method


@dataclass
class StreamingLLMMethod(Method):
    """Keep the first `n_sink` tokens and the most recent ones, B slots in all.

    Decision: keys keep their original positions (HF caches store keys after RoPE, and the rewrite
    works on that cache); the paper re-numbers positions inside the rolling cache, which needs
    pre-RoPE keys. Within the model's trained context the difference is small; beyond it, ours
    behaves like "window attention with sinks" at the original positions.

    Args:
        budget: B slots per KV head (an int >= 1), or a fraction of n + Γ (a float in (0, 1]); the n_sink
            sinks count in B, the recent window is the other B - n_sink slots.
        n_sink: initial "attention sink" tokens that are always kept (the paper's 4).
        interval: evict every g appended tokens (the paper evicts every step, g = 1).
    """

    name: ClassVar[str] = "streamingllm"
    budget: float | int = 0.2
    n_sink: int = 4

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.n_sink, int) and self.n_sink >= 0):
            raise ValueError(f"StreamingLLMMethod.n_sink must be an int >= 0, got {self.n_sink!r}")

    def compression_call(self, layer):
        return torch.ops.kvrewrite.evict_to_budget.default, {"n_sink": self.n_sink}

    def check_generation(self, n_prompt, max_new_tokens):
        b = self.target(n_prompt, max_new_tokens)
        if b <= self.n_sink:
            raise ValueError(
                f"streamingllm: {self.describe_target(n_prompt, max_new_tokens)} cannot hold the {self.n_sink} sink "
                f"tokens and a recent window; raise the budget"
            )
