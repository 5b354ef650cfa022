"""gemv_rms_norm_glu's Triton kernels on the CPU, through Triton's interpreter: z against the float64 reference
within kernels/gemv_rms_norm_glu.py error_bound, and bit for bit what the two launches it replaces compute in the
interpreter (gemv_rms_norm's split norm and GEMV, then gemv_glu's act and product), h the eager add.

fp16 and fp32 only (the 3.6 interpreter truncates fp32 -> bf16; bf16 runs in test_gemv_rms_norm_glu_gpu.py).

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_gemv_rms_norm_glu_triton.py`
(with Triton installed; skipped otherwise).
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from torch._library.triton import set_wrap_triton_enabled  # noqa: E402

from kvrewrite.kernels import gemv_glu, gemv_rms_norm  # noqa: E402
from kvrewrite.kernels import gemv_rms_norm_glu as m  # noqa: E402


def _inputs(I, K, dtype, residual, bias, unit_offset, seed=0):
    g = torch.Generator().manual_seed(seed + I + K)
    x = torch.randn(1, 1, K, generator=g).to(dtype)
    r = torch.randn(1, 1, K, generator=g).to(dtype) if residual else None
    nw = (torch.randn(K, generator=g) * (0.2 if unit_offset else 1.0)).to(dtype)
    w = (torch.randn(2 * I, K, generator=g) * 2 / K**0.5).to(dtype)
    b = torch.randn(2 * I, generator=g).to(dtype) if bias else None
    return x, r, nw, w, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("I, K, tuning, residual, bias, unit_offset", [
    (37, 700, dict(block_k=256), True, False, False),
    (5, 77, dict(block_k=32), False, True, False),
    (9, 300, dict(pairs=4, block_k=64), True, True, True),  # the last program's pairs cross I
    (16, 64, dict(pairs=2), True, False, False)])
def test_kernel_within_the_bound_and_the_bits_of_the_two_launches(I, K, tuning, residual, bias, unit_offset, act,
                                                                    dtype):
    x, r, nw, w, b = _inputs(I, K, dtype, residual, bias, unit_offset)
    with set_wrap_triton_enabled(False):
        z, h = m._launch(x, r, nw, 1e-5, w, b, unit_offset, act, True, **tuning)
        y, h2 = gemv_rms_norm._launch(x, r, nw, 1e-5, w, b, unit_offset, True, split_norm=True,
                                      block_k=tuning.get("block_k"))
        # gemv_glu over an identity weight: act(a) * b rounded as the epilogue rounds it, each row's one term exact
        eye = torch.eye(I, dtype=dtype)
        two = gemv_glu._launch(y[..., :I].contiguous(), y[..., I:].contiguous(), eye, None, act)
    z64, n64, y64 = m.reference_f64(x, r, nw, 1e-5, w, b, unit_offset, act)
    assert z.shape == (1, 1, I) and torch.equal(h, h2)
    assert torch.equal(z, two)
    err = ((z.double() - z64).abs() / m.error_bound(x, w, n64, y64)).max().item()
    assert err <= 1, f"{err:.2f}x the bound"


def test_gate_and_up_swapped_is_outside_the_bound():
    """The bound means something: the same kernel reading the up rows as the gate's (the weight's halves swapped)
    lands far outside it."""
    x, r, nw, w, b = _inputs(24, 128, torch.float32, True, False, False, seed=7)
    swapped = torch.cat([w[24:], w[:24]])
    with set_wrap_triton_enabled(False):
        z, _ = m._launch(x, r, nw, 1e-5, swapped, None, False, "silu", False)
    z64, n64, y64 = m.reference_f64(x, r, nw, 1e-5, w, None, False, "silu")
    assert ((z.double() - z64).abs() / m.error_bound(x, w, n64, y64)).max().item() > 100
