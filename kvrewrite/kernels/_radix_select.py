"""The K-th largest of a row's keys by radix select: evict_by_score's `_kth_largest` in four histogram rounds.

`_kth_largest` (evict_by_score.py) bisects over the key values: about log2 of the key range around the threshold
steps (up to 32; ~25-30 for the pooled scores of a 32k row), each a count over every lane, which is a reduction
across the program's warps and barriers. The compressing steps' selections run it (evict_by_score's select,
kvmerger's heavy-hitter, join and eviction thresholds, EMS's partition twice and its merge's slot cap), one program
per row, so at batch 1 eight programs on 132 SMs wait through them (EMS's partition: 57 us a layer on an H200,
docs/bench.md "Stop 50 runs").

Here the keys, mapped to uint32 in the same order (the sign bit flipped), are resolved a byte at a time from the
top: each round takes a 256-bin histogram of the current byte over the keys that match the bytes chosen so far
(`tl.histogram` with a mask), and the bin holding the still-needed rank is found by a suffix count over the 256
bins. Four rounds and no data-dependent loop, and the result is the same (thr, need, n_eq) as the bisection's, bit
for bit: thr is the K-th largest key value in both (tests/kernels/test_evict_by_score_triton.py's `_kth_probe`
compares them on tied, -inf- and NaN-heavy rows and on keys that differ in every byte). Whether it is faster on a
GPU is not yet measured: it is off (evict_by_score.RADIX_SELECT) until timed.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton.language as tl
except ImportError:  # CPU-only installs never launch these
    tl = None

if tl is not None:
    _BINS = tl.constexpr(256)


@triton_jit()
def _suffix_pick(h, need):
    """The bin b of the 256-bin histogram h holding the need-th largest (1-based) of its keys, and how many keys lie
    in the bins above b: gt(b) < need <= gt(b) + h[b], where gt(b) = sum of h over the bins above b."""
    b = tl.arange(0, _BINS)
    gt = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)
    pick = (gt < need) & (gt + h >= need)
    bstar = tl.max(tl.where(pick, b, -1), axis=0)
    return bstar, tl.sum(tl.where(b == bstar, gt, 0), axis=0)


@triton_jit()
def _kth_largest_radix(key, K):
    """The K-th largest of the int32 order keys `key` (a register block), 1 <= K <= its lanes: a byte a round from
    the top, each round's histogram over the keys whose higher bytes are the ones chosen so far."""
    u = key.to(tl.uint32, bitcast=True) ^ 0x80000000  # unsigned order = the keys' signed order
    need = K
    top = tl.zeros([], tl.uint32)
    for r in tl.static_range(4):
        digit = ((u >> (24 - 8 * r)) & 255).to(tl.int32)
        if r == 0:
            h = tl.histogram(digit, _BINS)
        else:
            h = tl.histogram(digit, _BINS, mask=(u >> (32 - 8 * r)) == top)
        b, gt = _suffix_pick(h, need)
        need -= gt
        top = (top << 8) | b.to(tl.uint32)
    return (top ^ 0x80000000).to(tl.int32, bitcast=True)
