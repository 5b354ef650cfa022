"""kvrewrite::indexed_attention — attention of new queries over a listed subset of a layer's slots (ClusterKV).

    o[b, hq, t] = sum_j p_j v[b, h, i_j] / sum_j p_j   over the entries i_j of index[b, hsel],
    p_j = exp(z_j + bias[b, h, i_j] - max),  z_j = scale * q[b, hq, t]·k[b, h, i_j],
    or with softcap > 0:  z_j = softcap * tanh(scale * q[b, hq, t]·k[b, h, i_j] / softcap)

h = hq // G is the query head's KV head (GQA, G = Hq // Hkv); hsel = h when the index has one slot list per KV
head (Hsel == Hkv: the G query heads of a group share it, ClusterKV's "mean query" selection) or hq when it
has one per query head (Hsel == Hq). An entry -1 is skipped wherever it lies (the selection pads its sections
with it); an entry listed twice counts twice (as a slot of degree 2 would). The soft cap (Gemma-2) applies to
the scaled score alone, the bias is added after it, as in kvrewrite::clustered_attention: over an index that
lists every valid slot once, in any order, this op IS clustered_attention at decode. There is no causal or
position test: the caller promises that every indexed slot is visible to every query (decode). A query with no
valid entry (only -1, or only slots of bias -inf) gets zeros.

Args:
    q:             [B, Hq, T, D]   fp16/bf16/fp32 (any strides: often a transposed view)
    keys, values:  [B, Hkv, C, D]  q's dtype
    bias:          [B, Hkv, C]     fp32 (log degree; -inf for an empty slot)
    index:         [B, Hsel, S]    int32, Hsel in {Hkv, Hq}; entries in [0, C) or -1
    scale:         softmax scale (the model's, e.g. D**-0.5)
    softcap:       attention logit soft cap (0: none)
Returns:
    [B, Hq, T, D] in q's dtype, contiguous. fp32 logits, softmax and accumulation.
Mutates: nothing.

Backends: CUDA runs the Triton kernel below (fp16/bf16/fp32, D in 16..256, a power of two); CPU runs the
reference through an opaque op (kvrewrite::indexed_attention_cpu: it checks the index's entries, a data read
a traced body may not do); other devices run the reference. A triton_op, so Inductor sees the Triton launch
and CUDA graphs capture it. The reference raises ValueError for an entry outside [0, C) and not -1; the CUDA
kernel cannot check, and skips such entries like -1 (it never reads outside the cache).

Kernel design (ClusterKV decode: Llama-3.1-8B, Hq 32, Hkv 8, D 128, bf16, S = 1344 = 16 sinks + 1008
selected + 320 window). clustered_attention's slot loop, with the slot offsets of a tile gathered from the
index instead of an arange: each tile loads BLOCK_N entries, then the BLOCK_N keys and values they name (each
a contiguous D-vector: 256 bytes in bf16, a full-width row read) and the BLOCK_N biases. All three gathers
depend on the index load only, so they are in flight together (two round trips to memory per tile, not three:
the K/V reads are predicated on the entry being valid, not on its bias, which would wait on the bias load);
an entry of -1 reads nothing, so a tile of -1 (a short selection's or window's padding) costs only its index
load. A valid entry whose slot is empty (bias -inf) is read and weighs 0 (its K/V are finite: the state keeps
them so, as clustered_attention requires).
- Index per KV head: one program owns (b, h) and a range of entries; its tile's M rows are the G query heads
  of the group at every query (row = t * G + g, as clustered_attention), so ONE gather feeds a tl.dot for the
  whole group. Per query head: one program owns (b, hq), its rows are that head's T queries, and each query
  head gathers its own list (G times the K/V reads of the shared index when the lists do not overlap: 5.5 MB
  vs 22 MB per decode call at B = 1; query heads of a group whose lists overlap hit the L2).
- Split-K over the entries: the split count from the shapes and the SM count alone (CUDA graphs and Inductor
  see one launch). Unlike clustered_attention's 32k-slot rows, 1344 entries are 21 tiles of 64: a decode call
  moves 5.5 MB (per KV head, B = 1), ~2 us at 3 TB/s, so it is latency-bound: the grid spreads the tiles over
  up to two programs per SM, down to one tile per program (B = 1 per KV head: 8 x 21 = 168 programs, each
  with every load in flight at once), and clustered_attention's combine kernel merges the splits' partials
  (one more launch, ~1-2 us inside a CUDA graph). fuse_combine (a tested launch option): the last split of each
  tile to finish (a per-tile counter, acq_rel atomic, kvrewrite.kernels._semaphores: zeroed once, reset by the
  kernel) merges the tile's partials, in split order (deterministic), and there is no combine launch. Measured
  (H100, torch 2.11, triton 3.6, kvrewrite.bench.clusterkv_attention --sweep, B 1) it does not win: the step costs
  the same per KV head (17.10 against 17.14 us at 32k) and 0.4-0.6 us more per query head (one program merges
  what 32 combine programs merged); so it is the default only where a tile has several rows (per KV head). A
  programmatic dependent launch (pdl=True, an experiment option) was slower. Other sweeps at B 1 (2 or 8 warps,
  half or twice the splits, 32-entry tiles) moved the step by < 0.5 us or made it slower. What did help (same
  sweeps, B 1 and 8): 128-entry tiles per KV head (B 1: 8 x 11 one-tile programs) and for rows that get one split
  anyway (B 8 per query head), and the value loads issued with the key loads when a split is one tile (one
  round trip less); see _launch_config. Per kernel at B 1 (torch.profiler): the split kernel 6.0-6.2 us per KV
  head (with its merge), 8.7-8.9 us per query head plus 1.7 us of combine launch.
- T > 1 works (rows = G * T per KV head, T per query head, in 16..64-row blocks), decode (T = 1) is the case
  the launch is shaped for.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite.kernels._semaphores import counters
from kvrewrite.kernels._triton_op import check_one_cuda_device, check_query_keys, register_triton_op, triton_jit
from kvrewrite.kernels.clustered_attention import (
    _DTYPES,
    _HEAD_DIMS,
    _clustered_attention_combine_kernel,
    _num_sms,
    check_softcap,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its PyTorch paths; only triton_indexed_attention raises
    triton = tl = None
try:
    # tanh for the SOFTCAP kernel: a global of this name is what Triton remaps to CUDA's libdevice (see
    # clustered_attention.py); Inductor's copy of the kernel source resolves it too
    from triton.language.extra import libdevice
except ImportError:
    libdevice = None


def check_inputs(name, q, keys, values, bias, index, softcap=0.0) -> tuple:
    """ValueError / TypeError naming the op and the bad input unless the shapes and dtypes are the op's (module
    docstring) and softcap is a finite number >= 0. Reads no data. Returns (B, Hq, T, D, Hkv, C, Hsel, S)."""
    B, Hq, T, D, Hkv, C = check_query_keys(name, q, keys)
    if values.shape != keys.shape:
        raise ValueError(f"{name}: values must be shaped like keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if tuple(bias.shape) != (B, Hkv, C):
        raise ValueError(f"{name}: bias must be [B, Hkv, C] = {(B, Hkv, C)}, got {tuple(bias.shape)}")
    if C == 0:
        raise ValueError(f"{name}: the state has no slots (C = 0)")
    if index.dim() != 3 or index.shape[0] != B or index.shape[1] not in (Hkv, Hq):
        raise ValueError(f"{name}: index must be [B={B}, Hsel, S] with Hsel = Hkv ({Hkv}, one slot list per KV "
                         f"head) or Hq ({Hq}, one per query head), got {tuple(index.shape)}")
    if q.dtype not in _DTYPES or keys.dtype != q.dtype or values.dtype != q.dtype:
        raise TypeError(f"{name}: q, keys and values must share one dtype of fp16/bf16/fp32, "
                        f"got {q.dtype}, {keys.dtype}, {values.dtype}")
    if bias.dtype != torch.float32:
        raise TypeError(f"{name}: bias must be fp32, got {bias.dtype}")
    if index.dtype != torch.int32:
        raise TypeError(f"{name}: index must be int32, got {index.dtype}")
    check_softcap(softcap, name)
    return B, Hq, T, D, Hkv, C, index.shape[1], index.shape[2]


def check_index(index, C, name="indexed_attention"):
    """ValueError naming the first bad entry unless every entry of index is in [0, C) or -1. Reads the data: for
    the CPU path and the reference only (meta tensors hold none: nothing to check)."""
    if index.device.type == "meta" or index.numel() == 0:
        return
    bad = (index < -1) | (index >= C)
    if bool(bad.any()):
        b, s, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: index entries must be slots in [0, C = {C}) or -1 (skipped), got "
                         f"{int(index[b, s, j])} at index[{b}, {s}, {j}] ({int(bad.sum())} such entries)")


def reference_indexed_attention(q, keys, values, bias, index, scale, softcap=0.0):
    """Plain-PyTorch reference: gathers each selection row's keys, values and biases, then attends in fp32.
    Load-bearing choices: fp32 logits, softmax and accumulation; entries -1 are masked out (their gathered
    slot 0 weighs 0: its logit is -inf and its value zeroed, whatever it holds), duplicates are not merged; the
    bias is added after the scale and after the soft cap (softcap * tanh(logit / softcap)); a row with no
    finite logit returns 0 instead of NaN."""
    name = "reference_indexed_attention"
    B, Hq, T, D, Hkv, C, Hsel, S = check_inputs(name, q, keys, values, bias, index, softcap)
    check_index(index, C, name)
    if S == 0:  # no entry: zeros (amax below would reduce an empty dim)
        return q.new_zeros(q.shape)
    G = Hq // Hkv
    per = Hsel // Hkv  # lists per KV head: 1 (shared by the group) or G (one per query head)
    sel = index.view(B, Hkv, per, S)
    valid = sel >= 0
    slot = sel.clamp_min(0).long()
    bi = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    hi = torch.arange(Hkv, device=q.device).view(1, Hkv, 1, 1)
    k_sel = keys[bi, hi, slot].float().expand(B, Hkv, G, S, D)  # [B, Hkv, per -> G, S, D]
    v_sel = values[bi, hi, slot].float().masked_fill(~valid[..., None], 0.0).expand(B, Hkv, G, S, D)
    b_sel = bias[bi, hi, slot].masked_fill(~valid, float("-inf"))  # [B, Hkv, per, S]
    qf = q.float().reshape(B, Hkv, G, T, D)
    logits = torch.einsum("bhgtd,bhgsd->bhgts", qf, k_sel) * scale
    if softcap > 0:
        logits = torch.tanh(logits / softcap) * softcap
    logits = (logits + b_sel[:, :, :, None, :]).masked_fill(~valid[:, :, :, None, :], float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(logits - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgts,bhgsd->bhgtd", p, v_sel) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    return out.reshape(B, Hq, T, D).to(q.dtype)


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA)
#
# One program owns one selection row (b, hsel): with the index per KV head hsel = h and the tile's rows are
# the group's G query heads at every query (row = t * G + g); per query head hsel = hq and the rows are its T
# queries. In both, R = rows per query (G or 1) and hq = hsel * R + row % R. The program walks one contiguous
# range of the row's entries (split-K); with several splits a partial (acc, m, l) per split, merged by
# clustered_attention's combine kernel, as there.
# ---------------------------------------------------------------------------------------------------


# Shape ints that only bound loops and masks are not specialised on: one compiled kernel serves every C, S, T,
# group size and split count of a dtype, head dim and index kind.
@triton_jit()
def _combine_tile(OUT, ACC, M_PART, L_PART, b, hsel, row0, row_end, Hq, R, T, NUM_SPLITS,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, RB: tl.constexpr):
    """The merge of the split partials of tile rows [row0, row_end) (row = t * R + g of selection row hsel) into
    OUT, RB rows at a time: clustered_attention's combine_row on [RB, splits] maxima and sums and [RB, splits, D]
    accumulators (loaded .cg: other programs of this launch wrote them), splits in index order."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    for r0 in range(row0, row_end, RB):
        rr = r0 + tl.arange(0, RB)
        ok = rr < row_end
        orow = (b.to(tl.int64) * Hq + hsel * R + rr % R) * T + rr // R
        ms = ok[:, None] & s_ok[None, :]
        m = tl.load(M_PART + orow[:, None] * NUM_SPLITS + offs_s[None, :], mask=ms, other=float("-inf"),
                    cache_modifier=".cg")
        l = tl.load(L_PART + orow[:, None] * NUM_SPLITS + offs_s[None, :], mask=ms, other=0.0, cache_modifier=".cg")
        acc = tl.load(ACC + ((orow[:, None] * NUM_SPLITS + offs_s[None, :]) * HEAD_DIM)[:, :, None]
                      + offs_d[None, None, :], mask=ms[:, :, None], other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, axis=1)
        m_base = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_base[:, None])
        den = tl.sum(w * l, axis=1)
        o = tl.sum(acc * w[:, :, None], axis=1) / tl.where(den > 0.0, den, 1.0)[:, None]
        tl.store(OUT + orow[:, None] * HEAD_DIM + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=ok[:, None])


@triton_jit(do_not_specialize=["Hkv", "Hsel", "R", "T", "C", "S", "entries_per_split", "NUM_SPLITS"])
def _indexed_attention_fwd_kernel(
    Q, K, V, BIAS, INDEX,
    OUT,  # [B, Hq, T, D] q's dtype (SPLIT False), or fp32 partial acc [B * Hq * T, NUM_SPLITS, D]
    M_PART, L_PART,  # fp32 [B * Hq * T, NUM_SPLITS], log2-domain running max and sum (SPLIT only)
    FINAL,  # [B, Hq, T, D] q's dtype: the output (SPLIT and FUSE_COMBINE only)
    SEM,  # int32 [>= B * Hsel * m_blocks] counters at 0, left at 0 (SPLIT and FUSE_COMBINE only)
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_bb, stride_bh, stride_bc,
    stride_ib, stride_ih, stride_is,
    # Hsel = Hkv (R = G) or Hq (R = 1); qk_scale = scale * log2(e), or with SOFTCAP scale / softcap and
    # softcap_log2 = softcap * log2(e) (unused without SOFTCAP)
    Hkv, Hsel, R, T, C, S, entries_per_split, qk_scale, softcap_log2,
    NUM_SPLITS,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SOFTCAP: tl.constexpr,  # soft-cap the scores: softcap * tanh(scale * q·k / softcap), before the bias
    FUSE_COMBINE: tl.constexpr,  # the last split of a tile to finish merges the tile's partials (no combine launch)
    BLOCK_S: tl.constexpr,  # >= NUM_SPLITS, a power of two (FUSE_COMBINE)
    RB: tl.constexpr,  # rows merged at a time (FUSE_COMBINE)
    PDL: tl.constexpr,  # launched as a programmatic dependent launch: wait for the previous grid, free the next
    EARLY_V: tl.constexpr,  # issue the value loads with the key loads (else after the softmax)
):
    LOG2E: tl.constexpr = 1.4426950408889634
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_s = tl.program_id(0)
    pid_sel = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_sel // Hsel
    hsel = pid_sel % Hsel
    h = hsel // (Hsel // Hkv)  # the KV head: hsel (per KV head) or hq // G (per query head)
    Hq = Hsel * R

    # -- rows of the tile: (query t, head g of the selection row) ---------------------------------
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R * T
    t = rows // R
    hq = hsel * R + rows % R
    offs_d = tl.arange(0, HEAD_DIM)

    # load q: it stays in registers for the whole entry range (rows past R * T load 0 and are never stored)
    q_ptrs = Q + b.to(tl.int64) * stride_qb + hq[:, None] * stride_qh + t[:, None] * stride_qt
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)

    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    index_base = INDEX + b.to(tl.int64) * stride_ib + hsel.to(tl.int64) * stride_ih

    # output row (b, hq, t) of the contiguous [B, Hq, T, *] outputs
    out_row = (b.to(tl.int64) * Hq + hq) * T + t

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # this program's entries: [n_start, n_start + entries_per_split) clipped to S (the last split is shorter)
    n_start = pid_s * entries_per_split
    n_end = tl.minimum(n_start + entries_per_split, S)
    for n0 in range(n_start, n_end, BLOCK_N):
        # -- the tile's entries: slot ids, -1 (or anything outside [0, C)) reads nothing ---------------
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(index_base + offs_n * stride_is, mask=offs_n < n_end, other=-1)
        valid = (slot >= 0) & (slot < C)
        slot = slot.to(tl.int64)
        # bias, keys and values all wait on the index only: issued together
        bias = tl.load(bias_base + slot * stride_bc, mask=valid, other=float("-inf"))
        k = tl.load(k_base + slot[:, None] * stride_kc + offs_d[None, :] * stride_kd, mask=valid[:, None], other=0.0)
        if EARLY_V:  # with the keys: one round trip for both (a short row's tile is all its work)
            v = tl.load(v_base + slot[:, None] * stride_vc + offs_d[None, :] * stride_vd, mask=valid[:, None],
                        other=0.0)

        # -- scores: scale * q·k (soft-capped) + bias; -inf where the entry is skipped or the slot empty --
        if Q.dtype.element_ty == tl.float32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        # (the casts: Inductor may hand the float scalars over as fp64)
        if SOFTCAP:
            # tanh in natural units (qk_scale = scale / softcap), times softcap * log2(e); a skipped entry's q·k
            # reads 0: tanh(0) = 0, then + its bias -inf
            capped = libdevice.tanh((qk * qk_scale).to(tl.float32))
            s = (capped * softcap_log2).to(tl.float32) + (bias * LOG2E)[None, :]
        else:
            s = (qk * qk_scale).to(tl.float32) + (bias * LOG2E)[None, :]

        # -- online softmax (base 2); a row that has seen nothing yet keeps m = -inf, l = 0 --------
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # -- accumulate p @ v -------------------------------------------------------------------------
        if not EARLY_V:
            v = tl.load(v_base + slot[:, None] * stride_vc + offs_d[None, :] * stride_vd, mask=valid[:, None],
                        other=0.0)
        if V.dtype.element_ty == tl.float32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(V.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # -- epilogue: output row (b, hq, t), contiguous [B, Hq, T, D] --------------------------------------
    if SPLIT:
        tl.store(OUT + (out_row[:, None] * NUM_SPLITS + pid_s) * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(M_PART + out_row * NUM_SPLITS + pid_s, m_i, mask=row_ok)
        tl.store(L_PART + out_row * NUM_SPLITS + pid_s, l_i, mask=row_ok)
        if FUSE_COMBINE:
            tl.debug_barrier()  # the program's partials before its arrival (released by the atomic)
            tile = pid_sel.to(tl.int64) * tl.num_programs(2) + pid_m
            if tl.atomic_add(SEM + tile, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                tl.store(SEM + tile, 0)  # every split has arrived: ready for the next launch
                _combine_tile(FINAL, OUT, M_PART, L_PART, b, hsel, pid_m * BLOCK_M,
                              tl.minimum(pid_m * BLOCK_M + BLOCK_M, R * T), Hq, R, T, NUM_SPLITS, HEAD_DIM, BLOCK_S,
                              RB)
    else:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row that saw nothing: acc == 0, o == 0
        tl.store(OUT + out_row[:, None] * HEAD_DIM + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def _launch_config(B, Hsel, R, T, S, D, num_sms, itemsize=2, block_m=None, block_n=None, num_splits=None,
                   num_warps=None, num_stages=None, fuse_combine=None, combine_rows=None, pdl=False, early_v=None):
    """Block sizes, split count and launch options from the shapes alone (never the data, so CUDA graphs and
    Inductor see one fixed launch). R: rows per query of a selection row (G per KV head, 1 per query head).
    The keyword overrides are for the tests (small splits) and the benchmark's sweep.

    Defaults: clustered_attention's decode choices (4 warps, 2 stages, M >= 16 rows for tl.dot) with 64-entry
    tiles (1344 entries: 21 tiles; 128 in the cases below), and splits up to two programs per SM as there, but
    down to ONE tile per split (clustered_attention keeps >= 2): a ClusterKV call is short and latency-bound, so
    every tile in flight at once beats pipelining two tiles in one program.
    """
    rows = R * T
    if block_m is None:
        block_m = min(max(triton.next_power_of_2(rows), 16), 64)  # tl.dot needs M >= 16
    m_blocks = triton.cdiv(rows, block_m)
    if num_stages is None:
        num_stages = 2
    if block_n is None:
        # 128-entry tiles at decode (16-row tiles) per KV head, and per query head where each row gets one split
        # anyway (B 8): -0.3 to -3 us per ClusterKV step (H100, kvrewrite.bench.clusterkv_attention --sweep); per
        # query head at B 1 (several splits per row) they measured -0.3 to +0.8 us: 64 there
        block_n = 128 if block_m == 16 and (rows > 1 or 2 * num_sms // (B * Hsel * m_blocks) <= 1) else 64
        while 2 * num_stages * block_n * D * itemsize > 128 * 1024 and block_n > 16:  # K and V tiles in smem
            block_n //= 2
    if num_warps is None:
        num_warps = 4
    tiles = triton.cdiv(S, block_n)
    if num_splits is None:
        num_splits = max(1, 2 * num_sms // (B * Hsel * m_blocks))
    tiles_per_split = triton.cdiv(tiles, min(max(num_splits, 1), tiles))
    num_splits = triton.cdiv(tiles, tiles_per_split)  # no empty split
    if early_v is None:  # the value loads beside the key loads when a split is one tile (per KV head at B 1:
        early_v = tiles_per_split == 1  # -0.7 to -1.5 us per step); a loop keeps the late loads (early: up to +9 us)
    block_s = max(triton.next_power_of_2(num_splits), 2)
    if fuse_combine is None:  # the last split merges when a tile has several rows (per KV head): measured -0.3 us
        fuse_combine = rows > 1  # there, +0.3-0.6 us per query head (one row per tile: the combine launch wins)
    if combine_rows is None:  # rows merged at a time by the last split: up to 16k fp32 partials in registers
        combine_rows = max(1, min(triton.next_power_of_2(min(rows, block_m)), 16384 // (block_s * D)))
    return dict(block_m=block_m, m_blocks=m_blocks, block_n=block_n, num_splits=num_splits,
                entries_per_split=tiles_per_split * block_n, num_warps=num_warps, num_stages=num_stages,
                fuse_combine=fuse_combine, block_s=block_s, combine_rows=combine_rows, pdl=pdl, early_v=early_v)


def triton_indexed_attention(q, keys, values, bias, index, scale, softcap=0.0, **tuning):
    """The op on CUDA through Triton (shapes and dtypes in the module docstring); validates shapes, dtypes,
    devices and softcap, not the index's entries (a data read: entries outside [0, C) are skipped like -1).

    ``tuning`` overrides the shape-based launch choices (block_m, block_n, num_splits, num_warps, num_stages,
    fuse_combine, combine_rows, pdl, early_v);
    for the tests and the benchmark's sweep, the op never passes it."""
    if triton is None:
        raise NotImplementedError("triton_indexed_attention needs Triton (pip install triton); "
                                  "kvrewrite::indexed_attention itself runs without it")
    name = "triton_indexed_attention"
    D = check_inputs(name, q, keys, values, bias, index, softcap)[3]
    if D not in _HEAD_DIMS:
        raise ValueError(f"{name}: head dim D must be one of {_HEAD_DIMS}, got D={D}")
    check_one_cuda_device(name, (q, keys, values, bias, index))
    if softcap > 0 and libdevice is None:
        raise NotImplementedError(f"{name}: softcap > 0 needs triton.language.extra.libdevice (Triton >= 3.0) "
                                  "for tanh")
    return _launch(q, keys, values, bias, index, scale, softcap, **tuning)


def _launch(q, keys, values, bias, index, scale, softcap=0.0, **overrides):
    """Allocate the output (and the split partials) and launch the kernel, then the combine when split. No
    checks: Triton's interpreter (TRITON_INTERPRET=1) runs it on CPU tensors, which is how the kernel is tested
    without a GPU (tests/kernels/test_indexed_attention_triton.py)."""
    # int(): the launch depends on the shapes, so a dynamic-shape trace specialises on them (a guard)
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C = int(keys.shape[1]), int(keys.shape[2])
    Hsel, S = int(index.shape[1]), int(index.shape[2])
    out = torch.empty((B, Hq, T, D), dtype=q.dtype, device=q.device)
    if S == 0 or out.numel() == 0:  # no entry: every query gets zeros (the shapes decide: traceable)
        return out.zero_()
    R = Hq // Hsel  # rows per query: G (index per KV head) or 1 (per query head)
    num_sms = _num_sms(q.device) if q.is_cuda else 8  # 8: Triton's interpreter on CPU tensors
    cfg = _launch_config(B, Hsel, R, T, S, D, num_sms, q.element_size(), **overrides)
    n_splits = cfg["num_splits"]
    split = n_splits > 1
    if softcap > 0:  # the cap in natural units, then the base-2 domain (kernel signature)
        qk_scale, softcap_log2 = scale / softcap, softcap * 1.4426950408889634
    else:
        qk_scale, softcap_log2 = scale * 1.4426950408889634, 0.0
    if split:
        part = torch.empty((B * Hq * T, n_splits, D), dtype=torch.float32, device=q.device)
        m_part = torch.empty((B * Hq * T, n_splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty((B * Hq * T, n_splits), dtype=torch.float32, device=q.device)
    else:
        part = m_part = l_part = out  # M_PART and L_PART are never touched without splits
    fuse = split and cfg["fuse_combine"]
    sem = counters("kvrewrite::indexed_attention", q, B * Hsel * cfg["m_blocks"]) if fuse else out
    wrap_triton(_indexed_attention_fwd_kernel)[(n_splits, B * Hsel, cfg["m_blocks"])](
        q, keys, values, bias, index, part, m_part, l_part, out, sem,
        *q.stride(), *keys.stride(), *values.stride(), *bias.stride(), *index.stride(),
        Hkv, Hsel, R, T, C, S, cfg["entries_per_split"], qk_scale, softcap_log2, n_splits,
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], SPLIT=split, SOFTCAP=softcap > 0,
        FUSE_COMBINE=fuse, BLOCK_S=cfg["block_s"], RB=cfg["combine_rows"], PDL=cfg["pdl"], EARLY_V=cfg["early_v"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({"launch_pdl": True} if cfg["pdl"] else {}),
    )
    if split and not fuse:  # clustered_attention's combine: row = (b, hq, t); no lse, no pending queries (unused: out)
        wrap_triton(_clustered_attention_combine_kernel)[(B * Hq * T,)](
            part, m_part, l_part, out, out, q, out, index, q.stride(0), q.stride(1), q.stride(3), n_splits, Hq,
            Hq // Hkv, HEAD_DIM=D, BLOCK_S=max(triton.next_power_of_2(n_splits), 2), WRITE_LSE=False,
            SAVE_Q=False, NPEND=1, PDL=False, TRIGGER_FIRST=False, num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------


@torch.library.custom_op("kvrewrite::indexed_attention_cpu", mutates_args=(), device_types="cpu")
def indexed_attention_cpu(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    index: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The CPU path of kvrewrite::indexed_attention, an opaque op of its own: the reference, which checks the
    index's entries (a host read: free on the CPU, untraceable, so the triton_op calls this op)."""
    return reference_indexed_attention(q, keys, values, bias, index, scale, softcap).contiguous()


@indexed_attention_cpu.register_fake
def _(q, keys, values, bias, index, scale, softcap=0.0):
    return q.new_empty(q.shape)  # contiguous, like the real output (empty_like would copy q's strides)


def indexed_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    index: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention over the slots listed in index (see the module docstring).

    This body is the op's kernel, its fake (traced on fake tensors) and, under torch.compile, what Inductor
    inlines: it checks shapes and dtypes only (no data-dependent Python); CPU calls the opaque
    kvrewrite::indexed_attention_cpu, CUDA launches the Triton kernel.
    """
    if q.is_cuda and triton is not None:
        return triton_indexed_attention(q, keys, values, bias, index, scale, softcap)
    check_inputs("indexed_attention", q, keys, values, bias, index, softcap)
    if q.device.type == "cpu":
        return torch.ops.kvrewrite.indexed_attention_cpu(q, keys, values, bias, index, scale, softcap)
    return reference_indexed_attention(q, keys, values, bias, index, scale, softcap).contiguous()


indexed_attention = register_triton_op("kvrewrite::indexed_attention", indexed_attention, (), triton is not None)
