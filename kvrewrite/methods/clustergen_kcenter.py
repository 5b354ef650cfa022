"""clustergen-kcenter: what the ClusterGen paper's experiments ran (§4: "we apply the greedy k-center clustering
algorithm once to compress the entire KV caches"): the last l tokens exact plus k centre tokens chosen by greedy
k-center (farthest point) over the others' keys, per layer and KV head. Notes: shared/notes/004-clustergen.md §6.1,
§9.4; the contract: docs/contracts/clustergen.md §1.13.

Decisions (the paper leaves them open):
- B = l + k slots per KV head, l = floor(recent_ratio * B) (default 0.5: the paper's l = k = 1024 at a 2k budget).
- Start point: the oldest candidate token (the first token, an attention sink; deterministic); ties of the farthest
  point go to the lowest slot. Keys as cached (post-RoPE), Euclidean in fp32.
- No counts at attention time: the paper keeps "the KV pairs of the k centres" and says nothing of weighting them.
- Generated tokens are appended; when a row holds B + g slots the same selection runs again over the current centres
  and the tokens that left the window (the paper compresses once, after the prompt; a fixed budget needs a rule for
  decoding, and re-running the same selection adds no new rule). k-center costs O(k (k + g) D) per row, hence the
  longer default interval (64). Measured (H100, 32k, budget 0.2, docs/methods.md): the re-selection takes 6.7 ms per
  layer, 3.4 ms per token amortised over 64, 55% of a plain decode step: this rule is for quality, not for speed.
"""
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvrewrite.methods.base import Method


@dataclass
class ClusterGenKCenterMethod(Method):
    """The last l tokens exact plus k greedy k-center centres of the rest.

    Args:
        budget: B slots per KV head (an int), or a fraction of n + Γ (a float in (0, 1]).
        interval: g, re-select when a row holds B + g slots.
        recent_ratio: l / B, the exact recent window's share of B.
    """

    name: ClassVar[str] = "clustergen-kcenter"
    budget: float | int = 0.2
    interval: int = 64
    recent_ratio: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.recent_ratio, (int, float)) and 0 <= self.recent_ratio < 1):
            raise ValueError(f"{type(self).__name__}.recent_ratio must be a number in [0, 1), got "
                             f"{self.recent_ratio!r}")
        self.recent_ratio = float(self.recent_ratio)

    def compression_call(self, layer):
        return torch.ops.kvrewrite.kcenter_compress.default, {"recent_ratio": self.recent_ratio}
