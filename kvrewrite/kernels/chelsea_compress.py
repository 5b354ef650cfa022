"""kvrewrite::chelsea_compress — Chelsea's chunked soft matching + degree-weighted star merge.

Based on "Efficient Long-Context LLM Inference via KV Cache Clustering" (Chelsea,
https://arxiv.org/abs/2506.11418), Algorithm 1 and Sec. 5. For every row (b, kv-head) whose fill
reached the threshold (budget = [target B, threshold B + g]) and that is not an outlier head:

1. load its valid slots in temporal order; protect the first n_sink and the last n_recent;
2. repeat CSM rounds on the middle region until the row holds `target` slots:
   - split the middle into consecutive chunks of `chunk`; inside each chunk, 1st/3rd/5th... slots
     form set A and 2nd/4th/6th... set B (the alternation restarts in every chunk); every round
     re-chunks the middle it starts from, so boundaries move as the middle shrinks (see ChelseaMethod);
   - every A slot draws one edge to its most cosine-similar B slot of the same chunk (keys only);
   - edges of all chunks are ranked together and the top n_merge kept, with
     r_i = max(r_init - r_alpha * min(r_steps, i), r_min), n_merge = min(max(1, floor(r_i * M)),
     L - target), i the round index inside this call, M the middle length;
   - every B slot and the A slots pointing to it form a star, merged by degree:
     k = sum n_i k_i / sum n_i, v likewise, n = sum n_i; the centroid keeps the B slot's place
     (temporal order is preserved) and the largest cache position of its members;
3. store the row packed, bias = log n.

State (mutated): keys, values [B, Hkv, C, D]; bias, slot_pos [B, Hkv, C]; fill [B, Hkv].

Load-bearing details of the reference (the CUDA kernel follows them): cosine in fp32 of the
normalised keys; argmax ties go to the first B; a star is summed as n_b k_b, then its members in
ranking order (scatter_add's order), then divided by the degree sum, and every other middle slot is
divided back, (k n) / n; centroids stay fp32 between the rounds of one call and are cast to the
state's dtype at the end. Exact ties in the edge ranking are broken by torch.topk (an unspecified
order); the CUDA kernel breaks them toward the earlier edge, which `pinned_ties()` makes the reference
do too (for the CUDA tests: identical keys tie exactly). Generic fp32 similarities never tie exactly.

Backends: the reference reads fill and budget on the host (CPU; CUDA without Triton, or with a chunk
above 512 or D above 256); on CUDA the Triton kernels below run every round on the device with no
host sync (CUDA graphs can capture them; see _slot_kernels.py).

Triton kernels. Round 0 (every decode-time call and every prefill-chunk call needs exactly one) runs
in parallel over the row's chunks and columns, six launches:
  0. prepare   (rows):            due check; padding dropped (packed in place, only rows that have
                                  some); degrees and positions snapshotted to SN, SP; n_merge of round 0;
  1. similarity (rows x chunks):  A slots (even offsets of a chunk) x B slots (odd offsets), cosine in
                                  fp32, argmax over B (leftmost on ties) -> per-row edge buffer;
  2. select    (rows):            the n_merge best edges by (similarity desc, edge index asc): a radix
                                  select of the threshold key (4 passes of a 256-bin histogram), ties at
                                  the threshold to the lowest edges (the reference under pinned_ties());
  3. plan      (rows x chunks):   each star's members in the reference's order, degree sums, largest
                                  positions, every survivor's destination (the chunk's output offset is
                                  an exclusive prefix sum of the chunks' merged counts); bias and
                                  slot_pos written;
  4. merge     (rows x chunks+1 x 2*D/32): each program merges one chunk's stars in 32 columns of keys
                                  or values and stores the survivors at their final slots, out of place
                                  (a staging copy of K/V for rows this round finishes, the fp32 scratch
                                  for the others); the extra program of each row moves the recent slots;
  5. copy back (rows x C/32):     the finished rows' slots [n_sink, L - m) from the staging copy.
Soft-matching edges never leave their chunk, so every chunk's stars are independent and steps 1, 3, 4
need no order between chunks. Rows that need more rounds (a prefill far above the target, e.g.
prefill_chunk >= prompt) keep round 0's centroids in the fp32 scratch (the reference keeps them in fp32
between rounds) and go on in a seventh launch, one program per row looping `while L > target` *on the
device*: the number of rounds is data-dependent but needs no host-side bound and no no-op launches, and
each round removes >= 1 slot or ends the loop (no edge left), so it terminates. That program runs the
same steps itself, chunk by chunk; it is slow (one SM per row) and only serves those rows.
`parallel_round0=False` runs every round there (a cross-check path in the tests).

No races: in round 0, steps 3 and 4 read degrees and positions from the SN/SP snapshot while step 3
rewrites bias and slot_pos, step 4 reads no bias, and step 4 reads the state's K/V but writes only the
staging copy or the scratch (an in-place compaction across chunk programs would race: a chunk's
destinations overlap the previous chunk's sources); every output slot has exactly one writer, so the
result is deterministic. In-place moves elsewhere (the per-row kernel, the padding/bias moves) do not
race either: survivors only move left (destination slot <= source slot), a program owns its columns
(or its whole row) and walks its tiles / chunks in increasing slot order with a CTA barrier between a
tile's loads and its stores. A store never hits a slot a later load still needs (later tiles
read slots >= their own start > every earlier destination), and inside a tile every thread has loaded
(star members included) before any thread stores.

Memory per call (transient, besides the state): SN, SP (12 bytes per slot), edge and plan buffers
(~26 bytes per A slot), the staging copy of keys and values (the state's K/V size), and the fp32
scratch for multi-round rows: keys + values [B*Hkv, CW, D] fp32 plus degrees and positions
[B*Hkv, CW] (CW = C minus the fewest slots a non-final round 0 removes, ~0.65 C with Llama-3's
schedule; scratch_slots()).

Numerics (bit-for-bit decisions where the inputs allow it): similarities are fp32 (16-bit keys: one
tensor-core dot of the raw keys, exact products with fp32 accumulation, scaled by the reciprocal norms;
fp32 keys: 3xTF32, fp32-level accuracy), merges are fp32 in the reference's order, and fp contraction
(FMA) is off so products and sums round as in the reference. A dot's summation order still differs
from the CPU's, so on generic data a near-tie (two similarities within ~1e-7) may break the other way;
on inputs whose similarities are exact in fp32 (tests/kernels/test_compression_gpu.py) the kept slots,
merges, order and values are identical.

This file, top to bottom: docstring, reference (pinned_ties, csm_round, chelsea_rows,
reference_chelsea_compress), Triton kernels, launcher (supports_chelsea, scratch_slots,
triton_chelsea_compress), op registration.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import contextlib
import math
import os
import struct

import torch
import torch.nn.functional as F

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels._slot_kernels import _check_state, _count_valid, _finish_row, _keep_mask
from kvrewrite.kernels._slots import load_row, rows_due, store_row
from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: the ops run their references; only the triton_* launchers raise
    triton = tl = libdevice = None

_PINNED_TIES = False


@contextlib.contextmanager
def pinned_ties():
    """Inside: the reference breaks exact ties of the edge ranking toward the earlier edge (a stable
    sort), as the CUDA kernel does, instead of torch.topk's unspecified order."""
    global _PINNED_TIES
    _PINNED_TIES = True
    try:
        yield
    finally:
        _PINNED_TIES = False


def csm_round(K, V, n, pos, n_merge: int, chunk: int):
    """One chunked-soft-matching round over R rows of equal middle length M.

    K, V: [R, M, D] fp32; n: [R, M] fp32 degrees; pos: [R, M] int64.
    Returns the merged (K, V, n, pos) of length M - m, m <= n_merge the edges actually kept.
    """
    R, M, D = K.shape
    nc = math.ceil(M / chunk)
    P = nc * chunk
    Kn = F.pad(F.normalize(K, dim=-1), (0, 0, 0, P - M))
    idx = torch.arange(P, device=K.device).view(nc, chunk)
    a_idx, b_idx = idx[:, 0::2], idx[:, 1::2]  # [nc, ca], [nc, cb]
    sim = Kn[:, a_idx] @ Kn[:, b_idx].transpose(-1, -2)  # [R, nc, ca, cb]
    sim = sim.masked_fill((b_idx >= M)[None, :, None, :], float("-inf"))
    best, arg = sim.max(dim=-1)  # [R, nc, ca]
    best = best.masked_fill((a_idx >= M)[None], float("-inf"))
    dst = torch.gather(b_idx[None].expand(R, -1, -1), 2, arg).flatten(1)  # [R, E]
    src = a_idx[None].expand(R, -1, -1).flatten(1)
    best = best.flatten(1)
    m = min(n_merge, int(torch.isfinite(best[0]).sum()))
    if m <= 0:
        return K, V, n, pos
    if _PINNED_TIES:  # ties to the earlier edge, as the CUDA kernel
        top = best.sort(dim=1, descending=True, stable=True).indices[:, :m]
    else:
        top = best.topk(m, dim=1).indices
    src, dst = src.gather(1, top), dst.gather(1, top)  # [R, m]; src in A, dst in B: disjoint
    w = n[..., None]
    Ks, Vs = K * w, V * w
    gidx = src[..., None].expand(-1, -1, D)
    k_add, v_add, n_add, p_add = Ks.gather(1, gidx), Vs.gather(1, gidx), n.gather(1, src), pos.gather(1, src)
    didx = dst[..., None].expand(-1, -1, D)
    Ks, Vs = Ks.scatter_add(1, didx, k_add), Vs.scatter_add(1, didx, v_add)
    n2 = n.scatter_add(1, dst, n_add)
    pos2 = pos.scatter_reduce(1, dst, p_add, reduce="amax")
    removed = torch.zeros(R, M, dtype=torch.int8, device=K.device).scatter_(1, src, 1)
    keep = torch.argsort(removed, dim=1, stable=True)[:, : M - m]  # survivors, in order
    n2 = n2.gather(1, keep)
    kidx = keep[..., None].expand(-1, -1, D)
    return Ks.gather(1, kidx) / n2[..., None], Vs.gather(1, kidx) / n2[..., None], n2, pos2.gather(1, keep)


def chelsea_rows(K, V, n, pos, target, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min):
    """Compress R rows of equal length L to `target` slots with repeated CSM rounds."""
    L = K.shape[1]
    i = 0
    while L > target:
        M = L - n_sink - n_recent
        if M < 1:  # the method's check_generation refuses such budgets; a direct call must not loop forever
            raise ValueError(f"chelsea_compress: a target of {target} slots cannot hold the {n_sink} sink + {n_recent} "
                             f"recent slots plus a compressible middle (rows of {L} slots); raise the budget")
        r = max(r_init - r_alpha * min(r_steps, i), r_min)
        # floor(r * M); the 1e-9 absorbs binary rounding (0.35 - 0.1 * 2 == 0.1499..., floor(0.15 * 20) is 3)
        n_merge = min(max(1, int(r * M + 1e-9)), L - target)
        mid = slice(n_sink, L - n_recent)
        Km, Vm, nm, pm = csm_round(K[:, mid], V[:, mid], n[:, mid], pos[:, mid], n_merge, chunk)
        if Km.shape[1] == M:  # no edge left: the middle cannot shrink further
            break
        K = torch.cat([K[:, :n_sink], Km, K[:, L - n_recent :]], dim=1)
        V = torch.cat([V[:, :n_sink], Vm, V[:, L - n_recent :]], dim=1)
        n = torch.cat([n[:, :n_sink], nm, n[:, L - n_recent :]], dim=1)
        pos = torch.cat([pos[:, :n_sink], pm, pos[:, L - n_recent :]], dim=1)
        L = K.shape[1]
        i += 1
    return K, V, n, pos


def reference_chelsea_compress(
    keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min, outlier_heads
):
    target = int(budget[0])
    groups: dict[int, list] = {}
    for b, h in rows_due(fill, budget, skip_heads=set(outlier_heads)):
        K, V, row_bias, pos = load_row(keys, values, bias, slot_pos, fill, b, h)
        groups.setdefault(K.shape[0], []).append((b, h, K, V, row_bias, pos))
    for rows in groups.values():
        K = torch.stack([r[2] for r in rows]).float()
        V = torch.stack([r[3] for r in rows]).float()
        n = torch.stack([r[4] for r in rows]).exp().round()
        pos = torch.stack([r[5] for r in rows])
        K, V, n, pos = chelsea_rows(K, V, n, pos, target, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min)
        for j, (b, h, *_) in enumerate(rows):
            store_row(keys, values, bias, slot_pos, fill, b, h, K[j], V[j], n[j].log(), pos[j])


# -- Triton kernels ----------------------------------------------------------------------------------
# Triton's interpreter (to debug these kernels on a CPU: TRITON_INTERPRET=1) has no libdevice
_INTERPRET = None if triton is None else tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

MAX_CHUNK = 512  # chunk sizes above this run the reference (a chunk's A x B tile lives in registers)
MAX_HEAD_DIM = 256
MERGE_COLUMNS = 32  # head-dim columns per program of chelsea's round-0 merge (a power of two >= 16)
SELECT_BLOCK = 2048  # edges per block of chelsea's round-0 selection (its histogram passes)


# -- helpers -----------------------------------------------------------------------------------------
@triton_jit()
def _degree(b):
    """Degree n = round(exp(bias)) of a slot, as the reference's exp().round() (never near .5)."""
    return tl.floor(tl.exp(b) + 0.5)


@triton_jit()
def _log(x):
    """log n of a merged slot: libdevice's logf (within an ulp, like the CPU's)."""
    if _INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton_jit()
def _order_key(x):
    """Monotone int32 key of fp32 x: x < y <=> key(x) < key(y) (signed); -0.0 keys as +0.0."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton_jit()
def _f64(bits):
    """A Python float passed as its IEEE bits (Triton passes Python floats as fp32)."""
    return (tl.full([], 0, tl.int64) + bits).to(tl.float64, bitcast=True)


@triton_jit()
def _compact_state_row(K, V, BIAS, POS, fill, keep_head, keep_tail, D,
                       BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_1D: tl.constexpr):
    """Keep the valid slots of [0, fill) whose rank r among the valid ones has r < keep_head or
    r >= L - keep_tail (L = valid count), packed at the front in order; returns how many were kept.
    Row pointers: K, V [C, D], BIAS, POS [C]. Bias bits travel unchanged (no degree is recomputed).
    Blocks of BLOCK_1D slots where nothing moves (no dropped slot so far) are only read."""
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    L = _count_valid(BIAS, fill, BLOCK_1D)
    rank0 = tl.full([], 0, tl.int32)
    out = tl.full([], 0, tl.int32)
    for j0 in range(0, fill, BLOCK_1D):
        j = j0 + tl.arange(0, BLOCK_1D)
        vi, keep = _keep_mask(tl.load(BIAS + j, mask=j < fill, other=float("-inf")), j, fill, rank0, L, keep_head,
                              keep_tail)
        ki = keep.to(tl.int32)
        moved = tl.sum((keep & (out + tl.cumsum(ki, axis=0) - ki != j)).to(tl.int32), axis=0)
        if moved > 0:  # move this block's kept slots tile by tile (in order, loads before stores)
            r1 = rank0
            o1 = out
            for t0 in range(j0, j0 + BLOCK_1D, BLOCK_S):
                t = t0 + tl.arange(0, BLOCK_S)
                bb = tl.load(BIAS + t, mask=t < fill, other=float("-inf"))
                tv, tk = _keep_mask(bb, t, fill, r1, L, keep_head, keep_tail)
                tki = tk.to(tl.int32)
                dest = o1 + tl.cumsum(tki, axis=0) - tki
                m2 = tk[:, None] & dmask[None, :]
                pp = tl.load(POS + t, mask=tk)
                kk = tl.load(K + t[:, None] * D + offs_d[None, :], mask=m2)
                vv = tl.load(V + t[:, None] * D + offs_d[None, :], mask=m2)
                tl.debug_barrier()  # every thread has loaded this tile before any thread stores
                tl.store(BIAS + dest, bb, mask=tk)
                tl.store(POS + dest, pp, mask=tk)
                tl.store(K + dest[:, None] * D + offs_d[None, :], kk, mask=m2)
                tl.store(V + dest[:, None] * D + offs_d[None, :], vv, mask=m2)
                r1 += tl.sum(tv, axis=0)
                o1 += tl.sum(tki, axis=0)
        rank0 += tl.sum(vi, axis=0)
        out += tl.sum(ki, axis=0)
    return out


# -- CSM steps (round 0's kernels share some) and the one-program-per-row kernel ---------------------
@triton_jit()
def _copy_slots(K, V, BIAS, POS, WK, WV, WN, WP, src0, dst0, count, from_state, to_state, D,
                BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Copy `count` slots src0.. -> dst0.. between the state (model dtype, bias = log n) and the fp32
    scratch (degree n), either way or in place (then dst0 <= src0: a left move, tile by tile in
    increasing order with a barrier between each tile's loads and stores)."""
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    for t0 in range(0, count, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        m = t < count
        s = src0 + t
        d = dst0 + t
        m2 = m[:, None] & dmask[None, :]
        if from_state:
            n = _degree(tl.load(BIAS + s, mask=m, other=0.0))
            pos = tl.load(POS + s, mask=m, other=0)
            kk = tl.load(K + s[:, None] * D + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
            vv = tl.load(V + s[:, None] * D + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
        else:
            n = tl.load(WN + s, mask=m, other=1.0)
            pos = tl.load(WP + s, mask=m, other=0)
            kk = tl.load(WK + s[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
            vv = tl.load(WV + s[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
        tl.debug_barrier()
        if to_state:
            tl.store(BIAS + d, _log(n), mask=m)
            tl.store(POS + d, pos, mask=m)
            tl.store(K + d[:, None] * D + offs_d[None, :], kk.to(K.dtype.element_ty), mask=m2)
            tl.store(V + d[:, None] * D + offs_d[None, :], vv.to(V.dtype.element_ty), mask=m2)
        else:
            tl.store(WN + d, n, mask=m)
            tl.store(WP + d, pos, mask=m)
            tl.store(WK + d[:, None] * D + offs_d[None, :], kk, mask=m2)
            tl.store(WV + d[:, None] * D + offs_d[None, :], vv, mask=m2)


@triton_jit()
def _norms(x):
    """Row norms of x in fp32, clamped as F.normalize's (zero rows give 0 similarities)."""
    xf = x.to(tl.float32)
    return tl.maximum(tl.sqrt_rn(tl.sum(xf * xf, axis=1)), 1e-12)


@triton_jit()
def _cosine(ka, na, kb, nb, LOW_PREC_DOT: tl.constexpr):
    """Cosine similarity in fp32 of rows ka x rows kb (na, nb: their norms)."""
    if LOW_PREC_DOT:  # 16-bit keys: exact products, fp32 accumulation on the tensor cores
        if _INTERPRET:  # the interpreter's 16-bit dot is wrong; fp32 products of 16-bit values are exact too
            raw = tl.dot(ka.to(tl.float32), tl.trans(kb.to(tl.float32)), input_precision="ieee")
        else:
            raw = tl.dot(ka, tl.trans(kb))
        sim = raw * tl.div_rn(tl.full(na.shape, 1.0, tl.float32), na)[:, None]
        sim = sim * tl.div_rn(tl.full(nb.shape, 1.0, tl.float32), nb)[None, :]
    else:  # fp32 keys: normalise, then 3xTF32 (fp32-level accuracy on the tensor cores; an FMA dot this size
        # unrolls past what ptxas allocates well); exact on keys with <= 11 significant bits, as the tests'
        an = tl.div_rn(ka.to(tl.float32), na[:, None])
        bn = tl.div_rn(kb.to(tl.float32), nb[:, None])
        sim = tl.dot(an, tl.trans(bn), input_precision="tf32x3")
    return sim


@triton_jit()
def _best_b(K, a_start, va, c_start, clen, D, S: tl.constexpr, SB: tl.constexpr, BLOCK_D: tl.constexpr,
            LOW_PREC_DOT: tl.constexpr):
    """For a block of A slots (rows a_start + 2 i): the most cosine-similar B slot of the chunk (leftmost on
    ties, -inf and 0 where there is none), B slots in blocks of SB."""
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    ka = tl.load(K + a_start[:, None] * D + offs_d[None, :], mask=va[:, None] & dmask[None, :], other=0.0)
    na = _norms(ka)
    best = tl.full(va.shape, float("-inf"), tl.float32)
    arg = tl.zeros(va.shape, tl.int32)
    for b0 in range(0, S, SB):
        ib = b0 + tl.arange(0, SB)
        vb = 2 * ib + 1 < clen
        kb = tl.load(K + (c_start + 2 * ib + 1)[:, None] * D + offs_d[None, :], mask=vb[:, None] & dmask[None, :],
                     other=0.0)
        sim = _cosine(ka, na, kb, _norms(kb), LOW_PREC_DOT)
        sim = tl.where(vb[None, :], sim, float("-inf"))
        blk_best = tl.max(sim, axis=1)
        blk_arg = tl.argmax(sim, axis=1, tie_break_left=True) + b0
        better = blk_best > best  # strict: an earlier block keeps its ties
        arg = tl.where(better, blk_arg, arg)
        best = tl.where(better, blk_best, best)
    return best, arg


@triton_jit()
def _csm_similarity(K, WK, EBEST, EDST, from_state, n_sink, M, D,
                    CHUNK: tl.constexpr, S: tl.constexpr, SA: tl.constexpr, BLOCK_D: tl.constexpr,
                    LOW_PREC_DOT: tl.constexpr):
    """Step 1 of a round: every A slot's best B of its chunk -> EBEST (fp32, -inf: no edge), EDST (the
    B's index in its chunk). Edge e = chunk * S + (A's index in its chunk); tiles of SA x SA slots.
    Returns the number of finite edges."""
    n_edges = tl.full([], 0, tl.int32)
    for c in range(0, tl.cdiv(M, CHUNK)):
        c_start = n_sink + c * CHUNK
        clen = tl.minimum(M - c * CHUNK, CHUNK)
        for a0 in range(0, S, SA):
            ia = a0 + tl.arange(0, SA)
            va = 2 * ia < clen
            if from_state:
                best, arg = _best_b(K, c_start + 2 * ia, va, c_start, clen, D, S, SA, BLOCK_D, LOW_PREC_DOT)
            else:
                best, arg = _best_b(WK, c_start + 2 * ia, va, c_start, clen, D, S, SA, BLOCK_D, False)
            best = tl.where(va, best, float("-inf"))
            tl.store(EBEST + c * S + ia, best)
            tl.store(EDST + c * S + ia, arg)
            n_edges += tl.sum((best > float("-inf")).to(tl.int32), axis=0)
    return n_edges


@triton_jit()
def _select_topm(EBEST, ESEL, n_e, m, EB: tl.constexpr, CCOUNT=None, S: tl.constexpr = 1):
    """Step 2: ESEL[e] = 1 for the m best edges of [0, n_e) by (similarity desc, e asc). The threshold key
    is found 8 bits at a time (a 256-bin histogram of the candidates per pass), then the keys above it
    and the first ones equal to it (lowest e) are taken. Needs m <= the finite edges."""
    INT_MIN: tl.constexpr = -2147483648
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.int32)  # the threshold's bits found so far (unsigned key order)
    hi_mask = tl.full([], 0, tl.int32)
    need = m
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        counts = tl.zeros([256], tl.int32)
        for e0 in range(0, n_e, EB):
            e = e0 + tl.arange(0, EB)
            uk = _order_key(tl.load(EBEST + e, mask=e < n_e, other=float("-inf"))) ^ INT_MIN
            cand = ((uk & hi_mask) == prefix) & (e < n_e)
            counts += tl.histogram((uk >> shift) & 255, 256, mask=cand)
        above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # candidates with digit >= d
        digit = tl.max(tl.where(above >= need, bins, -1), axis=0)
        need -= tl.sum(tl.where(bins > digit, counts, 0), axis=0)
        prefix = prefix | (digit << shift)
        hi_mask = hi_mask | (tl.full([], 255, tl.int32) << shift)
    t = prefix ^ INT_MIN  # back to the signed key order
    for e0 in range(0, n_e, EB):
        e = e0 + tl.arange(0, EB)
        k = _order_key(tl.load(EBEST + e, mask=e < n_e, other=float("-inf")))
        eq = ((k == t) & (e < n_e)).to(tl.int32)
        sel = (k > t) | ((eq != 0) & (tl.cumsum(eq, axis=0) - eq < need))
        tl.store(ESEL + e, sel.to(tl.int8), mask=e < n_e)
        need -= tl.sum(eq, axis=0)
        if CCOUNT is not None:  # selected edges per chunk (S edges a chunk; EB is a multiple of S)
            ch = e0 // S + tl.arange(0, EB // S)
            per_chunk = tl.sum(tl.reshape((sel & (e < n_e)).to(tl.int32), [EB // S, S]), axis=1)
            tl.store(CCOUNT + ch, per_chunk, mask=ch * S < n_e)


@triton_jit()
def _merge_tensor(X, WX, BIAS, WN, LIST, from_state, to_state, c_start, sa, va, vb, keep_a, dest_a, dest_b,
                  n_a, n_b, n_tot, cnt, first, k_max, offs_d, dmask, D):
    """Step 3 for one tensor (keys or values) and one block of D columns of a chunk: B slots become
    (n_b x_b + sum_k n_k x_k) / n_tot with the members k in rank order (the reference's scatter_add
    order); surviving A slots (x n) / n, as the reference divides every middle slot by its degree."""
    ma = va[:, None] & dmask[None, :]
    mb = vb[:, None] & dmask[None, :]
    if from_state:
        xa = tl.load(X + sa[:, None] * D + offs_d[None, :], mask=ma, other=0.0).to(tl.float32)
        xb = tl.load(X + (sa + 1)[:, None] * D + offs_d[None, :], mask=mb, other=0.0).to(tl.float32)
    else:
        xa = tl.load(WX + sa[:, None] * D + offs_d[None, :], mask=ma, other=0.0)
        xb = tl.load(WX + (sa + 1)[:, None] * D + offs_d[None, :], mask=mb, other=0.0)
    acc = xb * n_b[:, None]
    for k in range(0, k_max):
        has = cnt > k
        src = c_start + 2 * tl.load(LIST + first + k, mask=has, other=0)
        mk = has[:, None] & dmask[None, :]
        if from_state:
            xk = tl.load(X + src[:, None] * D + offs_d[None, :], mask=mk, other=0.0).to(tl.float32)
            nk = _degree(tl.load(BIAS + src, mask=has, other=0.0))
        else:
            xk = tl.load(WX + src[:, None] * D + offs_d[None, :], mask=mk, other=0.0)
            nk = tl.load(WN + src, mask=has, other=1.0)
        acc = tl.where(has[:, None], acc + xk * nk[:, None], acc)
    out_b = tl.div_rn(acc, n_tot[:, None])
    out_a = tl.div_rn(xa * n_a[:, None], n_a[:, None])
    tl.debug_barrier()  # the chunk's slots and star members are loaded before anything is stored
    mka = keep_a[:, None] & dmask[None, :]
    if to_state:
        tl.store(X + dest_a[:, None] * D + offs_d[None, :], out_a.to(X.dtype.element_ty), mask=mka)
        tl.store(X + dest_b[:, None] * D + offs_d[None, :], out_b.to(X.dtype.element_ty), mask=mb)
    else:
        tl.store(WX + dest_a[:, None] * D + offs_d[None, :], out_a, mask=mka)
        tl.store(WX + dest_b[:, None] * D + offs_d[None, :], out_b, mask=mb)


@triton_jit()
def _csm_merge(K, V, BIAS, POS, WK, WV, WN, WP, EBEST, EDST, ESEL, LIST, FIRST, from_state, to_state,
               n_sink, M, D, CHUNK: tl.constexpr, S: tl.constexpr, SA: tl.constexpr, BLOCK_DM: tl.constexpr,
               NUM_DB: tl.constexpr):
    """Step 3: merge the selected edges' stars and compact the middle, chunk by chunk. Returns the slot
    after the last survivor (where the recent slots go). Pairwise [S, SA] comparisons in blocks of SA."""
    ia = tl.arange(0, S)
    out = n_sink
    for c in range(0, tl.cdiv(M, CHUNK)):
        c_start = n_sink + c * CHUNK
        clen = tl.minimum(M - c * CHUNK, CHUNK)
        va = 2 * ia < clen
        vb = 2 * ia + 1 < clen
        sa = c_start + 2 * ia
        best = tl.load(EBEST + c * S + ia)
        dst = tl.load(EDST + c * S + ia)
        sel = (tl.load(ESEL + c * S + ia) != 0) & va
        # star sizes (cnt[j]: A slots merging into B slot j) and each member's rank in its star, in the
        # reference's edge order (similarity desc, then A index asc)
        cnt = tl.zeros([S], tl.int32)
        rank = tl.zeros([S], tl.int32)
        for a0 in range(0, S, SA):
            io = a0 + tl.arange(0, SA)
            b_o = tl.load(EBEST + c * S + io)
            d_o = tl.load(EDST + c * S + io)
            s_o = (tl.load(ESEL + c * S + io) != 0) & (2 * io < clen)
            cnt += tl.sum((s_o[None, :] & (d_o[None, :] == ia[:, None])).to(tl.int32), axis=1)
            ahead = (s_o[None, :] & (d_o[None, :] == dst[:, None])
                     & ((b_o[None, :] > best[:, None])
                        | ((b_o[None, :] == best[:, None]) & (io[None, :] < ia[:, None]))))
            rank += tl.sum(ahead.to(tl.int32), axis=1)
        first = tl.cumsum(cnt, axis=0) - cnt  # star j's members sit at LIST[first[j] ...]
        tl.store(FIRST + ia, first)
        tl.debug_barrier()
        tl.store(LIST + tl.load(FIRST + dst, mask=sel, other=0) + rank, ia, mask=sel)
        tl.debug_barrier()
        k_max = tl.max(cnt, axis=0)
        if from_state:
            n_a = _degree(tl.load(BIAS + sa, mask=va, other=0.0))
            n_b = _degree(tl.load(BIAS + sa + 1, mask=vb, other=0.0))
            p_a = tl.load(POS + sa, mask=va, other=0)
            p_b = tl.load(POS + sa + 1, mask=vb, other=0)
        else:
            n_a = tl.load(WN + sa, mask=va, other=1.0)
            n_b = tl.load(WN + sa + 1, mask=vb, other=1.0)
            p_a = tl.load(WP + sa, mask=va, other=0)
            p_b = tl.load(WP + sa + 1, mask=vb, other=0)
        # degree sums (in member order, as the reference's scatter_add) and the largest position
        n_tot = n_b
        p_tot = p_b
        for k in range(0, k_max):
            has = cnt > k
            src = c_start + 2 * tl.load(LIST + first + k, mask=has, other=0)
            if from_state:
                nk = _degree(tl.load(BIAS + src, mask=has, other=0.0))
                pk = tl.load(POS + src, mask=has, other=0)
            else:
                nk = tl.load(WN + src, mask=has, other=0.0)
                pk = tl.load(WP + src, mask=has, other=0)
            n_tot = tl.where(has, n_tot + nk, n_tot)
            p_tot = tl.where(has, tl.maximum(p_tot, pk), p_tot)
        # destinations: survivors packed in slot order (A_i sits before B_i)
        keep_a = va & (sel == 0)
        ka = keep_a.to(tl.int32)
        cum = tl.cumsum(ka, axis=0)
        dest_a = out + cum - ka + ia
        dest_b = out + cum + ia
        for db in range(NUM_DB):
            offs_d = db * BLOCK_DM + tl.arange(0, BLOCK_DM)
            dmask = offs_d < D
            _merge_tensor(K, WK, BIAS, WN, LIST, from_state, to_state, c_start, sa, va, vb, keep_a, dest_a, dest_b,
                          n_a, n_b, n_tot, cnt, first, k_max, offs_d, dmask, D)
            _merge_tensor(V, WV, BIAS, WN, LIST, from_state, to_state, c_start, sa, va, vb, keep_a, dest_a, dest_b,
                          n_a, n_b, n_tot, cnt, first, k_max, offs_d, dmask, D)
        if to_state:
            tl.store(BIAS + dest_a, _log(n_a), mask=keep_a)
            tl.store(POS + dest_a, p_a, mask=keep_a)
            tl.store(BIAS + dest_b, _log(n_tot), mask=vb)
            tl.store(POS + dest_b, p_tot, mask=vb)
        else:
            tl.store(WN + dest_a, n_a, mask=keep_a)
            tl.store(WP + dest_a, p_a, mask=keep_a)
            tl.store(WN + dest_b, n_tot, mask=vb)
            tl.store(WP + dest_b, p_tot, mask=vb)
        out += tl.sum(ka, axis=0) + tl.sum(vb.to(tl.int32), axis=0)
    return out


@triton_jit()
def _csm_rounds(Kr, Vr, Br, Pr, WKr, WVr, WNr, WPr, EBr, EDr, ESr, LIr, FIr, FILL_AT, L, T, i, in_scratch,
                C, D, n_sink, n_recent, r_init, r_alpha, r_min, eps, r_steps,
                CHUNK: tl.constexpr, S: tl.constexpr, SA: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DM: tl.constexpr, NUM_DB: tl.constexpr, BLOCK_S: tl.constexpr, EB: tl.constexpr,
                LOW_PREC_DOT: tl.constexpr):
    """CSM rounds i, i+1, ... of one row until it holds T slots (or has no edge left), all in this
    program; then the row is finished (bias -inf past L, fill = L). The row's slots are in the state
    (in_scratch 0) or in the fp32 scratch (1)."""
    go = L > T
    while go:
        M = L - n_sink - n_recent
        # n_merge = min(max(1, floor(r_i * M)), L - target), in float64 as the reference
        r = tl.maximum(r_init - r_alpha * tl.minimum(i, r_steps).to(tl.float64), r_min)
        n_merge = tl.minimum(tl.maximum((r * M.to(tl.float64) + eps).to(tl.int32), 1), L - T)
        n_edges = tl.full([], 0, tl.int32)
        from_state = in_scratch == 0
        if M > 1:
            n_edges = _csm_similarity(Kr, WKr, EBr, EDr, from_state, n_sink, M, D, CHUNK, S, SA, BLOCK_D,
                                      LOW_PREC_DOT)
        m = tl.minimum(n_merge, n_edges)
        if m > 0:
            tl.debug_barrier()
            _select_topm(EBr, ESr, tl.cdiv(M, CHUNK) * S, m, EB)
            tl.debug_barrier()
            to_state = L - m <= T  # the row's last round writes the state, others the fp32 scratch
            if from_state != to_state:
                _copy_slots(Kr, Vr, Br, Pr, WKr, WVr, WNr, WPr, 0, 0, n_sink, from_state, to_state, D,
                            BLOCK_S, BLOCK_D)
            mid_end = _csm_merge(Kr, Vr, Br, Pr, WKr, WVr, WNr, WPr, EBr, EDr, ESr, LIr, FIr, from_state,
                                 to_state, n_sink, M, D, CHUNK, S, SA, BLOCK_DM, NUM_DB)
            tl.debug_barrier()
            _copy_slots(Kr, Vr, Br, Pr, WKr, WVr, WNr, WPr, n_sink + M, mid_end, L - n_sink - M, from_state,
                        to_state, D, BLOCK_S, BLOCK_D)
            tl.debug_barrier()
            L = L - m
            in_scratch = tl.where(to_state, 0, 1)
        go = (m > 0) & (L > T)
        i += 1
    if in_scratch != 0:  # the loop stopped on a row with no edge left: its fp32 rows go back
        _copy_slots(Kr, Vr, Br, Pr, WKr, WVr, WNr, WPr, 0, 0, L, False, True, D, BLOCK_S, BLOCK_D)
    _finish_row(Br, FILL_AT, L, C, BLOCK_S)


@triton_jit(do_not_specialize=["H", "C", "CW", "EMAX", "n_sink", "n_recent", "r_init_bits", "r_alpha_bits",
                                "r_min_bits", "eps_bits", "r_steps"])
def _chelsea_rows_kernel(
    K, V, BIAS, POS, FILL, BUDGET, HEAD_ON,  # state [B, Hkv, C, (D)], fill [B, Hkv], budget [2], HEAD_ON [Hkv] int8
    WK, WV, WN, WP,  # fp32 scratch [R, CW, D], [R, CW]; positions int64 [R, CW]
    EBEST, EDST, ESEL, LIST, FIRST,  # per-row edge buffers [R, EMAX] (fp32, int32, int8), [R, EMAX] int32
    STATUS,  # [R, 4] int32 (active, L, m, final) of round 0 (FROM_STATUS)
    H, C, CW, D, EMAX, n_sink, n_recent, r_init_bits, r_alpha_bits, r_min_bits, eps_bits, r_steps,
    CHUNK: tl.constexpr, S: tl.constexpr, SA: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DM: tl.constexpr,
    NUM_DB: tl.constexpr, BLOCK_S: tl.constexpr, EB: tl.constexpr, LOW_PREC_DOT: tl.constexpr,
    FROM_STATUS: tl.constexpr, BLOCK_1D: tl.constexpr,
):
    """One program per row runs every round (FROM_STATUS=False), or the rounds after round 0 of the rows
    that the parallel round-0 kernels left in the scratch (FROM_STATUS=True)."""
    row = tl.program_id(0).to(tl.int64)
    fill = tl.load(FILL + row)
    target = tl.load(BUDGET)
    if FROM_STATUS:
        run = (tl.load(STATUS + row * 4) != 0) & (tl.load(STATUS + row * 4 + 3) == 0)
    else:
        run = (fill >= tl.load(BUDGET + 1)) & (tl.load(HEAD_ON + row % H) != 0)
    if run:
        Kr = K + row * C * D
        Vr = V + row * C * D
        Br = BIAS + row * C
        Pr = POS + row * C
        T = target.to(tl.int32)
        if FROM_STATUS:  # round 0 left L - m slots in the scratch
            L = tl.load(STATUS + row * 4 + 1) - tl.load(STATUS + row * 4 + 2)
            i = tl.full([], 1, tl.int32)
            in_scratch = tl.full([], 1, tl.int32)
        else:  # padding slots go first: pack the valid ones
            L = _compact_state_row(Kr, Vr, Br, Pr, fill.to(tl.int32), 2**30, 0, D, BLOCK_S, BLOCK_D, BLOCK_1D)
            tl.debug_barrier()
            i = tl.full([], 0, tl.int32)
            in_scratch = tl.full([], 0, tl.int32)
        _csm_rounds(Kr, Vr, Br, Pr, WK + row * CW * D, WV + row * CW * D, WN + row * CW, WP + row * CW,
                    EBEST + row * EMAX, EDST + row * EMAX, ESEL + row * EMAX, LIST + row * EMAX,
                    FIRST + row * EMAX, FILL + row, L, T, i, in_scratch, C, D, n_sink, n_recent,
                    _f64(r_init_bits), _f64(r_alpha_bits), _f64(r_min_bits), _f64(eps_bits), r_steps,
                    CHUNK, S, SA, BLOCK_D, BLOCK_DM, NUM_DB, BLOCK_S, EB, LOW_PREC_DOT)


# -- chelsea round 0 in parallel: prepare, similarity, select, plan, merge ----------------------------------
@triton_jit(do_not_specialize=["H", "C", "n_sink", "n_recent", "r_init_bits", "r_min_bits", "eps_bits"])
def _chelsea_prepare_kernel(K, V, BIAS, POS, FILL, BUDGET, HEAD_ON, SN, SP, STATUS,
                            H, C, D, n_sink, n_recent, r_init_bits, r_min_bits, eps_bits,
                            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_1D: tl.constexpr):
    """Round 0, step 0 (grid: rows): due check, padding dropped, the row's degrees and positions copied to
    SN, SP (the later steps read them there while they rewrite the state), n_merge of round 0.
    STATUS[row] = (active, L, n_merge, 0); rows with nothing to merge are finished here."""
    row = tl.program_id(0).to(tl.int64)
    fill = tl.load(FILL + row)
    active = tl.full([], 0, tl.int32)
    L = tl.full([], 0, tl.int32)
    n_merge = tl.full([], 0, tl.int32)
    if (fill >= tl.load(BUDGET + 1)) & (tl.load(HEAD_ON + row % H) != 0):
        Br = BIAS + row * C
        Pr = POS + row * C
        T = tl.load(BUDGET).to(tl.int32)
        fill32 = fill.to(tl.int32)
        L = tl.full([], 0, tl.int32)
        for j0 in range(0, fill32, BLOCK_1D):  # count the valid slots, snapshot as if there were no padding
            j = j0 + tl.arange(0, BLOCK_1D)
            bb = tl.load(Br + j, mask=j < fill32, other=float("-inf"))
            L += tl.sum((bb > float("-inf")).to(tl.int32), axis=0)
            tl.store(SN + row * C + j, _degree(bb), mask=j < fill32)
            tl.store(SP + row * C + j, tl.load(Pr + j, mask=j < fill32, other=0), mask=j < fill32)
        if L != fill32:  # padding slots go first: pack the valid ones, snapshot again
            tl.debug_barrier()
            L = _compact_state_row(K + row * C * D, V + row * C * D, Br, Pr, fill32, 2**30, 0, D, BLOCK_S, BLOCK_D,
                                   BLOCK_1D)
            tl.debug_barrier()
            for j0 in range(0, L, BLOCK_1D):
                j = j0 + tl.arange(0, BLOCK_1D)
                tl.store(SN + row * C + j, _degree(tl.load(Br + j, mask=j < L, other=0.0)), mask=j < L)
                tl.store(SP + row * C + j, tl.load(Pr + j, mask=j < L, other=0), mask=j < L)
        M = L - n_sink - n_recent
        if (L > T) & (M > 1):
            # round 0: r_0 = max(r_init - r_alpha * 0, r_min) = max(r_init, r_min)
            r = tl.maximum(_f64(r_init_bits), _f64(r_min_bits))
            n_merge = tl.minimum(tl.maximum((r * M.to(tl.float64) + _f64(eps_bits)).to(tl.int32), 1), L - T)
            active = tl.full([], 1, tl.int32)
        else:
            _finish_row(Br, FILL + row, L, C, BLOCK_1D)
    tl.store(STATUS + row * 4, active)
    tl.store(STATUS + row * 4 + 1, L)
    tl.store(STATUS + row * 4 + 2, n_merge)
    tl.store(STATUS + row * 4 + 3, tl.full([], 0, tl.int32))


@triton_jit(do_not_specialize=["C", "EMAX", "n_sink", "n_recent"])
def _chelsea_similarity_kernel(K, STATUS, EBEST, EDST, C, D, EMAX, n_sink, n_recent,
                               CHUNK: tl.constexpr, S: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr,
                               BLOCK_D: tl.constexpr, LOW_PREC_DOT: tl.constexpr):
    """Round 0, step 1 (grid: rows x chunks): the chunk's A slots' best B (as _csm_similarity)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    M = tl.load(STATUS + row * 4 + 1) - n_sink - n_recent
    if (tl.load(STATUS + row * 4) != 0) & (c * CHUNK < M):
        c_start = n_sink + c * CHUNK
        clen = tl.minimum(M - c * CHUNK, CHUNK)
        for a0 in range(0, S, SA):
            ia = a0 + tl.arange(0, SA)
            va = 2 * ia < clen
            best, arg = _best_b(K + row * C * D, c_start + 2 * ia, va, c_start, clen, D, S, SB, BLOCK_D,
                                LOW_PREC_DOT)
            tl.store(EBEST + row * EMAX + c * S + ia, tl.where(va, best, float("-inf")))
            tl.store(EDST + row * EMAX + c * S + ia, arg)


@triton_jit(do_not_specialize=["C", "EMAX", "NCH", "n_sink", "n_recent"])
def _chelsea_select_kernel(BIAS, FILL, BUDGET, STATUS, EBEST, ESEL, CCOUNT, C, EMAX, NCH, n_sink, n_recent,
                           CHUNK: tl.constexpr, S: tl.constexpr, EB: tl.constexpr, BLOCK_1D: tl.constexpr):
    """Round 0, step 2 (grid: rows): m = min(n_merge, finite edges); the m best edges -> ESEL, their
    count per chunk -> CCOUNT [rows, NCH];
    STATUS = (1, L, m, final). A row with no edge is finished here (STATUS active 0)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(STATUS + row * 4) != 0:
        L = tl.load(STATUS + row * 4 + 1)
        n_e = tl.cdiv(L - n_sink - n_recent, CHUNK) * S
        n_fin = tl.full([], 0, tl.int32)
        for e0 in range(0, n_e, BLOCK_1D):
            e = e0 + tl.arange(0, BLOCK_1D)
            n_fin += tl.sum((tl.load(EBEST + row * EMAX + e, mask=e < n_e, other=float("-inf"))
                             > float("-inf")).to(tl.int32), axis=0)
        m = tl.minimum(tl.load(STATUS + row * 4 + 2), n_fin)
        if m > 0:
            _select_topm(EBEST + row * EMAX, ESEL + row * EMAX, n_e, m, EB, CCOUNT + row * NCH, S)
            tl.store(STATUS + row * 4 + 2, m)
            tl.store(STATUS + row * 4 + 3, (L - m <= tl.load(BUDGET).to(tl.int32)).to(tl.int32))
        else:
            tl.store(STATUS + row * 4, tl.full([], 0, tl.int32))
            _finish_row(BIAS + row * C, FILL + row, L, C, BLOCK_1D)


@triton_jit(do_not_specialize=["C", "CW", "EMAX", "NCH", "n_sink", "n_recent"])
def _chelsea_plan_kernel(BIAS, POS, FILL, STATUS, SN, SP, WN, WP, EBEST, EDST, ESEL, CCOUNT, LIST, CNT, FIRST, NTOT,
                         DA, DB, C, CW, EMAX, NCH, n_sink, n_recent, CHUNK: tl.constexpr, S: tl.constexpr,
                         SA: tl.constexpr, NCB: tl.constexpr, BLOCK_1D: tl.constexpr):
    """Round 0, step 3 (grid: rows x chunks): the chunk's stars (member lists in the reference's order,
    degree sums, largest positions) and every survivor's destination slot -> LIST, CNT, FIRST, NTOT, DA,
    DB; the survivors' degrees and positions are written (state: bias = log n; scratch: n). The first
    chunk's program also writes the sinks (scratch rows) or finishes the row (state rows); the last
    chunk's program moves the recent slots."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    L = tl.load(STATUS + row * 4 + 1)
    M = L - n_sink - n_recent
    if (tl.load(STATUS + row * 4) != 0) & (c * CHUNK < M):
        m = tl.load(STATUS + row * 4 + 2)
        to_state = tl.load(STATUS + row * 4 + 3) != 0
        E = row * EMAX + c * S
        ia = tl.arange(0, S)
        c_start = n_sink + c * CHUNK
        clen = tl.minimum(M - c * CHUNK, CHUNK)
        va = 2 * ia < clen
        vb = 2 * ia + 1 < clen
        sa = c_start + 2 * ia
        # survivors of the chunks before this one (all full chunks)
        c2 = tl.arange(0, NCB)
        out = n_sink + c * CHUNK - tl.sum(tl.load(CCOUNT + row * NCH + c2, mask=c2 < c, other=0), axis=0)
        best = tl.load(EBEST + E + ia)
        dst = tl.load(EDST + E + ia)
        sel = (tl.load(ESEL + E + ia) != 0) & va
        cnt = tl.zeros([S], tl.int32)
        rank = tl.zeros([S], tl.int32)
        for a0 in range(0, S, SA):
            io = a0 + tl.arange(0, SA)
            b_o = tl.load(EBEST + E + io)
            d_o = tl.load(EDST + E + io)
            s_o = (tl.load(ESEL + E + io) != 0) & (2 * io < clen)
            cnt += tl.sum((s_o[None, :] & (d_o[None, :] == ia[:, None])).to(tl.int32), axis=1)
            ahead = (s_o[None, :] & (d_o[None, :] == dst[:, None])
                     & ((b_o[None, :] > best[:, None])
                        | ((b_o[None, :] == best[:, None]) & (io[None, :] < ia[:, None]))))
            rank += tl.sum(ahead.to(tl.int32), axis=1)
        first = tl.cumsum(cnt, axis=0) - cnt
        tl.store(FIRST + E + ia, first)
        tl.store(CNT + E + ia, cnt)
        tl.debug_barrier()
        tl.store(LIST + E + tl.load(FIRST + E + dst, mask=sel, other=0) + rank, ia, mask=sel)
        tl.debug_barrier()
        n_a = tl.load(SN + row * C + sa, mask=va, other=1.0)
        n_tot = tl.load(SN + row * C + sa + 1, mask=vb, other=1.0)
        p_a = tl.load(SP + row * C + sa, mask=va, other=0)
        p_tot = tl.load(SP + row * C + sa + 1, mask=vb, other=0)
        for k in range(0, tl.max(cnt, axis=0)):
            has = cnt > k
            src = c_start + 2 * tl.load(LIST + E + first + k, mask=has, other=0)
            n_tot = tl.where(has, n_tot + tl.load(SN + row * C + src, mask=has, other=0.0), n_tot)
            p_tot = tl.where(has, tl.maximum(p_tot, tl.load(SP + row * C + src, mask=has, other=0)), p_tot)
        keep_a = va & (sel == 0)
        ka = keep_a.to(tl.int32)
        cum = tl.cumsum(ka, axis=0)
        dest_a = out + cum - ka + ia
        dest_b = out + cum + ia
        tl.store(NTOT + E + ia, n_tot)
        tl.store(DA + E + ia, tl.where(keep_a, dest_a, -1))
        tl.store(DB + E + ia, tl.where(vb, dest_b, -1))
        if to_state:
            tl.store(BIAS + row * C + dest_a, _log(n_a), mask=keep_a)
            tl.store(POS + row * C + dest_a, p_a, mask=keep_a)
            tl.store(BIAS + row * C + dest_b, _log(n_tot), mask=vb)
            tl.store(POS + row * C + dest_b, p_tot, mask=vb)
        else:
            tl.store(WN + row * CW + dest_a, n_a, mask=keep_a)
            tl.store(WP + row * CW + dest_a, p_a, mask=keep_a)
            tl.store(WN + row * CW + dest_b, n_tot, mask=vb)
            tl.store(WP + row * CW + dest_b, p_tot, mask=vb)
        if c == tl.cdiv(M, CHUNK) - 1:  # the recent slots follow the last survivor
            out_end = out + tl.sum(ka, axis=0) + tl.sum(vb.to(tl.int32), axis=0)
            for t0 in range(0, L - n_sink - M, BLOCK_1D):
                t = t0 + tl.arange(0, BLOCK_1D)
                mt = t < L - n_sink - M
                nn = tl.load(SN + row * C + n_sink + M + t, mask=mt, other=1.0)
                pp = tl.load(SP + row * C + n_sink + M + t, mask=mt, other=0)
                if to_state:
                    tl.store(BIAS + row * C + out_end + t, _log(nn), mask=mt)
                    tl.store(POS + row * C + out_end + t, pp, mask=mt)
                else:
                    tl.store(WN + row * CW + out_end + t, nn, mask=mt)
                    tl.store(WP + row * CW + out_end + t, pp, mask=mt)
        if c == 0:
            if to_state:  # nothing reads the state's bias or fill any more: finish the row
                _finish_row(BIAS + row * C, FILL + row, L - m, C, BLOCK_1D)
            else:
                for t0 in range(0, n_sink, BLOCK_1D):
                    t = t0 + tl.arange(0, BLOCK_1D)
                    mt = t < n_sink
                    tl.store(WN + row * CW + t, tl.load(SN + row * C + t, mask=mt, other=1.0), mask=mt)
                    tl.store(WP + row * CW + t, tl.load(SP + row * C + t, mask=mt, other=0), mask=mt)


@triton_jit()
def _merge_chunk(X, OUT, SNr, LIr, CNr, FIr, NTr, DAr, DBr, c, n_sink, D, offs_d, dmask,
                 CHUNK: tl.constexpr, S: tl.constexpr):
    """Round 0, step 4 for one chunk of one row and some columns of keys or values: the chunk's stars
    merged in the reference's order (n_b x_b, then the members in ranking order, then / n; other
    survivors (x n) / n), stored at their final slots in OUT (the staging copy or the fp32 scratch)."""
    ia = tl.arange(0, S)
    c_start = n_sink + c * CHUNK
    sa = c_start + 2 * ia
    da = tl.load(DAr + c * S + ia)
    db = tl.load(DBr + c * S + ia)
    cnt = tl.load(CNr + c * S + ia)
    first = tl.load(FIr + c * S + ia)
    n_tot = tl.load(NTr + c * S + ia)
    keep_a = da >= 0
    vb = db >= 0
    n_a = tl.load(SNr + sa, mask=keep_a, other=1.0)
    n_b = tl.load(SNr + sa + 1, mask=vb, other=1.0)
    ma = keep_a[:, None] & dmask[None, :]
    mb = vb[:, None] & dmask[None, :]
    xa = tl.load(X + sa[:, None] * D + offs_d[None, :], mask=ma, other=0.0).to(tl.float32)
    acc = tl.load(X + (sa + 1)[:, None] * D + offs_d[None, :], mask=mb, other=0.0).to(tl.float32) * n_b[:, None]
    for k in range(0, tl.max(cnt, axis=0)):
        has = cnt > k
        src = c_start + 2 * tl.load(LIr + c * S + first + k, mask=has, other=0)
        xk = tl.load(X + src[:, None] * D + offs_d[None, :], mask=has[:, None] & dmask[None, :],
                     other=0.0).to(tl.float32)
        acc = tl.where(has[:, None], acc + xk * tl.load(SNr + src, mask=has, other=0.0)[:, None], acc)
    out_b = tl.div_rn(acc, n_tot[:, None])
    out_a = tl.div_rn(xa * n_a[:, None], n_a[:, None])
    tl.store(OUT + da[:, None] * D + offs_d[None, :], out_a.to(OUT.dtype.element_ty), mask=ma)
    tl.store(OUT + db[:, None] * D + offs_d[None, :], out_b.to(OUT.dtype.element_ty), mask=mb)


@triton_jit()
def _move_slots(X, OUT, src0, dst0, count, D, offs_d, dmask, BLOCK_S: tl.constexpr):
    """OUT[dst0 + t] = X[src0 + t] for t < count (some columns), cast to OUT's dtype; out of place."""
    for t0 in range(0, count, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        m2 = (t < count)[:, None] & dmask[None, :]
        xx = tl.load(X + (src0 + t)[:, None] * D + offs_d[None, :], mask=m2, other=0.0)
        tl.store(OUT + (dst0 + t)[:, None] * D + offs_d[None, :], xx.to(OUT.dtype.element_ty), mask=m2)


@triton_jit(do_not_specialize=["C", "CW", "EMAX", "NCH", "n_sink", "n_recent"])
def _chelsea_merge_kernel(K, V, XK, XV, WK, WV, SN, STATUS, LIST, CNT, FIRST, NTOT, DA, DB, C, CW, D, EMAX, NCH,
                          n_sink, n_recent, CHUNK: tl.constexpr, S: tl.constexpr, DS: tl.constexpr,
                          NSLICE: tl.constexpr, BLOCK_S: tl.constexpr):
    """Round 0, step 4 (grid: rows x (NCH + 1) x 2 * NSLICE): program (row, c, p) merges chunk c's stars
    (c < NCH; the last program of dim 1 moves the recent slots, and the sinks of scratch rows) in columns
    [DS * (p % NSLICE), +DS) of keys (p < NSLICE) or values. Out of place, so the (row, chunk) programs
    run in parallel without races: rows the round finishes go to the staging copy XK, XV [rows, C, D]
    (state dtype; step 5 copies it back), the others to the fp32 scratch WK, WV. The state's K/V are
    only read; each output slot has one writer (deterministic)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    p = tl.program_id(2)
    L = tl.load(STATUS + row * 4 + 1)
    M = L - n_sink - n_recent
    if (tl.load(STATUS + row * 4) != 0) & ((c * CHUNK < M) | (c == NCH)):
        m = tl.load(STATUS + row * 4 + 2)
        to_state = tl.load(STATUS + row * 4 + 3) != 0
        offs_d = (p % NSLICE) * DS + tl.arange(0, DS)
        dmask = offs_d < D
        E = row * EMAX
        if p < NSLICE:
            X = K + row * C * D
            XS = XK + row * C * D
            W = WK + row * CW * D
        else:
            X = V + row * C * D
            XS = XV + row * C * D
            W = WV + row * CW * D
        if c < NCH:  # (a call per target: the staging copy and the scratch differ in element type)
            if to_state:
                _merge_chunk(X, XS, SN + row * C, LIST + E, CNT + E, FIRST + E, NTOT + E, DA + E, DB + E, c, n_sink,
                             D, offs_d, dmask, CHUNK, S)
            else:
                _merge_chunk(X, W, SN + row * C, LIST + E, CNT + E, FIRST + E, NTOT + E, DA + E, DB + E, c, n_sink,
                             D, offs_d, dmask, CHUNK, S)
        else:  # the recent slots, m slots to the left; scratch rows also get the sinks
            if to_state:
                _move_slots(X, XS, n_sink + M, n_sink + M - m, L - n_sink - M, D, offs_d, dmask, BLOCK_S)
            else:
                _move_slots(X, W, n_sink + M, n_sink + M - m, L - n_sink - M, D, offs_d, dmask, BLOCK_S)
                _move_slots(X, W, 0, 0, n_sink, D, offs_d, dmask, BLOCK_S)


@triton_jit(do_not_specialize=["C", "n_sink"])
def _chelsea_writeback_kernel(K, V, XK, XV, STATUS, C, D, n_sink, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Round 0, step 5 (grid: rows x cdiv(C, BLOCK_T)): rows the round finished get their merged and
    compacted slots [n_sink, L - m) back from the staging copy (the sinks never move)."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    if (tl.load(STATUS + row * 4) != 0) & (tl.load(STATUS + row * 4 + 3) != 0):
        end = tl.load(STATUS + row * 4 + 1) - tl.load(STATUS + row * 4 + 2)
        offs_d = tl.arange(0, BLOCK_D)
        m2 = ((t >= n_sink) & (t < end))[:, None] & (offs_d < D)[None, :]
        at = row * C * D + t[:, None] * D + offs_d[None, :]
        tl.store(K + at, tl.load(XK + at, mask=m2), mask=m2)
        tl.store(V + at, tl.load(XV + at, mask=m2), mask=m2)


# -- launcher ----------------------------------------------------------------------------------------
def _block_s(block_d):
    return max(16, min(64, 4096 // block_d))


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def supports_chelsea(keys, chunk) -> bool:
    """Shapes the Triton kernel handles; others run the reference (which syncs with the host)."""
    return triton is not None and chunk <= MAX_CHUNK and keys.shape[-1] <= MAX_HEAD_DIM


def scratch_slots(C: int, n_sink: int, n_recent: int, r_init: float, r_min: float) -> int:
    """Slots of the fp32 scratch: the longest row a first round can leave when a second one follows.

    A round that is not the row's last removes n_0 = max(1, floor(r_0 M)) slots (r_0 = max(r_init, r_min)
    <= 0.5 keeps that many edges available: a middle of M slots has >= floor(M / 2) edges), and
    L - max(1, floor(r_0 (L - P))) grows with L, so a full row (L = C) bounds it.
    """
    M = C - n_sink - n_recent
    r0 = max(r_init, r_min)
    if M < 2 or not 0 < r0 <= 0.5:
        return max(C, 1)
    return C - max(1, int(r0 * M + 1e-9))


def triton_chelsea_compress(keys, values, bias, slot_pos, fill, budget, n_sink: int, n_recent: int, chunk: int,
                            r_init: float, r_alpha: float, r_steps: int, r_min: float, outlier_heads,
                            parallel_round0: bool = True, edge_block: int = 2048, sim_block: int = 32,
                            merge_columns: int | None = None, select_block: int | None = None) -> None:
    """Launch the kernels (see the module docstring). parallel_round0=False runs every round in the
    one-program-per-row kernel (the slow path, kept as a cross-check: at batch 40 on an H200 it made chelsea's
    compressing step 186.5 ms against 93.4, docs/bench.md "Stop 39 runs"). edge_block: edges per block of that
    kernel's selection; sim_block: A (and B) slots per similarity tile of that kernel; merge_columns,
    select_block: the round-0 merge's columns per program and selection's edges per block (defaults
    MERGE_COLUMNS, SELECT_BLOCK)."""
    if triton is None:
        raise NotImplementedError("triton_chelsea_compress needs Triton (pip install triton)")
    B, H, C, D = _check_state("triton_chelsea_compress", keys, values, bias, slot_pos, fill, budget)
    if chunk < 2 or chunk > MAX_CHUNK or D > MAX_HEAD_DIM:
        raise ValueError(f"triton_chelsea_compress: needs 2 <= chunk <= {MAX_CHUNK} and D <= {MAX_HEAD_DIM}, "
                         f"got chunk={chunk}, D={D}")
    R = B * H
    if R == 0 or C == 0:
        return
    merge_columns = MERGE_COLUMNS if merge_columns is None else merge_columns
    select_block = SELECT_BLOCK if select_block is None else select_block
    dev = keys.device
    S = max(16, triton.next_power_of_2((chunk + 1) // 2))  # A (and B) slots of a chunk, padded
    n_chunks = max(1, triton.cdiv(max(C - n_sink - n_recent, 1), chunk))
    EMAX = n_chunks * S
    CW = scratch_slots(C, n_sink, n_recent, r_init, r_min)
    head_on = torch.ones(H, dtype=torch.int8, device=dev)
    for h in outlier_heads:  # a fill kernel per outlier head (`head_on[h] = 0` would copy a host scalar)
        head_on.narrow(0, h, 1).zero_()
    f32, i32 = torch.float32, torch.int32
    wk = torch.empty(R, CW, D, dtype=f32, device=dev)
    wv = torch.empty(R, CW, D, dtype=f32, device=dev)
    wn = torch.empty(R, CW, dtype=f32, device=dev)
    wp = torch.empty(R, CW, dtype=torch.int64, device=dev)
    ebest = torch.empty(R, EMAX, dtype=f32, device=dev)
    edst = torch.empty(R, EMAX, dtype=i32, device=dev)
    esel = torch.empty(R, EMAX, dtype=torch.int8, device=dev)
    lst = torch.empty(R, EMAX, dtype=i32, device=dev)
    first = torch.empty(R, EMAX, dtype=i32, device=dev)
    status = torch.empty(R, 4, dtype=i32, device=dev)
    block_d = max(triton.next_power_of_2(D), 16)
    low_prec = keys.dtype in (torch.float16, torch.bfloat16)
    bits = dict(r_init=_bits(r_init), r_alpha=_bits(r_alpha), r_min=_bits(r_min), eps=_bits(1e-9))
    if parallel_round0:
        sn = torch.empty(R, C, dtype=f32, device=dev)
        sp = torch.empty(R, C, dtype=torch.int64, device=dev)
        cnt = torch.empty(R, EMAX, dtype=i32, device=dev)
        ntot = torch.empty(R, EMAX, dtype=f32, device=dev)
        da = torch.empty(R, EMAX, dtype=i32, device=dev)
        db = torch.empty(R, EMAX, dtype=i32, device=dev)
        _chelsea_prepare_kernel[(R,)](keys, values, bias, slot_pos, fill, budget, head_on, sn, sp, status, H, C, D,
                                      n_sink, n_recent, bits["r_init"], bits["r_min"], bits["eps"],
                                      BLOCK_S=_block_s(block_d), BLOCK_D=block_d, BLOCK_1D=1024, num_warps=4,
                                      enable_fp_fusion=False)
        _chelsea_similarity_kernel[(R, n_chunks)](keys, status, ebest, edst, C, D, EMAX, n_sink, n_recent,
                                                  CHUNK=chunk, S=S, SA=min(S, 64), SB=min(S, 64 if low_prec else 32),
                                                  BLOCK_D=block_d, LOW_PREC_DOT=low_prec, num_warps=8,
                                                  enable_fp_fusion=False)
        ccount = torch.empty(R, n_chunks, dtype=i32, device=dev)
        _chelsea_select_kernel[(R,)](bias, fill, budget, status, ebest, esel, ccount, C, EMAX, n_chunks, n_sink,
                                     n_recent, CHUNK=chunk, S=S, EB=max(select_block, S), BLOCK_1D=1024, num_warps=8)
        _chelsea_plan_kernel[(R, n_chunks)](bias, slot_pos, fill, status, sn, sp, wn, wp, ebest, edst, esel, ccount,
                                            lst, cnt, first, ntot, da, db, C, CW, EMAX, n_chunks, n_sink, n_recent,
                                            CHUNK=chunk, S=S, SA=min(S, 32), NCB=triton.next_power_of_2(n_chunks),
                                            BLOCK_1D=256, num_warps=4, enable_fp_fusion=False)
        nslice = triton.cdiv(D, merge_columns)
        xk = torch.empty_like(keys)  # staging copy of the rows round 0 finishes (step 5 copies it back)
        xv = torch.empty_like(values)
        _chelsea_merge_kernel[(R, n_chunks + 1, 2 * nslice)](
            keys, values, xk, xv, wk, wv, sn, status, lst, cnt, first, ntot, da, db, C, CW, D, EMAX, n_chunks, n_sink,
            n_recent, CHUNK=chunk, S=S, DS=merge_columns, NSLICE=nslice, BLOCK_S=64, num_warps=4,
            enable_fp_fusion=False)
        _chelsea_writeback_kernel[(R, triton.cdiv(C, 32))](keys, values, xk, xv, status, C, D, n_sink, BLOCK_T=32,
                                                           BLOCK_D=block_d, num_warps=4)
    _chelsea_rows_kernel[(R,)](
        keys, values, bias, slot_pos, fill, budget, head_on, wk, wv, wn, wp, ebest, edst, esel, lst, first, status,
        H, C, CW, D, EMAX, n_sink, n_recent, bits["r_init"], bits["r_alpha"], bits["r_min"], bits["eps"], r_steps,
        CHUNK=chunk, S=S, SA=min(S, sim_block), BLOCK_D=block_d, BLOCK_DM=16, NUM_DB=block_d // 16,
        BLOCK_S=_block_s(block_d), EB=edge_block, LOW_PREC_DOT=low_prec, FROM_STATUS=parallel_round0, BLOCK_1D=1024,
        num_warps=8, num_stages=1, enable_fp_fusion=False,
    )


# -- op registration ---------------------------------------------------------------------------------
@torch.library.custom_op(
    "kvrewrite::chelsea_compress", mutates_args=("keys", "values", "bias", "slot_pos", "fill")
)
def chelsea_compress(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    budget: torch.Tensor,
    n_sink: int,
    n_recent: int,
    chunk: int,
    r_init: float,
    r_alpha: float,
    r_steps: int,
    r_min: float,
    outlier_heads: list[int],
) -> None:
    """Chelsea compression of the rows that reached the threshold (see the module docstring)."""
    reference_chelsea_compress(
        keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min, outlier_heads
    )


@chelsea_compress.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min,
      outlier_heads):
    args = (keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min,
            outlier_heads)
    if supports_chelsea(keys, chunk):
        triton_chelsea_compress(*args)
        return
    if triton is not None:
        reference_fallback("chelsea_compress: chunk=%d, D=%d has no Triton kernel (chunk <= %d, D <= %d); running the "
                           "reference, which syncs with the host", chunk, keys.shape[-1], MAX_CHUNK, MAX_HEAD_DIM)
    reference_chelsea_compress(*args)


@chelsea_compress.register_fake
def _(keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min, outlier_heads):
    return None
