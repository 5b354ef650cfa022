"""kvrewrite::gemv_rms_norm_glu on CUDA: the split norm and the GEMV with the GLU epilogue against the float64
reference (kernels/gemv_rms_norm_glu.py reference_f64) within its error_bound, on fresh random inputs, outputs
written into memory poisoned with NaN first; h bit for bit the eager add; the constant weight's early load the same
bits. Against the two launches it replaces (gemv_rms_norm, then gemv_glu) it is checked bit for bit under Triton's
interpreter (test_gemv_rms_norm_glu_triton.py). Skipped without CUDA or Triton:
`python -m pytest -q tests/kernels/test_gemv_rms_norm_glu_gpu.py`.
"""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import gemv_glu
from kvrewrite.kernels import gemv_rms_norm_glu as M
from tests.kernels.poisoned import poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(M.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.gemv_rms_norm_glu.default


def _inputs(I, K, dtype, residual, bias, unit_offset, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, K, generator=g).to(dtype).cuda()
    r = torch.randn(1, 1, K, generator=g).to(dtype).cuda() if residual else None
    nw = (torch.randn(K, generator=g) * (0.2 if unit_offset else 1.0)).to(dtype).cuda()
    w = (torch.randn(2 * I, K, generator=g) * 2 / K**0.5).to(dtype).cuda()
    b = torch.randn(2 * I, generator=g).to(dtype).cuda() if bias else None
    return x, r, nw, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", gemv_glu.ACTS)
@pytest.mark.parametrize("I, K, residual, bias, unit_offset", [
    (14336, 4096, True, False, False),  # Llama-3.1-8B's gate/up
    (1000, 576, True, True, False), (37, 700, False, True, True), (8, 16, True, False, True), (1, 2048, True, False,
                                                                                             False)])
def test_matches_the_float64_reference(I, K, residual, bias, unit_offset, act, dtype):
    x, r, nw, w, b = _inputs(I, K, dtype, residual, bias, unit_offset, seed=I + K)
    z = poisoned(lambda: OP(x, r, nw, 1e-5, w, b, unit_offset, act, True)[0], I * 4)
    _, h = OP(x, r, nw, 1e-5, w, b, unit_offset, act, True)
    z64, n64, y64 = (t.cuda() for t in M.reference_f64(x.cpu(), None if r is None else r.cpu(), nw.cpu(), 1e-5,
                                                       w.cpu(), None if b is None else b.cpu(), unit_offset, act))
    assert z.shape == (1, 1, I) and z.dtype == dtype
    assert torch.equal(h, x + r) if residual else h.numel() == 0
    err = ((z.double() - z64).abs() / M.error_bound(x.cpu(), w.cpu(), n64.cpu(), y64.cpu()).cuda()).max().item()
    assert err <= 1, f"I{I} K{K} {dtype} {act}: error {err:.2f}x the bound"


@pytest.mark.parametrize("tuning", [dict(pairs=4), dict(pairs=3, block_k=256), dict(evict_first=True, num_stages=1)])
def test_launch_variants_and_the_early_weight_compute_the_same(tuning):
    x, r, nw, w, b = _inputs(333, 1500, torch.bfloat16, True, True, False, seed=5)
    base = M.triton_gemv_rms_norm_glu(x, r, nw, 1e-5, w, b, False, "silu", False)[0]
    early = M.triton_gemv_rms_norm_glu(x, r, nw, 1e-5, w, b, False, "silu", True)[0]
    tuned = M.triton_gemv_rms_norm_glu(x, r, nw, 1e-5, w, b, False, "silu", True, **tuning)[0]
    assert torch.equal(base, early) and torch.equal(base, tuned)


def test_cuda_errors_name_the_problem():
    w = torch.randn(24, 32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 1, 32, dtype=torch.bfloat16)
    nw = torch.randn(32, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"one CUDA device"):
        M.triton_gemv_rms_norm_glu(x, None, nw, 1e-5, w)
    with pytest.raises(ValueError, match=r"odd 23 rows"):
        OP(x.cuda(), None, nw, 1e-5, w[:23], None, False, "silu", False)
