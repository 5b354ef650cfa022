"""kvrewrite::evict_to_budget — keep sink slots and the most recent slots, drop the rest.

The eviction used by StreamingLLM (https://arxiv.org/abs/2309.17453) and, with n_sink = 0, by
sliding-window layers (keeping the last window - 1 tokens is exact for them, since the attention
op masks by position as well).

State (mutated): keys, values [B, Hkv, C, D]; bias, slot_pos [B, Hkv, C]; fill [B, Hkv].
budget: [2] int64 (target, threshold). A row whose fill reached the threshold keeps its first
n_sink valid slots and its last target - n_sink valid slots, packed in order; padding slots go first.
Rows below the threshold are untouched.

Backends: the reference below reads fill and budget on the host (CPU, and CUDA without Triton); on
CUDA the Triton kernels do the same on the device, with no host sync (CUDA graphs can capture them;
see _slot_kernels.py), bit-for-bit the same result.

Triton kernels (2 launches): the row's valid slots are counted (bias > -inf inside the fill); valid
ranks < min(n_sink, T) and >= L - (T - n_sink) are kept (all if L <= T). Step 1, grid rows x 2*D/16:
each program moves 16 columns of keys or of values; step 2, grid rows: bias and slot_pos, then the
row is finished (bias -inf past the kept slots, fill). The moves are in place and do not race:
survivors only move left (destination slot <= source slot), a program owns its columns (or its whole
row) and walks its tiles in increasing slot order with a CTA barrier between a tile's loads and its
stores.

This file, top to bottom: docstring, reference, Triton kernels, launcher (triton_evict_to_budget),
op registration.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch

from kvrewrite.kernels._slot_kernels import _check_state, _count_valid, _finish_row, _keep_mask
from kvrewrite.kernels._slots import load_row, rows_due, store_row
from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the ops run their references; only the triton_* launchers raise
    triton = tl = None


def reference_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink):
    target = int(budget[0])
    for b, h in rows_due(fill, budget):
        K, V, row_bias, pos = load_row(keys, values, bias, slot_pos, fill, b, h)
        L = K.shape[0]
        if L > target:
            keep = torch.cat([torch.arange(min(n_sink, target)), torch.arange(L - (target - min(n_sink, target)), L)])
            K, V, row_bias, pos = K[keep], V[keep], row_bias[keep], pos[keep]
        store_row(keys, values, bias, slot_pos, fill, b, h, K, V, row_bias, pos)


# -- Triton kernels ----------------------------------------------------------------------------------
COLUMNS = 16  # head-dim columns per program of evict's column-parallel step


@triton_jit()
def _evict_rule(BIAS, FILL, BUDGET, row, C, n_sink, BLOCK_1D: tl.constexpr):
    """(due, fill, L, keep_head, keep_tail) of a row: keep valid ranks < min(n_sink, T) and the last
    T - that many, or all of them when L <= T."""
    fill = tl.load(FILL + row)
    due = fill >= tl.load(BUDGET + 1)
    T = tl.load(BUDGET).to(tl.int32)
    fill32 = tl.where(due, fill, 0).to(tl.int32)
    L = _count_valid(BIAS + row * C, fill32, BLOCK_1D)
    sink = tl.minimum(T, n_sink)
    return due, fill32, L, tl.where(L > T, sink, L), tl.where(L > T, T - sink, 0)


@triton_jit(do_not_specialize=["C", "n_sink"])
def _evict_columns_kernel(K, V, BIAS, FILL, BUDGET, C, D, n_sink, DS: tl.constexpr, NSLICE: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_1D: tl.constexpr):
    """Step 1 (grid: rows x 2 * NSLICE): program (row, p) moves the kept slots' columns
    [DS * (p % NSLICE), +DS) of keys (p < NSLICE) or values, in slot order, in place. Programs own
    disjoint columns, so they never race; bias is only read (step 2 rewrites it)."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    due, fill, L, head, tail = _evict_rule(BIAS, FILL, BUDGET, row, C, n_sink, BLOCK_1D)
    if due:
        X = tl.where(p < NSLICE, 0, 1)
        offs_d = (p % NSLICE) * DS + tl.arange(0, DS)
        dmask = offs_d < D
        Br = BIAS + row * C
        rank0 = tl.full([], 0, tl.int32)
        out = tl.full([], 0, tl.int32)
        for t0 in range(0, fill, BLOCK_S):
            t = t0 + tl.arange(0, BLOCK_S)
            vi, keep = _keep_mask(tl.load(Br + t, mask=t < fill, other=float("-inf")), t, fill, rank0, L, head, tail)
            ki = keep.to(tl.int32)
            dest = out + tl.cumsum(ki, axis=0) - ki
            m2 = (keep & (dest != t))[:, None] & dmask[None, :]
            if X == 0:
                xx = tl.load(K + row * C * D + t[:, None] * D + offs_d[None, :], mask=m2)
                tl.debug_barrier()
                tl.store(K + row * C * D + dest[:, None] * D + offs_d[None, :], xx, mask=m2)
            else:
                xx = tl.load(V + row * C * D + t[:, None] * D + offs_d[None, :], mask=m2)
                tl.debug_barrier()
                tl.store(V + row * C * D + dest[:, None] * D + offs_d[None, :], xx, mask=m2)
            rank0 += tl.sum(vi, axis=0)
            out += tl.sum(ki, axis=0)


@triton_jit(do_not_specialize=["C", "n_sink"])
def _evict_meta_kernel(BIAS, POS, FILL, BUDGET, C, n_sink, BLOCK_1D: tl.constexpr):
    """Step 2 (grid: rows): the same moves for bias and slot_pos, then bias = -inf past the kept slots and
    fill = their count."""
    row = tl.program_id(0).to(tl.int64)
    due, fill, L, head, tail = _evict_rule(BIAS, FILL, BUDGET, row, C, n_sink, BLOCK_1D)
    if due:
        Br = BIAS + row * C
        Pr = POS + row * C
        rank0 = tl.full([], 0, tl.int32)
        out = tl.full([], 0, tl.int32)
        for t0 in range(0, fill, BLOCK_1D):
            t = t0 + tl.arange(0, BLOCK_1D)
            bb = tl.load(Br + t, mask=t < fill, other=float("-inf"))
            vi, keep = _keep_mask(bb, t, fill, rank0, L, head, tail)
            ki = keep.to(tl.int32)
            dest = out + tl.cumsum(ki, axis=0) - ki
            pp = tl.load(Pr + t, mask=keep)
            tl.debug_barrier()
            tl.store(Br + dest, bb, mask=keep)
            tl.store(Pr + dest, pp, mask=keep)
            rank0 += tl.sum(vi, axis=0)
            out += tl.sum(ki, axis=0)
        _finish_row(Br, FILL + row, out, C, BLOCK_1D)


# -- launcher ----------------------------------------------------------------------------------------
def triton_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink: int) -> None:
    if triton is None:
        raise NotImplementedError("triton_evict_to_budget needs Triton (pip install triton)")
    B, H, C, D = _check_state("triton_evict_to_budget", keys, values, bias, slot_pos, fill, budget)
    if B * H == 0 or C == 0:
        return
    nslice = triton.cdiv(D, COLUMNS)
    _evict_columns_kernel[(B * H, 2 * nslice)](keys, values, bias, fill, budget, C, D, n_sink, DS=COLUMNS,
                                               NSLICE=nslice, BLOCK_S=256, BLOCK_1D=1024, num_warps=4)
    _evict_meta_kernel[(B * H,)](bias, slot_pos, fill, budget, C, n_sink, BLOCK_1D=1024, num_warps=4)


# -- op registration ---------------------------------------------------------------------------------
@torch.library.custom_op("kvrewrite::evict_to_budget", mutates_args=("keys", "values", "bias", "slot_pos", "fill"))
def evict_to_budget(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    budget: torch.Tensor,
    n_sink: int,
) -> None:
    """Sink + recent eviction of the rows that reached the threshold (see the module docstring)."""
    reference_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink)


@evict_to_budget.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, n_sink):
    if triton is None:
        reference_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink)
    else:
        triton_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink)


@evict_to_budget.register_fake
def _(keys, values, bias, slot_pos, fill, budget, n_sink):
    return None
