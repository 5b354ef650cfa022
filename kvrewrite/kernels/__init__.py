"""kvrewrite custom ops (namespace ``kvrewrite::``).

One op per file: schema, fake, plain-PyTorch reference (the CPU path and the ground truth of the
tests). Each op is a ``torch.library.custom_op`` whose CPU/default kernel is the reference; a Triton
kernel slots in per device with ``op.register_kernel("cuda")`` in the same file.
Importing this package registers every op.
"""
from kvrewrite.kernels import (  # noqa: F401
    attention_column_stats,
    cache_append,
    chelsea_compress,
    clustered_attention,
    evict_to_budget,
)
