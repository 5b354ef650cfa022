"""kvrewrite::evict_by_score — keep a recent window plus the highest-scoring older slots, drop the rest.

The compression of H2O (https://arxiv.org/abs/2306.14048: heavy hitters by accumulated attention +
recent tokens) and SnapKV (https://arxiv.org/abs/2404.14469: the observation window + the top pooled
scores of the window's attention). The score is method state, filled by kvrewrite::accumulate_attention.

Temporal order is an index, not the layout. `order` [B, Hkv, C] int32 lists each row's slots oldest first: the
r-th oldest slot of a row is physical slot r + order[r] (a delta, so the zeroed state is the identity, and the slots
cache_append writes at `fill` are in order with no write here: ranks >= fill always have delta 0). On the row
viewed through `order` (bias, score, slot_pos of rank r), for every row (b, kv-head) whose fill reached the
threshold (budget = [target B, threshold]):

1. its valid ranks (rank < fill, bias > -inf; padding slots are dropped), oldest first; L of them. A row with
   L <= B keeps them all (only the padding goes);
2. otherwise R = min(n_recent + floor(recent_ratio * B), B) most recent valid ranks are kept, and among the L - R
   older ones the B - R with the highest score, where the score is first max-pooled over a window of `pool`
   neighbouring older ranks (the window clipped at both ends; pool = 1: the raw score). Ties go to the earlier
   rank;
3. compaction, K = the slots kept: the kept slots already below K stay where they are; those at or past
   K move (keys, values, bias, slot_pos, score) into the slots below K that are not kept (the holes), the j-th
   such slot in slot order into the j-th hole. `order` then lists the kept slots' new places for ranks < K (still
   oldest first) and delta 0 for ranks >= K; slots >= K are freed: bias -inf, score 0 (keys, values and slot_pos
   stay as they are); fill = K. With reset_score every score of the row restarts at 0 (SnapKV's window restarts).

So the row viewed through the new `order` holds exactly what packing the kept slots in temporal order would
(the op's layout before `order` existed; tests/kernels/evict_by_score_naive.py keeps that rule): the same kept set
and contents, bit for bit. At most min(K, fill - K) slots' keys and values move, never more than the slots
evicted: a call that drops few slots moves few (docs/methods.md, "At large batches the compaction ..."). Rows below
the threshold are untouched (bit for bit).

State (mutated): keys, values [B, Hkv, C, D]; bias, slot_pos [B, Hkv, C]; fill [B, Hkv]; score [B, Hkv, C] fp32;
order [B, Hkv, C] int32. budget: [2] int64. Args: n_recent (int >= 0), recent_ratio (float in [0, 1]), pool (odd
int >= 1), reset_score (bool).

Backends. The reference (static-shape tensor code: the view by gathers, ranks by cumsum, a stable sort for the top
scores, scatter/gather compaction) is the CPU path and the ground truth. CUDA runs the Triton kernels below
(supports_triton: the state's usual dtypes, contiguous; otherwise the reference), which leave the
same state bit for bit. Neither reads anything on the host and the launches depend on shapes only, so CUDA graphs
capture both (torch.compile mode="reduce-overhead"). The op stays a `custom_op` (opaque to Inductor) whose CUDA
kernel launches Triton directly, as chelsea_compress does: a `triton_op` failed under torch 2.11's Inductor
(docs/methods.md).

Triton kernels (2 launches). The tensor code sorts every row and gathers the whole layer's keys and values through
a temporary copy. Here only the keys and values that move are read and written, once; the selection runs in one
program per row and touches O(C) int32/fp32 metadata.

1. select, grid rows (a row not due returns at once). A chunked pass over the ranks reads each one's slot from
   `order`, then its bias and score there; a cumsum ranks the valid ones and copies slot, rank and score of each
   valid rank to row scratch (so the state can then be rewritten in place). Scores become
   int32 order keys (the fp32 bits made monotone; -0.0 keys as +0.0 and every NaN as one value above +inf, as the
   reference's max pooling and stable sort treat them), max-pooled over the older ranks. The threshold of the
   B - R largest comes from a bisection over the key values, the older keys in registers: one count (one
   reduction) per step, stopping as soon as a count hits B - R exactly, ~log2 of the key range around the threshold
   steps (13-17 on random scores, at most 32). Four 256-bin histogram rounds (8 bits of the key each) gave the same
   thresholds but ran 1.24-1.6x slower on an H200 (dropped; docs/bench.md "Stop 52 runs"), and a bitonic sort takes
   ~log2(C)^2 / 2 passes. Ties at the threshold are ranked by a cumsum, to the earlier rank as the stable sort does; at
   a threshold of -inf the row's other ranks count too (the reference ranks them at -inf). A cumsum over the kept ranks
   gives their new ranks, NEW[slot] (-1: not kept), and K; score 0 with reset. Then two passes over the slots: below K,
   a kept slot's rank gets its `order` entry and the others are listed in slot order as the holes (HOLE); in [K, fill),
   the kept slots (the movers) each take the next hole: bias, slot_pos and score copied there, `order` of its rank, and
   MSRC[j] = its slot for the move. Then the freed slots [K, C), fill, and INFO[row] = the moves.
2. move, grid (blocks of MOVE_SLOTS moves, rows, MOVE_COLUMNS-column slices of keys and of values): move j copies
   slot MSRC[j] to HOLE[j]. The sources lie at or past K, the destinations below: disjoint, so every program runs
   at once, in place, with no staging. At most min(K, C - K) <= C / 2 moves a row: the grid covers C / 2.
   Traffic: 4 D bytes read and written per moved slot at bf16 (keys and values), e.g. Llama-3.1-8B (Hkv 8,
   D 128, C ~6.6k), 32 slots out per row: at most 16 KB read and 16 KB written a row, where packing in order moved
   up to ~3.4 MB (every slot after the first evicted one).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import struct

import torch
import torch.nn.functional as F

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels._slot_kernels import _check_state
from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference; only triton_evict_by_score raises
    triton = tl = None

NEG_INF = float("-inf")


def _check_inputs(keys, bias, score, order, n_recent, recent_ratio, pool):
    name = "kvrewrite::evict_by_score"
    B, H, C, _ = keys.shape
    if tuple(score.shape) != (B, H, C) or score.dtype != torch.float32:
        raise ValueError(f"{name}: score must be fp32 [B, Hkv, C] = {(B, H, C)}, "
                         f"got {score.dtype} {tuple(score.shape)}")
    if tuple(order.shape) != (B, H, C) or order.dtype != torch.int32:
        raise ValueError(f"{name}: order must be int32 [B, Hkv, C] = {(B, H, C)} (slot of the r-th oldest minus r), "
                         f"got {order.dtype} {tuple(order.shape)}")
    if tuple(bias.shape) != (B, H, C):
        raise ValueError(f"{name}: bias must be [B, Hkv, C] = {(B, H, C)}, got {tuple(bias.shape)}")
    if n_recent < 0 or not 0 <= recent_ratio <= 1:
        raise ValueError(f"{name}: n_recent must be >= 0 and recent_ratio in [0, 1], got {n_recent}, {recent_ratio}")
    if pool < 1 or pool % 2 == 0:
        raise ValueError(f"{name}: pool must be an odd int >= 1 (1: no pooling), got {pool}")


def kept_slots(bias, fill, budget, score, n_recent: int, recent_ratio: float, pool: int):
    """The selection of evict_by_score on rows in temporal order (bias and score of rank r at r): (due [B, H], keep
    [B, H, C] bool by rank) for every row, due or not."""
    B, H, C = bias.shape
    ar = torch.arange(C, device=bias.device)
    target = budget[0]
    due = fill >= budget[1]
    valid = (ar < fill[..., None]) & (bias > NEG_INF)
    L = valid.sum(dim=-1, keepdim=True)
    rank = valid.long().cumsum(dim=-1) - 1  # rank among the valid slots, oldest first
    recent = torch.minimum(n_recent + torch.floor(recent_ratio * target.double()).long(), target)
    n_old = (L - recent).clamp_min(0)
    old = valid & (rank < n_old)
    s = score.masked_fill(~old, NEG_INF)
    if pool > 1:  # max-pool the older slots' scores in temporal order (the padding and recent slots are -inf)
        dest = torch.where(old, rank, C)
        packed = torch.full((B, H, C + 1), NEG_INF, device=bias.device).scatter(-1, dest, s)[..., :C]
        pooled = F.max_pool1d(packed.reshape(B * H, 1, C), pool, stride=1, padding=pool // 2).view(B, H, C)
        s = pooled.gather(-1, rank.clamp(0, C - 1)).masked_fill(~old, NEG_INF)
    ranked = torch.sort(s, dim=-1, descending=True, stable=True).indices  # ties: the earlier rank first
    place = torch.empty_like(ranked).scatter_(-1, ranked, ar.expand(B, H, C))
    keep = valid & ((rank >= n_old) | (place < target - recent))
    return due, torch.where(L > target, keep, valid)


def temporal_slots(order):
    """[B, H, C] int64: the physical slot of each temporal rank (rank r + order[r])."""
    return torch.arange(order.shape[-1], device=order.device) + order.long()


def _packed(ar, mask):
    """[B, H, C]: at j, the slot index of the j-th True of `mask` (in slot order); past their count, 0."""
    B, H, C = mask.shape
    dest = torch.where(mask, mask.long().cumsum(dim=-1) - 1, C + ar)
    return torch.zeros(B, H, 2 * C, dtype=torch.long, device=mask.device).scatter(-1, dest, ar.expand(B, H, C))[..., :C]


def _gathered(x, index):
    """x.gather(2, index) through an integer view of x's bits: CPU gathers of bf16 rewrite NaN payloads, and a
    slot that stays (or moves) must keep its bits exactly."""
    if not x.dtype.is_floating_point:
        return x.gather(2, index)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.view(bits).gather(2, index).view(x.dtype)


def reference_evict_by_score(keys, values, bias, slot_pos, fill, budget, score, order, n_recent, recent_ratio, pool,
                             reset_score):
    """The CPU path and the ground truth: the selection on the temporal view, then the holes below the kept count
    filled by the kept slots past it, by one gather per state tensor."""
    B, H, C, D = keys.shape
    ar = torch.arange(C, device=keys.device)
    slot = temporal_slots(order)
    due, keep = kept_slots(bias.gather(2, slot), fill, budget, score.gather(2, slot), n_recent, recent_ratio, pool)
    keep = keep & due[..., None]  # by temporal rank
    n_kept = keep.sum(dim=-1, keepdim=True)
    kept_at = torch.zeros_like(keep).scatter(2, slot, keep)  # by slot
    hole = (ar < n_kept) & ~kept_at
    mover = (ar >= n_kept) & kept_at
    # the j-th mover (slot order) goes to the j-th hole: new place of every slot, source of every slot
    to_hole = _packed(ar, hole).gather(2, (mover.long().cumsum(dim=-1) - 1).clamp_min(0))
    place = torch.where(mover, to_hole, ar)
    src = torch.cat([ar, ar]).expand(B, H, 2 * C).scatter(-1, torch.where(mover, to_hole, C + ar),
                                                          ar.expand(B, H, C))[..., :C]
    # order: the j-th kept rank's new place minus j for j < K, 0 past it (rows not due keep theirs)
    new_rank = torch.where(keep, keep.long().cumsum(dim=-1) - 1, C + ar)
    delta = place.gather(2, slot) - new_rank
    new_order = torch.zeros(B, H, 2 * C, dtype=torch.long, device=keys.device).scatter(-1, new_rank, delta)[..., :C]
    freed = due[..., None] & (ar >= n_kept)
    src4 = src[..., None].expand(B, H, C, D)
    keys.copy_(_gathered(keys, src4))
    values.copy_(_gathered(values, src4))
    slot_pos.copy_(slot_pos.gather(2, src))
    bias.copy_(_gathered(bias, src).masked_fill(freed, NEG_INF))
    moved = _gathered(score, src).masked_fill(freed, 0.0)
    score.copy_(moved.masked_fill(due[..., None], 0.0) if reset_score else moved)
    order.copy_(torch.where(due[..., None], new_order, order.long()))
    fill.copy_(torch.where(due, n_kept[..., 0], fill))


# -- Triton kernels ----------------------------------------------------------------------------------
MAX_SLOTS = 32768  # rows up to this hold their keys in registers for the selection; longer ones read them in chunks
SELECT_CHUNK = 4096  # slots per block of the select kernel's chunked passes (a power of two)
MOVE_SLOTS = 128  # moves per program of the move kernel (a power of two)
MOVE_COLUMNS = 64  # head-dim columns per program of the move kernel (a power of two)
MOVE_WARPS = 4

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


@triton_jit()
def _chunk_keys(KEYS, j0, n_old, CH: tl.constexpr, POOLED: tl.constexpr):
    """Keys [j0, j0 + CH) of _kth_largest_chunked's row, -inf's key past n_old."""
    j = j0 + tl.arange(0, CH)
    if POOLED:
        return tl.load(KEYS + j, mask=j < n_old, other=_KEY_NEG_INF)
    return _order_key(tl.load(KEYS + j, mask=j < n_old, other=float("-inf")))


@triton_jit()
def _kth_largest_chunked(KEYS, n_old, K, lanes, CH: tl.constexpr, POOLED: tl.constexpr):
    """_kth_largest(KEYS, n_old, K, S=lanes) for rows of any length: the same (thr, need, n_eq) and the same
    bisection, the keys read from memory CH at a time for each of its counts instead of held in registers (a row
    longer than the lanes one program holds: EMS's slot table past MAX_SLOTS). As there, n_eq counts the lanes past
    n_old (keys of -inf) when thr is -inf's key."""
    n_above = tl.zeros([], tl.int32)
    lo32 = tl.full([], _I32_MAX, tl.int32)
    hi32 = tl.full([], _KEY_NEG_INF, tl.int32)
    for j0 in range(0, n_old, CH):
        key = _chunk_keys(KEYS, j0, n_old, CH, POOLED)
        above = key > _KEY_NEG_INF
        c_above, c_lo, c_hi = tl.reduce((above.to(tl.int32), tl.where(above, key, _I32_MAX), key), 0, _add_min_max)
        n_above += c_above
        lo32 = tl.minimum(lo32, c_lo)
        hi32 = tl.maximum(hi32, c_hi)
    thr = tl.full([], _KEY_NEG_INF, tl.int32)
    if n_above >= K:
        lo = lo32.to(tl.int64)
        hi = hi32.to(tl.int64)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            cnt = tl.zeros([], tl.int32)
            for j0 in range(0, n_old, CH):
                key = _chunk_keys(KEYS, j0, n_old, CH, POOLED)
                cnt += tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
            if cnt == K:
                least = tl.full([], _I32_MAX, tl.int32)
                for j0 in range(0, n_old, CH):
                    key = _chunk_keys(KEYS, j0, n_old, CH, POOLED)
                    least = tl.minimum(least, tl.min(tl.where(key >= mid.to(tl.int32), key, _I32_MAX), axis=0))
                lo = least.to(tl.int64)
                hi = lo
            elif cnt > K:
                lo = mid
            else:
                hi = mid - 1
        thr = lo.to(tl.int32)
    n_gt = tl.zeros([], tl.int32)
    n_eq = tl.where(thr == _KEY_NEG_INF, lanes - n_old, 0).to(tl.int32)  # the lanes past n_old
    for j0 in range(0, n_old, CH):
        key = _chunk_keys(KEYS, j0, n_old, CH, POOLED)
        old = (j0 + tl.arange(0, CH)) < n_old
        c_gt, c_eq = tl.reduce(((key > thr).to(tl.int32), (old & (key == thr)).to(tl.int32)), 0, _add_add)
        n_gt += c_gt
        n_eq += c_eq
    return thr, K - n_gt, n_eq


@triton_jit(do_not_specialize=["n_recent", "ratio_bits"])
def _evict_select_kernel(BIAS, POS, SCORE, ORDER, FILL, BUDGET, SOR, TOR, SCR, KEYP, NEW, HOLE, MSRC, INFO, C,
                         n_recent, ratio_bits, POOL: tl.constexpr, RESET: tl.constexpr, BLOCK: tl.constexpr,
                         CHUNK: tl.constexpr, CHUNKED: tl.constexpr):
    """Launch 1 (grid: rows): a due row's selection, its metadata, order and fill; INFO[row] = the moves (0 for a
    row not due). Row scratch [C], by valid rank: SOR slot, TOR temporal rank, SCR score, KEYP pooled key; by slot:
    NEW the kept slot's new rank (-1: not kept); by move: HOLE destination, MSRC source."""
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    # the first chunk of order goes out with fill's load (a row not due wastes it); each later one during the last
    s0 = tl.arange(0, CHUNK)
    od_next = tl.load(ORDER + base + s0, mask=s0 < C, other=0)
    fill = tl.load(FILL + row)
    n_moves = tl.zeros([], tl.int32)
    if fill >= tl.load(BUDGET + 1):
        # -- the row through order: rank the valid slots, copy slot, rank and score out by valid rank
        n_fill = tl.minimum(fill, C).to(tl.int32)
        L = tl.zeros([], tl.int32)
        for c0 in range(0, n_fill, CHUNK):
            r = c0 + s0
            m = r < n_fill
            slot = r + od_next
            r_next = r + CHUNK
            od_next = tl.load(ORDER + base + r_next, mask=r_next < n_fill, other=0)
            bb = tl.load(BIAS + base + slot, mask=m, other=float("-inf"))
            sc = tl.load(SCORE + base + slot, mask=m, other=0.0)
            tl.store(NEW + base + slot, tl.full([CHUNK], -1, tl.int32), mask=m)
            valid = m & (bb > float("-inf"))
            vi = valid.to(tl.int32)
            rank = L + tl.cumsum(vi, axis=0) - vi
            tl.store(SOR + base + rank, slot, mask=valid)
            tl.store(TOR + base + rank, r, mask=valid)
            tl.store(SCR + base + rank, sc, mask=valid)
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
            # -- the K-th largest key (the search runs over the smallest power of two >= n_old lanes; CHUNKED: a row
            # past MAX_SLOTS, its keys read from memory CHUNK at a time)
            if CHUNKED:
                thr, need, n_eq = _kth_largest_chunked(KEYS, n_old, K, BLOCK, CHUNK, POOL > 1)
            elif BLOCK >= 64:
                if n_old <= BLOCK // 4:
                    thr, need, n_eq = _kth_largest(KEYS, n_old, K, BLOCK // 4, POOL > 1)
                elif n_old <= BLOCK // 2:
                    thr, need, n_eq = _kth_largest(KEYS, n_old, K, BLOCK // 2, POOL > 1)
                else:
                    thr, need, n_eq = _kth_largest(KEYS, n_old, K, BLOCK, POOL > 1)
            else:
                thr, need, n_eq = _kth_largest(KEYS, n_old, K, BLOCK, POOL > 1)
        # -- the kept ranks in order: new ranks by cumsum. Ties at thr go to the earlier rank: a slot's rank among
        # the row's key == thr ranks decides, unless all of them are kept (distinct scores). At thr = -inf those are
        # all ranks but the older ones above -inf, so it is the temporal rank less those before it (the padding
        # and recent ranks count there too, as in the reference's sort: fewer than B may then be kept).
        at_neg = thr == _KEY_NEG_INF
        every_tie = (need == n_eq) & (thr != _KEY_NEG_INF)
        carry = tl.zeros([], tl.int32)
        n_kept = tl.zeros([], tl.int32)
        for c0 in range(0, L, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            ranked = j < L
            old = j < n_old
            if POOL > 1:
                k = tl.load(KEYP + base + j, mask=old, other=_KEY_NEG_INF)
            else:
                k = _order_key(tl.load(SCR + base + j, mask=old, other=float("-inf")))
            slot = tl.load(SOR + base + j, mask=ranked, other=0)
            if every_tie:
                flag = tl.zeros([CHUNK], tl.int32)
                keep = ranked & ((j >= n_old) | (k >= thr))
            else:
                flag = tl.where(at_neg, old & (k > _KEY_NEG_INF), old & (k == thr)).to(tl.int32)
                before = carry + tl.cumsum(flag, axis=0) - flag
                tie_rank = tl.where(at_neg, tl.load(TOR + base + j, mask=ranked & at_neg, other=0) - before, before)
                keep = ranked & ((j >= n_old) | (k > thr) | ((k == thr) & (tie_rank < need)))
            ki = keep.to(tl.int32)
            new = n_kept + tl.cumsum(ki, axis=0) - ki
            tl.store(NEW + base + slot, new, mask=keep)
            if RESET:
                tl.store(SCORE + base + slot, tl.zeros([CHUNK], tl.float32), mask=keep)
            n_add, f_add = tl.reduce((ki, flag), 0, _add_add)
            n_kept += n_add
            carry += f_add
        tl.debug_barrier()
        # -- slots below n_kept: a kept one stays (its rank's order entry), the others are the holes, in slot order
        n_holes = tl.zeros([], tl.int32)
        for c0 in range(0, n_kept, CHUNK):
            d = c0 + s0
            new = tl.load(NEW + base + d, mask=d < n_kept, other=0)
            tl.store(ORDER + base + new, d - new, mask=(d < n_kept) & (new >= 0))
            hole = (d < n_kept) & (new < 0)
            hi = hole.to(tl.int32)
            tl.store(HOLE + base + n_holes + tl.cumsum(hi, axis=0) - hi, d, mask=hole)
            n_holes += tl.sum(hi, axis=0)
        tl.debug_barrier()
        # -- the movers: kept slots in [n_kept, fill), the j-th into the j-th hole (metadata here, keys and values
        # in launch 2); the holes lie below n_kept, the sources past it, so no read sees a write of this pass
        for c0 in range(n_kept, n_fill, CHUNK):
            src = c0 + s0
            new = tl.load(NEW + base + src, mask=src < n_fill, other=-1)
            mover = new >= 0
            mi = mover.to(tl.int32)
            jm = n_moves + tl.cumsum(mi, axis=0) - mi
            dst = tl.load(HOLE + base + jm, mask=mover, other=0)
            tl.store(MSRC + base + jm, src, mask=mover)
            tl.store(BIAS + base + dst, tl.load(BIAS + base + src, mask=mover), mask=mover)
            tl.store(POS + base + dst, tl.load(POS + base + src, mask=mover), mask=mover)
            if RESET:
                tl.store(SCORE + base + dst, tl.zeros([CHUNK], tl.float32), mask=mover)
            else:
                tl.store(SCORE + base + dst, tl.load(SCORE + base + src, mask=mover), mask=mover)
            tl.store(ORDER + base + new, dst - new, mask=mover)
            n_moves += tl.sum(mi, axis=0)
        tl.debug_barrier()
        # -- freed slots [n_kept, C): bias -inf, score 0, order delta 0 (keys, values and slot_pos stay); fill
        for c0 in range(n_kept, C, CHUNK):
            j = c0 + s0
            tl.store(BIAS + base + j, tl.full([CHUNK], float("-inf"), tl.float32), mask=j < C)
            tl.store(SCORE + base + j, tl.zeros([CHUNK], tl.float32), mask=j < C)
            tl.store(ORDER + base + j, tl.zeros([CHUNK], tl.int32), mask=j < C)
        tl.store(FILL + row, n_kept.to(tl.int64))
    tl.store(INFO + row, n_moves)


@triton_jit()
def _evict_move_kernel(K, V, MSRC, HOLE, INFO, C, D, BLOCK_S: tl.constexpr, DS: tl.constexpr, NSLICE: tl.constexpr):
    """Launch 2, grid (move blocks, rows, 2 * NSLICE): moves [BLOCK_S * b, +BLOCK_S) of the row, columns
    [DS * (p % NSLICE), +DS) of keys (p < NSLICE) or values: slot MSRC[j] to slot HOLE[j]. Sources (>= the kept
    count) and destinations (below it) are disjoint, so the programs need no order among them."""
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2)
    n_moves = tl.load(INFO + row)
    if blk * BLOCK_S < n_moves:
        j = blk * BLOCK_S + tl.arange(0, BLOCK_S)
        m = j < n_moves
        src = tl.load(MSRC + row * C + j, mask=m, other=0).to(tl.int64)
        dst = tl.load(HOLE + row * C + j, mask=m, other=0).to(tl.int64)
        cols = (p % NSLICE) * DS + tl.arange(0, DS)
        if p < NSLICE:
            X = K
        else:
            X = V
        base = row * C * D
        mm = m[:, None] & (cols < D)[None, :]
        x = tl.load(X + base + src[:, None] * D + cols[None, :], mask=mm)
        tl.store(X + base + dst[:, None] * D + cols[None, :], x, mask=mm)


# -- launcher ----------------------------------------------------------------------------------------
def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _select_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def supports_triton(keys, values, bias, slot_pos, fill, budget, score, order) -> bool:
    """Whether the CUDA path runs triton_evict_by_score: Triton installed, the state's dtypes (bias and score fp32,
    slot_pos, fill and budget int64, order int32), contiguous, one device. Any C (past MAX_SLOTS the selection's
    bisection reads the keys in chunks)."""
    state = (keys, values, bias, slot_pos, fill, budget, score, order)
    return (triton is not None and bias.dtype == score.dtype == torch.float32
            and slot_pos.dtype == fill.dtype == budget.dtype == torch.int64 and order.dtype == torch.int32
            and values.dtype == keys.dtype and values.shape == keys.shape
            and all(t.is_contiguous() for t in state) and len({t.device for t in state}) == 1)


def triton_evict_by_score(keys, values, bias, slot_pos, fill, budget, score, order, n_recent: int,
                          recent_ratio: float = 0.0, pool: int = 1, reset_score: bool = False, *,
                          select_chunk: int | None = None, move_slots: int | None = None,
                          move_columns: int | None = None, select_warps: int | None = None,
                          move_warps: int | None = None, chunked_select: bool | None = None) -> None:
    """Launch the two kernels (module docstring). The keyword arguments tune them (powers of two; defaults
    SELECT_CHUNK, MOVE_SLOTS, MOVE_COLUMNS, MOVE_WARPS, select warps by C; chunked_select, default C past MAX_SLOTS:
    the K-th largest key by _kth_largest_chunked); every value gives the same result.
    Under TRITON_INTERPRET=1 it runs on CPU tensors, which is how the kernels are tested without a GPU."""
    if triton is None:
        raise NotImplementedError("triton_evict_by_score needs Triton (pip install triton)")
    name = "triton_evict_by_score"
    B, H, C, D = _check_state(name, keys, values, bias, slot_pos, fill, budget)
    _check_inputs(keys, bias, score, order, n_recent, recent_ratio, pool)
    if not (score.is_contiguous() and order.is_contiguous()) or {score.device, order.device} != {keys.device}:
        raise ValueError(f"{name}: score and order must be contiguous and on {keys.device}, like keys")
    rows = B * H
    if rows == 0 or C == 0:
        return
    block = triton.next_power_of_2(C)
    dev = keys.device
    ws = torch.empty(7, rows, C, dtype=torch.int32, device=dev)  # the select kernel's row scratch
    sor, tor, scr, keyp, new, hole, msrc = ws[0], ws[1], ws[2].view(torch.float32), ws[3], ws[4], ws[5], ws[6]
    info = torch.empty(rows, dtype=torch.int32, device=dev)
    _evict_select_kernel[(rows,)](bias, slot_pos, score, order, fill, budget, sor, tor, scr, keyp, new, hole, msrc,
                                  info, C, n_recent, _bits(recent_ratio), POOL=pool, RESET=bool(reset_score),
                                  BLOCK=block, CHUNK=min(block, select_chunk or SELECT_CHUNK),
                                  CHUNKED=block > MAX_SLOTS if chunked_select is None else chunked_select,
                                  num_warps=select_warps or _select_warps(min(block, MAX_SLOTS)))
    most = max(1, C // 2)  # moves a row: at most min(kept, C - kept)
    bs = min(move_slots or MOVE_SLOTS, triton.next_power_of_2(most))
    ds = min(move_columns or MOVE_COLUMNS, triton.next_power_of_2(D))
    nslice = triton.cdiv(D, ds)
    _evict_move_kernel[(triton.cdiv(most, bs), rows, 2 * nslice)](keys, values, msrc, hole, info, C, D, BLOCK_S=bs,
                                                                 DS=ds, NSLICE=nslice,
                                                                 num_warps=move_warps or MOVE_WARPS)


# -- op registration ---------------------------------------------------------------------------------


@torch.library.custom_op("kvrewrite::evict_by_score",
                         mutates_args=("keys", "values", "bias", "slot_pos", "fill", "score", "order"))
def evict_by_score(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    budget: torch.Tensor,
    score: torch.Tensor,
    order: torch.Tensor,
    n_recent: int,
    recent_ratio: float = 0.0,
    pool: int = 1,
    reset_score: bool = False,
) -> None:
    """Recent window + top older slots by (pooled) score, for the rows at the threshold (module docstring)."""
    _check_inputs(keys, bias, score, order, n_recent, recent_ratio, pool)
    reference_evict_by_score(keys, values, bias, slot_pos, fill, budget, score, order, n_recent, recent_ratio, pool,
                             reset_score)


@evict_by_score.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, score, order, n_recent, recent_ratio=0.0, pool=1,
      reset_score=False):
    args = (keys, values, bias, slot_pos, fill, budget, score, order, n_recent, recent_ratio, pool, reset_score)
    _check_inputs(keys, bias, score, order, n_recent, recent_ratio, pool)
    if supports_triton(keys, values, bias, slot_pos, fill, budget, score, order):
        triton_evict_by_score(*args)
        return
    if triton is not None:
        reference_fallback("evict_by_score: no Triton kernel for this state (its dtypes or layout: C=%d, keys %s, "
                           "score %s, order %s); running the tensor code", keys.shape[2], keys.dtype, score.dtype,
                           order.dtype)
    reference_evict_by_score(*args)


@evict_by_score.register_fake
def _(keys, values, bias, slot_pos, fill, budget, score, order, n_recent, recent_ratio=0.0, pool=1,
      reset_score=False):
    return None
