"""The ordered prefill kernel (kernels/_ordered_prefill_kernels.py) and its routing on CUDA: rows whose slots hold their
tokens in position order (left padding, the past, the fresh chunk, empty slots after the fill), every dtype, head dims
64-256, GQA 1-7, T and C ragged against the tiles, outputs in memory filled with NaN first; against the reference, the
general prefill kernel and, for 16-bit data, TMA against pointer loads; positions from before 0 (the chunk padding)
and after; a row out of order routed to the general
kernel; the op under torch.compile (fake tensors: pointer loads) and inside a CUDA graph (TMA descriptors captured).
On a GPU machine: `python -m pytest -m gpu -q tests/kernels/test_ordered_prefill_gpu.py`.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import _ordered_prefill_kernels as op
from kvrewrite.kernels import _prefill_attention_kernels as pk
from kvrewrite.kernels import clustered_attention as ca
from tests.kernels.ordered_state import ordered_state
from tests.kernels.poisoned import poisoned
from tests.kernels.test_clustered_attention_gpu import DTYPES, _check
from tests.kernels.test_prefill_attention_gpu import _prefill

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(ca.triton is None, reason="needs Triton"),
]
# (B, Hq, Hkv, T, n_prev, C, pads, delta): GQA 4, 7, 1, 2; T ragged against the 128-query blocks; C ragged and past
# the fill; padding longer than a tile; a chunk at the start; positions from before 0 (the chunk padding) and after
SHAPES = [(2, 32, 8, 300, 1500, 2000, (0, 77), -100), (1, 14, 2, 257, 0, 300, (5,), 0),
          (3, 8, 8, 129, 700, 1000, (0,), 9), (2, 16, 8, 65, 4033, 4100, (0, 0, 130), -1)]


def _id(s):
    return "B{}-Hq{}Hkv{}-T{}-prev{}-C{}-delta{}".format(*s[:6], s[7])


def _reference(args):
    q, keys, values, bias, slot_pos, cp = args
    return ca.reference_clustered_attention(q.float(), keys.float(), values.float(), bias, slot_pos, cp,
                                            q.shape[-1] ** -0.5, 0, False, 0.0)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("D", (64, 128, 256), ids=lambda d: f"D{d}")
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_matches_reference_and_the_general_kernel(shape, D, dtype):
    """Ordered on (TMA where the default takes it) in poisoned memory: the reference's output, and the general
    kernel's within one rounding of a probability times the largest value (fp32: the same to 1e-5)."""
    B, Hq, Hkv, T, n_prev, C, pads, delta = shape
    args = ordered_state(B, Hq, Hkv, T, n_prev, C, D, pads, seed=hash((shape, D)) % 2**31, dtype=dtype,
                         device="cuda", delta=delta)
    nbytes = B * Hq * T * D * args[0].element_size()
    got = poisoned(lambda: _prefill(*args, 0, ordered=True), nbytes)
    ref = _reference(args)
    _check(got, ref, dtype, f"{_id(shape)} D{D} {dtype} ordered")
    general = _prefill(*args, 0, ordered=False)
    bound = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps * args[2].float().abs().max().item()
    assert (got.float() - general.float()).abs().max().item() <= bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tiles", [{}, dict(block_m=64, block_n=32), dict(block_m=128, block_n=128, num_warps=8)],
                         ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()) or "default")
@pytest.mark.parametrize("shape", SHAPES[:2], ids=_id)
def test_tma_matches_pointer_loads(shape, tiles, dtype):
    """The full tiles through TMA descriptors against pointer loads, lse included: the same data reaches the tensor
    cores, so within one rounding of a probability times the largest value; lse within 1e-6."""
    B, Hq, Hkv, T, n_prev, C, pads, delta = shape
    args = ordered_state(B, Hq, Hkv, T, n_prev, C, 128, pads, seed=9, dtype=dtype, device="cuda", delta=delta)
    assert op.tma_refusal(args[1], args[2]) is None or torch.cuda.get_device_capability()[0] < 9
    outs = []
    for tma in (False, True):
        lse = torch.full((B, Hq, T), math.nan, device="cuda")
        outs.append((_prefill(*args, 0, 0.0, lse, ordered=dict(tiles, tma=tma)), lse))
    (ptr, lse_ptr), (tma_out, lse_tma) = outs
    bound = torch.finfo(dtype).eps * args[2].float().abs().max().item()
    assert (tma_out.float() - ptr.float()).abs().max().item() <= bound
    torch.testing.assert_close(lse_tma, lse_ptr, rtol=1e-6, atol=1e-6)
    _check(tma_out, _reference(args), dtype, f"{_id(shape)} tma {tiles}")


def test_a_row_out_of_order_goes_to_the_general_kernel():
    """Row 1's slots 3 and 900 swapped (positions with them): routed to the general kernel, row 0 to the ordered one;
    both the reference's."""
    args = list(ordered_state(2, 32, 8, 200, 800, 1200, 128, seed=10, dtype=torch.bfloat16, device="cuda"))
    perm = torch.arange(1200, device="cuda")
    perm[3], perm[900] = 900, 3
    for i in (1, 2, 3, 4):
        args[i][1] = args[i][1][:, perm]
    order = pk.order_stats(2, 8, "cuda")
    pk.tile_ranges(args[3], args[4], 19, 64, False, {}, order)
    assert (order[:8].sum(1) == 0).all() and (order[8:].sum(1) == -1794).all()  # -(900 - 3) - (900 - 3)
    _check(_prefill(*args, 0, ordered=True), _reference(args), torch.bfloat16, "mixed rows")


def test_default_tma_choice():
    """TMA for 16-bit contiguous device state on compute capability >= 9; not for fp32, offload's host-mapped keys,
    or forced where it cannot serve (ValueError naming why)."""
    from kvrewrite import offload

    keys = torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert (op.tma_refusal(keys, keys) is None) == hopper
    assert "16-bit" in op.tma_refusal(keys.float(), keys.float()) or not hopper
    host = offload.host_alias(tuple(keys.shape), keys.dtype, keys.device)
    assert op.tma_refusal(host, host) is not None
    args = ordered_state(1, 8, 4, 100, 200, 300, 128, seed=11, device="cuda")  # fp32
    with pytest.raises(ValueError, match="tma=True needs"):
        _prefill(*args, 0, ordered=dict(tma=True))


def test_op_under_compile_and_in_a_cuda_graph(monkeypatch):
    """With ORDERED on, kvrewrite::clustered_attention on a prefill chunk: under torch.compile(fullgraph=True) (the
    body traced on fake tensors: pointer loads) and captured in a CUDA graph (the TMA descriptors' addresses captured,
    the queries changed in place before the replay): the eager output each time."""
    monkeypatch.setattr(op, "ORDERED", True)
    args = ordered_state(2, 32, 8, 256, 1024, 1400, 128, pads=(0, 40), seed=12, dtype=torch.bfloat16, device="cuda")
    q = args[0].contiguous()
    rest = args[1:]

    def attend(x):
        return torch.ops.kvrewrite.clustered_attention(x, *rest, 128 ** -0.5, 0)

    eager = attend(q)
    _check(eager, _reference((q, *rest)), torch.bfloat16, "op eager")
    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(compiled(q), eager, atol=torch.finfo(torch.bfloat16).eps * 8, rtol=0)
    static_q = q.clone()
    attend(static_q)  # compile the launch outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attend(static_q)
    new_q = torch.randn_like(q)
    static_q.copy_(new_q)
    graph.replay()
    torch.testing.assert_close(static_out, attend(new_q), atol=0, rtol=0)
