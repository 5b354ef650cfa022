"""Rewrite HF's eager attention (matmul -> scale -> +mask -> softmax -> matmul) into one SDPA node.

Placeholder until the eager pattern lands: matches nothing yet.
"""
from torch import fx

from kvrewrite.context import RewriteContext


def normalize_eager_attention(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    return gm
