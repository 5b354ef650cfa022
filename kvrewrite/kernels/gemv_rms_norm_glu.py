"""kvrewrite::gemv_rms_norm_glu — a gated MLP's gate/up projection with its residual add and RMSNorm in front and
act(gate) * up behind, for one row: the down projection then reads a ready input.

    h = x + residual;  n = RMSNorm(h)                      (kernels/gemv_rms_norm.py, HF's spelling)
    [g | u] = F.linear(n, weight, bias)                    weight [2I, K]: the gate's I rows, then the up's
    z = act(g) * u                                         (kernels/gemv_glu.py's act and roundings)

Args:
    x, residual, norm_weight, eps, unit_offset: as kvrewrite::gemv_rms_norm's (residual may be None)
    weight: [2I, K], bias [2I] or None: the fused gate/up projection (passes/fuse_projections.py's layout)
    act:    "silu", "gelu_tanh" or "gelu" (kernels/gemv_glu.py ACTS)
    constant_weight: as kvrewrite::gemv's: the first weight tile is loaded before the PDL wait
Returns:
    (z [..., I] contiguous, h): h as kvrewrite::gemv_rms_norm returns it (empty without a residual). Mutates nothing.

Why: kvrewrite::gemv_glu computes act(gate) * up in the down projection's prologue, so every one of its programs
reads both halves of the gate/up row from L2 and recomputes the activation over all of K (Llama-3.1-8B: 512
programs of 8 rows, each reading 57 KB): 43.0 us against 41.0 for kvrewrite::gemv on a ready input (H100,
docs/bench/gemv_glu_h100.json); on an H200 the down projection costs 30.7 us of a layer for 28.0 us of weight bytes
(docs/bench.md, "Stop 49 runs"). Here each program of the gate/up GEMV computes gate row i and up row
I + i together, so its epilogue writes z_i once; the down projection is a plain kvrewrite::gemv.
passes/fuse_glu_into_gate_up.py emits it, only while FUSE is on: not yet timed on a GPU.

Backends: CUDA runs the split norm's kernel (kernels/gemv_rms_norm.py _rms_norm_row_kernel) and then the GEMV below,
whatever N; other devices run the aten ops the pass replaced, in their order (gemv_rms_norm's reference_aten, the
two slices, act, mul), so a CPU graph computes the same bits before and after the pass. The kernel rounds where ATen
rounds: g and u to the dtype (one rounding each of the fp32 sums, the bias added in fp32, as kvrewrite::gemv), then
act_product's two roundings; its act is Triton's (kernels/gemv_glu.py: a few fp32 ulps off ATen's).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

from typing import Optional

import torch
from torch.library import wrap_triton

from kvrewrite.kernels import _pdl
from kvrewrite.kernels import gemv as _gemv
from kvrewrite.kernels import gemv_rms_norm as _norm
from kvrewrite.kernels._triton_op import check_one_cuda_device, register_triton_op, triton_jit
from kvrewrite.kernels.gemv import row_dots
from kvrewrite.kernels.gemv_glu import ACTS, PROLOGUE_ROUNDING, act_product, activation

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the aten ops; only triton_gemv_rms_norm_glu raises
    triton = tl = None

NAME = "kvrewrite::gemv_rms_norm_glu"

# passes/fuse_glu_into_gate_up.py emits the op only while this is on. Off until a GPU run times it against
# gemv_rms_norm + gemv_glu (`kvrewrite bench ... --kernel-option gemv_rms_norm_glu.FUSE=True`).
FUSE = False
PAIRS = 1  # gate/up row pairs per program (2 weight rows: kvrewrite::gemv's choice)


def reference_aten(x, residual, norm_weight, eps, weight, bias=None, unit_offset=False, act="silu"):
    """The aten ops the op replaces, in the graph's order and dtypes (the CPU path): (z, h), h None without residual."""
    y, h = _norm.reference_aten(x, residual, norm_weight, eps, weight, bias, unit_offset)
    half = weight.shape[0] // 2
    return activation(y[..., :half], act) * y[..., half:], h


def reference_f64(x, residual, norm_weight, eps, weight, bias=None, unit_offset=False, act="silu"):
    """(z64, n64, y64): z = act(g) * u in float64 from gemv_rms_norm's reference_f64 (h rounded once, the rest
    unrounded), with its normed row n64 and y64 = [g | u]: what the tests compare z with, within error_bound."""
    y64, _, n64 = _norm.reference_f64(x, residual, norm_weight, eps, weight, bias, unit_offset)
    half = weight.shape[0] // 2
    return activation(y64[..., :half], act) * y64[..., half:], n64, y64


# the largest |act'(x)| of every act (silu 1.0998, gelu and gelu tanh 1.1289): a bound on how far act carries an
# error of its input
ACT_LIPSCHITZ = 1.13


def error_bound(x, weight, n64, y64):
    """What the kernel's z may differ from reference_f64's z64 by, elementwise. e_g and e_u, gemv_rms_norm's
    error_bound of g and u (the norm, the fp32 sums and their rounding to the dtype), carried through act (at most
    ACT_LIPSCHITZ e_g) and the product; then gemv_glu's PROLOGUE_ROUNDING[dtype] |g u| for the act's and the product's
    roundings and Triton's act (|act(g)| <= |g| for every act)."""
    half = weight.shape[0] // 2
    e = _norm.error_bound(x, weight, n64, y64)
    e_g, e_u = e[..., :half], e[..., half:]
    g, u = y64[..., :half].abs(), y64[..., half:].abs()
    return (ACT_LIPSCHITZ * e_g * (u + e_u) + (g + ACT_LIPSCHITZ * e_g) * e_u
            + PROLOGUE_ROUNDING[x.dtype] * (g + e_g) * (u + e_u))


def input_problem(x, residual, norm_weight, weight, bias, act, name=NAME):
    """The error (ValueError or TypeError naming what is wrong) the op raises for these inputs, or None. Takes fake
    tensors (passes/fuse_glu_into_gate_up.py asks it of the traced values)."""
    if not isinstance(act, str) or act not in ACTS:
        return ValueError(f"{name}: act must be one of {ACTS}, got {act!r}")
    problem = _norm.input_problem_rms(x, residual, norm_weight, weight, bias, name)
    if problem is not None:
        return problem
    if weight.shape[0] % 2:
        return ValueError(f"{name}: weight must hold the gate's rows then the up's, [2I, K]; got an odd "
                          f"{weight.shape[0]} rows")
    return None


def _check_inputs(x, residual, norm_weight, weight, bias, act, name=NAME):
    problem = input_problem(x, residual, norm_weight, weight, bias, act, name)
    if problem is not None:
        raise problem


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA): kernels/gemv.py's kernel over row pairs (i, I + i), with the GLU in its epilogue
# ---------------------------------------------------------------------------------------------------


@triton_jit()
def _gemv_glu_epilogue_kernel(
    X, W, BIAS, Z,
    I, K,
    stride_xk, stride_wn,
    PAIRS: tl.constexpr,  # gate/up row pairs per program
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,  # index in ACTS
    HAS_BIAS: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    EARLY_W: tl.constexpr,  # a constant weight: its first tile is loaded before the PDL wait (kernels/_pdl.py)
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel before any other load (kernels/_pdl.py)
):
    # rows 2j and 2j + 1 of the tile: gate row i_j and up row I + i_j, i_j = program * PAIRS + j
    j = tl.arange(0, 2 * PAIRS)
    idx = tl.program_id(0) * PAIRS + j // 2
    rows = idx + (j % 2) * I
    row_ok = idx < I
    y = row_dots(X, W + rows[:, None].to(tl.int64) * stride_wn, row_ok, K, stride_xk, 2 * PAIRS, BLOCK_K, EVICT_FIRST,
                 EARLY_W, PDL)
    if HAS_BIAS:
        y += tl.load(BIAS + rows, mask=row_ok, other=0.0).to(tl.float32)
    g, u = tl.split(tl.reshape(y.to(Z.dtype.element_ty), (PAIRS, 2)))  # each rounded once, as gemv's output
    z = act_product(g.to(tl.float32), u, ACT)
    out = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    tl.store(Z + out, z.to(Z.dtype.element_ty), mask=out < I)


def launch_config(I, K, pairs=None, **overrides):
    """kernels/gemv.py's launch config for the 2I-row weight, with `pairs` (PAIRS) gate/up row pairs per program."""
    pairs = PAIRS if pairs is None else pairs
    return dict(_gemv._launch_config(2 * I, K, block_n=2 * pairs, **overrides), pairs=pairs)


def triton_gemv_rms_norm_glu(x, residual, norm_weight, eps, weight, bias=None, unit_offset=False, act="silu",
                             constant_weight=False, **tuning):
    """The op on CUDA through Triton; validates its inputs. ``tuning`` overrides launch_config (benchmarks only)."""
    if triton is None:
        raise NotImplementedError("triton_gemv_rms_norm_glu needs Triton (pip install triton); "
                                  "kvrewrite::gemv_rms_norm_glu itself runs without it")
    _check_inputs(x, residual, norm_weight, weight, bias, act, "triton_gemv_rms_norm_glu")
    tensors = [t for t in (x, residual, norm_weight, weight, bias) if t is not None]
    check_one_cuda_device("triton_gemv_rms_norm_glu", tensors)
    return _launch(x, residual, norm_weight, eps, weight, bias, unit_offset, act, constant_weight, **tuning)


def _launch(x, residual, norm_weight, eps, weight, bias=None, unit_offset=False, act="silu", constant_weight=False,
            **overrides):
    """The split norm's launch, then the GEMV's; no checks (Triton's interpreter runs it on CPU tensors)."""
    N, K = (int(n) for n in weight.shape)
    I = N // 2
    x1, r1, h = _norm.row_inputs(x, residual, K)
    normed = _norm._launch_norm(x1, residual, r1, h, norm_weight, eps, unit_offset,
                                _norm.launch_config(N, K, split_norm=True))
    cfg = launch_config(I, K, **overrides)
    z = torch.empty((*x.shape[:-1], I), dtype=x.dtype, device=x.device)
    pdl, launch = _pdl.launch_options(x)
    wrap_triton(_gemv_glu_epilogue_kernel)[(triton.cdiv(I, cfg["pairs"]),)](
        normed, weight, weight if bias is None else bias, z, I, K, normed.stride(0), weight.stride(0),
        PAIRS=cfg["pairs"], BLOCK_K=cfg["block_k"], ACT=ACTS.index(act), HAS_BIAS=bias is not None,
        EVICT_FIRST=cfg["evict_first"], EARLY_W=_gemv.early_weight(constant_weight), PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )
    return z, h


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------


def gemv_rms_norm_glu(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: Optional[torch.Tensor] = None, unit_offset: bool = False,
                      act: str = "silu", constant_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(g) * u, x + residual), [g | u] = F.linear(RMSNorm(x + residual), weight, bias), for one row (see the
    module docstring).

    The op's kernel, fake and what Inductor inlines (see _triton_op.py): CUDA launches the Triton kernels, other
    devices run reference_aten."""
    if x.is_cuda and triton is not None:
        return triton_gemv_rms_norm_glu(x, residual, norm_weight, eps, weight, bias, unit_offset, act,
                                        constant_weight)
    _check_inputs(x, residual, norm_weight, weight, bias, act)
    z, h = reference_aten(x, residual, norm_weight, eps, weight, bias, unit_offset, act)
    return z.contiguous(), (x.new_empty(0) if h is None else h.contiguous())


gemv_rms_norm_glu = register_triton_op(NAME, gemv_rms_norm_glu, (), triton is not None)
