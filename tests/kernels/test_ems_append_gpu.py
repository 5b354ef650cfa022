"""ems_append's Triton kernel compiled on CUDA against the reference (on the same GPU), bit for bit: fresh random
EMS slot tables (tests/kernels/test_ems_score_gpu.py's `synthetic_state`) with ragged fills and slot counts per
row, prefill chunks and decode steps, raw_keys fp16/bf16/fp32 from k_pre of another dtype (rounding to nearest
even), a non-contiguous k_pre, pos "with" (no raw keys), stores masked past capacity, and a CUDA graph of decode
steps replayed."""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import _ems_rank_kernels as kk
from kvrewrite.kernels import ems_append as op_file
from kvrewrite.kernels.ems_append import reference_ems_append
from tests.kernels.test_ems_score_gpu import synthetic_state

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(kk.triton is None, reason="needs Triton"),
]

TABLE = ("entry_start", "raw_keys", "lut", "key_scale", "token_pos", "slot_order", "slot_fill")
FILLS = [[300, 17, 299, 0], [250, 301, 64, 1]]
SLOTS = [[900, 17, 299, 0], [700, 1100, 100, 1]]


def state(C, R, D, dtype, pos, seed=0):
    s = synthetic_state(2, 4, C, R, FILLS, SLOTS, pads=(0, 5), seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    s["raw_keys"] = torch.randn(2, 4, C if pos == "without" else 0, D, generator=g, device="cuda").to(dtype)
    return s


def append_both(s, k_pre, cp):
    """fill += T (as cache_append leaves it), then the kernel on s and the reference on a copy; equal bit for bit."""
    s["fill"] += k_pre.shape[2]
    ref = {n: s[n].clone() for n in TABLE}
    reference_ems_append(s["fill"], k_pre, cp, *(ref[n] for n in TABLE))
    kk.triton_ems_append(s["fill"], k_pre, cp, *(s[n] for n in TABLE))
    for n in TABLE:
        assert torch.equal(s[n], ref[n]), n


@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("dtype,k_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                           (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("D", [64, 128])
def test_prefill_chunks_and_decode_steps_match_the_reference(pos, dtype, k_dtype, D):
    C, R = 700, 1500
    s = state(C, R, D, dtype, pos, seed=D)
    g = torch.Generator(device="cuda").manual_seed(1)
    p = 5000
    for T in (37, 256, 1, 1, 3):
        k_pre = torch.randn(2, 4, T, D, generator=g, device="cuda").to(k_dtype)
        cp = torch.arange(p, p + T, device="cuda")
        append_both(s, k_pre, cp)
        p += T


def test_non_contiguous_k_pre():
    s = state(700, 1500, 128, torch.bfloat16, "without")
    k_pre = torch.randn(2, 9, 4, 128, device="cuda").transpose(1, 2)  # [B, H, T, D] from [B, T, H, D]
    append_both(s, k_pre, torch.arange(40, 49, device="cuda"))


def test_past_capacity_the_stores_are_masked():
    s = state(310, 1101, 64, torch.float32, "without")  # row (1, 1) holds 1100 of 1101 slots, row (0, 0) 300 of 310
    s["fill"] += 5
    before = {n: s[n].clone() for n in TABLE}
    k_pre = torch.randn(2, 4, 5, 64, device="cuda")
    cp = torch.arange(9000, 9005, device="cuda")
    kk.triton_ems_append(s["fill"], k_pre, cp, *(s[n] for n in TABLE))
    assert int(s["slot_fill"][1, 1]) == 1101 and int(s["lut"][1, 1, 1100]) == 301  # 1 of the 5 slots fits
    assert torch.equal(s["slot_fill"], torch.clamp(before["slot_fill"] + 5, max=1101))
    assert torch.equal(s["entry_start"][1, 1, 301:306].cpu(), torch.arange(1100, 1105, dtype=torch.int32))
    assert torch.equal(s["entry_start"][0, 0, 300:305].cpu(), torch.arange(900, 905, dtype=torch.int32))
    assert torch.equal(s["raw_keys"][0, 0, 300:305], k_pre[0, 0])
    assert torch.equal(s["entry_start"][0, 0, :300], before["entry_start"][0, 0, :300])  # nothing else moved
    assert torch.equal(s["raw_keys"][0, 0, 305:], before["raw_keys"][0, 0, 305:])


def test_cuda_graph_of_decode_steps():
    s = state(700, 1500, 128, torch.bfloat16, "without")
    k_pre = torch.randn(2, 4, 1, 128, device="cuda")
    cp = torch.tensor([7000], device="cuda")
    s["fill"] += 1  # the warm-up step's entry (fill >= T, as after cache_append)
    ref = {n: s[n].clone() for n in TABLE}
    ref_fill = s["fill"].clone()
    kk.triton_ems_append(s["fill"], k_pre, cp, *(s[n] for n in TABLE))  # compile outside the capture
    reference_ems_append(ref_fill, k_pre, cp, *(ref[n] for n in TABLE))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s["fill"].add_(1)
        kk.triton_ems_append(s["fill"], k_pre, cp, *(s[n] for n in TABLE))
    for step in range(3):
        k_pre.normal_()
        cp.fill_(7001 + step)
        graph.replay()
        ref_fill += 1
        reference_ems_append(ref_fill, k_pre, cp, *(ref[n] for n in TABLE))
    for n in TABLE:
        assert torch.equal(s[n], ref[n]), n


def test_the_op_runs_the_kernel_on_cuda(monkeypatch):
    monkeypatch.setattr(op_file, "KERNELS_CHECKED_ON_GPU", True)
    s = state(700, 1500, 64, torch.float16, "without")
    calls = []
    real = kk.triton_ems_append
    monkeypatch.setattr(kk, "triton_ems_append", lambda *a, **k: calls.append(1) or real(*a, **k))
    T = 3
    s["fill"] += T
    ref = {n: s[n].clone() for n in TABLE}
    k_pre = torch.randn(2, 4, T, 64, device="cuda").half()
    cp = torch.arange(100, 103, device="cuda")
    keys = torch.zeros(2, 4, 700, 64, device="cuda", dtype=torch.float16)
    torch.ops.kvrewrite.ems_append(keys, s["bias"], s["fill"], k_pre, cp, torch.ones(2, T, dtype=torch.bool,
                                                                                      device="cuda"),
                                   *(s[n] for n in TABLE))
    reference_ems_append(s["fill"], k_pre, cp, *(ref[n] for n in TABLE))
    assert calls and all(torch.equal(s[n], ref[n]) for n in TABLE)
