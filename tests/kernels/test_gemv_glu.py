"""kvrewrite::gemv_glu on the CPU: it is the aten sequence it replaces there (act, mul, linear; bit for bit), every
device checks its inputs with errors that name the value, opcheck, and the Triton kernel through Triton's
interpreter (TRITON_INTERPRET=1 with Triton installed; skipped otherwise) against the fp32 reference within
error_bound. The interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest), which the bound's one ulp of the
input covers; its exact-prologue check (identity weight: y is the kernel's own input) is fp32-only here and runs for
every dtype in test_gemv_glu_gpu.py."""
import os

import pytest
import torch
import torch.nn.functional as F

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import gemv_glu as G

OP = torch.ops.kvrewrite.gemv_glu.default
ATEN = {"silu": lambda a: torch.ops.aten.silu.default(a),
        "gelu_tanh": lambda a: torch.ops.aten.gelu.default(a, approximate="tanh"),
        "gelu": lambda a: torch.ops.aten.gelu.default(a)}


def _inputs(K, N, dtype, bias, seed, lead=(1, 1)):
    g = torch.Generator().manual_seed(seed)
    ab = (torch.randn(*lead, 2 * K, generator=g) * 2).to(dtype)
    a, b = ab[..., :K], ab[..., K:]  # slices of one tensor, as the fused gate/up projection leaves them
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    return a, b, w, (torch.randn(N, generator=g).to(dtype) if bias else None)


@pytest.mark.parametrize("act", G.ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, bias", [((1, 1), False), ((1,), True)])
def test_cpu_is_the_aten_sequence_bit_for_bit(act, dtype, lead, bias):
    a, b, w, bias_ = _inputs(48, 40, dtype, bias, seed=len(lead), lead=lead)
    out = OP(a, b, w, bias_, act)
    want = torch.ops.aten.linear.default(torch.ops.aten.mul.Tensor(ATEN[act](a), b), w, bias_)
    assert out.shape == (*lead, 40) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, want)
    assert torch.equal(OP(a, b, w, bias_, act), F.linear(b * ATEN[act](a), w, bias_))  # the product commutes


def test_reference_rounds_act_and_product_to_the_dtype():
    a, b, _, _ = _inputs(64, 1, torch.bfloat16, False, seed=1)
    x = G.reference_input(a, b, "silu")
    assert x.dtype == torch.float32 and torch.equal(x, (F.silu(a) * b).float())  # eager bf16 rounds both


def test_opcheck():
    a, b, w, bias = _inputs(24, 16, torch.float32, True, seed=2)
    torch.library.opcheck(OP, (a, b, w, bias, "gelu_tanh"))
    torch.library.opcheck(OP, (a.contiguous(), b.contiguous(), w), {"act": "silu"})


def _bad(a=(1, 32), b=(1, 32), w=(24, 32), bias=None, act="silu", dtype=torch.float32):
    OP(torch.randn(*a, dtype=dtype), torch.randn(*b, dtype=dtype), torch.randn(*w),
       None if bias is None else torch.randn(*bias), act)


@pytest.mark.parametrize("kw, match", [
    (dict(act="relu"), r"act must be one of \('silu', 'gelu_tanh', 'gelu'\), got 'relu'"),
    (dict(b=(1, 1, 32)), r"a and b must have one shape \[\.\.\., K\], got a \(1, 32\), b \(1, 1, 32\)"),
    (dict(a=(2, 32), b=(2, 32)), r"\(a as the GEMV's input x\): x must hold one row of K=32 .*got shape \(2, 32\)"),
    (dict(a=(1, 31), b=(1, 31)), r"x must be \[\.\.\., K=32\].*got \(1, 31\)"),
    (dict(w=(24, 32, 1)), r"weight must be \[N, K\], got \(24, 32, 1\)"),
    (dict(bias=(23,)), r"bias must be \[N\] = \(24,\), got \(23,\)"),
])
def test_bad_inputs_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        _bad(**kw)


def test_bad_dtypes_and_strides_are_named():
    with pytest.raises(TypeError, match=r"x torch.bfloat16, weight torch.float32"):
        _bad(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"b must have unit stride along K, got strides \(64, 2\)"):
        OP(torch.randn(1, 32), torch.randn(1, 64)[:, ::2], torch.randn(24, 32))


def test_fake_gives_the_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = OP(torch.empty(1, 1, 32), torch.empty(1, 1, 32), torch.empty(24, 32), None, "gelu")
    assert out.shape == (1, 1, 24)


# ---------------------------------------------------------------------------------------------------
# The Triton kernel in the interpreter
# ---------------------------------------------------------------------------------------------------

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or G.triton is None,
                                 reason="runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1, install Triton")


@interpreted
@pytest.mark.parametrize("act", G.ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, K, tuning", [(37, 700, {}), (5, 45, dict(block_n=4, block_k=16))])
def test_interpreted_kernel_within_the_bound(act, dtype, N, K, tuning):
    a, b, w, bias = _inputs(K, N, dtype, bias=N % 2 == 1, seed=N + K)
    out = G._launch(a, b, w, bias, act, **tuning)
    ref = F.linear(G.reference_input(a, b, act), w.float(), bias.float())
    assert out.shape == (1, 1, N) and out.dtype == dtype
    err = ((out.float() - ref).abs() / G.error_bound(a, b, w, ref, act)).max().item()
    assert err <= 1, f"{act} {dtype} N{N} K{K}: error {err:.2f}x the bound"


@interpreted
def test_interpreted_constant_weight_computes_the_same_bits():
    """constant_weight loads the first weight tile before the PDL wait (EARLY_W): the same product, same order."""
    a, b, w, bias = _inputs(45, 5, torch.float32, bias=True, seed=4)
    plain = G._launch(a, b, w, bias, "silu", False, block_n=4, block_k=16)
    assert torch.equal(G._launch(a, b, w, bias, "silu", True, block_n=4, block_k=16), plain)


@interpreted
@pytest.mark.parametrize("act", G.ACTS)
def test_interpreted_prologue_is_the_aten_input(act):
    """Identity weight: the output is the kernel's own act(a) * b, within PROLOGUE_ROUNDING |a b| of ATen's."""
    a, b, _, _ = _inputs(45, 1, torch.float32, False, seed=9)
    out = G._launch(a, b, torch.eye(45), None, act, block_n=4, block_k=16)
    x = G.reference_input(a, b, act)
    assert ((out - x).abs() <= G.PROLOGUE_ROUNDING[torch.float32] * (a * b).abs()).all()
    assert not torch.equal(out, (a * b).float())  # the act was applied
