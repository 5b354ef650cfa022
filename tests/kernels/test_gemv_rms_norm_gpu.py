"""kvrewrite::gemv_rms_norm on CUDA: the Triton kernel against the float64 reference, on fresh random inputs.

Both outputs (y and h) are written into memory poisoned with NaN first. y within kernels/gemv_rms_norm.py
error_bound (gemv's bound plus the normed values' roundings and the fp32 mean), h exactly the eager add.
Skipped without CUDA or Triton.
"""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import gemv_rms_norm as m
from tests.kernels.poisoned import poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(m.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.gemv_rms_norm.default


def _check(N, K, dtype, residual, unit_offset, bias, seed, **tuning):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, K, generator=gen).to(dtype).cuda()
    r = torch.randn(1, 1, K, generator=gen).to(dtype).cuda() if residual else None
    nw = (torch.randn(K, generator=gen) * (0.1 if unit_offset else 1.0)).to(dtype).cuda()
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype).cuda()
    b = torch.randn(N, generator=gen).to(dtype).cuda() if bias else None
    if tuning:
        fn = lambda: m.triton_gemv_rms_norm(x, r, nw, 1e-5, w, b, unit_offset, **tuning)  # noqa: E731
    else:
        fn = lambda: OP(x, r, nw, 1e-5, w, b, unit_offset=unit_offset)  # noqa: E731
    y, h = poisoned(fn, N * 4 + K * 4)
    y64, h_ref, n64 = m.reference_f64(x, r, nw, 1e-5, w, b, unit_offset)
    assert y.shape == (1, 1, N) and y.dtype == dtype
    if residual:
        assert h.shape == x.shape and torch.equal(h, x + r) and torch.equal(h, h_ref)
    else:
        assert h.numel() == 0
    err = ((y.double() - y64).abs() / m.error_bound(x, w, n64, y64)).max().item()
    assert err <= 1, f"N{N} K{K} {dtype} residual {residual} unit_offset {unit_offset} {tuning}: {err:.2f}x the bound"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N, K", [(6144, 4096), (28672, 4096), (128256, 4096), (37, 700), (1000, 576), (3, 5000)])
def test_matches_float64_reference(N, K, dtype):
    _check(N, K, dtype, residual=True, unit_offset=False, bias=False, seed=N + K)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_spellings_bias_and_no_residual(residual, unit_offset):
    _check(333, 1500, torch.bfloat16, residual, unit_offset, bias=True, seed=7)


@pytest.mark.parametrize("tuning", [dict(block_n=1), dict(block_n=8, num_warps=8), dict(block_k=256),
                                    dict(preload=True), dict(block_n=2, block_k=4096),
                                    dict(block_n=2, num_warps=8, preload=True),  # the H100-tuned launch
                                    dict(constant_weight=True),  # the first weight tile before the PDL wait
                                    dict(split_norm=True), dict(split_norm=True, constant_weight=True)])
def test_launch_variants_compute_the_same(tuning):
    _check(515, 3000, torch.bfloat16, True, False, bias=True, seed=5, **tuning)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_split_norm_spellings(residual, unit_offset):
    """The split norm's two launches (the norm kernel, then gemv's): Gemma's spelling and no residual too."""
    _check(333, 1500, torch.bfloat16, residual, unit_offset, bias=True, seed=7, split_norm=True, constant_weight=True)


def test_cuda_errors_name_the_problem():
    w = torch.randn(24, 32, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"one CUDA device"):
        m.triton_gemv_rms_norm(torch.randn(1, 32, dtype=torch.bfloat16), None, nw, 1e-5, w)
    with pytest.raises(ValueError, match=r"norm_weight must be \[K\]"):
        OP(torch.randn(1, 32, device="cuda", dtype=torch.bfloat16), None, nw[:5], 1e-5, w)


@pytest.mark.parametrize("split_norm", [False, True])
def test_either_form_at_the_lm_head_shape(split_norm):
    """From SPLIT_NORM_MIN_N rows on the op splits by default; the fused kernel still computes such shapes right."""
    _check(128256, 4096, torch.bfloat16, True, False, bias=False, seed=3, split_norm=split_norm, constant_weight=True)
