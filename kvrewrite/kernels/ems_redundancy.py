"""kvrewrite::ems_redundancy — each to-be-merged entry's merge destination (docs/contracts/ems.md §6.8).

a = raw_keys (pre-RoPE keys: pos "without") when raw_keys has entries, else keys (post-RoPE: pos "with"). For every
TBM entry d (cls 3) of a due row, over the centres c (cls 2):

    cos(x, y) = (x . y) / (||x|| ||y||) in fp32 from the stored dtype (dot first, then divide); 0 if a norm is 0
    R_dc = max(cos(a_d, a_c), 0) * max(cos(v_d, v_c), 0)       (two negative cosines are anti-similar: decision 8)
    best_d = max_c R_dc;  c* = the smallest c with R_dc == best_d
    dest_d = c* if (tau < 1 and best_d >= tau) else -1           (-1: the zero class; tau >= 1 never merges)

dest = e for cls 1 and 2 (kept as themselves), -1 for cls 0 and 4 and for every entry of a row not due.

Inputs: keys, values [B, Hkv, C, D]; raw_keys [B, Hkv, C or 0, D]; cls [B, Hkv, C] int32 (kvrewrite::ems_partition);
due [B, Hkv] bool. Args: tau (float in [0, 1]). Returns dest [B, Hkv, C] int32.

Backends: the reference below (static-shape tensor code: the cosine matrices by matmuls in blocks of BLOCK TBM rows,
no host reads, deterministic) is the CPU path and the ground truth. The CUDA path is `_cuda_impl`'s choice: the
Triton kernel below once KERNELS_CHECKED_ON_GPU records that its GPU tests passed, else the reference.

Triton kernels (grids fixed by the shapes): 1. per row, the due TBM entries listed in ascending order (a chunked
cumsum); 2. grid (P, rows, S splits of the centre range; two launches, 32-entry blocks for rows under BIG_TBM TBM
entries and 128-entry ones from there): program p walks the row's blocks of BLOCK_T listed TBM entries p, p + P, ...
up to its TBM count (decode: ~32 TBM per row, one block); a block's TBM rows of a and v stay in registers with their
fp32 norms, and it walks its split's entries in centre blocks of BLOCK_N (a block without a centre is skipped): two
tl.dot products (fp32 accumulate; fp32 inputs at IEEE precision, never TF32), clamped at 0, each multiplied by its
centre's reciprocal norm, multiplied (RECIP_NORMS, the default; the TBM entry's norms are divided out after the walk;
without it, each dot divided by its norm product, tl.div_rn: dot first, then divide; 0 for a zero norm); a running
argmax per TBM row where a later block wins only when strictly larger (ties: the smallest centre), stored per split;
3. per entry block, dest: the splits combined in ascending order by the same strict rule. CENTRE_LIST (the default):
launch 1 also lists each row's centres, and the big tier's launch 2 becomes two: the listed centres' reciprocal
norms, once, then the walk of the list in blocks of LIST_BLOCK_N (`_redundancy_listed_kernel`: every block full of
centres, no branch, so its loads are pipelined; LIST_CENTRE_ROWS, the default: R as [centres, TBM], the best so far
kept per place of a [BLOCK_N, BLOCK_T] tile and reduced over the centres once after the walk).
Deterministic, no atomics, no host read, every output entry written once. It differs from the reference only in the
fp32 order of the dot and norm sums, so dest agrees exactly wherever no two R_dc are within a few ulps of each other
or of tau (§11; the GPU tests construct such gaps, and exact ties between identical vectors agree).

Checked: through Triton's interpreter against the reference and the naive model
(tests/kernels/test_ems_redundancy_triton.py), and compiled on an H100 (torch 2.11, Triton 3.6) against the reference
on the same GPU (fp32/fp16/bf16, D 64/128, C 1031, pos with/without, tau 0/0.6/1, padding, rows not due), exact
ties, five other blockings, the naive model, a CUDA graph replay (tests/kernels/test_ems_redundancy_gpu.py: 32
passed). Measured there on a Llama-3.1-8B-shaped 32k state at budget 0.2 (Hkv 8, C 6866, D 128, bf16;
tests/kernels/test_ems_compress_gpu.py run as a script, CUDA events around an eager call, Python launch overhead
included): B = 1 prefill-chunk compression (287 TBM per row) 0.45 ms vs the reference's 29.9 ms, decode-time (32
TBM per row) 0.30 ms vs 29.9 ms (the main launch itself 141 us: one TBM block per row, 16 centre splits); B = 8:
2.4 ms vs 228 ms and 0.36 ms vs 226 ms.
"""
from __future__ import annotations  # the kernel's `tl.constexpr` annotations stay strings without Triton


import torch

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels.ems_score import check_due

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its reference; only triton_ems_redundancy raises
    triton = tl = None

NAME = "kvrewrite::ems_redundancy"
CENTRE, TBM = 2, 3


BLOCK = 1024  # TBM rows per step of the reference: bounds its [B, Hkv, BLOCK, C] temporaries


def _unit(x):
    """(x fp32, ||x|| fp32) of x [B, H, C, D]."""
    x = x.float()
    return x, x.norm(dim=-1)


def _cosines(x, n, d0, d1):
    """[B, H, d1 - d0, C] fp32 cosines of rows d0..d1 of x against every row (dot first, then divide by the
    product of the norms; 0 where a norm is 0)."""
    den = n[..., d0:d1, None] * n[..., None, :]
    dot = x[..., d0:d1, :] @ x.transpose(-1, -2)
    return torch.where(den > 0, dot / torch.where(den > 0, den, 1.0), 0.0)


def reference_ems_redundancy(keys, values, raw_keys, cls, due, tau):
    B, H, C, _ = keys.shape
    a, na = _unit(raw_keys if raw_keys.shape[2] > 0 else keys)
    v, nv = _unit(values)
    centre = (cls == CENTRE)[..., None, :]
    ar = torch.arange(C, device=keys.device)
    args = []
    for d0 in range(0, C, BLOCK):  # a loop over static sizes
        d1 = min(d0 + BLOCK, C)
        r = _cosines(a, na, d0, d1).clamp_min(0) * _cosines(v, nv, d0, d1).clamp_min(0)  # r[d, c]
        r = torch.where(centre, r, float("-inf"))
        best = r.amax(-1, keepdim=True)
        arg = torch.where(centre & (r == best), ar, C).amin(-1)  # the smallest centre at the maximum
        merge = (best[..., 0] >= tau) & (arg < C) if tau < 1 else torch.zeros_like(arg, dtype=torch.bool)
        args.append(torch.where(merge, arg, -1))
    arg = torch.cat(args, dim=-1)
    dest = torch.where(cls == TBM, arg, torch.where((cls == 1) | (cls == CENTRE), ar, -1))
    return torch.where(due[..., None], dest, -1).to(torch.int32)


def _check_inputs(keys, values, raw_keys, cls, due, tau):
    if keys.dim() != 4:
        raise ValueError(f"{NAME}: keys must be [B, Hkv, C, D], got {list(keys.shape)}")
    B, H, C, D = keys.shape
    if tuple(values.shape) != (B, H, C, D) or values.dtype != keys.dtype:
        raise ValueError(f"{NAME}: values must be {keys.dtype} {[B, H, C, D]} like keys, got {values.dtype} "
                         f"{list(values.shape)}")
    if (raw_keys.dim() != 4 or tuple(raw_keys.shape) not in ((B, H, C, D), (B, H, 0, D))
            or raw_keys.dtype != keys.dtype):
        raise ValueError(f"{NAME}: raw_keys must be {keys.dtype} {[B, H, C, D]} (pos 'without') or {[B, H, 0, D]} "
                         f"(pos 'with'), got {raw_keys.dtype} {list(raw_keys.shape)}")
    if tuple(cls.shape) != (B, H, C) or cls.dtype != torch.int32:
        raise ValueError(f"{NAME}: cls must be torch.int32 {[B, H, C]}, got {cls.dtype} {list(cls.shape)}")
    check_due(NAME, due, B, H)
    for field, t in (("values", values), ("raw_keys", raw_keys), ("cls", cls), ("due", due)):
        if t.device != keys.device:
            raise ValueError(f"{NAME}: {field} is on {t.device}, keys on {keys.device}")
    if not 0 <= tau <= 1:
        raise ValueError(f"{NAME}: tau must be in [0, 1], got {tau}")


# -- the Triton kernel --------------------------------------------------------------------------------
BLOCK_T = 32  # TBM rows per program (32/64/4 warps best on the H100 but at B = 8 prefill: 64/64/8 10% faster)
BLOCK_N = 64  # centres per step
# Rows with at least BIG_TBM TBM entries (a prefill chunk's compression) take a second launch of 128-row blocks and
# 8 warps; the others (a decode-time compression) the 32-row, 4-warp one. Each launch's programs return at once on
# a row of the other tier (the count is a device value: no host read). H200, Llama-3.1-8B shape, batch 8, C 8665
# (`python -m kvrewrite.bench.ems_prefill`, docs/bench.md "Stop 43 runs"), ms with 32 / 4 against 128 / 8: 32 TBM a
# row 0.35 / 1.12, 256 1.42 / 0.85, 512 2.72 / 1.61, 1024 5.32 / 3.11, 2048 10.4 / 6.0. The cut sits at the smallest
# measured count where 128 / 8 wins; the idle second launch costs 0.03 ms at 32 a row (0.375 ms for both tiers).
BIG_TBM = 256
BIG_BLOCK_T, BIG_WARPS = 128, 8
LIST_CHUNK = 1024  # entries per step of the TBM list
TARGET_PROGRAMS = 256  # splits of the centre range: about this many programs per TBM block column
# The main launch's grid is (P, rows, S): P programs per (row, split) walk the row's blocks p, p + P, ... up to its
# TBM count, a device value. The small tier's rows hold under BIG_TBM TBM entries, so P = BIG_TBM / BLOCK_T (8) gives
# each of their blocks a program; the big tier takes at most BIG_PROGRAMS (a 2048-token chunk's 16 blocks of 128).
# Before, both tiers had one program per possible block (C / BLOCK_T), and a decode-time compression (one block a
# row) dispatched thousands of idle programs: H200, 32k, budget 0.2, C 8665, CUDA-graph replays of the whole op
# (docs/bench.md, "Stop 50 runs"): 32 TBM a row took 114 us at batch 1 and 371 at batch 8. Block index fastest
# keeps a split's programs together (they read the same centres from L2): with the split index fastest the batch-8
# prefill compression (2048 a row) took 5% longer.
BIG_PROGRAMS = 16
# Blocks of centres that hold none (a decode-time row's window and new tokens: a few of its ~110 blocks) are skipped, a
# branch around their loads. Tried and dropped: computing every block, masked, so that Triton pipelines the loads
# across blocks (7 async copies in the sm_90 TTGIR against none). On an H200 (32k, budget 0.2, C 8665; docs/bench.md
# "Stop 51 runs") the whole op took 2.24 ms against 0.79 for a batch-1 chunk's 2048 TBM a row, 18.2 against 6.0 at
# batch 8, and 229 against 135 us for batch 1's decode-time 32: the centres' blocks are L2-resident, the skipped
# loads are what the branch saves.
# RECIP_NORMS: R_dc as (max(a_d . a_c, 0) x 1/|a_c|) (max(v_d . v_c, 0) x 1/|v_c|), compared as such over the centres,
# and divided by |a_d| |v_d| once per TBM entry after its walk: both norms of d are one positive factor of its whole
# row of R, so the argmax is the same up to rounding (a few ulps: what §11 already allows for the sums' order; exact
# ties between identical vectors stay ties). Per [BT, BN] tile that drops the two IEEE divisions, the denominator
# products and their guards; the centres' reciprocals are a [BN] vector. Compiled for sm_90 here (`python -m
# kvrewrite.bench.occupancy`: bf16, D 128, 4 splits): the big tier's launch 221 registers a thread and 2600 static
# SASS instructions against 255 and 3968 (one program an SM either way: 96 KB of shared memory), the small tier's 168
# and 2536 against 255 and 3568 (3 programs an SM instead of 2). H200 (bench/ems_prefill.py, batch 8, 32k, the late
# 2048-query chunk's compression; docs/bench.md "Stop 53 runs"): 3.24-3.28 ms (three runs) against 5.99-6.00 (two),
# the same dest; 0.49 / 0.91 / 1.73 ms against 0.84 / 1.58 / 3.05 at 256 / 512 / 1024 entries to merge a row (one
# run). On; `--kernel-option
# ems_redundancy.RECIP_NORMS=False` (or the launcher's recip_norms=False) times the divided form.
RECIP_NORMS = True
# CENTRE_LIST: the big tier (a prefill chunk's compression) walks the row's centres by a list instead of every entry
# block: launch 1 also lists the due centres in ascending order, a launch of its own writes each listed centre's
# reciprocal norms once (1/|a_c|, 1/|v_c|: every program of the row recomputed them from its tiles), and the main
# launch's centre loop has no branch and no class loads, so Triton pipelines its loads (`_redundancy_listed_kernel`;
# RECIP_NORMS' form of R only). Why: stop 55's profile of EMS's batch-8 prefill (H200) gave the redundancy 1.80 s of
# 13.6, about 4 us a 128 x 64 centre step where its two dot products need about 0.6 at the tensor cores' rate.
# H200, Llama-3.1-8B shape, batch 8, 32k (docs/bench.md "Stop 55 runs"): the late chunk's compression alone 2.28 ms
# against 3.23 (`python -m kvrewrite.bench.ems_prefill --kernels redundancy`, one run, the same dest; 1.40 against
# 1.71 at 1024 entries to merge a row, but 0.67 against 0.48 at 256 and 0.26 against 0.24 at 32: the list and norms
# launches' fixed cost, about 17 us at batch 8, which a decode-time compression (under BIG_TBM: the entry walk) pays
# too); the whole prefill 12.96-13.11 s in three runs against 13.87 for the entry walk in the same call. 2 or 4
# stages time the same as 3; 128-centre steps 2.14 ms alone but 13.08 s end to end (one run): 64 kept. All of it timed
# with the norms launch's loads 2 bytes wide (D unspecialised); with D specialised (16-byte loads; stop 56, one run)
# the listed walk is the faster from 256 entries to merge a row on: 0.38 ms against the entry walk's 0.49 at 256.
CENTRE_LIST = True
LIST_BLOCK_N = 64  # centres per step of the listed walk
LIST_STAGES = 3  # its software pipeline's stages
NORM_BLOCK = 64  # listed centres per program of the norms launch
# LIST_CENTRE_ROWS: the listed walk computes R as [centres, TBM] (`_redundancy_listed_kernel`'s ROWS). Why: ncu's
# source counters of the [TBM, centres] form (H200, stop 56, the late chunk's compression at batch 8) put 290 of the
# hot loop's 754 instructions a warp into loading the list places and norms one column at a time (48 predicated 4-byte
# loads a thread, their 64-bit addresses) and 17% of its stall samples on those loads (long scoreboard); as [centres,
# TBM] the hot loop is 577 instructions (sm_90, offline compile; 225 registers against 224). H200, the late chunk's
# compression alone (`python -m kvrewrite.bench.ems_prefill --kernels redundancy --quick`, docs/bench.md "Stop 56
# runs", one run, the same dest): 1.83 ms against 2.00; 1.04 / 0.58 / 0.36 ms against 1.12 / 0.63 / 0.38 at 1024 /
# 512 / 256 entries to merge a row; 128-centre steps 2.19. On; `--kernel-option
# ems_redundancy.LIST_CENTRE_ROWS=False` (or the launcher's centre_rows=False) times the [TBM, centres] form.
LIST_CENTRE_ROWS = True


@triton_jit(do_not_specialize=["C"])
def _tbm_list_kernel(CLS, DUE, TL, KPOS, NT, CL, NC, C, CH: tl.constexpr, CENTRES: tl.constexpr = False):
    """Launch 1 (grid rows): the row's due TBM entries in ascending order TL[0, NT), KPOS[e] = e's place (-1);
    CENTRES: its due centres in ascending order too, CL[0, NC)."""
    row = tl.program_id(0).to(tl.int64)
    due = tl.load(DUE + row) != 0
    n = tl.zeros([], tl.int32)
    nc = tl.zeros([], tl.int32)
    for c0 in range(0, C, CH):
        e = c0 + tl.arange(0, CH)
        m = e < C
        cl = tl.load(CLS + row * C + e, mask=m, other=0)
        t = m & due & (cl == 3)
        ti = t.to(tl.int32)
        k = n + tl.cumsum(ti, axis=0) - ti
        tl.store(TL + row * C + k, e, mask=t)
        tl.store(KPOS + row * C + e, tl.where(t, k, -1), mask=m)
        n += tl.sum(ti, axis=0)
        if CENTRES:
            ce = m & due & (cl == 2)
            ci = ce.to(tl.int32)
            tl.store(CL + row * C + nc + tl.cumsum(ci, axis=0) - ci, e, mask=ce)
            nc += tl.sum(ci, axis=0)
    tl.store(NT + row, n)
    if CENTRES:
        tl.store(NC + row, nc)


@triton_jit(do_not_specialize=["C", "nt_lo"])  # D specialised: with D a runtime value its loads were 2-byte (sm_90)
def _centre_norms_kernel(A, V, CL, NC, NT, IA, IV, C, D, nt_lo, BC: tl.constexpr, BLOCK_D: tl.constexpr):
    """CENTRE_LIST's launch (grid listed-centre blocks x rows): IA / IV[row, k] = 1 / |a| and 1 / |v| of the row's
    k-th listed centre (0 for a zero norm), on the rows of the big tier (at least nt_lo TBM entries) only."""
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    nc = tl.load(NC + row)
    if (tl.load(NT + row) >= nt_lo) & (blk * BC < nc):
        k = blk * BC + tl.arange(0, BC)
        mk = k < nc
        e = tl.load(CL + row * C + k, mask=mk, other=0)
        kd = tl.arange(0, BLOCK_D)
        at = (row * C + e)[:, None] * D + kd[None, :]
        _, _, na, nv = _tiles_and_norms(A, V, at, mk[:, None] & (kd < D)[None, :], 1)
        tl.store(IA + row * C + k, _recip(na), mask=mk)
        tl.store(IV + row * C + k, _recip(nv), mask=mk)


@triton_jit()
def _tiles_and_norms(A, V, at, m, AXIS: tl.constexpr):
    """The tiles of a and v at the offsets `at` (0 outside the mask m) and their fp32 norms along AXIS, the head dim."""
    xa = tl.load(A + at, mask=m, other=0.0)
    xv = tl.load(V + at, mask=m, other=0.0)
    xaf = xa.to(tl.float32)
    xvf = xv.to(tl.float32)
    return xa, xv, tl.sqrt_rn(tl.sum(xaf * xaf, axis=AXIS)), tl.sqrt_rn(tl.sum(xvf * xvf, axis=AXIS))


@triton_jit()
def _recip(n):
    """1 / n, 0 where n is 0 (a zero norm: cosine 0)."""
    return tl.where(n > 0.0, tl.div_rn(1.0, tl.where(n > 0.0, n, 1.0)), 0.0)


@triton_jit()
def _tbm_block(A, V, TL, row, C, D, nt, blk, BT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Block blk of the row's listed TBM places: the places k, their mask and their rows of a and v with fp32 norms."""
    kd = tl.arange(0, BLOCK_D)
    k = blk * BT + tl.arange(0, BT)
    mk = k < nt
    d = tl.load(TL + row * C + k, mask=mk, other=0)
    at = (row * C + d)[:, None] * D + kd[None, :]
    xa, xv, na, nv = _tiles_and_norms(A, V, at, mk[:, None] & (kd < D)[None, :], 1)
    return k, mk, xa, xv, na, nv


@triton_jit()
def _dots(xa, ya, xv, yv, IEEE: tl.constexpr):
    """The two dot products of a TBM block against a centre block (fp32 inputs at IEEE precision, never TF32)."""
    if IEEE:
        da = tl.dot(xa, ya, input_precision="ieee")
        dv = tl.dot(xv, yv, input_precision="ieee")
    else:
        da = tl.dot(xa, ya)
        dv = tl.dot(xv, yv)
    return da, dv


@triton_jit()
def _store_best(PB, PA, best, arg, na, nv, row, sp, k, mk, C, S: tl.constexpr, RECIP: tl.constexpr):
    """A block's best R and its centre into split sp's place; RECIP: the TBM rows' norms divided out first,
    R = (a_d . a_c / |a_c|)(v_d . v_c / |v_c|) / (|a_d| |v_d|), 0 for a zero norm (one factor of the whole row)."""
    if RECIP:
        den = na * nv
        best = tl.where(best > 0.0, tl.where(den > 0.0, tl.div_rn(best, tl.where(den > 0.0, den, 1.0)), 0.0), best)
    at_p = (row * S + sp) * C + k
    tl.store(PB + at_p, best, mask=mk)
    tl.store(PA + at_p, arg, mask=mk)


@triton_jit(do_not_specialize=["C", "CS", "nt_lo", "nt_hi", "P"])
def _redundancy_kernel(A, V, CLS, TL, NT, PB, PA, C, D, CS, nt_lo, nt_hi, P, S: tl.constexpr, IEEE: tl.constexpr,
                       BT: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr, RECIP: tl.constexpr = False):
    """Launch 2 (grid P x rows x S centre splits): best R and its smallest centre over the split's centres
    [sp * CS, (sp + 1) * CS) for the TBM places of blocks p, p + P, ... of BT places each, up to the row's TBM count
    nt (PB/PA[row, sp, place]), on the rows whose nt lies in [nt_lo, nt_hi) (the launch's tier; BIG_TBM). A
    block of centres holding none is skipped."""
    p = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    nt = tl.load(NT + row)
    if (nt >= nt_lo) & (nt < nt_hi):
        kd = tl.arange(0, BLOCK_D)
        for blk in range(p, tl.cdiv(nt, BT), P):
            k, mk, xa, xv, na, nv = _tbm_block(A, V, TL, row, C, D, nt, blk, BT, BLOCK_D)
            best = tl.full([BT], float("-inf"), tl.float32)
            arg = tl.full([BT], C, tl.int32)
            for c0 in range(sp * CS, tl.minimum(sp * CS + CS, C), BN):
                c = c0 + tl.arange(0, BN)
                mc = c < C
                cen = mc & (tl.load(CLS + row * C + c, mask=mc, other=0) == 2)
                if tl.sum(cen.to(tl.int32), axis=0) > 0:
                    ct = (row * C + c)[None, :] * D + kd[:, None]  # [BLOCK_D, BN]: the centres transposed
                    ya, yv, nya, nyv = _tiles_and_norms(A, V, ct, cen[None, :] & (kd < D)[:, None], 0)
                    da, dv = _dots(xa, ya, xv, yv, IEEE)
                    if RECIP:  # the TBM row's norms are one factor of its whole row: applied after the loop
                        r = (tl.maximum(da, 0.0) * _recip(nya)[None, :]) * (tl.maximum(dv, 0.0) * _recip(nyv)[None, :])
                    else:
                        dena = na[:, None] * nya[None, :]
                        denv = nv[:, None] * nyv[None, :]
                        ca = tl.where(dena > 0.0, tl.div_rn(da, tl.where(dena > 0.0, dena, 1.0)), 0.0)
                        cv = tl.where(denv > 0.0, tl.div_rn(dv, tl.where(denv > 0.0, denv, 1.0)), 0.0)
                        r = tl.maximum(ca, 0.0) * tl.maximum(cv, 0.0)
                    r = tl.where(cen[None, :], r, float("-inf"))
                    tmax = tl.max(r, axis=1)
                    targ = tl.min(tl.where(cen[None, :] & (r == tmax[:, None]), c[None, :], C), axis=1)
                    up = tmax > best  # a later block wins only when strictly larger: ties to the smallest centre
                    best = tl.where(up, tmax, best)
                    arg = tl.where(up, targ, arg)
            _store_best(PB, PA, best, arg, na, nv, row, sp, k, mk, C, S, RECIP)


@triton_jit()
def _listed_block(A, V, CL, IA, IV, row, C, D, c0, hi, kd, BN: tl.constexpr, ROWS: tl.constexpr):
    """List places [c0, c0 + BN) of the row: their centres (C past hi), the centres' rows of a and v ([BN, BLOCK_D]
    with ROWS, else transposed: [BLOCK_D, BN]; zero past hi) and their reciprocal norms (0 past hi)."""
    j = c0 + tl.arange(0, BN)
    mj = j < hi
    c = tl.load(CL + row * C + j, mask=mj, other=C)  # a place past hi: centre C, zero tiles, R 0
    if ROWS:
        ct = (row * C + c)[:, None] * D + kd[None, :]
        mt = mj[:, None] & (kd < D)[None, :]
    else:
        ct = (row * C + c)[None, :] * D + kd[:, None]
        mt = mj[None, :] & (kd < D)[:, None]
    ya = tl.load(A + ct, mask=mt, other=0.0)
    yv = tl.load(V + ct, mask=mt, other=0.0)
    ia = tl.load(IA + row * C + j, mask=mj, other=0.0)
    iv = tl.load(IV + row * C + j, mask=mj, other=0.0)
    return c, ya, yv, ia, iv


@triton_jit()
def _listed_walk_cols(A, V, CL, IA, IV, row, C, D, lo, hi, kd, xa, xv, IEEE: tl.constexpr, BT: tl.constexpr,
                      BN: tl.constexpr):
    """The walk of list places [lo, hi) for one TBM block with R as [TBM, centres]: (best R, its smallest centre)
    [BT], reduced over each block's centres as it goes."""
    best = tl.full([BT], float("-inf"), tl.float32)
    arg = tl.full([BT], C, tl.int32)
    for c0 in range(lo, hi, BN):
        c, ya, yv, ia, iv = _listed_block(A, V, CL, IA, IV, row, C, D, c0, hi, kd, BN, False)
        da, dv = _dots(xa, ya, xv, yv, IEEE)
        # R >= 0 at every listed centre and 0 at a place past hi, whose centre C loses every tie: no mask
        r = (tl.maximum(da, 0.0) * ia[None, :]) * (tl.maximum(dv, 0.0) * iv[None, :])
        tmax = tl.max(r, axis=1)
        targ = tl.min(tl.where(r == tmax[:, None], c[None, :], C), axis=1)
        up = tmax > best  # the list ascends: a later block wins only when strictly larger, as in the walk
        best = tl.where(up, tmax, best)
        arg = tl.where(up, targ, arg)
    return best, arg


@triton_jit()
def _listed_walk_rows(A, V, CL, IA, IV, row, C, D, lo, hi, kd, xa, xv, IEEE: tl.constexpr, BT: tl.constexpr,
                      BN: tl.constexpr):
    """ROWS' walk of list places [lo, hi) for one TBM block (xa, xv [BT, BLOCK_D]): (best R, its smallest centre)
    [BT] (`_redundancy_listed_kernel`'s docstring)."""
    xat = tl.trans(xa)
    xvt = tl.trans(xv)
    best2 = tl.full([BN, BT], float("-inf"), tl.float32)
    arg2 = tl.full([BN, BT], C, tl.int32)
    for c0 in range(lo, hi, BN):
        c, ya, yv, ia, iv = _listed_block(A, V, CL, IA, IV, row, C, D, c0, hi, kd, BN, True)
        da, dv = _dots(ya, xat, yv, xvt, IEEE)  # [BN, BT]
        r = (tl.maximum(da, 0.0) * ia[:, None]) * (tl.maximum(dv, 0.0) * iv[:, None])
        up = r > best2
        best2 = tl.where(up, r, best2)
        arg2 = tl.where(up, c[:, None], arg2)
    best = tl.max(best2, axis=0)
    arg = tl.min(tl.where(best2 == best[None, :], arg2, C), axis=0)
    return best, arg


@triton_jit(do_not_specialize=["C", "nt_lo", "nt_hi", "P"])
def _redundancy_listed_kernel(A, V, TL, NT, CL, NC, IA, IV, PB, PA, C, D, nt_lo, nt_hi, P, S: tl.constexpr,
                              IEEE: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr,
                              ROWS: tl.constexpr = False):
    """CENTRE_LIST's launch 2 (grid P x rows x S splits of the row's listed centres): as `_redundancy_kernel` with
    RECIP, its centre blocks taken from the list CL[0, NC) (split sp: places [sp * cs, (sp + 1) * cs), cs = NC / S
    rounded up to BN) and the centres' reciprocal norms from IA / IV: no skipped block, no class load, the loop's loads
    prefetched by the pipeliner. A place past the split's end reads as centre C with R 0, which no listed centre's
    R (>= 0) loses a tie to, so dest is the same as the entry walk's.
    ROWS (LIST_CENTRE_ROWS): R as [centres, TBM] (the centres on the MMA's M side), so a centre's list place and
    norms are per-row values (two loads a thread, not one a column), and the best so far is kept elementwise, a
    [BN, BT] tile whose place i holds the best of the centres i, i + BN, ... (strictly larger wins: the smallest
    centre on a tie, the list ascending), reduced over the centres once after the walk (the largest R, the smallest
    centre holding it): the same argmax as the per-block reductions."""
    p = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    nt = tl.load(NT + row)
    if (nt >= nt_lo) & (nt < nt_hi):
        nc = tl.load(NC + row)
        cs = tl.cdiv(tl.cdiv(nc, S), BN) * BN
        lo = sp * cs
        hi = tl.minimum(lo + cs, nc)
        kd = tl.arange(0, BLOCK_D)
        for blk in range(p, tl.cdiv(nt, BT), P):
            k, mk, xa, xv, na, nv = _tbm_block(A, V, TL, row, C, D, nt, blk, BT, BLOCK_D)
            if ROWS:
                best, arg = _listed_walk_rows(A, V, CL, IA, IV, row, C, D, lo, hi, kd, xa, xv, IEEE, BT, BN)
            else:
                best, arg = _listed_walk_cols(A, V, CL, IA, IV, row, C, D, lo, hi, kd, xa, xv, IEEE, BT, BN)
            _store_best(PB, PA, best, arg, na, nv, row, sp, k, mk, C, S, True)


@triton_jit(do_not_specialize=["C", "tau"])
def _dest_kernel(CLS, DUE, KPOS, PB, PA, DEST, C, tau, MERGE: tl.constexpr, S: tl.constexpr, BT: tl.constexpr):
    """Launch 3 (grid entry blocks x rows): dest of every entry; a TBM entry combines its S splits in ascending
    order (strictly larger wins: ties to the smallest centre)."""
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    e = blk * BT + tl.arange(0, BT)
    me = e < C
    cls = tl.load(CLS + row * C + e, mask=me, other=0)
    due = tl.load(DUE + row) != 0
    tbm = me & due & (cls == 3)
    dest = tl.where(me & due & ((cls == 1) | (cls == 2)), e, -1)
    if MERGE:
        kp = tl.load(KPOS + row * C + e, mask=tbm, other=0)
        best = tl.full([BT], float("-inf"), tl.float32)
        arg = tl.full([BT], C, tl.int32)
        for sp in tl.static_range(S):
            at = (row * S + sp) * C + kp
            b = tl.load(PB + at, mask=tbm, other=float("-inf"))
            a = tl.load(PA + at, mask=tbm, other=C)
            up = b > best
            best = tl.where(up, b, best)
            arg = tl.where(up, a, arg)
        merge = (best >= tau) & (arg < C)
        dest = tl.where(tbm, tl.where(merge, arg, -1), dest)
    tl.store(DEST + row * C + e, dest, mask=me)


def triton_ems_redundancy(keys, values, raw_keys, cls, due, tau, *, block_t: int | None = None,
                          block_n: int | None = None, splits: int | None = None, num_warps: int | None = None,
                          big_tbm: int | None = None, programs: int | None = None, recip_norms: bool | None = None,
                          centre_list: bool | None = None, list_stages: int | None = None,
                          centre_rows: bool | None = None):
    """The Triton kernels (module docstring): dest [B, Hkv, C] int32. Under TRITON_INTERPRET=1 they run on CPU
    tensors (how they are tested without a GPU; fp32 only there: the 3.6 interpreter's 16-bit tl.dot is wrong).
    splits: centre-range splits per TBM block (default: about TARGET_PROGRAMS programs per block column, by the
    row count: a function of the shapes only); programs: P, the main launch's programs per (row, split) (default:
    one per block the tier's rows can hold); any values give the same dest.
    Without block_t and num_warps the main launch runs in two tiers by each row's TBM count (BIG_TBM, or big_tbm: 0
    puts every row in the big one); with either, one launch of that blocking serves every row. recip_norms (default
    RECIP_NORMS): the TBM entry's norms applied once after its walk (the same dest up to rounding). centre_list
    (default CENTRE_LIST, RECIP_NORMS' form only): the big tier's launch, or the one launch of an explicit blocking,
    walks the row's listed centres (`_redundancy_listed_kernel`, blocks of block_n or LIST_BLOCK_N, list_stages or
    LIST_STAGES pipeline stages); centre_rows (default LIST_CENTRE_ROWS): that walk's R as [centres, TBM]."""
    if triton is None:
        raise NotImplementedError(f"{NAME}: the Triton kernel needs Triton (pip install triton)")
    _check_inputs(keys, values, raw_keys, cls, due, tau)
    recip = RECIP_NORMS if recip_norms is None else bool(recip_norms)
    listed = CENTRE_LIST if centre_list is None else bool(centre_list)
    if listed and not recip:
        if centre_list:
            raise ValueError(f"{NAME}: centre_list=True walks RECIP_NORMS' form of R; it cannot run with "
                             "recip_norms=False (leave one of them out)")
        listed = False  # the module's CENTRE_LIST with R divided per score: the entry walk
    if centre_rows and not listed:
        raise ValueError(f"{NAME}: centre_rows=True lays out the listed walk's R; it needs centre_list (and "
                         "recip_norms) on")
    B, H, C, D = keys.shape
    a = raw_keys if raw_keys.shape[2] > 0 else keys
    dest = torch.empty_like(cls)
    rows = B * H
    if rows * C == 0:
        return dest
    bn = block_n or BLOCK_N
    if block_t is None and num_warps is None:  # (nt_lo, nt_hi, rows a block, warps, listed) of each launch
        cut = BIG_TBM if big_tbm is None else big_tbm
        tiers = [(0, cut, BLOCK_T, 4, False), (cut, C + 1, BIG_BLOCK_T, BIG_WARPS, listed)]
        tiers = [t for t in tiers if t[0] < t[1]]
    else:
        tiers = [(0, C + 1, block_t or BLOCK_T, num_warps or 4, listed)]
    a, v, c = a.contiguous(), values.contiguous(), cls.contiguous()
    du = due.to(torch.int32).contiguous()
    merge = tau < 1
    walks_list = merge and any(t[4] for t in tiers)  # some launch walks the centre list: launch 1 writes it
    S = 1
    ws = torch.empty(3 if walks_list else 2, rows, C, dtype=torch.int32, device=keys.device)
    tlist, kpos = ws[0], ws[1]
    clist = ws[2] if walks_list else kpos  # without the list launch 1 never writes CL: any int32 buffer serves
    counts = torch.empty(2, rows, dtype=torch.int32, device=keys.device)
    nt, ncen = counts[0], counts[1]
    if merge:
        S = splits or max(1, min(16, TARGET_PROGRAMS // rows, triton.cdiv(C, bn)))
    pb = torch.empty(rows, S, C, dtype=torch.float32, device=keys.device)
    pa = torch.empty(rows, S, C, dtype=torch.int32, device=keys.device)
    if merge:
        _tbm_list_kernel[(rows,)](c, du, tlist, kpos, nt, clist, ncen, C, CH=min(LIST_CHUNK, triton.next_power_of_2(C)),
                                  CENTRES=walks_list)
        cs = triton.cdiv(triton.cdiv(C, S), bn) * bn
        block_d = max(16, triton.next_power_of_2(D))
        ieee = keys.dtype == torch.float32
        for lo, hi, bt, warps, walk_list in tiers:
            P = programs or min(triton.cdiv(min(hi - 1, C), bt), BIG_PROGRAMS)
            if walk_list:
                inv = torch.empty(2, rows, C, dtype=torch.float32, device=keys.device)
                _centre_norms_kernel[(triton.cdiv(C, NORM_BLOCK), rows)](a, v, clist, ncen, nt, inv[0], inv[1], C, D,
                                                                       lo, BC=NORM_BLOCK, BLOCK_D=block_d)
                _redundancy_listed_kernel[(P, rows, S)](
                    a, v, tlist, nt, clist, ncen, inv[0], inv[1], pb, pa, C, D, lo, hi, P, S=S, IEEE=ieee, BT=bt,
                    BN=block_n or LIST_BLOCK_N, BLOCK_D=block_d, ROWS=LIST_CENTRE_ROWS if centre_rows is None
                    else bool(centre_rows), num_warps=warps, num_stages=list_stages or LIST_STAGES)
            else:
                _redundancy_kernel[(P, rows, S)](
                    a, v, c, tlist, nt, pb, pa, C, D, cs, lo, hi, P, S=S, IEEE=ieee, BT=bt, BN=bn, BLOCK_D=block_d,
                    RECIP=recip, num_warps=warps)
    bt = tiers[0][2]
    _dest_kernel[(triton.cdiv(C, bt), rows)](c, du, kpos, pb, pa, dest, C, float(tau), MERGE=merge, S=S, BT=bt)
    return dest


# -- the CUDA path ------------------------------------------------------------------------------------
# tests/kernels/test_ems_redundancy_gpu.py passed on an H100 (torch 2.11, Triton 3.6; 32 tests incl. the blocking
# BLOCK_T 32 / BLOCK_N 64 / 4 warps, in a run of 92 with test_ems_merge_gpu.py and test_ems_compress_gpu.py, all
# passed); with CENTRE_LIST's cases on an H200 (stop 55): 86 passed, then the compress, merge and method GPU files 66
KERNELS_CHECKED_ON_GPU = True


def _cuda_impl(keys):
    """THE one place that decides the CUDA path: the Triton launcher once checked on a GPU and Triton imports, with
    D <= 256, else None (the reference, logged once)."""
    if not KERNELS_CHECKED_ON_GPU or triton is None or keys.shape[-1] > 256:
        return None
    return triton_ems_redundancy


@torch.library.custom_op(NAME, mutates_args=())
def ems_redundancy(keys: torch.Tensor, values: torch.Tensor, raw_keys: torch.Tensor, cls: torch.Tensor,
                   due: torch.Tensor, *, tau: float) -> torch.Tensor:
    """dest [B, Hkv, C] int32 of every entry (module docstring). CPU runs the reference; CUDA `_cuda_impl`'s."""
    _check_inputs(keys, values, raw_keys, cls, due, tau)
    return reference_ems_redundancy(keys, values, raw_keys, cls, due, tau)


@ems_redundancy.register_kernel("cuda")
def _(keys, values, raw_keys, cls, due, *, tau):
    _check_inputs(keys, values, raw_keys, cls, due, tau)
    launcher = _cuda_impl(keys)
    if launcher is not None:
        return launcher(keys, values, raw_keys, cls, due, tau)
    reference_fallback("ems_redundancy: CUDA runs the tensor reference (KERNELS_CHECKED_ON_GPU=%s, Triton %s, D=%d)",
                       KERNELS_CHECKED_ON_GPU, "missing" if triton is None else "present", keys.shape[-1])
    return reference_ems_redundancy(keys, values, raw_keys, cls, due, tau)


@ems_redundancy.register_fake
def _(keys, values, raw_keys, cls, due, *, tau):
    return torch.empty_like(cls)
