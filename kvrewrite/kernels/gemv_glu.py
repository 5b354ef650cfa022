"""kvrewrite::gemv_glu — F.linear(act(a) * b, weight, bias) for one row: a gated MLP's down projection in a
batch-1 decode step, its activation and product included.

    y[..., n] = sum_k (act(a[..., k]) * b[..., k]) * weight[n, k] (+ bias[n])

Args:
    a, b:   [..., K]  one row each (a.numel() == K), same shape, unit stride along K; weight's dtype
                      (a: the gate projection's output, b: the up projection's)
    weight: [N, K]    fp16/bf16/fp32, unit stride along K
    bias:   [N]       weight's dtype, or None
    act:    "silu" (Llama, Mistral, Qwen, Phi-3, ...), "gelu_tanh" (Gemma's gelu(approximate="tanh")) or
            "gelu" (exact, erf)
    constant_weight: as kvrewrite::gemv's (kernels/gemv.py): the first weight tile is loaded before the PDL wait
Returns:
    [..., N] in weight's dtype, contiguous. Mutates nothing.

Why: a batch-1 decode step computes act(gate) * up in a small elementwise kernel of its own between the up and
the down projection (Inductor's triton_poi_fused_mul_silu_slice_view: 1.5 us each and a graph gap, 32 per
Llama-3.1-8B step). Here the GEMV computes it while loading its input (passes/fuse_glu_into_gemv.py).
Measured (H100, bf16, Llama-3.1-8B's down projection, CUDA graphs; docs/bench/gemv_glu_h100.json): 43.0 us at 8
rows per program, vs 44.9 us for eager silu, mul + kvrewrite::gemv, but 42.8 us for Inductor's fused silu*mul
kernel + kvrewrite::gemv (kvrewrite::gemv alone: 41.0 us): the prologue, recomputed by every program over all of
K (a and b read from L2 once per program), costs about what the separate kernel does. A win over eager, parity
under rw.compile. Tried and dropped (stops 49-50): act(gate) * up computed once, in the gate/up GEMV's epilogue (a
kernel whose programs each computed gate row i and up row I + i after the split norm), the down projection a plain
gemv. Bit-identical, but slower end to end on an H200 (snapkv, 32k, batch 1, rw.compile, fused projections, GEMV;
two pairs in one lease): 4.72-4.73 ms/token against 4.64 with this prologue (docs/bench.md, "Stop 50 runs").

Backends: CUDA runs kernels/gemv.py's kernel with a prologue; other devices run the aten ops it replaces,
in their order (act, mul, F.linear), so a CPU graph is bit-identical before and after the pass.

Rounding of the prologue (what eager ATen does for 16-bit dtypes): act computed in fp32 and rounded to the dtype,
the product of the rounded act and b computed in fp32 and rounded to the dtype, then the fp32 accumulation of
kernels/gemv.py (one rounding of the output). The kernel's act is not ATen's bit for bit: Triton's exp and
division are a few fp32 ulps off, and its gelu is a sigmoid (gelu_tanh) or an erf of Triton's where ATen's
0.5 a (1 + tanh / erf) cancels for negative a (absolute errors of a few ulps of |a|). So an element of the GEMV's
input may round the other way (two ulps of the dtype at most, rarely) or differ by a few fp32 ulps of |a b| (fp32):
error_bound allows PROLOGUE_ROUNDING[dtype] |a_k b_k| per element (|act(a)| <= |a| for all three).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

from typing import Optional

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from kvrewrite.kernels import gemv as _gemv
from kvrewrite.kernels import _pdl
from kvrewrite.kernels._pdl import gdc_launch_dependents, gdc_wait
from kvrewrite.kernels._triton_op import check_one_cuda_device, register_triton_op, triton_jit
from kvrewrite.kernels.gemv import _weight_tile

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the aten ops; only triton_gemv_glu raises
    triton = tl = None

ACTS = ("silu", "gelu_tanh", "gelu")  # index = the kernel's ACT constant


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """The aten op of `act` on x (the CPU path and the references): aten.silu / aten.gelu(approximate=...)."""
    if act == "silu":
        return F.silu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "gelu":
        return F.gelu(x)
    raise ValueError(f"kvrewrite::gemv_glu: act must be one of {ACTS}, got {act!r}")


def reference_input(a, b, act: str) -> torch.Tensor:
    """The GEMV's input the kernel computes, as ATen computes it (fp32 act rounded to the dtype, then the
    product rounded to the dtype), in fp32: what reference_gemv_glu and error_bound start from."""
    x = activation(a.float(), act).to(a.dtype).float() * b.float()
    return x.to(a.dtype).float()


def reference_gemv_glu(a, b, weight, bias=None, act="silu"):
    """What an exact kernel returns: the product of reference_input and weight in fp32 (bias added in fp32), rounded
    once to the dtype."""
    return _gemv.reference_gemv(reference_input(a, b, act), weight.float(),
                                None if bias is None else bias.float()).to(a.dtype)


# what an element of the GEMV's input may differ from reference_input's by, relative to |a b| (module docstring):
# two ulps of bf16 / fp16 (the act rounded the other way, carried into the product, whose own rounding may then
# fall the other way too), 64 ulps of fp32
PROLOGUE_ROUNDING = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9, torch.float32: 2.0**-18}


def error_bound(a, b, weight, ref, act="silu"):
    """What the Triton kernel may differ from the fp32 product `ref` of reference_input and weight (before
    rounding) by, elementwise: gemv.error_bound of that product plus PROLOGUE_ROUNDING[dtype] sum_k |a_k b_k w_nk|
    (the prologue's own errors, see the module docstring)."""
    x = reference_input(a, b, act)
    magnitude = F.linear((a.float() * b.float()).abs(), weight.float().abs())
    return _gemv.error_bound(x.to(a.dtype), weight, ref) + PROLOGUE_ROUNDING[a.dtype] * magnitude


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA): kernels/gemv.py's kernel, its x tile computed from a and b (the prologue)
# ---------------------------------------------------------------------------------------------------


@triton_jit()
def _glu_input(A, B, cols, K, stride_ak, stride_bk, ACT: tl.constexpr):
    """act(a) * b at columns `cols` (0 past K), in fp32, rounded where ATen rounds."""
    k_ok = cols < K
    a = tl.load(A + cols * stride_ak, mask=k_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols * stride_bk, mask=k_ok, other=0.0)
    if ACT == 0:  # silu: a sigmoid(a)
        g = a / (1.0 + tl.exp(-a))
    elif ACT == 1:  # gelu tanh: 0.5 a (1 + tanh(u)) = a sigmoid(2u), u = sqrt(2/pi) (a + 0.044715 a^3)
        u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        g = a / (1.0 + tl.exp(-2.0 * u))
    else:  # gelu: 0.5 a (1 + erf(a / sqrt(2)))
        g = 0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476))
    return (g.to(b.dtype).to(tl.float32) * b.to(tl.float32)).to(b.dtype).to(tl.float32)  # ATen's two roundings


@triton_jit()
def _gemv_glu_kernel(
    A, B, W, BIAS, Y,
    N, K,
    stride_ak, stride_bk, stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,  # index in ACTS
    HAS_BIAS: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
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
        acc += w0.to(tl.float32) * _glu_input(A, B, cols0, K, stride_ak, stride_bk, ACT)[None, :]
    for k0 in range(BLOCK_K if EARLY_W else 0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = _glu_input(A, B, cols, K, stride_ak, stride_bk, ACT)
        w = _weight_tile(w_rows, cols, row_ok, K, EVICT_FIRST)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(BIAS + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


BLOCK_N = 8  # weight rows per program (kernels/gemv.py takes 2), see launch_config


def launch_config(N, K, **overrides):
    """kernels/gemv.py's launch config with BLOCK_N weight rows per program unless overridden: every program
    loads a and b and computes the prologue over all of K, so more rows per program amortize it. On an H100 (bf16,
    Llama-3.1-8B's down projection 4096x14336, docs/bench/gemv_glu_h100.json): 1 row 54.6 us, 2 44.2, 4 44.1,
    8 43.0 (silu; gelu tanh alike); kvrewrite::gemv alone on a ready input 41.0 us."""
    return _gemv._launch_config(N, K, **{"block_n": BLOCK_N, **overrides})


def input_problem(a, b, weight, bias, act, name="kvrewrite::gemv_glu"):
    """The error (ValueError or TypeError naming what is wrong) the op raises for these inputs, or None where it
    takes them. a and b may be fake tensors: passes/fuse_glu_into_gemv.py asks this of the nodes' traced values."""
    if not isinstance(act, str) or act not in ACTS:
        return ValueError(f"{name}: act must be one of {ACTS}, got {act!r}")
    if tuple(a.shape) != tuple(b.shape):
        return ValueError(f"{name}: a and b must have one shape [..., K], got a {tuple(a.shape)}, b {tuple(b.shape)}")
    for label, t in (("a", a), ("b", b)):
        problem = _gemv.input_problem(t, weight, bias, f"{name} ({label} as the GEMV's input x)")
        if problem is not None:
            return problem
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return ValueError(f"{name}: {label} must have unit stride along K, got strides {t.stride()}")
    return None


def _check_inputs(a, b, weight, bias, act, name="kvrewrite::gemv_glu"):
    """Shape, dtype and act checks of the op (every device): raises input_problem's error, if any."""
    problem = input_problem(a, b, weight, bias, act, name)
    if problem is not None:
        raise problem


def triton_gemv_glu(a, b, weight, bias=None, act="silu", constant_weight=False, **tuning):
    """The op on CUDA through Triton (shapes in the module docstring); validates its inputs.
    ``tuning`` overrides launch_config's choices (block_n, block_k, num_warps, num_stages, evict_first);
    for the benchmark, the op never passes it."""
    if triton is None:
        raise NotImplementedError("triton_gemv_glu needs Triton (pip install triton); kvrewrite::gemv_glu itself "
                                  "runs without it")
    _check_inputs(a, b, weight, bias, act, "triton_gemv_glu")
    check_one_cuda_device("triton_gemv_glu", (a, b, weight) if bias is None else (a, b, weight, bias))
    return _launch(a, b, weight, bias, act, constant_weight, **tuning)


def _launch(a, b, weight, bias=None, act="silu", constant_weight=False, **overrides):
    """Allocate the output and launch; no checks (Triton's interpreter runs it on CPU tensors)."""
    N, K = (int(n) for n in weight.shape)
    a1, b1 = a.reshape(K), b.reshape(K)
    y = torch.empty((*a.shape[:-1], N), dtype=a.dtype, device=a.device)
    cfg = launch_config(N, K, **overrides)
    pdl, launch = _pdl.launch_options(a)
    wrap_triton(_gemv_glu_kernel)[(triton.cdiv(N, cfg["block_n"]),)](
        a1, b1, weight, weight if bias is None else bias, y, N, K, a1.stride(0), b1.stride(0), weight.stride(0),
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], ACT=ACTS.index(act), HAS_BIAS=bias is not None,
        EVICT_FIRST=cfg["evict_first"], EARLY_W=_gemv.early_weight(constant_weight), PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )
    return y


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------


def gemv_glu(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
             act: str = "silu", constant_weight: bool = False) -> torch.Tensor:
    """F.linear(act(a) * b, weight, bias) for one row (see the module docstring).

    The op's kernel, fake and what Inductor inlines (see _triton_op.py): CUDA launches the Triton kernel,
    other devices run the aten ops (act, mul, linear) in that order."""
    if a.is_cuda and triton is not None:
        return triton_gemv_glu(a, b, weight, bias, act, constant_weight)
    _check_inputs(a, b, weight, bias, act)
    return F.linear(activation(a, act) * b, weight, bias).contiguous()


gemv_glu = register_triton_op("kvrewrite::gemv_glu", gemv_glu, (), triton is not None)
