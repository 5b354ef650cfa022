"""Triton kernels of kvrewrite::ems_append, ems_score and ems_partition (docs/contracts/ems.md §6.1, §6.6, §6.7).

Private to those three op files (their module docstrings say when these run); shared here because ems_score and
ems_partition find a row's window the same way (`_window_start`). Every kernel reads `fill`, `slot_fill`, `due` and
`budget` on the device (no host read), launches depend on shapes only (CUDA-graph capturable), no float atomics.

- ems_append, grid (rows,): one program writes its row's T new slots (masked past R, entries masked past C) and the
  raw keys, then slot_fill = min(slot_fill + T, R) (past capacity, as cache_append's fill). One launch per layer
  and step.
- ems_score, 3 launches, grid (blocks of BLOCK, rows):
  1. count: per block the fp64 partial sums of loc and s_glo over its live slots, and how many of its slot_order
     positions are pooled slots (P members);
  2. g: alpha = fp32(sum num / sum den) (the block partials summed in a fixed order), g and g_pooled = -inf for
     the block's slots; P packed: PG[rank] = g of P_rank, PS[rank] = its slot (ranks by the counts' prefix);
  3. pool: g_pooled[P_i] = (sum_{k=i-h}^{i+h} PG[k], missing k as 0, in increasing k) / kernel, the halo read
     from the packed row (IEEE division, as torch's), so the pooled bits equal the reference's.
- ems_partition, grid (rows,): the row's candidate keys (`_order_key` of g_pooled at the head slot) are packed in
  entry order; the N_imp-th and (N_imp + N_tbm)-th largest come from evict_by_score's bisection (`_kth_largest`);
  ties at a threshold go to the earlier entry by a cumsum. No sort.
"""
from __future__ import annotations

import struct

import torch

from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels.evict_by_score import _f64, _kth_largest, _kth_largest_chunked, _order_key

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op files never call the launchers there
    triton = tl = None

SCORE_BLOCK = 1024  # slots per program of the ems_score kernels (a power of two)
WINDOW_CHUNK = 64  # entries per step of the backward window search (a power of two)
PARTITION_CHUNK = 1024  # entries per step of the partition's passes (a power of two)
MAX_ENTRIES = 32768  # rows up to this hold their candidate keys in registers; longer ones read them in chunks

if tl is not None:
    _I32_MAX = tl.constexpr(2147483647)


@triton_jit()
def _window_start(BIAS, fill, C, l_win, CH: tl.constexpr):
    """The first entry of the row's window: the l_win-th last valid entry (e < fill, bias > -inf), 0 when the row
    holds fewer (all valid entries are the window). Walks back from fill in chunks of CH until l_win are seen."""
    pos = tl.minimum(fill, C).to(tl.int32)
    cnt = tl.zeros([], tl.int32)
    w = tl.zeros([], tl.int32)
    while (pos > 0) & (cnt < l_win):
        lo = tl.maximum(pos - CH, 0)
        e = lo + tl.arange(0, CH)
        v = (e < pos) & (tl.load(BIAS + e, mask=e < pos, other=float("-inf")) > float("-inf"))
        vi = v.to(tl.int32)
        tot = tl.sum(vi, axis=0)
        suffix = tot - tl.cumsum(vi, axis=0) + vi  # valid entries in [e, pos)
        hit = v & (cnt + suffix == l_win)
        w = tl.maximum(w, tl.max(tl.where(hit, e, 0), axis=0))
        cnt += tot
        pos = lo
    return w


@triton_jit()
def _live(LUT, BIAS, j, sf, fill, R, C):
    """(live, lut) of slots j: j < slot_fill, 0 <= lut < fill, bias[lut] > -inf."""
    lut = tl.load(LUT + j, mask=j < R, other=-1)
    ok = (j < sf) & (j < R) & (lut >= 0) & (lut < fill)
    b = tl.load(BIAS + tl.minimum(tl.maximum(lut, 0), C - 1), mask=ok, other=float("-inf"))
    return ok & (b > float("-inf")), lut


# -- ems_append ----------------------------------------------------------------------------------------------------
@triton_jit()
def _ems_append_kernel(FILL, KPRE, CP, ES, RAW, LUT, KS, TP, SO, SF, T, C, R, D, H, skb, skh, skt, skd,
                       HAS_RAW: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    fill = tl.load(FILL + row)
    sf = tl.load(SF + row)
    kbase = (row // H) * skb + (row % H) * skh
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        mt = t < T
        e = fill - T + t
        j = sf + t
        mj = mt & (j >= 0) & (j < R)
        tl.store(LUT + row * R + j, e.to(tl.int32), mask=mj)
        tl.store(KS + row * R + j, tl.full([BT], 1.0, tl.float32), mask=mj)
        tl.store(TP + row * R + j, tl.load(CP + t, mask=mt, other=0).to(tl.int32), mask=mj)
        tl.store(SO + row * R + j, j.to(tl.int32), mask=mj)
        me = mt & (e >= 0) & (e < C)
        tl.store(ES + row * C + e, j.to(tl.int32), mask=me)
        if HAS_RAW:
            for d0 in range(0, D, BD):
                d = d0 + tl.arange(0, BD)
                m2 = me[:, None] & (d < D)[None, :]
                k = tl.load(KPRE + kbase + t[:, None].to(tl.int64) * skt + d[None, :] * skd, mask=m2)
                tl.store(RAW + (row * C + e[:, None]) * D + d[None, :], k.to(RAW.dtype.element_ty), mask=m2)
    # every warp has read SF (its entries' index j above) before one thread writes it: a warp that read it after the
    # write would put its entries T places on (the race stop 59 found in clustergen_fold's pack launch, by audit here)
    tl.debug_barrier()
    tl.store(SF + row, tl.minimum(sf + T, R))  # as cache_append's fill: every reader stays inside the table


def triton_ems_append(fill, k_pre, cache_position, entry_start, raw_keys, lut, key_scale, token_pos, slot_order,
                      slot_fill) -> None:
    """§6.1 in one launch (the state tensors contiguous; k_pre any strides). Runs on CPU tensors under
    TRITON_INTERPRET=1."""
    B, H, T, D = k_pre.shape
    C, R = entry_start.shape[2], lut.shape[2]
    rows = B * H
    if rows == 0 or T == 0:
        return
    bt = min(triton.next_power_of_2(T), 64)
    bd = triton.next_power_of_2(D)
    has_raw = raw_keys.shape[2] > 0
    _ems_append_kernel[(rows,)](fill, k_pre, cache_position, entry_start, raw_keys if has_raw else entry_start, lut,
                                key_scale, token_pos, slot_order, slot_fill, T, C, R, D, H, *k_pre.stride(),
                                HAS_RAW=has_raw, BT=bt, BD=bd, num_warps=4)


# -- ems_score -----------------------------------------------------------------------------------------------------
@triton_jit()
def _in_pool(LUT, BIAS, SO, k, sf, fill, w, R, C):
    """(in_p, slot) of slot_order positions k: slot = slot_order[k] is a live slot of an entry before the window."""
    s = tl.load(SO + k, mask=k < R, other=-1)
    sc = tl.minimum(tl.maximum(s, 0), R - 1)
    live, lut = _live(LUT, BIAS, sc, sf, fill, R, C)
    return (k < sf) & (s >= 0) & live & (lut < w), sc


@triton_jit(do_not_specialize=["l_win"])
def _score_count_kernel(BIAS, FILL, LUT, SO, GLO, PAST, CUR, SF, DUE, PART, CNT, C, R, NB, l_win,
                        BLOCK: tl.constexpr, WCH: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    if tl.load(DUE + row) != 0:
        fill = tl.load(FILL + row)
        sf = tl.load(SF + row)
        bias = BIAS + row * C
        w = _window_start(bias, fill, C, l_win, WCH)
        j = blk * BLOCK + tl.arange(0, BLOCK)
        live, _ = _live(LUT + row * R, bias, j, sf, fill, R, C)
        loc = tl.load(PAST + row * R + j, mask=live, other=0.0) + tl.load(CUR + row * R + j, mask=live, other=0.0)
        glo = tl.load(GLO + row * R + j, mask=live, other=0.0)
        num = tl.sum(tl.where(live, loc, 0.0).to(tl.float64), axis=0)
        den = tl.sum(tl.where(live, glo, 0.0).to(tl.float64), axis=0)
        tl.store(PART + (row * NB + blk) * 2, num)
        tl.store(PART + (row * NB + blk) * 2 + 1, den)
        in_p, _ = _in_pool(LUT + row * R, bias, SO + row * R, j, sf, fill, w, R, C)
        tl.store(CNT + row * NB + blk, tl.sum(in_p.to(tl.int32), axis=0))


@triton_jit(do_not_specialize=["l_win"])
def _score_g_kernel(BIAS, FILL, LUT, SO, GLO, PAST, CUR, SF, DUE, PART, CNT, G, GP, PG, PS, C, R, NB, l_win,
                    BLOCK: tl.constexpr, WCH: tl.constexpr, NBP: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    j = blk * BLOCK + tl.arange(0, BLOCK)
    mj = j < R
    tl.store(GP + row * R + j, tl.full([BLOCK], float("-inf"), tl.float32), mask=mj)
    if tl.load(DUE + row) == 0:
        tl.store(G + row * R + j, tl.zeros([BLOCK], tl.float32), mask=mj)
    else:
        fill = tl.load(FILL + row)
        sf = tl.load(SF + row)
        bias = BIAS + row * C
        w = _window_start(bias, fill, C, l_win, WCH)
        nb = tl.arange(0, NBP)
        num = tl.sum(tl.load(PART + (row * NB + nb) * 2, mask=nb < NB, other=0.0), axis=0)
        den = tl.sum(tl.load(PART + (row * NB + nb) * 2 + 1, mask=nb < NB, other=0.0), axis=0)
        alpha = tl.where(den == 0, 0.0, num / tl.where(den == 0, 1.0, den)).to(tl.float32)
        # g of the block's slots
        live, _ = _live(LUT + row * R, bias, j, sf, fill, R, C)
        loc = tl.load(PAST + row * R + j, mask=mj, other=0.0) + tl.load(CUR + row * R + j, mask=mj, other=0.0)
        g = tl.where(live, tl.maximum(alpha * tl.load(GLO + row * R + j, mask=mj, other=0.0), loc), 0.0)
        tl.store(G + row * R + j, g, mask=mj)
        # P packed: the block's slot_order positions that are pooled slots, at their rank
        in_p, s = _in_pool(LUT + row * R, bias, SO + row * R, j, sf, fill, w, R, C)
        before = tl.sum(tl.load(CNT + row * NB + nb, mask=nb < blk, other=0), axis=0)
        ip = in_p.to(tl.int32)
        rank = before + tl.cumsum(ip, axis=0) - ip
        loc_s = tl.load(PAST + row * R + s, mask=in_p, other=0.0) + tl.load(CUR + row * R + s, mask=in_p, other=0.0)
        g_s = tl.maximum(alpha * tl.load(GLO + row * R + s, mask=in_p, other=0.0), loc_s)
        tl.store(PG + row * R + rank, g_s, mask=in_p)
        tl.store(PS + row * R + rank, s, mask=in_p)


@triton_jit()
def _score_pool_kernel(DUE, CNT, PG, PS, GP, R, NB, KERNEL: tl.constexpr, BLOCK: tl.constexpr, NBP: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    if tl.load(DUE + row) != 0:
        nb = tl.arange(0, NBP)
        n_p = tl.sum(tl.load(CNT + row * NB + nb, mask=nb < NB, other=0), axis=0)
        i = blk * BLOCK + tl.arange(0, BLOCK)
        m = i < n_p
        acc = tl.zeros([BLOCK], tl.float32)
        for o in tl.static_range(KERNEL):  # k = i - h .. i + h in increasing k, a missing k as 0
            k = i + (o - (KERNEL - 1) // 2)
            acc += tl.load(PG + row * R + k, mask=m & (k >= 0) & (k < n_p), other=0.0)
        pooled = tl.math.div_rn(acc, tl.full([BLOCK], KERNEL, tl.float32))
        s = tl.load(PS + row * R + i, mask=m, other=0)
        tl.store(GP + row * R + s, pooled, mask=m)


def triton_ems_score(bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due, l_win: int,
                     pool: int, *, block: int | None = None, window_chunk: int | None = None):
    """§6.6 in 3 launches; returns (g, g_pooled) fp32 [B, Hkv, R]. `block`/`window_chunk` (powers of two) tune the
    launches and give the same result. Runs on CPU tensors under TRITON_INTERPRET=1."""
    B, H, C = bias.shape
    R = lut.shape[2]
    dev = bias.device
    g = torch.empty(B, H, R, dtype=torch.float32, device=dev)
    gp = torch.empty(B, H, R, dtype=torch.float32, device=dev)
    rows = B * H
    if rows == 0 or R == 0:
        return g, gp
    bs = min(block or SCORE_BLOCK, triton.next_power_of_2(R))
    nb = triton.cdiv(R, bs)
    wch = window_chunk or WINDOW_CHUNK
    part = torch.empty(rows, nb, 2, dtype=torch.float64, device=dev)
    cnt = torch.empty(rows, nb, dtype=torch.int32, device=dev)
    pg = torch.empty(rows, R, dtype=torch.float32, device=dev)
    ps = torch.empty(rows, R, dtype=torch.int32, device=dev)
    grid = (nb, rows)
    state = (bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due.view(torch.uint8))
    warps = 4 if bs <= 1024 else 8
    _score_count_kernel[grid](*state, part, cnt, C, R, nb, l_win, BLOCK=bs, WCH=wch, num_warps=warps)
    nbp = triton.next_power_of_2(nb)
    _score_g_kernel[grid](*state, part, cnt, g, gp, pg, ps, C, R, nb, l_win, BLOCK=bs, WCH=wch, NBP=nbp,
                          num_warps=warps)
    _score_pool_kernel[grid](due.view(torch.uint8), cnt, pg, ps, gp, R, nb, KERNEL=pool, BLOCK=bs, NBP=nbp,
                             num_warps=warps)
    return g, gp


# -- ems_partition -------------------------------------------------------------------------------------------------
@triton_jit()
def _thresholds(KEYS, nc, K, S: tl.constexpr, CH: tl.constexpr, CHUNKED: tl.constexpr):
    """(thr, need) of the K largest of the nc packed keys (thr = I32_MAX, need 0: none for K <= 0), over the
    smallest of S/4, S/2, S lanes that holds nc; CHUNKED (rows past MAX_ENTRIES): over the keys read from memory CH
    at a time."""
    thr = tl.full([], _I32_MAX, tl.int32)
    need = tl.zeros([], tl.int32)
    if K > 0:
        if CHUNKED:
            thr, need, _ = _kth_largest_chunked(KEYS, nc, K, S, CH, True)
        elif S >= 64:
            if nc <= S // 4:
                thr, need, _ = _kth_largest(KEYS, nc, K, S // 4, True)
            elif nc <= S // 2:
                thr, need, _ = _kth_largest(KEYS, nc, K, S // 2, True)
            else:
                thr, need, _ = _kth_largest(KEYS, nc, K, S, True)
        else:
            thr, need, _ = _kth_largest(KEYS, nc, K, S, True)
    return thr, need


@triton_jit(do_not_specialize=["l_win", "gm1_bits"])
def _partition_kernel(BIAS, FILL, ES, GP, DUE, BUDGET, CLS, KEYP, C, R, l_win, gm1_bits, GAMMA_INF: tl.constexpr,
                      S: tl.constexpr, CHUNK: tl.constexpr, WCH: tl.constexpr, CHUNKED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    bias = BIAS + row * C
    keys = KEYP + row * C
    a = tl.arange(0, CHUNK)
    if tl.load(DUE + row) == 0:
        for c0 in range(0, C, CHUNK):
            tl.store(CLS + row * C + c0 + a, tl.zeros([CHUNK], tl.int32), mask=c0 + a < C)
    else:
        fill = tl.load(FILL + row)
        w = _window_start(bias, fill, C, l_win, WCH)
        # pass 1: count the valid entries, pack the candidates' order keys in entry order
        nc = tl.zeros([], tl.int32)
        n_valid = tl.zeros([], tl.int32)
        for c0 in range(0, C, CHUNK):
            e = c0 + a
            valid = (e < fill) & (e < C) & (tl.load(bias + e, mask=e < C, other=float("-inf")) > float("-inf"))
            cand = valid & (e < w)
            es = tl.load(ES + row * C + e, mask=cand, other=0)
            es = tl.minimum(tl.maximum(es, 0), R - 1)
            key = _order_key(tl.load(GP + row * R + es, mask=cand, other=float("-inf")))
            ci = cand.to(tl.int32)
            tl.store(keys + nc + tl.cumsum(ci, axis=0) - ci, key, mask=cand)
            nc += tl.sum(ci, axis=0)
            n_valid += tl.sum(valid.to(tl.int32), axis=0)
        bt = tl.load(BUDGET)
        over = n_valid.to(tl.int64) > bt
        n_imp = tl.maximum(bt - l_win, 0)
        if GAMMA_INF:
            n_tbm = tl.full([], 0, tl.int64) + C
        else:
            n_tbm = tl.floor(_f64(gm1_bits) * bt.to(tl.float64)).to(tl.int64)
        k1 = tl.where(over, tl.minimum(n_imp, nc.to(tl.int64)), 0).to(tl.int32)
        k2 = tl.where(over, tl.minimum(n_imp + n_tbm, nc.to(tl.int64)), 0).to(tl.int32)
        tl.debug_barrier()
        thr1, need1 = _thresholds(keys, nc, k1, S, CHUNK, CHUNKED)
        thr2, need2 = _thresholds(keys, nc, k2, S, CHUNK, CHUNKED)
        # pass 2: the codes; ties at a threshold go to the earlier entry (a cumsum over the key == thr ones)
        rank0 = tl.zeros([], tl.int32)
        carry1 = tl.zeros([], tl.int32)
        carry2 = tl.zeros([], tl.int32)
        for c0 in range(0, C, CHUNK):
            e = c0 + a
            valid = (e < fill) & (e < C) & (tl.load(bias + e, mask=e < C, other=float("-inf")) > float("-inf"))
            cand = valid & (e < w)
            ci = cand.to(tl.int32)
            key = tl.load(keys + rank0 + tl.cumsum(ci, axis=0) - ci, mask=cand, other=0)
            f1 = (cand & (key == thr1)).to(tl.int32)
            f2 = (cand & (key == thr2)).to(tl.int32)
            top1 = (key > thr1) | ((f1 != 0) & (carry1 + tl.cumsum(f1, axis=0) - f1 < need1))
            top2 = (key > thr2) | ((f2 != 0) & (carry2 + tl.cumsum(f2, axis=0) - f2 < need2))
            ranked = tl.where(top1, 2, tl.where(top2, 3, 4))
            code = tl.where(valid & (e >= w), 1, tl.where(cand, tl.where(over, ranked, 2), 0))
            tl.store(CLS + row * C + e, code.to(tl.int32), mask=e < C)
            rank0 += tl.sum(ci, axis=0)
            carry1 += tl.sum(f1, axis=0)
            carry2 += tl.sum(f2, axis=0)


def triton_ems_partition(bias, fill, entry_start, g_pooled, due, budget, l_win: int, gamma: float, *,
                         chunk: int | None = None, window_chunk: int | None = None,
                         chunked_select: bool | None = None):
    """§6.7 in one launch; returns cls int32 [B, Hkv, C]. `chunk`/`window_chunk` (powers of two) and chunked_select
    (default: C past MAX_ENTRIES, the thresholds' bisections over keys read in chunks) tune it and give the same
    result. Runs on CPU tensors under TRITON_INTERPRET=1."""
    B, H, C = bias.shape
    R = g_pooled.shape[2]
    if R == 0:
        raise ValueError("triton_ems_partition: g_pooled holds 0 slots (R = 0); the kernel needs R >= 1")
    cls = torch.empty(B, H, C, dtype=torch.int32, device=bias.device)
    rows = B * H
    if rows == 0 or C == 0:
        return cls
    block = triton.next_power_of_2(C)
    keyp = torch.empty(rows, C, dtype=torch.int32, device=bias.device)
    inf = gamma == float("inf")
    gm1 = struct.unpack("<q", struct.pack("<d", 0.0 if inf else float(gamma) - 1.0))[0]
    _partition_kernel[(rows,)](bias, fill, entry_start, g_pooled, due.view(torch.uint8), budget, cls, keyp, C, R,
                               l_win, gm1, GAMMA_INF=inf, S=block, CHUNK=min(block, chunk or PARTITION_CHUNK),
                               WCH=window_chunk or WINDOW_CHUNK,
                               CHUNKED=block > MAX_ENTRIES if chunked_select is None else chunked_select,
                               num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)
    return cls
