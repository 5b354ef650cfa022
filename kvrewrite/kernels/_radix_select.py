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
    _KEY_NEG_INF = tl.constexpr(-2139095041)  # evict_by_score._order_key(-inf)
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
def _kth_largest_radix(key, K, n_above):
    """The K-th largest of the int32 order keys `key` (a register block; the lanes past the row hold -inf's key) when
    n_above, the count of keys above -inf's, is at least K (else -inf's key, as `_kth_largest`)."""
    thr = tl.full([], _KEY_NEG_INF, tl.int32)
    if n_above >= K:
        u = key.to(tl.uint32, bitcast=True) ^ 0x80000000  # unsigned order = the keys' signed order
        need = K
        b0, gt0 = _suffix_pick(tl.histogram((u >> 24).to(tl.int32), _BINS), need)
        need -= gt0
        top = b0.to(tl.uint32)
        b1, gt1 = _suffix_pick(tl.histogram(((u >> 16) & 255).to(tl.int32), _BINS, mask=(u >> 24) == top), need)
        need -= gt1
        top = (top << 8) | b1.to(tl.uint32)
        b2, gt2 = _suffix_pick(tl.histogram(((u >> 8) & 255).to(tl.int32), _BINS, mask=(u >> 16) == top), need)
        need -= gt2
        top = (top << 8) | b2.to(tl.uint32)
        b3, _ = _suffix_pick(tl.histogram((u & 255).to(tl.int32), _BINS, mask=(u >> 8) == top), need)
        top = (top << 8) | b3.to(tl.uint32)
        thr = (top ^ 0x80000000).to(tl.int32, bitcast=True)
    return thr
