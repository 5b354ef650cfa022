"""kvrewrite::kmeans_cluster — ClusterKV's clustering: k-means of a row's keys, written as a CSR index.

ClusterKV (https://arxiv.org/abs/2412.03213) clusters the post-RoPE keys of the prompt per KV head with
cosine k-means (C0 = L / 80 clusters, the first n_sink tokens left out), then every `window` (m = 320)
decode tokens the m newest keys alone into C+ = 4 more clusters; a decode step scores the centroids
against the query and attends the members of the best clusters (kvrewrite::select_clusters). This op is
the method's compression op: the whole contract is "Op 1" of the ClusterKV spec (docs / the lead's
clusterkv_spec.md); in short, per row (b, kv-head):

- due: fill >= budget[1] and either cluster_end == 0 (prefill clustering: the valid slots of [0, fill),
  the first n_sink of them the sinks, written to members[0:n_sink], the others clustered into
  ceil(L / tokens_per_cluster) clusters) or fill - cluster_end >= window (window clustering: the valid
  slots of [cluster_end, fill) into min(window_clusters, L)). Rows not due are untouched, bit for bit;
- initialisation: centroid k = point floor(k L / C_new) + r_k mod w_k, w_k = floor((k+1) L / C_new) -
  floor(k L / C_new) the width of stratum k, r_k a seeded hash of (seed, head, points clustered before, k)
  (init_points): one point in each of C_new disjoint strata of the sequence, so never a repeat; reproducible.
  The head hashed is head_offset + the state's head index: head_offset is the model layer's index of the
  state's first KV head (a tensor-parallel rank's state numbers its heads from 0), so a rank's heads draw the
  initial points that tp=1 draws for the same heads;
- `iters` rounds of assignment (argmax_k x . c_k / (|c_k| + 1e-8), ties to the lower k, fp32) and update
  (fp32 mean of the raw keys of each cluster, rounded to the centroids' dtype; an empty cluster keeps its
  centroid), then a final assignment;
- write: centroids, cluster_size, cluster_start (the append offset + exclusive cumsum), members (each
  cluster's slots in slot order, clusters in id order: CSR sorted indices), n_clusters += C_new,
  cluster_end = fill. More clusters than K: the reference raises ValueError, the kernel clamps.

State (mutated): centroids [B, Hkv, K, D] keys' dtype; cluster_size, cluster_start [B, Hkv, K] int32;
members [B, Hkv, C] int32; n_clusters [B, Hkv] int32; cluster_end [B, Hkv] int64. Read: keys, bias, fill,
budget (values and slot_pos are passed by the rewrite's convention and not read).

Backends. The reference (a Python loop over the due rows, tensor code inside a row, host reads) is the
CPU path and the ground truth. CUDA runs the Triton kernel below (supports_triton; otherwise the
reference, with a warning). The kernel reads nothing on the host, its launches depend on shapes only (CUDA
graphs capture it), and it is deterministic: every float sum has a fixed order (integer atomics only).

Triton kernel: one kernel, its work in phases, each depending on the whole previous one:
  0 count   (rows x 512-slot chunks)  due rule; valid slots per chunk of the scan range;
  1 write   (rows x chunks)           ranks from the chunk counts: sinks -> members, point i -> its slot (PTS) and
                                      its keys packed contiguous (XP); the initial centroids that fall in the
                                      chunk and their 1/(|c| + eps); per-row INFO (L, C_new, offsets, split size);
  iters x [ assign (rows x 256-point blocks)
                                      tensor-core dots [256, D] x [D, 64 centroids], scaled by 1/(|c| + eps),
                                      running first-max -> labels; changed labels counted per row (CHG);
            update (rows x splits x 64-cluster blocks)
                                      2048 labels at a time, the split's points of the block's clusters compacted
                                      (a cumsum, in point order) into the program's scratch, then one-hot
                                      [64, 64 points] x their keys [64, D] (and x ones: the counts) -> fp32
                                      partials per (split, cluster); the last program to finish a cluster block
                                      (an int counter) sums its partials in split order, / count, rounds to the
                                      dtype: new centroids and 1/|c| ]
  final assign (+ per-(split, cluster) counts by integer atomics); finalize (rows: sizes, starts, the cursor of
  each (split, cluster)); scatter (rows x splits: a stable counting sort, ranks inside 64-point steps from a
  [64, 64] label comparison) -> members.
A row whose labels did not change in an iteration has converged: every later iteration would recompute the
same centroids and labels bit for bit, so its later work is skipped (exact; stop_when_converged=False runs it).
By default all 2 iters + 5 phases run in ONE persistent launch (plus one memset of its counters): every program
loops over a phase's work items (only those of due rows: counts come from the largest L and C_new of the call)
and all meet at a grid barrier (an atomic counter, release/acquire: the acquire also makes the L1-cached loads
of the next phase see the other SMs' stores) between phases. All programs must be resident at once: the grid
is SMs x the CTAs per SM that the compiled kernel's registers and shared memory allow (_persistent_programs;
1 per SM at 8 warps: the update and the assignment take ~190-255 registers). A call where no row is due is that
memset and a launch whose programs read the due rule of every row and return. persistent=False launches one
kernel per phase (no barrier, any grid), each compiled for its phase's kind alone (KINDS: its own registers):
how the interpreter runs it with several programs, and a fallback should a device not keep the whole grid
resident (e.g. an MPS SM limit); at 32k it is as fast as the persistent launch, but a call with no row due
would pay its ~45 launches.

Why a compacted one-hot update rather than a counting sort per iteration: one phase (a sort-based mean needs a
count, a scan, a scatter and a gather-sum per iteration: 4 phases with their barriers, a tail for large
clusters), fixed-order fp32 sums, and ~64 / C_new of the one-hot flops over every point (2 L x 64 x D instead of
2 L C_new D, what an assignment costs): the dots see only the block's own points. The sort runs once, for the
final members.

Measured (H100 SXM, torch 2.11, triton 3.6; kvrewrite.bench.kmeans_cluster, two runs; Llama-3.1-8B layer: 8
rows, D 128, bf16, 20 iterations, keys a mixture of directions that does not converge in 20): a due prefill call
costs 0.92-0.93 ms at 8k (103 clusters; 42 us per iteration + 93 us), 5.47-5.49 ms at 32k (410 clusters; 249 us
per iteration + 381-383 us; before the compacted update 8.2 ms: 392 us per iteration); 128k not re-measured
(98 ms before). A window clustering (320 points into 4) 0.30-0.39 ms, ~45 phases of a few us each; a call with
no row due 3.5-4.4 us in a CUDA graph (0.25-0.6 ms eager: Python and launch). In a real 32k prefill
(bench.kmeans_cluster.prefill_cost, random-weight Llama-3.1-8B, chunks of 2048, budget 1024): clusterkv's prefill
minus full's = 175-176 ms (30 compressed layers: ~5.8 ms each), 5.4% of kvrewrite's full prefill (3.26 s) and
11.8-12.4% of HF's dense prefill (1.41-1.50 s): above the 10% target against HF's. Where the time goes (one
launch per phase, 32k): an assignment ~145 us (wgmma [256, D] x [D, 64], 1 CTA per SM at ~190 registers; ~130
TFLOP/s), an update ~100 us (latency-bound: 1 CTA per SM at 255 registers, dependent gathers), both ~L x C_new.
Smaller tiles, 4 warps, a register cap (maxnreg 128: 2 CTAs per SM, spills) and the elementwise argmax were all
slower or equal. On keys whose clusters settle, rows stop early.

Numerics: dots of 16-bit keys and centroids are exact products accumulated in fp32 (fp32 keys: 3xTF32); scores
are multiplied by 1/(|c| + 1e-8) where the reference divides, and sums run in another order, so scores differ
from the reference's by a few ulp and the centroids by rounding: near-ties (top-2 scores within ~1e-5 relative)
may be assigned differently, everything else is identical.

Memory per call (transient): the packed keys (XP, the keys' size), point slots and labels (8 bytes per slot),
fp32 partials [rows, splits, K, D] (capped at 256 MB by fewer splits; 28 MB at 32k), the update's scratch
(16 KB per program), counters.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import math
import os

import torch

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels._triton_op import check_head_offset, triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference; only triton_kmeans_cluster raises
    triton = tl = None

NAME = "kvrewrite::kmeans_cluster"
MASK32 = 0xFFFFFFFF
EPS = 1e-8  # added to the centroid norms of the cosine scores


# -- reference -----------------------------------------------------------------------------------------
def mix32(x: int) -> int:
    """The spec's 32-bit mixer (uint32 arithmetic)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    x ^= x >> 16
    return x


def init_points(L: int, n: int, seed: int, h: int, offset: int) -> list[int]:
    """Indices (among the L points) of the n <= L initial centroids of KV head h (the layer's: head_offset + the
    state's head), `offset` points clustered before:
    i_k = floor(k L / n) + r_k mod (floor((k+1) L / n) - floor(k L / n)), one point in each of the n disjoint
    strata (distinct: no two centroids start tied), r_k = mix32(mix32(mix32(mix32(seed mod 2^32) ^ h) ^ offset)
    ^ k)."""
    base = mix32(mix32(mix32(seed & MASK32) ^ h) ^ offset)
    return [k * L // n + mix32(base ^ k) % ((k + 1) * L // n - k * L // n) for k in range(n)]


def _check_inputs(keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start, members,
                  n_clusters, cluster_end, n_sink, tokens_per_cluster, window, window_clusters, iters, head_offset=0):
    """ValueError naming the op and the field unless the shapes and dtypes are the spec's."""
    if keys.dim() != 4 or not keys.dtype.is_floating_point:
        raise ValueError(f"{NAME}: keys must be a floating [B, Hkv, C, D] tensor, got {keys.dtype} {list(keys.shape)}")
    B, H, C, D = keys.shape
    K = centroids.shape[2] if centroids.dim() == 4 else -1
    expect = {
        "values": (values, (B, H, C, D), None), "bias": (bias, (B, H, C), torch.float32),
        "slot_pos": (slot_pos, (B, H, C), None), "fill": (fill, (B, H), torch.int64),
        "budget": (budget, (2,), torch.int64), "centroids": (centroids, (B, H, K, D), keys.dtype),
        "cluster_size": (cluster_size, (B, H, K), torch.int32),
        "cluster_start": (cluster_start, (B, H, K), torch.int32),
        "members": (members, (B, H, C), torch.int32), "n_clusters": (n_clusters, (B, H), torch.int32),
        "cluster_end": (cluster_end, (B, H), torch.int64),
    }
    for field, (t, shape, dtype) in expect.items():
        if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
            want = f"{dtype} {list(shape)}" if dtype is not None else f"{list(shape)}"
            if field == "centroids":
                want = f"{keys.dtype} [B, Hkv, K, D] = [{B}, {H}, K, {D}]"
            raise ValueError(f"{NAME}: {field} must be {want} (keys {list(keys.shape)}), got {t.dtype} {list(t.shape)}")
    devices = {t.device for t, _, _ in expect.values()} | {keys.device}
    if len(devices) != 1:
        raise ValueError(f"{NAME}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if n_sink < 0 or tokens_per_cluster < 1 or window < 1 or window_clusters < 1 or iters < 0:
        raise ValueError(f"{NAME}: expected n_sink >= 0, tokens_per_cluster >= 1, window >= 1, window_clusters >= 1,"
                         f" iters >= 0, got {n_sink}, {tokens_per_cluster}, {window}, {window_clusters}, {iters}")
    check_head_offset(NAME, head_offset)


def _assign(x, cent):
    """Labels of the points x [L, D] fp32: argmax_k x . c_k / (|c_k| + 1e-8) (first max on ties)."""
    c = cent.float()
    return ((x @ c.T) / (torch.linalg.vector_norm(c, dim=-1) + EPS)).argmax(dim=1)


def reference_kmeans_cluster(keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start,
                             members, n_clusters, cluster_end, n_sink, tokens_per_cluster, window, window_clusters,
                             iters, seed, clamp: bool = False, head_offset: int = 0) -> None:
    """The CPU path and the ground truth (module docstring), row by row. clamp=True clamps the cluster count to
    the free ids as the kernel does (for its tests) instead of raising. head_offset: the layer's index of the
    state's head 0 (hashed as head_offset + h)."""
    B, H, C, D = keys.shape
    K = centroids.shape[2]
    threshold = int(budget[1])
    for b in range(B):
        for h in range(H):
            f, ce, nc = int(fill[b, h]), int(cluster_end[b, h]), int(n_clusters[b, h])
            prefill = ce == 0
            if f < threshold or not (prefill or f - ce >= window):
                continue
            lo, hi = (0 if prefill else min(ce, C)), min(f, C)
            slots = lo + torch.nonzero(bias[b, h, lo:hi] > -math.inf).flatten()
            if prefill:
                sinks = slots[:n_sink]
                members[b, h, :n_sink] = -1
                members[b, h, :len(sinks)] = sinks.to(torch.int32)
                slots = slots[n_sink:]
            L = len(slots)
            n = -(-L // tokens_per_cluster) if prefill else min(window_clusters, L)
            if nc + n > K:
                if not clamp:
                    raise ValueError(f"{NAME}: row (b={b}, h={h}) needs {nc} + {n} clusters, more than K = {K}")
                n = max(K - nc, 0)
            offset = int(cluster_size[b, h, :nc].sum())
            if n > 0:
                x = keys[b, h, slots].float()  # [L, D]
                cent = keys[b, h, slots[init_points(L, n, seed, head_offset + h, offset)]]  # [n, D], the state's dtype
                for _ in range(iters):
                    label = _assign(x, cent)
                    sums = torch.zeros(n, D, dtype=torch.float32, device=keys.device).index_add_(0, label, x)
                    count = torch.bincount(label, minlength=n)
                    mean = (sums / count.clamp_min(1)[:, None]).to(cent.dtype)
                    cent = torch.where((count > 0)[:, None], mean, cent)
                label = _assign(x, cent)
                size = torch.bincount(label, minlength=n)
                start = n_sink + offset + size.cumsum(0) - size
                centroids[b, h, nc:nc + n] = cent
                cluster_size[b, h, nc:nc + n] = size.to(torch.int32)
                cluster_start[b, h, nc:nc + n] = start.to(torch.int32)
                ordered = slots[torch.argsort(label, stable=True)].to(torch.int32)
                m0 = n_sink + offset
                m = max(0, min(L, C - m0))  # a row whose sinks were short can reach past C by that much
                members[b, h, m0:m0 + m] = ordered[:m]
            n_clusters[b, h] = nc + n
            cluster_end[b, h] = f


# -- Triton kernel -------------------------------------------------------------------------------------
# Triton's interpreter (TRITON_INTERPRET=1, how the kernel is tested on a CPU) computes 16-bit dots wrongly (on
# the raw bits): there the operands go up to fp32 first (exact: the products of 16-bit values are exact in fp32)
_INTERPRET = None if triton is None else tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
INFO_W = 8  # per-row words: due, L, C_new, first id, first member offset, split size, splits used, offset
BLOCK_P = 256  # assign: points per block
BLOCK_C = 64  # assign: centroids per dot
UPDATE_C = 64  # update: clusters per program (and per reduce)
UPDATE_P = 64  # update: compacted points per dot (and the split size's granularity)
UPDATE_SUB = 2048  # update: labels compacted at a time (the program's scratch)
FINAL_C = 256  # finalize: clusters per step
SCATTER_P = 64  # scatter: points per step (its rank is a [SCATTER_P, SCATTER_P] comparison)
PREP_CHUNK = 512  # count / write: slots per work item
WRITE_P = 128  # write: slots per step (a [WRITE_P, D] tile of keys copied to the packed points)
INIT_K = 32  # write: initial centroids per step
MAXNREG = None  # registers per thread the compiler may use (None: its choice)
MAX_CTAS_PER_SM = 2  # persistent programs per SM, where the compiled kernel's registers and shared memory allow
SPLIT_POINTS = 2048  # points per split of the update (at most MAX_SPLITS splits)
MAX_SPLITS = 8
PARTIAL_BYTES = 256 << 20  # cap of the update's fp32 partial sums (fewer splits beyond)


@triton_jit()
def _mul32(x, c: tl.constexpr):
    """(x * c) mod 2^32 for int64 lanes x < 2^32 without int64 overflow (c split in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton_jit()
def _mix32(x):
    """mix32 on int64 lanes holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton_jit()
def _dot(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b in fp32 (PREC: fp32 operands' input precision)."""
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton_jit()
def _grid_sync(BAR, target):
    """All programs of the grid reach here before any goes on (BAR counts arrivals; target = epoch * grid)."""
    tl.debug_barrier()  # the CTA's stores of the phase are issued before its arrival (release)
    tl.atomic_add(BAR, 1, sem="acq_rel", scope="gpu")
    while tl.atomic_add(BAR, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton_jit()
def _row_rule(row64, FILL, BUDGET, NCL, CEND, C, window):
    """The due rule of a row and its scan range [lo, hi) (the state as the call found it)."""
    fill = tl.load(FILL + row64)
    ce = tl.load(CEND + row64)
    ready = fill >= tl.load(BUDGET + 1)
    pre = ready & (ce == 0)
    due = pre | (ready & (ce > 0) & (fill - ce >= window))
    hi = tl.minimum(fill, C).to(tl.int32)
    lo = tl.where(pre, 0, tl.minimum(ce, C)).to(tl.int32)
    return due, pre, lo, hi, tl.load(NCL + row64)


@triton_jit()
def _count_chunk(row64, j, FILL, BUDGET, NCL, CEND, BIAS, CSIZE, INFO, VC, C, K, NCH, window, CH: tl.constexpr):
    """Phase 0, chunk j of a row's scan range: VC[row, j] = its valid slots. Chunk 0 also writes INFO[row, 0] (due)
    and INFO[row, 7] (points clustered before: the sizes of the row's clusters), and zeros for a row not due."""
    due, pre, lo, hi, nc = _row_rule(row64, FILL, BUDGET, NCL, CEND, C, window)
    c0 = lo + j * CH
    if due & (c0 < hi):
        s = c0 + tl.arange(0, CH)
        valid = tl.load(BIAS + row64 * C + s, mask=s < hi, other=float("-inf")) > float("-inf")
        tl.store(VC + row64 * NCH + j, tl.sum(valid.to(tl.int32), axis=0))
    if j == 0:
        at = INFO + row64 * 8
        tl.store(at, due.to(tl.int32))
        if due:
            offset = tl.zeros([], tl.int32)
            for k0 in range(0, nc, CH):
                k = k0 + tl.arange(0, CH)
                offset += tl.sum(tl.load(CSIZE + row64 * K + k, mask=k < nc, other=0), axis=0)
            tl.store(at + 7, offset)
        else:
            for w in tl.static_range(1, 8):
                tl.store(at + w, 0)


@triton_jit()
def _write_chunk(row64, j, KEYS, FILL, BUDGET, NCL, CEND, BIAS, CENT, MEMBERS, INFO, VC, PTS, XP, INVN,
                 C, K, D, H, NS, NCH, n_sink, tpc, window, wc, seed_hi, seed_lo, hoff,
                 DP: tl.constexpr, CH: tl.constexpr, NCHP: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr,
                 ALIGN: tl.constexpr):
    """Phase 1, chunk j of a due row: its valid slots ranked (the chunks before it counted in phase 0): the first
    n_sink of the row are sinks (members), the others points: PTS[row, i] = slot of point i, XP[row, i] = its keys;
    the initial centroids that are points of this chunk (k: point floor(k L / n) + r_k mod stratum k's width,
    r_k a hash of (seed, hoff + the state's head, offset, k): init_points) and their reciprocal norms. Chunk 0
    writes INFO[row, 1:7] = [L, C_new, first id, first member offset, split size, splits used] and the -1 of sinks
    the row lacks."""
    due, pre, lo, hi, nc = _row_rule(row64, FILL, BUDGET, NCL, CEND, C, window)
    nch = tl.cdiv(hi - lo, CH)
    if due & ((j < nch) | (j == 0)):
        jj = tl.arange(0, NCHP)
        counts = tl.load(VC + row64 * NCH + jj, mask=jj < nch, other=0)
        total = tl.sum(counts, axis=0)
        prefix = tl.sum(tl.where(jj < j, counts, 0), axis=0)
        nsk = tl.where(pre, n_sink, 0)
        L = tl.maximum(total - nsk, 0)
        offset = tl.load(INFO + row64 * 8 + 7)
        n = tl.where(pre, tl.cdiv(L, tpc), tl.minimum(L, wc))
        n = tl.maximum(tl.minimum(n, K - nc), 0)
        if j == 0:
            chunk = tl.cdiv(tl.cdiv(L, NS), ALIGN) * ALIGN
            at = INFO + row64 * 8
            tl.store(at + 1, L)
            tl.store(at + 2, n)
            tl.store(at + 3, nc)
            tl.store(at + 4, n_sink + offset)
            tl.store(at + 5, chunk)
            tl.store(at + 6, tl.where(chunk > 0, tl.cdiv(L, tl.maximum(chunk, 1)), 0))
            if pre:  # sink entries the row lacks
                for i0 in range(0, n_sink, BW):
                    i = i0 + tl.arange(0, BW)
                    tl.store(MEMBERS + row64 * C + i, tl.full([BW], -1, tl.int32),
                             mask=(i >= total) & (i < n_sink) & (i < C))
        d = tl.arange(0, DP)
        dm = d < D
        rank0 = prefix
        c0 = lo + j * CH
        for b0 in range(c0, tl.minimum(c0 + CH, hi), BW):
            s = b0 + tl.arange(0, BW)
            valid = tl.load(BIAS + row64 * C + s, mask=s < hi, other=float("-inf")) > float("-inf")
            vi = valid.to(tl.int32)
            rank = rank0 + tl.cumsum(vi, axis=0) - vi
            tl.store(MEMBERS + row64 * C + rank, s, mask=valid & (rank < nsk))
            point = valid & (rank >= nsk)
            tl.store(PTS + row64 * C + rank - nsk, s, mask=point)
            m2 = point[:, None] & dm[None, :]
            x = tl.load(KEYS + (row64 * C + s)[:, None] * D + d[None, :], mask=m2)
            tl.store(XP + (row64 * C + rank - nsk)[:, None] * D + d[None, :], x, mask=m2)
            rank0 += tl.sum(vi, axis=0)
        a = tl.maximum(prefix - nsk, 0)  # this chunk's points: [a, b)
        b = tl.maximum(rank0 - nsk, 0)
        if (n > 0) & (a < b):
            tl.debug_barrier()  # PTS written above by other threads of the program
            seed = (tl.cast(seed_hi, tl.int64) << 16) | seed_lo
            base = _mix32(_mix32(seed ^ ((row64 % H) + hoff)) ^ offset)
            k_lo = tl.maximum(a.to(tl.int64) * n // L - 1, 0).to(tl.int32)  # k of point i: ~ i n / L
            k_hi = tl.minimum((b.to(tl.int64) - 1) * n // L + 2, n).to(tl.int32)
            for k0 in range(k_lo, k_hi, BK):
                k = k0 + tl.arange(0, BK)
                k64 = k.to(tl.int64)
                s_lo = k64 * L // n  # stratum k: points [s_lo, s_hi), s_hi > s_lo as n <= L
                s_hi = (k64 + 1) * L // n
                ik = (s_lo + _mix32(base ^ k64) % tl.maximum(s_hi - s_lo, 1)).to(tl.int32)
                mine = (k < k_hi) & (ik >= a) & (ik < b)
                # (point ik < L is another chunk's where not mine: its slot may be unwritten yet, and is not used)
                slot = tl.load(PTS + row64 * C + ik, mask=k < k_hi, other=0)
                m2 = mine[:, None] & dm[None, :]
                x = tl.load(KEYS + (row64 * C + slot)[:, None] * D + d[None, :], mask=m2, other=0.0)
                tl.store(CENT + (row64 * K + nc + k)[:, None] * D + d[None, :], x, mask=m2)
                xf = x.to(tl.float32)
                norm = tl.sqrt_rn(tl.sum(xf * xf, axis=1))
                tl.store(INVN + row64 * K + k, tl.math.div_rn(tl.full([BK], 1.0, tl.float32), norm + 1e-8),
                         mask=mine)


@triton_jit()
def _assign_block(row64, blk, XP, CENT, INVN, LAB, FCNT, CHG, L, n, nc, chunk, C, K, D, NS, R, it, final,
                  DP: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, STOP: tl.constexpr,
                  ELEM: tl.constexpr):
    """Labels of points [blk * BP, +BP) of a row in iteration `it`: argmax over the n centroids of
    x . c * (1 / (|c| + eps)); CHG[it, row] counts the labels that changed (integer atomics: the same total in any
    order). A row whose labels did not change in the iteration before has converged: its centroids and labels stay
    as they are (what recomputing them gives, bit for bit), so it is skipped (STOP; else every iteration runs). The
    final assignment also counts the labels per (split, cluster) in FCNT."""
    p = blk * BP + tl.arange(0, BP)
    pm = p < L
    converged = False
    if STOP & (it > 0):
        converged = tl.load(CHG + (it - 1) * R + row64, cache_modifier=".cg") == 0
    if converged:
        label = tl.load(LAB + row64 * C + p, mask=pm, other=0, cache_modifier=".cg")
    else:
        d = tl.arange(0, DP)
        x = tl.load(XP + (row64 * C + p)[:, None] * D + d[None, :], mask=pm[:, None] & (d < D)[None, :], other=0.0)
        if ELEM:  # running max per (point, column): no reduction inside the loop, one at the end
            best2 = tl.full([BP, BC], float("-inf"), tl.float32)
            idx2 = tl.zeros([BP, BC], tl.int32)
        else:
            best = tl.full([BP], float("-inf"), tl.float32)
            label = tl.zeros([BP], tl.int32)
        inv_next = tl.load(INVN + row64 * K + tl.arange(0, BC), mask=tl.arange(0, BC) < n, other=0.0)
        for c0 in range(0, n, BC):  # centroids and norms cached: the grid barrier's acquire makes this phase see them
            c = c0 + tl.arange(0, BC)
            cm = c < n
            cent = tl.load(CENT + (row64 * K + nc + c)[:, None] * D + d[None, :], mask=cm[:, None] & (d < D)[None, :],
                           other=0.0)
            inv = inv_next
            inv_next = tl.load(INVN + row64 * K + c + BC, mask=c + BC < n, other=0.0)  # the next block's, early
            s = _dot(x, tl.trans(cent), None, PREC) * inv[None, :]  # [BP, BC] fp32
            if c0 + BC > n:
                s = tl.where(cm[None, :], s, float("-inf"))
            if ELEM:
                better2 = s > best2  # strict: ties keep the earlier block's (lower) id
                best2 = tl.where(better2, s, best2)
                idx2 = tl.where(better2, c[None, :], idx2)
            else:
                m = tl.max(s, axis=1)
                i = tl.min(tl.where(s == m[:, None], c[None, :], 2147483647), axis=1)  # the first max
                better = m > best  # strict: ties keep the earlier block's (lower) id
                best = tl.where(better, m, best)
                label = tl.where(better, i, label)
        if ELEM:  # the first max: the lowest id among the columns' maxima
            m = tl.max(best2, axis=1)
            label = tl.min(tl.where(best2 == m[:, None], idx2, 2147483647), axis=1)
        if it == 0:
            changed = tl.sum(pm.to(tl.int32), axis=0)  # (no labels before)
        else:
            old = tl.load(LAB + row64 * C + p, mask=pm, other=0, cache_modifier=".cg")
            changed = tl.sum(((old != label) & pm).to(tl.int32), axis=0)
        tl.store(LAB + row64 * C + p, label, mask=pm)
        if changed > 0:
            tl.atomic_add(CHG + it * R + row64, changed, sem="relaxed")
    if final:
        tl.atomic_add(FCNT + (row64 * NS + p // chunk) * K + label, 1, mask=pm, sem="relaxed")


@triton_jit()
def _update_item(row64, s, cb, pid, XP, CENT, INVN, LAB, PART, PCNT, UCNT, SCR, L, n, nc, chunk, nsu, epoch, C, K, D,
                 NS, NCB, DP: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr, SUB: tl.constexpr,
                 PREC: tl.constexpr):
    """Clusters [cb * BC, +BC) over split s's points: PCNT = member counts, PART = fp32 key sums. SUB labels at a
    time, the points of this block's clusters are compacted (in point order) into the program's scratch SCR, then
    their keys summed by one-hot dots [BC, BP] x [BP, D]: ~BC / n of the points, not all of them (the one-hot dot
    over every point cost what an assignment costs). The last of the row's nsu splits to finish this block (UCNT
    counts them) reduces it: the partials in split order / the count, in the state's dtype, and the new 1/|c| (an
    empty cluster keeps both)."""
    p_lo = s * chunk
    p_hi = tl.minimum(p_lo + chunk, L)
    c = cb * BC + tl.arange(0, BC)
    cm = c < n
    d = tl.arange(0, DP)
    dm = d < D
    acc = tl.zeros([BC, DP], tl.float32)
    hits = tl.zeros([BC, 16], tl.float32)  # every column counts the members (a dot with ones: exact below 2^24)
    scr = SCR + pid * (2 * SUB)  # [point ids | their labels]
    for q0 in range(p_lo, p_hi, SUB):
        p = q0 + tl.arange(0, SUB)
        label = tl.load(LAB + row64 * C + p, mask=p < p_hi, other=-1)
        mine = (label >= cb * BC) & (label < cb * BC + BC)
        mi = mine.to(tl.int32)
        at = tl.cumsum(mi, axis=0) - mi
        tl.store(scr + at, p, mask=mine)
        tl.store(scr + SUB + at, label, mask=mine)
        cnt = tl.sum(mi, axis=0)
        tl.debug_barrier()  # the scratch written by the program's other threads
        for j0 in range(0, cnt, BP):
            j = j0 + tl.arange(0, BP)
            jm = j < cnt
            pi = tl.load(scr + j, mask=jm, other=0).to(tl.int64)
            lb = tl.load(scr + SUB + j, mask=jm, other=-1)
            x = tl.load(XP + (row64 * C + pi)[:, None] * D + d[None, :], mask=jm[:, None] & dm[None, :], other=0.0)
            hot = c[:, None] == lb[None, :]  # [BC, BP]
            if _INTERPRET:  # (its bool -> bf16 conversion is wrong too)
                hot = hot.to(tl.float32)
            else:
                hot = hot.to(x.dtype)
            acc = _dot(hot, x, acc, PREC)
            hits = _dot(hot, tl.full([BP, 16], 1.0, hot.dtype), hits, PREC)
        tl.debug_barrier()  # every read of the scratch done before the next SUB overwrites it
    at = (row64 * NS + s) * K + c
    tl.store(PCNT + at, tl.max(hits, axis=1).to(tl.int32), mask=cm)
    tl.store(PART + at[:, None] * DP + d[None, :], acc, mask=cm[:, None])
    tl.debug_barrier()  # the block's partials are stored before its arrival (release)
    if tl.atomic_add(UCNT + row64 * NCB + cb, 1, sem="acq_rel", scope="gpu") == epoch * nsu - 1:
        acc = tl.zeros([BC, DP], tl.float32)
        count = tl.zeros([BC], tl.int32)
        for s2 in range(0, nsu, 2):  # two splits' loads in flight, added in split order
            at = (row64 * NS + s2) * K + c
            two = s2 + 1 < nsu
            p0 = tl.load(PART + at[:, None] * DP + d[None, :], mask=cm[:, None], other=0.0, cache_modifier=".cg")
            p1 = tl.load(PART + (at + K)[:, None] * DP + d[None, :], mask=cm[:, None] & two, other=0.0,
                         cache_modifier=".cg")
            count += tl.load(PCNT + at, mask=cm, other=0, cache_modifier=".cg")
            count += tl.load(PCNT + at + K, mask=cm & two, other=0, cache_modifier=".cg")
            acc += p0
            acc += p1  # (+0.0 where there is no second split: exact, the same sum)
        new = tl.math.div_rn(acc, tl.maximum(count, 1).to(tl.float32)[:, None]).to(CENT.dtype.element_ty)
        keep = cm & (count > 0)
        tl.store(CENT + (row64 * K + nc + c)[:, None] * D + d[None, :], new, mask=keep[:, None] & dm[None, :])
        nf = new.to(tl.float32)
        norm = tl.sqrt_rn(tl.sum(nf * nf, axis=1))
        tl.store(INVN + row64 * K + c, tl.math.div_rn(tl.full([BC], 1.0, tl.float32), norm + 1e-8), mask=keep)


@triton_jit()
def _finalize_row(row, FILL, CSIZE, CSTART, NCL, CEND, FCNT, n, nc, mbase, nsu, K, NS, BC: tl.constexpr):
    """Sizes and starts of the row's new clusters; FCNT[s, k] becomes the member offset of split s's first point
    of cluster k (the scatter's cursor); n_clusters, cluster_end."""
    row64 = tl.cast(row, tl.int64)
    carry = mbase
    for c0 in range(0, n, BC):
        c = c0 + tl.arange(0, BC)
        cm = c < n
        size = tl.zeros([BC], tl.int32)
        for s in range(0, nsu):
            size += tl.load(FCNT + (row64 * NS + s) * K + c, mask=cm, other=0, cache_modifier=".cg")
        start = carry + tl.cumsum(size, axis=0) - size
        tl.store(CSIZE + row64 * K + nc + c, size, mask=cm)
        tl.store(CSTART + row64 * K + nc + c, start, mask=cm)
        cursor = start
        for s in range(0, nsu):
            at = FCNT + (row64 * NS + s) * K + c
            v = tl.load(at, mask=cm, other=0, cache_modifier=".cg")
            tl.store(at, cursor, mask=cm)
            cursor += v
        carry += tl.sum(size, axis=0)
    tl.store(NCL + row, nc + n)
    tl.store(CEND + row, tl.load(FILL + row))


@triton_jit()
def _scatter_item(row64, s, PTS, LAB, MEMBERS, CURSOR, L, chunk, C, K, NS, BP: tl.constexpr):
    """members[cursor[label] + rank] = slot for split s's points, BP at a time in point order (stable)."""
    p_lo = s * chunk
    p_hi = tl.minimum(p_lo + chunk, L)
    i = tl.arange(0, BP)
    for p0 in range(p_lo, p_hi, BP):
        p = p0 + i
        pm = p < p_hi
        label = tl.load(LAB + row64 * C + p, mask=pm, other=-1, cache_modifier=".cg")
        slot = tl.load(PTS + row64 * C + p, mask=pm, other=0)
        same = (label[:, None] == label[None, :]) & pm[None, :]  # [BP, BP]
        rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)  # earlier points of its cluster
        n_same = tl.sum(same.to(tl.int32), axis=1)
        at = CURSOR + (row64 * NS + s) * K + label
        pos = tl.load(at, mask=pm, other=0, cache_modifier=".cg") + rank
        tl.store(MEMBERS + row64 * C + pos, slot, mask=pm & (pos < C))
        tl.debug_barrier()  # every cursor read before the block's last point of each cluster advances it
        tl.store(at, pos + 1, mask=pm & (rank == n_same - 1))
        tl.debug_barrier()


@triton_jit()
def _kmeans_kernel(KEYS, BIAS, FILL, BUDGET, CENT, CSIZE, CSTART, MEMBERS, NCL, CEND,
                   INFO, VC, PTS, XP, LAB, INVN, PART, PCNT, FCNT, UCNT, CHG, BAR, SCR,
                   R, H, C, K, D, NS, NCB, NCH, n_sink, tpc, window, wc, seed_hi, seed_lo, hoff, iters,
                   p_begin, p_end,
                   RP: tl.constexpr, DP: tl.constexpr, PREC: tl.constexpr, GRID_SYNC: tl.constexpr,
                   CH: tl.constexpr, NCHP: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BPA: tl.constexpr,
                   BCA: tl.constexpr, BCU: tl.constexpr, BPU: tl.constexpr, BSU: tl.constexpr, BCF: tl.constexpr,
                   BPS: tl.constexpr, STOP: tl.constexpr, AEL: tl.constexpr = False, KINDS: tl.constexpr = 63):
    """Phases [p_begin, p_end) (module docstring), each program taking work items pid, pid + grid, ...; with
    GRID_SYNC a grid barrier between phases (the persistent launch, p_begin = 0). Phases: 0 count, 1 write, then
    (assign, update) x iters, the final assign, finalize, scatter."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    r = tl.arange(0, RP)
    rm = r < R
    if p_begin <= 1:  # any row due? (later launches read it from INFO: the state changes at the end)
        fill = tl.load(FILL + r, mask=rm, other=0)
        ce = tl.load(CEND + r, mask=rm, other=0)
        ready = rm & (fill >= tl.load(BUDGET + 1))
        active = ready & ((ce == 0) | (fill - ce >= window))
    else:
        active = tl.load(INFO + r * 8, mask=rm, other=0, cache_modifier=".cg") != 0
    if tl.max(active.to(tl.int32), axis=0) > 0:
        for p in range(p_begin, p_end):
            q = p - 2
            # 0 count, 1 write, 2 assign, 3 update, 4 finalize, 5 scatter
            kind = tl.where(p <= 1, p, tl.where(q <= 2 * iters, 2 + q % 2, q - 2 * iters + 3))
            if (KINDS & 3) != 0:
                if kind <= 1:
                    for item in range(pid, NCH * R, G):  # chunk-major: the first chunks of every row first
                        j = item // R
                        row64 = tl.cast(item % R, tl.int64)
                        if (KINDS & 1) != 0:
                            if kind == 0:
                                _count_chunk(row64, j, FILL, BUDGET, NCL, CEND, BIAS, CSIZE, INFO, VC, C, K, NCH,
                                             window, CH)
                        if (KINDS & 2) != 0:
                            if kind == 1:
                                _write_chunk(row64, j, KEYS, FILL, BUDGET, NCL, CEND, BIAS, CENT, MEMBERS, INFO, VC,
                                             PTS, XP, INVN, C, K, D, H, NS, NCH, n_sink, tpc, window, wc, seed_hi,
                                             seed_lo, hoff, DP, CH, NCHP, BW, BK, BPU)
            if (KINDS & 4) != 0:
                if kind == 2:
                    Lmax = tl.max(tl.load(INFO + r * 8 + 1, mask=rm, other=0, cache_modifier=".cg"), axis=0)
                    for item in range(pid, tl.cdiv(Lmax, BPA) * R, G):
                        blk = item // R
                        row64 = tl.cast(item % R, tl.int64)
                        L = tl.load(INFO + row64 * 8 + 1, cache_modifier=".cg")
                        n = tl.load(INFO + row64 * 8 + 2, cache_modifier=".cg")
                        if (blk * BPA < L) & (n > 0):
                            nc = tl.load(INFO + row64 * 8 + 3, cache_modifier=".cg")
                            chunk = tl.load(INFO + row64 * 8 + 5, cache_modifier=".cg")
                            _assign_block(row64, blk, XP, CENT, INVN, LAB, FCNT, CHG, L, n, nc, chunk, C, K, D, NS, R,
                                          q // 2, q == 2 * iters, DP, BPA, BCA, PREC, STOP, AEL)
            if (KINDS & 8) != 0:
                if kind == 3:
                    nmax = tl.max(tl.load(INFO + r * 8 + 2, mask=rm, other=0, cache_modifier=".cg"), axis=0)
                    ncb = tl.cdiv(nmax, BCU)
                    for item in range(pid, ncb * NS * R, G):
                        cb = item % ncb  # the cluster blocks of one (split, row) are neighbours: its keys stay in L2
                        s = item // ncb // R
                        row64 = tl.cast(item // ncb % R, tl.int64)
                        L = tl.load(INFO + row64 * 8 + 1, cache_modifier=".cg")
                        n = tl.load(INFO + row64 * 8 + 2, cache_modifier=".cg")
                        chunk = tl.load(INFO + row64 * 8 + 5, cache_modifier=".cg")
                        moved = True
                        if STOP:  # else converged: the centroids stay
                            moved = tl.load(CHG + (q // 2) * R + row64, cache_modifier=".cg") > 0
                        if (s * chunk < L) & (cb * BCU < n) & moved:
                            nc = tl.load(INFO + row64 * 8 + 3, cache_modifier=".cg")
                            nsu = tl.load(INFO + row64 * 8 + 6, cache_modifier=".cg")
                            _update_item(row64, s, cb, pid, XP, CENT, INVN, LAB, PART, PCNT, UCNT, SCR, L, n, nc,
                                         chunk, nsu, q // 2 + 1, C, K, D, NS, NCB, DP, BCU, BPU, BSU, PREC)
            if (KINDS & 16) != 0:
                if kind == 4:
                    for row in range(pid, R, G):
                        at = INFO + tl.cast(row, tl.int64) * 8
                        if tl.load(at, cache_modifier=".cg") != 0:
                            _finalize_row(row, FILL, CSIZE, CSTART, NCL, CEND, FCNT,
                                          tl.load(at + 2, cache_modifier=".cg"), tl.load(at + 3, cache_modifier=".cg"),
                                          tl.load(at + 4, cache_modifier=".cg"), tl.load(at + 6, cache_modifier=".cg"),
                                          K, NS, BCF)
            if (KINDS & 32) != 0:
                if kind == 5:
                    for item in range(pid, NS * R, G):
                        s = item // R
                        row64 = tl.cast(item % R, tl.int64)
                        L = tl.load(INFO + row64 * 8 + 1, cache_modifier=".cg")
                        n = tl.load(INFO + row64 * 8 + 2, cache_modifier=".cg")
                        chunk = tl.load(INFO + row64 * 8 + 5, cache_modifier=".cg")
                        if (s * chunk < L) & (n > 0):
                            _scatter_item(row64, s, PTS, LAB, MEMBERS, FCNT, L, chunk, C, K, NS, BPS)
            if GRID_SYNC:
                if p + 1 < p_end:
                    _grid_sync(BAR, (p + 1) * G)


# -- launcher ------------------------------------------------------------------------------------------
def supports_triton(keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start, members,
                    n_clusters, cluster_end) -> bool:
    """Whether the CUDA path runs triton_kmeans_cluster: Triton installed, 16/32-bit float keys, D <= 256, the
    state contiguous (shapes and dtypes are checked by the op)."""
    return (triton is not None and keys.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and keys.shape[3] <= 256 and keys.shape[2] < 2**30
            and all(t.is_contiguous() for t in (keys, bias, fill, centroids, cluster_size, cluster_start, members,
                                                   n_clusters, cluster_end)))


def _splits(R: int, C: int, K: int, DP: int) -> int:
    ns = max(1, min(MAX_SPLITS, -(-C // SPLIT_POINTS)))
    return max(1, min(ns, PARTIAL_BYTES // max(1, R * K * DP * 4)))


_GRIDS = {}  # persistent grid size per (device, compiled kernel's specialisation)


def _persistent_programs(args, meta, dev) -> int:
    """Programs of the persistent launch: every one must be resident at once (they wait for each other at the grid
    barriers), so SMs x the CTAs per SM that the compiled kernel's registers, shared memory and warps allow (at most
    MAX_CTAS_PER_SM). Compiles the kernel (warmup: no launch) the first time per specialisation."""
    spec = tuple((a == 1, a % 16 == 0) if isinstance(a, int) else (a.dtype, a.data_ptr() % 16 == 0) for a in args)
    key = (dev, tuple(sorted(meta.items())), spec)
    if key not in _GRIDS:
        kernel = _kmeans_kernel.warmup(*args, grid=(1,), GRID_SYNC=True, **meta)
        kernel._init_handles()
        props = torch.cuda.get_device_properties(dev)
        threads = 32 * meta["num_warps"]
        regs = -(-max(kernel.n_regs, 1) // 8) * 8 * threads  # allocated per warp in units of 256
        smem = kernel.metadata.shared + 1024  # + the CTA's reserved shared memory
        ctas = min(MAX_CTAS_PER_SM, getattr(props, "regs_per_multiprocessor", 65536) // regs,
                   getattr(props, "max_threads_per_multi_processor", 2048) // threads,
                   getattr(props, "shared_memory_per_multiprocessor", 233472) // smem)
        _GRIDS[key] = props.multi_processor_count * max(1, ctas)
    return _GRIDS[key]


def triton_kmeans_cluster(keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start, members,
                          n_clusters, cluster_end, n_sink: int, tokens_per_cluster: int, window: int,
                          window_clusters: int, iters: int, seed: int, *, head_offset: int = 0, persistent: bool = True,
                          programs: int | None = None, splits: int | None = None, block_p: int | None = None,
                          block_c: int | None = None, update_c: int = UPDATE_C, update_p: int | None = None,
                          update_sub: int = UPDATE_SUB, final_c: int = FINAL_C, scatter_p: int = SCATTER_P,
                          prep_chunk: int = PREP_CHUNK, write_p: int = WRITE_P, init_k: int = INIT_K,
                          num_warps: int = 8, num_stages: int | None = None, maxnreg: int | None = MAXNREG,
                          assign_elem: bool = False, stop_when_converged: bool = True, on_launch=None) -> None:
    """Launch the kernel (module docstring). head_offset: the layer's index of the state's head 0 (hashed as
    head_offset + h, as the reference). persistent: one launch with grid barriers (programs: all resident,
    _persistent_programs, on CUDA; 1 elsewhere: the interpreter runs programs one after the other) or one launch per
    phase (programs: 4 per SM, 3 elsewhere). The other keywords tune it (block sizes: powers of two >= 16; splits
    >= 1); the defaults halve the point and centroid blocks (and pipeline 2 stages) for rows of more than 256 bytes
    (fp32 keys of D 128, 16-bit of D 256) to stay within the shared memory. Every value gives the same labels, the
    centroids up to the summation order. stop_when_converged=False runs every iteration of a row whose labels no
    longer change (the worst case's time; the same result). update_sub: labels compacted at a time by the update
    (its scratch: 8 bytes each per program). maxnreg caps the registers per thread (CUDA; None: the compiler's
    choice). assign_elem: the assignment keeps a running max per (point, column) and reduces once at the end
    (measured no faster on an H100; kept as a knob). on_launch(phase, compiled kernel) is called after each
    launch (profiling; phase None for the persistent launch). Under TRITON_INTERPRET=1 it runs on CPU tensors,
    which is how the kernel is tested without a GPU."""
    if triton is None:
        raise NotImplementedError("triton_kmeans_cluster needs Triton (pip install triton)")
    _check_inputs(keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start, members,
                  n_clusters, cluster_end, n_sink, tokens_per_cluster, window, window_clusters, iters, head_offset)
    B, H, C, D = keys.shape
    K = centroids.shape[2]
    R = B * H
    if R == 0 or C == 0:
        return
    dev = keys.device
    DP = max(16, triton.next_power_of_2(D))
    NS = splits or _splits(R, C, K, DP)
    shrink = max(1, DP * keys.element_size() // 256)  # rows of more than 256 bytes: smaller tiles
    block_p = block_p or max(16, BLOCK_P // shrink)
    block_c = block_c or max(16, BLOCK_C // shrink)
    update_p = update_p or max(16, UPDATE_P // shrink)
    num_stages = num_stages or (3 if shrink == 1 else 2)
    kk = max(K, 1)
    NCB = triton.cdiv(kk, update_c)
    NCH = triton.cdiv(C, prep_chunk)
    info = torch.empty(R, INFO_W, dtype=torch.int32, device=dev)
    vc = torch.empty(R, NCH, dtype=torch.int32, device=dev)
    pts = torch.empty(R, C, dtype=torch.int32, device=dev)
    lab = torch.empty(R, C, dtype=torch.int32, device=dev)
    xp = torch.empty(R, C, D, dtype=keys.dtype, device=dev)
    invn = torch.empty(R, kk, dtype=torch.float32, device=dev)
    part = torch.empty(R, NS, kk, DP, dtype=torch.float32, device=dev)
    pcnt = torch.empty(R, NS, kk, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    cap = programs or (MAX_CTAS_PER_SM * sms if persistent else 4 * sms)  # programs at most
    scr = torch.empty(cap, 2 * update_sub, dtype=torch.int32, device=dev)  # the update's compaction, per program
    counters = torch.zeros(1 + (iters + 1) * R + R * NCB + R * NS * kk, dtype=torch.int32, device=dev)  # one memset
    bar, chg, counters = counters[:1], counters[1:1 + (iters + 1) * R], counters[1 + (iters + 1) * R:]
    ucnt, fcnt = counters[:R * NCB], counters[R * NCB:]
    seed_mix = mix32(seed & MASK32)
    prec = "tf32x3" if keys.dtype == torch.float32 else "tf32"  # fp32: ~fp32 accuracy on tensor cores
    n_phases = 2 * iters + 5
    args = (keys, bias, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters, cluster_end,
            info, vc, pts, xp, lab, invn, part, pcnt, fcnt, ucnt, chg, bar, scr, R, H, C, K, D, NS, NCB, NCH, n_sink,
            tokens_per_cluster, window, window_clusters, seed_mix >> 16, seed_mix & 0xFFFF, head_offset, iters)
    meta = dict(RP=triton.next_power_of_2(R), DP=DP, PREC=prec, CH=prep_chunk, NCHP=triton.next_power_of_2(NCH),
                BW=write_p, BK=init_k, BPA=block_p, BCA=block_c, BCU=update_c, BPU=update_p, BSU=update_sub,
                BCF=final_c, BPS=scatter_p, STOP=bool(stop_when_converged), AEL=bool(assign_elem),
                num_warps=num_warps, num_stages=num_stages)
    if maxnreg and dev.type == "cuda":
        meta["maxnreg"] = maxnreg
    if persistent:
        G = programs or (_persistent_programs((*args, 0, n_phases), meta, dev) if dev.type == "cuda" else 1)
        assert G <= cap, (G, cap)
        kernel = _kmeans_kernel[(G,)](*args, 0, n_phases, GRID_SYNC=True, **meta)
        if on_launch is not None:
            on_launch(None, kernel)
    else:
        G = programs or (4 * sms if dev.type == "cuda" else 3)
        for p in range(n_phases):  # each launch compiled for its phase's kind alone (its own registers)
            q = p - 2
            kind = p if p <= 1 else 2 + q % 2 if q <= 2 * iters else q - 2 * iters + 3
            kernel = _kmeans_kernel[(G,)](*args, p, p + 1, GRID_SYNC=False, KINDS=1 << kind, **meta)
            if on_launch is not None:
                on_launch(p, kernel)


# -- op registration -----------------------------------------------------------------------------------


@torch.library.custom_op("kvrewrite::kmeans_cluster",
                         mutates_args=("centroids", "cluster_size", "cluster_start", "members", "n_clusters",
                                       "cluster_end"))
def kmeans_cluster(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    budget: torch.Tensor,
    centroids: torch.Tensor,
    cluster_size: torch.Tensor,
    cluster_start: torch.Tensor,
    members: torch.Tensor,
    n_clusters: torch.Tensor,
    cluster_end: torch.Tensor,
    *,
    n_sink: int,
    tokens_per_cluster: int,
    window: int,
    window_clusters: int,
    iters: int,
    seed: int,
    head_offset: int = 0,
) -> None:
    """ClusterKV's k-means of the due rows, appended to the CSR cluster index (module docstring). head_offset: the
    layer's index of the state's first KV head (tensor parallelism: the initialisation hashes the layer's head)."""
    args = (keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start, members,
            n_clusters, cluster_end, n_sink, tokens_per_cluster, window, window_clusters, iters)
    _check_inputs(*args, head_offset)
    reference_kmeans_cluster(*args, seed, head_offset=head_offset)


@kmeans_cluster.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters,
      cluster_end, *, n_sink, tokens_per_cluster, window, window_clusters, iters, seed, head_offset=0):
    args = (keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start, members,
            n_clusters, cluster_end, n_sink, tokens_per_cluster, window, window_clusters, iters)
    _check_inputs(*args, head_offset)
    if supports_triton(*args[:12]):
        triton_kmeans_cluster(*args, seed, head_offset=head_offset)
        return
    if triton is not None:
        reference_fallback("kmeans_cluster: no Triton kernel for this state (%s, D=%d, or its layout); running the "
                           "tensor code (host syncs)", keys.dtype, keys.shape[3])
    reference_kmeans_cluster(*args, seed, head_offset=head_offset)


@kmeans_cluster.register_fake
def _(keys, values, bias, slot_pos, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters,
      cluster_end, *, n_sink, tokens_per_cluster, window, window_clusters, iters, seed, head_offset=0):
    return None
