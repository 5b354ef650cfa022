"""The Triton kernel of kvrewrite::expanded_attention (contract docs/contracts/ems.md §6.2); the op, its checks and
the launcher live in kvrewrite/kernels/expanded_attention.py.

One program owns one row (batch b, KV head h), a block of tile rows (query t, group head g: row = t * G + g, as
clustered_attention, so each K/V tile is read once for the whole group) and one split of the row's runtime slots:
split s of NUM_SPLITS owns slots [s * S, (s + 1) * S) ∩ [0, slot_fill), S = ceil(slot_fill / NUM_SPLITS) read on
the device (balanced whatever the fill; no host read), and the entries lut[first] .. lut[last] of those slots (an
entry straddling a boundary is read by both splits, each counting only its own slots). Per tile of BLOCK_N entries
[e0, e0 + BLOCK_N):

    sv = q @ K_tileᵀ * qk_scale                                 once per entry tile (fp32 [BLOCK_M, BLOCK_N])
    the tile's slots [entry_start[e0], entry_start[e0 + BLOCK_N]) ∩ the split, in chunks of BLOCK_J:
        lut, key_scale per slot; local = lut - e0; bias (and slot_pos) gathered per slot from the tile's entries
        z = a_j * sv[:, local]  (softcap: tanh(a_j * sv[:, local]) * softcap * log2 e), -inf where invisible
        online max; p = 2^(z - m)
        P_tile = P_tile * alpha + p @ onehot(local)ᵀ            (segment sum per entry, no atomics)
    acc = acc * 2^(m_tile_start - m) + P_tile @ V_tile            once per entry tile

so no expanded key or value is ever formed, in memory or in registers. The in-tile gather sv[:, local] is tl.gather
(GATHER 2, the default: the per-(row, entry) visibility, bias and causal test, is folded into sv once per tile as
-inf, so a chunk reads only lut and key_scale) or a one-hot product (0: fp32 "ieee", 1: "tf32x3"; these read bias
and slot_pos per slot, a -inf cannot pass through a product). The segment sum is a one-hot product (SCATTER 0, the
default) or differences of the chunk's running sum at each entry's range ends (1). kvrewrite/bench/ems_attention.py
measured the choices (expanded_attention._launch_config). The partials (acc, m, l, base 2) are
clustered_attention's: its combine kernel merges them.

GM < BLOCK_M (the narrow form, expanded_attention.NARROW; one query block holding every real row, G * T <= GM): the
two tl.dot products keep their BLOCK_M (16) rows, but the per-slot work (gather, exponentials, the running-sum
segment sum, SCATTER 1) runs on the first GM rows only. A decode step of a group of G = 4 has 4 real rows of 16: the
full-width form spends 3/4 of its per-slot work on padding rows. The rows are taken from q @ Kᵀ and put back for
P @ V by reshapes ([BLOCK_M, N] as [BLOCK_M / GM, GM, N]: padding rows are exact zeros, so a sum over the first axis
selects the real ones bit for bit).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

from kvrewrite.kernels._query_block import block_rows, query_block
from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels.clustered_attention import libdevice

try:
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its reference; only the launcher needs Triton
    tl = None


@triton_jit()
def _first_rows(x, BLOCK_M: tl.constexpr, GM: tl.constexpr, N: tl.constexpr):
    """The first GM rows [GM, N] of x [BLOCK_M, N], whose other rows are zeros (exact: a sum with zeros)."""
    return tl.sum(tl.reshape(x, [BLOCK_M // GM, GM, N]), axis=0)


@triton_jit()
def _spread_rows(x, BLOCK_M: tl.constexpr, GM: tl.constexpr, N: tl.constexpr):
    """x [GM, N] as the first GM rows of a [BLOCK_M, N] tensor of zeros."""
    full = tl.reshape(tl.broadcast_to(x[None, :, :], [BLOCK_M // GM, GM, N]), [BLOCK_M, N])
    return tl.where((tl.arange(0, BLOCK_M) < GM)[:, None], full, 0.0)


@triton_jit(do_not_specialize=["Hkv", "G", "T", "C", "R", "NUM_SPLITS"])
def _expanded_attention_fwd_kernel(
    Q, K, V,
    BIAS, POS,  # fp32 / int64 [B, Hkv, C], contiguous
    CPOS,  # int64 [T]
    ESTART,  # int32 [B, Hkv, C], contiguous
    LUT, KSCALE,  # int32 / fp32 [B, Hkv, R], contiguous
    SFILL,  # int64 [B, Hkv], contiguous
    OUT,  # [B, Hq, T, D] q's dtype (SPLIT False), or fp32 partial acc [B * Hq * T, NUM_SPLITS, D]
    M_PART, L_PART,  # fp32 [B * Hq * T, NUM_SPLITS], log2-domain running max and sum (SPLIT only)
    LSE,  # fp32 [B * Hq * T], natural log, -inf for a row that saw nothing (written without SPLIT)
    S_OUT,  # fp32 [B * Hq * T, C]: s_e = scale * q·keys[e] of the split's entries (WRITE_S only)
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    # qk_scale = scale * log2(e); with SOFTCAP, qk_scale = scale / softcap and softcap_log2 = softcap * log2(e)
    Hkv, G, T, C, R, qk_scale, softcap_log2, s_scale,
    NUM_SPLITS,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # entries per tile
    BLOCK_J: tl.constexpr,  # slots per chunk
    SPLIT: tl.constexpr,
    LOAD_POS: tl.constexpr,  # False (past_only): slot_pos is not read, every live entry is visible
    SOFTCAP: tl.constexpr,
    WRITE_S: tl.constexpr,
    GATHER: tl.constexpr,  # the in-tile gather of s: 0 one-hot fp32 ieee, 1 one-hot tf32x3, 2 tl.gather
    SCATTER: tl.constexpr,  # the per-entry segment sum of p: 0 one-hot product, 1 running-sum differences
    GM: tl.constexpr,  # rows of the per-slot work: BLOCK_M, or (narrow form: GATHER 2, SCATTER 1, one block) fewer
):
    LOG2E: tl.constexpr = 1.4426950408889634
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    Hq = Hkv * G
    row = b.to(tl.int64) * Hkv + h  # the (b, h) row of the state

    rows, row_ok, t, hq, offs_d = block_rows(h, pid_m, G, T, BLOCK_M, HEAD_DIM)
    q, qpos, qpos_min, qpos_max, q_rel = query_block(Q, CPOS, b, row_ok, t, hq, offs_d, stride_qb, stride_qh,
                                                     stride_qt, stride_qd)
    out_row = (b.to(tl.int64) * Hq + hq) * T + t
    if GM < BLOCK_M:  # the narrow form's rows: the block's first GM (pid_m is 0: one block holds every real row)
        rows_n = tl.arange(0, GM)
        row_ok_n = rows_n < G * T
        t_n = rows_n // G
        out_row_n = (b.to(tl.int64) * Hq + h * G + rows_n % G) * T + t_n
        qpos_n = tl.load(CPOS + t_n, mask=row_ok_n, other=0)
        q_rel_n = tl.where(row_ok_n, qpos_n - qpos_min, 0).to(tl.int32)
    else:
        row_ok_n = row_ok
        out_row_n = out_row
        q_rel_n = q_rel

    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    bias_base = BIAS + row * C
    pos_base = POS + row * C
    es_base = ESTART + row * C
    lut_base = LUT + row * R
    ks_base = KSCALE + row * R

    # this split's slots [j0, j1) and entries [e_lo, e_hi]
    n_slots = tl.minimum(tl.load(SFILL + row), R).to(tl.int32)
    per_split = (n_slots + NUM_SPLITS - 1) // NUM_SPLITS
    j0 = pid_s * per_split
    j1 = tl.minimum(j0 + per_split, n_slots)
    busy = j0 < j1
    e_first = tl.load(lut_base + j0, mask=busy, other=0)
    e_last = tl.load(lut_base + j1 - 1, mask=busy, other=-1)
    # a freed slot (lut -1) at either end: walk from entry 0 / to the last entry; the tiles' slot ranges and the
    # in-tile test below still count every slot once (only the contract's invariant, no -1 below slot_fill, is fast)
    e_lo = tl.maximum(e_first, 0)
    e_hi = tl.where(busy, tl.where(e_last >= 0, e_last, C - 1), -1)
    e_hi = tl.minimum(e_hi, C - 1)

    m_i = tl.full([GM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GM], dtype=tl.float32)
    acc = tl.zeros([GM, HEAD_DIM], dtype=tl.float32)
    offs_bn = tl.arange(0, BLOCK_N)

    for e0 in range(e_lo, e_hi + 1, BLOCK_N):
        offs_e = e0 + offs_bn
        e_ok = offs_e <= e_hi
        k = tl.load(k_base + offs_e[:, None] * stride_kc + offs_d[None, :] * stride_kd, mask=e_ok[:, None], other=0.0)
        # V is loaded early: its latency hides behind the tile's slot chunks
        v = tl.load(v_base + offs_e[:, None] * stride_vc + offs_d[None, :] * stride_vd, mask=e_ok[:, None], other=0.0)
        if Q.dtype.element_ty == tl.float32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if WRITE_S:
            tl.store(S_OUT + out_row[:, None] * C + offs_e[None, :], (qk * s_scale).to(tl.float32),
                     mask=row_ok[:, None] & e_ok[None, :])
        if GM < BLOCK_M:
            qk = _first_rows(qk.to(tl.float32), BLOCK_M, GM, BLOCK_N)
        sv = (qk * qk_scale).to(tl.float32)

        # the tile's slots: from its first entry's first slot (the split's first slot for the first tile) to the
        # next tile's first entry's first slot (the split's end for the last tile, or where entry_start is not
        # that of a slot-holding entry)
        es0 = tl.load(es_base + e0)
        js = tl.where(e0 > e_lo, tl.maximum(es0, j0), j0)
        has_next = e0 + BLOCK_N <= e_hi
        es_next = tl.load(es_base + e0 + BLOCK_N, mask=has_next, other=0)
        je = tl.where(has_next & (es_next >= js), tl.minimum(es_next, j1), j1)
        if GATHER == 2:
            # visibility per (row, entry), once per tile: -inf scores gather as -inf (no product with a one-hot)
            bias_e = tl.load(bias_base + offs_e, mask=e_ok, other=float("-inf"))
            vis_e = (bias_e > float("-inf"))[None, :] & row_ok_n[:, None]
            if LOAD_POS:
                pos_e = tl.load(pos_base + offs_e, mask=e_ok, other=0)
                p_rel_e = tl.minimum(tl.maximum(pos_e - qpos_min, -1), 2**30).to(tl.int32)
                vis_e = vis_e & (p_rel_e[None, :] <= q_rel_n[:, None])
            sv = tl.where(vis_e, sv, float("-inf"))
        if SCATTER == 1:
            # each entry's slot range [start, end) within [js, je) (entry_start; the next entry's start, or je)
            st_e = tl.load(es_base + offs_e, mask=e_ok, other=0)
            en_e = tl.load(es_base + offs_e + 1, mask=offs_e + 1 <= e_hi, other=0)
            st_e = tl.where(e_ok, tl.minimum(tl.maximum(st_e, js), je), je)
            en_e = tl.where(offs_e + 1 <= e_hi, tl.minimum(tl.maximum(en_e, st_e), je), je)
            en_e = tl.where(e_ok, en_e, je)

        m_tile = m_i
        P = tl.zeros([GM, BLOCK_N], dtype=tl.float32)
        # the slot metadata is prefetched one chunk ahead (loop-carried), so its latency overlaps the chunk's math
        offs_jn = js + tl.arange(0, BLOCK_J)
        e_next = tl.load(lut_base + offs_jn, mask=offs_jn < je, other=-1)
        a_next = tl.load(ks_base + offs_jn, mask=offs_jn < je, other=0.0)
        for jc in range(js, je, BLOCK_J):
            e_j = e_next
            a_j = a_next
            offs_jn = jc + BLOCK_J + tl.arange(0, BLOCK_J)
            e_next = tl.load(lut_base + offs_jn, mask=offs_jn < je, other=-1)
            a_next = tl.load(ks_base + offs_jn, mask=offs_jn < je, other=0.0)
            loc = e_j - e0
            in_tile = (e_j >= 0) & (loc >= 0) & (loc < BLOCK_N)  # e_j = -1 past je
            if GATHER == 2:
                loc = tl.where(in_tile, loc, 0)
                sg = tl.gather(sv, tl.broadcast_to(loc[None, :], (GM, BLOCK_J)), 1)
                vis = in_tile[None, :] & (sg > float("-inf"))
                live = in_tile
            else:
                b_j = tl.load(bias_base + e_j, mask=in_tile, other=float("-inf"))  # L1: the tile's entries
                live = in_tile & (b_j > float("-inf"))
                loc = tl.where(live, loc, 0)
                onehot_g = ((offs_bn[:, None] == loc[None, :]) & live[None, :]).to(tl.float32)  # [BLOCK_N, BLOCK_J]
                if GATHER == 1:
                    sg = tl.dot(sv, onehot_g, input_precision="tf32x3")
                else:
                    sg = tl.dot(sv, onehot_g, input_precision="ieee")
                vis = live[None, :] & row_ok[:, None]
                if LOAD_POS:
                    pos_j = tl.load(pos_base + e_j, mask=live, other=0)
                    p_rel = tl.minimum(tl.maximum(pos_j - qpos_min, -1), 2**30).to(tl.int32)
                    vis = vis & (p_rel[None, :] <= q_rel[:, None])
            z = sg * a_j[None, :]
            if SOFTCAP:
                z = libdevice.tanh(z) * softcap_log2
            z = tl.where(vis, z, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z, axis=1))
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_base)
            p = tl.exp2(z - m_base[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # segment sum per entry: P[:, e] += sum of p over the chunk's slots of entry e
            if SCATTER == 1:
                # by differences of the chunk's running sum at each entry's range ends (a_e, b_e local to the chunk)
                cs = tl.cumsum(p, axis=1)
                r_lo = tl.minimum(tl.maximum(st_e - jc, 0), BLOCK_J)
                r_hi = tl.minimum(tl.maximum(en_e - jc, 0), BLOCK_J)
                hi = tl.gather(cs, tl.broadcast_to(tl.maximum(r_hi - 1, 0)[None, :], (GM, BLOCK_N)), 1)
                lo = tl.gather(cs, tl.broadcast_to(tl.maximum(r_lo - 1, 0)[None, :], (GM, BLOCK_N)), 1)
                seg = tl.where((r_hi > r_lo)[None, :], hi - tl.where((r_lo > 0)[None, :], lo, 0.0), 0.0)
            else:
                onehot = (offs_bn[:, None] == loc[None, :]) & live[None, :]  # [BLOCK_N, BLOCK_J]
                if V.dtype.element_ty == tl.float32:
                    seg = tl.dot(p, tl.trans(onehot.to(tl.float32)), input_precision="ieee")
                else:  # p rounded to V's dtype as for any 16-bit P @ V; sums in fp32
                    seg = tl.dot(p.to(V.dtype.element_ty), tl.trans(onehot.to(V.dtype.element_ty)))
            P = P * alpha[:, None] + seg
            m_i = m_new

        m_base = tl.where(m_i == float("-inf"), 0.0, m_i)
        if GM < BLOCK_M:
            P = _spread_rows(P, BLOCK_M, GM, BLOCK_N)
        if V.dtype.element_ty == tl.float32:
            pv = tl.dot(P, v, input_precision="ieee")
        else:
            pv = tl.dot(P.to(V.dtype.element_ty), v)
        if GM < BLOCK_M:
            pv = _first_rows(pv, BLOCK_M, GM, HEAD_DIM)
        acc = acc * tl.exp2(m_tile - m_base)[:, None] + pv

    if SPLIT:
        tl.store(OUT + (out_row_n[:, None] * NUM_SPLITS + pid_s) * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok_n[:, None])
        tl.store(M_PART + out_row_n * NUM_SPLITS + pid_s, m_i, mask=row_ok_n)
        tl.store(L_PART + out_row_n * NUM_SPLITS + pid_s, l_i, mask=row_ok_n)
    else:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row that saw nothing: acc == 0, o == 0
        tl.store(OUT + out_row_n[:, None] * HEAD_DIM + offs_d[None, :], o.to(OUT.dtype.element_ty),
                 mask=row_ok_n[:, None])
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) / LOG2E, float("-inf"))
        tl.store(LSE + out_row_n, lse, mask=row_ok_n)
