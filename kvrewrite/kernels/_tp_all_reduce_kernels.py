"""kvrewrite::tp_all_reduce's push kernel: the sum over the ranks (plus the residual) in one launch that meets each
peer once.

Why: torch's one-shot kernel (torch.ops.symm_mem.one_shot_all_reduce_copy) copies the rank's partial sum into its
own symmetric buffer, meets every peer at a barrier, reads their buffers, and meets them at a second barrier before
its buffer may be written again: 6.9-7.6 us per 8 KB decode row on two H200s, 64 per Llama-3.1-8B step at tp=2
(docs/tensor-parallel.md).

How (push, double-buffered):
- Every rank's symmetric buffer holds two slots of WORLD regions (one per source rank) of `region` elements, then
  a flag block (int32 [WORLD, MAX_PROGRAMS]; zeroed by tp_all_reduce.prepare, as the call counts). Program p of
  rank r stores its share of x straight into region r of slot s on every peer (NVLink writes), then sets its flag
  (r, p) on every peer to the call's epoch, its call count + 1: an exchange at system scope with release order
  whose old value is never read, so the program does not wait for its round trip.
- It then waits until each peer's flag (q, p) in its own buffer has reached the epoch (acquire loads; a signed
  int32 difference, so counts may wrap), reads region q of slot s from its own memory, and sums in rank order in
  float32: every rank adds the same numbers in the same order, so every rank holds the same bits (at two ranks,
  a + b: NCCL's sum bit for bit).
- The slot alternates per call (s = that program's call count & 1, counted in a local int32 per program). The next
  write into slot s comes two calls later, after this rank saw the peer's flag of the call in between, which the
  peer set only once its kernel of this call had completed (stream order): so the peer read slot s first. A peer
  is thus at most one call ahead, its flag the epoch or one more. One meeting per call instead of two.
- Before stop 47 the flags were 0/1, raised by a compare-and-swap 0 -> 1 that spun while the peer had not yet
  taken the previous one, and taken back by a compare-and-swap 1 -> 0: the raise waited for an NVLink round trip.
  Measured on two H200s: 3.4-3.6 us per 8-64 KB call with the epochs (python -m kvrewrite.bench.all_reduce, stop
  47) against 4.2 with the compare-and-swap (stop 44, another lease); the 8B tp=2 step in one lease, the two forms
  one after the other: 2.903 against 2.914 ms/token (docs/tensor-parallel.md, "Stop 47").
- The residual, when given, is added as the graph added it: the sum rounded to x's dtype, then (sum + residual)
  rounded again (what an add of two bf16 tensors computes), so the next GEMV's norm reads the residual stream
  without an add of its own.
- Grid-stride over blocks with at most MAX_PROGRAMS programs, all resident at once: a program waits only for the
  program of the same index on the peers, which runs since every program is scheduled.
- Launched with PDL (kernels/_pdl.py), signalling first ("Trigger first" there, since stop 45; before, after the
  wait): the next kernel (a GEMV with a constant weight) is scheduled and loads its first tile while this one waits
  for the kernel before it and for the peers; every load of this one comes after its wait. The ops launch these kernels
  from a custom op's body, so they ask `_pdl.launch_options(x, direct=True)`: without `direct` (stop 44) the
  launches ran without PDL (_pdl.launch_options says why).
Every rank must call the op in the same order with the same shapes (the graphs are the same on every rank).

The norm kernel (_push_all_reduce_rms_norm_kernel, kvrewrite::tp_all_reduce_rms_norm): the same meeting in one
program that holds the whole row (up to NORM_MAX_ELEMENTS), then h = the sum (+ residual) and n = RMSNorm(h) in the
split norm's arithmetic (kernels/gemv_rms_norm.row_rms_norm): n has the split norm's bits up to its
NORM_REGISTER_ELEMENTS (8192); past it the split norm loops over its tiles and reduces the squares in another order,
so n agrees within a few ulps (1.4e-6 in float32 at 12288 elements, stop 46's 2-GPU check). Its calls use a buffer of
their own (the "norm" channel, tp_all_reduce.prepare), whose slots alternate with its own call count (COUNT[0]).

Tried and dropped (stop 46): NCCL's LL exchange in the norm kernel (each value sent as an 8-byte word with the call's
epoch, the receiver polling its own buffer: no fence, no compare-and-swap). It passed the 2-GPU checks bit for bit,
and ran the 8B tp=2 step in 2.96 ms/token against 2.90 with the flags, in one lease of two H200s (its row of 4096
words took 255 registers a thread and 40 bytes of stack at 4 warps; at 8 warps no spill, but other n bits).

Measured (two H200s, one run, 64 chained calls in a CUDA graph, python -m kvrewrite.bench.all_reduce; stop 47, the
epoch flags): 3.4 us per 8-16 KB call against torch's one-shot 6.8-7.8 and NCCL's 11.1-12.3, 9.3 us at 1 MiB (14.8,
19.7); bit for bit NCCL's sum (the compare-and-swap form, stop 44: 4.2 us per 8-16 KB call, 10.3 at 1 MiB).
Tests: tests/kernels/test_tp_all_reduce_triton.py (the interpreter, rank 1 played by the test), the 2-GPU test.
"""
from __future__ import annotations

from kvrewrite.kernels._pdl import wait_and_signal
from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels.gemv import _launch_config as _gemv_launch_config
from kvrewrite.kernels.gemv_rms_norm import NORM_WARPS, row_rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

MAX_PROGRAMS = 64  # programs per launch (grid-stride beyond): all resident on any GPU this runs on
BLOCK = 1024  # elements per program and block: 2 KB of bf16, 16 bytes per thread at 4 warps


def flag_offset(world: int, max_bytes: int) -> int:
    """Byte offset of the flag block in every rank's buffer: after two slots of `world` regions of max_bytes."""
    return 2 * world * max_bytes


def buffer_bytes(world: int, max_bytes: int) -> int:
    """Bytes of the symmetric buffer: two slots of `world` regions of max_bytes each, then the flags."""
    return flag_offset(world, max_bytes) + world * MAX_PROGRAMS * 4


@triton_jit()
def _block_offsets(pid, i, programs, BLOCK: tl.constexpr):
    """Offsets of program pid's i-th block (blocks pid, pid + programs, ...: the grid stride)."""
    return tl.max_contiguous(tl.multiple_of((pid + i * programs) * BLOCK + tl.arange(0, BLOCK), BLOCK), BLOCK)


@triton_jit()
def _meet_peers(PTRS, pid, epoch, FLAG_OFFSET: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                FLAGS_PER_RANK: tl.constexpr):
    """Program pid's meeting with every peer after its pushes: set flag (RANK, pid) on every peer to `epoch` (this
    program's call count + 1; release, an exchange whose old value is never read, so nothing waits for its round
    trip), then wait until each peer's flag (r, pid) in this rank's buffer has reached epoch (acquire), then a
    barrier; returns this rank's buffer address (int64). The caller's barrier before it orders every thread's pushes
    before the release. Counts may wrap: "reached" is a signed int32 difference >= 0 (a peer runs at most one call
    ahead, so its flag is epoch or epoch + 1)."""
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = (tl.load(PTRS + r) + FLAG_OFFSET).to(tl.pointer_type(tl.int32)) + RANK * FLAGS_PER_RANK + pid
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    own = tl.load(PTRS + RANK)
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = (own + FLAG_OFFSET).to(tl.pointer_type(tl.int32)) + r * FLAGS_PER_RANK + pid
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while seen - epoch < 0:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    return own


@triton_jit()
def _sum_ranks(own, res, mine, offs, m, REGION: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
               HAS_RES: tl.constexpr):
    """The sum over the ranks at offsets `offs` (any shape): this rank's values `own`, every peer's from its region of
    this rank's slot `mine`, added in rank order in float32 (every rank the same sum, the same bits) and rounded to
    own's dtype; with HAS_RES, + res rounded again (what the graph's add of two tensors of that dtype computes; res
    is not read without it). Shared by both kernels."""
    acc = tl.zeros(own.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += own.to(tl.float32)
        else:
            peer = tl.load(tl.multiple_of(mine + r * REGION, 16) + offs, mask=m, other=0.0, volatile=True)
            acc += peer.to(tl.float32)
    out = acc.to(own.dtype)
    if HAS_RES:
        out = (out.to(tl.float32) + res.to(tl.float32)).to(own.dtype)
    return out


@triton_jit()
def _push_all_reduce_kernel(
    X, RES, OUT,  # RES: the residual (HAS_RES) or X again
    PTRS, COUNT,  # int64 [WORLD]: every rank's buffer address; int32 [MAX_PROGRAMS]: this rank's calls per program
    n,
    ITERS: tl.constexpr,  # blocks per program: cdiv(blocks, programs) (the grid stride; 1 up to 64 blocks)
    REGION: tl.constexpr,  # elements of one (slot, source rank) region
    FLAG_OFFSET: tl.constexpr,  # bytes of the slots before the flag block
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    FLAGS_PER_RANK: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    TRIGGER_FIRST: tl.constexpr,  # with PDL: let the next kernel launch before the wait (_pdl.TRIGGER_FIRST)
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dt = X.dtype.element_ty
    if PDL:  # the next kernel (a GEMV with a constant weight) launches and loads its first tile during the meeting
        wait_and_signal(TRIGGER_FIRST)
    calls = tl.load(COUNT + pid)
    slot = calls & 1
    # push this rank's share into region RANK of the slot on every peer
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer = tl.multiple_of(tl.load(PTRS + r).to(tl.pointer_type(dt)) + (slot * WORLD + RANK) * REGION, 16)
            for i in range(ITERS):  # past the last block the mask is empty
                offs = _block_offsets(pid, i, programs, BLOCK)
                m = offs < n
                tl.store(peer + offs, tl.load(X + offs, mask=m), mask=m)
    tl.debug_barrier()  # every thread's stores issued before the flag is raised (release orders them)
    own = _meet_peers(PTRS, pid, calls + 1, FLAG_OFFSET, RANK, WORLD, FLAGS_PER_RANK)
    mine = own.to(tl.pointer_type(dt)) + slot * WORLD * REGION
    for i in range(ITERS):
        offs = _block_offsets(pid, i, programs, BLOCK)
        m = offs < n
        x = tl.load(X + offs, mask=m, other=0.0)
        res = tl.load(RES + offs, mask=m, other=0.0) if HAS_RES else x
        tl.store(OUT + offs, _sum_ranks(x, res, mine, offs, m, REGION, RANK, WORLD, HAS_RES), mask=m)
    tl.store(COUNT + pid, calls + 1)


def launch_push(x, residual, out, ptrs, count, rank: int, world: int, max_bytes: int) -> None:
    """Launch the push kernel for contiguous x (and residual, or None) into out over a buffer of buffer_bytes(world,
    max_bytes) on every rank; ptrs and count as tp_all_reduce.prepare made them. No checks: the op's one_shot_buffer
    decided the path."""
    from kvrewrite.kernels import _pdl

    n = x.numel()
    pdl, launch = _pdl.launch_options(x, direct=True)  # a custom_op's body
    nblocks = triton.cdiv(n, BLOCK)
    programs = min(MAX_PROGRAMS, nblocks)
    _push_all_reduce_kernel[(programs,)](
        x, x if residual is None else residual, out, ptrs, count, n, ITERS=triton.cdiv(nblocks, programs),
        REGION=max_bytes // x.element_size(), FLAG_OFFSET=flag_offset(world, max_bytes), RANK=rank, WORLD=world,
        FLAGS_PER_RANK=MAX_PROGRAMS, HAS_RES=residual is not None, BLOCK=BLOCK, PDL=pdl,
        TRIGGER_FIRST=_pdl.TRIGGER_FIRST, num_warps=4, **launch,
    )


@triton_jit()
def _push_all_reduce_rms_norm_kernel(
    X, RES, NW, H, NORMED,  # RES: the residual (HAS_RES) or X again; H: the sum (+ residual); NORMED: RMSNorm(H)
    PTRS, COUNT,  # as the push kernel's, of the norm channel's buffer (one program: COUNT[0])
    n, eps,
    REGION: tl.constexpr,
    FLAG_OFFSET: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    FLAGS_PER_RANK: tl.constexpr,
    HAS_RES: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_TILES: tl.constexpr,  # the row in registers as [ROW_TILES, BLOCK_K] (n <= ROW_TILES * BLOCK_K)
    PDL: tl.constexpr,
    TRIGGER_FIRST: tl.constexpr,
):
    """The push kernel's sum (+ residual) of one row in one program, then the RMSNorm of the result: h and n stored.
    One program holds the whole row, so the norm needs no second meeting; the GEMV after it (kernels/gemv.py, a
    constant weight) launches at this kernel's start and loads its first weight tiles while it meets the peers."""
    dt = X.dtype.element_ty
    tile = tl.arange(0, ROW_TILES)[:, None]
    cols = tile * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    k_ok = cols < n
    if PDL:  # the next kernel (a GEMV with a constant weight) launches and loads its first tile during the meeting
        wait_and_signal(TRIGGER_FIRST)
    calls = tl.load(COUNT)
    slot = calls & 1
    x = tl.load(X + cols, mask=k_ok, other=0.0)
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer = tl.load(PTRS + r).to(tl.pointer_type(dt)) + (slot * WORLD + RANK) * REGION
            tl.store(peer + cols, x, mask=k_ok)
    res = tl.load(RES + cols, mask=k_ok, other=0.0) if HAS_RES else x  # before the meeting: latency behind the peers'
    nw = tl.load(NW + cols, mask=k_ok, other=0.0).to(tl.float32)
    tl.debug_barrier()
    own = _meet_peers(PTRS, 0, calls + 1, FLAG_OFFSET, RANK, WORLD, FLAGS_PER_RANK)
    mine = own.to(tl.pointer_type(dt)) + slot * WORLD * REGION
    h = _sum_ranks(x, res, mine, cols, k_ok, REGION, RANK, WORLD, HAS_RES)
    tl.store(H + cols, h, mask=k_ok)
    tl.store(NORMED + cols, row_rms_norm(h, nw, tile, n, eps, dt, BLOCK_K, ROW_TILES, UNIT_OFFSET), mask=k_ok)
    tl.store(COUNT, calls + 1)


NORM_MAX_ELEMENTS = 16384  # the longest row the norm kernel holds in registers (70B: 8192), a warp per 1024


def launch_push_rms_norm(x, residual, norm_weight, eps: float, unit_offset: bool, h, normed, ptrs, count, rank: int,
                         world: int, max_bytes: int) -> None:
    """Launch the norm kernel for contiguous x of n <= NORM_MAX_ELEMENTS elements (and residual, or None; norm_weight
    [n]) into h and normed, over the norm channel's buffer (buffer_bytes(world, max_bytes) on every rank). No checks:
    kvrewrite::tp_all_reduce_rms_norm decided the path."""
    from kvrewrite.kernels import _pdl

    n = x.numel()
    block_k = _gemv_launch_config(1, n)["block_k"]  # the split norm's tiles (gemv's K tiles): its squares' order
    tiles = triton.next_power_of_2(triton.cdiv(n, block_k))
    pdl, launch = _pdl.launch_options(x, direct=True)  # a custom_op's body
    _push_all_reduce_rms_norm_kernel[(1,)](
        x, x if residual is None else residual, norm_weight, h, normed, ptrs, count, n, float(eps),
        REGION=max_bytes // x.element_size(), FLAG_OFFSET=flag_offset(world, max_bytes), RANK=rank, WORLD=world,
        FLAGS_PER_RANK=MAX_PROGRAMS, HAS_RES=residual is not None, UNIT_OFFSET=bool(unit_offset),
        BLOCK_K=block_k, ROW_TILES=tiles, PDL=pdl, TRIGGER_FIRST=_pdl.TRIGGER_FIRST,
        num_warps=max(NORM_WARPS, tiles * block_k // 1024), **launch,
    )
