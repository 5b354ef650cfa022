"""Triton kernels of kvrewrite::ems_merge (private: the op's file owns the schema, the reference and the
registration; its CUDA path calls triton_ems_merge). The semantics are the op's contract (docs/contracts/ems.md
§6.9, the module docstring of kvrewrite/kernels/ems_merge.py).

Design. Nine launches, each simple: a grid fixed by the shapes (rows = B * Hkv, C entries, R slots), no host read
(CUDA-graph capturable), a program whose row is not due returns at once (rows not due untouched bit for bit),
every output element has exactly one writer and no float atomics (deterministic). Row scratch is int32 / fp32
[rows, C] or [rows, R] unless said otherwise.

1. weights (grid entry blocks x rows): CNT[e] the slots of valid entry e ([entry_start[e], next start or
   slot_fill)), W[e] their g summed in slot order (fp64, as the reference).
2. group (grid rows, one program per row): the merging TBM entries d (cls 3, dest >= 0) listed in ascending order
   (a chunked cumsum), then each one's rank among the earlier d' with the same dest (chunks of GROUP_CHUNK listed
   entries: an in-chunk comparison matrix plus a running per-centre count GCNT, written by each chunk's last
   occurrence; decode: ~32 per row, one chunk); kept entries' new index (cumsum) and SRC[new] = old; MOFF[c] =
   exclusive cumsum of GCNT; the member lists MEM[MOFF[c] + rank] = d (d ascending).
3. merge (grid blocks of MERGE_BLOCK entries x rows): every kept single entry gets GSLOTS = CNT, SEGOFF = 0; each
   centre with members walks [c] + MEM (its group order) in chunks of MEMBER_STEP: the weights (fallback to slot
   counts when their sum is 0), the unit keys' / raw keys' and the values' weighted sums in fp32, ONORM[e] =
   ||keys[e]||, SEGOFF[e] = the slot offset of e inside the group, GSLOTS[c]; the new key/value/raw key (rounded
   to the state's dtype) go to the staging copies XK/XV/XR at the centre's new index (MRG[new] = 1) and
   NNORM[c] = the norm of the stored new key.
4. layout (grid rows): GSTART[c] = exclusive cumsum of GSLOTS over the kept entries; the LUT cap: n_drop = live
   - R_max candidates (alive non-head slots of centres) by the order key (g_pooled ascending, token_pos
   descending), found as evict_by_score's bisection (_kth_largest; past MAX_SLOTS slots _kth_largest_chunked, which
   reads the keys from memory for each count) over ~key(g_pooled), then a second bisection over token_pos among the
   threshold ties (positions are distinct per row); every alive slot's virtual place v
   = GSTART[target] + SEGOFF[entry] + offset in the entry (the §6.9.5 order with nothing dropped), a scan of
   the survivors over v gives the new slot, NEWPOS[j] per old slot (-1: dead or dropped); NSTART[new entry] =
   the new place of its head slot; slot_order compacted by a scan (old token order, remapped).
5. slot stage (grid slot blocks x rows): each surviving old slot's lut (new entry), key_scale (rescaled in a
   merged group: key_scale * ONORM[e] / NNORM[c], 1 if that norm is 0), token_pos and scores to staging at its
   new place.
6. slot write (grid slot blocks x rows): [0, slot_fill) from staging, the freed slots up to the old slot_fill
   reset, slot_order, slot_fill.
7. entry metadata (grid entry blocks x rows): entry_start, bias 0, slot_pos = max token_pos of the new slots of
   each kept entry; freed entries bias -inf, entry_start 0; fill.
8. stage and 9. move (grid entry blocks x rows x column slices of keys, values, raw keys): the staged block move of
   kernels/_shift_kernels.py (the kept entries only shift left): launch 8 copies each block's halo (sources past
   the block) to the staging copy, launch 9 moves every block in place (loads, a CTA barrier, stores) and takes the
   merged centres' new rows from the staging copy that launch 3 wrote. Entries that neither move nor merge are not
   touched.

The per-row launches 2 and 4 are serial chunked passes in one program per row (8 SMs at B = 1). Measured on
an H100 (profiler, Llama-3.1-8B-shaped 32k state at budget 0.2, B = 1, bf16): all nine launches ~195 us GPU time
at a decode-time compression and ~230 us after a prefill chunk; launch 4 is ~98 us of it (the next step: its
per-slot passes as parallel launches, leaving only the three scans per row), launch 2 ~20 us, launches 8-9 ~35 us.
Transient memory: the staging copies (the state's K/V/raw size) and ~20 words per entry and per slot of scratch.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import math
import struct

import torch

from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels.evict_by_score import (MAX_SLOTS, _f64, _kth_largest, _kth_largest_chunked, _order_key,
                                             _select_warps)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its reference; only triton_ems_merge raises
    triton = tl = None

if tl is not None:
    from kvrewrite.kernels.evict_by_score import _I32_MAX, _KEY_NEG_INF

NAME = "triton_ems_merge"
ENTRY_BLOCK = 128  # entries per program of launches 1 and 7
GROUP_CHUNK = 64  # entries per chunk of the rank pass of launch 2 (a [chunk, chunk] comparison)
CHUNK = 4096  # lanes of the other chunked per-row passes
MERGE_BLOCK = 16  # entries per program of launch 3
MEMBER_STEP = 16  # members per step of a group's loops
SLOT_BLOCK = 512  # slots per program of launches 5 and 6
MOVE_SLOTS = 64  # entries per program of launches 8 and 9
MOVE_COLUMNS = 64  # head-dim columns per program of launches 8 and 9
INFO_WORDS = 8  # per row: due, n_kept, n_slots, old fill, old slot_fill


# -- 1: weights -------------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C", "R"])
def _w_kernel(BIAS, FILL, ES, SFILL, G, DUE, CNT, W, C, R, BE: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    if tl.load(DUE + row) != 0:
        fill = tl.load(FILL + row)
        sf = tl.load(SFILL + row).to(tl.int32)
        e = blk * BE + tl.arange(0, BE)
        me = e < C
        valid = me & (e < fill) & (tl.load(BIAS + row * C + e, mask=me, other=float("-inf")) > float("-inf"))
        st = tl.load(ES + row * C + e, mask=valid, other=0)
        nx = tl.load(ES + row * C + e + 1, mask=valid & (e + 1 < fill), other=0)
        nx = tl.where(e + 1 < fill, nx, sf)
        cnt = tl.where(valid, nx - st, 0)
        w = tl.zeros([BE], tl.float64)
        for k in range(0, tl.max(cnt, axis=0)):
            w += tl.load(G + row * R + st + k, mask=k < cnt, other=0.0).to(tl.float64)
        tl.store(CNT + row * C + e, cnt, mask=me)
        tl.store(W + row * C + e, w, mask=me)


# -- 2: groups --------------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C"])
def _group_kernel(FILL, SFILL, CLS, DEST, DUE, RANK, GCNT, NEWIDX, SRC, MOFF, MEM, MLIST, INFO, C, GCH: tl.constexpr,
                  CH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    due = tl.load(DUE + row) != 0
    tl.store(INFO + row * 8, due.to(tl.int32))
    if due:
        fill = tl.load(FILL + row)
        # the merging TBM entries (cls 3, dest >= 0) listed in ascending order, so the rank pass walks only them
        n_m = tl.zeros([], tl.int32)
        for c0 in range(0, C, CH):
            e = c0 + tl.arange(0, CH)
            m = e < C
            ds = tl.load(DEST + base + e, mask=m, other=-1)
            mt = m & (tl.load(CLS + base + e, mask=m, other=0) == 3) & (ds >= 0)
            mi = mt.to(tl.int32)
            tl.store(MLIST + base + n_m + tl.cumsum(mi, axis=0) - mi, e, mask=mt)
            n_m += tl.sum(mi, axis=0)
        tl.debug_barrier()
        a = tl.arange(0, GCH)
        for k0 in range(0, n_m, GCH):
            mt = k0 + a < n_m
            e = tl.load(MLIST + base + k0 + a, mask=mt, other=0)
            key = tl.where(mt, tl.load(DEST + base + e, mask=mt, other=-1), -1)
            same = (key[:, None] == key[None, :]) & mt[:, None]
            local = tl.sum((same & (a[None, :] < a[:, None])).to(tl.int32), axis=1)
            last = tl.sum((same & (a[None, :] > a[:, None])).to(tl.int32), axis=1) == 0
            rank = tl.load(GCNT + base + key, mask=mt, other=0) + local
            tl.debug_barrier()  # every load of GCNT before this chunk's stores
            tl.store(RANK + base + e, rank, mask=mt)
            tl.store(GCNT + base + key, rank + 1, mask=mt & last)
            tl.debug_barrier()
        n_kept = tl.zeros([], tl.int32)
        moff = tl.zeros([], tl.int32)
        for c0 in range(0, C, CH):
            e = c0 + tl.arange(0, CH)
            m = e < C
            cl = tl.load(CLS + base + e, mask=m, other=0)
            kept = m & (e < fill) & ((cl == 1) | (cl == 2))
            ki = kept.to(tl.int32)
            nid = n_kept + tl.cumsum(ki, axis=0) - ki
            tl.store(NEWIDX + base + e, tl.where(kept, nid, -1), mask=m)
            tl.store(SRC + base + nid, e, mask=kept)
            gc = tl.load(GCNT + base + e, mask=m, other=0)
            tl.store(MOFF + base + e, moff + tl.cumsum(gc, axis=0) - gc, mask=m)
            n_kept += tl.sum(ki, axis=0)
            moff += tl.sum(gc, axis=0)
        tl.debug_barrier()
        for c0 in range(0, C, CH):
            e = c0 + tl.arange(0, CH)
            m = e < C
            ds = tl.load(DEST + base + e, mask=m, other=-1)
            mt = m & (tl.load(CLS + base + e, mask=m, other=0) == 3) & (ds >= 0)
            off = tl.load(MOFF + base + ds, mask=mt, other=0) + tl.load(RANK + base + e, mask=mt, other=0)
            tl.store(MEM + base + off, e, mask=mt)
        tl.store(INFO + row * 8 + 1, n_kept)
        tl.store(INFO + row * 8 + 3, fill.to(tl.int32))
        tl.store(INFO + row * 8 + 4, tl.load(SFILL + row).to(tl.int32))


# -- 3: merge ---------------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C"])
def _merge_kernel(K, V, RK, XK, XV, XR, DUE, CNT, W, GCNT, NEWIDX, MOFF, MEM, SEGOFF, GSLOTS, ONORM, NNORM, MRG,
                  C, D, HAS_RAW: tl.constexpr, OB: tl.constexpr, MB: tl.constexpr, BLOCK_D: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    if tl.load(DUE + row) != 0:
        base = row * C
        c = blk * OB + tl.arange(0, OB)
        mc = c < C
        nid = tl.load(NEWIDX + base + c, mask=mc, other=-1)
        gc = tl.load(GCNT + base + c, mask=mc & (nid >= 0), other=0)
        single = (nid >= 0) & (gc == 0)
        tl.store(GSLOTS + base + c, tl.load(CNT + base + c, mask=single, other=0), mask=single)
        tl.store(SEGOFF + base + c, tl.zeros([OB], tl.int32), mask=single)
        multi = (nid >= 0) & (gc > 0)
        mi = multi.to(tl.int32)
        mrank = tl.cumsum(mi, axis=0) - mi
        lane = tl.arange(0, OB)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        for t in range(0, tl.sum(mi, axis=0)):
            sel = multi & (mrank == t)
            q = tl.sum(tl.where(sel, lane, 0), axis=0)
            cq = blk * OB + q
            n = tl.sum(tl.where(sel, gc, 0), axis=0) + 1  # members, the centre first
            mo = tl.load(MOFF + base + cq)
            # the weights' sum and the slot counts' sum (the fallback)
            wsum = tl.zeros([], tl.float64)
            csum = tl.zeros([], tl.float64)
            for k0 in range(0, n, MB):
                k = k0 + tl.arange(0, MB)
                mk = k < n
                e = tl.where(k == 0, cq, tl.load(MEM + base + mo + k - 1, mask=mk & (k > 0), other=0))
                wsum += tl.sum(tl.load(W + base + e, mask=mk, other=0.0), axis=0)
                csum += tl.sum(tl.load(CNT + base + e, mask=mk, other=0).to(tl.float64), axis=0)
            fb = wsum <= 0.0
            wtot = tl.where(fb, csum, wsum)
            acck = tl.zeros([BLOCK_D], tl.float32)
            accv = tl.zeros([BLOCK_D], tl.float32)
            accr = tl.zeros([BLOCK_D], tl.float32)
            off = tl.zeros([], tl.int32)
            for k0 in range(0, n, MB):
                k = k0 + tl.arange(0, MB)
                mk = k < n
                e = tl.where(k == 0, cq, tl.load(MEM + base + mo + k - 1, mask=mk & (k > 0), other=0))
                cnt = tl.load(CNT + base + e, mask=mk, other=0)
                we = tl.where(fb, cnt.to(tl.float64), tl.load(W + base + e, mask=mk, other=0.0))
                w = tl.where(mk, we / wtot, 0.0).to(tl.float32)
                tl.store(SEGOFF + base + e, off + tl.cumsum(cnt, axis=0) - cnt, mask=mk)
                off += tl.sum(cnt, axis=0)
                at = (base + e)[:, None] * D + d[None, :]
                m2 = mk[:, None] & dm[None, :]
                kk = tl.load(K + at, mask=m2, other=0.0).to(tl.float32)
                nk = tl.sqrt_rn(tl.sum(kk * kk, axis=1))
                tl.store(ONORM + base + e, nk, mask=mk)
                uk = tl.where(nk[:, None] > 0.0, kk / tl.where(nk > 0.0, nk, 1.0)[:, None], 0.0)
                acck += tl.sum(w[:, None] * uk, axis=0)
                accv += tl.sum(w[:, None] * tl.load(V + at, mask=m2, other=0.0).to(tl.float32), axis=0)
                if HAS_RAW:
                    rr = tl.load(RK + at, mask=m2, other=0.0).to(tl.float32)
                    nr = tl.sqrt_rn(tl.sum(rr * rr, axis=1))
                    accr += tl.sum(w[:, None] * tl.where(nr[:, None] > 0.0, rr / tl.where(nr > 0.0, nr, 1.0)[:, None],
                                                         0.0), axis=0)
            tl.store(GSLOTS + base + cq, off)
            newi = tl.sum(tl.where(sel, nid, 0), axis=0)
            at_c = (base + cq) * D + d
            at_n = (base + newi) * D + d
            nm = tl.sqrt_rn(tl.sum(acck * acck, axis=0))
            kc = tl.load(K + at_c, mask=dm, other=0.0)
            kn = tl.where(nm > 0.0, (acck / tl.where(nm > 0.0, nm, 1.0)).to(XK.dtype.element_ty), kc)
            knf = kn.to(tl.float32)
            tl.store(NNORM + base + cq, tl.sqrt_rn(tl.sum(knf * knf, axis=0)))
            tl.store(XK + at_n, kn, mask=dm)
            tl.store(XV + at_n, accv.to(XV.dtype.element_ty), mask=dm)
            if HAS_RAW:
                nr = tl.sqrt_rn(tl.sum(accr * accr, axis=0))
                rc = tl.load(RK + at_c, mask=dm, other=0.0)
                rn = tl.where(nr > 0.0, (accr / tl.where(nr > 0.0, nr, 1.0)).to(XR.dtype.element_ty), rc)
                tl.store(XR + at_n, rn, mask=dm)
            tl.store(MRG + base + newi, 1)


# -- 4: layout --------------------------------------------------------------------------------------
@triton_jit()
def _slot_alive(LUT, BIAS, DEST, j, mj, base_c, base_r, fill):
    """(alive, entry, target) of the old slots j (mj: j < slot_fill)."""
    lut = tl.load(LUT + base_r + j, mask=mj, other=-1)
    live = mj & (lut >= 0) & (lut < fill)
    e = tl.where(live, lut, 0)
    live = live & (tl.load(BIAS + base_c + e, mask=live, other=float("-inf")) > float("-inf"))
    tgt = tl.load(DEST + base_c + e, mask=live, other=-1)
    return live & (tgt >= 0), e, tl.maximum(tgt, 0)


@triton_jit(do_not_specialize=["C", "R", "gm1_bits"])
def _layout_kernel(BIAS, ES, LUT, TP, GP, ORDER, BUDGET, CLS, DEST, INFO, NEWIDX, SEGOFF, GSLOTS, GSTART, KEYP, VJ,
                   SURV, NEWPOS, NSTART, NORD, C, R, gm1_bits, CAP: tl.constexpr, S: tl.constexpr,
                   CH: tl.constexpr, CHUNKED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(INFO + row * 8) != 0:
        bc = row * C
        br = row * R
        fill = tl.load(INFO + row * 8 + 3)
        sf = tl.load(INFO + row * 8 + 4)
        n_live = tl.zeros([], tl.int32)
        for c0 in range(0, C, CH):
            e = c0 + tl.arange(0, CH)
            m = e < C
            kept = m & (tl.load(NEWIDX + bc + e, mask=m, other=-1) >= 0)
            gs = tl.load(GSLOTS + bc + e, mask=kept, other=0)
            tl.store(GSTART + bc + e, n_live + tl.cumsum(gs, axis=0) - gs, mask=kept)
            n_live += tl.sum(gs, axis=0)
        tl.debug_barrier()
        # the LUT cap: thresholds of the n_drop lowest (g_pooled asc, token_pos desc) candidates
        thr = tl.full([], _I32_MAX, tl.int32)  # nothing dropped
        thr2 = tl.full([], _I32_MAX, tl.int32)
        if CAP:
            bt = tl.load(BUDGET)
            rmax = bt + tl.floor(_f64(gm1_bits) * bt.to(tl.float64)).to(tl.int64)
            n_drop = tl.maximum(n_live.to(tl.int64) - rmax, 0).to(tl.int32)
            if n_drop > 0:
                for j0 in range(0, R, CH):
                    j = j0 + tl.arange(0, CH)
                    mr = j < R
                    alive, e, tgt = _slot_alive(LUT, BIAS, DEST, j, j < sf, bc, br, fill)
                    cand = alive & (tl.load(CLS + bc + tgt, mask=alive, other=0) == 2)
                    cand = cand & (j != tl.load(ES + bc + tgt, mask=alive, other=0))
                    key = _order_key(tl.load(GP + br + j, mask=cand, other=0.0)) ^ -1  # ascending g_pooled
                    tl.store(KEYP + br + j, tl.where(cand, key, _KEY_NEG_INF), mask=mr)
                tl.debug_barrier()
                if CHUNKED:  # S lanes would not fit a program's registers: the keys stay in KEYP
                    thr, need, n_eq = _kth_largest_chunked(KEYP + br, R, n_drop, S, CH, True)
                else:
                    thr, need, n_eq = _kth_largest(KEYP + br, R, n_drop, S, True)
                thr2 = tl.full([], -1, tl.int32)  # every tie dropped
                if need < n_eq:  # the `need` ties with the largest token_pos (distinct per row)
                    tl.debug_barrier()
                    for j0 in range(0, R, CH):
                        j = j0 + tl.arange(0, CH)
                        mr = j < R
                        k = tl.load(KEYP + br + j, mask=mr, other=_KEY_NEG_INF)
                        tie = mr & (k == thr) & (k > _KEY_NEG_INF)
                        tl.store(KEYP + br + j, tl.where(tie, tl.load(TP + br + j, mask=tie, other=0), _KEY_NEG_INF),
                                 mask=mr)
                    tl.debug_barrier()
                    if CHUNKED:
                        thr2, need2, n_eq2 = _kth_largest_chunked(KEYP + br, R, need, S, CH, True)
                    else:
                        thr2, need2, n_eq2 = _kth_largest(KEYP + br, R, need, S, True)
                tl.debug_barrier()
        # virtual places (nothing dropped) and the survivors
        for j0 in range(0, R, CH):
            j = j0 + tl.arange(0, CH)
            mr = j < R
            alive, e, tgt = _slot_alive(LUT, BIAS, DEST, j, j < sf, bc, br, fill)
            v = (tl.load(GSTART + bc + tgt, mask=alive, other=0) + tl.load(SEGOFF + bc + e, mask=alive, other=0)
                 + j - tl.load(ES + bc + e, mask=alive, other=0))
            drop = alive & (thr < _I32_MAX)
            if CAP:
                cand = alive & (tl.load(CLS + bc + tgt, mask=alive, other=0) == 2)
                cand = cand & (j != tl.load(ES + bc + tgt, mask=alive, other=0))
                key = _order_key(tl.load(GP + br + j, mask=cand, other=0.0)) ^ -1
                tp = tl.load(TP + br + j, mask=cand, other=0)
                drop = drop & cand & ((key > thr) | ((key == thr) & (tp >= thr2)))
            tl.store(VJ + br + j, tl.where(alive, v, -1), mask=mr)
            tl.store(SURV + br + v, (~drop).to(tl.int32), mask=alive)
        tl.debug_barrier()
        n_slots = tl.zeros([], tl.int32)
        for v0 in range(0, n_live, CH):
            v = v0 + tl.arange(0, CH)
            mv = v < n_live
            s = tl.load(SURV + br + v, mask=mv, other=0)
            tl.store(SURV + br + v, tl.where(s != 0, n_slots + tl.cumsum(s, axis=0) - s, -1), mask=mv)
            n_slots += tl.sum(s, axis=0)
        tl.debug_barrier()
        for j0 in range(0, R, CH):
            j = j0 + tl.arange(0, CH)
            mr = j < R
            vj = tl.load(VJ + br + j, mask=mr & (j < sf), other=-1)
            tl.store(NEWPOS + br + j, tl.load(SURV + br + vj, mask=vj >= 0, other=-1), mask=mr)
        tl.debug_barrier()
        for c0 in range(0, C, CH):
            e = c0 + tl.arange(0, CH)
            m = e < C
            nid = tl.load(NEWIDX + bc + e, mask=m, other=-1)
            kept = nid >= 0
            hs = tl.load(ES + bc + e, mask=kept, other=0)
            tl.store(NSTART + bc + nid, tl.load(NEWPOS + br + hs, mask=kept, other=0), mask=kept)
        n_ord = tl.zeros([], tl.int32)
        for k0 in range(0, sf, CH):
            k = k0 + tl.arange(0, CH)
            mk = k < sf
            o = tl.load(ORDER + br + k, mask=mk, other=-1)
            npos = tl.load(NEWPOS + br + o, mask=mk & (o >= 0), other=-1)
            keep = (npos >= 0).to(tl.int32)
            tl.store(NORD + br + n_ord + tl.cumsum(keep, axis=0) - keep, npos, mask=keep != 0)
            n_ord += tl.sum(keep, axis=0)
        tl.store(INFO + row * 8 + 2, n_slots)


# -- 5, 6: slots ------------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C", "R"])
def _slot_stage_kernel(LUT, KS, TP, SG, SP, SC, DEST, INFO, NEWIDX, NEWPOS, GCNT, ONORM, NNORM, LUTX, KSX, TPX, SGX,
                       SPX, SCX, C, R, BS: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    if tl.load(INFO + row * 8) != 0:
        bc = row * C
        br = row * R
        sf = tl.load(INFO + row * 8 + 4)
        j = blk * BS + tl.arange(0, BS)
        mj = j < sf
        np_ = tl.load(NEWPOS + br + j, mask=mj, other=-1)
        ok = np_ >= 0
        e = tl.load(LUT + br + j, mask=ok, other=0)
        tgt = tl.load(DEST + bc + e, mask=ok, other=0)
        merged = ok & (tl.load(GCNT + bc + tgt, mask=ok, other=0) > 0)
        ks = tl.load(KS + br + j, mask=ok, other=1.0)
        nn = tl.load(NNORM + bc + tgt, mask=merged, other=1.0)
        on = tl.load(ONORM + bc + e, mask=merged, other=1.0)
        ks = tl.where(merged, tl.where(nn > 0.0, ks * on / tl.where(nn > 0.0, nn, 1.0), 1.0), ks)
        at = br + np_
        tl.store(LUTX + at, tl.load(NEWIDX + bc + tgt, mask=ok, other=-1), mask=ok)
        tl.store(KSX + at, ks, mask=ok)
        tl.store(TPX + at, tl.load(TP + br + j, mask=ok, other=0), mask=ok)
        tl.store(SGX + at, tl.load(SG + br + j, mask=ok, other=0.0), mask=ok)
        tl.store(SPX + at, tl.load(SP + br + j, mask=ok, other=0.0), mask=ok)
        tl.store(SCX + at, tl.load(SC + br + j, mask=ok, other=0.0), mask=ok)


@triton_jit(do_not_specialize=["R"])
def _slot_write_kernel(LUT, KS, TP, SG, SP, SC, ORDER, SFILL, INFO, NORD, LUTX, KSX, TPX, SGX, SPX, SCX, R,
                       BS: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    if tl.load(INFO + row * 8) != 0:
        br = row * R
        sf = tl.load(INFO + row * 8 + 4)
        ns = tl.load(INFO + row * 8 + 2)
        k = blk * BS + tl.arange(0, BS)
        mk = k < tl.maximum(sf, ns)
        live = k < ns
        at = br + k
        tl.store(LUT + at, tl.load(LUTX + at, mask=live & mk, other=-1), mask=mk)
        tl.store(KS + at, tl.load(KSX + at, mask=live & mk, other=1.0), mask=mk)
        tl.store(TP + at, tl.load(TPX + at, mask=live & mk, other=0), mask=mk)
        tl.store(SG + at, tl.load(SGX + at, mask=live & mk, other=0.0), mask=mk)
        tl.store(SP + at, tl.load(SPX + at, mask=live & mk, other=0.0), mask=mk)
        tl.store(SC + at, tl.load(SCX + at, mask=live & mk, other=0.0), mask=mk)
        tl.store(ORDER + at, tl.load(NORD + at, mask=live & mk, other=-1), mask=mk)
        if blk == 0:
            tl.store(SFILL + row, ns.to(tl.int64))


# -- 7: entry metadata ------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C", "R"])
def _entry_meta_kernel(BIAS, POS, ES, FILL, INFO, NSTART, TPX, C, R, BE: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    if tl.load(INFO + row * 8) != 0:
        bc = row * C
        nk = tl.load(INFO + row * 8 + 1)
        ns = tl.load(INFO + row * 8 + 2)
        i = blk * BE + tl.arange(0, BE)
        mi = i < C
        kept = mi & (i < nk)
        st = tl.load(NSTART + bc + i, mask=kept, other=0)
        en = tl.load(NSTART + bc + i + 1, mask=kept & (i + 1 < nk), other=0)
        en = tl.where(i + 1 < nk, en, ns)
        cnt = tl.where(kept, en - st, 0)
        pmax = tl.full([BE], -1, tl.int32)
        for k in range(0, tl.max(cnt, axis=0)):
            pmax = tl.maximum(pmax, tl.load(TPX + row * R + st + k, mask=k < cnt, other=-1))
        tl.store(ES + bc + i, tl.where(kept, st, 0), mask=mi)
        tl.store(BIAS + bc + i, tl.where(kept, 0.0, float("-inf")), mask=mi)
        tl.store(POS + bc + i, pmax.to(tl.int64), mask=kept)
        if blk == 0:
            tl.store(FILL + row, nk.to(tl.int64))


# -- 8, 9: the staged block move of keys, values, raw keys ------------------------------------------
@triton_jit()
def _move(K, V, RK, XK, XV, XR, SRC, MRG, INFO, C, D, STAGE: tl.constexpr, BS: tl.constexpr, DS: tl.constexpr,
          NSLICE: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2)
    if tl.load(INFO + row * 8) != 0:
        n_kept = tl.load(INFO + row * 8 + 1)
        j0 = blk * BS
        if j0 < n_kept:
            j = j0 + tl.arange(0, BS)
            mj = j < n_kept
            src = tl.load(SRC + row * C + j, mask=mj, other=0)
            mrg = mj & (tl.load(MRG + row * C + j, mask=mj, other=0) != 0)
            moved = mj & (src != j) & ~mrg
            halo = moved & (src >= j0 + BS)
            own = moved & (src < j0 + BS)
            cols = (p % NSLICE) * DS + tl.arange(0, DS)
            t = p // NSLICE
            if t == 0:
                X = K
                SX = XK
            elif t == 1:
                X = V
                SX = XV
            else:
                X = RK
                SX = XR
            cm = (cols < D)[None, :]
            at_d = (row * C + j)[:, None] * D + cols[None, :]
            at_s = (row * C + src)[:, None] * D + cols[None, :]
            if STAGE:
                tl.store(SX + at_d, tl.load(X + at_s, mask=halo[:, None] & cm), mask=halo[:, None] & cm)
            else:
                x = tl.load(X + at_s, mask=own[:, None] & cm)
                x = tl.where((halo | mrg)[:, None], tl.load(SX + at_d, mask=(halo | mrg)[:, None] & cm), x)
                tl.debug_barrier()  # every load of the block before any store to it
                tl.store(X + at_d, x, mask=(moved | mrg)[:, None] & cm)


@triton_jit()
def _stage_kernel(K, V, RK, XK, XV, XR, SRC, MRG, INFO, C, D, BS: tl.constexpr, DS: tl.constexpr,
                  NSLICE: tl.constexpr):
    _move(K, V, RK, XK, XV, XR, SRC, MRG, INFO, C, D, True, BS, DS, NSLICE)


@triton_jit()
def _move_kernel(K, V, RK, XK, XV, XR, SRC, MRG, INFO, C, D, BS: tl.constexpr, DS: tl.constexpr,
                 NSLICE: tl.constexpr):
    _move(K, V, RK, XK, XV, XR, SRC, MRG, INFO, C, D, False, BS, DS, NSLICE)


# -- launcher ---------------------------------------------------------------------------------------
def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def supports(keys, lut) -> bool:
    """Whether the kernels take this state: Triton installed, D <= 256. Any R: past MAX_SLOTS the cap's bisection
    reads the row's keys from memory in chunks (_kth_largest_chunked) instead of holding them in registers."""
    return triton is not None and keys.shape[-1] <= 256


def triton_ems_merge(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
                     slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, g, g_pooled, cls, dest, due, gamma, *,
                     entry_block=None, group_chunk=None, chunk=None, merge_block=None, member_step=None,
                     slot_block=None, move_slots=None, move_columns=None, chunked_select=None):
    """Launch the nine kernels (module docstring); the state is updated in place like the reference. The inputs
    are checked by the op (kvrewrite.kernels.ems_merge); the keyword knobs (powers of two) change only the blocking
    (the fp32 merge sums follow MEMBER_STEP's chunks); chunked_select (default: R past MAX_SLOTS) takes the cap's
    chunked bisection, which gives the same thresholds. Under TRITON_INTERPRET=1 it runs on CPU tensors."""
    if triton is None:
        raise NotImplementedError(f"{NAME} needs Triton (pip install triton)")
    B, H, C, D = keys.shape
    R = lut.shape[-1]
    rows = B * H
    if rows == 0 or C == 0 or R == 0 or D == 0:
        return
    dev = keys.device
    has_raw = raw_keys.shape[2] > 0
    be, gch, ch = entry_block or ENTRY_BLOCK, group_chunk or GROUP_CHUNK, chunk or CHUNK
    ob, mb, bs = merge_block or MERGE_BLOCK, member_step or MEMBER_STEP, slot_block or SLOT_BLOCK
    ms, mc = move_slots or MOVE_SLOTS, move_columns or MOVE_COLUMNS
    block_d = triton.next_power_of_2(D)
    due_i = due.to(torch.int32).contiguous()
    ce = torch.empty(13, rows, C, dtype=torch.int32, device=dev)
    cnt, rank, newidx, src, moff, mem, segoff, gslots, gstart, nstart, mlist = (ce[i] for i in range(11))
    onorm, nnorm = ce[11].view(torch.float32), ce[12].view(torch.float32)
    cz = torch.zeros(2, rows, C, dtype=torch.int32, device=dev)
    gcnt, mrg = cz[0], cz[1]
    w = torch.empty(rows, C, dtype=torch.float64, device=dev)
    cr = torch.empty(11, rows, R, dtype=torch.int32, device=dev)
    keyp, vj, surv, newpos, nord, lutx, tpx = (cr[i] for i in range(7))
    ksx, sgx, spx, scx = (cr[i].view(torch.float32) for i in range(7, 11))
    info = torch.zeros(rows, INFO_WORDS, dtype=torch.int32, device=dev)
    xk, xv = torch.empty_like(keys), torch.empty_like(values)
    xr = torch.empty_like(raw_keys) if has_raw else xk
    rk = raw_keys if has_raw else keys
    _w_kernel[(triton.cdiv(C, be), rows)](bias, fill, entry_start, slot_fill, g, due_i, cnt, w, C, R, BE=be)
    _group_kernel[(rows,)](fill, slot_fill, cls, dest, due_i, rank, gcnt, newidx, src, moff, mem, mlist, info, C,
                           GCH=gch, CH=min(ch, triton.next_power_of_2(C)), num_warps=8)
    _merge_kernel[(triton.cdiv(C, ob), rows)](keys, values, rk, xk, xv, xr, due_i, cnt, w, gcnt, newidx, moff, mem,
                                              segoff, gslots, onorm, nnorm, mrg, C, D, HAS_RAW=has_raw, OB=ob, MB=mb,
                                              BLOCK_D=block_d, num_warps=4)
    S = triton.next_power_of_2(R)
    cap = not math.isinf(gamma)
    chunked = S > MAX_SLOTS if chunked_select is None else chunked_select
    _layout_kernel[(rows,)](bias, entry_start, lut, token_pos, g_pooled, slot_order, budget, cls, dest, info, newidx,
                            segoff, gslots, gstart, keyp, vj, surv, newpos, nstart, nord, C, R,
                            _bits(gamma - 1 if cap else 0.0), CAP=cap, S=S, CH=min(ch, S), CHUNKED=chunked,
                            num_warps=_select_warps(min(S, MAX_SLOTS)))
    grid_r = (triton.cdiv(R, bs), rows)
    _slot_stage_kernel[grid_r](lut, key_scale, token_pos, s_glo, s_loc_past, s_loc_cur, dest, info, newidx, newpos,
                               gcnt, onorm, nnorm, lutx, ksx, tpx, sgx, spx, scx, C, R, BS=bs)
    _slot_write_kernel[grid_r](lut, key_scale, token_pos, s_glo, s_loc_past, s_loc_cur, slot_order, slot_fill, info,
                               nord, lutx, ksx, tpx, sgx, spx, scx, R, BS=bs)
    _entry_meta_kernel[(triton.cdiv(C, be), rows)](bias, slot_pos, entry_start, fill, info, nstart, tpx, C, R, BE=be)
    ds = min(mc, block_d)
    nslice = triton.cdiv(D, ds)
    grid = (triton.cdiv(C, ms), rows, (3 if has_raw else 2) * nslice)
    for kernel in (_stage_kernel, _move_kernel):
        kernel[grid](keys, values, rk, xk, xv, xr, src, mrg, info, C, D, BS=ms, DS=ds, NSLICE=nslice, num_warps=4)
