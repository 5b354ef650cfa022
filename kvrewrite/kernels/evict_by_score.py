"""kvrewrite::evict_by_score — keep a recent window plus the highest-scoring older slots, drop the rest.

The compression of H2O (https://arxiv.org/abs/2306.14048: heavy hitters by accumulated attention +
recent tokens) and SnapKV (https://arxiv.org/abs/2404.14469: the observation window + the top pooled
scores of the window's attention). The score is method state, filled by kvrewrite::accumulate_attention.

For every row (b, kv-head) whose fill reached the threshold (budget = [target B, threshold]):

1. its valid slots (slot < fill, bias > -inf; padding slots are dropped) in slot order, which is
   temporal order; L of them. A row with L <= B keeps them all (only the padding goes);
2. otherwise R = min(n_recent + floor(recent_ratio * B), B) most recent valid slots are kept, and
   among the L - R older ones the B - R with the highest score, where the score is first max-pooled
   over a window of `pool` neighbouring older slots (in temporal order, the window clipped at both
   ends; pool = 1: the raw score). Ties go to the earlier slot;
3. the kept slots are packed at the front of the row in temporal order, each with its keys, values,
   bias, position and score; the freed slots get bias -inf and score 0; fill = the slots kept. With
   reset_score the kept slots' scores restart at 0 too (SnapKV's window restarts).

Rows below the threshold are untouched (bit for bit).

State (mutated): keys, values [B, Hkv, C, D]; bias, slot_pos [B, Hkv, C]; fill [B, Hkv]; score [B, Hkv, C]
fp32. budget: [2] int64. Args: n_recent (int >= 0), recent_ratio (float in [0, 1]), pool (odd int >= 1),
reset_score (bool).

Backends. The reference (static-shape tensor code: ranks by cumsum, a stable sort for the top scores,
scatter/gather compaction) is the CPU path and the ground truth. CUDA runs the Triton kernels below
(supports_triton: C <= MAX_SLOTS, the state's usual dtypes, contiguous; otherwise the reference), which leave
the same state bit for bit. Neither reads anything on the host and the launches depend on shapes only, so CUDA
graphs capture both (torch.compile mode="reduce-overhead"). The op stays a `custom_op` (opaque to Inductor)
whose CUDA kernel launches Triton directly, as chelsea_compress does: a `triton_op` failed under torch 2.11's
Inductor (docs/methods.md).

Triton kernels (3 launches). The tensor code sorts every row and gathers the whole layer's keys and values through
a temporary copy (~340 us per Llama-3.1-8B layer on an H100). Here only the keys and values that move are read and
written, once, plus a small halo; the selection runs in one program per row.

1. select, grid rows (a row not due returns at once). A chunked cumsum ranks the row's valid slots and copies
   the slot index, score, bias and slot_pos of each valid rank to row scratch (so the state's metadata can then
   be rewritten in place in any order). Scores become int32 order keys (the fp32 bits made monotone; -0.0 keys
   as +0.0 and every NaN as one value above +inf, as the reference's max pooling and stable sort treat them),
   max-pooled over the older ranks. The threshold of the B - R largest comes from a bisection over the key
   values, the older keys in registers: one count (one reduction) per step, stopping as soon as a count hits
   B - R exactly, ~log2 of the key range around the threshold steps (13-17 on random scores, at most 32). A
   radix select would take a histogram per digit (Triton's costs ~log2(bins) ballots per element) and a
   bitonic sort ~log2(C)^2 / 2 passes. Ties at the threshold are ranked by a cumsum, to the earlier slot as
   the stable sort does; at a threshold of -inf the row's other slots count too (the reference ranks them at
   -inf). A cumsum over the kept ranks gives their destinations: the kept bias, slot_pos and score are written
   there from the scratch, SRC[destination] = source slot, then the freed slots and fill. Per row it leaves
   [first destination that moves, kept count] for the moves.
2. stage and 3. move, grid (blocks of MOVE_SLOTS destination slots, rows, MOVE_COLUMNS-column slices of keys and
   of values); only destinations in [first, kept) are touched. The survivors only shift left, so a block's
   sources can lie past its end, in slots that later blocks overwrite: moved block-parallel in place, that would
   race (and a move program walking a row in order, as evict_to_budget's, runs one latency-bound tile at a time).
   Launch 2 copies exactly those halo sources (a block's destinations whose source lies past the block: about
   the row's shift, at most the block) to a staging buffer; launch 3 then moves every block at once, its own
   sources from the state and the halo from the stage: only the block's program writes its slots and no other
   program of launch 3 reads them (loads, a CTA barrier, stores). Traffic: the moving keys and values once plus
   the halo twice. Llama-3.1-8B (B 1, Hkv 8, D 128, bf16, C ~8.6k, fill 6586 -> 6554, 32 slots out per row
   anywhere in it): up to ~27 MB read and written, plus ~6% for a shift of ~16 on average over 256-slot blocks.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import logging
import struct

import torch
import torch.nn.functional as F

from kvrewrite.kernels._slot_kernels import _check_state
from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference; only triton_evict_by_score raises
    triton = tl = None

logger = logging.getLogger(__name__)

NEG_INF = float("-inf")


def _check_inputs(keys, bias, score, n_recent, recent_ratio, pool):
    name = "kvrewrite::evict_by_score"
    B, H, C, _ = keys.shape
    if tuple(score.shape) != (B, H, C) or score.dtype != torch.float32:
        raise ValueError(f"{name}: score must be fp32 [B, Hkv, C] = {(B, H, C)}, "
                         f"got {score.dtype} {tuple(score.shape)}")
    if tuple(bias.shape) != (B, H, C):
        raise ValueError(f"{name}: bias must be [B, Hkv, C] = {(B, H, C)}, got {tuple(bias.shape)}")
    if n_recent < 0 or not 0 <= recent_ratio <= 1:
        raise ValueError(f"{name}: n_recent must be >= 0 and recent_ratio in [0, 1], got {n_recent}, {recent_ratio}")
    if pool < 1 or pool % 2 == 0:
        raise ValueError(f"{name}: pool must be an odd int >= 1 (1: no pooling), got {pool}")


def kept_slots(bias, fill, budget, score, n_recent: int, recent_ratio: float, pool: int):
    """The selection of evict_by_score: (due [B, H], keep [B, H, C] bool) for every row, due or not."""
    B, H, C = bias.shape
    ar = torch.arange(C, device=bias.device)
    target = budget[0]
    due = fill >= budget[1]
    valid = (ar < fill[..., None]) & (bias > NEG_INF)
    L = valid.sum(dim=-1, keepdim=True)
    rank = valid.long().cumsum(dim=-1) - 1  # temporal rank among the valid slots
    recent = torch.minimum(n_recent + torch.floor(recent_ratio * target.double()).long(), target)
    n_old = (L - recent).clamp_min(0)
    old = valid & (rank < n_old)
    s = score.masked_fill(~old, NEG_INF)
    if pool > 1:  # max-pool the older slots' scores in temporal order (the padding and recent slots are -inf)
        dest = torch.where(old, rank, C)
        packed = torch.full((B, H, C + 1), NEG_INF, device=bias.device).scatter(-1, dest, s)[..., :C]
        pooled = F.max_pool1d(packed.reshape(B * H, 1, C), pool, stride=1, padding=pool // 2).view(B, H, C)
        s = pooled.gather(-1, rank.clamp(0, C - 1)).masked_fill(~old, NEG_INF)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # ties: the earlier slot first
    place = torch.empty_like(order).scatter_(-1, order, ar.expand(B, H, C))
    keep = valid & ((rank >= n_old) | (place < target - recent))
    return due, torch.where(L > target, keep, valid)


def reference_evict_by_score(keys, values, bias, slot_pos, fill, budget, score, n_recent, recent_ratio, pool,
                             reset_score):
    """The CPU path and the ground truth: selection, then compaction of the due rows by one gather per state
    tensor."""
    B, H, C, D = keys.shape
    due, keep = kept_slots(bias, fill, budget, score, n_recent, recent_ratio, pool)
    ar = torch.arange(C, device=keys.device)
    keep = keep & due[..., None]
    n_kept = keep.sum(dim=-1)
    # source slot of every destination: kept slots scatter to their packed place, the others past C;
    # destinations past the packed ones (and every slot of a row not due) keep their own slot
    dest = torch.where(keep, keep.long().cumsum(dim=-1) - 1, C + ar)
    src = torch.cat([ar, ar]).expand(B, H, 2 * C).scatter(-1, dest, ar.expand(B, H, C))[..., :C]
    src = torch.where(due[..., None], src, ar)
    freed = due[..., None] & (ar >= n_kept[..., None])
    src4 = src[..., None].expand(B, H, C, D)
    keys.copy_(keys.gather(2, src4))
    values.copy_(values.gather(2, src4))
    slot_pos.copy_(slot_pos.gather(2, src))
    bias.copy_(bias.gather(2, src).masked_fill(freed, NEG_INF))
    moved = score.gather(2, src).masked_fill(freed, 0.0)
    score.copy_(moved.masked_fill(due[..., None], 0.0) if reset_score else moved)
    fill.copy_(torch.where(due, n_kept, fill))


# -- Triton kernels ----------------------------------------------------------------------------------
MAX_SLOTS = 32768  # larger C runs the reference on CUDA too (the selection holds a row's keys in registers)
SELECT_CHUNK = 4096  # slots per block of the select kernel's chunked passes (a power of two)
MOVE_SLOTS = 256  # destination slots per program of the stage and move kernels (a power of two)
MOVE_COLUMNS = 64  # head-dim columns per program of the stage and move kernels (a power of two)

if tl is not None:
    _KEY_NEG_INF = tl.constexpr(-2139095041)  # _order_key(-inf)
    _I32_MAX = tl.constexpr(2147483647)


@triton_jit()
def _order_key(x):
    """int32 key of fp32 x in the order of the reference's sort: -0.0 as +0.0, every NaN as one value above +inf."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    bits = tl.where(mag == 0, 0, bits)
    bits = tl.where(mag > 0x7F800000, 0x7FC00000, bits)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton_jit()
def _f64(bits):
    """A Python float passed as its IEEE bits (Triton passes Python floats as fp32)."""
    return (tl.full([], 0, tl.int64) + bits).to(tl.float64, bitcast=True)


@triton_jit()
def _add_min_max(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.minimum(a1, b1), tl.maximum(a2, b2)


@triton_jit()
def _add_add(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton_jit()
def _add_add_min(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, tl.minimum(a2, b2)


@triton_jit()
def _kth_largest(KEYS, n_old, K, S: tl.constexpr, POOLED: tl.constexpr):
    """(thr, need, n_eq) over the keys of the older ranks [0, n_old) (S >= n_old lanes; the row's other slots
    rank as -inf), K >= 1: thr is the K-th largest key, need = K - #(key > thr) how many of the key == thr slots
    rank among the K largest (the earliest ones), n_eq how many older keys equal thr. KEYS: pooled keys (POOLED)
    or the raw fp32 scores."""
    j = tl.arange(0, S)
    if POOLED:
        key = tl.load(KEYS + j, mask=j < n_old, other=_KEY_NEG_INF)
    else:
        key = _order_key(tl.load(KEYS + j, mask=j < n_old, other=float("-inf")))
    thr = tl.full([], _KEY_NEG_INF, tl.int32)  # fewer than K keys above -inf: the K-th is -inf
    above = key > _KEY_NEG_INF
    n_above, lo32, hi32 = tl.reduce((above.to(tl.int32), tl.where(above, key, _I32_MAX), key), 0, _add_min_max)
    if n_above >= K:
        # bisection over the key values, count(key >= lo) >= K > count(key > hi) throughout; ~log2 of the key
        # range around the threshold steps (at most 32), one count each
        lo = lo32.to(tl.int64)
        hi = hi32.to(tl.int64)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            cnt = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
            if cnt == K:  # the K largest are exactly the keys >= mid: thr is the smallest of them
                lo = tl.min(tl.where(key >= mid.to(tl.int32), key, _I32_MAX), axis=0).to(tl.int64)
                hi = lo
            elif cnt > K:
                lo = mid
            else:
                hi = mid - 1
        thr = lo.to(tl.int32)
    n_gt, n_eq = tl.reduce(((key > thr).to(tl.int32), (key == thr).to(tl.int32)), 0, _add_add)
    return thr, K - n_gt, n_eq


@triton_jit(do_not_specialize=["n_recent", "ratio_bits"])
def _evict_select_kernel(BIAS, POS, SCORE, FILL, BUDGET, SOR, SCR, BIR, POR, KEYP, SRC, INFO, C, n_recent, ratio_bits,
                         POOL: tl.constexpr, RESET: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Launch 1 (grid: rows): a due row's selection, its bias/slot_pos/score and fill; INFO[row] = [first
    destination that moves, kept count] ([0, 0] for a row not due). Row scratch [C], by valid rank: SOR slot,
    SCR score, BIR bias, POR slot_pos, KEYP pooled key; by destination: SRC source slot (of the moved ones)."""
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    # the first chunk's loads go out with fill's (a row not due wastes them); each later one during the last
    s0 = tl.arange(0, CHUNK)
    bb_next = tl.load(BIAS + base + s0, mask=s0 < C, other=float("-inf"))
    sc_next = tl.load(SCORE + base + s0, mask=s0 < C, other=0.0)
    pp_next = tl.load(POS + base + s0, mask=s0 < C, other=0)
    fill = tl.load(FILL + row)
    first = tl.zeros([], tl.int32)
    n_kept = tl.zeros([], tl.int32)
    if fill >= tl.load(BUDGET + 1):
        # -- rank the valid slots and copy the row's metadata out by rank (so it can then be written in place)
        n_fill = tl.minimum(fill, C).to(tl.int32)
        L = tl.zeros([], tl.int32)
        for c0 in range(0, n_fill, CHUNK):
            s = c0 + s0
            bb, sc, pp = bb_next, sc_next, pp_next
            m = s < n_fill
            s_next = s + CHUNK
            bb_next = tl.load(BIAS + base + s_next, mask=s_next < n_fill, other=float("-inf"))
            sc_next = tl.load(SCORE + base + s_next, mask=s_next < n_fill, other=0.0)
            pp_next = tl.load(POS + base + s_next, mask=s_next < n_fill, other=0)
            valid = m & (bb > float("-inf"))
            vi = valid.to(tl.int32)
            rank = L + tl.cumsum(vi, axis=0) - vi
            tl.store(SOR + base + rank, s, mask=valid)
            tl.store(SCR + base + rank, sc, mask=valid)
            tl.store(BIR + base + rank, bb, mask=valid)
            tl.store(POR + base + rank, pp, mask=valid)
            L += tl.sum(vi, axis=0)
        # -- the rule's sizes (int64 until known to be small: the target may be the state's NO_LIMIT)
        target = tl.load(BUDGET)
        recent = tl.minimum(n_recent + tl.floor(_f64(ratio_bits) * target.to(tl.float64)).to(tl.int64), target)
        select = L.to(tl.int64) > target
        n_old = tl.where(select, L - recent, 0).to(tl.int32)  # older ranks [0, n_old), recent ones [n_old, L)
        K = tl.where(select, target - recent, 0).to(tl.int32)  # older slots kept
        thr = tl.full([], _I32_MAX, tl.int32)  # K == 0: no older slot is kept
        need = tl.zeros([], tl.int32)
        n_eq = tl.zeros([], tl.int32)
        tl.debug_barrier()
        if K > 0:
            if POOL > 1:  # -- max pooling over the older ranks (temporal order), the window clipped at the ends
                for c0 in range(0, n_old, CHUNK):
                    j = c0 + tl.arange(0, CHUNK)
                    k = tl.full([CHUNK], _KEY_NEG_INF, tl.int32)
                    for o in tl.static_range(POOL):
                        jj = j + (o - POOL // 2)
                        x = tl.load(SCR + base + jj, mask=(j < n_old) & (jj >= 0) & (jj < n_old), other=float("-inf"))
                        k = tl.maximum(k, _order_key(x))
                    tl.store(KEYP + base + j, k, mask=j < n_old)
                tl.debug_barrier()
                KEYS = KEYP + base
            else:
                KEYS = SCR + base
            # -- the K-th largest key (the search runs over the smallest power of two >= n_old lanes)
            if BLOCK >= 64:
                if n_old <= BLOCK // 4:
                    thr, need, n_eq = _kth_largest(KEYS, n_old, K, BLOCK // 4, POOL > 1)
                elif n_old <= BLOCK // 2:
                    thr, need, n_eq = _kth_largest(KEYS, n_old, K, BLOCK // 2, POOL > 1)
                else:
                    thr, need, n_eq = _kth_largest(KEYS, n_old, K, BLOCK, POOL > 1)
            else:
                thr, need, n_eq = _kth_largest(KEYS, n_old, K, BLOCK, POOL > 1)
        # -- the kept ranks in order: destinations by cumsum; metadata written from the rank copies. Ties at thr go
        # to the earlier slot: a slot's rank among the row's key == thr slots decides, unless all of them are kept
        # (distinct scores). At thr = -inf those are all slots but the older ones above -inf, so the rank is the
        # slot index less those before it.
        at_neg = thr == _KEY_NEG_INF
        every_tie = (need == n_eq) & (thr != _KEY_NEG_INF)
        carry = tl.zeros([], tl.int32)
        first = tl.full([], _I32_MAX, tl.int32)
        for c0 in range(0, L, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            ranked = j < L
            old = j < n_old
            if POOL > 1:
                k = tl.load(KEYP + base + j, mask=old, other=_KEY_NEG_INF)
            else:
                k = _order_key(tl.load(SCR + base + j, mask=old, other=float("-inf")))
            slot = tl.load(SOR + base + j, mask=ranked, other=0)
            bb = tl.load(BIR + base + j, mask=ranked)
            pp = tl.load(POR + base + j, mask=ranked)
            sc = tl.load(SCR + base + j, mask=ranked)
            if every_tie:
                flag = tl.zeros([CHUNK], tl.int32)
                keep = ranked & ((j >= n_old) | (k >= thr))
            else:
                flag = tl.where(at_neg, old & (k > _KEY_NEG_INF), old & (k == thr)).to(tl.int32)
                before = carry + tl.cumsum(flag, axis=0) - flag
                tie_rank = tl.where(at_neg, slot - before, before)
                keep = ranked & ((j >= n_old) | (k > thr) | ((k == thr) & (tie_rank < need)))
            ki = keep.to(tl.int32)
            dest = n_kept + tl.cumsum(ki, axis=0) - ki
            moved = keep & (slot != dest)
            tl.store(SRC + base + dest, slot, mask=moved)
            tl.store(BIAS + base + dest, bb, mask=moved)
            tl.store(POS + base + dest, pp, mask=moved)
            if RESET:
                tl.store(SCORE + base + dest, tl.zeros([CHUNK], tl.float32), mask=keep)
            else:
                tl.store(SCORE + base + dest, sc, mask=moved)
            n_add, f_add, first_c = tl.reduce((ki, flag, tl.where(moved, dest, _I32_MAX)), 0, _add_add_min)
            n_kept += n_add
            carry += f_add
            first = tl.minimum(first, first_c)
        first = tl.minimum(first, n_kept)
        # -- freed slots: bias -inf, score 0 (keys, values and slot_pos stay as they are); fill
        for c0 in range(n_kept, C, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            tl.store(BIAS + base + j, tl.full([CHUNK], float("-inf"), tl.float32), mask=j < C)
            tl.store(SCORE + base + j, tl.zeros([CHUNK], tl.float32), mask=j < C)
        tl.store(FILL + row, n_kept.to(tl.int64))
    tl.store(INFO + 2 * row, first)
    tl.store(INFO + 2 * row + 1, n_kept)


@triton_jit()
def _move_block(K, V, SK, SV, SRC, INFO, C, D, STAGE: tl.constexpr, BLOCK_S: tl.constexpr, DS: tl.constexpr,
                NSLICE: tl.constexpr):
    """Program (b, row, p) of launches 2 (STAGE) and 3: destinations [BLOCK_S * b, +BLOCK_S) of the row, columns
    [DS * (p % NSLICE), +DS) of keys (p < NSLICE) or values. Destinations in [first, kept) move, from sources at
    or after them; sources past the block (its halo) are overwritten by later blocks in launch 3, so launch 2
    copies them to the stage SK/SV (at their destination's place) first. No other program writes a block."""
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2)
    j0 = blk * BLOCK_S
    j = j0 + tl.arange(0, BLOCK_S)
    src = tl.load(SRC + row * C + j, mask=j < C, other=0)  # with INFO's loads (only moved entries are used)
    first = tl.load(INFO + 2 * row)
    n_kept = tl.load(INFO + 2 * row + 1)
    if (j0 < n_kept) & (j0 + BLOCK_S > first):
        moved = (j >= first) & (j < n_kept)
        halo = moved & (src >= j0 + BLOCK_S)
        own = moved & (src < j0 + BLOCK_S)
        cols = (p % NSLICE) * DS + tl.arange(0, DS)
        if p < NSLICE:
            X = K
            SX = SK
        else:
            X = V
            SX = SV
        base = row * C * D
        cm = (cols < D)[None, :]
        at_dest = base + j[:, None] * D + cols[None, :]
        at_src = base + src[:, None] * D + cols[None, :]
        if STAGE:
            tl.store(SX + at_dest, tl.load(X + at_src, mask=halo[:, None] & cm), mask=halo[:, None] & cm)
        else:
            x = tl.load(X + at_src, mask=own[:, None] & cm)
            x = tl.where(halo[:, None], tl.load(SX + at_dest, mask=halo[:, None] & cm), x)
            tl.debug_barrier()  # every load of the block before any store to it
            tl.store(X + at_dest, x, mask=moved[:, None] & cm)


@triton_jit()
def _evict_stage_kernel(K, V, SK, SV, SRC, INFO, C, D, BLOCK_S: tl.constexpr, DS: tl.constexpr,
                        NSLICE: tl.constexpr):
    """Launch 2, grid (slot blocks, rows, 2 * NSLICE): each block's halo to the stage (_move_block)."""
    _move_block(K, V, SK, SV, SRC, INFO, C, D, True, BLOCK_S, DS, NSLICE)


@triton_jit()
def _evict_move_kernel(K, V, SK, SV, SRC, INFO, C, D, BLOCK_S: tl.constexpr, DS: tl.constexpr,
                       NSLICE: tl.constexpr):
    """Launch 3, grid (slot blocks, rows, 2 * NSLICE): every block's moves, in place (_move_block)."""
    _move_block(K, V, SK, SV, SRC, INFO, C, D, False, BLOCK_S, DS, NSLICE)


# -- launcher ----------------------------------------------------------------------------------------
def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _select_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def supports_triton(keys, values, bias, slot_pos, fill, budget, score) -> bool:
    """Whether the CUDA path runs triton_evict_by_score: Triton installed, C <= MAX_SLOTS, the state's dtypes
    (bias and score fp32, slot_pos, fill and budget int64), contiguous, one device."""
    return (triton is not None and keys.shape[2] <= MAX_SLOTS and bias.dtype == score.dtype == torch.float32
            and slot_pos.dtype == fill.dtype == budget.dtype == torch.int64 and values.dtype == keys.dtype
            and values.shape == keys.shape
            and all(t.is_contiguous() for t in (keys, values, bias, slot_pos, fill, score))
            and len({t.device for t in (keys, values, bias, slot_pos, fill, budget, score)}) == 1)


def triton_evict_by_score(keys, values, bias, slot_pos, fill, budget, score, n_recent: int, recent_ratio: float = 0.0,
                          pool: int = 1, reset_score: bool = False, *, select_chunk: int | None = None,
                          move_slots: int | None = None, move_columns: int | None = None,
                          select_warps: int | None = None, move_warps: int = 8) -> None:
    """Launch the three kernels (module docstring). The keyword arguments tune them (powers of two; defaults
    SELECT_CHUNK, MOVE_SLOTS, MOVE_COLUMNS, warps by C); every value gives the same result. Under
    TRITON_INTERPRET=1 it runs on CPU tensors, which is how the kernels are tested without a GPU."""
    if triton is None:
        raise NotImplementedError("triton_evict_by_score needs Triton (pip install triton)")
    name = "triton_evict_by_score"
    B, H, C, D = _check_state(name, keys, values, bias, slot_pos, fill, budget)
    _check_inputs(keys, bias, score, n_recent, recent_ratio, pool)
    if not score.is_contiguous() or score.device != keys.device:
        raise ValueError(f"{name}: score must be contiguous and on {keys.device}, like keys")
    if C > MAX_SLOTS:
        raise ValueError(f"{name}: C = {C} slots; the kernels take C <= {MAX_SLOTS}")
    rows = B * H
    if rows == 0 or C == 0:
        return
    block = triton.next_power_of_2(C)
    dev = keys.device
    ws = torch.empty(5, rows, C, dtype=torch.int32, device=dev)  # the select kernel's row scratch
    sor, scr, bir, keyp, src = ws[0], ws[1].view(torch.float32), ws[2].view(torch.float32), ws[3], ws[4]
    por = torch.empty(rows, C, dtype=torch.int64, device=dev)
    info = torch.empty(rows, 2, dtype=torch.int32, device=dev)
    _evict_select_kernel[(rows,)](bias, slot_pos, score, fill, budget, sor, scr, bir, por, keyp, src, info, C, n_recent,
                                  _bits(recent_ratio), POOL=pool, RESET=bool(reset_score), BLOCK=block,
                                  CHUNK=min(block, select_chunk or SELECT_CHUNK),
                                  num_warps=select_warps or _select_warps(block))
    bs = min(move_slots or MOVE_SLOTS, block)
    ds = min(move_columns or MOVE_COLUMNS, triton.next_power_of_2(D))
    nslice = triton.cdiv(D, ds)
    stage_k = torch.empty_like(keys)  # of each block only the halo is written and read
    stage_v = torch.empty_like(values)
    grid = (triton.cdiv(C, bs), rows, 2 * nslice)
    for kernel in (_evict_stage_kernel, _evict_move_kernel):
        kernel[grid](keys, values, stage_k, stage_v, src, info, C, D, BLOCK_S=bs, DS=ds, NSLICE=nslice,
                     num_warps=move_warps)


# -- op registration ---------------------------------------------------------------------------------
_WARNED = set()  # the C of states the CUDA path ran the tensor code for (warned once each)


@torch.library.custom_op("kvrewrite::evict_by_score",
                         mutates_args=("keys", "values", "bias", "slot_pos", "fill", "score"))
def evict_by_score(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    budget: torch.Tensor,
    score: torch.Tensor,
    n_recent: int,
    recent_ratio: float = 0.0,
    pool: int = 1,
    reset_score: bool = False,
) -> None:
    """Recent window + top older slots by (pooled) score, for the rows at the threshold (module docstring)."""
    _check_inputs(keys, bias, score, n_recent, recent_ratio, pool)
    reference_evict_by_score(keys, values, bias, slot_pos, fill, budget, score, n_recent, recent_ratio, pool,
                             reset_score)


@evict_by_score.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, score, n_recent, recent_ratio=0.0, pool=1, reset_score=False):
    args = (keys, values, bias, slot_pos, fill, budget, score, n_recent, recent_ratio, pool, reset_score)
    _check_inputs(keys, bias, score, n_recent, recent_ratio, pool)
    if supports_triton(keys, values, bias, slot_pos, fill, budget, score):
        triton_evict_by_score(*args)
        return
    if triton is not None and keys.shape[2] not in _WARNED:
        _WARNED.add(keys.shape[2])
        logger.warning("evict_by_score: no Triton kernel for this state (C=%d, at most %d; or its dtypes or "
                       "layout); running the tensor code", keys.shape[2], MAX_SLOTS)
    reference_evict_by_score(*args)


@evict_by_score.register_fake
def _(keys, values, bias, slot_pos, fill, budget, score, n_recent, recent_ratio=0.0, pool=1, reset_score=False):
    return None
