"""kvrewrite::gemv — F.linear(x, weight, bias) for one row of x: the products of a batch-1 decode step.

    y[..., n] = sum_k x[..., k] * weight[n, k] (+ bias[n])

Args:
    x:      [..., K]  fp16/bf16/fp32, one row (x.numel() == K; e.g. [1, 1, K])
    weight: [N, K]    x's dtype, unit stride along K
    bias:   [N]       x's dtype, or None
    constant_weight: the caller's word that no kernel writes weight while the graph calling the op runs (a model
            constant); the kernel then loads its first weight tile before it waits for the kernel before it
            (kernels/_pdl.py, "Constant weights"). passes/replace_linear_with_gemv.py sets it for get_attr weights
            that no node of the graph writes. False: every load waits.
Returns:
    [..., N] in x's dtype, contiguous. Mutates nothing.

Why: a batch-1 decode step reads every weight once and does 2 FLOPs per weight: a matrix-vector product,
bandwidth-bound. cuBLAS runs these shapes as split-K GEMMs plus a reduction kernel; on an H100 (bf16,
Llama-3.1-8B shapes, docs/bench/gemv_h100.json) the kernel below is 1.07-1.57x as fast, in one launch
(4096x4096: 63% -> 78% of the copy bandwidth; the 128256x4096 lm_head: 89% -> 103%, a read-only stream
beating the copy, which also writes).
One row only: this kernel re-reads the weights for every row of x; a first version that took up to 4 rows
was 5-54% slower than cuBLAS at 2 and 4, so more rows are a GEMM's job (F.linear).

Backends: CUDA runs the Triton kernel (fp32 accumulation, the bias added in fp32, one rounding to x's
dtype); other devices run F.linear itself. The op is a `torch.library.triton_op`, so Inductor sees
the kernel and CUDA graphs capture it. Every device checks the shapes (one row included), so a graph
that runs on the CPU runs on the GPU (passes/replace_linear_with_gemv.py inserts the op where it fits).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

from typing import Optional

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from kvrewrite.kernels import _pdl
from kvrewrite.kernels._pdl import gdc_launch_dependents, gdc_wait
from kvrewrite.kernels._triton_op import check_one_cuda_device, register_triton_op, triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs F.linear; only triton_gemv raises
    triton = tl = None

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def reference_gemv(x, weight, bias=None):
    """What an exact kernel returns: the product in fp32 (bias added in fp32), rounded once to x's dtype. The GPU
    tests compare the kernel with the unrounded product instead, within error_bound."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


# relative rounding allowance: one ulp of bf16 / fp16 (the output is rounded once), two of fp32 (no final rounding,
# only the summation order differs, which the second term of error_bound covers)
ROUNDING = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-22}


def error_bound(x, weight, ref):
    """What the Triton kernel may differ from the fp32 product `ref` (fp32, before rounding) by, elementwise:
    ROUNDING[dtype] |ref| (its own fp32 sum may round the other way) plus the fp32 summation-order error,
    4 sqrt(K) 2^-24 sum_k |x_k w_nk|. The GPU tests and kvrewrite/bench/gemv.py check against it."""
    K = weight.shape[1]
    magnitude = F.linear(x.float().abs(), weight.float().abs())
    return ROUNDING[x.dtype] * ref.abs() + 4 * K**0.5 * 2.0**-24 * magnitude


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA)
#
# One program computes BLOCK_N outputs: it streams its BLOCK_N weight rows in [BLOCK_N, BLOCK_K] tiles,
# multiplies them by the matching slice of x and keeps an fp32 [BLOCK_N, BLOCK_K] accumulator, reduced
# along K once at the end (no split-K, so no second kernel). Launched with PDL (kernels/_pdl.py), it waits for
# the previous kernel first; with EARLY_W (a constant weight) its first weight tile is loaded before that wait.
# ---------------------------------------------------------------------------------------------------

EARLY_WEIGHT = True  # constant_weight=True loads the first weight tile before the PDL wait (A/B: --kernel-option)


@triton_jit()
def _weight_tile(w_rows, cols, row_ok, K, EVICT_FIRST: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns `cols` (0 outside the rows and K)."""
    mask = row_ok[:, None] & (cols < K)[None, :]
    if EVICT_FIRST:
        return tl.load(w_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(w_rows + cols[None, :], mask=mask, other=0.0)


def early_weight(constant_weight: bool) -> bool:
    """The EARLY_W of gemv's, gemv_rms_norm's and gemv_glu's kernels: the first weight tile before the PDL wait, for
    a constant weight while EARLY_WEIGHT is on. Independent of PDL: without the wait it only moves a load earlier."""
    return bool(constant_weight) and EARLY_WEIGHT


@triton_jit()
def _gemv_kernel(
    X, W, BIAS, Y,
    N, K,
    stride_xk, stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVICT_FIRST: tl.constexpr,  # hint that the weight lines will not be read again
    EARLY_W: tl.constexpr,  # a constant weight: its first tile is loaded before the PDL wait (kernels/_pdl.py)
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel before any other load (kernels/_pdl.py)
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = W + rows[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if EARLY_W:
        cols0 = tl.arange(0, BLOCK_K)
        w0 = _weight_tile(w_rows, cols0, row_ok, K, EVICT_FIRST)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if EARLY_W:
        x0 = tl.load(X + cols0 * stride_xk, mask=cols0 < K, other=0.0).to(tl.float32)
        acc += w0.to(tl.float32) * x0[None, :]
    for k0 in range(BLOCK_K if EARLY_W else 0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + cols * stride_xk, mask=cols < K, other=0.0).to(tl.float32)
        w = _weight_tile(w_rows, cols, row_ok, K, EVICT_FIRST)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(BIAS + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


def _launch_config(N, K, block_n=None, block_k=None, num_warps=None, num_stages=None, evict_first=None):
    """Tile sizes and launch options. The keyword overrides are for the benchmark's sweep.

    From the sweeps on an H100 (bf16, the seven Llama-3.1-8B shapes from k/v's 1024x4096 to the lm_head's
    128256x4096; kvrewrite/bench/gemv.py --sweep, docs/bench/sweep_gemv_h100.json): 2 weight rows per program,
    2048-wide K tiles, 8 warps, 3 stages, no eviction hint: within 1.0% of the fastest of 81 variants on
    average and 5% on every shape (k/v's best takes 1 row per program). On an H200 (36 variants on q/k/v, gate/up,
    down and the lm_head; docs/bench/sweep_gemv_h200.json) it is within 3% of the fastest (q/k/v 16.2 vs 15.7 us
    with 4096-wide tiles and 4 warps; the others within 0.7%): kept.
    """
    if block_k is None:
        block_k = min(2048, max(triton.next_power_of_2(K), 16))
    return dict(block_n=2 if block_n is None else block_n, block_k=block_k,
                num_warps=8 if num_warps is None else num_warps, num_stages=3 if num_stages is None else num_stages,
                evict_first=False if evict_first is None else evict_first)


def input_problem(x, weight, bias, name="kvrewrite::gemv"):
    """The error (ValueError or TypeError naming what is wrong) the op raises for these inputs, or None where it
    takes them. x may be a fake tensor: passes/replace_linear_with_gemv.py asks this of a node's traced value."""
    if weight.dim() != 2:
        return ValueError(f"{name}: weight must be [N, K], got {tuple(weight.shape)}")
    N, K = weight.shape
    if x.dim() < 1 or x.shape[-1] != K:
        return ValueError(f"{name}: x must be [..., K={K}] to match weight {tuple(weight.shape)}, got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        return ValueError(f"{name}: bias must be [N] = ({N},), got {tuple(bias.shape)}")
    if x.numel() != K:
        return ValueError(f"{name}: x must hold one row of K={K} values (a batch-1 decode step), got shape "
                          f"{tuple(x.shape)}: more rows are a GEMM's job (F.linear)")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return TypeError(f"{name}: x, weight and bias must share one dtype of fp16/bf16/fp32, got x {x.dtype}, "
                         f"weight {weight.dtype}, bias {None if bias is None else bias.dtype}")
    if K and weight.stride(1) != 1:
        return ValueError(f"{name}: weight must have unit stride along K, got strides {weight.stride()}")
    return None


def _check_inputs(x, weight, bias, name="kvrewrite::gemv"):
    """Shape and dtype checks of the op (every device): raises input_problem's error, if any."""
    problem = input_problem(x, weight, bias, name)
    if problem is not None:
        raise problem


def triton_gemv(x, weight, bias=None, constant_weight=False, **tuning):
    """The op on CUDA through Triton (shapes in the module docstring); validates its inputs.
    ``tuning`` overrides the launch choices (block_n, block_k, num_warps, num_stages, evict_first); for the
    benchmark's sweep, the op never passes it."""
    if triton is None:
        raise NotImplementedError("triton_gemv needs Triton (pip install triton); kvrewrite::gemv itself runs without it")
    _check_inputs(x, weight, bias, "triton_gemv")
    check_one_cuda_device("triton_gemv", (x, weight) if bias is None else (x, weight, bias))
    return _launch(x, weight, bias, constant_weight, **tuning)


def _launch(x, weight, bias=None, constant_weight=False, **overrides):
    """Allocate the output and launch; no checks (Triton's interpreter runs it on CPU tensors)."""
    N, K = (int(n) for n in weight.shape)
    x1 = x.reshape(K)
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    cfg = _launch_config(N, K, **overrides)
    pdl, launch = _pdl.launch_options(x)
    wrap_triton(_gemv_kernel)[(triton.cdiv(N, cfg["block_n"]),)](
        x1, weight, weight if bias is None else bias, y, N, K, x1.stride(0), weight.stride(0),
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], HAS_BIAS=bias is not None, EVICT_FIRST=cfg["evict_first"],
        EARLY_W=early_weight(constant_weight), PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **launch,
    )
    return y


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         constant_weight: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for one row of x (see the module docstring; constant_weight changes only when the
    kernel loads the weight, never the result).

    The op's kernel, fake and what Inductor inlines (see _triton_op.py): CUDA launches the Triton kernel,
    other devices run F.linear."""
    if x.is_cuda and triton is not None:
        return triton_gemv(x, weight, bias, constant_weight)
    _check_inputs(x, weight, bias)
    return F.linear(x, weight, bias).contiguous()


gemv = register_triton_op("kvrewrite::gemv", gemv, (), triton is not None)
