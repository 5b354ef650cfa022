"""tp_all_reduce's push kernel on the CPU, through Triton's interpreter, as rank 0 of 2 with rank 1 played by the test:
rank 1's partial sum already in rank 0's buffer and its flag raised there, as its kernel leaves them. Checks the
sum (float32 bit for bit; bf16 within the interpreter's rounding, toward zero; + residual), the push into rank 1's buffer, the flags (rank 1's taken in
rank 0's buffer, rank 0's raised in rank 1's), the slot alternating per call and the grid stride (more blocks
than programs); the same of tp_all_reduce_rms_norm's one-program kernel, with the norm of the sum against HF's
spelling (both, Llama's and Gemma's). The 2-GPU runs are tests/test_tensor_parallel.py (test_tensor_parallel_gpu_nccl: bit for bit NCCL).

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_tp_all_reduce_triton.py`
(with Triton installed; skipped otherwise).
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels._tp_all_reduce_kernels import (  # noqa: E402
    BLOCK, MAX_PROGRAMS, buffer_bytes, flag_offset, launch_push, launch_push_rms_norm)
from kvrewrite.kernels.gemv_rms_norm import reference_rms_norm  # noqa: E402

WORLD, MAX_BYTES = 2, 1 << 19  # the largest message: (MAX_PROGRAMS + 1) * BLOCK float32 fits


def _flags(buf) -> torch.Tensor:
    return buf[flag_offset(WORLD, MAX_BYTES):].view(torch.int32).view(WORLD, MAX_PROGRAMS)


def _region(buf, slot: int, src: int, dtype, n: int) -> torch.Tensor:
    elems = MAX_BYTES // dtype.itemsize
    return buf[: flag_offset(WORLD, MAX_BYTES)].view(dtype)[(slot * WORLD + src) * elems:][:n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [8, 3 * BLOCK + 8, (MAX_PROGRAMS + 1) * BLOCK])  # a partial block; the grid stride
@pytest.mark.parametrize("residual", [False, True])
def test_rank0_of_two(dtype, n, residual):
    gen = torch.Generator().manual_seed(n)
    bufs = [torch.zeros(buffer_bytes(WORLD, MAX_BYTES), dtype=torch.uint8) for _ in range(WORLD)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    count = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    programs = min(MAX_PROGRAMS, -(-n // BLOCK))
    for call in range(3):  # slots 0, 1, 0
        slot = call % 2
        x0, x1, r = (torch.randn(n, generator=gen).to(dtype) for _ in range(3))
        _region(bufs[0], slot, 1, dtype, n).copy_(x1)  # what rank 1's kernel pushed and raised
        _flags(bufs[0])[1, :programs] = 1
        out = torch.full_like(x0, float("nan"))  # poisoned
        launch_push(x0, r if residual else None, out, ptrs, count, 0, WORLD, MAX_BYTES)
        want = (x0.float() + x1.float()).to(dtype)
        if residual:
            want = (want.float() + r.float()).to(dtype)
        err = (out.float() - want.float()).abs()
        if dtype == torch.float32:
            assert torch.equal(out, want), f"call {call}: differs by {err.max()}"
        else:  # the interpreter rounds float32 to bf16 toward zero (GPUs to nearest even: the GPU test's NCCL bits)
            bound = 2 ** -6 * (x0.float().abs() + x1.float().abs() + (r.float().abs() if residual else 0))
            assert bool((err <= bound).all()), f"call {call}: differs by {err.max()} (allowed {bound.max()})"
        assert torch.equal(_region(bufs[1], slot, 0, dtype, n), x0)  # pushed into rank 1's region of this slot
        assert not _flags(bufs[0]).any()  # rank 1's flags taken
        assert torch.equal(_flags(bufs[1])[0, :programs], torch.ones(programs, dtype=torch.int32))  # ours raised
        assert not _flags(bufs[1])[0, programs:].any() and not _flags(bufs[1])[1].any()
        _flags(bufs[1]).zero_()  # rank 1 takes them
        assert torch.equal(count[:programs], torch.full((programs,), call + 1, dtype=torch.int32))
        assert not count[programs:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4096, 3000])  # two whole 2048-wide tiles; a partial one
@pytest.mark.parametrize("residual, unit_offset", [(False, False), (True, False), (True, True)])
def test_norm_kernel_rank0_of_two(dtype, n, residual, unit_offset):
    gen = torch.Generator().manual_seed(n + residual)
    bufs = [torch.zeros(buffer_bytes(WORLD, MAX_BYTES), dtype=torch.uint8) for _ in range(WORLD)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    count = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    nw = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    for call in range(3):  # slots 0, 1, 0
        slot = call % 2
        x0, x1, r = (torch.randn(n, generator=gen).to(dtype) for _ in range(3))
        _region(bufs[0], slot, 1, dtype, n).copy_(x1)  # what rank 1's kernel pushed and raised
        _flags(bufs[0])[1, 0] = 1
        h, normed = torch.full_like(x0, float("nan")), torch.full_like(x0, float("nan"))  # poisoned
        launch_push_rms_norm(x0, r if residual else None, nw, 1e-5, unit_offset, h, normed, ptrs, count, 0, WORLD,
                             MAX_BYTES)
        want = (x0.float() + x1.float()).to(dtype)
        if residual:
            want = (want.float() + r.float()).to(dtype)
        want_n = reference_rms_norm(want, nw, 1e-5, unit_offset)
        if dtype == torch.float32:
            assert torch.equal(h, want), f"call {call}: h differs by {(h - want).abs().max()}"
            err = (normed - want_n).abs().max()
            assert err <= 1e-5 * want_n.abs().max(), f"call {call}: n differs by {err}"
        else:  # the interpreter rounds float32 to bf16 toward zero (GPUs to nearest even): h within 2 of its ulps
            # a summand's size; n within those carried through the norm, plus its own two roundings
            bound_h = 2 ** -6 * (x0.float().abs() + x1.float().abs() + (r.float().abs() if residual else 0))
            inv_rms = want.float().pow(2).mean().rsqrt()
            scale = (nw.float() + 1 if unit_offset else nw.float()).abs() * inv_rms
            bound_n = scale * bound_h * 1.01 + 2 ** -6 * want_n.float().abs()
            for what, got, ref, bound in (("h", h, want, bound_h), ("n", normed, want_n, bound_n)):
                err = (got.float() - ref.float()).abs()
                assert bool((err <= bound).all()), f"call {call}: {what} differs by {err.max()}"
        assert torch.equal(_region(bufs[1], slot, 0, dtype, n), x0)  # pushed into rank 1's region of this slot
        assert not _flags(bufs[0]).any()  # rank 1's flag taken
        assert int(_flags(bufs[1])[0, 0]) == 1 and int(_flags(bufs[1]).sum()) == 1  # ours raised, only program 0's
        _flags(bufs[1]).zero_()  # rank 1 takes it
        assert int(count[0]) == call + 1 and not count[1:].any()
