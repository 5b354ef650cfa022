"""tp_all_reduce's push kernel on the CPU, through Triton's interpreter, as rank 0 of 2 with rank 1 played by the test:
rank 1's partial sum already in rank 0's buffer and its flag set there to the call's epoch (the call count + 1), as its
kernel leaves them, or one ahead (rank 1 a call further on). Checks the sum (float32 bit for bit; bf16 within the
interpreter's rounding, toward zero; + residual), the push into rank 1's buffer, the flags (rank 0's set to the epoch
in rank 1's buffer, rank 1's left as they were), the slot alternating per call, the grid stride (more blocks than
programs) and call counts that wrap past 2**31 - 1 (the epochs compare by their signed difference); the same of
tp_all_reduce_rms_norm's one-program kernel, with the norm of the sum against HF's spelling (both, Llama's and
Gemma's). A kernel whose peer's flag has not reached the epoch waits for it (not run here: it would wait forever).
The 2-GPU runs are tests/test_tensor_parallel.py (test_tensor_parallel_gpu_nccl: bit for bit NCCL).

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


def _epoch(start: int, call: int) -> int:
    """The call's epoch as the kernels compute it: the int32 call count + 1, wrapping."""
    return (start + call + 1 + 2**31) % 2**32 - 2**31


def _region(buf, slot: int, src: int, dtype, n: int) -> torch.Tensor:
    elems = MAX_BYTES // dtype.itemsize
    return buf[: flag_offset(WORLD, MAX_BYTES)].view(dtype)[(slot * WORLD + src) * elems:][:n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [8, 3 * BLOCK + 8, (MAX_PROGRAMS + 1) * BLOCK])  # a partial block; the grid stride
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("start, ahead", [(0, 0), (2**31 - 2, 1)])  # counts from 0; wrapping, rank 1 a call ahead
def test_rank0_of_two(dtype, n, residual, start, ahead):
    gen = torch.Generator().manual_seed(n)
    bufs = [torch.zeros(buffer_bytes(WORLD, MAX_BYTES), dtype=torch.uint8) for _ in range(WORLD)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    programs = min(MAX_PROGRAMS, -(-n // BLOCK))
    count = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    count[:programs] = start
    for call in range(3):  # slots 0, 1, 0 (2**31 - 2 is even)
        slot = (start + call) % 2
        x0, x1, r = (torch.randn(n, generator=gen).to(dtype) for _ in range(3))
        _region(bufs[0], slot, 1, dtype, n).copy_(x1)  # what rank 1's kernel pushed and raised
        peer_flag = _epoch(start, call + ahead)
        _flags(bufs[0])[1, :programs] = peer_flag
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
        assert torch.equal(_flags(bufs[0])[1, :programs], torch.full((programs,), peer_flag, dtype=torch.int32))
        assert not _flags(bufs[0])[0].any() and not _flags(bufs[0])[1, programs:].any()  # rank 1's left as they were
        raised = torch.full((programs,), _epoch(start, call), dtype=torch.int32)
        assert torch.equal(_flags(bufs[1])[0, :programs], raised)  # ours set to this call's epoch in rank 1's buffer
        assert not _flags(bufs[1])[0, programs:].any() and not _flags(bufs[1])[1].any()
        assert torch.equal(count[:programs], raised)  # the call count, + 1
        assert not count[programs:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4096, 3000])  # two whole 2048-wide tiles; a partial one
@pytest.mark.parametrize("residual, unit_offset", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("start, ahead", [(0, 0), (2**31 - 2, 1)])  # counts from 0; wrapping, rank 1 a call ahead
def test_norm_kernel_rank0_of_two(dtype, n, residual, unit_offset, start, ahead):
    gen = torch.Generator().manual_seed(n + residual)
    bufs = [torch.zeros(buffer_bytes(WORLD, MAX_BYTES), dtype=torch.uint8) for _ in range(WORLD)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    count = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    count[0] = start
    nw = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    for call in range(3):
        slot = (start + call) % 2
        x0, x1, r = (torch.randn(n, generator=gen).to(dtype) for _ in range(3))
        _region(bufs[0], slot, 1, dtype, n).copy_(x1)  # what rank 1's kernel pushed and raised
        peer_flag = _epoch(start, call + ahead)
        _flags(bufs[0])[1, 0] = peer_flag
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
        assert int(_flags(bufs[0])[1, 0]) == peer_flag and int(_flags(bufs[0]).count_nonzero()) == 1  # left as it was
        epoch = _epoch(start, call)
        assert int(_flags(bufs[1])[0, 0]) == epoch and int(_flags(bufs[1]).count_nonzero()) == 1  # ours, program 0's
        assert int(count[0]) == epoch and not count[1:].any()
