"""Triton kernels of EMS's statistics (private: expanded_attention_stats.py and ems_attention.py own the schemas,
the references and the registration; contract docs/contracts/ems.md §6.3 and §6.4).

Words: a row is (batch b, KV head h), G = Hq / Hkv query heads hq = h·G + g read it; slot j reads entry e = lut_j
with key scale a_j; live_j = j < slot_fill, lut_j >= 0, bias[lut_j] > -inf; visible adds slot_pos[e] <= c_t.

1. Statistics by recomputation (`_stats_kernel`, kvrewrite::expanded_attention_stats and the prefill fold of
   kvrewrite::ems_attention). One program per (block of BLOCK_J slots, row), as attention_column_stats' kernel:
   it loads its slots' lut, a_j, and each slot's entry key, bias and slot_pos ONCE (a gather: one key row per
   slot, read from L2 when slots share an entry; never written anywhere), then for each of the G query heads walks
   the T queries in blocks of BLOCK_M: s = scale·q·k (one tl.dot per tile, fp32; fp32 inputs: ieee), z = a_j·s
   (softcap > 0: softcap·tanh(z / softcap)), p = exp(z - lse_t), summed over the block's queries into total (and,
   for t >= T - min(last, T), into recent). Query blocks in which no query sees any slot of the tile (causality)
   are skipped. Each output element has exactly one writer and no atomics: deterministic. Two forms of the query
   loop, on by default since stop 54 (the knobs' comment, below): PIPE (no branch around the loads, so they
   pipeline) and LEAN (p = exp2(qk·c_j - lse_t·log2 e) with c_j = a_j·scale·log2 e, the causal mask only in the
   programs whose tile holds a slot some query of the chunk precedes, decided once a program); without a cap only (a
   capped call keeps _block_p's step).
   FOLD = False writes total/recent [B, Hq, R] fp32 per query head. FOLD = True sums the G heads in registers and
   applies ems_attention's T > 1 rule in place, so no [B, Hq, R] tensor exists: s_glo += tot; s_loc_past := rec;
   s_loc_cur := 0 on every slot of the row (slots past slot_fill get 0 added / 0 written: their reset values);
   win_count := 0 by the row's first program (nothing reads win_count in this launch: no race).

2. Decode fold (`_decode_fold_kernel`, ems_attention's T = 1 rule). Inputs: S [B, Hq, C] fp32, the per-entry
   score s_e = scale·q·keys[e] (pre-cap) of each query head, and each head's final natural-log lse [B, Hq, 1].
   One program per (block of BLOCK_J slots, row): p_j = sum_g exp(z_gj - lse_g), z_gj = a_j·S[hq, lut_j] (capped),
   for live (and, without past_only, visible) slots; s_glo += p; s_loc_cur += p; and when this step completes the
   window (win_count + 1 == l_win): s_loc_past := s_loc_cur, s_loc_cur := 0. S is read only at live slots' entries
   (an expanded_attention forward may leave the others unwritten).

   win_count: every program READS it (once, before anything) and NO program of this launch writes it, so no
   program can see the new value in the same step, whatever the order the programs run in. The increment (and
   the reset at l_win) is a dedicated pass, `_win_count_kernel` (one tiny launch over the B·Hkv rows, stream-
   ordered after the fold): a cross-program "read before anyone writes" needs either that, a flag copied into
   scratch by an earlier launch (the spec's fused design, where the forward kernel would copy it), or an atomic
   arrival counter with persistent zeroed scratch. The dedicated pass is the one with no scratch and no atomics.

Everything has a grid fixed by the shapes, no host reads and no allocation beyond the outputs: CUDA-graph
capturable. The launchers do no checks (the ops check), so Triton's interpreter (TRITON_INTERPRET=1) runs them on
CPU tensors. Tuning knobs (block_j, block_m) exist for the interpreter tests' small tiles.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch

from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels.attention_column_stats import _load_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the ops run their references; only these launchers need Triton
    triton = tl = None
try:
    # tanh for SOFTCAP: the name Triton remaps to CUDA's libdevice (as clustered_attention.py imports it)
    from triton.language.extra import libdevice
except ImportError:
    libdevice = None

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton_jit()
def _cap(z, softcap, SOFTCAP: tl.constexpr):
    """softcap·tanh(z / softcap) when SOFTCAP (HF's order: divide, tanh, multiply), else z; fp32."""
    if SOFTCAP:
        z = libdevice.tanh(z / softcap) * softcap
    return z


@triton_jit()
def _row_slots(LUT, KS, BIAS, POS, SLOT_FILL, b, h, offs_j, R,
               stride_lb, stride_lh, stride_lj, stride_bb, stride_bh, stride_bc,
               stride_pb, stride_ph, stride_pc, stride_fb, stride_fh, LOAD_POS: tl.constexpr):
    """The block's slots: (entry index (0 where not live), a_j, live mask, the entry's slot_pos (0 unless
    LOAD_POS))."""
    j_ok = offs_j < R
    fill = tl.load(SLOT_FILL + b * stride_fb + h * stride_fh)
    lut = tl.load(LUT + b * stride_lb + h * stride_lh + offs_j * stride_lj, mask=j_ok, other=-1)
    a = tl.load(KS + b * stride_lb + h * stride_lh + offs_j * stride_lj, mask=j_ok, other=1.0)
    live = j_ok & (offs_j < fill) & (lut >= 0)
    e = tl.where(live, lut, 0).to(tl.int64)
    bias = tl.load(BIAS + b * stride_bb + h * stride_bh + e * stride_bc, mask=live, other=float("-inf"))
    live = live & (bias > float("-inf"))
    pos = tl.zeros_like(e)
    if LOAD_POS:
        pos = tl.load(POS + b * stride_pb + h * stride_ph + e * stride_pc, mask=live, other=0)
    return e, a, live, pos


@triton_jit()
def _block_qk(k, q, FP32: tl.constexpr, TRANS: tl.constexpr):
    """q·k of the tile's slots and the block's queries, fp32: [BLOCK_J, BLOCK_M] (k @ qᵀ, TRANS) or [BLOCK_M,
    BLOCK_J] (q @ kᵀ); fp32 inputs at IEEE precision (no TF32)."""
    if TRANS:
        if FP32:
            qk = tl.dot(k, tl.trans(q), input_precision="ieee")
        else:
            qk = tl.dot(k, tl.trans(q))
    elif FP32:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    return qk  # one return: Triton wants one type across the constexpr branches


@triton_jit()
def _block_p(Q, LSE, CPOS, b, hq, offs_t, offs_d, d_ok, T, k, a, live, pos,
             stride_qb, stride_qh, stride_qt, stride_qd, stride_eb, stride_eh, stride_et, stride_cp,
             first_recent, scale, softcap, FP32: tl.constexpr, SOFTCAP: tl.constexpr, TRANS: tl.constexpr,
             EVEN_D: tl.constexpr):
    """p = exp(cap(a_j·scale·q_t·k_j) - lse_t) of one query block against the tile's slots (0 where the slot is not
    visible to the query), as [BLOCK_J, BLOCK_M] (TRANS) or [BLOCK_M, BLOCK_J], and the mask of its recent queries."""
    t_ok = offs_t < T
    qpos = tl.load(CPOS + offs_t * stride_cp, mask=t_ok, other=0)
    q = _load_rows(Q + b * stride_qb + hq * stride_qh + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                   t_ok, d_ok, EVEN_D)
    lse = tl.load(LSE + b * stride_eb + hq * stride_eh + offs_t * stride_et, mask=t_ok, other=float("-inf"))
    # s_e = scale·q·k, then a_j·s_e, then the cap: the reference's order (the cast: Inductor may hand scale over as
    # an fp64 scalar); 16-bit products are exact, sums fp32
    qk = _block_qk(k, q, FP32, TRANS)
    if TRANS:  # [BLOCK_J, BLOCK_M]: slots down, queries across
        z = _cap((qk * scale).to(tl.float32) * a[:, None], softcap, SOFTCAP)
        vis = live[:, None] & (pos[:, None] <= qpos[None, :]) & (lse > float("-inf"))[None, :]
        p = tl.where(vis, tl.exp2((z - lse[None, :]) * 1.4426950408889634), 0.0)
        is_rec = (offs_t >= first_recent)[None, :]
    else:  # [BLOCK_M, BLOCK_J]: queries down, slots across
        z = _cap((qk * scale).to(tl.float32) * a[None, :], softcap, SOFTCAP)
        vis = live[None, :] & (pos[None, :] <= qpos[:, None]) & (lse > float("-inf"))[:, None]
        p = tl.where(vis, tl.exp2((z - lse[:, None]) * 1.4426950408889634), 0.0)
        is_rec = (offs_t >= first_recent)[:, None]
    return p, is_rec


@triton_jit()
def _lean_step(total, recent, Q, LSE, CPOS, b, hq, t0, offs_d, d_ok, T, k, c, live, pos,
               stride_qb, stride_qh, stride_qt, stride_qd, stride_eb, stride_eh, stride_et, stride_cp, first_recent,
               BLOCK_M: tl.constexpr, FP32: tl.constexpr, EVEN_D: tl.constexpr, MASK: tl.constexpr,
               EVEN_T: tl.constexpr):
    """One query block of the TRANS form without a cap (LEAN): p = exp2(qk·c_j - lse_t·log2 e), c_j =
    a_j·scale·log2 e, one FMA and one exp2 a score. The causal mask only with MASK, which the program sets once for
    all its blocks (some query of the chunk precedes some live slot of the tile: the chunk's own slots), so a block
    neither loads the positions nor reduces them; slots that are not live are zeroed by the caller once (their p may
    be anything here: k = 0, c = 0 give exp2(-lse)); padded queries get lse = +inf, so p = 0. One reduction a block,
    two only in the block where the recent queries start. EVEN_T (T a multiple of BLOCK_M; blocks start at multiples
    of it): every block is full, so q and lse load without a row mask (no predicate a load)."""
    offs_t = t0 + tl.arange(0, BLOCK_M)
    t_ok = offs_t < T
    q_ptrs = Q + b * stride_qb + hq * stride_qh + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd
    lse_ptrs = LSE + b * stride_eb + hq * stride_eh + offs_t * stride_et
    if EVEN_T and EVEN_D:
        q = tl.load(q_ptrs)
        lse2 = tl.load(lse_ptrs) * 1.4426950408889634
    else:
        q = _load_rows(q_ptrs, t_ok, d_ok, EVEN_D)
        lse2 = tl.load(lse_ptrs, mask=t_ok, other=float("inf")) * 1.4426950408889634
    x = _block_qk(k, q, FP32, True) * c[:, None] - lse2[None, :]
    if MASK:  # (and lse = -inf: the query sees no slot)
        qpos = tl.load(CPOS + offs_t * stride_cp, mask=t_ok, other=2**62)
        vis = live[:, None] & (pos[:, None] <= qpos[None, :]) & (lse2 > float("-inf"))[None, :]
        x = tl.where(vis, x, float("-inf"))
    p = tl.exp2(x)
    if t0 >= first_recent:  # every query of the block is recent
        s = tl.sum(p, axis=1)
        total += s
        recent += s
    elif t0 + BLOCK_M > first_recent:
        total += tl.sum(p, axis=1)
        recent += tl.sum(tl.where((offs_t >= first_recent)[None, :], p, 0.0), axis=1)
    else:
        total += tl.sum(p, axis=1)
    return total, recent


@triton_jit()
def _lean_loop(total, recent, Q, LSE, CPOS, b, hq, t_start, offs_d, d_ok, T, k, c, live, pos, strides, first_recent,
               BLOCK_M: tl.constexpr, FP32: tl.constexpr, EVEN_D: tl.constexpr, MASK: tl.constexpr,
               EVEN_T: tl.constexpr, PIPE_STAGES: tl.constexpr):
    """PIPE's query loop of LEAN steps from the block at t_start to T, with the program's mask decision MASK fixed
    for the whole loop. strides: q's four and lse's three, then the positions'."""
    stride_qb, stride_qh, stride_qt, stride_qd, stride_eb, stride_eh, stride_et, stride_cp = strides
    for t0 in tl.range(t_start, T, BLOCK_M, num_stages=PIPE_STAGES):
        total, recent = _lean_step(total, recent, Q, LSE, CPOS, b, hq, t0, offs_d, d_ok, T, k, c, live, pos,
                                   stride_qb, stride_qh, stride_qt, stride_qd, stride_eb, stride_eh, stride_et,
                                   stride_cp, first_recent, BLOCK_M, FP32, EVEN_D, MASK, EVEN_T)
    return total, recent


@triton_jit()
def _scan_chunk(CPOS, stride_cp, T, pos_min, BLOCK_M: tl.constexpr, SCAN: tl.constexpr):
    """(the first query block holding a query at or after pos_min (T where none): every block before it sees no slot
    of the tile, whatever order the chunk's positions come in; the chunk's smallest position)."""
    first = T
    qmin = 2**62
    for t0 in range(0, T, SCAN):
        offs = t0 + tl.arange(0, SCAN)
        qpos = tl.load(CPOS + offs * stride_cp, mask=offs < T, other=2**62)
        first = tl.minimum(first, tl.min(tl.where((qpos >= pos_min) & (offs < T), offs, T), axis=0))
        qmin = tl.minimum(qmin, tl.min(qpos, axis=0))
    return (first // BLOCK_M) * BLOCK_M, qmin


@triton_jit(do_not_specialize=["Hkv", "G", "T", "R", "D", "first_recent"])
def _stats_kernel(
    Q, K, BIAS, POS, CPOS, LUT, KS, SLOT_FILL, LSE,
    OUT_TOT, OUT_REC,  # FOLD False: contiguous [B, Hq, R] fp32 outputs.  FOLD True: s_glo, s_loc_past [B, Hkv, R]
    OUT_CUR, WIN,  # FOLD True only: s_loc_cur [B, Hkv, R] (zeroed), win_count [B, Hkv] int64 (zeroed)
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    stride_cp,
    stride_lb, stride_lh, stride_lj,  # lut and key_scale (same shape; the launcher passes lut's, checked equal)
    stride_fb, stride_fh,  # slot_fill
    stride_eb, stride_eh, stride_et,  # lse
    stride_sb, stride_sh, stride_sj,  # FOLD: s_glo / s_loc_past / s_loc_cur (same strides); else unused
    stride_wb, stride_wh,  # FOLD: win_count
    Hkv, G, T, R, D, first_recent, scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
    FP32: tl.constexpr, SOFTCAP: tl.constexpr, FOLD: tl.constexpr,
    ACC2D: tl.constexpr,  # sum p over the query blocks elementwise, reduce over the queries once per head (ACC2D)
    TRANS: tl.constexpr,  # the scores as [slots, queries] (k @ qᵀ): the sums over the queries run along a row (TRANS)
    PIPE: tl.constexpr = False,  # the query loop without its skip branch, from the first seeing block (not with ACC2D)
    PIPE_STAGES: tl.constexpr = 3,
    LEAN: tl.constexpr = False,  # _lean_step's blocks (TRANS, no cap, not with ACC2D)
    EVEN_D: tl.constexpr = False,  # D == BLOCK_D: q and the keys load as 16-byte vectors (attention_column_stats')
    EVEN_T: tl.constexpr = False,  # T % BLOCK_M == 0: LEAN's blocks load q and lse without a row mask
):
    Q_AXIS: tl.constexpr = 1 if TRANS else 0  # the tile's query axis: the sums over the queries run along it
    pid_j = tl.program_id(0)
    pid_r = tl.program_id(1)
    b = (pid_r // Hkv).to(tl.int64)
    h = (pid_r % Hkv).to(tl.int64)
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    e, a, live, pos = _row_slots(LUT, KS, BIAS, POS, SLOT_FILL, b, h, offs_j, R,
                                 stride_lb, stride_lh, stride_lj, stride_bb, stride_bh, stride_bc,
                                 stride_pb, stride_ph, stride_pc, stride_fb, stride_fh, True)
    # one key row per slot (its entry's), in registers only: shared by every query head and query block
    k = _load_rows(K + b * stride_kb + h * stride_kh + e[:, None] * stride_kc + offs_d[None, :] * stride_kd, live,
                   d_ok, EVEN_D)
    pos_min = tl.min(tl.where(live, pos, 2**62), axis=0)
    pos_max = tl.max(tl.where(live, pos, -(2**62)), axis=0)
    c = tl.where(live, a * (scale * 1.4426950408889634), 0.0)  # LEAN: a_j·scale·log2 e
    t_start = 0
    masked = True  # PIPE + LEAN: some query of the chunk precedes some live slot of the tile (all blocks take the mask)
    if PIPE:
        t_start, qmin = _scan_chunk(CPOS, stride_cp, T, pos_min, BLOCK_M, 1024)
        masked = qmin < pos_max
    tot = tl.zeros([BLOCK_J], dtype=tl.float32)
    rec = tl.zeros([BLOCK_J], dtype=tl.float32)
    for g in range(G):
        hq = h * G + g
        total = tl.zeros([BLOCK_J], dtype=tl.float32)
        recent = tl.zeros([BLOCK_J], dtype=tl.float32)
        if TRANS:
            total_2d = tl.zeros([BLOCK_J, BLOCK_M], dtype=tl.float32)
        else:
            total_2d = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
        if PIPE:  # no branch around the loads: Triton's pipeliner prefetches the next blocks' q, lse, positions
            if LEAN:  # the mask decided once: two loops, so the unmasked one has no mask code at all
                strides = (stride_qb, stride_qh, stride_qt, stride_qd, stride_eb, stride_eh, stride_et, stride_cp)
                if masked:
                    total, recent = _lean_loop(total, recent, Q, LSE, CPOS, b, hq, t_start, offs_d, d_ok, T, k, c,
                                               live, pos, strides, first_recent, BLOCK_M, FP32, EVEN_D, True, EVEN_T,
                                               PIPE_STAGES)
                else:
                    total, recent = _lean_loop(total, recent, Q, LSE, CPOS, b, hq, t_start, offs_d, d_ok, T, k, c,
                                               live, pos, strides, first_recent, BLOCK_M, FP32, EVEN_D, False, EVEN_T,
                                               PIPE_STAGES)
            else:
                for t0 in tl.range(t_start, T, BLOCK_M, num_stages=PIPE_STAGES):
                    offs_t = t0 + tl.arange(0, BLOCK_M)
                    p, is_rec = _block_p(Q, LSE, CPOS, b, hq, offs_t, offs_d, d_ok, T, k, a, live, pos,
                                         stride_qb, stride_qh, stride_qt, stride_qd, stride_eb, stride_eh, stride_et,
                                         stride_cp, first_recent, scale, softcap, FP32, SOFTCAP, TRANS, EVEN_D)
                    total += tl.sum(p, axis=Q_AXIS)
                    recent += tl.sum(tl.where(is_rec, p, 0.0), axis=Q_AXIS)
        else:
            for t0 in range(0, T, BLOCK_M):
                offs_t = t0 + tl.arange(0, BLOCK_M)
                t_ok = offs_t < T
                qpos = tl.load(CPOS + offs_t * stride_cp, mask=t_ok, other=0)
                if tl.max(tl.where(t_ok, qpos, -(2**62)), axis=0) >= pos_min:  # some query sees some slot
                    if LEAN:  # the mask in every block (this loop is not the default's)
                        total, recent = _lean_step(total, recent, Q, LSE, CPOS, b, hq, t0, offs_d, d_ok, T, k, c,
                                                   live, pos, stride_qb, stride_qh, stride_qt, stride_qd,
                                                   stride_eb, stride_eh, stride_et, stride_cp, first_recent, BLOCK_M,
                                                   FP32, EVEN_D, True, EVEN_T)
                    else:
                        p, is_rec = _block_p(Q, LSE, CPOS, b, hq, offs_t, offs_d, d_ok, T, k, a, live, pos,
                                             stride_qb, stride_qh, stride_qt, stride_qd, stride_eb, stride_eh,
                                             stride_et, stride_cp, first_recent, scale, softcap, FP32, SOFTCAP, TRANS,
                                             EVEN_D)
                        if ACC2D:
                            if t0 + BLOCK_M > first_recent:  # the block holds some of the last `last` queries
                                recent += tl.sum(tl.where(is_rec, p, 0.0), axis=Q_AXIS)
                                total_2d += tl.where(is_rec, 0.0, p)
                            else:
                                total_2d += p
                        else:
                            total += tl.sum(p, axis=Q_AXIS)
                            recent += tl.sum(tl.where(is_rec, p, 0.0), axis=Q_AXIS)
        if ACC2D:  # the older queries' sum plus the recent ones': recent == total exactly when every query is recent
            total = tl.sum(total_2d, axis=Q_AXIS) + recent
        if LEAN:  # slots that are not live took p from zeroed keys (_lean_step)
            total = tl.where(live, total, 0.0)
            recent = tl.where(live, recent, 0.0)
        if FOLD:
            tot += total
            rec += recent
        else:
            out = (b * Hkv * G + hq) * R + offs_j
            tl.store(OUT_TOT + out, total, mask=offs_j < R)
            tl.store(OUT_REC + out, recent, mask=offs_j < R)
    if FOLD:  # ems_attention, T > 1: s_glo += tot; s_loc_past := rec; s_loc_cur := 0; win_count := 0
        j_ok = offs_j < R
        s_off = b * stride_sb + h * stride_sh + offs_j * stride_sj
        glo = tl.load(OUT_TOT + s_off, mask=j_ok, other=0.0)
        tl.store(OUT_TOT + s_off, glo + tot, mask=j_ok)
        tl.store(OUT_REC + s_off, rec, mask=j_ok)
        tl.store(OUT_CUR + s_off, tl.zeros([BLOCK_J], dtype=tl.float32), mask=j_ok)
        if pid_j == 0:
            tl.store(WIN + b * stride_wb + h * stride_wh, tl.full([], 0, tl.int64))


@triton_jit(do_not_specialize=["Hkv", "G", "R", "l_win"])
def _decode_fold_kernel(
    S, LSE, BIAS, POS, CPOS, LUT, KS, SLOT_FILL,
    S_GLO, S_PAST, S_CUR, WIN,  # mutated: the three scores [B, Hkv, R] fp32; win_count [B, Hkv] int64 (READ only)
    stride_xb, stride_xh, stride_xc,  # S
    stride_eb, stride_eh,  # lse [B, Hq, 1]
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    stride_lb, stride_lh, stride_lj,
    stride_fb, stride_fh,
    stride_sb, stride_sh, stride_sj,
    stride_wb, stride_wh,
    Hkv, G, R, l_win, softcap,
    BLOCK_J: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr,
):
    pid_j = tl.program_id(0)
    pid_r = tl.program_id(1)
    b = (pid_r // Hkv).to(tl.int64)
    h = (pid_r % Hkv).to(tl.int64)
    # read before anything else, and never written by this launch (module docstring: _win_count_kernel does)
    rotate = tl.load(WIN + b * stride_wb + h * stride_wh) + 1 == l_win
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    e, a, live, pos = _row_slots(LUT, KS, BIAS, POS, SLOT_FILL, b, h, offs_j, R,
                                 stride_lb, stride_lh, stride_lj, stride_bb, stride_bh, stride_bc,
                                 stride_pb, stride_ph, stride_pc, stride_fb, stride_fh, CAUSAL)
    if CAUSAL:  # without past_only's promise: the entry must lie at or before the query
        live = live & (pos <= tl.load(CPOS))
    p = tl.zeros([BLOCK_J], dtype=tl.float32)
    for g in range(G):
        hq = h * G + g
        lse = tl.load(LSE + b * stride_eb + hq * stride_eh)
        lse = tl.where(lse > float("-inf"), lse, float("inf"))  # a head that saw nothing adds exp(-inf) = 0
        s = tl.load(S + b * stride_xb + hq * stride_xh + e * stride_xc, mask=live, other=0.0)
        z = _cap(s * a, softcap, SOFTCAP)
        p += tl.where(live, tl.exp2((z - lse) * 1.4426950408889634), 0.0)
    j_ok = offs_j < R
    s_off = b * stride_sb + h * stride_sh + offs_j * stride_sj
    glo = tl.load(S_GLO + s_off, mask=j_ok, other=0.0)
    cur = tl.load(S_CUR + s_off, mask=j_ok, other=0.0) + p
    tl.store(S_GLO + s_off, glo + p, mask=j_ok)
    if rotate:
        tl.store(S_PAST + s_off, cur, mask=j_ok)
        tl.store(S_CUR + s_off, tl.zeros([BLOCK_J], dtype=tl.float32), mask=j_ok)
    else:
        tl.store(S_CUR + s_off, cur, mask=j_ok)


@triton_jit(do_not_specialize=["rows", "l_win"])
def _win_count_kernel(WIN, rows, l_win, BLOCK: tl.constexpr):
    """win_count := win_count + 1, or 0 where that reaches l_win (contiguous [B·Hkv] int64)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < rows
    n = tl.load(WIN + offs, mask=ok, other=0) + 1
    tl.store(WIN + offs, tl.where(n == l_win, 0, n), mask=ok)


# The statistics kernel reduces each query block's p over its queries into the per-slot sums (two cross-thread
# reductions per block and head). ACC2D adds the older queries' p into a [BLOCK_M, BLOCK_J] accumulator instead,
# reduced once per head, and reduces only the blocks that hold recent queries: the same sums in another fp32 order
# (total = older + recent, so recent == total exactly when every query is recent, as without it).
# TRANS computes the scores as k @ qᵀ ([slots, queries]: the slots fill the MMA's M side, whatever the query block)
# so that the sums over the queries run along each thread's row; compiled for sm_90 (bf16, D 128, 32-query blocks,
# 128 slots, 4 warps, FOLD) it takes 163 registers a thread where the plain form takes 255 (191 with ACC2D too;
# ACC2D alone 255). H200, the late chunk of a batch-8 32k prefill (`python -m kvrewrite.bench.ems_prefill`,
# docs/bench.md "Stop 43 runs"): TRANS 25.2 ms, with 64-query blocks 25.7, with ACC2D too 29.0; the plain form
# 42.4, ACC2D 40.2 (34.3 with 64-query blocks and 8 warps). TRANS is the default; ACC2D stays off.
# EVEN_D (not a knob: D == BLOCK_D): q and the keys load as 16-byte vectors, where the column mask against the runtime
# D made each element a 2-byte load of its own (sm_90 SASS: 32 LDG.E.U16 a thread and query block, 162 registers;
# 158 without). Same chunk, stop 53: 18.7 ms (one run) against 24.69-24.85 (three runs of the earlier code, in other
# calls; docs/bench.md "Stop 53 runs"), and the batch-8 prefill 1.51x -> 1.47x dense end to end.
# PIPE drops the skip branch around the query block's loads (the loop starts at the first block that sees a slot of
# the tile, _first_seeing_block), so Triton's pipeliner prefetches q, lse and the positions (LDGSTS): alone no faster
# (stop 53, with EVEN_D: 3 stages 20.9 ms, 2 stages 18.8, against 18.7). LEAN's step (_lean_step): one FMA and one
# exp2 a score, the causal mask only in the blocks that need it, one reduction a block: 17.3 ms, 15.8 with PIPE at 2
# stages or with 64-query blocks (one call). Stop 54 (docs/bench.md "Stop 54 runs"), alone: LEAN + PIPE at 2 stages
# (32-query blocks) 15.83-16.01 ms in three measurements over two calls, against 18.51-18.55 for stop 53's form in
# the same calls; with 64-query blocks 12.97 (one run), at 3 stages with 64 15.69; 64-query blocks with 8 warps 25.9,
# 128 with 8 warps 21.9 (no PIPE; one run each). End to end, the batch-8 32k prefill: LEAN + PIPE alone 15.03 s
# against 16.21 for stop 53's form (one run each, the two GPUs of one call); with gather_slots' kernel too
# (_expanded_prefill_kernels.GATHER_KERNEL) 13.94-13.98 s against 16.22-16.24 (two runs each, both GPUs of one call).
# The defaults now; `--kernel-option _ems_fold_kernels.LEAN=False` (and PIPE=False, PIPE_STAGES=3) times stop 53's
# form. A soft cap keeps _block_p's step (LEAN has no cap).
ACC2D = False
TRANS = True
PIPE = True
PIPE_STAGES = 2
LEAN = True
# Stop 56: ncu's source counters of that loop (H200, the late chunk: 13.0 ms, 763 instructions a warp and query block,
# 255 registers, 2 programs an SM) put most of its time in the causal-mask decision (each block's smallest position:
# a 64-bit min over the block through shuffles, shared memory and two barriers) and in the row masks of q's and lse's
# loads (a predicate and its select per 16-byte copy), not in the exponentials. Now the program decides the mask once
# (the chunk's smallest position against its tile's largest slot position, from _scan_chunk's pass over the positions:
# _lean_step's MASK, two loops) and EVEN_T (T a multiple of the block) drops the row masks: 379 instructions in the
# hot path (sm_90, offline compile), 8.74-8.88 ms alone in two calls against 13.09 (stop 55), and the batch-8 prefill
# 12.51-12.57 s against 12.92 for stop 55's code in the same call (docs/bench.md "Stop 56 runs").
# LEAN's query block where the launch gives none (the other forms take stats_config's 32). 64 since stop 55: alone at
# the late chunk 12.97 and 13.09 ms (stop 54 and 55, one run each) against 15.83-16.01 for 32; EMS's batch-8 prefill
# (H200, docs/bench.md "Stop 55 runs") 13.55 and 13.81 s against 13.81 and 13.97 for 32, the two GPUs of one call.
LEAN_BLOCK_M = 64


def stats_config(T: int, D: int, block_j=None, block_m=None, num_warps=None, num_stages=None) -> dict:
    """Tile sizes from the shapes alone (one fixed launch for CUDA graphs); the knobs override them."""
    block_d = max(16, triton.next_power_of_2(D))
    wide = block_d > 128  # D = 256: smaller tiles keep q and the keys in registers
    # D = 128 measured on the H100 (Llama-3.1-8B shape at 32k, a 256-query chunk, bf16, B = 1): 128 slots x 32
    # queries with 4 warps took 0.70 ms, the 64 x 64 tiles with 8 warps 1.19 ms (a sweep of 54 configurations)
    return dict(BLOCK_D=block_d,
                BLOCK_M=block_m or min(32, max(16, triton.next_power_of_2(T))),  # tl.dot: >= 16
                BLOCK_J=block_j or (32 if wide else 128),
                num_warps=num_warps or (8 if wide else 4), num_stages=num_stages or 2)


def _stats_launch(q, keys, bias, slot_pos, cache_position, lut, key_scale, slot_fill, lse, scale, last, softcap,
                  out_tot, out_rec, fold_state, block_j, block_m, num_warps=None, num_stages=None, acc2d=None,
                  trans=None, pipe=None, pipe_stages=None, lean=None):
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, R = int(keys.shape[1]), int(lut.shape[2])
    fold = fold_state is not None
    acc2d = ACC2D if acc2d is None else acc2d
    if acc2d and (pipe or lean):
        raise ValueError("_ems_fold_kernels: PIPE's query loop and LEAN's step have no ACC2D form; turn ACC2D off")
    pipe = (not acc2d and PIPE) if pipe is None else pipe  # ACC2D asked for: its own loop and step, not the defaults
    lean = (not acc2d and LEAN) if lean is None else lean
    trans = TRANS if trans is None else trans
    lean = lean and trans and not softcap > 0  # the step is TRANS's form without a cap; the others keep _block_p
    if lean and block_m is None:
        block_m = min(LEAN_BLOCK_M, max(16, triton.next_power_of_2(T)))
    cfg = stats_config(T, D, block_j, block_m, num_warps, num_stages)
    s_glo, s_past, s_cur, win = fold_state if fold else (out_tot, out_rec, out_tot, slot_fill)
    _stats_kernel[(triton.cdiv(R, cfg["BLOCK_J"]), B * Hkv)](
        q, keys, bias, slot_pos, cache_position, lut, key_scale, slot_fill, lse,
        s_glo if fold else out_tot, s_past if fold else out_rec, s_cur, win,
        *q.stride(), *keys.stride(), *bias.stride(), *slot_pos.stride(), *cache_position.stride(), *lut.stride(),
        *slot_fill.stride(), *lse.stride(), *s_glo.stride(), *(win.stride() if fold else (0, 0)),
        Hkv, Hq // Hkv, T, R, D, T - min(last, T), float(scale), float(softcap),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_J=cfg["BLOCK_J"], BLOCK_D=cfg["BLOCK_D"], FP32=q.dtype == torch.float32,
        SOFTCAP=softcap > 0, FOLD=fold, ACC2D=acc2d,
        TRANS=trans, PIPE=pipe, PIPE_STAGES=pipe_stages or PIPE_STAGES, LEAN=lean, EVEN_D=D == cfg["BLOCK_D"],
        EVEN_T=T % cfg["BLOCK_M"] == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def launch_stats(q, keys, bias, slot_pos, cache_position, lut, key_scale, slot_fill, lse, scale, last, softcap,
                 block_j=None, block_m=None, **knobs):
    """(total, recent) [B, Hq, R] fp32 of kvrewrite::expanded_attention_stats (no checks: the op checks)."""
    B, Hq, T, _ = q.shape
    R = lut.shape[2]
    total = torch.empty((B, Hq, R), dtype=torch.float32, device=q.device)
    recent = torch.empty((B, Hq, R), dtype=torch.float32, device=q.device)
    if total.numel() == 0:
        return total, recent
    if T == 0:
        return total.zero_(), recent.zero_()
    _stats_launch(q, keys, bias, slot_pos, cache_position, lut, key_scale, slot_fill, lse, scale, last, softcap,
                  total, recent, None, block_j, block_m, **knobs)
    return total, recent


def launch_prefill_fold(q, keys, bias, slot_pos, cache_position, lut, key_scale, slot_fill, lse, s_glo, s_loc_past,
                        s_loc_cur, win_count, scale, l_win, softcap, block_j=None, block_m=None, **knobs):
    """ems_attention's T > 1 rule in place from recomputed statistics (module docstring, 1; FOLD). T >= 1."""
    if s_glo.numel() == 0:
        win_count.zero_()  # R == 0: no slot program would run
        return
    _stats_launch(q, keys, bias, slot_pos, cache_position, lut, key_scale, slot_fill, lse, scale, l_win, softcap,
                  None, None, (s_glo, s_loc_past, s_loc_cur, win_count), block_j, block_m, **knobs)


def launch_decode_fold(S, lse, bias, slot_pos, cache_position, lut, key_scale, slot_fill, s_glo, s_loc_past,
                       s_loc_cur, win_count, l_win, softcap, past_only, block_j=None):
    """ems_attention's T = 1 rule in place from S [B, Hq, C] and lse [B, Hq, 1] (module docstring, 2): the fold
    launch, then the win_count pass. win_count must be contiguous."""
    B, Hkv, R = s_glo.shape
    Hq = S.shape[1]
    if B * Hkv == 0:
        return
    block_j = block_j or 512
    if R > 0:
        _decode_fold_kernel[(triton.cdiv(R, block_j), B * Hkv)](
            S, lse, bias, slot_pos, cache_position, lut, key_scale, slot_fill, s_glo, s_loc_past, s_loc_cur,
            win_count, *S.stride(), *lse.stride()[:2], *bias.stride(), *slot_pos.stride(), *lut.stride(),
            *slot_fill.stride(), *s_glo.stride(), *win_count.stride(), Hkv, Hq // Hkv, R, l_win, float(softcap),
            BLOCK_J=block_j, SOFTCAP=softcap > 0, CAUSAL=not past_only, num_warps=4,
        )
    _win_count_kernel[(triton.cdiv(B * Hkv, 256),)](win_count, B * Hkv, l_win, BLOCK=256, num_warps=1)
