"""Device-side row helpers shared by the Triton kernels of kvrewrite::evict_to_budget and
kvrewrite::chelsea_compress (not ops themselves: each op's kernels and launcher sit in its own file),
and the state check of their launchers. _slots.py holds the host-side row helpers of the references.

The references read `fill` and `budget` on the host to pick the due rows and their lengths. The Triton
kernels read them on the device: every program loads its row's (b, kv-head) fill, the target and the
threshold, and returns at once when the row is not due (or is an outlier head). Nothing is copied to
the host and no shape depends on data, so a call can be captured in a CUDA graph (torch.compile
mode="reduce-overhead"); the launch sequence is fixed per op call.

Here: _keep_mask (which valid slots a rank rule keeps), _count_valid (the valid slots of a row),
_finish_row (bias -inf past the kept slots, fill), _check_state (the launchers' input check).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch

from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton.language as tl
except ImportError:  # CPU-only installs: the ops run their references; only the triton_* launchers raise
    tl = None


@triton_jit()
def _keep_mask(bb, j, fill, rank0, L, keep_head, keep_tail):
    """(valid, keep) of slots j given their bias: keep = valid rank r < keep_head or r >= L - keep_tail."""
    valid = (bb > float("-inf")) & (j < fill)
    vi = valid.to(tl.int32)
    rank = rank0 + tl.cumsum(vi, axis=0) - vi
    return vi, valid & ((rank < keep_head) | (rank >= L - keep_tail))


@triton_jit()
def _count_valid(BIAS, fill, BLOCK_1D: tl.constexpr):
    L = tl.full([], 0, tl.int32)
    for j0 in range(0, fill, BLOCK_1D):
        j = j0 + tl.arange(0, BLOCK_1D)
        L += tl.sum((tl.load(BIAS + j, mask=j < fill, other=float("-inf")) > float("-inf")).to(tl.int32), axis=0)
    return L


@triton_jit()
def _finish_row(BIAS, FILL_AT, L, C, BLOCK_S: tl.constexpr):
    """bias = -inf on slots [L, C), fill = L."""
    tl.debug_barrier()  # all loads of the row are done before slots past L are cleared
    for j0 in range(L, C, BLOCK_S):
        j = j0 + tl.arange(0, BLOCK_S)
        tl.store(BIAS + j, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=j < C)
    tl.store(FILL_AT, L.to(tl.int64))


def _check_state(name, keys, values, bias, slot_pos, fill, budget):
    B, H, C, D = keys.shape
    expect = {"values": (values, (B, H, C, D), keys.dtype), "bias": (bias, (B, H, C), torch.float32),
              "slot_pos": (slot_pos, (B, H, C), torch.int64), "fill": (fill, (B, H), torch.int64),
              "budget": (budget, (2,), torch.int64)}
    for field, (t, shape, dtype) in expect.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{name}: {field} must be {dtype} {list(shape)} (keys {list(keys.shape)}), "
                             f"got {t.dtype} {list(t.shape)}")
    for field, t in (("keys", keys), ("values", values), ("bias", bias), ("slot_pos", slot_pos), ("fill", fill)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: {field} must be contiguous (the op updates it in place)")
        if t.device != keys.device:
            raise ValueError(f"{name}: {field} is on {t.device}, keys on {keys.device}")
    return B, H, C, D
