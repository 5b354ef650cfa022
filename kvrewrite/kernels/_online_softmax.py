"""The online softmax of the prefill attention kernels (_prefill_attention_kernels.py, _expanded_prefill_kernels.py):
one tile's update and the epilogue, in base 2.

A row that has seen nothing yet keeps m = -inf and l = 0 (its tile's exponentials are taken against 0, so
exp2(-inf) = 0 and no NaN appears), and its output is 0 with lse -inf. Triton inlines these functions: the kernels
compile to the same code as with the lines written out (the same SASS for sm_90, instruction for instruction,
checked for both kernels when these were split out).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton.language as tl
except ImportError:  # CPU-only installs import this module too; only launching needs Triton
    tl = None


@triton_jit()
def softmax_tile(m_i, l_i, acc, s, v_ptrs, v_mask):
    """(m_i, l_i, acc) after a tile of base-2 scores s [BLOCK_M, BLOCK_N] (-inf: not seen) whose values are read at
    v_ptrs [BLOCK_N, D] (rows where v_mask is False read 0): the running max, sum and p @ v (p in the values'
    dtype for 16-bit values, fp32 sums; fp32 values at IEEE precision)."""
    m_new, l_i, alpha, p = softmax_probs(m_i, l_i, s)
    v = tl.load(v_ptrs, mask=v_mask[:, None], other=0.0)
    return m_new, l_i, softmax_acc(acc, alpha, p, v)


@triton_jit()
def softmax_probs(m_i, l_i, s):
    """softmax_tile's first half: (m_new, l_i, alpha, p), the new running max and sum, the old accumulator's factor
    and the tile's probabilities against m_new."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, alpha, p


@triton_jit()
def softmax_acc(acc, alpha, p, v):
    """softmax_tile's second half: acc * alpha + p @ v for the tile's values v [BLOCK_N, D], however loaded (a TMA
    descriptor's tile: _ordered_prefill_kernels.py)."""
    if v.dtype == tl.float32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv


@triton_jit()
def store_rows(OUT, LSE, out_row, row_ok, offs_d, acc, m_i, l_i, HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr):
    """The epilogue: o = acc / l into row out_row of the contiguous [B, Hq, T, HEAD_DIM] output (0 for a row that
    saw nothing) and, with WRITE_LSE, the natural-log log-sum-exp (-inf there) into LSE[out_row]."""
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row that saw nothing: acc == 0, o == 0
    tl.store(OUT + out_row[:, None] * HEAD_DIM + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
        tl.store(LSE + out_row, lse, mask=row_ok)
