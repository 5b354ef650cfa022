"""kvrewrite::indexed_attention on CUDA: the Triton kernel against the reference at realistic sizes, CUDA graphs,
torch.compile, opcheck.

Inputs are drawn on the GPU: keys, values, q ~ N(0, 1), bias = log of degrees 1..5 with ~10% empty slots (-inf),
and an index of distinct random slots laid out as ClusterKV's selection writes it at S = 1344 (16 sinks, 1008
selected with a -1 tail, 320 window entries with a -1 tail), else with a run of -1 longer than a split and ~5%
scattered -1. Every op call runs in memory filled with NaN first, so an output element the kernel forgets to
write fails the comparison. Skipped without CUDA or Triton.
On a GPU machine: `python -m pytest -m gpu -q tests/kernels/test_indexed_attention_gpu.py`.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.cuda_graphs import capture, warm_up
from kvrewrite.kernels import indexed_attention as ia
from tests.kernels.poisoned import poisoned as _poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(ia.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.indexed_attention.default
CLUSTERED = torch.ops.kvrewrite.clustered_attention.default

# Tolerance: q's dtype -> assert_close(op output, reference on the fp32-upcast inputs); only the kernel's
# rounding remains (tests/kernels/test_clustered_attention_gpu.py derives these): fp32 ieee dots and fp32
# softmax ~1e-6; fp16 / bf16 round p before p @ v and the output once: 2e-3 / 1.6e-2. A dropped entry, a
# wrong head or a misplaced bias moves outputs by >= 1e-1.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KINDS = ("per_kv", "per_q")


def _inputs(B, Hq, Hkv, T, C, D, S, dtype, kind, seed, q_std=1.0):
    """(q as a transposed view, keys, values, bias, index), drawn on the GPU (module docstring)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    keys = torch.randn(B, Hkv, C, D, device=dev, generator=g).to(dtype)
    values = torch.randn(B, Hkv, C, D, device=dev, generator=g).to(dtype)
    q = (torch.randn(B, T, Hq, D, device=dev, generator=g) * q_std).to(dtype).transpose(1, 2)
    bias = torch.randint(1, 6, (B, Hkv, C), device=dev, generator=g).float().log()
    bias.masked_fill_(torch.rand(B, Hkv, C, device=dev, generator=g) < 0.1, -math.inf)
    Hsel = Hkv if kind == "per_kv" else Hq
    if S <= C:  # distinct slots
        index = torch.rand(B, Hsel, C, device=dev, generator=g).argsort(-1)[..., :S].int()
    else:  # more entries than slots: duplicates
        index = torch.randint(0, C, (B, Hsel, S), device=dev, generator=g, dtype=torch.int32)
    if S == 1344:  # ClusterKV: 16 sinks, 1008 selected (the last 58 unused), 320 window (the last 120 unused)
        index[..., 16 + 950:16 + 1008] = -1
        index[..., 1344 - 120:] = -1
    else:
        index[..., S * 5 // 8: S * 3 // 4] = -1
        index.masked_fill_(torch.rand(B, Hsel, S, device=dev, generator=g) < 0.05, -1)
    return q, keys, values, bias, index


def _reference(q, keys, values, bias, index, scale, softcap=0.0):
    return ia.reference_indexed_attention(q.float(), keys.float(), values.float(), bias, index, scale, softcap)


def _nbytes(q, index, **tuning):
    """The output and the split partials of a launch (for the poisoned pool)."""
    B, Hq, T, D = q.shape
    cfg = ia._launch_config(B, index.shape[1], Hq // index.shape[1], T, index.shape[2], D,
                            ia._num_sms(q.device), q.element_size(), **tuning)
    return B * Hq * T * (D * q.element_size() + cfg["num_splits"] * (D + 2) * 4)


def _check(out, ref, dtype, what, softcap=0.0):
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous(), what
    assert torch.isfinite(out).all(), f"{what}: {int((~torch.isfinite(out)).sum())} non-finite outputs (unwritten?)"
    rel = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    tol = dict(TOL[dtype], atol=max(TOL[dtype]["atol"], 2e-6 * softcap))
    torch.testing.assert_close(out.float(), ref, **tol, msg=f"{what}: max |diff| / max |ref| = {rel:.3g}")


def _run_and_compare(B, Hq, Hkv, T, C, D, S, dtype, kind, seed, softcap=0.0, **tuning):
    """The op (or, with `tuning`, the launcher) against the reference, in poisoned memory. softcap > 0 draws
    q ~ N(0, softcap**2): the scaled scores then spread over about +-softcap, where the cap bends them."""
    q, keys, values, bias, index = _inputs(B, Hq, Hkv, T, C, D, S, dtype, kind, seed, q_std=softcap or 1.0)
    scale = D**-0.5
    ref = _reference(q, keys, values, bias, index, scale, softcap)
    args = (q, keys, values, bias, index, scale)
    if tuning:
        out = _poisoned(lambda: ia.triton_indexed_attention(*args, softcap, **tuning), _nbytes(q, index, **tuning))
    else:  # the op, softcap as the graphs pass it (a keyword, only when set)
        kwargs = dict(softcap=softcap) if softcap else {}
        out = _poisoned(lambda: OP(*args, **kwargs), _nbytes(q, index))
    _check(out, ref, dtype, f"B{B} Hq{Hq} Hkv{Hkv} T{T} C{C} D{D} S{S} {dtype} {kind} softcap {softcap} "
                            f"{tuning or ''}", softcap)


# (B, Hq, Hkv, T, C, D, S): the Llama-3.1-8B decode shapes (32k and 128k slots, S = 1344, B = 1 and 8), GQA 1/3/4/7,
# ragged S (never a multiple of the 64-entry tile but 1344), S > C (duplicates), T > 1 (5 queries; 64: rows in
# several 64-row blocks), D 64/128/256
SHAPES = [
    (1, 32, 8, 1, 32768, 128, 1344),
    (8, 32, 8, 1, 32768, 128, 1344),
    (1, 32, 8, 1, 131072, 128, 1344),
    (3, 14, 2, 1, 4097, 128, 1000),
    (1, 9, 3, 1, 2000, 64, 333),
    (2, 4, 4, 1, 300, 128, 777),
    (1, 8, 2, 5, 3000, 128, 500),
    (1, 16, 2, 64, 5000, 128, 700),
    (2, 8, 2, 1, 1000, 256, 300),
]


def _id(shape):
    return "B{}-Hq{}Hkv{}-T{}-C{}-D{}-S{}".format(*shape)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=[_id(s) for s in SHAPES])
def test_triton_matches_reference(shape, dtype, kind):
    _run_and_compare(*shape, dtype, kind, seed=hash((shape, str(dtype), kind)) % 2**31)


@pytest.mark.parametrize("D", (16, 32))
@pytest.mark.parametrize("kind", KINDS)
def test_small_head_dims(kind, D):
    """The tiny models of the CPU tests use D = 16."""
    for i, shape in enumerate([(2, 4, 2, 1, 100, D, 90), (1, 7, 1, 5, 37, D, 50)]):
        for dtype in DTYPES.values():
            _run_and_compare(*shape, dtype, kind, seed=100 * D + i)


def _tuning_id(tuning):
    return "-".join(f"{k}{v}" for k, v in tuning.items())


@pytest.mark.parametrize("tuning", [dict(num_splits=1), dict(num_splits=2), dict(num_splits=7), dict(num_splits=64),
                                    dict(block_n=16), dict(block_n=32), dict(block_n=128), dict(num_warps=8),
                                    dict(num_stages=3), dict(num_stages=1), dict(fuse_combine=False),
                                    dict(num_splits=7, fuse_combine=False), dict(fuse_combine=True),
                                    dict(combine_rows=1, fuse_combine=True),
                                    dict(num_splits=64, combine_rows=2, fuse_combine=True), dict(pdl=True),
                                    dict(early_v=False), dict(early_v=False, num_splits=1),
                                    dict(early_v=True, num_splits=1)], ids=_tuning_id)
def test_launch_variants_agree(tuning):
    """Forced split counts, tile sizes, warps and stages (the benchmark's sweep space): the same function."""
    for kind in KINDS:
        _run_and_compare(2, 32, 8, 1, 32768, 128, 1344, torch.bfloat16, kind, seed=7, **tuning)
        _run_and_compare(1, 14, 2, 5, 3000, 64, 999, torch.float16, kind, seed=8, **tuning)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rows_with_nothing_are_zero(dtype, kind):
    """A row of only -1, a row listing only empty slots (bias -inf), and splits entirely of -1 (their partials
    weigh 0 in the combine): zeros where nothing is valid, the reference's values elsewhere."""
    B, Hq, Hkv, C, D, S = 2, 32, 8, 4096, 128, 1344
    q, keys, values, bias, index = _inputs(B, Hq, Hkv, 1, C, D, S, dtype, kind, seed=3)
    index[0, 1] = -1
    bias[1, 0, :50] = -math.inf
    index[1, 0] = torch.randint(0, 50, (S,), device="cuda", dtype=torch.int32)
    index[1, 2:, 64:640] = -1  # whole tiles and splits of -1
    args = (q, keys, values, bias, index, D**-0.5)
    out = _poisoned(lambda: OP(*args), _nbytes(q, index))
    _check(out, _reference(*args), dtype, "rows with nothing")
    G = Hq // Hkv
    rows = [(0, range(G, 2 * G)), (1, range(G))] if kind == "per_kv" else [(0, [1]), (1, [0])]
    for b, heads in rows:
        assert all((out[b, hq] == 0).all() for hq in heads)
    assert (out[0, 0] != 0).any() and (out[1, -1] != 0).any()
    empty = OP(q, keys, values, bias, index[..., :0], D**-0.5)
    assert empty.shape == q.shape and (empty == 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_empty_slots_and_minus_one_read_nothing_that_matters(kind):
    """Huge (finite) stale keys and values in empty slots: listing those slots is bit for bit the same as
    listing -1 there (both weigh exactly 0); garbage past -1 is never read (-1 reads nothing)."""
    B, Hq, Hkv, C, D, S = 2, 32, 8, 4096, 128, 1344
    q, keys, values, bias, index = _inputs(B, Hq, Hkv, 1, C, D, S, torch.bfloat16, kind, seed=4)
    empty = torch.isinf(bias)
    k2, v2 = keys.clone(), values.clone()
    k2[empty], v2[empty] = 1e4, -1e4
    listed_empty = torch.gather(empty.repeat_interleave(index.shape[1] // Hkv, dim=1), 2, index.clamp_min(0).long())
    assert (listed_empty & (index >= 0)).any()
    as_minus_one = torch.where(listed_empty, -1, index)
    assert torch.equal(OP(q, k2, v2, bias, index, D**-0.5), OP(q, keys, values, bias, as_minus_one, D**-0.5))


@pytest.mark.parametrize("kind", KINDS)
def test_full_index_is_clustered_attention(kind):
    """An index of every valid slot once, shuffled, -1 scattered: clustered_attention at decode (past_only)."""
    B, Hq, Hkv, C, D = 2, 32, 8, 4097, 128
    q, keys, values, bias, _ = _inputs(B, Hq, Hkv, 1, C, D, 1, torch.float32, kind, seed=5)
    Hsel = Hkv if kind == "per_kv" else Hq
    S = C + 300
    g = torch.Generator(device="cuda").manual_seed(6)
    order = torch.rand(B, Hsel, C, device="cuda", generator=g).argsort(-1)  # a shuffle of the slots
    slots = order.masked_fill(torch.isinf(torch.gather(bias.repeat_interleave(Hsel // Hkv, dim=1), 2, order)), -1)
    where = torch.rand(B, Hsel, S, device="cuda", generator=g).argsort(-1)[..., :C]  # places among S entries
    index = torch.full((B, Hsel, S), -1, device="cuda", dtype=torch.int32).scatter_(2, where, slots.int())
    slot_pos = torch.arange(C, device="cuda").expand(B, Hkv, C).contiguous()
    want = CLUSTERED(q, keys, values, bias, slot_pos, torch.tensor([C], device="cuda"), D**-0.5, 0, past_only=True)
    torch.testing.assert_close(OP(q, keys, values, bias, index, D**-0.5), want, atol=2e-5, rtol=1e-5)


# -- softcap -----------------------------------------------------------------------------------------------------

SOFTCAP_SHAPES = [(1, 32, 8, 1, 32768, 128, 1344), (3, 14, 2, 1, 4097, 128, 1000), (2, 9, 3, 17, 333, 64, 200)]


@pytest.mark.parametrize("softcap", [5.0, 50.0], ids=lambda c: f"cap{c:g}")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SOFTCAP_SHAPES, ids=[_id(s) for s in SOFTCAP_SHAPES])
def test_softcap_matches_reference(shape, dtype, kind, softcap):
    _run_and_compare(*shape, dtype, kind, seed=hash((shape, str(dtype), kind, softcap)) % 2**31, softcap=softcap)


def test_softcap_zero_is_the_uncapped_kernel():
    """softcap=0.0 is the kernel without SOFTCAP, bit for bit; a cap changes the result (the flag arrives)."""
    q, keys, values, bias, index = _inputs(2, 32, 8, 1, 4096, 128, 1344, torch.bfloat16, "per_kv", seed=9,
                                           q_std=30.0)
    args = (q, keys, values, bias, index, 128**-0.5)
    want = OP(*args)
    assert torch.equal(OP(*args, softcap=0.0), want)
    assert (OP(*args, softcap=30.0).float() - want.float()).abs().max() > 1e-1


# -- CUDA graphs, torch.compile, opcheck, errors -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_replay_matches_eager(kind):
    """The op captured in a CUDA graph (split + combine, every launch fixed by the shapes); replays with new q and
    index copied into the captured buffers give the eager op's bits."""
    B, Hq, Hkv, C, D, S = 2, 32, 8, 8192, 128, 1344
    q, keys, values, bias, index = _inputs(B, Hq, Hkv, 1, C, D, S, torch.bfloat16, kind, seed=10)
    static_q, static_index = q.clone(), index.clone()
    outs = []

    def call():
        return OP(static_q, keys, values, bias, static_index, D**-0.5)

    warm_up(call)
    graph = capture(lambda: outs.append(call()))
    for i in range(3):
        q2, _, _, _, index2 = _inputs(B, Hq, Hkv, 1, C, D, S, torch.bfloat16, kind, seed=20 + i)
        static_q.copy_(q2)
        static_index.copy_(index2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[0], OP(q2, keys, values, bias, index2, D**-0.5)), f"replay {i}"
    del graph


@pytest.mark.parametrize("softcap", [0.0, 50.0], ids=["nocap", "cap50"])
@pytest.mark.parametrize("kind", KINDS)
def test_compile_reduce_overhead_no_graph_break(kind, softcap):
    """A decode-step-like function around the op compiles whole (fullgraph=True) under CUDA graphs, Inductor sees
    the Triton kernels (user-defined kernels in its code), and replays match eager on new queries and indices."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    B, Hq, Hkv, C, D, S, dtype = 2, 32, 8, 8192, 128, 1344, torch.bfloat16
    _, keys, values, bias, index = _inputs(B, Hq, Hkv, 1, C, D, S, dtype, kind, seed=11)
    w_q = torch.randn(Hq * D, Hq * D, device="cuda", dtype=dtype) / (Hq * D) ** 0.5

    def step(x, index):
        q = (x @ w_q).view(B, 1, Hq, D).transpose(1, 2)  # [B, Hq, 1, D], a transposed view
        o = torch.ops.kvrewrite.indexed_attention(q, keys, values, bias, index, D**-0.5, softcap=softcap)
        return o.transpose(1, 2).reshape(B, Hq * D).float().sum(-1)

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    x0 = torch.randn(B, Hq * D, device="cuda", dtype=dtype)
    _, code = run_and_get_code(compiled, x0, index)
    assert any("_indexed_attention_fwd_kernel" in c for c in code), "Inductor did not inline the Triton kernel"
    for i in range(4):  # warm-up, recording, then replays
        x = torch.randn(B, Hq * D, device="cuda", dtype=dtype)
        idx = _inputs(B, Hq, Hkv, 1, C, D, S, dtype, kind, seed=30 + i)[4]
        got, want = compiled(x, idx).clone(), step(x, idx)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=1e-2, msg=f"call {i}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("case", [(torch.bfloat16, "per_kv", 1, 1344, 0.0), (torch.float16, "per_q", 1, 300, 30.0),
                                  (torch.float32, "per_kv", 3, 50, 0.0)], ids=["bf16-split", "fp16-per_q-cap", "fp32-T3"])
def test_opcheck_cuda(case):
    dtype, kind, T, S, softcap = case
    q, keys, values, bias, index = _inputs(2, 8, 2, T, 2000, 64, S, dtype, kind, seed=S)
    torch.library.opcheck(OP, (q, keys, values, bias, index, 0.125), {"softcap": softcap} if softcap else {})


def test_errors_are_clear():
    q, keys, values, bias, index = _inputs(1, 4, 2, 1, 37, 64, 20, torch.float16, "per_kv", seed=0)
    f = ia.triton_indexed_attention
    with pytest.raises(TypeError, match="index must be int32"):
        f(q, keys, values, bias, index.long(), 0.125)
    with pytest.raises(ValueError, match=r"index must be \[B=1, Hsel, S\]"):
        f(q, keys, values, bias, index[:, :1], 0.125)
    with pytest.raises(TypeError, match="bias must be fp32"):
        f(q, keys, values, bias.half(), index, 0.125)
    with pytest.raises(ValueError, match="head dim D"):
        f(q[..., :48], keys[..., :48], values[..., :48], bias, index, 0.125)
    with pytest.raises(ValueError, match="CUDA device"):
        f(q, keys, values, bias, index.cpu(), 0.125)
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        f(q, keys, values, bias, index, 0.125, softcap=-30.0)
