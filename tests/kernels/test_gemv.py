"""kvrewrite::gemv on the CPU: it is F.linear there, and every device checks its shapes and dtypes with errors
that name what is wrong. The Triton kernel is checked in test_gemv_gpu.py."""
import os

import pytest
import torch
import torch.nn.functional as F

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import gemv as gemv_module
from kvrewrite.kernels.gemv import error_bound, reference_gemv

OP = torch.ops.kvrewrite.gemv.default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(), (1,), (1, 1), (1, 1, 1)])
def test_cpu_is_f_linear(lead, bias, dtype):
    g = torch.Generator().manual_seed(len(lead) + 7 * bias)
    x = torch.randn(*lead, 48, generator=g).to(dtype)
    w = torch.randn(40, 48, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype) if bias else None
    out = OP(x, w, b)
    assert out.shape == (*lead, 40) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, F.linear(x, w, b))
    assert torch.equal(OP(x, w, b, True), out)  # constant_weight: when the kernel loads, not what it computes


def test_reference_rounds_once_from_fp32():
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    assert torch.equal(reference_gemv(x, w), (x.float() @ w.float().T).to(torch.bfloat16))


def test_error_bound_is_one_ulp_plus_the_summation_error():
    x = torch.ones(1, 16, dtype=torch.bfloat16)
    w = torch.full((2, 16), -0.5, dtype=torch.bfloat16)
    ref = (x.float() @ w.float().T)  # -8 each
    bound = error_bound(x, w, ref)
    assert torch.allclose(bound, 2.0**-7 * 8 + 4 * 4 * 2.0**-24 * 8 * torch.ones(1, 2))


def test_fake_gives_the_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = OP(torch.empty(1, 1, 32), torch.empty(24, 32), torch.empty(24))
    assert out.shape == (1, 1, 24)


@pytest.mark.parametrize("x, w, b, match", [
    ((1, 32), (24, 32, 1), None, r"weight must be \[N, K\], got \(24, 32, 1\)"),
    ((1, 31), (24, 32), None, r"x must be \[\.\.\., K=32\].*got \(1, 31\)"),
    ((1, 32), (24, 32), (23,), r"bias must be \[N\] = \(24,\), got \(23,\)"),
    ((2, 32), (24, 32), None, r"x must hold one row of K=32 values .*got shape \(2, 32\).*F.linear"),
    ((0, 32), (24, 32), None, r"x must hold one row .*got shape \(0, 32\)"),
])
def test_bad_shapes_are_named(x, w, b, match):
    with pytest.raises(ValueError, match=match):
        OP(torch.randn(*x), torch.randn(*w), None if b is None else torch.randn(*b))


def test_mixed_dtypes_are_named():
    with pytest.raises(TypeError, match=r"x torch.float32, weight torch.bfloat16"):
        OP(torch.randn(1, 32), torch.randn(24, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"one dtype of fp16/bf16/fp32"):
        OP(torch.randn(1, 32, dtype=torch.float64), torch.randn(24, 32, dtype=torch.float64))


def test_weight_must_be_unit_stride_along_k():
    with pytest.raises(ValueError, match=r"unit stride along K"):
        OP(torch.randn(1, 32), torch.randn(32, 24).T)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or gemv_module.triton is None,
                    reason="runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1, install Triton")
@pytest.mark.parametrize("K, block_k", [(100, 32), (64, 64), (5, 16)])
def test_interpreted_kernel_with_a_constant_weight_computes_the_same_bits(K, block_k):
    """constant_weight loads the first weight tile before the PDL wait (EARLY_W): the same product in the same
    order, within gemv's bound of the fp32 product."""
    g = torch.Generator().manual_seed(K)
    x, w, b = torch.randn(1, 1, K, generator=g), torch.randn(9, K, generator=g), torch.randn(9, generator=g)
    plain = gemv_module._launch(x, w, b, False, block_k=block_k)
    early = gemv_module._launch(x, w, b, True, block_k=block_k)
    assert torch.equal(early, plain)
    ref = F.linear(x, w, b)
    assert ((early - ref).abs() <= error_bound(x, w, ref) + 2.0**-22 * b.abs()).all()
