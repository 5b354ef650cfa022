"""kvrewrite::clustered_attention's prefill kernels: many queries (a prefill chunk) over a layer's slots.

The decode kernel (clustered_attention.py) walks every slot of its range and tests each tile's positions on
the way. A prefill chunk's query block needs far fewer of its tiles' tests: slots are appended in position
order (cache_append), so the block sees none of the fresh slots after its last query and none of the empty
slots after the fill, and every query of the block sees every live slot of the old tiles. Two kernels:

1. `_tile_ranges_kernel`: per (row b, KV head h, tile of BLOCK_N slots) the least and the greatest position
   of the tile's live slots (bias > -inf); an empty tile gets (EMPTY_MIN, EMPTY_MAX), a range no query meets.
   Read once per call (12 bytes a slot), where the slot loop of every query block would otherwise reduce
   each tile's positions again.
2. `_prefill_attention_kernel`: one program per (query block, b, h); the query blocks of one (b, h) are
   neighbours in the grid, so the programs running at once share their K/V in L2. It bounds its tile loop
   by the ranges (the first and last tile some query of the block sees; tiles in between that it does
   not see still run and add exact zeros) and applies the per-element causal and window masks only in
   tiles that some query of the block does not see whole (the diagonal of the fresh block, a window's
   edge): elsewhere an empty slot's bias -inf is the only mask needed.

The result is the decode kernel's, slot for slot: the same online softmax in base 2, the same degree bias
and soft cap, zeros for a query that sees nothing. Nothing here assumes the layout for correctness: a tile
is skipped only when its range shows that no query of the block sees it, and the masks run wherever the
range does not show that every query sees it, so slots in any order give the same output (more tiles
masked and walked). clustered_attention.launch_forward picks these kernels for prefill-sized blocks whose grid
needs no split (its PREFILL_KERNEL and PREFILL_SPLIT_GRIDS say when, and what they measured). Tests:
tests/kernels/test_prefill_attention_triton.py (Triton's interpreter, against float64) and
tests/kernels/test_prefill_attention_gpu.py.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite.kernels import _ordered_prefill_kernels as _ordered
from kvrewrite.kernels import _pdl
from kvrewrite.kernels._online_softmax import softmax_tile, store_rows
from kvrewrite.kernels._pdl import gdc_launch_dependents, gdc_wait
from kvrewrite.kernels._query_block import block_rows, query_block
from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs import this module too; only launching needs Triton
    triton = tl = None
try:
    from triton.language.extra import libdevice  # tanh for SOFTCAP (clustered_attention.py says why this name)
except ImportError:
    libdevice = None

# an empty tile's range (int64): no query position reaches EMPTY_MIN, so no query sees the tile, and every one is
# past EMPTY_MAX, so the tile counts as seen whole (its slots' bias -inf masks them). The kernels spell the values
# out: a Triton kernel reads no plain global.
EMPTY_MIN, EMPTY_MAX = 2**62, -(2**62)


@triton_jit(do_not_specialize=["Hkv", "C", "n_tiles"])
def _tile_ranges_kernel(
    BIAS, POS,  # fp32 and int64 [B, Hkv, C]
    RANGES,  # int64 [B * Hkv, n_tiles, 2], out: (least, greatest) position of each tile's live slots
    ORDER,  # int64 [B * Hkv, 2] (ORDER_STATS only): minima of position - index and index - position, live slots
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    Hkv, C, n_tiles,
    BLOCK_N: tl.constexpr,  # slots of a tile (the attention kernel's)
    TILES: tl.constexpr,  # tiles of a program
    PDL: tl.constexpr,
    ORDER_STATS: tl.constexpr = False,  # for the ordered kernel's routing (_ordered_prefill_kernels.py)
):
    if PDL:  # the bias and positions come from the append just before
        gdc_wait()
        gdc_launch_dependents()
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    tiles = pid_t * TILES + tl.arange(0, TILES)
    offs = tiles[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    ok = offs < C
    bias = tl.load(BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh + offs * stride_bc, mask=ok,
                   other=float("-inf"))
    pos = tl.load(POS + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph + offs * stride_pc, mask=ok, other=0)
    live = bias > float("-inf")
    least = tl.min(tl.where(live, pos, 2**62), axis=1)
    greatest = tl.max(tl.where(live, pos, -(2**62)), axis=1)
    out = RANGES + (bh.to(tl.int64) * n_tiles + tiles) * 2
    t_ok = tiles < n_tiles
    tl.store(out, least, mask=t_ok)
    tl.store(out + 1, greatest, mask=t_ok)
    if ORDER_STATS:  # the row is ordered (slot j holds position j + delta) iff both minima sum to 0
        d = pos - offs
        d_min = tl.min(tl.min(tl.where(live, d, 2**61), axis=1), axis=0)
        d_neg = tl.min(tl.min(tl.where(live, -d, 2**61), axis=1), axis=0)
        if d_min < 2**61:  # integer minima: the order of the atomics does not matter
            tl.atomic_min(ORDER + bh.to(tl.int64) * 2, d_min)
            tl.atomic_min(ORDER + bh.to(tl.int64) * 2 + 1, d_neg)


@triton_jit()
def _seen_tiles(RANGES, n_tiles, qpos_min, qpos_max, window, HAS_WINDOW: tl.constexpr, SCAN: tl.constexpr):
    """(lo, hi): the tiles that some query of a block (positions in [qpos_min, qpos_max]) sees lie in [lo, hi);
    lo >= hi when it sees none. Reads the row's tile ranges, SCAN at a time."""
    lo = n_tiles
    hi = 0
    for j0 in range(0, n_tiles, SCAN):
        j = j0 + tl.arange(0, SCAN)
        ok = j < n_tiles
        least = tl.load(RANGES + j * 2, mask=ok, other=2**62)
        seen = ok & (least <= qpos_max)
        if HAS_WINDOW:
            greatest = tl.load(RANGES + j * 2 + 1, mask=ok, other=-(2**62))
            seen = seen & (greatest > qpos_min - window)
        lo = tl.minimum(lo, tl.min(tl.where(seen, j, n_tiles), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(seen, j + 1, 0), axis=0))
    return lo, hi


@triton_jit()
def tile_scores(q, j, k_base, v_base, bias_base, pos_base, ks_base, ranges, offs_d, stride_kc, stride_kd, stride_vc,
                stride_vd, stride_bc, stride_pc, stride_ac, C, window, qk_scale, softcap_log2, qpos_min, qpos_max,
                q_rel, lo_rel, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                KEY_SCALE: tl.constexpr, MASKED: tl.constexpr):
    """Slot tile j's base-2 scores s [BLOCK_M, BLOCK_N] for the query block (-inf where a query does not see a slot),
    the tile's value pointers and their row mask: (s, v_ptrs, n_ok). MASKED: the tile may reach past C (its slots'
    loads masked); without it the tile is full, and its loads carry no mask (FULL_TILES). Shared with
    sketch_attention's prefill kernel (_sketch_prefill_kernels.py)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = offs_n < C
    else:  # a constant mask: folded away, so the bias, key-scale, key and value copies carry no predicate
        n_ok = tl.full([BLOCK_N], 1, tl.int1)
    bias = tl.load(bias_base + offs_n * stride_bc, mask=n_ok, other=float("-inf"))
    k = tl.load(k_base + offs_n[:, None] * stride_kc + offs_d[None, :] * stride_kd, mask=n_ok[:, None], other=0.0)
    if q.dtype == tl.float32:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    s = (qk * qk_scale).to(tl.float32)
    if KEY_SCALE:
        s = s * tl.load(ks_base + offs_n * stride_ac, mask=n_ok, other=0.0)[None, :]
    if SOFTCAP:  # as the decode kernel's: the cap in natural units, then base 2; the bias after it
        s = (libdevice.tanh(s) * softcap_log2).to(tl.float32)
    s = s + (bias * LOG2E)[None, :]
    # every query of the block sees every live slot of the tile: the bias (-inf where empty) is the only mask
    least = tl.load(ranges + j * 2)
    greatest = tl.load(ranges + j * 2 + 1)
    whole = greatest <= qpos_min
    if HAS_WINDOW:
        whole = whole & (least > qpos_max - window)
    if not whole:
        pos = tl.load(pos_base + offs_n * stride_pc, mask=n_ok, other=0)
        p_rel = tl.minimum(tl.maximum(pos - qpos_min, lo_rel), 2**30).to(tl.int32)
        vis = p_rel[None, :] <= q_rel[:, None]
        if HAS_WINDOW:
            vis = vis & (p_rel[None, :] > q_rel[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
    v_ptrs = v_base + offs_n[:, None] * stride_vc + offs_d[None, :] * stride_vd
    return s, v_ptrs, n_ok


@triton_jit()
def _slot_tile(m_i, l_i, acc, q, j, k_base, v_base, bias_base, pos_base, ks_base, ranges, offs_d,
               stride_kc, stride_kd, stride_vc, stride_vd, stride_bc, stride_pc, stride_ac, C, window, qk_scale,
               softcap_log2, qpos_min, qpos_max, q_rel, lo_rel, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
               SOFTCAP: tl.constexpr, KEY_SCALE: tl.constexpr, MASKED: tl.constexpr):
    """The online softmax after slot tile j of the query block: (m_i, l_i, acc) (tile_scores, then p @ v)."""
    s, v_ptrs, n_ok = tile_scores(q, j, k_base, v_base, bias_base, pos_base, ks_base, ranges, offs_d, stride_kc,
                                  stride_kd, stride_vc, stride_vd, stride_bc, stride_pc, stride_ac, C, window,
                                  qk_scale, softcap_log2, qpos_min, qpos_max, q_rel, lo_rel, BLOCK_N, HAS_WINDOW,
                                  SOFTCAP, KEY_SCALE, MASKED)
    return softmax_tile(m_i, l_i, acc, s, v_ptrs, n_ok)


# Shape ints that only bound loops and masks are not specialised on (value 1, multiple of 16): one compiled
# kernel serves every C, T, G and window of a dtype and head dim.
@triton_jit(do_not_specialize=["Hkv", "G", "T", "C", "n_tiles", "window"])
def _prefill_attention_kernel(
    Q, K, V, BIAS, POS, CPOS,
    KSCALE,  # fp32 [B, Hkv, C]: each slot's key scale a_j (KEY_SCALE only; expanded_attention's gathered slots)
    RANGES,  # int64 [B * Hkv, n_tiles, 2] from _tile_ranges_kernel
    ORDER,  # int64 [B * Hkv, 2] from _tile_ranges_kernel (SKIP_ORDERED only)
    OUT,  # [B, Hq, T, D] q's dtype
    LSE,  # fp32 [B * Hq * T]: each row's natural-log log-sum-exp, -inf for a row that saw nothing (WRITE_LSE only)
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    stride_ab, stride_ah, stride_ac,
    # qk_scale = scale * log2(e); with SOFTCAP, qk_scale = scale / softcap and softcap_log2 = softcap * log2(e)
    Hkv, G, T, C, n_tiles, window, qk_scale, softcap_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,  # window > 0
    SOFTCAP: tl.constexpr,  # soft-cap the scores: softcap * tanh(scale * q·k / softcap), before the bias and masks
    KEY_SCALE: tl.constexpr,  # the score of slot j is a_j * scale * q·k (before the cap): EMS's expanded keys
    WRITE_LSE: tl.constexpr,
    SCAN: tl.constexpr,  # tile ranges read at once while bounding the loop
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel before any load (kernels/_pdl.py)
    FULL_TILES: tl.constexpr = True,  # the full slot tiles' loads without a mask (module knob FULL_TILES)
    SKIP_ORDERED: tl.constexpr = False,  # leave the ordered rows (ORDER) to _ordered_prefill_kernels.py
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid_m = tl.program_id(0)  # fastest: the blocks of one (b, h) run together and share its K/V in L2
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    Hq = Hkv * G

    run = True
    if SKIP_ORDERED:  # the rows _ordered_prefill_kernel takes (slot j holds position j + delta, delta the row's)
        run = tl.load(ORDER + pid_bh.to(tl.int64) * 2) + tl.load(ORDER + pid_bh.to(tl.int64) * 2 + 1) != 0
    if run:
        # -- rows of the tile: (query t, head g of the group), as the decode kernel's ----------------------------
        rows, row_ok, t, hq, offs_d = block_rows(h, pid_m, G, T, BLOCK_M, HEAD_DIM)
        q, qpos, qpos_min, qpos_max, q_rel = query_block(Q, CPOS, b, row_ok, t, hq, offs_d, stride_qb, stride_qh,
                                                         stride_qt, stride_qd)
        lo_rel = -1 - window if HAS_WINDOW else -1

        ranges = RANGES + pid_bh.to(tl.int64) * n_tiles * 2
        lo, hi = _seen_tiles(ranges, n_tiles, qpos_min, qpos_max, window, HAS_WINDOW, SCAN)

        k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
        bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
        pos_base = POS + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph
        ks_base = KSCALE + b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        n_full = C // BLOCK_N if FULL_TILES else 0  # the full tiles without a slot mask, then the rest with one
        if FULL_TILES:
            for j in range(lo, tl.minimum(hi, n_full)):
                m_i, l_i, acc = _slot_tile(m_i, l_i, acc, q, j, k_base, v_base, bias_base, pos_base, ks_base,
                                           ranges, offs_d, stride_kc, stride_kd, stride_vc, stride_vd, stride_bc,
                                           stride_pc, stride_ac, C, window, qk_scale, softcap_log2, qpos_min,
                                           qpos_max, q_rel, lo_rel, BLOCK_N, HAS_WINDOW, SOFTCAP, KEY_SCALE, False)
        for j in range(tl.maximum(lo, n_full), hi):
            m_i, l_i, acc = _slot_tile(m_i, l_i, acc, q, j, k_base, v_base, bias_base, pos_base, ks_base, ranges,
                                       offs_d, stride_kc, stride_kd, stride_vc, stride_vd, stride_bc, stride_pc,
                                       stride_ac, C, window, qk_scale, softcap_log2, qpos_min, qpos_max, q_rel, lo_rel,
                                       BLOCK_N, HAS_WINDOW, SOFTCAP, KEY_SCALE, True)

        # -- epilogue: output row (b, hq, t) of the contiguous [B, Hq, T, *] outputs ------------------------------
        store_rows(OUT, LSE, (b.to(tl.int64) * Hq + hq) * T + t, row_ok, offs_d, acc, m_i, l_i, HEAD_DIM,
                   WRITE_LSE)


def prefill_launch_config(B, Hkv, G, T, C, D, itemsize=2, block_m=None, block_n=None, num_warps=None,
                          num_stages=None) -> dict:
    """Tiles, warps and stages of _prefill_attention_kernel from the shapes alone; the keyword overrides are for
    the benchmark's sweep. Defaults: 64-row query tiles (16 queries of a 4-head group), 64-slot tiles, 4 warps, 2
    stages, with the slot tile halved while two stages of K and V tiles would pass 128 KB of shared memory (fp32 or
    D = 256). The fastest of an H200 sweep at batch 8 (bf16, D 128, chunk 2048 over 6.6k slots; docs/bench.md "Stop
    41 runs"): 6.27-6.31 ms, tied with 128 x 32 tiles and 4 warps; 128-row tiles with 8 warps 6.6-6.7, 3 stages 6.7,
    8 warps at 64 rows 12-17."""
    if block_m is None:
        block_m = 64
    if num_stages is None:
        num_stages = 2
    if block_n is None:
        block_n = 64
        while 2 * num_stages * block_n * D * itemsize > 128 * 1024 and block_n > 16:
            block_n //= 2
    if num_warps is None:
        num_warps = 4
    return dict(block_m=block_m, m_blocks=triton.cdiv(G * T, block_m), block_n=block_n,
                n_tiles=triton.cdiv(C, block_n), num_warps=num_warps, num_stages=num_stages)


def prefill_overrides(overrides: dict) -> dict:
    """The launch overrides a prefill kernel takes (tiles, warps, stages; the given ones only) out of a caller's
    overrides for its decode kernel's _launch_config (clustered_attention, expanded_attention)."""
    return {k: overrides[k] for k in ("block_m", "block_n", "num_warps", "num_stages") if overrides.get(k) is not None}


# FULL_TILES: the slot loop in two, the tiles that end at or before C without a slot mask (_slot_tile's MASKED off: a
# constant mask, folded away), then the partial last tile, if the block reaches it, with one. Why: ncu's source
# counters of EMS's gathered prefill attention (H200, stop 56, the late chunk of a batch-8 32k prefill, 26.9 ms under
# ncu) put 16% of the stall samples on the per-column 4-byte copies of each tile's bias and key scale and most of
# its integer instructions on their predicates and addresses: 765 instructions a warp and tile in the hot path, 553
# with FULL_TILES (sm_90, offline compile, bf16, D 128, the key scale on; 255 registers either way). Timed (H200,
# stop 57): that call 27.3 -> 21.6 ms; EMS's batch-8 32k prefill 1.11x -> 1.06-1.07x dense in the same call.
# Outputs: fp32 bit for bit; fp16/bf16 within one rounding of a probability times a value of the masked loop's (sm_90
# orders the unmasked tile's score arithmetic otherwise: lse within 1e-6), the same error against the reference.
# False: the one masked loop.
FULL_TILES = True
RANGE_TILES = 16  # tiles of a _tile_ranges_kernel program
SCAN = 128  # tile ranges a query block reads at once while bounding its loop


def order_stats(B: int, Hkv: int, device):
    """The buffer tile_ranges fills with each row's order statistics: int64 [B * Hkv, 2], both columns 2**61 (no live
    slot yet). A row is ordered, every live slot j at position j + delta, iff its two entries sum to 0 (delta the
    first); a row without a live slot sums to 2**62."""
    return torch.full((B * Hkv, 2), 2**61, dtype=torch.int64, device=device)


def tile_ranges(bias, slot_pos, n_tiles, block_n, pdl, launch, order=None):
    """Launch _tile_ranges_kernel: int64 [B * Hkv, n_tiles, 2], each tile's (least, greatest) live position; with
    `order` (order_stats') it also takes each row's minima of position - index and index - position."""
    B, Hkv, C = (int(n) for n in bias.shape)
    ranges = torch.empty((B * Hkv, n_tiles, 2), dtype=torch.int64, device=bias.device)
    wrap_triton(_tile_ranges_kernel)[(triton.cdiv(n_tiles, RANGE_TILES), B * Hkv)](
        bias, slot_pos, ranges, ranges if order is None else order, *bias.stride(), *slot_pos.stride(), Hkv, C,
        n_tiles, BLOCK_N=block_n, TILES=RANGE_TILES, PDL=pdl, ORDER_STATS=order is not None, num_warps=4,
        **launch,
    )
    return ranges


def launch_prefill(q, keys, values, bias, slot_pos, cache_position, window, qk_scale, softcap_log2, softcap, lse,
                   key_scale=None, full_tiles=None, ordered=None, **overrides):
    """Launch the tile ranges, then the attention; returns the output [B, Hq, T, D] (contiguous). lse: an fp32
    [B, Hq, T] tensor to receive each query's natural-log log-sum-exp, or None. key_scale: an fp32 [B, Hkv, C]
    per-slot factor of the scores (before the soft cap), or None. full_tiles (default FULL_TILES): the full slot
    tiles' loads without a mask (fp32 bit for bit; 16-bit within one rounding of a probability). ordered (default
    _ordered_prefill_kernels.ORDERED; True, False, or a dict of that kernel's launch overrides and `tma`): the rows
    whose live slots hold their positions in order, slot j position j + delta, go to _ordered_prefill_kernels.py
    (where `routable`), the others to _prefill_attention_kernel. No checks (the caller's:
    clustered_attention.triton_clustered_attention, expanded_attention's gathered slots); runs under Triton's
    interpreter on CPU tensors."""
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C = int(keys.shape[1]), int(keys.shape[2])
    G = Hq // Hkv
    cfg = prefill_launch_config(B, Hkv, G, T, C, D, q.element_size(), **overrides)
    n_tiles = cfg["n_tiles"]
    pdl, launch = _pdl.launch_options(q)
    ordered = _ordered.ORDERED if ordered is None else ordered
    if ordered is not False and not _ordered.routable(keys, values, window, softcap, key_scale):
        ordered = False
    ordered_tuning = dict(ordered) if isinstance(ordered, dict) else {}
    order = None if ordered is False else order_stats(B, Hkv, q.device)
    ranges = tile_ranges(bias, slot_pos, n_tiles, cfg["block_n"], pdl, launch, order)
    out = torch.empty((B, Hq, T, D), dtype=q.dtype, device=q.device)
    ks = bias if key_scale is None else key_scale  # an unused pointer without it: any fp32 [B, Hkv, C]
    wrap_triton(_prefill_attention_kernel)[(cfg["m_blocks"], B * Hkv)](
        q, keys, values, bias, slot_pos, cache_position, ks, ranges, ranges if order is None else order, out,
        out if lse is None else lse,
        *q.stride(), *keys.stride(), *values.stride(), *bias.stride(), *slot_pos.stride(), *ks.stride(),
        Hkv, G, T, C, n_tiles, window, qk_scale, softcap_log2,
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], HAS_WINDOW=window > 0, SOFTCAP=softcap > 0,
        KEY_SCALE=key_scale is not None, WRITE_LSE=lse is not None, SCAN=SCAN, PDL=pdl,
        FULL_TILES=FULL_TILES if full_tiles is None else bool(full_tiles), SKIP_ORDERED=order is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )
    if order is not None:
        _ordered.launch_ordered(q, keys, values, bias, cache_position, order, out, lse, qk_scale, pdl, launch,
                                **ordered_tuning)
    return out
