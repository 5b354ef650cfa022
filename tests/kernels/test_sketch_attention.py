"""kvrewrite::sketch_attention (CPU path = the reference) against a naive float64 form written here.

The naive form is the contract's formula (docs/contracts/clustergen.md §3.1) query by query in float64: the visible
slots (bias > -inf, slot_pos <= the query's position), the numerator over roles 0 and 2 shifted by its own max, the
denominator over roles 0 and 1 by its own, out = e^(m_N - m_Z) N / Z, 0 without a visible denominator slot.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels.sketch_attention import reference_sketch_attention
from tests.kernels.test_clustered_attention import make_state

OP = torch.ops.kvrewrite.sketch_attention.default
CLUSTERED = torch.ops.kvrewrite.clustered_attention.default

# Tolerance: q's dtype -> assert_close(op, float64 naive on the same exact values). fp32 scores and sums: ~1e-6
# relative on outputs of size <= ~4 (as tests/kernels/test_clustered_attention.py); bf16: the fp32 result rounded
# once (2**-8 relative). A wrong role mask or a shared shift moves outputs by >= 1e-2.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-5, rtol=2**-8),
}


def naive_sketch_attention(q, keys, values, bias, slot_pos, cache_position, role, scale):
    """float64, one (b, query head, query) at a time, two shifts (module docstring)."""
    B, Hq, T, D = q.shape
    G = Hq // keys.shape[1]
    out = torch.zeros(B, Hq, T, D, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            k, v, r = keys[b, h].double(), values[b, h].double(), role[b, h]
            for t in range(T):
                vis = (bias[b, h] > -math.inf) & (slot_pos[b, h] <= cache_position[t])
                z = (k @ q[b, hq, t].double()) * scale + bias[b, h].double()
                num = vis & ((r == 0) | (r == 2))
                den = vis & ((r == 0) | (r == 1))
                if not den.any():
                    continue
                m_z = z[den].max()
                Z = torch.exp(z[den] - m_z).sum()
                if num.any():
                    m_n = z[num].max()
                    N = (torch.exp(z[num] - m_n)[:, None] * v[num]).sum(0)
                    out[b, hq, t] = torch.exp(m_n - m_z) * N / Z
    return out


def make_inputs(B, Hq, Hkv, T, C, D, dtype, seed, value_bias=4.0):
    """clustered_attention's make_state (past slots with log-degree biases and ~15% empty, a causal fresh block of
    T), roles drawn 0/1/2 over the past slots (the fresh block exact, role 0), and the value slots' (role 2) biases
    raised by U(0, value_bias): their numerator weights then exceed the denominator's, as ClusterGen's do.
    Returns (q as a transposed view, keys, values, bias, slot_pos, cache_position, role)."""
    g = torch.Generator().manual_seed(seed)
    keys, values, bias, slot_pos, cp = make_state(B, Hkv, C, D, T, dtype, gen=g)
    role = torch.randint(0, 3, (B, Hkv, C), generator=g).to(torch.int8)
    role[:, :, C - min(T, C):] = 0
    bias = torch.where(role == 2, bias + torch.rand(B, Hkv, C, generator=g) * value_bias, bias)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)
    return q, keys, values, bias, slot_pos, cp, role


def _check(out, ref, dtype, what):
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous(), what
    diff = (out.double() - ref).abs().max().item()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype], msg=f"{what}: max |diff| {diff:.3g}")


# (B, Hq, Hkv, T, C, D): G = 1, 2, 4; odd C; decode (T = 1) and prefill blocks (T = 5, and T = 130 > one 128-query
# block of the reference)
SHAPES = [
    (1, 2, 2, 1, 37, 16),
    (2, 4, 2, 1, 53, 16),
    (1, 8, 2, 5, 41, 32),
    (2, 4, 1, 3, 1, 16),
    (1, 4, 1, 130, 151, 16),
]


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["B{}-Hq{}Hkv{}-T{}-C{}-D{}".format(*s) for s in SHAPES])
def test_matches_naive(shape, dtype, impl):
    B, Hq, Hkv, T, C, D = shape
    q, keys, values, bias, slot_pos, cp, role = make_inputs(B, Hq, Hkv, T, C, D, dtype, seed=hash(shape) % 2**31)
    scale = D**-0.5
    if impl == "op":
        out = OP(q, keys, values, bias, slot_pos, cp, role, scale=scale)
    else:
        out = reference_sketch_attention(q, keys, values, bias, slot_pos, cp, role, scale)
    _check(out, naive_sketch_attention(q, keys, values, bias, slot_pos, cp, role, scale), dtype, f"{shape} {impl}")


def test_roles_matter():
    """The role masks change the result (a test that ignores them would fail here): against the same inputs with
    every role 0, outputs move by far more than the tolerance."""
    q, keys, values, bias, slot_pos, cp, role = make_inputs(1, 4, 2, 1, 53, 16, torch.float32, seed=3)
    a = OP(q, keys, values, bias, slot_pos, cp, role, scale=0.25)
    b = OP(q, keys, values, bias, slot_pos, cp, torch.zeros_like(role), scale=0.25)
    assert (a - b).abs().max() > 1e-1


@pytest.mark.parametrize("T", (1, 6))
def test_every_role_zero_is_clustered_attention(T):
    q, keys, values, bias, slot_pos, cp, role = make_inputs(2, 8, 2, T, 61, 16, torch.float32, seed=4)
    role.zero_()
    out = OP(q, keys, values, bias, slot_pos, cp, role, scale=0.3)
    torch.testing.assert_close(out, CLUSTERED(q, keys, values, bias, slot_pos, cp, 0.3, 0), atol=2e-6, rtol=1e-5)


def one_shift(q, keys, values, bias, role, scale):
    """The single-shift spelling (one max over every visible slot) in fp32, decode, no causal test: what the op
    must not be (test_large_value_weight_does_not_underflow checks that it fails where the op does not)."""
    z = torch.einsum("bhd,bhcd->bhc", q[:, :, 0].float(), keys.float()) * scale + bias
    w = torch.exp(z - z.amax(-1, keepdim=True))
    num = torch.einsum("bhc,bhcd->bhd", w * ((role == 0) | (role == 2)), values.float())
    return num / (w * ((role == 0) | (role == 1))).sum(-1, keepdim=True)


def test_large_value_weight_does_not_underflow():
    """Value slots of weight +80 over denominator slots of weight -20 (their values scaled by e^-60, so the output
    stays finite): one shared shift would put the denominator's terms at e^-100 (fp32 denormals: ~5 significant
    bits), the two shifts keep it exact."""
    B, Hkv, C, D = 1, 1, 24, 16
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    role = torch.tensor([1, 2] * (C // 2), dtype=torch.int8).view(B, Hkv, C)
    bias = torch.where(role == 2, 80.0, -20.0)
    values = torch.where((role == 2)[..., None], values * math.exp(-60), values)
    slot_pos, cp = torch.zeros(B, Hkv, C, dtype=torch.int64), torch.tensor([3])
    q = torch.randn(B, 2, 1, D, generator=g)
    want = naive_sketch_attention(q, keys, values, bias, slot_pos, cp, role, 0.25)
    assert torch.isfinite(want).all() and want.abs().max() > 1e10
    out = OP(q, keys, values, bias, slot_pos, cp, role, scale=0.25)
    # fp32 scores near +-100 carry an absolute error of a few ulp(100) = 7.6e-6 each: ~1e-5 relative per weight
    torch.testing.assert_close(out.double(), want, atol=0, rtol=1e-4)
    bad = one_shift(q, keys[:, [0, 0]], values[:, [0, 0]], bias[:, [0, 0]], role[:, [0, 0]], 0.25)
    assert ((bad.double() - want[:, :, 0]).abs() / want[:, :, 0].abs()).max() > 1e-3, "the test cannot fail"


def test_nothing_visible_gives_zero():
    """A query with no visible denominator slot gets 0 (not NaN): every slot empty, in its future, or value-only."""
    B, Hq, Hkv, C, D = 1, 4, 4, 10, 16
    q, keys, values, bias, slot_pos, cp, role = make_inputs(B, Hq, Hkv, 1, C, D, torch.float32, seed=6)
    bias[0, 0] = -math.inf  # head 0: every slot empty
    slot_pos[0, 1] = cp[0] + 1  # head 1: every slot after the query
    role[0, 2] = 2  # head 2: only value slots (a numerator, no denominator)
    bias[0, 2] = 0.0
    role[0, 3] = 1  # head 3: only denominator slots: a visible denominator, an empty numerator -> 0 as well
    bias[0, 3] = 0.0
    slot_pos[0, 2:] = 0
    for out in (OP(q, keys, values, bias, slot_pos, cp, role, scale=0.25),
                reference_sketch_attention(q, keys, values, bias, slot_pos, cp, role, 0.25)):
        assert torch.equal(out, torch.zeros_like(out))


def test_causal_prefill():
    """A prefill chunk: query t sees the past slots and the fresh slots up to itself, no later ones."""
    B, Hkv, C, D, T = 1, 1, 7, 16, 4
    g = torch.Generator().manual_seed(7)
    keys, values = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    slot_pos = torch.tensor([[[0, 1, 2, 10, 11, 12, 13]]])
    role = torch.tensor([[[1, 2, 0, 0, 0, 0, 0]]], dtype=torch.int8)
    bias = torch.tensor([[[math.log(3.0), 2.5, 0.0, 0.0, 0.0, 0.0, 0.0]]])
    cp = torch.arange(10, 14)
    q = torch.randn(B, 1, T, D, generator=g)
    out = OP(q, keys, values, bias, slot_pos, cp, role, scale=0.25)
    for t in range(T):
        vis = 3 + t + 1
        z = keys[0, 0, :vis] @ q[0, 0, t] * 0.25 + bias[0, 0, :vis]
        den = torch.exp(z[[0] + list(range(2, vis))]).sum()
        num = (torch.exp(z[1:vis])[:, None] * values[0, 0, 1:vis]).sum(0)
        torch.testing.assert_close(out[0, 0, t], num / den, atol=2e-6, rtol=1e-5)


def test_past_only_promise_is_checked():
    q, keys, values, bias, slot_pos, cp, role = make_inputs(1, 4, 2, 1, 20, 16, torch.float32, seed=8)
    ok = OP(q, keys, values, bias, slot_pos, cp, role, scale=0.25, past_only=True)
    torch.testing.assert_close(ok, OP(q, keys, values, bias, slot_pos, cp, role, scale=0.25), atol=0, rtol=0)
    slot_pos[0, 1, 3] = cp[0] + 5
    with pytest.raises(ValueError, match="past_only=True, but used slot 3 of batch row 0, KV head 1"):
        OP(q, keys, values, bias, slot_pos, cp, role, scale=0.25, past_only=True)


def test_errors_name_the_field():
    q, keys, values, bias, slot_pos, cp, role = make_inputs(1, 4, 2, 1, 20, 16, torch.float32, seed=9)
    args = [q, keys, values, bias, slot_pos, cp, role]
    with pytest.raises(ValueError, match="softcap must be 0, got 50.0"):
        OP(*args, scale=0.25, softcap=50.0)
    cases = [(6, role.long(), "role must be torch.int8"), (6, role[:, :1], "role must be"),
             (3, bias.double(), "bias must be torch.float32"), (4, slot_pos.int(), "slot_pos must be torch.int64"),
             (5, cp.int(), "cache_position must be torch.int64"), (2, values[..., :8], "values must be shaped"),
             (2, values.double(), "values .* share one dtype")]
    for i, bad, match in cases:
        with pytest.raises(ValueError, match=match):
            OP(*args[:i], bad, *args[i + 1:], scale=0.25)
    role[0, 1, 4] = 3
    with pytest.raises(ValueError, match=r"role must be 0 .* got 3 at role\[0, 1, 4\]"):
        OP(*args[:6], role, scale=0.25)


@pytest.mark.parametrize("T,past_only", [(1, True), (5, False)], ids=["decode", "prefill"])
def test_opcheck(T, past_only):
    q, keys, values, bias, slot_pos, cp, role = make_inputs(2, 4, 2, T, 19, 16, torch.float32, seed=10)
    torch.library.opcheck(OP, (q, keys, values, bias, slot_pos, cp, role), dict(scale=0.25, past_only=past_only))
