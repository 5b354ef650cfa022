"""The query block of a clustered_attention program (its decode kernel and its prefill kernel).

A program owns BLOCK_M rows of one (b, KV head h): row r is query t = r // G of query head h * G + r % G (every head
of the GQA group at each query, so the group shares each K/V tile's loads). Rows past G * T load 0 and are never
stored.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton.language as tl
except ImportError:  # CPU-only installs import this module too; only launching needs Triton
    tl = None


@triton_jit()
def block_rows(h, pid_m, G, T, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(rows, row_ok, t, hq, offs_d) of query block pid_m, from the program's indices alone. Apart from
    query_block's loads on purpose: Inductor's mutation analysis of a user kernel (torch's triton_kernel_wrap, under
    torch.compile and the exporters) follows a store's pointer back through a call to every argument of the callee,
    so output rows computed in the call that loads q counted Q and CPOS as written (and skipped CUDA graphs for
    "mutated inputs"); tests/kernels/test_mutation_analysis.py checks every kernel's written arguments."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * T
    t = rows // G
    hq = h * G + rows % G
    offs_d = tl.arange(0, HEAD_DIM)
    return rows, row_ok, t, hq, offs_d


@triton_jit()
def query_block(Q, CPOS, b, row_ok, t, hq, offs_d, stride_qb, stride_qh, stride_qt, stride_qd):
    """(q, qpos, qpos_min, qpos_max, q_rel) of the block's rows (block_rows'): q [BLOCK_M, HEAD_DIM] (held for the
    whole slot range), the rows' positions, their range over the rows < G * T (a slot outside it is seen by no row),
    and the positions relative to the block's first query in int32 (int64 compares cost two instructions per
    element): rows get [0, T) (rows past G * T: 0). The kernels clamp slots' relative positions to
    [-(window + 1), 2**30], which keeps every causal and window test's outcome (slots before the clamp are older than
    every row's window, slots after it newer than every row)."""
    q_ptrs = Q + b.to(tl.int64) * stride_qb + hq[:, None] * stride_qh + t[:, None] * stride_qt
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    qpos = tl.load(CPOS + t, mask=row_ok, other=0)
    qpos_max = tl.max(tl.where(row_ok, qpos, -(2**62)), axis=0)
    qpos_min = tl.min(tl.where(row_ok, qpos, 2**62), axis=0)
    q_rel = tl.where(row_ok, qpos - qpos_min, 0).to(tl.int32)
    return q, qpos, qpos_min, qpos_max, q_rel
