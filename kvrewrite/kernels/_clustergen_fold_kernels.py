"""Triton kernels of kvrewrite::clustergen_fold (private: the op's file owns the schema, the reference and the
registration; its CUDA path calls triton_clustergen_fold). The semantics are the op's (its module docstring and
docs/contracts/clustergen.md §1.5-1.11, §3.2), decision for decision.

Design. Nothing is read on the host; every grid is fixed by the shapes (rows = B * Hkv, C, M_max), so a call is
CUDA-graph capturable. A program whose row is not due (or has nothing to fold) returns at once, and every loop is
bounded by data loaded on the device (the row's fill, |F|, the open clusters, M_target), so a decode-time call
works in proportion to the g folded tokens and the sketch it rewrites, not to the capacity. Every output element
has one writer; the only atomics are int32 counts (deterministic). A row value that every warp of a program reads and
the program then rewrites (the pack launch's fill and n_clusters) is written only after a barrier that every warp
reaches after its reads (a warp that read the new value would skip its share: stop 59's race, docs/methods.md).
Launches:

1. split (grid rows): E = the valid exact slots of [0, fill) ranked by a chunked cumsum; FS = F's slots in order,
   KS = the kept (sinks, window) slots in order; INFO = [due, |F|, n_kept].
2. calibrate (grid rows; rows with F and delta < 0 only): greedy k-center over F's keys, min(M_target, M_max, |F|)
   passes over F, each updating every point's squared distance to its nearest centre (scratch D2, -1 marks a
   chosen point) and finding the farthest (first on ties; per-lane running maxima, one reduction per pass);
   delta = fp32(1.001) * sqrt_rn(max d2).
3. distances (grid cluster blocks x F blocks x rows): for every folded key, the nearest of the clusters open
   BEFORE the fold (min and first argmin per block of clusters): the parallel part of the leader clustering;
   the first cluster block also writes w_f = ||v_f||^2 (fp32). DIST_DOT (the default): the distances through the
   dot product on tensor cores, every cluster block in one program (below).
4. resolve (grid rows): the fp64 prefix sums of w (mu_old + cumsum); then F in blocks of RB keys, in order: the
   block's nearest old cluster (the partial minima of launch 3), its nearest cluster opened earlier in this fold
   (a distance tile against the leaders opened so far), the block's own distance tile; then the exact sequential
   rule key by key on those numbers (join i* if d^2 <= delta^2, else open, else force), in registers: a key that
   opens a cluster offers it to the block's later keys (one column of the tile), so a step costs two small
   reductions (three when it opens). RESOLVE_EVENTS: a step per opening instead of per key (the keys before the
   next far key join at once; once no cluster is free the far keys left are forced at once), the offered column
   computed when a key opens. ASSIGN = each folded key's cluster, NL = the leaders opened in this fold in order,
   JC = joiners per cluster (int32 atomics), INFO += [n_clusters after, n_forced now]. JOINER_INDEX: also each
   cluster's joiners of the fold listed in F order (JO offsets, JL keys).
5. reservoirs (grid sketch blocks x rows): per sketch slot j the hash uniform (mix32_triton), the key-slot draw
   floor(u n) (integers) and its joiner (a scan of ASSIGN for cluster i's m-th; JOINER_INDEX: read off JL), the
   value-slot draw (binary search of the prefix sums); the taken samples copy key, value and slot_pos; every sketch
   slot's bias and role.
6. pack (grid rows): new representatives, count += joiners, n_clusters, n_forced, n_seen, mu; the kept slots
   staged in scratch then written to [0, n_kept) (bias 0, role 0); [n_kept, fill) freed (bias -inf, role 0);
   fill = n_kept.

The direct form's distances (dist_dot=False) are sum((a - b)^2) in fp32 over D (as the reference), in chunks of DC
dims: a different summation order than torch's, so fp32 distances agree to rounding (exactly on inputs whose sums
are exact, e.g. small-integer keys: how the tests make every decision exact). With DIST_DOT (the default) launch 3
expands them, ||a||^2 + ||b||^2 - 2 a.b (fp32 norms, the product on tensor cores, clamped at 0): exact on those
inputs too, and otherwise off the direct form by a few ulp of the keys' squared norms, so a near-tie (two clusters,
or a distance and delta, that close) may decide otherwise than the reference.

Freed slots: the reference writes bias -inf / role 0 on [n_kept, C - S); these kernels on [n_kept, fill) only,
so that a decode call's work does not grow with the capacity. Identical whenever [fill, C - S) already holds bias
-inf and role 0, which the reset state, this op's output and cache_append (which writes at fill) keep.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import struct

import torch

from kvrewrite.kernels._hash import mix32_triton
from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels.kmeans_cluster import MASK32, mix32

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its reference; only triton_clustergen_fold raises
    triton = tl = None

NAME = "triton_clustergen_fold"
SPLIT_CH = 1024  # slots per chunk of the split pass
# launch 2: points per chunk of a pass and warps. 256 and 8 by an H200 sweep of the first chunk's fold (batch 8, |F|
# 2012, 204 centres: 57.6-58.1 ms at 64 points, 23.9 at 256, 91.8-93.0 at 128, 106-108 at 256 with 16 warps; stop
# 58, docs/bench.md). Tried and dropped: the chunk loop software-pipelined (tl.range num_stages 2 or 3). Stop 61 built
# it as a knob (its GPU test passed: the same state); stop 62 timed it on an H200 at batch 8 (two runs; docs/bench.md
# "Stop 62 runs"): 88.4-88.8 ms at 256 points and 2 stages, 175 at 3, 63-67 at 128 points, against 23.9 without.
CAL_CH, CAL_WARPS = 256, 8
DIST_BF, DIST_BM, DIST_FO = 16, 32, 1024  # launch 3: keys x clusters per tile, keys per program
# DIST_DOT (on): launch 3's distances as ||a||^2 + ||b||^2 - 2 a.b with the product on tensor cores (DOT_BF x DOT_BM
# tiles, every cluster block in one program, so each key leaves one running minimum and launch 4 reads one, not one per
# block), instead of sum((a - b)^2) on CUDA cores in DC-dim steps (dist_dot=False: the direct form); launch 4's
# distances to the leaders opened in the fold too (its RES_B x RES_BL tiles). Why: at a later prefill chunk's fold (2048
# keys, 407 open clusters, batch 8, H200) the direct distance launch took 4.95 of the fold's 8.45 ms (docs/bench.md
# "Stop 59 runs"). What changes: the rounding (the expansion's, clamped at 0), so a key whose two nearest clusters, or
# whose nearest distance and delta, agree to ~1e-7 of its squared norm may decide otherwise than the reference; on
# inputs whose sums are exact (small-integer keys: the tests) every decision is the reference's; on real keys
# (SmolLM2-135M, fp32 in the interpreter, stop 61; SmolLM2-135M and Qwen2.5-0.5B, bf16, on an H200 with RES_B 128, stop
# 62: 297 folds; docs/bench.md) the same state as the direct form; on random normal bf16 keys at batch 8 (all distances
# within a few percent of each other) some decisions differ. Timed with RESOLVE_EVENTS and JOINER_INDEX (H200, batch 8,
# CUDA-graph replays, two runs; `python -m kvrewrite.bench.clustergen_fold --form-sweep`, docs/bench.md "Stop 62 runs"):
# a later chunk's fold 8.50 -> 1.11 ms, the first chunk's 23.96 -> 16.30, a decode step's 423 -> 342 us.
DIST_DOT = True
DOT_BF, DOT_BM, DOT_FO = 64, 64, 256  # keys x clusters per tile, keys per program (its loop covers every cluster)
# launch 4: keys per sequential block, leaders per tile. RES_B 128 with the three forms (H200, stop 62) took a later
# prefill chunk's fold at batch 8 from 1.11 to 0.93 ms and the fold bench's decode case from 342 to 353 us, but end to
# end it made ClusterGen's batch-1 compressing decode step 11.52 ms against 8.62 at 32 (4.67 against 4.59 ms/token)
# on `--no-prefill`'s synthetic state, which then left the sketch empty, so its decode folds opened a cluster a key
# (docs/bench.md "Stop 62 runs"; the bench now replays the prompt's folds): 32 stays until timed on a real state.
RES_B, RES_BL = 32, 32
# RESOLVE_EVENTS (on): launch 4 takes a step per key that opens a cluster (the keys before the next one that is farther
# than delta from every cluster join their nearest at once; once no cluster is free, every far key left is forced at
# once) instead of a step per key: the same rule and the same results (nothing but an opening changes another key's
# nearest cluster). Why: a later prefill chunk's fold opens no cluster (all M open) yet stepped through its 2048 keys
# one by one, 1.82 ms a fold at batch 8 (docs/bench.md "Stop 59 runs"). Alone (stop 62, batch 8): 8.50 -> 7.07 ms
# a later chunk's fold, 423 -> 404 us a decode step's.
RESOLVE_EVENTS = True
# launch 5: sketch slots a program, and its warps. Timed (H200, stop 63, the fold bench's --reservoir-sweep, two rounds,
# the fold's whole CUDA-graph replay): with D specialised, 64 slots 3-5% faster than 32 at batch 8's decode fold (97
# against 100-103 us) and within 1% elsewhere; 16 slots at 4 warps 30% slower there; 32 stays. The slots a program
# change the reduction layout of a value sample's ||v||^2, so a value slot's bias can differ in its last bits (16 at 4
# warps did); every other field is the same for any value.
SK_BS, SK_WARPS = 32, 4
# SK_SPLIT (launch 5's form, on): the kept value samples' ||v||^2 in one unrolled pass of independent loads over 32-bit
# row offsets, and the taken samples' copies only in a block that takes any; off: one loop over D chunks that copies,
# then re-reads, each chunk in turn (a store before each load, so nothing overlaps). The same bits (wj sums its chunks
# in the same order). Why: a decode fold takes a few samples a row, yet every program walked the copy loop. Timed (H200,
# stop 63, D specialised, two rounds): a decode fold 100-103 against 110-112 us at batch 8, 51 against 53 at batch 1.
SK_SPLIT = True
SCAN_CH = 16  # ASSIGN entries per step of launch 5's joiner scan
# JOINER_INDEX (on): launch 4 also lists each cluster's joiners of the fold in F order (each key's rank among them as it
# resolves a block, then offsets and a scatter: JO, JL), and launch 5 reads a key slot's m-th joiner there instead
# of scanning ASSIGN (SCAN_CH entries a step over all |F| keys, in every program with a slot to take). The same
# sample. Why: launch 5 took 1.69 ms of a later prefill chunk's 8.45 ms fold at batch 8 (docs/bench.md "Stop 59
# runs"), nearly every program scanning its 2048 ASSIGN entries. Alone (stop 62, batch 8): 8.50 -> 7.02 ms a later
# chunk's fold.
JOINER_INDEX = True
DC = 8  # dims per step of a distance tile
PACK_B = 16  # slots per step of launch 6


# D is specialised (kept out of every do_not_specialize list): Triton then knows a head dimension that is a multiple of
# 16 and vectorises the row loads and masks; unspecialised, every launch compiled for any D, with scalar 2-byte loads
# (offline sm_90, bf16, D 128, the default launches, stop 63: registers a thread 255 with a 96-byte spill -> 61 for the
# calibration, 220 -> 116 distances, 168 -> 72 resolve, 168 -> 40 reservoirs, 168 -> 40 pack). The whole fold, H200,
# CUDA-graph replays (stop 63; with SK_SPLIT; docs/bench.md "Stop 63 runs"): batch 8 decode 357 -> 101 us, first chunk
# 16.3 -> 5.9 ms, later chunk 1.09 -> 0.43 ms; batch 1 decode 112 -> 52 us, first chunk 15.0 -> 5.1, later 0.52 -> 0.28.

# -- helpers -----------------------------------------------------------------------------------------
@triton_jit()
def _f64(bits):
    """A Python float passed as its IEEE bits (Triton passes Python floats as fp32)."""
    return (tl.full([], 0, tl.int64) + bits).to(tl.float64, bitcast=True)


@triton_jit()
def _round_half_even(y):
    """Python's round() of an fp64 y >= 0, as int64 (for y < 0, something <= 0)."""
    f = y.to(tl.int64)
    d = y - f.to(tl.float64)
    up = (d > 0.5) | ((d == 0.5) & ((f & 1) == 1))
    return f + up.to(tl.int64)


@triton_jit()
def _sizes(BUDGET, n_sink, window, t, vs_bits, ct_bits, Mmax):
    """(S, s, M clamped to [1, M_max], M_target) from budget[0], as the op's sketch_sizes (int64 scalars)."""
    S = tl.load(BUDGET) - n_sink - window
    s = _round_half_even(S.to(tl.float64) * _f64(vs_bits))
    Mu = (S - s) // t
    M = tl.minimum(tl.maximum(Mu, 1), Mmax)
    Mt = tl.maximum(_round_half_even(Mu.to(tl.float64) * _f64(ct_bits)), 1)
    return S, s, M, Mt


@triton_jit()
def _d2_tile(KA, offa, ma, KB, offb, mb, D, BA: tl.constexpr, BB: tl.constexpr, DCH: tl.constexpr):
    """[BA, BB] fp32 sum over D of (a - b)^2, rows a at KA + offa (element offsets), b at KB + offb."""
    acc = tl.zeros([BA, BB], tl.float32)
    for d0 in range(0, D, DCH):
        dd = d0 + tl.arange(0, DCH)
        md = dd < D
        a = tl.load(KA + offa[:, None] + dd[None, :], mask=ma[:, None] & md[None, :], other=0.0).to(tl.float32)
        b = tl.load(KB + offb[:, None] + dd[None, :], mask=mb[:, None] & md[None, :], other=0.0).to(tl.float32)
        diff = a[:, None, :] - b[None, :, :]
        acc += tl.sum(diff * diff, axis=2)
    return acc


@triton_jit()
def _d2_col(KA, offa, ma, offb, D, BA: tl.constexpr, DCH: tl.constexpr):
    """[BA] fp32 sum over D of (a - b)^2, rows a at KA + offa against the one row b at KA + offb (a scalar offset),
    in _d2_tile's chunks."""
    acc = tl.zeros([BA], tl.float32)
    for d0 in range(0, D, DCH):
        dd = d0 + tl.arange(0, DCH)
        md = dd < D
        a = tl.load(KA + offa[:, None] + dd[None, :], mask=ma[:, None] & md[None, :], other=0.0).to(tl.float32)
        b = tl.load(KA + offb + dd, mask=md, other=0.0).to(tl.float32)
        diff = a - b[None, :]
        acc += tl.sum(diff * diff, axis=1)
    return acc


# -- launch 1: split ---------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C", "n_sink", "window"])
def _cg_split_kernel(BIAS, ROLE, FILL, BUDGET, FS, KS, INFO, C, n_sink, window, CH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    fill = tl.load(FILL + row)
    due = fill >= tl.load(BUDGET + 1)
    nF = tl.zeros([], tl.int32)
    V = tl.zeros([], tl.int32)
    if due:
        n_fill = tl.minimum(fill, C).to(tl.int32)
        for c0 in range(0, n_fill, CH):
            s = c0 + tl.arange(0, CH)
            m = s < n_fill
            ex = m & (tl.load(ROLE + base + s, mask=m, other=1) == 0) & \
                (tl.load(BIAS + base + s, mask=m, other=float("-inf")) > float("-inf"))
            V += tl.sum(ex.to(tl.int32), axis=0)
        nF = tl.maximum(V - n_sink - window, 0)
        r0 = tl.zeros([], tl.int32)
        for c0 in range(0, n_fill, CH):
            s = c0 + tl.arange(0, CH)
            m = s < n_fill
            ex = m & (tl.load(ROLE + base + s, mask=m, other=1) == 0) & \
                (tl.load(BIAS + base + s, mask=m, other=float("-inf")) > float("-inf"))
            ei = ex.to(tl.int32)
            rank = r0 + tl.cumsum(ei, axis=0) - ei
            is_f = ex & (rank >= n_sink) & (rank < n_sink + nF)
            tl.store(FS + base + rank - n_sink, s, mask=is_f)
            tl.store(KS + base + tl.where(rank < n_sink, rank, rank - nF), s, mask=ex & ~is_f)
            r0 += tl.sum(ei, axis=0)
    tl.store(INFO + row * 8, due.to(tl.int32))
    tl.store(INFO + row * 8 + 1, nF)
    tl.store(INFO + row * 8 + 2, V - nF)


# -- launch 2: δ calibration -------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C", "n_sink", "window", "t", "vs_bits", "ct_bits", "Mmax"])
def _cg_calib_kernel(K, FS, INFO, DELTA, D2, BUDGET, C, D, n_sink, window, t, vs_bits, ct_bits, Mmax,
                     CH: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    due = tl.load(INFO + row * 8)
    nF = tl.load(INFO + row * 8 + 1)
    if (due != 0) & (nF > 0) & (tl.load(DELTA + row) < 0.0):
        _, _, _, Mt = _sizes(BUDGET, n_sink, window, t, vs_bits, ct_bits, Mmax)
        k = tl.minimum(tl.minimum(Mt, Mmax), nF.to(tl.int64)).to(tl.int32)
        dcol = tl.arange(0, BLOCK_D)
        dm = dcol < D
        ci = tl.zeros([], tl.int32)  # the next centre (F index): the first folded key
        best = tl.full([], -1.0, tl.float32)
        for step in range(0, k):
            cslot = tl.load(FS + base + ci).to(tl.int64)
            c = tl.load(K + (base + cslot) * D + dcol, mask=dm, other=0.0).to(tl.float32)
            lane_best = tl.full([CH], -2.0, tl.float32)  # per lane: the largest d2 so far, the first on ties
            lane_i = tl.zeros([CH], tl.int32)
            for c0 in range(0, nF, CH):
                f = c0 + tl.arange(0, CH)
                m = f < nF
                slot = tl.load(FS + base + f, mask=m, other=0).to(tl.int64)
                x = tl.load(K + (base + slot)[:, None] * D + dcol[None, :], mask=m[:, None] & dm[None, :],
                            other=0.0).to(tl.float32)
                diff = x - c[None, :]
                dc = tl.sum(diff * diff, axis=1)
                old = tl.load(D2 + base + f, mask=m & (step > 0), other=float("inf"))
                new = tl.where(f == ci, -1.0, tl.minimum(old, dc))
                tl.store(D2 + base + f, new, mask=m)
                score = tl.where(m, new, -2.0)
                better = score > lane_best
                lane_best = tl.where(better, score, lane_best)
                lane_i = tl.where(better, f, lane_i)
            best = tl.max(lane_best, axis=0)
            ci = tl.min(tl.where(lane_best == best, lane_i, 2147483647), axis=0)
            tl.debug_barrier()
        r = tl.sqrt_rn(tl.maximum(best, 0.0))
        tl.store(DELTA + row, r * 1.001)  # fp32 r times fp32(1.001), as the reference


# -- launch 3: distances to the clusters open before the fold -----------------------------------------
@triton_jit()
def _rows(KA, off, m, D, BLOCK_D: tl.constexpr):
    """The rows at KA + off [B] (element offsets) as [B, BLOCK_D] (zero past D and where m is false) and their fp32
    squared norms."""
    dcol = tl.arange(0, BLOCK_D)
    x = tl.load(KA + off[:, None] + dcol[None, :], mask=m[:, None] & (dcol < D)[None, :], other=0.0)
    xf = x.to(tl.float32)
    return x, tl.sum(xf * xf, axis=1)


@triton_jit()
def _d2_dot(a, na, b, nb):
    """[BA, BB] fp32 ||a||^2 + ||b||^2 - 2 a.b (DIST_DOT) of loaded rows a, b and their squared norms (_rows); the
    product on tensor cores (16-bit keys: exact products, fp32 sums; fp32 keys: IEEE), clamped at 0 (the expansion's
    rounding can leave a tiny negative)."""
    if a.dtype == tl.float32:
        ab = tl.dot(a, tl.trans(b), input_precision="ieee")
    else:
        ab = tl.dot(a, tl.trans(b))
    return tl.maximum(na[:, None] + nb[None, :] - 2.0 * ab, 0.0)


@triton_jit(do_not_specialize=["C", "Mmax", "NCB"])
def _cg_dist_kernel(K, V, REP, FS, INFO, NCL, PD, PI, W, C, D, Mmax, NCB, BF: tl.constexpr, BM: tl.constexpr,
                    FO: tl.constexpr, DCH: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    cb = tl.program_id(0)
    fo = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    base = row * C
    due = tl.load(INFO + row * 8)
    nF = tl.load(INFO + row * 8 + 1)
    f_lo = fo * FO
    if (due != 0) & (f_lo < nF):
        f_hi = tl.minimum(f_lo + FO, nF)
        if cb == 0:  # w_f = ||v_f||^2 in fp32
            for f0 in range(f_lo, f_hi, BF):
                f = f0 + tl.arange(0, BF)
                m = f < f_hi
                slot = tl.load(FS + base + f, mask=m, other=0).to(tl.int64)
                _, w = _rows(V, (base + slot) * D, m, D, BLOCK_D)
                tl.store(W + base + f, w, mask=m)
        nc_old = tl.load(NCL + row).to(tl.int32)
        if DOT:  # every cluster block in this program (grid 1 x ...): one running minimum per key, NCB = 1
            if nc_old > 0:
                for f0 in range(f_lo, f_hi, BF):
                    f = f0 + tl.arange(0, BF)
                    m = f < f_hi
                    slot = tl.load(FS + base + f, mask=m, other=0).to(tl.int64)
                    a, na = _rows(K, (base + slot) * D, m, D, BLOCK_D)
                    bd = tl.full([BF], float("inf"), tl.float32)
                    bi = tl.zeros([BF], tl.int32)
                    for i0 in range(0, nc_old, BM):  # blocks in order, strict <: the first nearest on ties
                        i = i0 + tl.arange(0, BM)
                        mi = i < nc_old
                        rb, nb = _rows(REP, (row * Mmax + i).to(tl.int64) * D, mi, D, BLOCK_D)
                        acc = tl.where(mi[None, :], _d2_dot(a, na, rb, nb), float("inf"))
                        dmin = tl.min(acc, axis=1)
                        imin = tl.min(tl.where(acc == dmin[:, None], i[None, :], 2147483647), axis=1)
                        better = dmin < bd
                        bd = tl.where(better, dmin, bd)
                        bi = tl.where(better, imin, bi)
                    tl.store(PD + row * NCB * C + f, bd, mask=m)
                    tl.store(PI + row * NCB * C + f, bi, mask=m)
        else:
            i0 = cb * BM
            if i0 < nc_old:
                i = i0 + tl.arange(0, BM)
                mi = i < nc_old
                offr = (row * Mmax + i).to(tl.int64) * D
                for f0 in range(f_lo, f_hi, BF):
                    f = f0 + tl.arange(0, BF)
                    m = f < f_hi
                    slot = tl.load(FS + base + f, mask=m, other=0).to(tl.int64)
                    acc = _d2_tile(K, (base + slot) * D, m, REP, offr, mi, D, BF, BM, DCH)
                    acc = tl.where(mi[None, :], acc, float("inf"))
                    dmin = tl.min(acc, axis=1)
                    imin = tl.min(tl.where(acc == dmin[:, None], i[None, :], 2147483647), axis=1)
                    tl.store(PD + (row * NCB + cb) * C + f, dmin, mask=m)
                    tl.store(PI + (row * NCB + cb) * C + f, imin, mask=m)


# -- launch 4: the sequential resolve ----------------------------------------------------------------
@triton_jit(do_not_specialize=["C", "Mmax", "NCB", "n_sink", "window", "t", "vs_bits", "ct_bits"])
def _cg_resolve_kernel(K, FS, INFO, NCL, DELTA, MU, PD, PI, W, P, ASSIGN, NL, JC, JR, JO, JL, BUDGET, C, D, Mmax, NCB,
                       n_sink, window, t, vs_bits, ct_bits, BM: tl.constexpr, RB: tl.constexpr, BL: tl.constexpr,
                       DCH: tl.constexpr, CH: tl.constexpr, EVENTS: tl.constexpr, JIDX: tl.constexpr,
                       DOT: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    due = tl.load(INFO + row * 8)
    nF = tl.load(INFO + row * 8 + 1)
    if (due != 0) & (nF > 0):
        _, _, M, _ = _sizes(BUDGET, n_sink, window, t, vs_bits, ct_bits, Mmax)
        M32 = M.to(tl.int32)
        # value weights: P_l = mu_old + sum_{l' <= l} w_l' (fp64; sums of fp32 w are exact in fp64 in practice)
        mu_old = tl.load(MU + row).to(tl.float64)
        carry = tl.zeros([], tl.float64)
        for c0 in range(0, nF, CH):
            f = c0 + tl.arange(0, CH)
            m = f < nF
            w = tl.load(W + base + f, mask=m, other=0.0).to(tl.float64)
            tl.store(P + base + f, mu_old + (carry + tl.cumsum(w, axis=0)), mask=m)
            carry += tl.sum(w, axis=0)
        dl = tl.load(DELTA + row)
        dd2 = dl * dl
        nc_old = tl.load(NCL + row).to(tl.int32)
        nc = nc_old
        forced = tl.zeros([], tl.int32)
        nl = tl.zeros([], tl.int32)
        if DOT:  # launch 3 kept one running minimum per key over every cluster block
            ncb = tl.minimum(tl.cdiv(nc_old, BM), 1)
        else:
            ncb = tl.cdiv(nc_old, BM)
        fl = tl.arange(0, RB)
        for f0 in range(0, nF, RB):
            f = f0 + fl
            mf = f < nF
            slot = tl.load(FS + base + f, mask=mf, other=0).to(tl.int64)
            offk = (base + slot) * D
            if DOT:  # the block's keys and norms, for its tiles against the leaders
                ka, nka = _rows(K, offk, mf, D, BLOCK_D)
            # nearest old cluster (lowest index on ties: blocks in order, strict <)
            bd = tl.full([RB], float("inf"), tl.float32)
            bi = tl.zeros([RB], tl.int32)
            for cb in range(0, ncb):
                pd = tl.load(PD + (row * NCB + cb) * C + f, mask=mf, other=float("inf"))
                pi = tl.load(PI + (row * NCB + cb) * C + f, mask=mf, other=0)
                better = pd < bd
                bd = tl.where(better, pd, bd)
                bi = tl.where(better, pi, bi)
            # nearest cluster opened earlier in this fold (leader l is cluster nc_old + l)
            for l0 in range(0, nl, BL):
                lo = l0 + tl.arange(0, BL)
                ml = lo < nl
                lf = tl.load(NL + base + lo, mask=ml, other=0)
                lslot = tl.load(FS + base + lf, mask=ml, other=0).to(tl.int64)
                if DOT:
                    lrow, nlr = _rows(K, (base + lslot) * D, ml, D, BLOCK_D)
                    acc = _d2_dot(ka, nka, lrow, nlr)
                else:
                    acc = _d2_tile(K, offk, mf, K, (base + lslot) * D, ml, D, RB, BL, DCH)
                acc = tl.where(ml[None, :], acc, float("inf"))
                dmin = tl.min(acc, axis=1)
                lmin = tl.min(tl.where(acc == dmin[:, None], lo[None, :], 2147483647), axis=1)
                better = dmin < bd
                bd = tl.where(better, dmin, bd)
                bi = tl.where(better, nc_old + lmin, bi)
            lead = tl.zeros([RB], tl.int32)  # 1: opened a cluster
            cid = tl.zeros([RB], tl.int32)
            n_here = tl.minimum(nF - f0, RB)
            if EVENTS:
                # the same rule, a step per key that opens a cluster: the keys before the next far one join their
                # nearest (nothing changes for the others); once no cluster is free every far key left is forced
                q0 = tl.zeros([], tl.int32)
                while q0 < n_here:
                    rest = (fl >= q0) & mf
                    far_v = rest & (bd > dd2)
                    if nc >= M32:
                        forced += tl.sum(far_v.to(tl.int32), axis=0)
                        cid = tl.where(rest, bi, cid)
                        q0 = n_here
                    else:
                        qf = tl.min(tl.where(far_v, fl, RB), axis=0)
                        cid = tl.where(rest & (fl < qf), bi, cid)
                        if qf < n_here:  # key qf opens cluster nc and offers it to the block's later keys
                            sel = fl == qf
                            lead = tl.where(sel, 1, lead)
                            cid = tl.where(sel, nc, cid)
                            qslot = tl.max(tl.where(sel, slot, -1), axis=0)
                            col = _d2_col(K, offk, mf, (base + qslot) * D, D, RB, DCH)  # d2 of every key to key qf
                            better = (col < bd) & (fl > qf)
                            bd = tl.where(better, col, bd)
                            bi = tl.where(better, nc, bi)
                            nc += 1
                        q0 = qf + 1
            else:
                # the block's own distances, then the exact sequential rule key by key; a key that opens cluster idx
                # offers it to the block's later keys (strict <: clusters are offered in index order, the lowest
                # index wins ties)
                dd = _d2_tile(K, offk, mf, K, offk, mf, D, RB, RB, DCH)
                for q in range(0, n_here):
                    sel = fl == q
                    best_d = tl.min(tl.where(sel, bd, float("inf")), axis=0)
                    best_i = tl.max(tl.where(sel, bi, -1), axis=0)
                    far = best_d > dd2
                    opn = far & (nc < M32)
                    forced += (far & (nc >= M32)).to(tl.int32)
                    idx = tl.where(opn, nc, best_i)
                    lead = tl.where(sel, opn.to(tl.int32), lead)
                    cid = tl.where(sel, idx, cid)
                    if opn:
                        col = tl.min(tl.where(fl[None, :] == q, dd, float("inf")), axis=1)  # d2 of every key to key q
                        better = (col < bd) & (fl > q)
                        bd = tl.where(better, col, bd)
                        bi = tl.where(better, idx, bi)
                    nc += opn.to(tl.int32)
            tl.store(ASSIGN + base + f, cid, mask=mf)
            if JIDX:  # each key's rank among its cluster's joiners of this fold (JC: the earlier blocks' counts)
                before = tl.load(JC + row * Mmax + cid, mask=mf, other=0, cache_modifier=".cg")  # (atomics: L2)
                earlier = (cid[:, None] == cid[None, :]) & (fl[None, :] < fl[:, None]) & mf[None, :]
                tl.store(JR + base + f, before + tl.sum(earlier.to(tl.int32), axis=1), mask=mf)
                tl.debug_barrier()  # every thread's JC read before the block's increments
            tl.atomic_add(JC + row * Mmax + cid, tl.full([RB], 1, tl.int32), mask=mf)  # int32: deterministic
            tl.store(NL + base + nl + tl.cumsum(lead, axis=0) - lead, f, mask=lead != 0)
            nl += tl.sum(lead, axis=0)
            tl.debug_barrier()
        tl.store(INFO + row * 8 + 3, nc)
        if JIDX:  # the joiners of each cluster listed in F order: JO = offsets (exclusive cumsum of JC), JL = keys
            carry32 = tl.zeros([], tl.int32)
            for c0 in range(0, nc, CH):
                c = c0 + tl.arange(0, CH)
                mc = c < nc
                cnt = tl.load(JC + row * Mmax + c, mask=mc, other=0, cache_modifier=".cg")
                tl.store(JO + row * Mmax + c, carry32 + tl.cumsum(cnt, axis=0) - cnt, mask=mc)
                carry32 += tl.sum(cnt, axis=0)
            tl.debug_barrier()  # the offsets stored before any thread reads them
            for c0 in range(0, nF, CH):
                fa = c0 + tl.arange(0, CH)
                m = fa < nF
                a = tl.load(ASSIGN + base + fa, mask=m, other=0)
                at = (tl.load(JO + row * Mmax + a, mask=m, other=0, cache_modifier=".cg")
                      + tl.load(JR + base + fa, mask=m, other=0, cache_modifier=".cg"))
                tl.store(JL + base + at, fa, mask=m)
        tl.store(INFO + row * 8 + 4, forced)


# -- launch 5: reservoirs, sketch bias and role ------------------------------------------------------
@triton_jit(do_not_specialize=["C", "Mmax", "H", "n_sink", "window", "t", "vs_bits", "ct_bits", "hbase",
                               "hoff"])
def _cg_reservoir_kernel(K, V, BIAS, POS, ROLE, FS, INFO, COUNT, JC, ASSIGN, JO, JL, P, MU, NSEEN, BUDGET, C, D,
                         Mmax, H, n_sink, window, t, vs_bits, ct_bits, hbase, hoff, BS: tl.constexpr,
                         SCH: tl.constexpr, LOG_C: tl.constexpr, DCOPY: tl.constexpr, JIDX: tl.constexpr,
                         SPLIT: tl.constexpr, BLOCK_D: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    base = row * C
    due = tl.load(INFO + row * 8)
    nF = tl.load(INFO + row * 8 + 1)
    if (due != 0) & (nF > 0):
        S, s, M, _ = _sizes(BUDGET, n_sink, window, t, vs_bits, ct_bits, Mmax)
        if blk * BS < S:
            j = blk * BS + tl.arange(0, BS)
            mj = j < S
            slot = (C - S + j).to(tl.int64)
            nc_new = tl.load(INFO + row * 8 + 3)
            n_seen_new = tl.load(NSEEN + row) + nF
            # u = h24 * 2^-24, h = mix32(mix32(mix32(kv_head ^ hbase) ^ n_seen) ^ j), kv_head = hoff + row % H
            # (the head's index in the model layer: the op's head_offset)
            hb = (hbase.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32)
            kvh = (row % H + hoff).to(tl.uint32)
            h = mix32_triton(kvh ^ hb)
            h = mix32_triton(h ^ n_seen_new.to(tl.uint32))
            h = mix32_triton(h ^ j.to(tl.uint32))
            h24 = (h >> 8).to(tl.int64)
            Mt_ = M * t
            is_key = mj & (j < Mt_)
            is_val = mj & (j >= Mt_) & (j < Mt_ + s)
            ci = tl.minimum(j // t, Mmax - 1).to(tl.int32)
            open_j = is_key & (ci < nc_new)
            n_old = tl.load(COUNT + row * Mmax + ci, mask=open_j, other=0).to(tl.int64)
            n_tot = n_old + tl.load(JC + row * Mmax + ci, mask=open_j, other=0).to(tl.int64)
            pick = (h24 * n_tot) >> 24  # floor(u n), exact
            take_k = open_j & (pick >= n_old)
            want = (pick - n_old + 1).to(tl.int32)  # the cluster's want-th joiner of this fold
            if JIDX:  # the resolve's list of the cluster's joiners, in F order
                src_k = tl.load(JL + base + tl.load(JO + row * Mmax + ci, mask=take_k, other=0) + want - 1,
                                mask=take_k, other=0)
            else:  # a scan of ASSIGN for the cluster's want-th joiner
                src_k = tl.zeros([BS], tl.int32)
                if tl.sum(take_k.to(tl.int32), axis=0) > 0:
                    run = tl.zeros([BS], tl.int32)
                    for c0 in range(0, nF, SCH):
                        fa = c0 + tl.arange(0, SCH)
                        a = tl.load(ASSIGN + base + fa, mask=fa < nF, other=-1)
                        eq = (a[None, :] == ci[:, None]) & take_k[:, None]
                        cum = run[:, None] + tl.cumsum(eq.to(tl.int32), axis=1)
                        src_k += tl.sum(tl.where(eq & (cum == want[:, None]), fa[None, :], 0), axis=1)
                        run += tl.sum(eq.to(tl.int32), axis=1)
            mu_old = tl.load(MU + row).to(tl.float64)
            mu_new = tl.load(P + base + nF - 1)
            x = h24.to(tl.float64) * (1.0 / 16777216.0) * mu_new
            take_v = is_val & ~(x < mu_old)
            pos = tl.zeros([BS], tl.int32)  # searchsorted(P[:nF], x, right=True)
            for it in range(LOG_C):
                cand = pos + (tl.full([], 1, tl.int32) << (LOG_C - 1 - it))
                ok = take_v & (cand <= nF)
                pv = tl.load(P + base + cand - 1, mask=ok, other=float("inf"))
                pos = tl.where(ok & (pv <= x), cand, pos)
            src_v = tl.minimum(pos, nF - 1)
            take = take_k | take_v
            src = tl.where(take_k, src_k, src_v)
            sslot = tl.load(FS + base + src, mask=take, other=0).to(tl.int64)
            wj = tl.zeros([BS], tl.float32)  # ||v_j||^2 of the sample the slot holds after the fold
            keep_v = is_val & ~take
            if SPLIT:  # the kept values' norms in one unrolled pass, then the copies where the block takes any
                Kr = K + base * D  # the row's base pointers: 32-bit offsets in the tiles (C * D < 2^31, checked)
                Vr = V + base * D
                at_r = (C - S + j).to(tl.int32)[:, None] * D
                for d0 in tl.static_range(0, BLOCK_D, DCOPY):  # independent loads, chunk order as below
                    dcol = d0 + tl.arange(0, DCOPY)
                    vkeep = tl.load(Vr + at_r + dcol[None, :], mask=keep_v[:, None] & (dcol < D)[None, :],
                                    other=0.0).to(tl.float32)
                    wj += tl.sum(vkeep * vkeep, axis=1)
                if tl.sum(take.to(tl.int32), axis=0) > 0:
                    fr_r = sslot.to(tl.int32)[:, None] * D
                    for c0 in range(0, D, DCOPY):  # a taken row's wj: 0 above, then its chunks in order
                        ccol = c0 + tl.arange(0, DCOPY)
                        mt = take[:, None] & (ccol < D)[None, :]
                        tl.store(Kr + at_r + ccol[None, :], tl.load(Kr + fr_r + ccol[None, :], mask=mt), mask=mt)
                        vsrc = tl.load(Vr + fr_r + ccol[None, :], mask=mt, other=0.0)
                        tl.store(Vr + at_r + ccol[None, :], vsrc, mask=mt)
                        vt = vsrc.to(tl.float32)
                        wj += tl.sum(vt * vt, axis=1)
                    tl.store(POS + base + slot, tl.load(POS + base + sslot, mask=take), mask=take)
            else:
                for d0 in range(0, D, DCOPY):  # D in chunks: [BS, D] tiles of 64-bit addresses spill
                    dcol = d0 + tl.arange(0, DCOPY)
                    dm = (dcol < D)[None, :]
                    at = (base + slot)[:, None] * D + dcol[None, :]
                    fr = (base + sslot)[:, None] * D + dcol[None, :]
                    mt = take[:, None] & dm
                    tl.store(K + at, tl.load(K + fr, mask=mt), mask=mt)
                    vsrc = tl.load(V + fr, mask=mt, other=0.0)
                    tl.store(V + at, vsrc, mask=mt)
                    vkeep = tl.load(V + at, mask=keep_v[:, None] & dm, other=0.0)
                    vv = tl.where(take[:, None], vsrc, vkeep).to(tl.float32)
                    wj += tl.sum(vv * vv, axis=1)
                tl.store(POS + base + slot, tl.load(POS + base + sslot, mask=take), mask=take)
            mu32 = mu_new.to(tl.float32)
            b_key = tl.where(open_j, tl.log(n_tot.to(tl.float32) / t), float("-inf"))
            b_val = tl.where(wj > 0, tl.log(mu32 / (s.to(tl.float32) * wj)), float("-inf"))
            b = tl.where(is_key, b_key, tl.where(is_val, b_val, float("-inf")))
            r = tl.where(is_key, 1, tl.where(is_val, 2, 0)).to(tl.int8)
            tl.store(BIAS + base + slot, b, mask=mj)
            tl.store(ROLE + base + slot, r, mask=mj)


# -- launch 6: state scalars, new representatives, pack ----------------------------------------------
@triton_jit(do_not_specialize=["C", "Mmax", "NK"])
def _cg_pack_kernel(K, V, BIAS, POS, ROLE, FILL, REP, COUNT, JC, NCL, NFORCED, NSEEN, MU, KS, FS, NL, INFO, P, XK, XV,
                    XP, C, D, Mmax, NK, PB: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    due = tl.load(INFO + row * 8)
    nF = tl.load(INFO + row * 8 + 1)
    n_kept = tl.load(INFO + row * 8 + 2)
    dcol = tl.arange(0, BLOCK_D)
    dm = (dcol < D)[None, :]
    o = tl.arange(0, PB)
    if due != 0:
        if nF > 0:
            nc_old = tl.load(NCL + row).to(tl.int32)
            nc_new = tl.load(INFO + row * 8 + 3)
            for l0 in range(0, nc_new - nc_old, PB):  # representatives of the clusters opened now: their leaders
                lo = l0 + o
                ml = lo < nc_new - nc_old
                lslot = tl.load(FS + base + tl.load(NL + base + lo, mask=ml, other=0), mask=ml, other=0).to(tl.int64)
                mk = ml[:, None] & dm
                tl.store(REP + (row * Mmax + nc_old + lo).to(tl.int64)[:, None] * D + dcol[None, :],
                         tl.load(K + (base + lslot)[:, None] * D + dcol[None, :], mask=mk), mask=mk)
            for i0 in range(0, nc_new, PB):
                i = i0 + o
                mi = i < nc_new
                c = tl.load(COUNT + row * Mmax + i, mask=mi, other=0) + tl.load(JC + row * Mmax + i, mask=mi, other=0)
                tl.store(COUNT + row * Mmax + i, c, mask=mi)
            n_forced = tl.load(NFORCED + row) + tl.load(INFO + row * 8 + 4).to(tl.int64)
            n_seen = tl.load(NSEEN + row) + nF.to(tl.int64)
            # every warp has read NCL (the loops' bounds above), NFORCED and NSEEN before one thread writes them: a
            # warp that read NCL after the write would take nc_new for nc_old and skip its representatives
            tl.debug_barrier()
            tl.store(NCL + row, nc_new.to(tl.int64))
            tl.store(NFORCED + row, n_forced)
            tl.store(NSEEN + row, n_seen)
            tl.store(MU + row, tl.load(P + base + nF - 1).to(tl.float32))
            tl.debug_barrier()  # the leaders' keys are read before the pack overwrites F's slots
        # stage the kept slots that move, then write them to [0, n_kept)
        for k0 in range(0, n_kept, PB):
            k = k0 + o
            src = tl.load(KS + base + k, mask=k < n_kept, other=0)
            mv = (k < n_kept) & (src != k)
            src64 = (base + src).to(tl.int64)
            x = (row * NK + k).to(tl.int64)
            mk = mv[:, None] & dm
            tl.store(XK + x[:, None] * D + dcol[None, :], tl.load(K + src64[:, None] * D + dcol[None, :], mask=mk),
                     mask=mk)
            tl.store(XV + x[:, None] * D + dcol[None, :], tl.load(V + src64[:, None] * D + dcol[None, :], mask=mk),
                     mask=mk)
            tl.store(XP + x, tl.load(POS + src64, mask=mv), mask=mv)
        tl.debug_barrier()
        for k0 in range(0, n_kept, PB):
            k = k0 + o
            mkk = k < n_kept
            src = tl.load(KS + base + k, mask=mkk, other=0)
            mv = mkk & (src != k)
            x = (row * NK + k).to(tl.int64)
            dst = (base + k).to(tl.int64)
            mk = mv[:, None] & dm
            tl.store(K + dst[:, None] * D + dcol[None, :], tl.load(XK + x[:, None] * D + dcol[None, :], mask=mk),
                     mask=mk)
            tl.store(V + dst[:, None] * D + dcol[None, :], tl.load(XV + x[:, None] * D + dcol[None, :], mask=mk),
                     mask=mk)
            tl.store(POS + dst, tl.load(XP + x, mask=mv), mask=mv)
            tl.store(BIAS + dst, tl.zeros([PB], tl.float32), mask=mkk)
            tl.store(ROLE + dst, tl.zeros([PB], tl.int8), mask=mkk)
        fill = tl.minimum(tl.load(FILL + row), C).to(tl.int32)
        for c0 in range(n_kept, fill, PB * 8):
            c = c0 + tl.arange(0, PB * 8)
            mc = c < fill
            tl.store(BIAS + base + c, tl.full([PB * 8], float("-inf"), tl.float32), mask=mc)
            tl.store(ROLE + base + c, tl.zeros([PB * 8], tl.int8), mask=mc)
        # every warp has read FILL (the bound of the loop above) before one thread writes it. Without this barrier a
        # warp that reached its load after the write read n_kept and freed none of its slots: H200, batch 8, 1-5 of
        # 40 replays of a later prefill chunk's fold left 512 freed slots of one row at bias 0 (stop 59).
        tl.debug_barrier()
        tl.store(FILL + row, n_kept.to(tl.int64))


# -- launcher ----------------------------------------------------------------------------------------
def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def launch_config(C: int, D: int, *, dist_bm: int | None = None, dist_fo: int | None = None,
                  dist_bf: int | None = None, dist_warps: int = 4, dist_dot: bool | None = None,
                  res_b: int | None = None, res_bl: int = RES_BL, num_warps_seq: int = 4,
                  resolve_events: bool | None = None, joiner_index: bool | None = None, cal_ch: int = CAL_CH,
                  cal_warps: int = CAL_WARPS, sk_bs: int | None = None, sk_warps: int | None = None,
                  sk_split: bool | None = None) -> dict:
    """{launch: its constexprs and num_warps} of the five launches that read keys ("calib", "dist", "resolve",
    "reservoir", "pack") for a state of capacity C and head dimension D, with the knobs resolved as
    triton_clustergen_fold's docstring says: what it launches, and what bench/occupancy.py compiles offline."""
    block_d = triton.next_power_of_2(D)
    dist_dot = DIST_DOT if dist_dot is None else bool(dist_dot)
    res_b = res_b or RES_B
    dist_bm = dist_bm or (DOT_BM if dist_dot else DIST_BM)
    dist_bf = dist_bf or (DOT_BF if dist_dot else DIST_BF)
    if dist_dot and min(dist_bm, dist_bf, res_b, res_bl) < 16:
        raise ValueError(f"{NAME}: the dot form of the distances needs dist_bm, dist_bf, res_b and res_bl >= 16 "
                         f"(tensor-core tiles), got {dist_bm}, {dist_bf}, {res_b} and {res_bl}")
    joiner_index = JOINER_INDEX if joiner_index is None else bool(joiner_index)
    dist_d = max(block_d, 16) if dist_dot else block_d  # tl.dot's tiles
    return dict(
        calib=dict(CH=cal_ch, BLOCK_D=block_d, num_warps=cal_warps),
        dist=dict(BF=dist_bf, BM=dist_bm, FO=dist_fo or (DOT_FO if dist_dot else DIST_FO), DCH=DC, BLOCK_D=dist_d,
                  DOT=dist_dot, num_warps=dist_warps),
        resolve=dict(BM=dist_bm, RB=res_b, BL=res_bl, DCH=DC, CH=SPLIT_CH,
                     EVENTS=RESOLVE_EVENTS if resolve_events is None else bool(resolve_events), JIDX=joiner_index,
                     DOT=dist_dot, BLOCK_D=dist_d, num_warps=num_warps_seq),
        reservoir=dict(BS=sk_bs or SK_BS, SCH=SCAN_CH, LOG_C=max(C, 1).bit_length(), DCOPY=min(block_d, 32),
                       JIDX=joiner_index, SPLIT=(SK_SPLIT if sk_split is None else bool(sk_split)) and C * D < 2 ** 31,
                       BLOCK_D=block_d, num_warps=sk_warps or SK_WARPS),
        pack=dict(PB=PACK_B, BLOCK_D=block_d),
    )


def triton_clustergen_fold(keys, values, bias, slot_pos, fill, budget, role, rep, count, n_clusters, mu, delta,
                           n_seen, n_forced, *, n_sink: int, window: int, t: int, value_share: float,
                           cluster_target: float, seed: int, layer: int, head_offset: int = 0, **knobs) -> None:
    """Launch the six kernels (module docstring); mutates the state as the op. The inputs are checked by the op
    (kvrewrite/kernels/clustergen_fold.py); here only what the kernels add: contiguous tensors. Knobs (launch_config's
    keywords; sizes are powers of two; every value gives the same result, but dist_dot's rounding on near-ties and the
    last bits named below): dist_bm clusters per distance block, dist_fo keys per distance program, dist_bf keys per
    distance tile (defaults DIST_BM, DIST_FO, DIST_BF; DOT_BM, DOT_FO, DOT_BF with the dot form, whose tiles must be
    at least 16), dist_warps the distance launch's warps, dist_dot its form (default DIST_DOT); res_b keys per
    sequential block (default RES_B), res_bl leaders per tile, num_warps_seq the resolve launch's warps,
    resolve_events its form (default RESOLVE_EVENTS); joiner_index the reservoirs' joiner lookup (default
    JOINER_INDEX); cal_ch points per chunk of a calibration pass, cal_warps its warps; sk_bs sketch slots per reservoir
    program, sk_warps its warps, sk_split its form (defaults SK_BS, SK_WARPS, SK_SPLIT; the split form's 32-bit
    offsets need C * D < 2^31, else the loop form runs: the same bits). sk_bs and sk_warps can round a value slot's
    bias otherwise in its last bits (SK_BS's comment). Under TRITON_INTERPRET=1 it runs on CPU tensors (how the
    kernels are tested without a GPU)."""
    if triton is None:
        raise NotImplementedError(f"{NAME} needs Triton (pip install triton)")
    state = dict(keys=keys, values=values, bias=bias, slot_pos=slot_pos, fill=fill, budget=budget, role=role,
                 rep=rep, count=count, n_clusters=n_clusters, mu=mu, delta=delta, n_seen=n_seen, n_forced=n_forced)
    for field, x in state.items():
        if not x.is_contiguous():
            raise ValueError(f"{NAME}: {field} must be contiguous (the kernels index it flat), got strides "
                             f"{x.stride()}")
    B, H, C, D = keys.shape
    Mmax = rep.shape[2]
    rows = B * H
    if rows == 0 or C == 0 or D == 0:
        return
    dev = keys.device
    cfg = launch_config(C, D, **knobs)
    dist, resolve, reservoir = cfg["dist"], cfg["resolve"], cfg["reservoir"]
    joiner_index = resolve["JIDX"]
    ncb = 1 if dist["DOT"] else triton.cdiv(Mmax, dist["BM"])  # the dot form keeps one minimum per key
    nk = max(n_sink + window, 1)
    vs, ct = _bits(value_share), _bits(cluster_target)
    hbase = mix32(mix32(seed) ^ (layer & MASK32))
    i32 = torch.empty(6 if joiner_index else 4, rows, C, dtype=torch.int32, device=dev)
    fs, ks, assign, nl = i32[0], i32[1], i32[2], i32[3]
    jr, jl = (i32[4], i32[5]) if joiner_index else (assign, assign)  # (unread without the index)
    f32 = torch.empty(2, rows, C, dtype=torch.float32, device=dev)
    d2, w = f32[0], f32[1]
    p = torch.empty(rows, C, dtype=torch.float64, device=dev)
    pd = torch.empty(rows, ncb, C, dtype=torch.float32, device=dev)
    pi = torch.empty(rows, ncb, C, dtype=torch.int32, device=dev)
    jc = torch.zeros(rows, Mmax, dtype=torch.int32, device=dev)
    jo = torch.empty(rows, Mmax, dtype=torch.int32, device=dev) if joiner_index else jc  # (unread without the index)
    info = torch.zeros(rows, 8, dtype=torch.int32, device=dev)
    xk = torch.empty(rows, nk, D, dtype=keys.dtype, device=dev)
    xv = torch.empty(rows, nk, D, dtype=values.dtype, device=dev)
    xp = torch.empty(rows, nk, dtype=torch.int64, device=dev)
    sz = (n_sink, window, t, vs, ct)
    _cg_split_kernel[(rows,)](bias, role, fill, budget, fs, ks, info, C, n_sink, window, CH=SPLIT_CH)
    _cg_calib_kernel[(rows,)](keys, fs, info, delta, d2, budget, C, D, *sz, Mmax, **cfg["calib"])
    _cg_dist_kernel[(ncb, triton.cdiv(C, dist["FO"]), rows)](keys, values, rep, fs, info, n_clusters, pd, pi, w, C, D,
                                                             Mmax, ncb, **dist)
    _cg_resolve_kernel[(rows,)](keys, fs, info, n_clusters, delta, mu, pd, pi, w, p, assign, nl, jc, jr, jo, jl,
                                budget, C, D, Mmax, ncb, *sz, **resolve)
    _cg_reservoir_kernel[(triton.cdiv(C, reservoir["BS"]), rows)](keys, values, bias, slot_pos, role, fs, info, count,
                                                                  jc, assign, jo, jl, p, mu, n_seen, budget, C, D,
                                                                  Mmax, H, *sz, hbase, head_offset, **reservoir)
    _cg_pack_kernel[(rows,)](keys, values, bias, slot_pos, role, fill, rep, count, jc, n_clusters, n_forced, n_seen,
                             mu, ks, fs, nl, info, p, xk, xv, xp, C, D, Mmax, nk, **cfg["pack"])
