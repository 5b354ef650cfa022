"""Tensor form of kmeans_cluster.mix32 (the project's 32-bit mixer) and ClusterGen's counter-based uniforms.

uint32 arithmetic in int64 tensors, masked to 32 bits. A 32 x 32-bit product does not fit in int64, so it is
split in 16-bit halves (x = hi * 2^16 + lo): x * c mod 2^32 = (lo * c + ((hi * c) mod 2^16) * 2^16) mod 2^32,
every partial < 2^49 (no signed overflow). Bit for bit the Python mix32 (tested on many ints).

mix32_triton is the Triton twin (uint32 tensors: products wrap mod 2^32 natively), used by the fold's kernels
(kvrewrite/kernels/_clustergen_fold_kernels.py); tested bit-equal to mix32 (tests/kernels/
test_clustergen_fold_triton.py through the interpreter, test_clustergen_fold_gpu.py compiled).
"""
from __future__ import annotations  # the Triton helper's annotations stay strings without Triton

import torch

from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels.kmeans_cluster import MASK32, mix32

try:
    import triton.language as tl
except ImportError:  # CPU-only installs: mix32_triton stays plain Python (never called there)
    tl = None

_M1, _M2 = 0x7FEB352D, 0x846CA68B


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """mix32 of every element of an int64 tensor (its low 32 bits, as the Python mix32 masks first)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mulmod32(x, _M1)
    x = x ^ (x >> 15)
    x = _mulmod32(x, _M2)
    return x ^ (x >> 16)


def clustergen_hash24(seed: int, layer: int, kv_head: torch.Tensor, n_seen: torch.Tensor, j: torch.Tensor):
    """h >> 8 (int64, in [0, 2^24)) with h = mix32(mix32(mix32(mix32(mix32(seed) ^ layer) ^ kv_head) ^ n_seen) ^ j),
    the contract's §1.9 key (u = result * 2^-24); kv_head, n_seen and j broadcast together."""
    base = mix32(mix32(seed) ^ (layer & MASK32))
    h = mix32_tensor(mix32_tensor(mix32_tensor(kv_head ^ base) ^ n_seen) ^ j)
    return h >> 8


@triton_jit()
def mix32_triton(x):
    """mix32 of every element of a tl.uint32 tensor (Triton; the constants as uint32 so products wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)
