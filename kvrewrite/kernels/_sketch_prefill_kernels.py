"""kvrewrite::sketch_attention's prefill kernel: many queries (a prefill chunk) over ClusterGen's slots.

The op's decode kernel (sketch_attention.py) is clustered_attention's decode layout: every program walks its whole
slot range and tests each tile's positions on the way. A prefill chunk is compute-bound, and there
clustered_attention's prefill kernel (_prefill_attention_kernels.py) bounds each query block's tile loop by the
tiles' position ranges and masks only the tiles it does not see whole (1.46x faster than the decode loop at a
2048-query chunk, docs/bench.md "Stop 41 runs"). This kernel is that one with the op's two sums:

    s = the tile's base-2 scores, -inf where a query does not see a slot   (tile_scores, shared)
    Z: m_Z, l_Z over roles 0 and 1 (its own running max)
    N: m_N, acc = sum of 2^(s - m_N) v over roles 0 and 2                 (softmax_tile, shared)
    out = 2^(m_N - m_Z) acc / l_Z in two halves; 0 where no denominator slot is visible

the function of sketch_attention.py's module docstring, slot for slot (a role outside {0, 1, 2} counts in neither
sum, as the decode kernel's). Nothing assumes the slots' order for correctness (the ranges only bound and skip;
ClusterGen's sketch slots at the end of the state hold old positions, so their tiles are seen whole).
sketch_attention._launch picks it for prefill-sized blocks (G * T > 16) while PREFILL_KERNEL is on (its comment
says what was measured). Tests: tests/kernels/test_sketch_attention_triton.py (Triton's interpreter, against the
reference) and tests/kernels/test_sketch_attention_gpu.py.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite.kernels import _pdl
from kvrewrite.kernels import _prefill_attention_kernels as pk
from kvrewrite.kernels._online_softmax import softmax_tile
from kvrewrite.kernels._pdl import gdc_launch_dependents, gdc_wait
from kvrewrite.kernels._prefill_attention_kernels import _seen_tiles, tile_scores
from kvrewrite.kernels._query_block import block_rows, query_block
from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton.language as tl
except ImportError:  # CPU-only installs import this module too; only launching needs Triton
    tl = None

# Tried and dropped (stop 62): ONE_EXP, a tile without an exact slot (role 0) taking one exponential a score against its
# own sum's max instead of one for each sum (the same output bit for bit). Over ClusterGen's layout (36 exact slots,
# then roles 1 and 2), a 2048-query chunk over 16k slots at batch 8 on an H200: 9.12-9.14 ms against 7.92 without, two
# runs (`python -m kvrewrite.bench.attention_prefill --batch 8 --cases "chelsea 32k chunk 2048" --sketch`; docs/bench.md
# "Stop 62 runs"): slower, not profiled.

@triton_jit()
def _sketch_tile(m_n, l_n, acc, m_z, l_z, q, j, k_base, v_base, bias_base, pos_base, role_base, ranges, offs_d,
                 stride_kc, stride_kd, stride_vc, stride_vd, stride_bc, stride_pc, stride_rc, C, qk_scale, qpos_min,
                 qpos_max, q_rel, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Both sums after slot tile j of the query block: (m_n, l_n, acc, m_z, l_z). l_n is the numerator's own sum
    (softmax_tile's; the output does not use it)."""
    s, v_ptrs, n_ok = tile_scores(q, j, k_base, v_base, bias_base, pos_base, bias_base, ranges, offs_d, stride_kc,
                                  stride_kd, stride_vc, stride_vd, stride_bc, stride_pc, stride_bc, C, 0, qk_scale,
                                  0.0, qpos_min, qpos_max, q_rel, -1, BLOCK_N, False, False, False, MASKED)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    role = tl.load(role_base + offs_n * stride_rc, mask=n_ok, other=3)
    # -- denominator (roles 0, 1): its own running max; a row that has seen nothing keeps m = -inf, l = 0 -----------
    s_z = tl.where(((role == 0) | (role == 1))[None, :], s, float("-inf"))
    m_z_new = tl.maximum(m_z, tl.max(s_z, axis=1))
    base_z = tl.where(m_z_new == float("-inf"), 0.0, m_z_new)
    l_z = l_z * tl.exp2(m_z - base_z) + tl.sum(tl.exp2(s_z - base_z[:, None]), axis=1)
    # -- numerator (roles 0, 2): the online softmax's max and p @ v ------------------------------------------------
    s_n = tl.where(((role == 0) | (role == 2))[None, :], s, float("-inf"))
    m_n, l_n, acc = softmax_tile(m_n, l_n, acc, s_n, v_ptrs, n_ok)
    return m_n, l_n, acc, m_z_new, l_z


@triton_jit(do_not_specialize=["Hkv", "G", "T", "C", "n_tiles"])
def _sketch_prefill_kernel(
    Q, K, V, BIAS, POS, CPOS, ROLE,  # as sketch_attention's; ROLE int8 [B, Hkv, C]
    RANGES,  # int64 [B * Hkv, n_tiles, 2] from _prefill_attention_kernels._tile_ranges_kernel
    OUT,  # [B, Hq, T, D] q's dtype
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    stride_rb, stride_rh, stride_rc,
    Hkv, G, T, C, n_tiles, qk_scale,  # qk_scale = scale * log2(e)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCAN: tl.constexpr,  # tile ranges read at once while bounding the loop
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel before any load (kernels/_pdl.py)
    FULL_TILES: tl.constexpr,  # the full slot tiles' loads without a mask (_prefill_attention_kernels.FULL_TILES)
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid_m = tl.program_id(0)  # fastest: the blocks of one (b, h) run together and share its K/V in L2
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    Hq = Hkv * G

    rows, row_ok, t, hq, offs_d = block_rows(h, pid_m, G, T, BLOCK_M, HEAD_DIM)
    q, qpos, qpos_min, qpos_max, q_rel = query_block(Q, CPOS, b, row_ok, t, hq, offs_d, stride_qb, stride_qh,
                                                     stride_qt, stride_qd)
    ranges = RANGES + pid_bh.to(tl.int64) * n_tiles * 2
    lo, hi = _seen_tiles(ranges, n_tiles, qpos_min, qpos_max, 0, False, SCAN)

    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    pos_base = POS + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph
    role_base = ROLE + b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh

    m_n = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # numerator's running max (roles 0, 2)
    l_n = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_z = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # denominator's running max (roles 0, 1)
    l_z = tl.zeros([BLOCK_M], dtype=tl.float32)
    n_full = C // BLOCK_N if FULL_TILES else 0  # the full tiles without a slot mask, then the rest with one
    if FULL_TILES:
        for j in range(lo, tl.minimum(hi, n_full)):
            m_n, l_n, acc, m_z, l_z = _sketch_tile(
                m_n, l_n, acc, m_z, l_z, q, j, k_base, v_base, bias_base, pos_base, role_base, ranges, offs_d,
                stride_kc, stride_kd, stride_vc, stride_vd, stride_bc, stride_pc, stride_rc, C, qk_scale, qpos_min,
                qpos_max, q_rel, BLOCK_N, False)
    for j in range(tl.maximum(lo, n_full), hi):
        m_n, l_n, acc, m_z, l_z = _sketch_tile(
            m_n, l_n, acc, m_z, l_z, q, j, k_base, v_base, bias_base, pos_base, role_base, ranges, offs_d, stride_kc,
            stride_kd, stride_vc, stride_vd, stride_bc, stride_pc, stride_rc, C, qk_scale, qpos_min, qpos_max, q_rel,
            BLOCK_N, True)

    # -- epilogue: 2^(m_N - m_Z) acc / l_Z in two halves (sketch_attention.py's docstring says why) ----------------
    base_n = tl.where(m_n == float("-inf"), 0.0, m_n)
    base_z = tl.where(m_z == float("-inf"), 0.0, m_z)
    half = tl.exp2((base_n - base_z) * 0.5)
    o = (acc * (half / tl.where(l_z > 0.0, l_z, 1.0))[:, None]) * half[:, None]
    # no visible denominator slot, or no numerator slot (acc == 0; half may overflow there): 0
    o = tl.where(((l_z > 0.0) & (m_n > float("-inf")))[:, None], o, 0.0)
    out_row = (b.to(tl.int64) * Hq + hq) * T + t
    tl.store(OUT + out_row[:, None] * HEAD_DIM + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def launch_sketch_prefill(q, keys, values, bias, slot_pos, cache_position, role, qk_scale, full_tiles=None,
                          **overrides):
    """Launch the tile ranges, then the kernel; returns the output [B, Hq, T, D] (contiguous). The tiles, warps and
    stages are clustered_attention's prefill kernel's (prefill_launch_config; overrides: block_m, block_n, num_warps,
    num_stages); full_tiles: default _prefill_attention_kernels.FULL_TILES. No checks (the caller's:
    sketch_attention.triton_sketch_attention); runs under Triton's interpreter on CPU tensors."""
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C = int(keys.shape[1]), int(keys.shape[2])
    G = Hq // Hkv
    cfg = pk.prefill_launch_config(B, Hkv, G, T, C, D, q.element_size(), **overrides)
    pdl, launch = _pdl.launch_options(q)
    ranges = pk.tile_ranges(bias, slot_pos, cfg["n_tiles"], cfg["block_n"], pdl, launch)
    out = torch.empty((B, Hq, T, D), dtype=q.dtype, device=q.device)
    wrap_triton(_sketch_prefill_kernel)[(cfg["m_blocks"], B * Hkv)](
        q, keys, values, bias, slot_pos, cache_position, role, ranges, out,
        *q.stride(), *keys.stride(), *values.stride(), *bias.stride(), *slot_pos.stride(), *role.stride(),
        Hkv, G, T, C, cfg["n_tiles"], qk_scale,
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], SCAN=pk.SCAN, PDL=pdl,
        FULL_TILES=pk.FULL_TILES if full_tiles is None else bool(full_tiles), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **launch,
    )
    return out
