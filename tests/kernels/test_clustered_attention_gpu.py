"""kvrewrite::clustered_attention on CUDA: the Triton kernel against the reference, opcheck, torch.compile.

Every check draws fresh random inputs (make_state: past slots with random degrees and ~15% empty, then a
causal fresh block of T tokens) and runs the op in memory filled with NaN first, so an output element the
kernel forgets to write fails the comparison. Skipped without CUDA or Triton.
On a GPU machine: `python -m pytest -m gpu -q tests/kernels/test_clustered_attention_gpu.py`.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import clustered_attention as ca
from tests.kernels.poisoned import poisoned as _poisoned
from tests.kernels.test_clustered_attention import make_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(ca.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.clustered_attention.default

# Tolerance table: q's dtype -> assert_close(op output, reference on the fp32-upcast inputs).
# Inputs are the same exact values for both, so only the kernel's own rounding remains:
#   fp32: ieee fp32 dots (no TF32), fp32 softmax and accumulation in another order and base 2 (exp2 of
#         logit * log2 e): ~1e-6 absolute on outputs of size <= ~4; 2e-5 / 1e-5 leaves 10x headroom and
#         sits ~1e3 below what a real bug moves (a dropped bias, wrong GQA head or off-by-one mask >= 1e-2).
#   fp16: q.k in fp16 products with fp32 sums (exact), p rounded to fp16 before p @ v (relative 2**-11 per
#         weight), output rounded to fp16 (half an ulp: 2**-11 relative): <= 2**-11 * max|v| ~ 2e-3 worst case.
#   bf16: the same with an 8-bit significand: p and output at 2**-8 / 2**-9 relative: 1.6e-2 (2**-6) covers
#         the worst case (the Triton tutorial uses 1e-2 for fp16 attention); typical errors are ~1e-3.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (B, Hq, Hkv, T, C, window). GQA ratios of the supported families: 1, 3 (SmolLM2 9/3), 4, 7 (Qwen2.5
# 14/2), 8. C is ragged (never a multiple of the 32/64-slot tile) except 1; C = 4097 at T = 1 and small
# B * Hkv is split over many programs (split-K + combine), C = 1 and 37 are not. T = 64 is a prefill
# chunk: the last min(T, C) slots are the fresh block, each query sees it causally.
SHAPES = [
    (1, 4, 4, 1, 1, 0),
    (3, 9, 3, 1, 37, 0),
    (1, 8, 2, 1, 1000, 16),
    (3, 14, 2, 1, 4097, 0),
    (1, 16, 2, 1, 4097, 16),
    (3, 32, 4, 1, 1000, 0),
    (1, 7, 1, 1, 37, 16),
    (1, 9, 3, 5, 1000, 0),
    (3, 8, 2, 5, 37, 16),
    (1, 14, 2, 5, 4097, 0),
    (3, 4, 4, 5, 1, 0),
    (1, 14, 2, 64, 1000, 0),
    (3, 4, 4, 64, 37, 16),
    (1, 16, 2, 64, 4097, 16),
    (3, 9, 3, 64, 1000, 0),
]
HEAD_DIMS = (64, 128, 256)


def _id(shape):
    B, Hq, Hkv, T, C, w = shape
    return f"B{B}-Hq{Hq}Hkv{Hkv}-T{T}-C{C}-w{w}"


def _tuning_id(tuning):
    return "-".join(f"{k}{v}" for k, v in tuning.items())


def _inputs(B, Hq, Hkv, T, C, D, dtype, seed, q_std=1.0):
    """make_state and q ~ N(0, q_std**2) (scale * q.k then has a standard deviation of about q_std)."""
    g = torch.Generator().manual_seed(seed)
    keys, values, bias, slot_pos, cp = make_state(B, Hkv, C, D, T, dtype, gen=g)
    q = (torch.randn(B, T, Hq, D, generator=g) * q_std).to(dtype).transpose(1, 2)  # a transposed view, as in the models
    return [x.cuda() for x in (q, keys, values, bias, slot_pos, cp)]


def _tol(dtype, softcap=0.0):
    """TOL[dtype]; with a soft cap the fp32 logits reach |softcap| and carry a few ulp of it (<= ~4 * softcap *
    2**-23 through the divide, tanh and multiply, in the reference as in the kernel's libdevice tanhf): each
    weight moves by that relatively, outputs (|v| <= ~4) by <= softcap * 2e-6. fp16/bf16 are dominated by the
    rounding of p before p @ v, which the cap does not change."""
    return dict(TOL[dtype], atol=max(TOL[dtype]["atol"], 2e-6 * softcap))


def _check(out, ref, dtype, what, softcap=0.0):
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous(), what
    assert torch.isfinite(out).all(), f"{what}: {int((~torch.isfinite(out)).sum())} non-finite outputs (unwritten?)"
    diff = (out.float() - ref).abs().max().item()
    rel = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    torch.testing.assert_close(out.float(), ref, **_tol(dtype, softcap),
                               msg=f"{what}: max |diff| {diff:.3g}, rel {rel:.3g}")


def _run_and_compare(B, Hq, Hkv, T, C, D, dtype, window, seed, past_only=False, softcap=0.0, **tuning):
    """The op (or, with `tuning`, the launcher) against the reference on fresh inputs. softcap > 0 also draws
    q ~ N(0, softcap**2): scale * q.k then spreads over about +-softcap, where the cap bends most scores."""
    q, keys, values, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, D, dtype, seed, q_std=softcap or 1.0)
    scale = D**-0.5
    f32 = [x.float() for x in (q, keys, values)]
    ref = ca.reference_clustered_attention(*f32, bias, slot_pos, cp, scale, window, past_only,  # checks the promise
                                           softcap)
    cfg = ca._launch_config(B, Hkv, Hq // Hkv, T, C, D, ca._num_sms(q.device), q.element_size(), **tuning)
    nbytes = B * Hq * T * (D * q.element_size() + cfg["num_splits"] * (D + 2) * 4)  # output, split partials
    args = (q, keys, values, bias, slot_pos, cp, scale, window)
    if tuning:
        out = _poisoned(lambda: ca.triton_clustered_attention(*args, past_only, softcap, **tuning), nbytes)
    else:  # the op, with past_only and softcap as the graphs pass them (keywords, only when set)
        kwargs = dict(past_only=True) if past_only else {}
        if softcap:
            kwargs["softcap"] = softcap
        out = _poisoned(lambda: OP(*args, **kwargs), nbytes)
    _check(out, ref, dtype, f"B{B} Hq{Hq} Hkv{Hkv} T{T} C{C} D{D} {dtype} window {window} past_only {past_only} "
                            f"softcap {softcap} {tuning or ''}", softcap)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("D", HEAD_DIMS, ids=[f"D{d}" for d in HEAD_DIMS])
@pytest.mark.parametrize("shape", SHAPES, ids=[_id(s) for s in SHAPES])
def test_triton_matches_reference(shape, D, dtype):
    B, Hq, Hkv, T, C, window = shape
    _run_and_compare(B, Hq, Hkv, T, C, D, dtype, window, seed=hash((shape, D, str(dtype))) % 2**31)


@pytest.mark.parametrize("D", (16, 32))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_small_head_dims(D, dtype):
    """The tiny models of the CPU tests use D = 16; D = 32 for completeness."""
    for i, (B, Hq, Hkv, T, C, window) in enumerate([(2, 4, 2, 1, 100, 0), (1, 7, 1, 5, 37, 3), (3, 8, 2, 16, 300, 0)]):
        _run_and_compare(B, Hq, Hkv, T, C, D, dtype, window, seed=100 * D + i)


@pytest.mark.parametrize("tuning", [dict(num_splits=1), dict(num_splits=2), dict(num_splits=7), dict(block_n=32),
                                    dict(skip_unseen=False), dict(num_splits=5, skip_unseen=False),
                                    dict(skip_unseen=True), dict(block_n=128, skip_unseen=True)],
                         ids=_tuning_id)
def test_launch_variants_agree(tuning):
    """Forced split counts and tile sizes (the benchmark's sweep space) compute the same function."""
    for T in (1, 5):
        _run_and_compare(3, 14, 2, T, 1000, 128, torch.bfloat16, 16 if T == 5 else 0, seed=7 + T, **tuning)


@pytest.mark.parametrize("B", (1, 2, 4, 8, 16, 64))
@pytest.mark.parametrize("Hkv, G", [(8, 4), (2, 7), (1, 4), (3, 3)])
@pytest.mark.parametrize("C", (100, 4096, 32768, 131072))
def test_decode_grid_stays_within_two_programs_per_sm(B, Hkv, G, C):
    """The decode split rule (the H100 sweep's finding): the grid never puts a third program on an SM, unless
    one split per (b, kv head) already does; and it uses that room: one split more would break the rule, or
    the slots run out (>= 2 tiles per split)."""
    sms = 132
    cfg = ca._launch_config(B, Hkv, G, 1, C, 128, sms)
    S, tiles = cfg["num_splits"], math.ceil(C / cfg["block_n"])
    assert B * Hkv * S <= max(2 * sms, B * Hkv), cfg
    more = ca._launch_config(B, Hkv, G, 1, C, 128, sms, num_splits=S + 1)["num_splits"]
    assert B * Hkv * (S + 1) > 2 * sms or more == S or tiles // (S + 1) < 2, (cfg, more)
    if (B, Hkv, G, C) == (8, 8, 4, 32768):
        assert S == 4  # the Llama-3.1-8B batch-8 case of docs/bench/attention_notes.md


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[3] == 1], ids=[_id(s) for s in SHAPES if s[3] == 1])
def test_past_only_matches_reference(shape, dtype):
    """past_only=True at T = 1 (decode graphs; no slot after the query: make_state's fresh slot is the query's
    own): the kernel skips slot_pos (window 0) or reads it for the window, and matches the reference."""
    B, Hq, Hkv, T, C, window = shape
    _run_and_compare(B, Hq, Hkv, T, C, 128, dtype, window, seed=hash((shape, str(dtype), "past")) % 2**31,
                     past_only=True)


@pytest.mark.parametrize("tuning", [dict(num_splits=1), dict(num_splits=7), dict(skip_unseen=False)],
                         ids=_tuning_id)
def test_past_only_launch_variants_agree(tuning):
    """past_only (no positions read) under forced splits and unpredicated loads, at T = 1 and at T = 5 with
    the promise kept at every query (a T = 1 state, queries at and after its newest slot)."""
    _run_and_compare(3, 14, 2, 1, 1000, 64, torch.bfloat16, 0, seed=21, past_only=True, **tuning)
    q, keys, values, bias, slot_pos, cp = _inputs(2, 8, 2, 1, 1000, 64, torch.float16, seed=22)
    q = torch.randn(2, 8, 5, 64, device="cuda", dtype=torch.float16)
    cp = cp[0] + torch.arange(5, device="cuda")
    args = (q, keys, values, bias, slot_pos, cp, 0.125, 0)
    ref = ca.reference_clustered_attention(*[x.float() for x in args[:3]], *args[3:], past_only=True)
    out = _poisoned(lambda: ca.triton_clustered_attention(*args, True, **tuning), 1 << 24)
    _check(out, ref, torch.float16, f"T 5 past_only {tuning}")


def test_future_slots_are_masked_at_decode():
    """At T = 1 a used slot whose position lies after the query's is invisible, as in the reference: without
    past_only the op reads slot_pos even though the runtime never makes such slots. This fails if the causal
    test were skipped; past_only=True (the caller's promise, broken here) does skip it, which shows the test
    can fail."""
    B, Hq, Hkv, T, C, D = 2, 8, 2, 1, 3000, 128
    q, keys, values, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, D, torch.float32, seed=5)
    future = torch.rand(B, Hkv, C, device="cuda") < 0.3
    slot_pos = torch.where(future, cp[0] + 1 + torch.randint(0, 50, (B, Hkv, C), device="cuda"), slot_pos)
    args = (q, keys, values, bias, slot_pos, cp, D**-0.5, 0)
    ref = ca.reference_clustered_attention(*args)
    out = _poisoned(lambda: OP(*args), 1 << 24)
    _check(out, ref, torch.float32, "future slots at T = 1")
    unmasked = OP(*args, past_only=True)  # the broken promise: the CUDA kernel cannot see it
    assert (unmasked - ref).abs().max() > 1e-2, "the future slots did not matter: the test would not catch a skip"
    # without future slots, past_only computes the same function
    args = (q, keys, values, bias, torch.minimum(slot_pos, cp[0]), cp, D**-0.5, 0)
    torch.testing.assert_close(OP(*args, past_only=True), OP(*args), atol=1e-5, rtol=1e-5)


def test_query_with_no_visible_slot_is_zero_not_nan():
    D = 64
    k, v = torch.randn(2, 1, 4, D, device="cuda"), torch.randn(2, 1, 4, D, device="cuda")
    q = torch.randn(2, 3, 2, D, device="cuda")
    bias = torch.zeros(2, 1, 4, device="cuda")
    bias[1] = -math.inf  # batch row 1: every slot empty
    pos = torch.tensor([5, 6, 7, 8], device="cuda").expand(2, 1, 4).contiguous()
    cp = torch.tensor([3, 6], device="cuda")  # query 0 precedes every slot; query 1 sees slots 5, 6
    for dtype in DTYPES.values():
        out = _poisoned(lambda: OP(q.to(dtype), k.to(dtype), v.to(dtype), bias, pos, cp, 0.125, 0), 1 << 20)
        assert torch.isfinite(out).all()
        assert (out[0, :, 0] == 0).all() and (out[1] == 0).all() and (out[0, :, 1] != 0).any()
    out = OP(q, k, v, torch.zeros_like(bias), pos, torch.tensor([20, 21], device="cuda"), 0.125, 4)  # window hides all
    assert torch.isfinite(out).all() and (out == 0).all()


@pytest.mark.parametrize("T", [1, 5, 40], ids=["decode", "T5", "T40"])
def test_empty_slots_are_never_attended(T):
    """bias -inf marks an empty slot: huge stale keys and values there change nothing (decode predicates their
    reads off; prefill-sized blocks read them and mask the scores, which needs them finite)."""
    B, Hq, Hkv, C, D = 2, 8, 2, 300, 128
    q, keys, values, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, D, torch.bfloat16, seed=3)
    empty = torch.isinf(bias)
    assert empty.any()
    k2, v2 = keys.clone(), values.clone()
    k2[empty] = 1e4
    v2[empty] = -1e4
    a = OP(q, keys, values, bias, slot_pos, cp, D**-0.5, 0)
    b = OP(q, k2, v2, bias, slot_pos, cp, D**-0.5, 0)
    assert torch.equal(a, b)


def test_errors_are_clear():
    q, keys, values, bias, slot_pos, cp = _inputs(1, 4, 2, 1, 37, 64, torch.float16, seed=0)
    with pytest.raises(TypeError, match="bias fp32"):
        ca.triton_clustered_attention(q, keys, values, bias.half(), slot_pos, cp, 0.125, 0)
    with pytest.raises(TypeError, match="share one dtype"):
        ca.triton_clustered_attention(q, keys.float(), values, bias, slot_pos, cp, 0.125, 0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ca.triton_clustered_attention(q[:, :3], keys, values, bias, slot_pos, cp, 0.125, 0)
    with pytest.raises(ValueError, match=r"multiple of Hkv >= 1 \(GQA\), got Hq=\d+, Hkv=0"):
        ca.triton_clustered_attention(q, keys[:, :0], values[:, :0], bias[:, :0], slot_pos[:, :0], cp, 0.125, 0)
    with pytest.raises(ValueError, match="head dim D"):
        ca.triton_clustered_attention(q[..., :48], keys[..., :48], values[..., :48], bias, slot_pos, cp, 0.125, 0)
    with pytest.raises(ValueError, match="CUDA device"):
        ca.triton_clustered_attention(q, keys, values, bias, slot_pos.cpu(), cp, 0.125, 0)
    with pytest.raises(ValueError, match=r"cache_position must be \[T\]"):
        ca.triton_clustered_attention(q, keys, values, bias, slot_pos, cp.repeat(2), 0.125, 0)
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        ca.triton_clustered_attention(q, keys, values, bias, slot_pos, cp, 0.125, 0, softcap=-30.0)


@pytest.mark.parametrize("case", [(torch.bfloat16, 8, 2, 1, 4097, 0), (torch.float16, 7, 1, 5, 300, 16),
                                  (torch.float32, 4, 4, 3, 37, 0)], ids=["bf16-split", "fp16-window", "fp32"])
def test_opcheck_cuda(case):
    dtype, Hq, Hkv, T, C, window = case
    q, keys, values, bias, slot_pos, cp = _inputs(2, Hq, Hkv, T, C, 64, dtype, seed=C)
    torch.library.opcheck(OP, (q, keys, values, bias, slot_pos, cp, 0.125, window))
    if T == 1:
        torch.library.opcheck(OP, (q, keys, values, bias, slot_pos, cp, 0.125, window), {"past_only": True})


@pytest.mark.parametrize("softcap", [0.0, 50.0], ids=["nocap", "cap50"])
@pytest.mark.parametrize("past_only", [False, True], ids=["all", "past_only"])
def test_compile_reduce_overhead_no_graph_break(past_only, softcap):
    """A decode-step-like function around the op compiles whole (fullgraph=True) under CUDA graphs, Inductor
    sees the Triton kernel (a user-defined kernel in its code), and replays match eager on new inputs;
    past_only=True as decode graphs pass it (a keyword). softcap=50: the SOFTCAP kernel, whose
    libdevice.tanh Inductor's copy of the kernel source must resolve too (its kernel header imports it)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    B, Hq, Hkv, C, D, dtype = 2, 8, 2, 2000, 64, torch.bfloat16
    _, keys, values, bias, slot_pos, cp = _inputs(B, Hq, Hkv, 1, C, D, dtype, seed=11)
    w_q = torch.randn(Hq * D, Hq * D, device="cuda", dtype=dtype) / (Hq * D) ** 0.5

    def step(x, cp):
        q = (x @ w_q).view(B, 1, Hq, D).transpose(1, 2)  # [B, Hq, 1, D], a transposed view
        o = torch.ops.kvrewrite.clustered_attention(q, keys, values, bias, slot_pos, cp, D**-0.5, 0,
                                                    past_only=past_only, softcap=softcap)
        return o.transpose(1, 2).reshape(B, Hq * D).float().sum(-1)

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    x0 = torch.randn(B, Hq * D, device="cuda", dtype=dtype)
    _, code = run_and_get_code(compiled, x0, cp)
    assert any("_clustered_attention_fwd_kernel" in c for c in code), "Inductor did not inline the Triton kernel"
    for i in range(4):  # warm-up, recording, then replays
        x = torch.randn(B, Hq * D, device="cuda", dtype=dtype)
        got, want = compiled(x, cp).clone(), step(x, cp)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=1e-2, msg=f"call {i}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


# -- softcap: Gemma-2's soft cap, softcap * tanh(scale * q.k / softcap) before the bias and the masks --------------

# (B, Hq, Hkv, T, C, D, window): decode (T = 1: split-K over C = 4097 slots, single split at C = 37, a window), odd
# prefill blocks (T = 17, 64: 64-row tiles, causal fresh block), odd C throughout, GQA 1/3/4/7
SOFTCAP_SHAPES = [
    (3, 14, 2, 1, 4097, 128, 0),
    (1, 7, 1, 1, 37, 128, 0),
    (1, 8, 2, 1, 1000, 64, 16),
    (2, 9, 3, 17, 333, 128, 0),
    (1, 14, 2, 64, 1000, 128, 0),
    (3, 4, 4, 64, 37, 64, 16),
]


def _softcap_id(shape):
    B, Hq, Hkv, T, C, D, w = shape
    return f"B{B}-Hq{Hq}Hkv{Hkv}-T{T}-C{C}-D{D}-w{w}"


@pytest.mark.parametrize("softcap", [5.0, 30.0, 50.0], ids=lambda c: f"cap{c:g}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SOFTCAP_SHAPES, ids=[_softcap_id(s) for s in SOFTCAP_SHAPES])
def test_softcap_matches_reference(shape, dtype, softcap):
    B, Hq, Hkv, T, C, D, window = shape
    _run_and_compare(B, Hq, Hkv, T, C, D, dtype, window, seed=hash((shape, str(dtype), softcap)) % 2**31,
                     softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softcap_past_only_matches_reference(dtype):
    """SOFTCAP with LOAD_POS off (past_only at window 0, as decode graphs run full-attention layers), split and not."""
    for i, (B, Hq, Hkv, C, window) in enumerate([(3, 14, 2, 4097, 0), (1, 7, 1, 37, 0), (1, 8, 2, 1000, 16)]):
        _run_and_compare(B, Hq, Hkv, 1, C, 128, dtype, window, seed=40 + i, past_only=True, softcap=50.0)


@pytest.mark.parametrize("tuning", [dict(num_splits=1), dict(num_splits=7), dict(block_n=32),
                                    dict(skip_unseen=False), dict(skip_unseen=True)], ids=_tuning_id)
def test_softcap_launch_variants_agree(tuning):
    """The SOFTCAP kernel under forced splits, tile sizes and (un)predicated loads, decode and a T = 5 block."""
    for T in (1, 5):
        _run_and_compare(3, 14, 2, T, 1000, 128, torch.bfloat16, 16 if T == 5 else 0, seed=70 + T, softcap=30.0,
                         **tuning)


@pytest.mark.parametrize("T", [1, 40], ids=["decode", "T40"])
def test_softcap_zero_is_the_uncapped_kernel(T):
    """softcap=0.0 launches the kernel without SOFTCAP: the very same bits as omitting it; and a cap changes the
    result on these logits (so the flag reaches the kernel)."""
    q, keys, values, bias, slot_pos, cp = _inputs(2, 8, 2, T, 1000, 128, torch.bfloat16, seed=9, q_std=30.0)
    args = (q, keys, values, bias, slot_pos, cp, 128**-0.5, 0)
    want = OP(*args)
    assert torch.equal(OP(*args, softcap=0.0), want)
    assert torch.equal(ca.triton_clustered_attention(*args, False, 0.0), want)
    assert (OP(*args, softcap=30.0).float() - want.float()).abs().max() > 1e-1


def test_softcap_saturates_and_keeps_empty_rows_zero():
    """|scale * q.k| ~ 1e5 (fp32): tanh saturates to +-1, no inf or NaN, as the reference; a query that sees
    no slot is still 0; an empty slot's huge stale keys and values are still never attended."""
    B, Hq, Hkv, T, C, D = 2, 8, 2, 5, 300, 64
    q, keys, values, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, D, torch.float32, seed=13, q_std=1e4)
    empty = torch.isinf(bias)
    keys[empty], values[empty] = 1e4, -1e4
    args = (q, keys, values, bias, slot_pos, cp, D**-0.5, 0)
    ref = ca.reference_clustered_attention(*args, softcap=30.0)
    _check(_poisoned(lambda: OP(*args, softcap=30.0), 1 << 24), ref, torch.float32, "saturated", 30.0)
    k, v = torch.randn(2, 1, 4, D, device="cuda"), torch.randn(2, 1, 4, D, device="cuda")
    bias = torch.zeros(2, 1, 4, device="cuda")
    bias[1] = -math.inf  # batch row 1: every slot empty
    pos = torch.tensor([5, 6, 7, 8], device="cuda").expand(2, 1, 4).contiguous()
    out = OP(1e4 * torch.randn(2, 3, 2, D, device="cuda"), k, v, bias, pos, torch.tensor([3, 6], device="cuda"),
             D**-0.5, 0, softcap=30.0)
    assert torch.isfinite(out).all() and (out[:, :, 0] == 0).all() and (out[1] == 0).all()


@pytest.mark.parametrize("case", [(torch.bfloat16, 8, 2, 1, 4097, 0, True), (torch.float32, 7, 1, 17, 300, 16, False)],
                         ids=["bf16-split-past_only", "fp32-prefill-window"])
def test_softcap_opcheck_cuda(case):
    dtype, Hq, Hkv, T, C, window, past_only = case
    q, keys, values, bias, slot_pos, cp = _inputs(2, Hq, Hkv, T, C, 64, dtype, seed=C, q_std=30.0)
    torch.library.opcheck(OP, (q, keys, values, bias, slot_pos, cp, 0.125, window),
                          {"past_only": past_only, "softcap": 30.0})
