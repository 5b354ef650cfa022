"""kvrewrite::gemv_rms_norm — the residual add and the RMSNorm before a projection, fused into its GEMV (one row).

    h = x + residual                    (x's dtype; h = x where residual is None)
    n = RMSNorm(h)                      HF's spelling, see below
    y = F.linear(n, weight, bias)

Args:
    x, residual:  [..., K]  fp16/bf16/fp32, one row (x.numel() == K); residual like x, or None
    norm_weight:  [K]       x's dtype
    eps:          the norm's epsilon
    weight, bias: [N, K], [N] or None, as kvrewrite::gemv takes them (kernels/gemv.py)
    unit_offset:  False: Llama/Mistral/Qwen/Phi, n = norm_weight * (h32 * rsqrt(mean(h32^2) + eps)).to(dtype)
                  True:  Gemma,                  n = (h32 * rsqrt(mean(h32^2) + eps) * (1 + norm_weight32)).to(dtype)
                  (h32 = h.to(float32))
    constant_weight: as kvrewrite::gemv's (kernels/gemv.py): the first weight tile is loaded before the PDL wait
Returns:
    (y [..., N] contiguous, h): h = x + residual (shape of x, contiguous), the next layer's residual; without a
    residual h is an empty tensor (0 elements): h would be x itself, which an op may not return (its outputs may
    not alias its inputs), and a copy would cost a store and a tensor nobody reads (the pass keeps reading x).
    Mutates nothing.

Why: a batch-1 decode step of Llama-3.1-8B runs the add + RMSNorm before the qkv, gate_up and lm_head GEMVs as
65 small Inductor kernels (~2.6 us each, ~170 us a step of ~5.5 ms; docs/bench/e2e_h100_decode_profile_gemv.txt).
Fused, each GEMV program first sums h^2 over K (fp32), then streams its weight rows with n computed on the fly:
x, residual and norm_weight (8 KB each at K=4096) are re-read by every program from L1/L2, the weights once; the
first weight tile can be loaded before the sum (PRELOAD), so its latency overlaps it. Against a compiled add +
RMSNorm and then kvrewrite::gemv (bf16, K=4096, qkv / gate_up / lm_head; launch choices: the comment at BLOCK_N):
on an H100 22.3 / 84.2 / 343.5 us vs 23.7 / 85.7 / 344.9 (1.4-1.5 us saved per GEMV); on an H200, where the
re-read inputs cost more against the faster weight stream, 18.6 / 65.1 / 259.2 vs 19.3 / 63.2 / 243.9 (qkv gains,
gate_up and the lm_head lose 1.9 and 15 us).

From SPLIT_NORM_MIN_N output rows on (Llama-3.1-8B's gate/up and lm_head) the op runs as two launches instead: the
norm in one program, then kernels/gemv.py's kernel on n, which under PDL loads its constant weight's first tile while
the norm runs (H200: 63.3 / 247.0 us against the fused kernel's 66.1 / 266.1; snapkv end to end 4.68-4.69 ms/token
against 4.95-4.96 fused everywhere, in earlier calls of the same session; docs/bench.md "Stop 37 runs"). The redundant re-reads grow with the grid, so
the fused kernel stays below it (q/k/v: 17.7 us fused with a constant weight, 18.9 split).

Backends: CUDA runs the Triton kernel(s), other devices the aten ops the pass replaced, in their order and dtypes
(reference_aten), so a CPU graph computes the same bits before and after passes/fuse_rms_norm_into_gemv.py.
The kernel rounds where eager rounds (h to the dtype after the add; Llama: the normed value, then its product
with the weight; Gemma: once); it differs from eager by the fp32 summation order of the mean and of the
product, and by rsqrt's last bits (error_bound).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

from typing import Optional

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from kvrewrite.kernels import _pdl
from kvrewrite.kernels._pdl import gdc_launch_dependents, gdc_wait, wait_and_signal
from kvrewrite.kernels._triton_op import check_one_cuda_device, register_triton_op, triton_jit
from kvrewrite.kernels.gemv import ROUNDING, _launch_config, _weight_tile, early_weight, input_problem
from kvrewrite.kernels.gemv import _launch as _gemv_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the aten ops; only triton_gemv_rms_norm raises
    triton = tl = None

NAME = "kvrewrite::gemv_rms_norm"


def reference_aten(x, residual, norm_weight, eps, weight, bias=None, unit_offset=False):
    """The aten ops the op replaces, in HF's order and dtypes (the CPU path): (y, h), h None without residual."""
    h = x if residual is None else torch.add(x, residual)
    n = reference_rms_norm(h, norm_weight, eps, unit_offset)
    return F.linear(n, weight, bias).contiguous(), (None if residual is None else h)


def reference_rms_norm(h, norm_weight, eps, unit_offset=False):
    """HF's RMSNorm of h in its aten ops, order and dtypes (Llama's spelling, or Gemma's with unit_offset)."""
    h32 = h.to(torch.float32)
    r = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h32 * r * (norm_weight.to(torch.float32) + 1.0)).type_as(h)
    return norm_weight * (h32 * r).to(h.dtype)


def reference_f64(x, residual, norm_weight, eps, weight, bias=None, unit_offset=False):
    """(y, h, n) with h rounded to x's dtype once (as eager and the kernel do), n and y in float64, unrounded: what
    the GPU and interpreter tests compare the kernel with, within error_bound."""
    h = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    h64 = h.double()
    r = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    w64 = norm_weight.double()
    n = h64 * r * (w64 + 1.0 if unit_offset else w64)
    y = F.linear(n, weight.double(), None if bias is None else bias.double())
    return y, h, n


# unit roundoff of each dtype: the normed value is rounded to it (Llama: twice)
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def error_bound(x, weight, n64, y64):
    """What the kernel's y may differ from reference_f64's y64 by, elementwise:

        ROUNDING[dtype] |y64| + (c_n + 4 sqrt(K) 2^-24) sum_k |n64_k w_nk|,
        c_n = 2u + 2 sqrt(K) 2^-24 + 2^-21

    The second term is gemv's (kernels/gemv.py: the output's rounding and the fp32 summation order of the product);
    c_n bounds the relative error of each normed value n_k: at most two roundings to the dtype (u, the unit roundoff:
    Llama rounds h32*r, then its product with the weight), the rsqrt of an fp32 mean of K squares (half of the mean's
    summation-order error 4 sqrt(K) 2^-24, gemv's allowance, plus a few ulp for rsqrt) and the fp32 products."""
    K = weight.shape[1]
    c_n = 2 * UNIT[x.dtype] + 2 * K**0.5 * 2.0**-24 + 2.0**-21
    magnitude = F.linear(n64.abs(), weight.double().abs())
    return ROUNDING[x.dtype] * y64.abs() + (c_n + 4 * K**0.5 * 2.0**-24) * magnitude


def input_problem_rms(x, residual, norm_weight, weight, bias, name=NAME):
    """The error (ValueError or TypeError naming what is wrong) the op raises for these inputs, or None. Takes fake
    tensors too (passes/fuse_rms_norm_into_gemv.py asks it of the traced values)."""
    problem = input_problem(x, weight, bias, name)  # shapes, one row, dtypes of x / weight / bias
    if problem is not None:
        return problem
    K = weight.shape[1]
    if K == 0:
        return ValueError(f"{name}: K must be >= 1 (the norm's mean over K), got weight {tuple(weight.shape)}")
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype):
        return ValueError(f"{name}: residual must be x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                          f"{tuple(residual.shape)} {residual.dtype}")
    if tuple(norm_weight.shape) != (K,) or norm_weight.dtype != x.dtype:
        return ValueError(f"{name}: norm_weight must be [K] = ({K},) in x's dtype {x.dtype}, got "
                          f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    return None


def _check_inputs(x, residual, norm_weight, weight, bias, name=NAME):
    problem = input_problem_rms(x, residual, norm_weight, weight, bias, name)
    if problem is not None:
        raise problem


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA)
#
# kernels/gemv.py's kernel with a prologue: each program sums h^2 over K in BLOCK_K tiles (fp32; program 0
# also stores h), then streams its BLOCK_N weight rows, recomputing h and n per K tile. With a constant weight
# (EARLY_W) the first weight tile is loaded before the PDL wait, so it streams in during the previous kernel's tail
# and the prologue.
# ---------------------------------------------------------------------------------------------------


@triton_jit()
def _h(X, RES, cols, k_ok, stride_xk, stride_rk, dtype: tl.constexpr, HAS_RES: tl.constexpr):
    """h = x + residual at columns `cols` (any shape; 0 where not k_ok), rounded to the dtype as eager's add."""
    h = tl.load(X + cols * stride_xk, mask=k_ok, other=0.0)
    if HAS_RES:
        r = tl.load(RES + cols * stride_rk, mask=k_ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
    return h


@triton_jit()
def _scaled(h, nw, inv_rms, dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """n from h, the norm weight nw (fp32) and rsqrt(mean(h^2) + eps), rounded where eager rounds."""
    normed = h.to(tl.float32) * inv_rms
    if UNIT_OFFSET:
        return (normed * (nw + 1.0)).to(dtype)
    return (nw * normed.to(dtype).to(tl.float32)).to(dtype)


@triton_jit()
def _normed(X, RES, NW, cols, K, stride_xk, stride_rk, stride_nk, inv_rms, dtype: tl.constexpr,
            HAS_RES: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """n at columns `cols` (0 past K), rounded where eager rounds."""
    k_ok = cols < K
    h = _h(X, RES, cols, k_ok, stride_xk, stride_rk, dtype, HAS_RES)
    nw = tl.load(NW + cols * stride_nk, mask=k_ok, other=0.0).to(tl.float32)
    return _scaled(h, nw, inv_rms, dtype, UNIT_OFFSET)


@triton_jit()
def _inv_rms(X, RES, H, K, eps, stride_xk, stride_rk, store_h, dtype: tl.constexpr, BLOCK_K: tl.constexpr,
             HAS_RES: tl.constexpr):
    """rsqrt(mean(h^2) + eps) of h = x + residual over K in BLOCK_K tiles (fp32); with a residual, h (rounded to the
    dtype, as eager's add) is stored to H where store_h."""
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_ok = cols < K
        h = _h(X, RES, cols, k_ok, stride_xk, stride_rk, dtype, HAS_RES)
        if HAS_RES:
            tl.store(H + cols, h, mask=k_ok & store_h)
        h32 = h.to(tl.float32)
        squares += h32 * h32
    return tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton_jit()
def _gemv_rms_norm_kernel(
    X, RES, NW, W, BIAS, Y, H,
    N, K, eps,
    stride_xk, stride_rk, stride_nk, stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PRELOAD: tl.constexpr,  # load the first weight tile before the prologue: its latency overlaps the sum
    EARLY_W: tl.constexpr,  # PRELOAD's load before the PDL wait, for a constant weight (the launch sets PRELOAD too)
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel before any other load (kernels/_pdl.py)
):
    pid = tl.program_id(0)
    dtype = X.dtype.element_ty
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = W + rows[:, None].to(tl.int64) * stride_wn
    cols0 = tl.arange(0, BLOCK_K)
    if EARLY_W:
        w0 = _weight_tile(w_rows, cols0, row_ok, K, EVICT_FIRST)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if PRELOAD:
        if not EARLY_W:
            w0 = _weight_tile(w_rows, cols0, row_ok, K, EVICT_FIRST)
    inv_rms = _inv_rms(X, RES, H, K, eps, stride_xk, stride_rk, pid == 0, dtype, BLOCK_K, HAS_RES)

    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PRELOAD:
        n = _normed(X, RES, NW, cols0, K, stride_xk, stride_rk, stride_nk, inv_rms, dtype, HAS_RES, UNIT_OFFSET)
        acc += w0.to(tl.float32) * n.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K if PRELOAD else 0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        n = _normed(X, RES, NW, cols, K, stride_xk, stride_rk, stride_nk, inv_rms, dtype, HAS_RES, UNIT_OFFSET)
        w = _weight_tile(w_rows, cols, row_ok, K, EVICT_FIRST)
        acc += w.to(tl.float32) * n.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(BIAS + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


@triton_jit()
def row_rms_norm(h, nw, tile, K, eps, dtype: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TILES: tl.constexpr,
                 UNIT_OFFSET: tl.constexpr):
    """n = RMSNorm(h) of a row held in registers as [ROW_TILES, BLOCK_K] tiles (0 past K; `tile` the tiles' index
    column, nw the norm weight in fp32): the squares added tile by tile in _inv_rms's order, so n has the bits of the
    fused kernel's. Shared by the split norm's kernel and tp_all_reduce_rms_norm's (_tp_all_reduce_kernels.py)."""
    h32 = h.to(tl.float32)
    sq = h32 * h32
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(ROW_TILES):  # tile i alone (the others add exact zeros): _inv_rms's order
        squares += tl.sum(tl.where(tile == i, sq, 0.0), axis=0)
    inv_rms = tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
    return _scaled(h, nw, inv_rms, dtype, UNIT_OFFSET)


@triton_jit()
def _rms_norm_row_kernel(
    X, RES, NW, NORMED, H,
    K, eps,
    stride_xk, stride_rk, stride_nk,
    BLOCK_K: tl.constexpr,
    ROW_TILES: tl.constexpr,  # > 0: the row in registers as [ROW_TILES, BLOCK_K], one load of each input; 0: loops
    HAS_RES: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    PDL: tl.constexpr,
    TRIGGER_FIRST: tl.constexpr,  # with PDL: let the GEMV launch before the wait (_pdl.TRIGGER_FIRST)
):
    """The split norm's first launch, one program: h (stored with a residual) and n = RMSNorm(h) (stored to NORMED), the
    fused kernel's prologue and _normed in the same tiles, so n is the value each fused program computes. With
    ROW_TILES the row's K tiles sit in registers side by side: every load is issued at once and h is read once (the
    loops wait on one tile's loads after another, twice; this launch is on the step's critical path), and the sum of
    squares still adds the tiles in _inv_rms's order, so n has the same bits."""
    dtype = X.dtype.element_ty
    if PDL:  # the GEMV launches and loads its first (constant) weight tile during the norm (and, TRIGGER_FIRST, the wait)
        wait_and_signal(TRIGGER_FIRST)
    if ROW_TILES > 0:
        tile = tl.arange(0, ROW_TILES)[:, None]
        cols = tile * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        k_ok = cols < K
        h = _h(X, RES, cols, k_ok, stride_xk, stride_rk, dtype, HAS_RES)
        if HAS_RES:
            tl.store(H + cols, h, mask=k_ok)
        nw = tl.load(NW + cols * stride_nk, mask=k_ok, other=0.0).to(tl.float32)
        tl.store(NORMED + cols, row_rms_norm(h, nw, tile, K, eps, dtype, BLOCK_K, ROW_TILES, UNIT_OFFSET), mask=k_ok)
    else:
        inv_rms = _inv_rms(X, RES, H, K, eps, stride_xk, stride_rk, True, dtype, BLOCK_K, HAS_RES)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            n = _normed(X, RES, NW, cols, K, stride_xk, stride_rk, stride_nk, inv_rms, dtype, HAS_RES, UNIT_OFFSET)
            tl.store(NORMED + cols, n, mask=cols < K)


# SPLIT_NORM_MIN_N: from this many output rows on, the op runs as two launches, the norm in one program
# (_rms_norm_row_kernel) and then kernels/gemv.py's kernel on n. Under PDL with a constant weight the GEMV's
# programs launch while the norm runs and load their first weight tile before they wait for it; the weight stream
# then runs at plain gemv's rate, without every program re-reading x, the residual and the norm weight with every
# weight tile (what the fused kernel pays: 1.10-1.18x gemv alone on an H200). Measured: the module docstring and
# docs/bench.md "Stop 37 runs" (H200 only). A/B: --kernel-option gemv_rms_norm.SPLIT_NORM_MIN_N=0 (always split) or a value above every N (never).
SPLIT_NORM_MIN_N = 16384
NORM_WARPS = 4
# The norm kernel holds the row in registers (ROW_TILES) up to this many elements, with a warp per 1024 of them
# (at least NORM_WARPS): 32 elements of each input a thread. Longer rows loop over their tiles. Why: on an H200 the
# loops' form ended 4.4 us after the GEMV before it, on the step's critical path (docs/bench.md "Stop 38 runs"); the
# register form was timed end to end only together with two other launch changes (-0.9% there), not alone.
# A/B: --kernel-option gemv_rms_norm.NORM_REGISTER_ELEMENTS=0 (always the loops).
NORM_REGISTER_ELEMENTS = 8192

# Rows per program, warps and the first weight tile's preload, from the sweeps (bf16, qkv 6144, gate/up 28672, lm_head
# 128256 rows x 4096; kvrewrite/bench/gemv_rms_norm.py --sweep). 4 rows x 4 warps without the preload:
# - H200 (docs/bench/sweep_gemv_rms_norm_h200.json, 34 variants): the fastest on all three, 18.6 / 65.1 / 259.2 us,
#   where the H100's choice below takes 19.5 / 72.7 / 302.6 (gemv alone 16.1 / 59.7 / 240.2; a compiled add + RMSNorm,
#   then gemv: 19.3 / 63.2 / 243.9). A persistent variant (one prologue per program, then a flat loop over its row
#   blocks x K tiles) was 1.3-5x slower there and was dropped. So was a one-pass form (no prologue: the sum of
#   squares accumulated along the product, the row sums scaled by rsqrt at the end; docs/bench/
#   sweep_gemv_rms_norm_h200_onepass.json, 16 launches): at 4 rows x 4 warps 18.9 / 67.9 / 267.2 us against this
#   kernel's 18.6 / 65.5 / 261.5 in the same run, its best per shape 18.9 / 65.8 / 255.1 (8 rows, the lm_head only
#   faster), and end to end (snapkv, rw.compile with PDL) 4.96-4.99 ms/token against 4.92-4.94. So the prologue is not
#   what costs against gemv alone (16.1 / 59.7 / 240.2): the main loop, which reads x, the residual and the norm
#   weight with every weight tile, is.
# - H100 (docs/bench/sweep_gemv_rms_norm_h100.json): 22.3 / 84.2 / 343.5 us, within 0.5% of that sweep's fastest, 2 rows
#   x 8 warps with the preload (22.2 / 83.9 / 343.0; gemv alone 20.4 / 82.0 / 341.3; compiled add + RMSNorm, then
#   gemv: 23.7 / 85.7 / 344.9).
BLOCK_N, NUM_WARPS, PRELOAD = 4, 4, False


def launch_config(N, K, block_n=None, num_warps=None, preload=None, split_norm=None, norm_row_tiles=None,
                  **overrides):
    """gemv's launch configuration (kernels/gemv.py _launch_config) with this kernel's rows per program, warps
    and first-tile preload; with split_norm (default: N >= SPLIT_NORM_MIN_N), gemv's own launch configuration for
    the GEMV after the norm's launch, and the norm kernel's: norm_row_tiles (the row's K tiles held in registers,
    0 = loop over them; default: every tile where the row has at most NORM_REGISTER_ELEMENTS) and norm_warps."""
    split_norm = N >= SPLIT_NORM_MIN_N if split_norm is None else split_norm
    if split_norm:
        cfg = _launch_config(N, K, block_n=block_n, num_warps=num_warps, **overrides)
        if norm_row_tiles is None:
            tiles = triton.next_power_of_2(triton.cdiv(K, cfg["block_k"]))
            norm_row_tiles = tiles if tiles * cfg["block_k"] <= NORM_REGISTER_ELEMENTS else 0
        norm_warps = max(NORM_WARPS, norm_row_tiles * cfg["block_k"] // 1024)
        if preload is not None:  # a sweep of the fused kernel would otherwise time the split form unawares
            raise ValueError(f"gemv_rms_norm launch_config: preload={preload} tunes the fused kernel, but N = {N} "
                             f"runs the split norm (N >= SPLIT_NORM_MIN_N = {SPLIT_NORM_MIN_N} or split_norm=True); "
                             f"pass split_norm=False to tune the fused kernel")
        return dict(cfg, preload=False, split_norm=True, norm_row_tiles=norm_row_tiles, norm_warps=norm_warps)
    if norm_row_tiles is not None:
        raise ValueError(f"gemv_rms_norm launch_config: norm_row_tiles tunes the split norm's kernel, but N = {N} runs "
                         f"the fused kernel (N < SPLIT_NORM_MIN_N = {SPLIT_NORM_MIN_N}); pass split_norm=True")
    cfg = _launch_config(N, K, block_n=BLOCK_N if block_n is None else block_n,
                         num_warps=NUM_WARPS if num_warps is None else num_warps, **overrides)
    return dict(cfg, preload=PRELOAD if preload is None else preload, split_norm=False)


def triton_gemv_rms_norm(x, residual, norm_weight, eps, weight, bias=None, unit_offset=False, constant_weight=False,
                         **tuning):
    """The op on CUDA through Triton; validates its inputs. ``tuning`` overrides launch_config (the benchmark's
    sweep; the op never passes it)."""
    if triton is None:
        raise NotImplementedError("triton_gemv_rms_norm needs Triton (pip install triton); "
                                  "kvrewrite::gemv_rms_norm itself runs without it")
    _check_inputs(x, residual, norm_weight, weight, bias, "triton_gemv_rms_norm")
    tensors = [t for t in (x, residual, norm_weight, weight, bias) if t is not None]
    check_one_cuda_device("triton_gemv_rms_norm", tensors)
    return _launch(x, residual, norm_weight, eps, weight, bias, unit_offset, constant_weight, **tuning)


def _launch(x, residual, norm_weight, eps, weight, bias=None, unit_offset=False, constant_weight=False, **overrides):
    """Allocate the outputs and launch; no checks (Triton's interpreter runs it on CPU tensors)."""
    N, K = (int(n) for n in weight.shape)
    x1 = x.reshape(K)
    r1 = x1 if residual is None else residual.reshape(K)
    h = torch.empty(x.shape if residual is not None else (0,), dtype=x.dtype, device=x.device)
    cfg = launch_config(N, K, **overrides)
    early = early_weight(constant_weight)
    pdl, launch = _pdl.launch_options(x)
    if cfg["split_norm"]:
        normed = _launch_norm(x1, residual, r1, h, norm_weight, eps, unit_offset, cfg)
        gemv_tuning = {k: cfg[k] for k in ("block_n", "block_k", "num_warps", "num_stages", "evict_first")}
        return _gemv_launch(normed.view(x.shape), weight, bias, constant_weight, **gemv_tuning), h
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    wrap_triton(_gemv_rms_norm_kernel)[(triton.cdiv(N, cfg["block_n"]),)](
        x1, r1, norm_weight, weight, weight if bias is None else bias, y, h if residual is not None else y,
        N, K, float(eps), x1.stride(0), r1.stride(0), norm_weight.stride(0), weight.stride(0),
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        UNIT_OFFSET=bool(unit_offset), EVICT_FIRST=cfg["evict_first"], PRELOAD=cfg["preload"] or early,
        EARLY_W=early, PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )
    return y, h


def _launch_norm(x1, residual, r1, h, norm_weight, eps, unit_offset, cfg):
    """The split norm's launch: n = RMSNorm(x1 + residual) into a new row (h stored with a residual)."""
    normed = torch.empty_like(x1)
    pdl, launch = _pdl.launch_options(x1)
    wrap_triton(_rms_norm_row_kernel)[(1,)](
        x1, r1, norm_weight, normed, h if residual is not None else normed, x1.numel(), float(eps), x1.stride(0),
        r1.stride(0), norm_weight.stride(0), BLOCK_K=cfg["block_k"], ROW_TILES=cfg["norm_row_tiles"],
        HAS_RES=residual is not None, UNIT_OFFSET=bool(unit_offset), PDL=pdl, TRIGGER_FIRST=_pdl.TRIGGER_FIRST,
        num_warps=cfg["norm_warps"], **launch)
    return normed


def split_norm(h, norm_weight, eps, unit_offset=False):
    """RMSNorm of one CUDA row h by the split norm's kernel alone (no GEMV after it): a new tensor of h's shape.
    kvrewrite::tp_all_reduce_rms_norm's two-launch baseline."""
    K = h.numel()
    cfg = launch_config(SPLIT_NORM_MIN_N, K, split_norm=True)
    h1 = h.reshape(K)
    return _launch_norm(h1, None, h1, None, norm_weight, eps, unit_offset, cfg).view(h.shape)


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------


def gemv_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: Optional[torch.Tensor] = None, unit_offset: bool = False,
                  constant_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(RMSNorm(x + residual), weight, bias), x + residual) for one row (see the module docstring).

    The op's kernel, fake and what Inductor inlines (see _triton_op.py): CUDA launches the Triton kernel,
    other devices run reference_aten."""
    if x.is_cuda and triton is not None:
        return triton_gemv_rms_norm(x, residual, norm_weight, eps, weight, bias, unit_offset, constant_weight)
    _check_inputs(x, residual, norm_weight, weight, bias)
    y, h = reference_aten(x, residual, norm_weight, eps, weight, bias, unit_offset)
    return y, (x.new_empty(0) if h is None else h.contiguous())


gemv_rms_norm = register_triton_op(NAME, gemv_rms_norm, (), triton is not None)
