"""The staged in-place shift of kept keys and values toward the front of each row (kcenter_compress's compaction).

A compaction that packs the kept slots at the front of the row IN ORDER shifts every slot after the first dropped
one left. Two launches over the grid (blocks of BLOCK_S destination slots, rows, DS-column slices of keys and of
values) move them in place, given SRC[row, destination] = source slot (source >= destination) and INFO[row] =
[first destination that moves, kept count]; only destinations in [first, kept) are touched.

The survivors only shift left, so a block's sources can lie past its end, in slots that later blocks overwrite:
moved block-parallel in place, that would race (and a program walking the row in order runs one latency-bound tile
at a time). Launch 1 (`_shift_stage_kernel`) copies exactly those halo sources (a block's destinations whose source
lies past the block: about the row's shift, at most the block) to a staging buffer; launch 2 (`_shift_move_kernel`)
then moves every block at once, its own sources from the state and the halo from the stage: only the block's
program writes its slots and no other program of launch 2 reads them (loads, a CTA barrier, stores). Traffic: the
moving keys and values once plus the halo twice.

(kvrewrite::evict_by_score used these until it kept an `order` index instead of packing in order: its kept slots
now only fill the holes the evicted ones leave, a disjoint move in one launch.)
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing here is launched
    tl = None

MOVE_SLOTS = 256  # destination slots per program of the stage and move launches (a power of two)
MOVE_COLUMNS = 64  # head-dim columns per program of the stage and move launches (a power of two)


@triton_jit()
def _shift_block(K, V, SK, SV, SRC, INFO, C, D, STAGE: tl.constexpr, BLOCK_S: tl.constexpr, DS: tl.constexpr,
                 NSLICE: tl.constexpr):
    """Program (b, row, p): destinations [BLOCK_S * b, +BLOCK_S) of the row, columns [DS * (p % NSLICE), +DS) of
    keys (p < NSLICE) or values. Destinations in [first, kept) move, from sources at or after them; sources past
    the block (its halo) are overwritten by later blocks in the move launch, so the stage launch (STAGE) copies them
    to the stage SK/SV (at their destination's place) first. No other program writes a block."""
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
def _shift_stage_kernel(K, V, SK, SV, SRC, INFO, C, D, BLOCK_S: tl.constexpr, DS: tl.constexpr,
                        NSLICE: tl.constexpr):
    """Launch 1, grid (slot blocks, rows, 2 * NSLICE): each block's halo to the stage (_shift_block)."""
    _shift_block(K, V, SK, SV, SRC, INFO, C, D, True, BLOCK_S, DS, NSLICE)


@triton_jit()
def _shift_move_kernel(K, V, SK, SV, SRC, INFO, C, D, BLOCK_S: tl.constexpr, DS: tl.constexpr,
                       NSLICE: tl.constexpr):
    """Launch 2, grid (slot blocks, rows, 2 * NSLICE): every block's moves, in place (_shift_block)."""
    _shift_block(K, V, SK, SV, SRC, INFO, C, D, False, BLOCK_S, DS, NSLICE)
