"""kvrewrite::gemv_glu on CUDA: the Triton kernel against the fp32 reference (kernels/gemv_glu.py reference_input
times the weight), on fresh random inputs, every output written into memory poisoned with NaN first.

Tolerance (gemv_glu.error_bound): kernels/gemv.py's bound plus PROLOGUE_ROUNDING |a_k b_k| per input element. The
prologue's rounding is checked on its own with an identity weight (the output is then the kernel's act(a) * b):
ATen's value within one ulp, and in at most 1% of the elements (a kernel that skips a rounding differs in far
more). Skipped without CUDA or Triton: `python -m pytest -q tests/kernels/test_gemv_glu_gpu.py`.
"""
import pytest
import torch
import torch.nn.functional as F

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import gemv_glu as G
from tests.kernels.poisoned import poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(G.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.gemv_glu.default


def _inputs(N, K, dtype, bias, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    ab = (torch.randn(1, 1, 2 * K, generator=gen) * scale).to(dtype).cuda()
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype).cuda()
    b = torch.randn(N, generator=gen).to(dtype).cuda() if bias else None
    return ab[..., :K], ab[..., K:], w, b  # gate and up: slices of one row, as fuse_projections leaves them


def _check(N, K, dtype, act, bias, seed, **tuning):
    a, b, w, bias_ = _inputs(N, K, dtype, bias, seed)
    fn = (lambda: OP(a, b, w, bias_, act)) if not tuning else (lambda: G.triton_gemv_glu(a, b, w, bias_, act, **tuning))
    out = poisoned(fn, N * 4)
    ref = F.linear(G.reference_input(a, b, act), w.float(), None if bias_ is None else bias_.float())
    assert out.shape == (1, 1, N) and out.dtype == dtype
    err = ((out.float() - ref).abs() / G.error_bound(a, b, w, ref, act)).max().item()
    assert err <= 1, f"N{N} K{K} {dtype} {act} bias {bias} {tuning}: error {err:.2f}x the bound"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N, K", [(4096, 14336), (1000, 576), (37, 700), (257, 14336), (8, 16), (1, 2048)])
@pytest.mark.parametrize("act", G.ACTS)
def test_matches_fp32_reference(N, K, dtype, act):
    _check(N, K, dtype, act, bias=(N % 2 == 1), seed=N + K)


@pytest.mark.parametrize("tuning", [dict(block_n=1), dict(block_n=16, block_k=256),
                                    dict(evict_first=True, num_stages=1)])
def test_launch_variants_compute_the_same(tuning):
    _check(333, 1500, torch.bfloat16, "silu", bias=True, seed=5, **tuning)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", G.ACTS)
def test_prologue_rounds_like_aten(dtype, act):
    """Identity weight: out = the kernel's act(a) * b; against eager ATen's on the GPU (F.silu(a) * b in dtype),
    within PROLOGUE_ROUNDING |a b| (and fp16's subnormal spacing). Inputs of scale 1: at larger |a| ATen's gelu
    cancels (module docstring of gemv_glu.py) and flips more of the 16-bit roundings."""
    K = 4096
    a, b, _, _ = _inputs(1, K, dtype, False, seed=11, scale=1.0)
    out = OP(a, b, torch.eye(K, dtype=dtype, device="cuda"), None, act).float()
    want = (G.activation(a, act) * b).float()
    info = torch.finfo(dtype)
    tol = G.PROLOGUE_ROUNDING[dtype] * (a.float() * b.float()).abs() + info.smallest_normal * info.eps
    assert ((out - want).abs() <= tol).all(), f"{act} {dtype}: max error {(out - want).abs().max().item():.3g}"
    if dtype != torch.float32:  # a kernel that skips a rounding differs in about a quarter of the elements
        off = (out != want).float().mean().item()
        assert off <= 0.01, f"{act} {dtype}: {off:.2%} of the elements differ from ATen's"


def test_cuda_errors_name_the_problem():
    w = torch.randn(24, 32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"one CUDA device"):
        G.triton_gemv_glu(x, x, w)
    with pytest.raises(ValueError, match=r"act must be one of .*got 'tanh'"):
        OP(x.cuda(), x.cuda(), w, None, "tanh")
