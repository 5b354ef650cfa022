"""Triton kernels of kvrewrite::kvmerger_compress (private: the op's file owns the schema, the reference and
the registration; its CUDA path calls triton_kvmerger_compress). The semantics are the op's contract
(readings "chain" and "anchor", budget modes "exact" and "epsilon", every sigma_mode and values_mode).

For every row (b, kv-head) with fill >= budget[1] (rows not due are untouched bit for bit): the valid slots in
slot order v_0 .. v_{N-1}; if N > Bt = budget[0], sinks, the recent window and the heavy hitters are protected,
adjacent mergeable pairs are joined by key cosine, the maximal runs of joined pairs are merged around their
pivot with Gaussian x degree weights, and the kept slots are packed at the front; slots [fill, C) are reset
(bias -inf, score 0, degree 1, keys/values 0, slot_pos 0).

Recent and heavy counts: R = n_recent + floor(recent_ratio * Bt), H = n_heavy + floor(hh_ratio * Bt), computed on
the device from budget[0] (pass the ratios so one captured graph serves every budget; the ints serve fixed
counts; both forms add). They are clamped in the order sinks, recent, heavy so that P <= Bt.

Design. Nothing is read on the host; every launch has a grid fixed by the shapes (rows = B * Hkv, C), so a call
is CUDA-graph capturable; a program whose row is not due (or has nothing to merge) returns at once. Every
decision is made in one program per row from per-row scratch, every output slot has exactly one writer and
the merge reads the state's keys/values while writing a staging copy, so there are no races and the result
is deterministic (no atomics). Launches:

1. rank (grid rows): due check; the valid slots ranked by a chunked cumsum, their slot, score, slot_pos,
   degree and bias copied by rank to scratch (so launch 4 may rewrite the state's metadata in place); the
   protected ranks: sinks, recent, and the H heavy hitters among the rest by the K-th largest score order key
   (evict_by_score's bisection, ties to the earlier slot by a cumsum over the ties). INFO[row] = [due, N].
2. cosine (grid slot blocks x rows): c_i = cos(k_{v_i}, k_{v_{i+1}}) in fp32 for every adjacent valid pair
   (elementwise products summed in fp32: no tensor cores, exact for 16-bit keys' products).
3. join (grid rows): joinable pairs (both mergeable); J = N - Bt joins: "exact" the J largest c_i, "epsilon"
   every c_i > epsilon or, if fewer, the J largest (the same K-th largest selection, ties to the earlier pair).
   Reading "anchor" first walks the ranks backwards one at a time (the anchor's key in registers, one key load
   and one dot per rank: a latency-bound serial loop, ~N dependent loads per row), then joins the largest of
   the remaining c_i while the row holds more than Bt. Fewer joinable pairs than needed: all of them, then the
   surplus set slots with the lowest summed score (ties: the earlier; segmented-scan sums) are evicted. The
   sets (maximal runs of joined pairs) are listed, the kept ones compacted: OST[o], OCN[o] = first rank and
   member count of output slot o; INFO[row][1] = the kept count.
4. merge (grid output blocks x rows): each program takes MERGE_SLOTS output slots; single-member sets that
   move are copied as one tile (those already in place are left alone, here and in launch 5), each larger set
   is merged by a loop over its members (pivot = largest score, distances, sigma by sigma_mode, weights
   g_i d_i / sum, keys and values in fp32) into a staging copy XK/XV; the metadata (bias, slot_pos, score,
   degree) of the output slots is written to the state from the rank copies.
5. writeback (grid slot blocks x rows): the staged slots of [0, kept) from the staging copy, slots [kept, C)
   reset; fill.

Costs. Launches 2, 4 and 5 are memory bound. Launch 2 reads the keys of the valid
slots of a merging row about twice (each slot is in two pairs; the second read mostly hits L2). Launch 4 reads the
members of multi-member sets (keys twice: distances, then the weighted sum; values once) and the single slots
that move, and writes each moved output slot once to the staging copy; launch 5 reads and writes those moved
slots once more and empties [kept, C) (bias -inf, score 0, degree 1; keys, values and slot_pos stay, as
evict_by_score leaves them: an empty slot is never read). Slots already in place (the prefix before the first
merge, sinks, early heavy hitters) cost nothing. So a due row costs about 2x the K/V bytes of its slots from
the first merge on, plus the keys once more. Launches 1 and 3 are one
program per row over int32 scratch (~C words, a few chunked passes, the bisections ~log2 of the key range, at most
32 steps, each a reduction over the row held in registers up to evict_by_score's MAX_SLOTS slots, and over
its keys read from memory in chunks past them: _kth_largest_chunked).
Reading "anchor" adds a serial loop of ~N dependent key loads per row to launch 3 (~1 us each: ~1 ms for a
row of 1000 slots; rows run in parallel). Transient memory: the staging copy (the state's K/V size) and 14
int32 words + 1 int64 of scratch per slot. Measured (H100, 8 KV heads, D 128, bf16, one layer; docs/methods.md,
python -m kvrewrite.bench.kvmerger_knobs): the decode-time call at the 32k / budget 0.2 state (6688 -> 6656
slots) 127 us at B = 1, of which launches 1 and 3 (one program per row: 8 SMs at B = 1) take ~80; after a
prefill chunk of 2048, 190-207 us. At B = 8 (~450 us) launches 4 and 5 are ~70% and the staging copy
matters: an in-place move (as kernels/_shift_kernels.py's stage/move launches) is the next step there.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import struct

import torch

from kvrewrite.kernels._slot_kernels import _check_state
from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels.evict_by_score import (MAX_SLOTS, _f64, _kth_largest, _kth_largest_chunked,
                                             _order_key, _select_warps)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its reference; only triton_kvmerger_compress raises
    triton = tl = None

NAME = "triton_kvmerger_compress"
SIGMA_MODES = ("fixed", "distance", "paper")
VALUES_MODES = ("scale", "bias")
READINGS = ("chain", "anchor")
BUDGET_MODES = ("exact", "epsilon")
CHUNK = 4096  # lanes of the per-row passes of launches 1 and 3 (a power of two)
COS_SLOTS = 64  # pairs per program of the cosine launch
MERGE_SLOTS = 32  # output slots per program of the merge launch
MERGE_WARPS = 1  # warps per program of the merge launch (a set's tile reductions stay in one warp)
MEMBER_STEP = 16  # members per step of a set's loops (fixed: it sets the fp32 summation order)
COPY_SLOTS = 64  # slots per program of the writeback launch
PAPER_ITERS = 10  # sigma iterations of sigma_mode "paper"

if tl is not None:  # _order_key(-inf) marks "not a candidate" in the selections
    from kvrewrite.kernels.evict_by_score import _I32_MAX, _KEY_NEG_INF


# -- helpers -----------------------------------------------------------------------------------------
@triton_jit()
def _seg_add(fa, va, fb, vb):
    """Segmented sum: a flag starts a new segment."""
    return fa | fb, tl.where(fb != 0, vb, va + vb)


@triton_jit()
def _select_top(KEYS, FLAG, n, K, base, BLOCK: tl.constexpr, CH: tl.constexpr, CHUNKED: tl.constexpr):
    """FLAG[i] = 1 for the K largest int32 keys of KEYS[0, n) (ties: the earlier index), else 0; keys at
    _KEY_NEG_INF are never selected (the caller guarantees K <= the count above it); K == 0 selects none. CHUNKED:
    the bisection reads the keys from memory CH at a time (rows past MAX_SLOTS)."""
    thr = tl.full([], _I32_MAX, tl.int32)
    need = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    if K > 0:
        if CHUNKED:
            thr, need, n_eq = _kth_largest_chunked(KEYS + base, n, K, BLOCK, CH, True)
        else:
            thr, need, n_eq = _kth_largest(KEYS + base, n, K, BLOCK, True)
    carry = tl.zeros([], tl.int32)
    for c0 in range(0, n, CH):
        j = c0 + tl.arange(0, CH)
        m = j < n
        k = tl.load(KEYS + base + j, mask=m, other=_KEY_NEG_INF)
        tie = (m & (k == thr)).to(tl.int32)
        before = carry + tl.cumsum(tie, axis=0) - tie
        sel = m & (k > _KEY_NEG_INF) & ((k > thr) | ((tie != 0) & (before < need)))
        tl.store(FLAG + base + j, sel.to(tl.int32), mask=m)
        carry += tl.sum(tie, axis=0)
    tl.debug_barrier()


@triton_jit()
def _gauss(dist, sigma):
    """exp(-dist / (2 sigma^2)); 1 where sigma == 0 (every member equals the pivot)."""
    s2 = tl.where(sigma == 0.0, 1.0, 2.0 * sigma * sigma)
    return tl.where(sigma == 0.0, 1.0, tl.exp(-dist / s2))


# -- launch 1: rank ----------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C", "n_sink", "n_recent", "n_heavy", "rr_bits", "hr_bits"])
def _kvm_rank_kernel(BIAS, POS, SCORE, DEG, FILL, BUDGET, SOR, SCR, POR, DGR, BIR, PROT, KEYP, INFO, C,
                     n_sink, n_recent, n_heavy, rr_bits, hr_bits, BLOCK: tl.constexpr, CH: tl.constexpr,
                     CHUNKED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    fill = tl.load(FILL + row)
    due = fill >= tl.load(BUDGET + 1)
    N = tl.zeros([], tl.int32)
    if due:
        n_fill = tl.minimum(fill, C).to(tl.int32)
        for c0 in range(0, n_fill, CH):
            s = c0 + tl.arange(0, CH)
            m = s < n_fill
            bb = tl.load(BIAS + base + s, mask=m, other=float("-inf"))
            valid = m & (bb > float("-inf"))
            vi = valid.to(tl.int32)
            r = N + tl.cumsum(vi, axis=0) - vi
            tl.store(SOR + base + r, s, mask=valid)
            tl.store(SCR + base + r, tl.load(SCORE + base + s, mask=valid), mask=valid)
            tl.store(POR + base + r, tl.load(POS + base + s, mask=valid), mask=valid)
            tl.store(DGR + base + r, tl.load(DEG + base + s, mask=valid), mask=valid)
            tl.store(BIR + base + r, bb, mask=valid)
            N += tl.sum(vi, axis=0)
        tl.debug_barrier()
        target = tl.load(BUDGET)
        n64 = N.to(tl.int64)
        merge = n64 > target
        bt = tl.minimum(target, n64)
        sinks = tl.minimum(tl.maximum(n_sink, 0).to(tl.int64), bt)
        R = n_recent + tl.floor(_f64(rr_bits) * target.to(tl.float64)).to(tl.int64)
        recent = tl.minimum(R, bt - sinks)
        Hh = n_heavy + tl.floor(_f64(hr_bits) * target.to(tl.float64)).to(tl.int64)
        heavy = tl.minimum(Hh, bt - sinks - recent)
        sinks32 = sinks.to(tl.int32)
        lo_recent = (n64 - recent).to(tl.int32)
        heavy32 = tl.where(merge, heavy, 0).to(tl.int32)
        # candidates for the heavy hitters: ranks [sinks, N - recent), keyed by score (always above "none")
        for c0 in range(0, N, CH):
            j = c0 + tl.arange(0, CH)
            m = j < N
            cand = m & (j >= sinks32) & (j < lo_recent)
            k = tl.maximum(_order_key(tl.load(SCR + base + j, mask=m, other=0.0)), _KEY_NEG_INF + 1)
            tl.store(KEYP + base + j, tl.where(cand, k, _KEY_NEG_INF), mask=m)
        tl.debug_barrier()
        _select_top(KEYP, PROT, N, heavy32, base, BLOCK, CH, CHUNKED)
        for c0 in range(0, N, CH):
            j = c0 + tl.arange(0, CH)
            m = j < N
            h = tl.load(PROT + base + j, mask=m, other=0)
            p = merge & ((j < sinks32) | (j >= lo_recent) | (h != 0))
            tl.store(PROT + base + j, p.to(tl.int32), mask=m)
        tl.debug_barrier()
    tl.store(INFO + 2 * row, due.to(tl.int32))
    tl.store(INFO + 2 * row + 1, N)


# -- launch 2: cosines -------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C"])
def _kvm_cosine_kernel(K, BUDGET, SOR, INFO, COS, C, D, BS: tl.constexpr, BLOCK_D: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    due = tl.load(INFO + 2 * row)
    N = tl.load(INFO + 2 * row + 1)
    i0 = blk * BS
    if (due != 0) & (N.to(tl.int64) > tl.load(BUDGET)) & (i0 + 1 < N):
        base = row * C
        i = i0 + tl.arange(0, BS)
        m = i + 1 < N
        sa = tl.load(SOR + base + i, mask=m, other=0).to(tl.int64)
        sb = tl.load(SOR + base + i + 1, mask=m, other=0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        mm = m[:, None] & (d < D)[None, :]
        ka = tl.load(K + (base + sa)[:, None] * D + d[None, :], mask=mm, other=0.0).to(tl.float32)
        kb = tl.load(K + (base + sb)[:, None] * D + d[None, :], mask=mm, other=0.0).to(tl.float32)
        dot = tl.sum(ka * kb, axis=1)
        nn = tl.sqrt_rn(tl.sum(ka * ka, axis=1)) * tl.sqrt_rn(tl.sum(kb * kb, axis=1))
        c = tl.where(nn > 0.0, tl.div_rn(dot, tl.where(nn > 0.0, nn, 1.0)), 0.0)
        tl.store(COS + base + i, c, mask=m)


# -- launch 3: join ----------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C", "eps_bits"])
def _kvm_join_kernel(K, BUDGET, SOR, SCR, PROT, COS, KEYP, JOIN, J1, SST, SSUM, OST, OCN, INFO, C, D, eps_bits,
                     EPSILON_MODE: tl.constexpr, ANCHOR: tl.constexpr, BLOCK: tl.constexpr, CH: tl.constexpr,
                     BLOCK_D: tl.constexpr, CHUNKED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    due = tl.load(INFO + 2 * row)
    N = tl.load(INFO + 2 * row + 1)
    if due != 0:
        target = tl.load(BUDGET)
        merge = N.to(tl.int64) > target
        J = tl.where(merge, N.to(tl.int64) - target, 0).to(tl.int32)
        eps = _f64(eps_bits)
        n1 = tl.zeros([], tl.int32)  # pairs joined by the anchor pass
        if ANCHOR:
            if merge:  # sequential, from the last rank backwards: the anchor is the current set's right-most
                d = tl.arange(0, BLOCK_D)
                s_last = tl.load(SOR + base + N - 1).to(tl.int64)
                ka = tl.load(K + (base + s_last) * D + d, mask=d < D, other=0.0).to(tl.float32)
                na = tl.sqrt_rn(tl.sum(ka * ka, axis=0))
                for t in range(0, N - 1):
                    jj = N - 2 - t
                    pa = tl.load(PROT + base + jj)
                    pb = tl.load(PROT + base + jj + 1)
                    sj = tl.load(SOR + base + jj).to(tl.int64)
                    kj = tl.load(K + (base + sj) * D + d, mask=d < D, other=0.0).to(tl.float32)
                    nj = tl.sqrt_rn(tl.sum(kj * kj, axis=0))
                    nn = na * nj
                    c = tl.where(nn > 0.0, tl.div_rn(tl.sum(ka * kj, axis=0), tl.where(nn > 0.0, nn, 1.0)), 0.0)
                    jn = (pa == 0) & (pb == 0) & (c.to(tl.float64) > eps)
                    tl.store(J1 + base + jj, jn.to(tl.int32))
                    n1 += jn.to(tl.int32)
                    ka = tl.where(jn, ka, kj)
                    na = tl.where(jn, na, nj)
                tl.debug_barrier()
        # joinable pairs (not joined yet), their keys, the counts
        n_join = tl.zeros([], tl.int32)
        n_eps = tl.zeros([], tl.int32)
        for c0 in range(0, N, CH):
            j = c0 + tl.arange(0, CH)
            m = merge & (j + 1 < N)
            pa = tl.load(PROT + base + j, mask=m, other=1)
            pb = tl.load(PROT + base + j + 1, mask=m, other=1)
            ok = m & (pa == 0) & (pb == 0)
            cand = ok
            if ANCHOR:
                cand = ok & (tl.load(J1 + base + j, mask=ok, other=0) == 0)
            c = tl.load(COS + base + j, mask=ok, other=0.0)
            k = tl.maximum(_order_key(c), _KEY_NEG_INF + 1)
            tl.store(KEYP + base + j, tl.where(cand, k, _KEY_NEG_INF), mask=j < N)
            n_join += tl.sum(ok.to(tl.int32), axis=0)
            if EPSILON_MODE and not ANCHOR:
                n_eps += tl.sum((ok & (c.to(tl.float64) > eps)).to(tl.int32), axis=0)
        tl.debug_barrier()
        n_sel = tl.minimum(tl.maximum(J - n1, n_eps), n_join - n1)
        _select_top(KEYP, JOIN, N, n_sel, base, BLOCK, CH, CHUNKED)
        if ANCHOR:
            for c0 in range(0, N, CH):
                j = c0 + tl.arange(0, CH)
                m = merge & (j + 1 < N)
                a1 = tl.load(J1 + base + j, mask=m, other=0)
                tl.store(JOIN + base + j, tl.load(JOIN + base + j, mask=m, other=0) | a1, mask=m)
            tl.debug_barrier()
        n_sel += n1
        # sets: a rank starts one unless joined to its predecessor; SST[set] = its first rank; SSUM[set] = its
        # summed score (segmented scan, carried across chunks), read only by the fallback
        n_sets = tl.zeros([], tl.int32)
        carry = tl.zeros([], tl.float32)
        for c0 in range(0, N, CH):
            j = c0 + tl.arange(0, CH)
            m = j < N
            prev = tl.load(JOIN + base + j - 1, mask=m & (j > 0), other=0)
            start = m & (prev == 0)
            si = start.to(tl.int32)
            sid = n_sets + tl.cumsum(si, axis=0) - 1
            tl.store(SST + base + sid, j, mask=start)
            sc = tl.load(SCR + base + j, mask=m, other=0.0)
            f_in, v = tl.associative_scan((si, sc), 0, _seg_add)
            v = tl.where(f_in == 0, v + carry, v)
            nxt = tl.load(JOIN + base + j, mask=m, other=0)
            end = m & ((nxt == 0) | (j == N - 1))
            tl.store(SSUM + base + sid, v, mask=end)
            carry = tl.sum(tl.where(tl.arange(0, CH) == CH - 1, v, 0.0), axis=0)
            n_sets += tl.sum(si, axis=0)
        tl.debug_barrier()
        # fallback: fewer joinable pairs than J joins: evict the n_ev mergeable sets of lowest summed score
        n_ev = J - n_sel
        if n_ev > 0:
            for c0 in range(0, n_sets, CH):
                s = c0 + tl.arange(0, CH)
                m = s < n_sets
                st = tl.load(SST + base + s, mask=m, other=0)
                p = tl.load(PROT + base + st, mask=m, other=1)
                k = tl.maximum(-1 - _order_key(tl.load(SSUM + base + s, mask=m, other=0.0)), _KEY_NEG_INF + 1)
                tl.store(KEYP + base + s, tl.where(m & (p == 0), k, _KEY_NEG_INF), mask=m)
            tl.debug_barrier()
            _select_top(KEYP, JOIN, n_sets, n_ev, base, BLOCK, CH, CHUNKED)  # JOIN is free again: the eviction flags
        # the kept sets, compacted: OST/OCN by output slot
        n_out = tl.zeros([], tl.int32)
        for c0 in range(0, n_sets, CH):
            s = c0 + tl.arange(0, CH)
            m = s < n_sets
            st = tl.load(SST + base + s, mask=m, other=0)
            en = tl.load(SST + base + s + 1, mask=m & (s + 1 < n_sets), other=N)
            if n_ev > 0:
                ev = tl.load(JOIN + base + s, mask=m, other=0)
            else:
                ev = tl.zeros([CH], tl.int32)
            keep = m & (ev == 0)
            ki = keep.to(tl.int32)
            o = n_out + tl.cumsum(ki, axis=0) - ki
            tl.store(OST + base + o, st, mask=keep)
            tl.store(OCN + base + o, en - st, mask=keep)
            n_out += tl.sum(ki, axis=0)
        tl.store(INFO + 2 * row + 1, n_out)


# -- launch 4: merge ---------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C", "sigma_bits"])
def _kvm_merge_kernel(K, V, XK, XV, BIAS, POS, SCORE, DEG, SOR, SCR, POR, DGR, BIR, OST, OCN, DIST, INFO, C, D,
                      sigma_bits, SIGMA_MODE: tl.constexpr, VALUES_BIAS: tl.constexpr, ITERS: tl.constexpr,
                      OB: tl.constexpr, MB: tl.constexpr, BLOCK_D: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    due = tl.load(INFO + 2 * row)
    n_out = tl.load(INFO + 2 * row + 1)
    o0 = blk * OB
    if (due != 0) & (o0 < n_out):
        base = row * C
        d = tl.arange(0, BLOCK_D)
        dm = (d < D)[None, :]
        o = o0 + tl.arange(0, OB)
        mo = o < n_out
        st = tl.load(OST + base + o, mask=mo, other=0)
        cnt = tl.load(OCN + base + o, mask=mo, other=0)
        single = mo & (cnt == 1)
        # single-member sets that move: one tile copy, metadata from the rank copies (one in place: nothing)
        slot = tl.load(SOR + base + st, mask=single, other=0).to(tl.int64)
        single = single & (slot != o)
        at_src = (base + slot)[:, None] * D + d[None, :]
        at_dst = (base + o)[:, None] * D + d[None, :]
        sm = single[:, None] & dm
        tl.store(XK + at_dst, tl.load(K + at_src, mask=sm), mask=sm)
        tl.store(XV + at_dst, tl.load(V + at_src, mask=sm), mask=sm)
        tl.store(BIAS + base + o, tl.load(BIR + base + st, mask=single), mask=single)
        tl.store(POS + base + o, tl.load(POR + base + st, mask=single), mask=single)
        tl.store(SCORE + base + o, tl.load(SCR + base + st, mask=single), mask=single)
        tl.store(DEG + base + o, tl.load(DGR + base + st, mask=single), mask=single)
        # larger sets: one at a time (their first rank and size taken from the registers, not reloaded)
        sigma0 = _f64(sigma_bits).to(tl.float32)
        # the block's multi-member sets in order: the t-th is the lane whose multi-rank is t
        lane = tl.arange(0, OB)
        is_multi = mo & (cnt > 1)
        mrank = tl.cumsum(is_multi.to(tl.int32), axis=0) - 1
        n_multi = tl.sum(is_multi.to(tl.int32), axis=0)
        for t in range(0, n_multi):
            sel = is_multi & (mrank == t)
            q = tl.sum(tl.where(sel, lane, 0), axis=0)
            cq = tl.sum(tl.where(sel, cnt, 0), axis=0)
            sq = tl.sum(tl.where(sel, st, 0), axis=0)
            oq = o0 + q
            if cq <= MB:
                # a set of <= MB members: one tile of keys and values, every step in registers (the same values
                # and fp32 summation order as the loop below, whose first and only chunk it is)
                r = sq + tl.arange(0, MB)
                mr = r < sq + cq
                sc = tl.load(SCR + base + r, mask=mr, other=float("-inf"))
                cmax = tl.max(sc, axis=0)
                piv = tl.min(tl.where(mr & (sc == cmax), r, _I32_MAX), axis=0)
                dgi = tl.load(DGR + base + r, mask=mr, other=0)
                dsum = tl.sum(dgi, axis=0)
                ssum = tl.sum(tl.where(mr, sc, 0.0), axis=0)
                sl = tl.load(SOR + base + r, mask=mr, other=0).to(tl.int64)
                at = (base + sl)[:, None] * D + d[None, :]
                kk = tl.load(K + at, mask=mr[:, None] & dm, other=0.0).to(tl.float32)
                vv = tl.load(V + at, mask=mr[:, None] & dm, other=0.0).to(tl.float32)
                kp = tl.sum(tl.where((r == piv)[:, None], kk, 0.0), axis=0)
                diff = kp[None, :] - kk
                dist = tl.where(mr, tl.sum(diff * diff, axis=1), 0.0)
                nq = cq.to(tl.float32)
                sigma = sigma0
                if SIGMA_MODE == 1:
                    sigma = tl.sum(tl.where(mr, tl.sqrt_rn(dist), 0.0), axis=0) / (1.4142135623730951 * nq)
                if SIGMA_MODE == 2:
                    for _ in range(ITERS):
                        sigma = tl.sum(tl.where(mr, _gauss(dist, sigma), 0.0), axis=0) / (1.4142135623730951 * nq)
                dg = tl.where(mr, dgi, 1).to(tl.float32)
                g = _gauss(dist, sigma)
                z = tl.sum(tl.where(mr, g * dg, 0.0), axis=0)
                w = tl.where(mr, g * dg / z, 0.0)
                acck = tl.sum(w[:, None] * kk, axis=0)
                bq = tl.zeros([], tl.float32)
                if VALUES_BIAS:
                    accv = tl.sum(w[:, None] * vv, axis=0)
                    bq = tl.log(dsum.to(tl.float32))
                else:
                    accv = tl.sum((w / dg)[:, None] * vv, axis=0) * dsum.to(tl.float32)
                tl.store(XK + (base + oq) * D + d, acck.to(XK.dtype.element_ty), mask=d < D)
                tl.store(XV + (base + oq) * D + d, accv.to(XV.dtype.element_ty), mask=d < D)
                tl.store(BIAS + base + oq, bq)
                tl.store(POS + base + oq, tl.load(POR + base + piv))
                tl.store(SCORE + base + oq, ssum)
                tl.store(DEG + base + oq, dsum)
            else:
                # pivot (largest score, ties: the earlier), degree and score sums
                best = tl.full([], float("-inf"), tl.float32)
                piv = sq
                dsum = tl.zeros([], tl.int32)
                ssum = tl.zeros([], tl.float32)
                for r0 in range(sq, sq + cq, MB):
                    r = r0 + tl.arange(0, MB)
                    mr = r < sq + cq
                    sc = tl.load(SCR + base + r, mask=mr, other=float("-inf"))
                    cmax = tl.max(sc, axis=0)
                    cidx = tl.min(tl.where(mr & (sc == cmax), r, _I32_MAX), axis=0)
                    piv = tl.where(cmax > best, cidx, piv)  # a later chunk wins only when strictly larger
                    best = tl.maximum(best, cmax)
                    dsum += tl.sum(tl.load(DGR + base + r, mask=mr, other=0), axis=0)
                    ssum += tl.sum(tl.where(mr, sc, 0.0), axis=0)
                pslot = tl.load(SOR + base + piv).to(tl.int64)
                kp = tl.load(K + (base + pslot) * D + d, mask=d < D, other=0.0).to(tl.float32)
                # squared distances to the pivot (stored by rank), their root sum
                rsum = tl.zeros([], tl.float32)
                for r0 in range(sq, sq + cq, MB):
                    r = r0 + tl.arange(0, MB)
                    mr = r < sq + cq
                    sl = tl.load(SOR + base + r, mask=mr, other=0).to(tl.int64)
                    kk = tl.load(K + (base + sl)[:, None] * D + d[None, :], mask=mr[:, None] & dm, other=0.0)
                    diff = kp[None, :] - kk.to(tl.float32)
                    dist = tl.sum(diff * diff, axis=1)
                    tl.store(DIST + base + r, dist, mask=mr)
                    rsum += tl.sum(tl.where(mr, tl.sqrt_rn(dist), 0.0), axis=0)
                tl.debug_barrier()
                nq = cq.to(tl.float32)
                sigma = sigma0
                if SIGMA_MODE == 1:
                    sigma = rsum / (1.4142135623730951 * nq)
                if SIGMA_MODE == 2:
                    for _ in range(ITERS):
                        gs = tl.zeros([], tl.float32)
                        for r0 in range(sq, sq + cq, MB):
                            r = r0 + tl.arange(0, MB)
                            mr = r < sq + cq
                            dist = tl.load(DIST + base + r, mask=mr, other=0.0)
                            g = _gauss(dist, sigma)
                            gs += tl.sum(tl.where(mr, g, 0.0), axis=0)
                        sigma = gs / (1.4142135623730951 * nq)
                # weights w_i = g_i d_i / sum_j g_j d_j
                z = tl.zeros([], tl.float32)
                for r0 in range(sq, sq + cq, MB):
                    r = r0 + tl.arange(0, MB)
                    mr = r < sq + cq
                    dist = tl.load(DIST + base + r, mask=mr, other=0.0)
                    dg = tl.load(DGR + base + r, mask=mr, other=0).to(tl.float32)
                    g = _gauss(dist, sigma)
                    z += tl.sum(tl.where(mr, g * dg, 0.0), axis=0)
                acck = tl.zeros([BLOCK_D], tl.float32)
                accv = tl.zeros([BLOCK_D], tl.float32)
                for r0 in range(sq, sq + cq, MB):
                    r = r0 + tl.arange(0, MB)
                    mr = r < sq + cq
                    dist = tl.load(DIST + base + r, mask=mr, other=0.0)
                    dg = tl.load(DGR + base + r, mask=mr, other=1).to(tl.float32)
                    g = _gauss(dist, sigma)
                    w = tl.where(mr, g * dg / z, 0.0)
                    sl = tl.load(SOR + base + r, mask=mr, other=0).to(tl.int64)
                    at = (base + sl)[:, None] * D + d[None, :]
                    kk = tl.load(K + at, mask=mr[:, None] & dm, other=0.0).to(tl.float32)
                    vv = tl.load(V + at, mask=mr[:, None] & dm, other=0.0).to(tl.float32)
                    acck += tl.sum(w[:, None] * kk, axis=0)
                    if VALUES_BIAS:
                        accv += tl.sum(w[:, None] * vv, axis=0)
                    else:
                        accv += tl.sum((w / dg)[:, None] * vv, axis=0)
                bq = tl.zeros([], tl.float32)
                if VALUES_BIAS:
                    bq = tl.log(dsum.to(tl.float32))
                else:
                    accv = accv * dsum.to(tl.float32)
                tl.store(XK + (base + oq) * D + d, acck.to(XK.dtype.element_ty), mask=d < D)
                tl.store(XV + (base + oq) * D + d, accv.to(XV.dtype.element_ty), mask=d < D)
                tl.store(BIAS + base + oq, bq)
                tl.store(POS + base + oq, tl.load(POR + base + piv))
                tl.store(SCORE + base + oq, ssum)
                tl.store(DEG + base + oq, dsum)


# -- launch 5: writeback -----------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C"])
def _kvm_writeback_kernel(K, V, XK, XV, BIAS, POS, SCORE, DEG, FILL, SOR, OST, OCN, INFO, C, D, BS: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    due = tl.load(INFO + 2 * row)
    n_out = tl.load(INFO + 2 * row + 1)
    if due != 0:
        base = row * C
        j = blk * BS + tl.arange(0, BS)
        d = tl.arange(0, BLOCK_D)
        mj = j < C
        kept = mj & (j < n_out)
        cnt = tl.load(OCN + base + j, mask=kept, other=0)
        src = tl.load(SOR + base + tl.load(OST + base + j, mask=kept, other=0), mask=kept, other=0)
        kept = kept & ((cnt != 1) | (src != j))  # the slots the merge launch staged
        freed = mj & (j >= n_out)  # emptied: bias -inf, score 0, degree 1; keys, values, slot_pos stay (never read)
        at = (base + j)[:, None] * D + d[None, :]
        mk = kept[:, None] & (d < D)[None, :]
        tl.store(K + at, tl.load(XK + at, mask=mk), mask=mk)
        tl.store(V + at, tl.load(XV + at, mask=mk), mask=mk)
        tl.store(BIAS + base + j, tl.full([BS], float("-inf"), tl.float32), mask=freed)
        tl.store(SCORE + base + j, tl.zeros([BS], tl.float32), mask=freed)
        tl.store(DEG + base + j, tl.full([BS], 1, tl.int32), mask=freed)
        if blk == 0:
            tl.store(FILL + row, n_out.to(tl.int64))


# -- launcher ----------------------------------------------------------------------------------------
def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _check_options(n_recent, n_heavy, n_sink, epsilon, sigma, sigma_mode, values_mode, reading, budget_mode,
                   recent_ratio, hh_ratio):
    for field, v, allowed in (("sigma_mode", sigma_mode, SIGMA_MODES), ("values_mode", values_mode, VALUES_MODES),
                              ("reading", reading, READINGS), ("budget_mode", budget_mode, BUDGET_MODES)):
        if v not in allowed:
            raise ValueError(f"{NAME}: {field} must be one of {allowed}, got {v!r}")
    for field, v in (("n_recent", n_recent), ("n_heavy", n_heavy), ("n_sink", n_sink)):
        if int(v) != v or v < 0:
            raise ValueError(f"{NAME}: {field} must be an int >= 0, got {v!r}")
    for field, v in (("recent_ratio", recent_ratio), ("hh_ratio", hh_ratio)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{NAME}: {field} must be in [0, 1], got {v!r}")
    if not sigma >= 0.0:
        raise ValueError(f"{NAME}: sigma must be >= 0, got {sigma!r}")


def triton_kvmerger_compress(keys, values, bias, slot_pos, fill, budget, score, degree, *, n_recent: int = 0,
                             n_heavy: int = 0, n_sink: int = 0, epsilon: float = 0.75, sigma: float = 5.0,
                             sigma_mode: str = "fixed", values_mode: str = "scale", reading: str = "chain",
                             budget_mode: str = "exact", recent_ratio: float = 0.0, hh_ratio: float = 0.0,
                             chunk: int | None = None, cos_slots: int | None = None, merge_slots: int | None = None,
                             copy_slots: int | None = None, merge_warps: int | None = None,
                             select_warps: int | None = None, chunked_select: bool | None = None) -> None:
    """Launch the five kernels (module docstring); mutates keys, values, bias, slot_pos, fill, score, degree in
    place. R = n_recent + floor(recent_ratio * budget[0]), H = n_heavy + floor(hh_ratio * budget[0]) (on the
    device). Tuning knobs (defaults measured best on an H100, docs/methods.md): chunk, cos_slots, merge_slots,
    copy_slots (powers of two) override CHUNK, COS_SLOTS, MERGE_SLOTS, COPY_SLOTS; merge_warps and select_warps the
    warps of the merge launch (MERGE_WARPS) and of the two per-row launches (by C); chunked_select (default: C past
    MAX_SLOTS) the bisections over keys read in chunks (the same selection). Every value gives the same
    result (but for the fallback's set-score sums, which chunk changes the rounding of: an exact tie decided by the
    last ulp could go the other way). Under TRITON_INTERPRET=1 it runs on CPU tensors (how the kernels are tested
    without a GPU)."""
    if triton is None:
        raise NotImplementedError(f"{NAME} needs Triton (pip install triton)")
    _check_options(n_recent, n_heavy, n_sink, epsilon, sigma, sigma_mode, values_mode, reading, budget_mode,
                   recent_ratio, hh_ratio)
    B, H, C, D = _check_state(NAME, keys, values, bias, slot_pos, fill, budget)
    for field, t, dtype in (("score", score, torch.float32), ("degree", degree, torch.int32)):
        if tuple(t.shape) != (B, H, C) or t.dtype != dtype:
            raise ValueError(f"{NAME}: {field} must be {dtype} [B, Hkv, C] = {[B, H, C]}, got {t.dtype} "
                             f"{list(t.shape)}")
        if not t.is_contiguous() or t.device != keys.device:
            raise ValueError(f"{NAME}: {field} must be contiguous and on {keys.device}, like keys")
    if budget.device != keys.device:
        raise ValueError(f"{NAME}: budget is on {budget.device}, keys on {keys.device}")
    rows = B * H
    if rows == 0 or C == 0 or D == 0:
        return
    dev = keys.device
    block = triton.next_power_of_2(C)
    ch = min(block, chunk or CHUNK)
    chunked = block > MAX_SLOTS if chunked_select is None else chunked_select  # the bisections read keys in chunks
    select_warps = select_warps or _select_warps(min(block, MAX_SLOTS))
    cs, ms, ps = cos_slots or COS_SLOTS, merge_slots or MERGE_SLOTS, copy_slots or COPY_SLOTS
    block_d = triton.next_power_of_2(D)
    ws = torch.empty(14, rows, C, dtype=torch.int32, device=dev)  # row scratch (int32 / fp32 views)
    sor, dgr, prot, keyp, join, j1, sst, ost, ocn = (ws[i] for i in range(9))
    scr, bir, cos, ssum, dist = (ws[i].view(torch.float32) for i in range(9, 14))
    por = torch.empty(rows, C, dtype=torch.int64, device=dev)
    info = torch.empty(rows, 2, dtype=torch.int32, device=dev)
    xk = torch.empty_like(keys)
    xv = torch.empty_like(values)
    _kvm_rank_kernel[(rows,)](bias, slot_pos, score, degree, fill, budget, sor, scr, por, dgr, bir, prot, keyp,
                              info, C, n_sink, n_recent, n_heavy, _bits(recent_ratio), _bits(hh_ratio),
                              BLOCK=block, CH=ch, CHUNKED=chunked, num_warps=select_warps)
    _kvm_cosine_kernel[(triton.cdiv(C, cs), rows)](keys, budget, sor, info, cos, C, D, BS=cs,
                                                           BLOCK_D=block_d)
    _kvm_join_kernel[(rows,)](keys, budget, sor, scr, prot, cos, keyp, join, j1, sst, ssum, ost, ocn, info, C, D,
                              _bits(epsilon), EPSILON_MODE=budget_mode == "epsilon", ANCHOR=reading == "anchor",
                              BLOCK=block, CH=ch, BLOCK_D=block_d, CHUNKED=chunked, num_warps=select_warps)
    _kvm_merge_kernel[(triton.cdiv(C, ms), rows)](
        keys, values, xk, xv, bias, slot_pos, score, degree, sor, scr, por, dgr, bir, ost, ocn, dist, info, C, D,
        _bits(sigma), SIGMA_MODE=SIGMA_MODES.index(sigma_mode), VALUES_BIAS=values_mode == "bias",
        ITERS=PAPER_ITERS, OB=ms, MB=MEMBER_STEP, BLOCK_D=block_d, num_warps=merge_warps or MERGE_WARPS)
    _kvm_writeback_kernel[(triton.cdiv(C, ps), rows)](keys, values, xk, xv, bias, slot_pos, score, degree,
                                                              fill, sor, ost, ocn, info, C, D, BS=ps, BLOCK_D=block_d)
