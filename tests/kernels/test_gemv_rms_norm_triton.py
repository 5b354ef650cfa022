"""gemv_rms_norm's Triton kernel on the CPU, through Triton's interpreter, against the float64 reference within
kernels/gemv_rms_norm.py error_bound (its derivation: the docstring there), h bit for bit the eager add.

fp16 and fp32 only: the 3.6 interpreter truncates fp32 -> bf16 (a GPU rounds to nearest even), so its bf16 h is
not eager's; bf16 runs in test_gemv_rms_norm_gpu.py. Odd K and N and small K tiles make the tiles cross K and N.

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_gemv_rms_norm_triton.py`
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

from kvrewrite.kernels import gemv_rms_norm as m  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("N, K, tuning", [(37, 700, dict(block_k=256)), (5, 77, dict(block_k=32, preload=False)),
                                          (9, 4096, dict()), (3, 100, dict(block_k=128, block_n=4)),
                                          (37, 700, dict(block_k=256, split_norm=True)),  # the split norm's two launches
                                          (5, 77, dict(block_k=32, split_norm=True)),  # its row in registers
                                          (5, 77, dict(block_k=32, split_norm=True, norm_row_tiles=0))])  # its loops
def test_kernel_within_the_bound_of_float64(N, K, tuning, residual, unit_offset, dtype):
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(1, 1, K, generator=g).to(dtype)
    r = torch.randn(1, 1, K, generator=g).to(dtype) if residual else None
    nw = (torch.randn(K, generator=g) * (0.2 if unit_offset else 1.0)).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if N % 2 else None
    with set_wrap_triton_enabled(False):
        y, h = m._launch(x, r, nw, 1e-5, w, b, unit_offset, **tuning)
    y64, h_ref, n64 = m.reference_f64(x, r, nw, 1e-5, w, b, unit_offset)
    if residual:
        assert torch.equal(h, x + r) and torch.equal(h, h_ref)
    else:
        assert h.numel() == 0
    err = ((y.double() - y64).abs() / m.error_bound(x, w, n64, y64)).max().item()
    assert err <= 1, f"{err:.2f}x the bound"


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("tuning", [dict(block_k=32), dict(block_k=32, preload=True)])
def test_constant_weight_loads_earlier_and_computes_the_same_bits(residual, tuning):
    """constant_weight moves the first weight tile's load before the PDL wait (EARLY_W, which sets PRELOAD): the
    same product in the same order."""
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(1, 1, 100, generator=g), (torch.randn(1, 1, 100, generator=g) if residual else None)
    nw, w = torch.randn(100, generator=g), torch.randn(7, 100, generator=g) / 10
    with set_wrap_triton_enabled(False):
        plain = m._launch(x, r, nw, 1e-5, w, None, False, False, **tuning)
        early = m._launch(x, r, nw, 1e-5, w, None, False, True, **tuning)
    assert torch.equal(plain[0], early[0]) and torch.equal(plain[1], early[1])


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_split_norm_row_in_registers_computes_the_loops_bits(residual, unit_offset):
    """The norm kernel's row held in registers (ROW_TILES, the default up to NORM_REGISTER_ELEMENTS) adds the tiles'
    squares in its loops' order: the same n, so the same y and h."""
    g = torch.Generator().manual_seed(11)
    x, r = torch.randn(1, 1, 300, generator=g), (torch.randn(1, 1, 300, generator=g) if residual else None)
    nw, w = torch.randn(300, generator=g), torch.randn(7, 300, generator=g) / 20
    with set_wrap_triton_enabled(False):
        loops = m._launch(x, r, nw, 1e-5, w, None, unit_offset, split_norm=True, block_k=64, norm_row_tiles=0)
        regs = m._launch(x, r, nw, 1e-5, w, None, unit_offset, split_norm=True, block_k=64)
    assert m.launch_config(7, 300, split_norm=True, block_k=64)["norm_row_tiles"] == 8  # 5 tiles, padded
    assert torch.equal(loops[0], regs[0]) and torch.equal(loops[1], regs[1])
