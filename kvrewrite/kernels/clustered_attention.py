"""kvrewrite::clustered_attention — degree-biased attention of new queries over a layer's slots.

    o[t] = sum_j exp(z_tj + b_j) v_j / sum_j exp(z_tj + b_j),
    z_tj = scale * q[t]·k_j,  or with softcap > 0:  z_tj = softcap * tanh(scale * q[t]·k_j / softcap)

over the slots j visible to query t: slot_pos[j] <= cache_position[t] (causality, which also covers
the fresh tokens of a prefill chunk written just before), and, for a sliding-window layer
(window > 0), slot_pos[j] > cache_position[t] - window. b_j = log n_j is the slot's degree bias
(0 for an exact token, -inf for an empty or padding slot), so merging identical keys is exact
(Chelsea eq. 2). GQA is index math: query head h reads KV head h // (Hq // Hkv). An empty slot's keys
and values must be finite (the state keeps them so: zero-initialised, then written only with the
model's keys and values or merges of them): the CUDA kernel reads every slot for prefill-sized query
blocks and masks by score, and 0 x inf would be NaN. The soft cap (Gemma-2, and Gemma-3 with
attn_logit_softcapping set) applies to the scaled score alone: the degree bias and the -inf of an
invisible slot are added after it, as Hugging Face's eager attention adds its mask after the cap.

Args:
    q:              [B, Hq, T, D]   model dtype
    keys, values:   [B, Hkv, C, D]  model dtype
    bias:           [B, Hkv, C]     fp32
    slot_pos:       [B, Hkv, C]     int64
    cache_position: [T]             int64
    scale:          softmax scale (the model's, e.g. D**-0.5)
    window:         sliding window of the layer, 0 for none
    past_only:      the caller's promise that no used slot lies after any query position (every slot with
                    bias > -inf has slot_pos <= min(cache_position)); then the causal test is redundant and
                    the CUDA kernel skips reading slot_pos when window == 0 (8 bytes per slot; 1.5-7% of a
                    decode step's attention on an H100, docs/bench/attention_notes.md). The function is the
                    same either way. The CPU path and the reference check the promise (ValueError when it is
                    broken); the CUDA kernel cannot without the read it skips, so there a broken promise makes
                    future slots visible. The rewritten decode graph sets it (the runtime appends the query's
                    token before attending, and compression keeps slot_pos = the max of the merged tokens'),
                    prefill chunks do not (their fresh block is causal).
    softcap:        attention logit soft cap (the model's attn_logit_softcapping, e.g. 50.0 for Gemma-2), 0 for
                    none (the default: the function and every kernel are then those without the cap). Merging
                    identical keys stays exact under the cap: the cap acts per score, the bias outside it.
Returns:
    [B, Hq, T, D] in q's dtype, contiguous (whatever q's strides: q is often a transposed view,
    and Inductor checks the real output's strides against the fake's); a query that sees no slot
    gets zeros (padding queries).
Mutates: nothing.

Backends: CUDA runs the Triton kernel below (fp16/bf16/fp32, D in 16..256, a power of two), and for prefill
chunks whose grid needs no split the prefill kernels of kernels/_prefill_attention_kernels.py (PREFILL_KERNEL); CPU
runs fused SDPA over the used slots (softcap > 0: the fp32 logits written out, SDPA cannot cap); other
devices, and CUDA without Triton, run the reference.
The op is a `torch.library.triton_op`, so Inductor sees the Triton launch and CUDA graphs work.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import functools

import torch
from torch.library import wrap_triton

from kvrewrite.kernels import _pdl
from kvrewrite.kernels import _prefill_attention_kernels as _prefill
from kvrewrite.kernels._pdl import gdc_launch_dependents, gdc_wait, wait_and_signal
from kvrewrite.kernels._query_block import block_rows, query_block
from kvrewrite.kernels._triton_op import check_attention_shapes, check_one_cuda_device, register_triton_op, triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its PyTorch paths; only triton_clustered_attention raises
    triton = tl = None
try:
    # tanh for the SOFTCAP kernel. A global of this name is what Triton remaps to the backend's library (CUDA's
    # libdevice: __nv_tanhf); `tl.extra.libdevice.tanh` would reach only the unmapped stubs. Inductor's copy of
    # the kernel source resolves the name too: its kernel header imports the same module as `libdevice`.
    from triton.language.extra import libdevice
except ImportError:
    libdevice = None


def check_past_only(bias, slot_pos, cache_position, name="clustered_attention"):
    """ValueError unless every used slot (bias > -inf) lies at or before every query (past_only's promise).
    Reads the data: for the CPU path and the reference only (meta tensors hold none: nothing to check)."""
    if cache_position.numel() == 0 or slot_pos.device.type == "meta":
        return
    q_min = cache_position.min()
    late = (bias > float("-inf")) & (slot_pos > q_min)
    if bool(late.any()):
        b, h, c = (int(i) for i in late.nonzero()[0])
        raise ValueError(f"{name}: past_only=True, but used slot {c} of batch row {b}, KV head {h} holds position "
                         f"{int(slot_pos[b, h, c])}, after the query position {int(q_min)} ({int(late.sum())} such "
                         f"slots); pass past_only=False when slots may lie in a query's future (e.g. a prefill chunk)")


def check_softcap(softcap, name="clustered_attention"):
    """ValueError unless softcap is a finite number >= 0 (0: no cap). A negative cap would compute the cap of
    its absolute value (c * tanh(x / c) is even in c), a NaN no cap at all: both are caller bugs."""
    if not softcap >= 0 or softcap == float("inf"):
        raise ValueError(f"{name}: softcap must be a finite number >= 0 (0 = no cap), got {softcap}")


def reference_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only=False,
                                  softcap=0.0):
    """Plain-PyTorch reference. Load-bearing choices: fp32 logits, softmax and accumulation; the bias
    is added after scaling, and after the soft cap (softcap * tanh(logit / softcap), HF's order: divide,
    tanh, multiply) when softcap > 0; rows with no visible slot return 0 instead of NaN. past_only is checked
    (check_past_only) and changes nothing else: the causal mask is applied either way."""
    check_softcap(softcap, "reference_clustered_attention")
    if past_only:
        check_past_only(bias, slot_pos, cache_position, "reference_clustered_attention")
    B, Hq, T, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    qf = q.float().view(B, Hkv, G, T, D)
    logits = torch.einsum("bhgtd,bhcd->bhgtc", qf, keys.float()) * scale
    if softcap > 0:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits + bias[:, :, None, None, :]
    qp = cache_position[None, None, None, :, None]
    sp = slot_pos[:, :, None, None, :]
    visible = sp <= qp
    if window > 0:
        visible = visible & (sp > qp - window)
    logits = logits.masked_fill(~visible, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(logits - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgtc,bhcd->bhgtd", p, values.float()) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    return out.reshape(B, Hq, T, D).to(q.dtype)


def cpu_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, softcap=0.0):
    """The CPU path: the same function through PyTorch's fused SDPA with an additive fp32 mask
    (bias, -inf where invisible); query groups are folded into the query axis for GQA. SDPA cannot
    soft-cap, so with softcap > 0 the fp32 logits are written out (matmul, cap, + mask, softmax, matmul).
    Checked against the float64 spelling of the formula in tests/kernels/test_clustered_attention.py."""
    B, Hq, T, D = q.shape
    Hkv, C = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    qp = cache_position[None, None, :, None]
    sp = slot_pos[:, :, None, :]
    visible = sp <= qp
    if window > 0:
        visible = visible & (sp > qp - window)
    mask = bias[:, :, None, :].masked_fill(~visible, float("-inf"))  # [B, Hkv, T, C]
    seen = torch.isfinite(mask).any(dim=-1, keepdim=True)  # [B, Hkv, T, 1]
    mask = mask.masked_fill(~seen, 0.0)  # no NaN rows; their output is zeroed below
    mask = mask[:, :, None].expand(B, Hkv, G, T, C).reshape(B, Hkv, G * T, C)
    f32 = torch.float32
    qf, kf, vf = q.to(f32).reshape(B, Hkv, G * T, D), keys.to(f32), values.to(f32)
    if softcap > 0:
        logits = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        logits = torch.tanh(logits / softcap) * softcap + mask
        out = torch.matmul(torch.softmax(logits, dim=-1), vf)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    out = out.view(B, Hkv, G, T, D).masked_fill(~seen[:, :, None], 0.0)
    return out.reshape(B, Hq, T, D).to(q.dtype)


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA)
#
# One program owns one KV head of one batch row (GQA: its G query heads and a block of the T queries
# are the M rows of the tile, row = t * G + g, so each K/V tile is read once for the whole group), and
# one contiguous range of slots (split-K). With one split the program normalises and writes the output;
# with several (decode, where B * Hkv programs would leave most SMs idle) each writes an unnormalised
# partial (acc, running max m, sum l) and a combine kernel merges them, flash-decoding style. Both
# cases share the kernel: the slot loop is the same, only the range and the epilogue differ.
#
# Later methods (DESIGN.md §3) are meant as small edits of the slot loop: separate numerator and
# denominator weights (ClusterGen) load a second bias and keep two exponentials (one feeds acc, the
# other l); attention over a selected subset (ClusterKV) takes the slot offsets `offs_n` from an index
# tensor instead of an arange; per-slot key scaling (EMS) multiplies `qk` by a loaded per-slot factor.
# ---------------------------------------------------------------------------------------------------


# Shape ints that only bound loops and masks are not specialised on (value 1, multiple of 16): one
# compiled kernel then serves every C, T, G and window of a dtype and head dim.
@triton_jit(do_not_specialize=["Hkv", "G", "T", "C", "window", "NUM_SPLITS", "pend_scale"])
def _clustered_attention_fwd_kernel(
    Q, K, V, BIAS, POS, CPOS,
    OUT,  # [B, Hq, T, D] q's dtype (SPLIT False), or fp32 partial acc [B * Hq * T, NUM_SPLITS, D]
    M_PART, L_PART,  # fp32 [B * Hq * T, NUM_SPLITS], log2-domain running max and sum (SPLIT only)
    LOGITS,  # fp32 [B * Hq * T, C]: every row's masked log2-domain score of every slot (WRITE_LOGITS only)
    LSE,  # fp32 [B * Hq * T]: each row's natural-log log-sum-exp, -inf for a row that saw nothing (WRITE_LSE only)
    # kvrewrite::observed_attention's deferred statistics (PENDING: T == 1, the tile's rows [G, (NPEND + 1) G) are
    # free): NPEND entries of earlier steps' queries; entry e of a step at position c saw k_e = ((c - e - 1) mod
    # NPEND) + 1 steps ago (pending_steps_ago in observed_attention.py)
    PEND_Q,  # fp32 [B * Hkv * NPEND * G, D]: the entries' queries (PENDING); SAVE_Q: receives this step's
    PEND_LSE,  # fp32 [B * Hkv * NPEND * G]: their natural-log lse; +inf (empty) or -inf (it saw nothing) add 0
    SCORE,  # fp32 [B, Hkv, C], mutated (PENDING): += pend_scale * sum over the entries' rows of 2^(s - lse2)
    FILL,  # int64 [B, Hkv] (PENDING without LOAD_POS): the entry of k steps ago saw slots [0, fill - k)
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    stride_sb, stride_sh, stride_sc,
    stride_fb, stride_fh,
    # qk_scale = scale * log2(e); with SOFTCAP, qk_scale = scale / softcap and softcap_log2 = softcap * log2(e)
    # (unused without SOFTCAP)
    Hkv, G, T, C, window, slots_per_split, qk_scale, softcap_log2,
    NUM_SPLITS,
    pend_scale,  # 1 (sum over the group) or 1 / G (mean) (PENDING)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SKIP_UNSEEN: tl.constexpr,  # predicate off K/V reads of slots no query of the block can see
    LOAD_POS: tl.constexpr,  # False (past_only, window 0): slot_pos is not read, every used slot is visible
    HAS_WINDOW: tl.constexpr,  # window > 0 (only with LOAD_POS)
    CAUSAL_SKIP: tl.constexpr,  # test causality per element only in tiles holding a slot after the block's first query
    SOFTCAP: tl.constexpr,  # soft-cap the scores: softcap * tanh(scale * q·k / softcap), before the bias and masks
    WRITE_LOGITS: tl.constexpr,  # store s (kvrewrite::observed_attention's decode statistics)
    WRITE_LSE: tl.constexpr,  # store the log-sum-exp in the epilogue (without SPLIT; the combine does it with SPLIT)
    PENDING: tl.constexpr,  # fold the pending entries' attention into SCORE on the way (rows [G, (NPEND + 1) G))
    NPEND: tl.constexpr,  # pending entries (PENDING; 1 otherwise)
    DEFER: tl.constexpr,  # fold only at a step with c mod NPEND == 0 (else every entry: the empty ones add 0)
    SAVE_Q: tl.constexpr,  # store q and its lse as entry c mod NPEND, emptying the others after a fold (no SPLIT)
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel before any load (kernels/_pdl.py)
):
    LOG2E: tl.constexpr = 1.4426950408889634
    if PDL:  # every input (q, the slots, the bias the append just wrote) comes from earlier kernels
        gdc_wait()
        gdc_launch_dependents()
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    Hq = Hkv * G

    # -- rows of the tile: (query t, head g of the group); q stays in registers for the whole slot range --------
    rows, row_ok, t, hq, offs_d = block_rows(h, pid_m, G, T, BLOCK_M, HEAD_DIM)
    q, qpos, qpos_min, qpos_max, q_rel = query_block(Q, CPOS, b, row_ok, t, hq, offs_d, stride_qb, stride_qh,
                                                     stride_qt, stride_qd)
    lo = -1
    if PENDING:
        # rows [G, (NPEND + 1) G): the NPEND pending entries (G heads each) of earlier decode steps; entry e is at
        # position qpos_min - k_e (q_rel -k_e): it saw every slot this step's query sees but the k_e newest. Its
        # probability 2^(s - lse2) of every slot goes into SCORE (rows not folded get lse2 = +inf: 0)
        r = qpos_min % NPEND
        if DEFER:
            fold = r == 0
        else:
            fold = r >= 0
        e = (rows - G) // G
        pend = (rows >= G) & (rows < (NPEND + 1) * G) & fold
        k_ago = tl.where(e < r, r - e, r - e + NPEND).to(tl.int32)
        prow = (b.to(tl.int64) * Hkv + h) * (NPEND * G) + rows - G
        pq = tl.load(PEND_Q + prow[:, None] * HEAD_DIM + offs_d[None, :], mask=pend[:, None], other=0.0)
        q = tl.where(pend[:, None], pq.to(Q.dtype.element_ty), q)
        plse = tl.load(PEND_LSE + prow, mask=pend, other=float("inf"))
        plse2 = tl.where(plse == float("-inf"), float("inf"), plse * LOG2E)
        q_rel = tl.where(pend, -k_ago, q_rel)
        lo = -NPEND
        score_base = SCORE + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
        if not LOAD_POS:  # past_only: this step's token is the slot cache_append just wrote, fill - 1
            n_seen = tl.load(FILL + b.to(tl.int64) * stride_fb + h.to(tl.int64) * stride_fh) - k_ago
    if HAS_WINDOW:
        lo = lo - window

    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    pos_base = POS + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph

    # output row (b, hq, t) of the contiguous [B, Hq, T, *] outputs
    out_row = (b.to(tl.int64) * Hq + hq) * T + t

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # this program's slots: [n_start, n_start + slots_per_split) clipped to C (the last split is shorter)
    n_start = pid_s * slots_per_split
    n_end = tl.minimum(n_start + slots_per_split, C)
    for n0 in range(n_start, n_end, BLOCK_N):
        # -- slot metadata: bias (-inf = empty), and position relative to the block's first query ----
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_end
        bias = tl.load(bias_base + offs_n * stride_bc, mask=n_ok, other=float("-inf"))
        if PENDING:  # loaded early: its latency hides behind the keys' (no dependence on them)
            old_score = tl.load(score_base + offs_n * stride_sc, mask=n_ok & fold, other=0.0)
        if LOAD_POS:
            pos = tl.load(pos_base + offs_n * stride_pc, mask=n_ok, other=0)
            p_rel = tl.minimum(tl.maximum(pos - qpos_min, lo), 2**30).to(tl.int32)
            if SKIP_UNSEEN:
                need = (bias > float("-inf")) & (pos <= qpos_max)
                if HAS_WINDOW:
                    need = need & (pos > qpos_min - window)
            else:
                need = n_ok
        else:
            if SKIP_UNSEEN:
                need = bias > float("-inf")
            else:
                need = n_ok
        # the bias in the log2 domain, -inf where no row needs the slot: its score is -inf whatever the row
        # (with SKIP_UNSEEN its K/V are not read either: q·k reads 0 there)
        bias2 = tl.where(need, bias * LOG2E, float("-inf"))

        # -- scores: scale * q·k (soft-capped) + bias, -inf where the slot is not visible to the row --
        k = tl.load(k_base + offs_n[:, None] * stride_kc + offs_d[None, :] * stride_kd, mask=need[:, None], other=0.0)
        if Q.dtype.element_ty == tl.float32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        # (the casts: Inductor may hand the float scalars over as fp64)
        if SOFTCAP:
            # the cap works in natural units: tanh(scale * q·k / softcap) (qk_scale = scale / softcap), times
            # softcap * log2(e) to reach the base-2 domain; CUDA's tanhf (libdevice, 2 ulp; no 1 - 2 / (e^2x + 1)
            # cancellation near 0) saturates to +-1 for large arguments. An unneeded slot's q·k reads 0:
            # tanh(0) = 0, then + bias2 = -inf.
            capped = libdevice.tanh((qk * qk_scale).to(tl.float32))
            s = (capped * softcap_log2).to(tl.float32) + bias2[None, :]
        else:
            s = (qk * qk_scale).to(tl.float32) + bias2[None, :]
        if LOAD_POS:
            if CAUSAL_SKIP:
                # a tile whose slots all lie at or before the block's first query is visible to every row (with
                # PENDING: at or before the oldest entry's position)
                if tl.max(tl.where(need, p_rel, -NPEND - 1), axis=0) > (-NPEND if PENDING else 0):
                    s = tl.where(p_rel[None, :] <= q_rel[:, None], s, float("-inf"))
            else:
                s = tl.where(p_rel[None, :] <= q_rel[:, None], s, float("-inf"))
            if HAS_WINDOW:
                s = tl.where(p_rel[None, :] > q_rel[:, None] - window, s, float("-inf"))
        if WRITE_LOGITS:  # the final score of every (row, slot): -inf where invisible, empty or unneeded
            tl.store(LOGITS + out_row[:, None] * C + offs_n[None, :], s, mask=row_ok[:, None] & n_ok[None, :])
        if PENDING and not LOAD_POS:
            s = tl.where(pend[:, None] & (offs_n[None, :] >= n_seen[:, None]), float("-inf"), s)

        # -- online softmax (base 2); a row that has seen nothing yet keeps m = -inf, l = 0 --------
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        if PENDING:
            # the pending rows subtract their known lse instead of a running max, so the same exp2 gives their
            # probabilities (their m, l and acc are never stored); each slot belongs to one program: a plain
            # read-modify-write of its score, deterministic
            m_base = tl.where(pend, plse2, m_base)
            alpha = tl.where(pend, 1.0, alpha)
        p = tl.exp2(s - m_base[:, None])
        if PENDING:
            col = tl.sum(tl.where(pend[:, None], p, 0.0), axis=0) * pend_scale
            tl.store(score_base + offs_n * stride_sc, old_score + col, mask=n_ok & fold)
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # -- accumulate p @ v -------------------------------------------------------------------------
        v = tl.load(v_base + offs_n[:, None] * stride_vc + offs_d[None, :] * stride_vd, mask=need[:, None], other=0.0)
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
    else:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row that saw nothing: acc == 0, o == 0
        tl.store(OUT + out_row[:, None] * HEAD_DIM + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) / LOG2E, float("-inf"))
        if SAVE_Q:  # entry r (after PENDING's reads: without SPLIT this program is the only one of its rows);
            # after a fold the other entries are emptied (the rows that held them, pend & e >= 1)
            srow = (b.to(tl.int64) * Hkv + h) * (NPEND * G) + r * G + rows
            tl.store(PEND_Q + srow[:, None] * HEAD_DIM + offs_d[None, :], q.to(tl.float32), mask=row_ok[:, None])
            tl.store(PEND_LSE + srow, lse, mask=row_ok)
            tl.store(PEND_LSE + prow, float("inf"), mask=pend & (e >= 1))
        elif WRITE_LSE:
            tl.store(LSE + out_row, lse, mask=row_ok)


@triton_jit()
def combine_row(ACC, M_PART, L_PART, OUT, row, NUM_SPLITS, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge one output row's split partials into OUT[row]; returns the row's natural-log log-sum-exp (-inf for
    a row that saw nothing). Shared by the combine kernel and kvrewrite::observed_attention's."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    # rescale each split's (acc, l) to the row's overall max; splits that saw nothing weigh 0
    m = tl.load(M_PART + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    l = tl.load(L_PART + row * NUM_SPLITS + offs_s, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_base = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_base)
    den = tl.sum(w * l, axis=0)
    acc_ptrs = ACC + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=s_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    tl.store(OUT + row * HEAD_DIM + offs_d, o.to(OUT.dtype.element_ty))
    return tl.where(den > 0.0, (m_base + tl.log2(tl.where(den > 0.0, den, 1.0))) * 0.6931471805599453,
                    float("-inf"))


@triton_jit(do_not_specialize=["NUM_SPLITS", "Hq", "G"])
def _clustered_attention_combine_kernel(
    ACC, M_PART, L_PART, OUT,  # partials as written by the fwd kernel; OUT [B * Hq * T, D]
    LSE,  # fp32 [B * Hq * T], natural log (WRITE_LSE only); with SAVE_Q: PEND_LSE
    Q, PEND_Q, CPOS,  # q [B, Hq, 1, D], the pending entries (SAVE_Q only, T == 1: the fwd kernel's PEND_Q)
    stride_qb, stride_qh, stride_qd,
    NUM_SPLITS, Hq, G,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    SAVE_Q: tl.constexpr,  # q and lse into entry c mod NPEND; the other entries emptied at c mod NPEND == 0
    NPEND: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: wait for the split kernel first (kernels/_pdl.py)
    TRIGGER_FIRST: tl.constexpr,  # with PDL: let the next kernel launch before the wait (_pdl.TRIGGER_FIRST)
):
    if PDL:
        wait_and_signal(TRIGGER_FIRST)
    row = tl.program_id(0).to(tl.int64)
    if SAVE_Q:  # loaded first, stored last: their latency overlaps the partials'
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + (row // Hq) * stride_qb + (row % Hq) * stride_qh + offs_d * stride_qd)
        r = tl.load(CPOS) % NPEND
    lse = combine_row(ACC, M_PART, L_PART, OUT, row, NUM_SPLITS, HEAD_DIM, BLOCK_S)
    if SAVE_Q:
        entry0 = (row // G) * (NPEND * G) + row % G  # entry 0 of this row's head (b, h, g)
        tl.store(PEND_Q + (entry0 + r * G) * HEAD_DIM + offs_d, q.to(tl.float32))
        tl.store(LSE + entry0 + r * G, lse)
        for e in tl.static_range(1, NPEND):
            tl.store(LSE + entry0 + e * G, float("inf"), mask=r == 0)
    elif WRITE_LSE:
        tl.store(LSE + row, lse)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)


def _num_sms(device: torch.device) -> int:
    return _num_sms_of(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _num_sms_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Programs of the decode kernel one SM holds at once (bf16, D = 128, Hopper: 65536 registers and 227 KB of shared
# memory per SM; Triton 3.6 compiles the plain kernel to 152 registers a thread and 73.7 KB, three per SM, and the one
# with observed_attention's pending rows to 196 registers, two per SM; H200 sweep, docs/bench/attention_notes.md
# "Large batches"; kvrewrite/bench/occupancy.py recomputes them without a GPU and a test holds these to it).
# launch_forward passes them to _launch_config, which splits a decode grid the SMs cannot hold.
RESIDENT_PROGRAMS, RESIDENT_PROGRAMS_PENDING = 3, 2

# Prefill-sized query blocks (more than 16 rows) whose grid needs no splits run kernels/_prefill_attention_kernels.py
# (tile ranges, a bounded loop, masks only where a tile is not seen whole); False runs the slot-loop kernel below
# for them too (an A/B switch: `--kernel-option clustered_attention.PREFILL_KERNEL=False`). H200, bf16, Llama layout,
# a 32k prompt's chunk of 2048 over 6.6k compressed slots: 6.27-6.31 ms against 9.17-9.19 at batch 8 (the new kernel
# in one device call, the slot loop in two), 0.89-0.99 against 1.11-1.12 at batch 1 (two interleaved rounds); `full`'s
# chunk of 1024 over 16k used slots 0.95 against 2.09-2.11; docs/bench.md "Stop 41 runs".
PREFILL_KERNEL = True
# Also the prefill-sized grids the slot loop would split (fewer than two programs per SM: chunks of <= 256 queries at
# batch 1 in the Llama layout), unsplit: each program walks every tile its block sees. Off until timed (`python -m
# kvrewrite.bench.attention_prefill --ab` times it; chunk 256 at batch 1 took 0.92 ms in the slot loop with 3 splits,
# 9x cuDNN's time on the same dense data, docs/bench.md "Stop 41 runs").
PREFILL_SPLIT_GRIDS = False


def fewest_waves_splits(programs: int, capacity: int, max_splits: int = 8) -> int:
    """The split count S in [1, max_splits] whose grid of programs * S programs, each 1/S of the work, ends soonest
    when capacity of them run at once: the least ceil(programs * S / capacity) / S (whole waves of S-times shorter
    programs), the smallest such S on ties (fewer partials to combine)."""
    best = 1
    for S in range(2, max_splits + 1):
        if -(-programs * S // capacity) * best < -(-programs * best // capacity) * S:
            best = S
    return best


def _launch_config(B, Hkv, G, T, C, D, num_sms, itemsize=2, block_m=None, block_n=None, num_splits=None,
                   num_warps=None, num_stages=None, skip_unseen=None, resident=None):
    """Block sizes, split count and launch options from the shapes alone (never the data, so CUDA graphs
    and Inductor see one fixed launch). The keyword overrides are for the benchmark's tuning sweep.

    4 warps and 2 stages throughout; what the sweeps on an H100 found best (Llama-3.1-8B layout, bf16):
    - decode (G * T <= 16 rows; kvrewrite/bench/attention.py): 128-slot tiles, K/V reads of empty slots
      predicated off (skip_unseen: a decode step is bandwidth-bound); 8 warps, 64- or 32-slot tiles, 3-4
      stages were 1-40% slower; the split count below;
    - prefill chunks (kvrewrite/bench/attention_prefill.py: T = 1024 and 2048 queries over ~7k compressed
      slots plus the causal fresh block): 64-row query tiles, 64-slot tiles, every slot's K/V read
      (skip_unseen False: the reads no longer wait on the bias loads, so the loop pipelines): 2.5-3.0x the
      previous launch at T = 1024 (1.49 -> 0.49-0.59 ms) and 20% faster than 128-slot tiles with skip_unseen;
      128-row tiles and 8 warps were no faster. Reading empty slots is why their K/V must be finite
      (module docstring). Such chunks now run the prefill kernels where no split is needed (PREFILL_KERNEL); this
      launch still serves the split ones (small chunks at batch 1) and PREFILL_KERNEL = False.
    resident: programs one SM holds at once (RESIDENT_PROGRAMS...). Where a decode grid at one split has more
    programs than the SMs hold (B * Hkv > resident * SMs: large batches; the last of them would run in a
    second, partial wave), the split count is fewest_waves_splits over that capacity instead of 1: on an H200
    at 6.7k slots the pending rows' kernel (two per SM) took 367 us at B = 40 with 1 split and 287 with the
    rule's 4, at B = 48 377 and 332 (2); the plain kernel (three per SM) at B = 64 455 and 417 (3), and at
    B = 40 and 48, where its grid fits, 1 split stays the fastest. None keeps 1 (the other kernels that share
    this config have not been measured there).
    Splits are whole tiles. Balanced boundaries (C / splits slots each, to 16 slots: 33 splits of ~200 slots at
    B = 1 and 6.6k slots instead of 26 of 256) were built and measured slower on an H200 in stop 39 (16.2-18.8
    us a call against 15.3; docs/bench/sweep_attention_h200_balance_stop39.json), then removed.
    """
    rows = G * T  # M rows of one (b, kv head): every query head of the group at every query
    if block_m is None:
        block_m = min(max(triton.next_power_of_2(rows), 16), 64)  # tl.dot needs M >= 16
    m_blocks = triton.cdiv(rows, block_m)
    decode = block_m <= 16
    if skip_unseen is None:
        skip_unseen = decode
    if num_stages is None:
        num_stages = 2
    if block_n is None:
        block_n = 128 if decode else 64
        while 2 * num_stages * block_n * D * itemsize > 128 * 1024 and block_n > 16:  # K and V tiles in smem
            block_n //= 2
    if num_warps is None:
        num_warps = 4
    tiles = triton.cdiv(C, block_n)
    if num_splits is None:
        if decode:
            # the most splits that keep the grid within two programs per SM: one wave, and no SM running
            # a third program while the others wait for it (H100 sweep, B = 1, 2, 4, 8, 16, C = 4k to 128k:
            # the best count measured at every size; one split more was up to 5% slower. B = 8 gets 4
            # splits = 256 programs; 5 splits (320) ran 3-5% slower, 32 splits 1-3%;
            # docs/bench/attention_notes.md)
            num_splits = max(1, 2 * num_sms // (B * Hkv * m_blocks))
            if resident is not None and B * Hkv * m_blocks > resident * num_sms:  # not all resident at 1 split
                num_splits = fewest_waves_splits(B * Hkv * m_blocks, resident * num_sms)
        else:
            num_splits = triton.cdiv(2 * num_sms, B * Hkv * m_blocks)  # prefill: cover the SMs twice
        num_splits = min(num_splits, tiles // 2)  # >= 2 tiles per split
    tiles_per_split = triton.cdiv(tiles, min(max(num_splits, 1), tiles))
    num_splits = triton.cdiv(tiles, tiles_per_split)  # no empty split
    return dict(block_m=block_m, m_blocks=m_blocks, block_n=block_n, num_splits=num_splits,
                slots_per_split=tiles_per_split * block_n, num_warps=num_warps, num_stages=num_stages,
                skip_unseen=skip_unseen)


def _check_inputs(q, keys, values, bias, slot_pos, cache_position, window, softcap=0.0):
    name = "triton_clustered_attention"
    B, Hq, T, D, Hkv, C = check_attention_shapes(name, q, keys, bias, slot_pos, cache_position)
    if values.shape != keys.shape:
        raise ValueError(f"{name}: values must be shaped like keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if C == 0:
        raise ValueError(f"{name}: the state has no slots (C = 0)")
    if q.dtype not in _DTYPES or keys.dtype != q.dtype or values.dtype != q.dtype:
        raise TypeError(f"{name}: q, keys and values must share one dtype of fp16/bf16/fp32, "
                        f"got {q.dtype}, {keys.dtype}, {values.dtype}")
    if bias.dtype != torch.float32 or slot_pos.dtype != torch.int64 or cache_position.dtype != torch.int64:
        raise TypeError(f"{name}: expected bias fp32, slot_pos and cache_position int64, "
                        f"got {bias.dtype}, {slot_pos.dtype}, {cache_position.dtype}")
    if D not in _HEAD_DIMS:
        raise ValueError(f"{name}: head dim D must be one of {_HEAD_DIMS}, got D={D}")
    check_one_cuda_device(name, (q, keys, values, bias, slot_pos, cache_position))
    if window < 0:
        raise ValueError(f"{name}: window must be >= 0 (0 = no window), got {window}")
    check_softcap(softcap, name)


def triton_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only=False,
                               softcap=0.0, **tuning):
    """The op on CUDA through Triton (shapes and dtypes in the module docstring); validates its inputs,
    but cannot check past_only's promise (that would read slot_pos, the read past_only saves).

    ``tuning`` overrides the shape-based launch choices (block_n, num_splits, num_warps, num_stages,
    skip_unseen); it is for the benchmark's sweep, the op never passes it.
    """
    if triton is None:
        raise NotImplementedError("triton_clustered_attention needs Triton (pip install triton); "
                                  "kvrewrite::clustered_attention itself runs without it")
    _check_inputs(q, keys, values, bias, slot_pos, cache_position, window, softcap)
    if softcap > 0 and libdevice is None:
        raise NotImplementedError("triton_clustered_attention: softcap > 0 needs triton.language.extra.libdevice "
                                  "(Triton >= 3.0) for tanh")
    return _launch(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only, softcap, **tuning)


def _launch(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only=False, softcap=0.0,
            causal_skip=True, lse=None, pending=None, save_q=None, **overrides):
    """Allocate the output (and the split partials) and launch. No checks: Triton's interpreter
    (TRITON_INTERPRET=1) runs it on CPU tensors, which is how the kernel can be debugged without a GPU.

    past_only with window 0 skips the causal test and never reads slot_pos (LOAD_POS False): right because
    the caller promises that no used slot lies after any query (module docstring), at any T. With a window
    the positions are read anyway (the window test needs them), and the causal test costs nothing more.

    softcap > 0 compiles the SOFTCAP variant (a constexpr: softcap == 0 runs the kernel without the cap, and
    its float argument is passed but never read).

    lse: an fp32 [B, Hq, T] tensor to receive each query's natural-log log-sum-exp (-inf where it saw nothing),
    or None (kvrewrite::observed_attention's prefill statistics read it).

    pending, save_q: kvrewrite::observed_attention's deferred decode statistics (T == 1): `pending` as in
    launch_forward; save_q, its `q` (with `lse` its `lse`): this step's q and lse go into entry c mod NPEND."""
    out, part, m_part, l_part, S = launch_forward(q, keys, values, bias, slot_pos, cache_position, scale, window,
                                                  past_only, softcap, causal_skip, lse=lse, pending=pending,
                                                  save_q=save_q, **overrides)
    if part is not None:
        pdl, launch = _pdl.launch_options(q)
        wrap_triton(_clustered_attention_combine_kernel)[(out.numel() // out.shape[-1],)](
            part, m_part, l_part, out, out if lse is None else lse, q, out if save_q is None else save_q,
            cache_position, q.stride(0), q.stride(1), q.stride(3), S, q.shape[1], q.shape[1] // keys.shape[1],
            HEAD_DIM=out.shape[-1], BLOCK_S=max(triton.next_power_of_2(S), 2), WRITE_LSE=lse is not None,
            SAVE_Q=save_q is not None, NPEND=1 if save_q is None else int(save_q.shape[2]), PDL=pdl,
            TRIGGER_FIRST=_pdl.TRIGGER_FIRST, num_warps=4, **launch,
        )
    return out


def launch_forward(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only=False, softcap=0.0,
                   causal_skip=True, lse=None, logits=None, pending=None, save_q=None, **overrides):
    """Launch the slot-loop kernel; returns (out, part, m_part, l_part, S): the split partials (None without
    splits: then `out` is final) for the caller to combine. With `logits` (fp32 [B * Hq * T, C]) every row's
    masked log2-domain score is stored there, and the partials are always written (even with one split): the
    caller needs each row's log-sum-exp, which the combine computes. `lse` as in _launch (without splits the
    kernel's epilogue writes it; with splits the caller's combine must).

    pending (T == 1 only): a dict of kvrewrite::observed_attention's deferred statistics, q and lse (fp32
    [B, Hkv, P, G, D] and [B, Hkv, P, G], contiguous: P entries of earlier steps' queries and their natural-log
    lse), score (fp32 [B, Hkv, C]), fill ([B, Hkv]) and scale (1: sum over the group, 1 / G: mean). The entries
    ride in the tile's rows [G, (P + 1) G) (entry e saw this step's slots but the k_e newest:
    slot_pos <= cache_position[0] - k_e, or without slot_pos reads (past_only, window 0) slots before fill - k_e;
    observed_attention.pending_steps_ago) and their probabilities are added to score on the way: at every step
    without save_q, at steps with c mod P == 0 with it (deferring).
    save_q: pending's q (deferring): this step's q and lse go into entry c mod P (the kernel's epilogue without
    splits, else the caller's combine: after every program has read `pending`), the others are emptied after
    a fold."""
    # int(): the launch depends on the shapes, so a dynamic-shape trace specialises on them (a guard)
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C = int(keys.shape[1]), int(keys.shape[2])
    G = Hq // Hkv
    num_sms = _num_sms(q.device) if q.is_cuda else 8  # 8: Triton's interpreter on CPU tensors
    if pending is not None:
        if save_q is not None and save_q is not pending["q"]:
            raise ValueError("launch_forward: save_q must be pending's q (the kernel reads it, then writes it)")
        if T != 1:
            raise ValueError(f"launch_forward: the pending queries ride along decode steps only (T = 1), got T = {T}")
        npend = int(pending["q"].shape[2])
        overrides.setdefault("block_m", max(16, triton.next_power_of_2(2 * G)))  # rows [G, (P + 1) G) for them
        if (npend + 1) * G > overrides["block_m"]:
            raise ValueError(f"launch_forward: {npend} pending entries of {G} heads do not fit a "
                             f"{overrides['block_m']}-row tile next to the step's own {G} rows")
    prefill_kernel = overrides.pop("prefill_kernel", PREFILL_KERNEL)
    prefill_split_grids = overrides.pop("prefill_split_grids", PREFILL_SPLIT_GRIDS)
    ordered = overrides.pop("ordered", None)  # the prefill kernels' (_prefill_attention_kernels.launch_prefill)
    overrides.setdefault("resident", RESIDENT_PROGRAMS if pending is None else RESIDENT_PROGRAMS_PENDING)
    cfg = _launch_config(B, Hkv, G, T, C, D, num_sms, q.element_size(), **overrides)
    S = cfg["num_splits"]
    split = S > 1 or logits is not None
    load_pos = not (past_only and window == 0)
    if softcap > 0:  # the cap in natural units, then the base-2 domain (kernel signature)
        qk_scale, softcap_log2 = scale / softcap, softcap * 1.4426950408889634
    else:
        qk_scale, softcap_log2 = scale * 1.4426950408889634, 0.0
    # (the decode launch takes <= 16 rows)
    if prefill_kernel and G * T > 16 and pending is None and logits is None and (S == 1 or prefill_split_grids):
        out = _prefill.launch_prefill(q, keys, values, bias, slot_pos, cache_position, window, qk_scale,
                                      softcap_log2, softcap, lse, ordered=ordered,
                                      **_prefill.prefill_overrides(overrides))
        return out, None, None, None, 1
    if ordered is not None:
        raise ValueError(f"clustered_attention: `ordered` tunes the prefill kernels (_prefill_attention_kernels.py); "
                         f"this launch takes the slot-loop kernel (G * T = {G * T}, prefill_kernel {prefill_kernel})")
    out = torch.empty((B, Hq, T, D), dtype=q.dtype, device=q.device)
    if split:
        part = torch.empty((B * Hq * T, S, D), dtype=torch.float32, device=q.device)
        m_part = torch.empty((B * Hq * T, S), dtype=torch.float32, device=q.device)
        l_part = torch.empty((B * Hq * T, S), dtype=torch.float32, device=q.device)
    else:
        part = m_part = l_part = out  # M_PART and L_PART are never touched without splits
    if pending is None:  # unused pointers and strides: any tensor of the launch
        pq = plse = score = fill = out
        score_strides, fill_strides, pend_scale = (0, 0, 0), (0, 0), 1.0
    else:
        pq, plse, score, fill = pending["q"], pending["lse"], pending["score"], pending["fill"]
        score_strides, fill_strides, pend_scale = score.stride(), fill.stride(), float(pending["scale"])
    pdl, launch = _pdl.launch_options(q)
    wrap_triton(_clustered_attention_fwd_kernel)[(S, B * Hkv, cfg["m_blocks"])](
        q, keys, values, bias, slot_pos, cache_position, part, m_part, l_part,
        out if logits is None else logits, out if lse is None else lse,
        pq if save_q is None else save_q, plse, score, fill,
        *q.stride(), *keys.stride(), *values.stride(), *bias.stride(), *slot_pos.stride(), *score_strides,
        *fill_strides, Hkv, G, T, C, window, cfg["slots_per_split"], qk_scale, softcap_log2, S, pend_scale,
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], SPLIT=split, SKIP_UNSEEN=cfg["skip_unseen"],
        LOAD_POS=load_pos, HAS_WINDOW=window > 0, CAUSAL_SKIP=causal_skip, SOFTCAP=softcap > 0,
        WRITE_LOGITS=logits is not None, WRITE_LSE=lse is not None and not split,
        PENDING=pending is not None, NPEND=1 if pending is None else npend, DEFER=save_q is not None,
        SAVE_Q=save_q is not None and not split, PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )
    if not split:
        return out, None, None, None, S
    return out, part, m_part, l_part, S


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------


@torch.library.custom_op("kvrewrite::clustered_attention_cpu", mutates_args=(), device_types="cpu")
def clustered_attention_cpu(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    scale: float,
    window: int,
    past_only: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The CPU path of kvrewrite::clustered_attention, an opaque op of its own: it attends only up to
    the last used slot (slots past it are empty, bias -inf), which takes a host read. The read is free
    on the CPU but cannot be traced, so the triton_op below calls this op rather than inlining it.
    past_only is checked (check_past_only), and the causal mask applied as always."""
    check_softcap(softcap)
    if past_only:
        check_past_only(bias, slot_pos, cache_position)
    used = torch.isfinite(bias).flatten(0, 1).any(dim=0).nonzero()
    last = int(used[-1]) + 1 if used.numel() else 1
    keys, values, bias, slot_pos = keys[:, :, :last], values[:, :, :last], bias[:, :, :last], slot_pos[:, :, :last]
    return cpu_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window,
                                   softcap).contiguous()


@clustered_attention_cpu.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only=False, softcap=0.0):
    return q.new_empty(q.shape)  # contiguous, like the real output (empty_like would copy q's strides)


def clustered_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    scale: float,
    window: int,
    past_only: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Degree-biased attention over cache slots (see the module docstring).

    This body is the op's kernel, its fake (traced on fake tensors) and, under torch.compile, what
    Inductor inlines: it must stay free of data-dependent Python. Hence the CPU path is a call to the
    opaque kvrewrite::clustered_attention_cpu (Inductor keeps it as an extern call), and CUDA is the
    Triton launch, which Inductor sees as a user-defined Triton kernel.
    """
    if q.is_cuda and triton is not None:
        return triton_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only,
                                          softcap)
    if q.device.type == "cpu":
        return torch.ops.kvrewrite.clustered_attention_cpu(q, keys, values, bias, slot_pos, cache_position, scale,
                                                           window, past_only, softcap)
    return reference_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window,
                                         past_only, softcap).contiguous()


clustered_attention = register_triton_op("kvrewrite::clustered_attention", clustered_attention, (), triton is not None)
