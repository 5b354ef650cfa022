"""kvrewrite::gemv_rms_norm_glu on the CPU: the aten ops it replaces (gemv_rms_norm's, two slices, act, mul), bit for
bit, and its input errors named. The Triton kernel: test_gemv_rms_norm_glu_triton.py (interpreter) and _gpu.py."""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels.gemv_glu import activation

OPS = torch.ops.kvrewrite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("residual, bias, unit_offset", [(True, False, False), (False, True, False),
                                                         (True, True, True)])
def test_cpu_is_the_replaced_aten_ops_bit_for_bit(residual, bias, unit_offset, act, dtype):
    g = torch.Generator().manual_seed(3)
    K, I = 40, 24
    x = torch.randn(1, 1, K, generator=g).to(dtype)
    r = torch.randn(1, 1, K, generator=g).to(dtype) if residual else None
    nw = torch.randn(K, generator=g).to(dtype)
    w = (torch.randn(2 * I, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(2 * I, generator=g).to(dtype) if bias else None
    z, h = OPS.gemv_rms_norm_glu(x, r, nw, 1e-6, w, b, unit_offset, act, True)
    y, h_ref = OPS.gemv_rms_norm(x, r, nw, 1e-6, w, b, unit_offset, True)
    assert torch.equal(z, activation(y[..., :I], act) * y[..., I:]) and z.is_contiguous()
    assert torch.equal(h, h_ref)


def test_errors_name_what_is_wrong():
    x, nw = torch.randn(1, 1, 8), torch.randn(8)
    with pytest.raises(ValueError, match="odd 7 rows"):
        OPS.gemv_rms_norm_glu(x, None, nw, 1e-6, torch.randn(7, 8), None, False, "silu", False)
    with pytest.raises(ValueError, match="act must be one of"):
        OPS.gemv_rms_norm_glu(x, None, nw, 1e-6, torch.randn(6, 8), None, False, "relu", False)
    with pytest.raises(ValueError, match="norm_weight must be"):
        OPS.gemv_rms_norm_glu(x, None, torch.randn(7), 1e-6, torch.randn(6, 8), None, False, "silu", False)
