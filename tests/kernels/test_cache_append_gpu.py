"""kvrewrite::cache_append on CUDA: the Triton kernel against the reference scatter, bit for bit.

The state is poisoned with random garbage (finite keys and values, biases that are neither 0 nor -inf,
huge slot positions) and every row has its own fill; the kernel runs on one copy, the reference scatter
on another, and every field must be identical (the writes are copies and one rounding to the state's
dtype, so equality is the only tolerance). Skipped without CUDA or Triton.
On a GPU machine: `python -m pytest -m gpu -q tests/kernels/test_cache_append_gpu.py`.
"""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import cache_append as ca
from kvrewrite.state import allocate_layer_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(ca.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.cache_append.default
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "budget")


def _poisoned_state(B, Hkv, C, D, dtype, T, g):
    s = allocate_layer_state(B, Hkv, C, D, dtype, "cuda")
    s["keys"].copy_(torch.randn(B, Hkv, C, D, generator=g) * 100)
    s["values"].copy_(torch.randn(B, Hkv, C, D, generator=g) * 100)
    s["bias"].copy_(torch.rand(B, Hkv, C, generator=g) + 0.5)
    s["slot_pos"].copy_(torch.randint(10**9, 2 * 10**9, (B, Hkv, C), generator=g))
    s["fill"].copy_(torch.randint(0, C - T + 1, (B, Hkv), generator=g))  # ragged: every row its own fill
    s["fill"].view(-1)[0] = C - T  # one row fills the state to the last slot
    return s


def _call(op, s, k_new, v_new, cp, valid):
    op(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k_new, v_new, cp, valid)


def _check(B, Hkv, C, D, T, dtype, new_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    s = _poisoned_state(B, Hkv, C, D, dtype, T, g)
    ref = {k: v.clone() for k, v in s.items()}
    # new tokens as the models hand them over: a transposed view of [B, T, Hkv, D]
    k_new = torch.randn(B, T, Hkv, D, generator=g).to(new_dtype).cuda().transpose(1, 2)
    v_new = torch.randn(B, T, Hkv, D, generator=g).to(new_dtype).cuda().transpose(1, 2)
    cp = torch.arange(T).cuda() + int(torch.randint(0, 10**6, (1,), generator=g))
    valid = torch.rand(B, T, generator=g) > 0.2
    valid[0, : T // 2] = False  # a left-padded row
    valid = valid.cuda()
    fill0 = s["fill"].clone()
    _call(OP, s, k_new, v_new, cp, valid)
    ca.reference_cache_append(ref["keys"], ref["values"], ref["bias"], ref["slot_pos"], ref["fill"], k_new, v_new,
                              cp, valid)
    what = f"B{B} Hkv{Hkv} C{C} D{D} T{T} state {dtype} new {new_dtype}"
    for f in FIELDS:
        assert torch.equal(s[f], ref[f]), f"{what}: {f} differs from the reference scatter"
    assert torch.equal(s["fill"], fill0 + T), what


# (B, Hkv, C, D, T): T = 1 (decode: one program per row, which advances the fill), T = 5 and 37 (one
# ragged token block), 256 and 300 (prefill chunks: several blocks, then the separate fill update);
# D = 16 (the tiny test models), 64, 80 (not a power of two), 128, 256.
SHAPES = [(1, 8, 300, 128, 1), (3, 2, 1000, 64, 1), (2, 3, 77, 80, 5), (3, 2, 500, 16, 37), (1, 8, 700, 128, 256),
          (2, 2, 601, 256, 300), (4, 1, 33, 64, 33),
          (2, 4, 64, 128, 16), (1, 2, 100, 128, 17)]  # the largest one-block call at D = 128, and one token more


@pytest.mark.parametrize("new", ["same", "fp32"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hkv{}-C{}-D{}-T{}".format(*s))
def test_triton_matches_reference(shape, dtype, new):
    B, Hkv, C, D, T = shape
    _check(B, Hkv, C, D, T, dtype, dtype if new == "same" else torch.float32, seed=hash((shape, str(dtype), new)) % 2**31)


def test_successive_appends_lay_tokens_out_contiguously():
    """A prefill chunk then decode steps, as the runtime issues them, equal the reference step by step."""
    g = torch.Generator().manual_seed(1)
    s = _poisoned_state(2, 4, 400, 128, torch.bfloat16, 1, g)
    s["fill"].zero_()
    ref = {k: v.clone() for k, v in s.items()}
    for step, T in enumerate((256, 1, 1, 1, 64)):
        k = torch.randn(2, 4, T, 128, generator=g).to(torch.bfloat16).cuda()
        cp = torch.arange(T).cuda() + step * 1000
        valid = torch.ones(2, T, dtype=torch.bool, device="cuda")
        _call(OP, s, k, -k, cp, valid)
        ca.reference_cache_append(ref["keys"], ref["values"], ref["bias"], ref["slot_pos"], ref["fill"], k, -k, cp, valid)
        for f in FIELDS:
            assert torch.equal(s[f], ref[f]), f"step {step}: {f}"
    assert (s["fill"] == 256 + 3 + 64).all()


def test_errors_are_clear():
    s = allocate_layer_state(1, 2, 10, 16, torch.float16, "cuda")
    k = torch.randn(1, 2, 3, 16, device="cuda", dtype=torch.float16)
    cp, valid = torch.arange(3, device="cuda"), torch.ones(1, 3, dtype=torch.bool, device="cuda")
    with pytest.raises(ValueError, match="k_new and v_new"):
        _call(OP, s, k[..., :8], k[..., :8], cp, valid)
    with pytest.raises(ValueError, match="token_valid"):
        _call(OP, s, k, k, cp, valid[:, :2])
    with pytest.raises(TypeError, match="token_valid bool"):
        _call(OP, s, k, k, cp, valid.long())
    with pytest.raises(ValueError, match="CUDA device"):
        _call(OP, s, k, k, cp.cpu(), valid)


@pytest.mark.parametrize("T", [1, 300])
def test_opcheck_cuda(T):
    g = torch.Generator().manual_seed(T)
    s = _poisoned_state(2, 3, 700, 64, torch.bfloat16, T, g)
    k = torch.randn(2, 3, T, 64, device="cuda", dtype=torch.bfloat16)
    valid = torch.ones(2, T, dtype=torch.bool, device="cuda")
    torch.library.opcheck(OP, (s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k, -k,
                               torch.arange(T, device="cuda"), valid))


def test_compile_sees_the_kernel():
    """fullgraph compile of append-then-read inlines the Triton kernel and matches the reference."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    s = _poisoned_state(2, 2, 64, 32, torch.float16, 1, g)
    s["fill"].zero_()
    ref = {k: v.clone() for k, v in s.items()}

    def step(state, x, cp, valid):
        torch.ops.kvrewrite.cache_append(state["keys"], state["values"], state["bias"], state["slot_pos"],
                                         state["fill"], x * 2, x - 1, cp, valid)
        return state["keys"].float().sum()

    compiled = torch.compile(step, fullgraph=True)
    for i in range(3):
        x = torch.randn(2, 2, 1, 32, device="cuda", dtype=torch.float16)
        cp = torch.tensor([i], device="cuda")
        valid = torch.tensor([[True], [i > 0]], device="cuda")
        if i == 0:
            got, code = run_and_get_code(compiled, s, x, cp, valid)
            assert any("_cache_append_kernel" in c for c in code), "Inductor did not inline the Triton kernel"
        else:
            got = compiled(s, x, cp, valid)
        ca.reference_cache_append(ref["keys"], ref["values"], ref["bias"], ref["slot_pos"], ref["fill"], x * 2, x - 1,
                                  cp, valid)
        for f in FIELDS:
            assert torch.equal(s[f], ref[f]), f"call {i}: {f}"
        torch.testing.assert_close(got, ref["keys"].float().sum())
    torch._dynamo.reset()


# (B, Hkv, C, D, T): one-block calls (T = 1 and 5: the kernel advances the fill) and multi-block ones (T = 37 at
# D = 128 and T = 300: the separate fill update), every one with rows that pass C
CAPACITY_SHAPES = [(2, 3, 20, 64, 1), (2, 3, 20, 80, 5), (1, 4, 40, 128, 37), (2, 2, 50, 128, 300)]


@pytest.mark.parametrize("shape", CAPACITY_SHAPES, ids=lambda s: "B{}-Hkv{}-C{}-D{}-T{}".format(*s))
def test_stores_stop_at_capacity(shape):
    """fill + T > C (the runtime refuses it first): the kernel writes the tokens that fit and nothing past C,
    and the fill stops at C. Every field is a view into a larger buffer whose slots after each row's C are
    poisoned (room for T of them: every slot an unbounded store could reach), fill a view with a poisoned
    column after it; the poison must be untouched, bit for bit."""
    B, Hkv, C, D, T = shape
    g = torch.Generator().manual_seed(C + T)
    dev, dtype = "cuda", torch.bfloat16
    bufs = {
        "keys": (torch.randn(B, Hkv, C + T, D, generator=g) * 100).to(dtype).to(dev),
        "values": (torch.randn(B, Hkv, C + T, D, generator=g) * 100).to(dtype).to(dev),
        "bias": (torch.rand(B, Hkv, C + T, generator=g) + 0.5).to(dev),
        "slot_pos": torch.randint(10**9, 2 * 10**9, (B, Hkv, C + T), generator=g).to(dev),
    }
    s = {k: v[:, :, :C] for k, v in bufs.items()}
    fill_buf = torch.full((B, Hkv + 1), -5, dtype=torch.long, device=dev)
    s["fill"] = fill_buf[:, :Hkv]
    # ragged rows: already full, one slot left, passing C by part of T, fitting exactly (T <= C), empty
    fills = [C, C - 1, C - min(max(T // 2, 1), C), C - min(T, C), 0, C - 2]
    s["fill"].copy_(torch.tensor(fills * B)[: B * Hkv].view(B, Hkv))
    before = {k: v.clone() for k, v in bufs.items()}
    fill0, fill_buf0 = s["fill"].clone(), fill_buf.clone()
    k_new = torch.randn(B, T, Hkv, D, generator=g).cuda().transpose(1, 2)  # fp32, converted to bf16 on store
    v_new = torch.randn(B, T, Hkv, D, generator=g).cuda().transpose(1, 2)
    cp = torch.arange(T, device=dev) + 7000
    valid = torch.rand(B, T, generator=g).cuda() > 0.2
    _call(OP, s, k_new, v_new, cp, valid)
    torch.cuda.synchronize()

    for f in bufs:  # the poison after C (every row)
        assert torch.equal(bufs[f][:, :, C:], before[f][:, :, C:]), f"{f}: written past C"
    assert torch.equal(fill_buf[:, Hkv], fill_buf0[:, Hkv]), "written past fill"
    assert torch.equal(s["fill"], (fill0 + T).clamp(max=C)), "fill must stop at C"
    for b in range(B):
        for h in range(Hkv):
            f0 = int(fill0[b, h])
            n = max(0, min(T, C - f0))  # the tokens that fit
            new = slice(f0, f0 + n)
            assert torch.equal(s["keys"][b, h, new], k_new[b, h, :n].to(dtype)), (b, h)
            assert torch.equal(s["values"][b, h, new], v_new[b, h, :n].to(dtype)), (b, h)
            assert torch.equal(s["slot_pos"][b, h, new], cp[:n]), (b, h)
            assert torch.equal(s["bias"][b, h, new], torch.where(valid[b, :n], 0.0, float("-inf"))), (b, h)
            for f in bufs:  # the slots before the fill are kept
                assert torch.equal(s[f][b, h, :f0], before[f][b, h, :f0]), (f, b, h)
