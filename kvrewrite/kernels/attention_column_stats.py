"""kvrewrite::attention_column_stats — how much attention each slot receives, for score-based methods.

For the queries of a prefill chunk (or a decode step), with the same visibility and degree bias as
kvrewrite::clustered_attention:

    p[h, t, j] = exp(scale * q[h, t]·k_j + b_j - lse[h, t])       (the softmax probability)
    total[h, j]  = sum_t p[h, t, j]                                 (H2O's accumulated attention)
    recent[h, j] = sum_{t >= T - last} p[h, t, j]                   (SnapKV's observation window)

per query head h (methods pool the query heads of a KV head as their paper says). `lse` is the
log-sum-exp of each query's visible logits, which the attention computes anyway; given it, one pass
over the slots suffices and the T x C probability matrix is never materialised (the reference
walks T in blocks). Pass lse=None to compute it here (a second pass).

Args:
    q: [B, Hq, T, D]; keys: [B, Hkv, C, D]; bias, slot_pos: [B, Hkv, C]; cache_position: [T]
    lse: [B, Hq, T] fp32 or None; scale: softmax scale; window: sliding window (0: none);
    last: the number of most recent queries summed into `recent` (clamped to T)
Returns:
    (total, recent), each [B, Hq, C] fp32; invisible and empty slots get 0; queries that see no
    slot contribute nothing.

Callers that read only `recent` (SnapKV's window after a prefill chunk: mode "window" of accumulate_attention
and observed_attention) launch with need_total=False (`_launch`, `column_sums`): the kernels then walk only the
query blocks that hold the last `last` queries, so a 2048-query chunk with a 32-query window costs one block of
64 queries instead of 32 blocks (and `total` is not returned). On an H200 at batch 8 and 32k the full walk was
7.4 s of snapkv's 17.7 s compiled prefill (docs/bench.md, "Stop 39 runs").

Backends: CUDA runs the Triton kernels below (fp16/bf16/fp32, D <= 256); other devices run the
reference. The op is a `torch.library.triton_op`, so Inductor sees the launches and CUDA graphs work.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite.kernels._triton_op import check_attention_shapes, check_one_cuda_device, register_triton_op, triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its reference; only triton_attention_column_stats raises
    triton = tl = None

BLOCK_T = 128  # queries per block of the reference: bounds its memory to B*Hq*BLOCK_T*C floats


def _visible_logits(q, keys, bias, slot_pos, cache_position, scale, window):
    """fp32 logits [B, Hq, t, C] with -inf where a slot is invisible or empty."""
    B, Hq, T, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    logits = torch.einsum("bhgtd,bhcd->bhgtc", q.float().view(B, Hkv, G, T, D), keys.float())
    logits = logits * scale + bias[:, :, None, None, :]
    qp, sp = cache_position[None, None, None, :, None], slot_pos[:, :, None, None, :]
    visible = sp <= qp
    if window > 0:
        visible = visible & (sp > qp - window)
    return logits.masked_fill(~visible, float("-inf")).reshape(B, Hq, T, -1)


def reference_attention_column_stats(q, keys, bias, slot_pos, cache_position, lse, scale, window, last,
                                     need_total=True):
    """Plain-PyTorch reference, blockwise over queries; fp32 throughout. need_total=False: (None, recent), from
    the block that holds the first of the last `last` queries on."""
    B, Hq, T, _ = q.shape
    C = keys.shape[2]
    total = torch.zeros(B, Hq, C, dtype=torch.float32, device=q.device)
    recent = torch.zeros_like(total)
    first_recent = T - min(max(last, 0), T)
    for t0 in range(0 if need_total else first_recent // BLOCK_T * BLOCK_T, T, BLOCK_T):
        t1 = min(t0 + BLOCK_T, T)
        logits = _visible_logits(q[:, :, t0:t1], keys, bias, slot_pos, cache_position[t0:t1], scale, window)
        block_lse = logits.logsumexp(dim=-1) if lse is None else lse[:, :, t0:t1].float()
        p = torch.exp(logits - block_lse[..., None])
        p = torch.nan_to_num(p, nan=0.0)  # a query seeing nothing: -inf - -inf
        total += p.sum(dim=2)
        if t1 > first_recent:
            recent += p[:, :, max(first_recent - t0, 0) :].sum(dim=2)
    return (total if need_total else None), recent


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA)
#
# Stats kernel: one program owns BLOCK_N slots of one query head (b, hq) of KV head hq // G; it loads
# its K tile, bias and positions once and walks the T queries in blocks of BLOCK_M: p = exp2(scale *
# log2 e * q·k + log2 e * (bias - lse)), summed over the block's rows into `total` (and, for rows t >=
# T - last, into `recent`). Only a [BLOCK_M, BLOCK_N] tile of p ever exists; query blocks that see no
# slot of the tile (causality, window) are skipped: inside the walk by a branch around the block's loads, or
# (PIPELINE) by a first pass over the query positions that bounds the visible blocks, so that the walk has no
# branch around its loads and Triton can pipeline them (tl.range). The K tile is read once per query head (G times
# per KV head, from the L2); outputs are written once, with no atomics, so results are deterministic.
# LSE kernel (only when the caller has no lse): one program per BLOCK_M queries of a query head, an
# online log-sum-exp over every slot (flash-attention's forward without V), written as natural log.
# ---------------------------------------------------------------------------------------------------


@triton_jit()
def _scores(q, k, qk_scale, bias, FP32: tl.constexpr):
    """log2-domain logits scale * log2 e * q·k + log2 e * bias of a [M, D] x [N, D] tile, in fp32."""
    LOG2E: tl.constexpr = 1.4426950408889634
    if FP32:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))  # 16-bit products are exact, sums fp32
    # (the cast: Inductor may hand qk_scale over as an fp64 scalar)
    return (qk * qk_scale).to(tl.float32) + bias[None, :] * LOG2E


@triton_jit()
def _load_rows(ptrs, row_ok, d_ok, EVEN_D: tl.constexpr):
    """A [rows, BLOCK_D] tile of q or keys, masked by row; by column only when D < BLOCK_D. EVEN_D (D == BLOCK_D):
    a row's mask is the same for all its columns, so they load as 16-byte vectors; the column mask, against the
    runtime D, made every element a 2-byte load of its own (the sm_90 SASS: LDG.E.U16)."""
    if EVEN_D:
        tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        tile = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return tile


@triton_jit(do_not_specialize=["Hq", "G", "T", "C", "D", "window", "t_begin"])
def _column_stats_lse_kernel(
    Q, K, BIAS, POS, CPOS, LSE,  # LSE: out, contiguous [B, Hq, T] fp32, natural log
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    stride_cp,
    Hq, G, T, C, D, window, qk_scale,
    t_begin,  # the first query whose lse is needed (rows before it are not written)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FP32: tl.constexpr,  # fp32 inputs: ieee dots (no TF32)
    EVEN_D: tl.constexpr,  # D == BLOCK_D (_load_rows)
):
    LOG2E: tl.constexpr = 1.4426950408889634
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    hq = (pid_bh % Hq).to(tl.int64)
    h = hq // G
    offs_t = t_begin + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t_ok = offs_t < T
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = _load_rows(Q + b * stride_qb + hq * stride_qh + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                   t_ok, d_ok, EVEN_D)
    qpos = tl.load(CPOS + offs_t * stride_cp, mask=t_ok, other=0)
    k_base = K + b * stride_kb + h * stride_kh
    bias_base = BIAS + b * stride_bb + h * stride_bh
    pos_base = POS + b * stride_pb + h * stride_ph
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, C, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        bias = tl.load(bias_base + offs_n * stride_bc, mask=offs_n < C, other=float("-inf"))
        pos = tl.load(pos_base + offs_n * stride_pc, mask=offs_n < C, other=0)
        live = bias > float("-inf")
        k = _load_rows(k_base + offs_n[:, None] * stride_kc + offs_d[None, :] * stride_kd, live, d_ok, EVEN_D)
        vis = live[None, :] & (pos[None, :] <= qpos[:, None]) & t_ok[:, None]
        vis = vis & ((window <= 0) | (pos[None, :] > qpos[:, None] - window))
        s = tl.where(vis, _scores(q, k, qk_scale, bias, FP32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: l stays 0
        l_i = l_i * tl.exp2(m_i - m_base) + tl.sum(tl.exp2(s - m_base[:, None]), axis=1)
        m_i = m_new
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) / LOG2E, float("-inf"))
    tl.store(LSE + (b * Hq + hq) * T + offs_t, lse, mask=t_ok)


@triton_jit()
def _add_sums(total, recent, total_rows, recent_rows, p, offs_t, first_recent,
              NEED_TOTAL: tl.constexpr, NEED_RECENT: tl.constexpr, SUM_ONCE: tl.constexpr):
    """A block's p added into the walk's sums: every row into total, rows t >= first_recent into recent; per row
    (SUM_ONCE, reduced after the walk) or summed over the block's rows now."""
    in_window = tl.where((offs_t >= first_recent)[:, None], p, 0.0)
    if SUM_ONCE:
        if NEED_TOTAL:
            total_rows += p
        if NEED_RECENT:
            recent_rows += in_window
    else:
        if NEED_TOTAL:
            total += tl.sum(p, axis=0)
        if NEED_RECENT:
            recent += tl.sum(in_window, axis=0)
    return total, recent, total_rows, recent_rows


@triton_jit()
def _block_positions(CPOS, stride_cp, t0, T, BLOCK_M: tl.constexpr):
    """(offs_t, t_ok, qpos, qpos_min, qpos_max) of the query block at t0: its indices, which are < T, their
    positions and the positions' range over those rows."""
    offs_t = t0 + tl.arange(0, BLOCK_M)
    t_ok = offs_t < T
    qpos = tl.load(CPOS + offs_t * stride_cp, mask=t_ok, other=0)
    qpos_min = tl.min(tl.where(t_ok, qpos, 2**62), axis=0)
    qpos_max = tl.max(tl.where(t_ok, qpos, -(2**62)), axis=0)
    return offs_t, t_ok, qpos, qpos_min, qpos_max


@triton_jit()
def _some_row_sees(qpos_min, qpos_max, pos_min, pos_max, window):
    """Whether some query of a block (positions in [qpos_min, qpos_max]) sees some live slot of a tile (positions
    in [pos_min, pos_max]): causality and the window, from the ranges alone."""
    return (qpos_max >= pos_min) & ((window <= 0) | (pos_max > qpos_min - window))


@triton_jit()
def _every_row_sees(qpos_min, qpos_max, pos_min, pos_max, window):
    """Whether every query of a block sees every live slot of a tile (the ranges as in _some_row_sees)."""
    return (qpos_min >= pos_max) & ((window <= 0) | (pos_min > qpos_max - window))


@triton_jit()
def _block_probs(q_base, lse_base, stride_qt, stride_qd, stride_lt, offs_t, t_ok, qpos, qpos_min, qpos_max, window,
                 qk_scale, k, bias, live, pos, pos_min, pos_max, offs_d, d_ok,
                 FP32: tl.constexpr, EVEN_D: tl.constexpr, SKIP_MASKS: tl.constexpr):
    """The probabilities [BLOCK_M, BLOCK_N] of a query block (offs_t; its positions qpos, their range over the rows
    < T) over the tile's slots, 0 where a query does not see a slot. A row without an lse (a query that sees
    nothing, or past T) gets lse +inf, so its p is exp2(-inf) = 0 with or without the mask."""
    LOG2E: tl.constexpr = 1.4426950408889634
    q = _load_rows(q_base + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd, t_ok, d_ok, EVEN_D)
    lse = tl.load(lse_base + offs_t * stride_lt, mask=t_ok, other=float("-inf")) * LOG2E
    lse = tl.where(lse > float("-inf"), lse, float("inf"))
    p = tl.exp2(_scores(q, k, qk_scale, bias, FP32) - lse[:, None])
    if not (SKIP_MASKS & _every_row_sees(qpos_min, qpos_max, pos_min, pos_max, window)):  # else: no mask needed
        vis = live[None, :] & (pos[None, :] <= qpos[:, None])  # (an empty slot's bias -inf gives p = 0 too)
        vis = vis & ((window <= 0) | (pos[None, :] > qpos[:, None] - window))
        p = tl.where(vis, p, 0.0)
    return p


@triton_jit()
def _visible_blocks(CPOS, stride_cp, t_begin, T, window, pos_min, pos_max, BLOCK_M: tl.constexpr):
    """(lo, hi): the query blocks from t_begin whose queries see some slot of the tile lie in [lo, hi) (blocks in
    between that see none add zeros); lo >= hi when none does. Reads the T positions only."""
    lo = T
    hi = t_begin
    for t0 in range(t_begin, T, BLOCK_M):
        _, _, _, qpos_min, qpos_max = _block_positions(CPOS, stride_cp, t0, T, BLOCK_M)
        sees = _some_row_sees(qpos_min, qpos_max, pos_min, pos_max, window)
        lo = tl.where(sees & (lo == T), t0, lo)
        hi = tl.where(sees, t0 + BLOCK_M, hi)
    return lo, hi


@triton_jit(do_not_specialize=["Hq", "G", "T", "C", "D", "window", "first_recent", "t_begin"])
def _column_stats_kernel(
    Q, K, BIAS, POS, CPOS, LSE,
    TOTAL, RECENT,  # out, contiguous [B, Hq, C] fp32 (TOTAL: only with NEED_TOTAL)
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    stride_cp,
    stride_lb, stride_lh, stride_lt,
    Hq, G, T, C, D, window, first_recent, qk_scale,
    t_begin,  # the first query block walked: 0, or without NEED_TOTAL first_recent's block
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FP32: tl.constexpr,  # fp32 inputs: ieee dots (no TF32)
    NEED_TOTAL: tl.constexpr,  # compute and store TOTAL (False: only RECENT, from query t_begin on)
    NEED_RECENT: tl.constexpr,  # some query is recent (first_recent < T); False: RECENT stores zeros, no sums
    EVEN_D: tl.constexpr,  # D == BLOCK_D (_load_rows)
    SUM_ONCE: tl.constexpr,  # add p into [BLOCK_M, BLOCK_N] tiles, summed over their rows once after the walk
    SKIP_MASKS: tl.constexpr,  # a block whose every row sees every slot of the tile computes p with no mask
    PIPELINE: tl.constexpr,  # find the visible blocks first, then walk them with no branch around the loads
    NUM_STAGES: tl.constexpr,  # PIPELINE's software pipelining depth (tl.range)
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    hq = (pid_bh % Hq).to(tl.int64)
    h = hq // G
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < C
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    # -- the tile's slots, loaded once: bias (-inf = empty), position, keys ------------------------------
    bias = tl.load(BIAS + b * stride_bb + h * stride_bh + offs_n * stride_bc, mask=n_ok, other=float("-inf"))
    pos = tl.load(POS + b * stride_pb + h * stride_ph + offs_n * stride_pc, mask=n_ok, other=0)
    live = bias > float("-inf")
    k = _load_rows(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kc + offs_d[None, :] * stride_kd,
                   live, d_ok, EVEN_D)
    pos_min = tl.min(tl.where(live, pos, 2**62), axis=0)
    pos_max = tl.max(tl.where(live, pos, -(2**62)), axis=0)

    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    recent = tl.zeros([BLOCK_N], dtype=tl.float32)
    # SUM_ONCE: the walk's sums stay per row (no reduction across the warps, and its barriers, at every block)
    total_rows = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    recent_rows = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    q_base = Q + b * stride_qb + hq * stride_qh
    lse_base = LSE + b * stride_lb + hq * stride_lh
    if PIPELINE:
        lo, hi = _visible_blocks(CPOS, stride_cp, t_begin, T, window, pos_min, pos_max, BLOCK_M)
        for t0 in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
            offs_t, t_ok, qpos, qpos_min, qpos_max = _block_positions(CPOS, stride_cp, t0, T, BLOCK_M)
            p = _block_probs(q_base, lse_base, stride_qt, stride_qd, stride_lt, offs_t, t_ok, qpos, qpos_min,
                             qpos_max, window, qk_scale, k, bias, live, pos, pos_min, pos_max, offs_d, d_ok, FP32,
                             EVEN_D, SKIP_MASKS)
            total, recent, total_rows, recent_rows = _add_sums(total, recent, total_rows, recent_rows, p, offs_t,
                                                               first_recent, NEED_TOTAL, NEED_RECENT, SUM_ONCE)
    else:
        for t0 in range(t_begin, T, BLOCK_M):
            offs_t, t_ok, qpos, qpos_min, qpos_max = _block_positions(CPOS, stride_cp, t0, T, BLOCK_M)
            if _some_row_sees(qpos_min, qpos_max, pos_min, pos_max, window):
                p = _block_probs(q_base, lse_base, stride_qt, stride_qd, stride_lt, offs_t, t_ok, qpos, qpos_min,
                                 qpos_max, window, qk_scale, k, bias, live, pos, pos_min, pos_max, offs_d, d_ok, FP32,
                                 EVEN_D, SKIP_MASKS)
                total, recent, total_rows, recent_rows = _add_sums(total, recent, total_rows, recent_rows, p,
                                                                   offs_t, first_recent, NEED_TOTAL, NEED_RECENT,
                                                                   SUM_ONCE)
    if SUM_ONCE:
        total = tl.sum(total_rows, axis=0)
        recent = tl.sum(recent_rows, axis=0)
    out = (b * Hq + hq) * C + offs_n
    if NEED_TOTAL:
        tl.store(TOTAL + out, total, mask=n_ok)
    tl.store(RECENT + out, recent, mask=n_ok)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


def _check_inputs(q, keys, bias, slot_pos, cache_position, lse, window, last):
    """Shape and argument checks of the op (every device); names what is wrong."""
    name = "kvrewrite::attention_column_stats"
    B, Hq, T, _, _, _ = check_attention_shapes(name, q, keys, bias, slot_pos, cache_position)
    if lse is not None and (tuple(lse.shape) != (B, Hq, T) or lse.dtype != torch.float32):
        raise ValueError(f"{name}: lse must be None or fp32 [B, Hq, T] = {(B, Hq, T)}, "
                         f"got {lse.dtype} {tuple(lse.shape)}")
    if window < 0 or last < 0:
        raise ValueError(f"{name}: window (0 = none) and last must be >= 0, got window={window}, last={last}")


def _check_cuda_inputs(q, keys, bias, slot_pos, cache_position, lse):
    name = "triton_attention_column_stats"
    if q.dtype not in _DTYPES or keys.dtype != q.dtype:
        raise TypeError(f"{name}: q and keys must share one dtype of fp16/bf16/fp32, got {q.dtype}, {keys.dtype}")
    if bias.dtype != torch.float32 or slot_pos.dtype != torch.int64 or cache_position.dtype != torch.int64:
        raise TypeError(f"{name}: expected bias fp32, slot_pos and cache_position int64, "
                        f"got {bias.dtype}, {slot_pos.dtype}, {cache_position.dtype}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim D must be <= {MAX_HEAD_DIM}, got D={q.shape[-1]}")
    check_one_cuda_device(name, [q, keys, bias, slot_pos, cache_position] + ([] if lse is None else [lse]))


def _launch_config(T: int, D: int, tuning: dict | None = None, total_only: bool = False) -> dict:
    """Tile sizes from the shapes alone (never the data: one fixed launch for CUDA graphs and Inductor); `tuning`
    (block_m, block_n, num_warps, num_stages, even_d, sum_once, skip_masks, pipeline) overrides them for the
    benchmark's sweep (bench/column_stats.py).

    total_only: the stats kernel sums every query and no recent ones, with the lse given, in 16-bit inputs (h2o's
    and kvmerger's prefill chunks through observed_attention). There, with D = 128 and T >= 128, the default is the
    fastest launch of one H200 sweep (docs/bench.md, "Stop 40 runs"): 128 x 64 tiles, 4 warps, even_d and
    sum_once. The other calls (recent sums, no lse, fp32) keep the untuned tiles: sum_once would hold a second
    register tile for the recent sums, and even_d cost the recent path a program an SM on sm_90; not timed there.
    skip_masks (on): a query block whose every row sees every slot of the tile computes p without the per-element
    mask. pipeline (off until timed): the visible blocks bounded first, then walked with no branch around the
    loads, so Triton can pipeline them num_stages deep (the branchy walk compiles to the same code at any depth;
    the sm_90 registers and spills of both are in docs/bench.md)."""
    block_d = max(16, triton.next_power_of_2(D))
    wide = block_d > 128  # D = 256: smaller tiles keep q and k in registers
    cfg = dict(
        block_d=block_d,
        block_m=min(32 if wide else 64, max(16, triton.next_power_of_2(T))),  # tl.dot needs M >= 16
        block_n=32 if wide else 64,
        num_warps=4 if block_d <= 64 else 8,
        num_stages=2,
        even_d=False,  # both kernels' EVEN_D when D == block_d (else always off)
        sum_once=False,  # the stats kernel's SUM_ONCE
        skip_masks=True,  # the stats kernel's SKIP_MASKS
        pipeline=False,  # the stats kernel's PIPELINE (its loop's depth: num_stages)
    )
    if total_only and block_d == 128 and T >= 128:
        cfg.update(block_m=128, block_n=64, num_warps=4, even_d=True, sum_once=True)
    unknown = set(tuning or {}) - (set(cfg) - {"block_d"})
    if unknown:
        raise ValueError(f"attention_column_stats: unknown launch overrides {sorted(unknown)}")
    return {**cfg, **(tuning or {})}


def triton_attention_column_stats(q, keys, bias, slot_pos, cache_position, lse, scale, window, last, need_total=True):
    """The op on CUDA through Triton (shapes in the module docstring); validates its inputs. need_total=False:
    (None, recent) (_launch)."""
    if triton is None:
        raise NotImplementedError("triton_attention_column_stats needs Triton (pip install triton); "
                                  "kvrewrite::attention_column_stats itself runs without it")
    _check_inputs(q, keys, bias, slot_pos, cache_position, lse, window, last)
    _check_cuda_inputs(q, keys, bias, slot_pos, cache_position, lse)
    return _launch(q, keys, bias, slot_pos, cache_position, lse, scale, window, last, need_total)


def _launch(q, keys, bias, slot_pos, cache_position, lse, scale, window, last, need_total=True, tuning=None):
    """(total, recent) through the kernels, unchecked; need_total=False: (None, recent), walking only the query
    blocks that hold the last `last` queries (module docstring); tuning: _launch_config's overrides."""
    # int(): the launch depends on the shapes, so a dynamic-shape trace specialises on them (a guard)
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C = int(keys.shape[1]), int(keys.shape[2])
    G = Hq // Hkv
    total = torch.empty((B, Hq, C), dtype=torch.float32, device=q.device) if need_total else None
    recent = torch.empty((B, Hq, C), dtype=torch.float32, device=q.device)
    first_recent = T - min(last, T)
    if B * Hq * C == 0:
        return total, recent
    if T == 0 or (not need_total and first_recent == T):  # no query to walk
        return (total.zero_() if need_total else None), recent.zero_()
    total_only = need_total and first_recent == T and lse is not None and q.dtype != torch.float32
    cfg = _launch_config(T, D, tuning, total_only=total_only)
    meta = dict(BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_D=cfg["block_d"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], FP32=q.dtype == torch.float32,
                EVEN_D=bool(cfg["even_d"]) and D == cfg["block_d"])
    t_begin = 0 if need_total else first_recent // cfg["block_m"] * cfg["block_m"]
    common = (*q.stride(), *keys.stride(), *bias.stride(), *slot_pos.stride(), *cache_position.stride())
    qk_scale = scale * LOG2E
    if lse is None:
        lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
        wrap_triton(_column_stats_lse_kernel)[(triton.cdiv(T - t_begin, cfg["block_m"]), B * Hq)](
            q, keys, bias, slot_pos, cache_position, lse, *common, Hq, G, T, C, D, window, qk_scale, t_begin, **meta,
        )
    wrap_triton(_column_stats_kernel)[(triton.cdiv(C, cfg["block_n"]), B * Hq)](
        q, keys, bias, slot_pos, cache_position, lse, recent if total is None else total, recent, *common,
        *lse.stride(), Hq, G, T, C, D, window, first_recent, qk_scale, t_begin, **meta, NEED_TOTAL=need_total,
        NEED_RECENT=first_recent < T, SUM_ONCE=bool(cfg["sum_once"]), SKIP_MASKS=bool(cfg["skip_masks"]),
        PIPELINE=bool(cfg["pipeline"]), NUM_STAGES=cfg["num_stages"],
    )
    return total, recent


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------


def attention_column_stats(
    q: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    window: int,
    last: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column sums of the attention probabilities, over all queries and the last `last` ones.

    The op's kernel, fake and what Inductor inlines (see _triton_op.py): CUDA launches the Triton
    kernels, other devices run the reference (plain tensor code, traceable: no host reads)."""
    if q.is_cuda and triton is not None:
        return triton_attention_column_stats(q, keys, bias, slot_pos, cache_position, lse, scale, window, last)
    _check_inputs(q, keys, bias, slot_pos, cache_position, lse, window, last)
    return reference_attention_column_stats(q, keys, bias, slot_pos, cache_position, lse, scale, window, last)


attention_column_stats = register_triton_op("kvrewrite::attention_column_stats", attention_column_stats, (),
                                            triton is not None)
