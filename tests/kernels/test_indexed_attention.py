"""kvrewrite::indexed_attention (CPU path = the reference) against a naive float64 attention written here, and
against kvrewrite::clustered_attention when the index lists every valid slot.

The naive version walks every output row (b, query head, query) and every entry of its index row: -1 is
skipped, a listed slot contributes exp(scale * q.k + bias) (the score soft-capped first when softcap > 0),
a slot listed twice contributes twice, and a row with nothing left is 0.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import indexed_attention as ia  # noqa: F401  (registers kvrewrite::indexed_attention)
from kvrewrite.kernels.indexed_attention import reference_indexed_attention

OP = torch.ops.kvrewrite.indexed_attention.default
CLUSTERED = torch.ops.kvrewrite.clustered_attention.default
IMPLS = {"op": OP, "reference": reference_indexed_attention}
KINDS = ("per_kv", "per_q")

# Tolerance: output dtype -> (atol, rtol) against the float64 naive attention on the same (exact) inputs.
#   fp32: fp32 logits, softmax and sums: ~1e-6 on outputs of size <= ~4; 2e-5 / 1e-5 is 5x that and ~1e3 below
#         what a real bug moves (a dropped entry or bias, a wrong head: >= 1e-2).
#   bf16: the fp32 result rounded once to bf16 (half an ulp: 2**-9 relative) plus the above; 2**-8.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-5, rtol=2**-8)}
# Two fp32 computations of the same function, each rounded to bf16, may land one bf16 ulp (2**-7) apart.
TOL_PAIR = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-5, rtol=2**-7)}


def naive_indexed_attention(q, keys, values, bias, index, scale, softcap=0.0):
    """float64, one output row and one index entry at a time."""
    B, Hq, T, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    per_q = index.shape[1] == Hq
    q, k, v, bias = q.double(), keys.double(), values.double(), bias.double()
    out = torch.zeros(B, Hq, T, D, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            row = index[b, hq if per_q else h].tolist()
            for t in range(T):
                logits, vals = [], []
                for slot in row:
                    if slot == -1:
                        continue
                    z = scale * float(q[b, hq, t] @ k[b, h, slot])
                    if softcap > 0:
                        z = softcap * math.tanh(z / softcap)
                    z += float(bias[b, h, slot])
                    if z == -math.inf:
                        continue
                    logits.append(z)
                    vals.append(v[b, h, slot])
                if logits:
                    m = max(logits)
                    w = [math.exp(z - m) for z in logits]
                    out[b, hq, t] = sum(wj * vj for wj, vj in zip(w, vals)) / sum(w)
    return out


def make_inputs(B, Hq, Hkv, T, C, D, S, dtype, kind, seed, minus_one=0.25, empty=0.15, q_std=1.0):
    """Random keys, values, q ~ N(0, q_std**2); bias = log of degrees 1..5 with ~`empty` of the slots empty
    (-inf); index [B, Hkv or Hq, S] of random slots (duplicates happen) with ~`minus_one` of the entries -1."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    values = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    q = (torch.randn(B, Hq, T, D, generator=g) * q_std).to(dtype)
    bias = torch.randint(1, 6, (B, Hkv, C), generator=g).float().log()
    bias.masked_fill_(torch.rand(B, Hkv, C, generator=g) < empty, -math.inf)
    Hsel = Hkv if kind == "per_kv" else Hq
    index = torch.randint(0, C, (B, Hsel, S), generator=g, dtype=torch.int32)
    index.masked_fill_(torch.rand(B, Hsel, S, generator=g) < minus_one, -1)
    return q, keys, values, bias, index


# (B, Hq, Hkv, T, C, D, S): G = 1, 4, 7, 3; T > 1; S below and above C (duplicates)
SHAPES = [(1, 4, 4, 1, 20, 16, 9), (2, 8, 2, 1, 50, 16, 40), (1, 7, 1, 3, 30, 16, 25), (2, 9, 3, 2, 12, 32, 17)]


def _id(shape):
    return "B{}-Hq{}Hkv{}-T{}-C{}-D{}-S{}".format(*shape)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[_id(s) for s in SHAPES])
def test_matches_naive(shape, dtype, impl, kind):
    B, Hq, Hkv, T, C, D, S = shape
    q, keys, values, bias, index = make_inputs(*shape, dtype, kind, seed=hash((shape, kind)) % 2**31)
    out = IMPLS[impl](q, keys, values, bias, index, D**-0.5)
    assert out.dtype == dtype and out.shape == (B, Hq, T, D) and out.is_contiguous()
    torch.testing.assert_close(out.double(), naive_indexed_attention(q, keys, values, bias, index, D**-0.5),
                               **TOL[dtype])


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_full_index_is_clustered_attention(dtype, kind, T):
    """An index listing every valid slot once, in a random order, with -1 scattered between: the op is
    kvrewrite::clustered_attention at decode (past_only, every slot before the queries)."""
    B, Hq, Hkv, C, D = 2, 8, 2, 40, 16
    q, keys, values, bias, _ = make_inputs(B, Hq, Hkv, T, C, D, 1, dtype, kind, seed=T)
    g = torch.Generator().manual_seed(10 + T)
    Hsel = Hkv if kind == "per_kv" else Hq
    G = Hq // Hkv
    S = C + 13
    index = torch.full((B, Hsel, S), -1, dtype=torch.int32)
    for b in range(B):
        for s in range(Hsel):
            h = s if kind == "per_kv" else s // G
            valid = (bias[b, h] > -math.inf).nonzero().flatten()
            slots = valid[torch.randperm(len(valid), generator=g)]
            where = torch.randperm(S, generator=g)[: len(slots)]  # -1 padding at the other places
            index[b, s, where] = slots.int()
    slot_pos = torch.arange(C).expand(B, Hkv, C).contiguous()
    cp = torch.arange(C, C + T)
    want = CLUSTERED(q, keys, values, bias, slot_pos, cp, D**-0.5, 0, past_only=True)
    torch.testing.assert_close(OP(q, keys, values, bias, index, D**-0.5), want, **TOL_PAIR[dtype])


@pytest.mark.parametrize("kind", KINDS)
def test_minus_one_anywhere_is_skipped(kind):
    """-1 at the start, in the middle and at the end of a row: the same result as the row without them."""
    B, Hq, Hkv, T, C, D = 2, 8, 2, 1, 30, 16
    q, keys, values, bias, _ = make_inputs(B, Hq, Hkv, T, C, D, 1, torch.float32, kind, seed=3, empty=0.0)
    Hsel = Hkv if kind == "per_kv" else Hq
    g = torch.Generator().manual_seed(4)
    dense = torch.randint(0, C, (B, Hsel, 12), generator=g, dtype=torch.int32)
    minus = torch.full((B, Hsel, 3), -1, dtype=torch.int32)
    padded = torch.cat([minus, dense[..., :5], minus, minus, dense[..., 5:], minus], dim=-1)
    want = OP(q, keys, values, bias, dense, 0.25)
    torch.testing.assert_close(OP(q, keys, values, bias, padded, 0.25), want, atol=2e-6, rtol=1e-5)
    assert (OP(q, keys, values, bias, dense[..., 1:], 0.25) - want).abs().max() > 1e-3  # an entry matters


@pytest.mark.parametrize("kind", KINDS)
def test_duplicates_count_twice(kind):
    """A slot listed twice weighs as a slot of degree 2 listed once (its bias + log 2)."""
    B, Hq, Hkv, T, C, D = 1, 4, 2, 1, 20, 16
    q, keys, values, bias, _ = make_inputs(B, Hq, Hkv, T, C, D, 1, torch.float32, kind, seed=5, empty=0.0)
    Hsel = Hkv if kind == "per_kv" else Hq
    once = torch.arange(0, 16, 2, dtype=torch.int32).expand(B, Hsel, 8).contiguous()  # distinct slots
    twice = torch.cat([once, once[..., 2:3]], dim=-1)  # slot 4 again, in every row
    bias2 = bias.clone()
    bias2[..., 4] += math.log(2)
    got = OP(q, keys, values, bias, twice, 0.25)
    torch.testing.assert_close(got, OP(q, keys, values, bias2, once, 0.25), atol=2e-6, rtol=1e-5)
    assert (got - OP(q, keys, values, bias, once, 0.25)).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_with_nothing_are_zero(dtype, impl, kind):
    """A row of only -1, a row whose only entries are empty slots (bias -inf), and S = 0: zeros, no NaN."""
    B, Hq, Hkv, T, C, D, S = 2, 4, 2, 2, 10, 16, 6
    q, keys, values, bias, index = make_inputs(B, Hq, Hkv, T, C, D, S, dtype, kind, seed=6, empty=0.0,
                                               minus_one=0.0)
    bias[1, 0, 3] = -math.inf
    index[0, 1] = -1  # row (b 0, sel 1): only -1
    index[1, 0] = torch.tensor([-1, 3, 3, -1, 3, -1])  # row (b 1, sel 0): only the empty slot 3
    out = IMPLS[impl](q, keys, values, bias, index, 0.25)
    G = Hq // Hkv
    heads = (lambda s: range(s * G, (s + 1) * G)) if kind == "per_kv" else (lambda s: [s])
    assert torch.isfinite(out).all()
    for b, s in ((0, 1), (1, 0)):
        for hq in heads(s):
            assert (out[b, hq] == 0).all()
    assert (out[0, 0] != 0).any() and (out[1, -1] != 0).any()
    empty = IMPLS[impl](q, keys, values, bias, index[..., :0], 0.25)
    assert empty.shape == q.shape and empty.dtype == dtype and (empty == 0).all()


def test_empty_slots_are_skipped():
    """An indexed slot with bias -inf is never attended, whatever (finite) stale keys and values it holds."""
    B, Hq, Hkv, T, C, D, S = 1, 4, 2, 1, 20, 16, 15
    q, keys, values, bias, index = make_inputs(B, Hq, Hkv, T, C, D, S, torch.float32, "per_kv", seed=7,
                                               empty=0.0, minus_one=0.0)
    stale = torch.zeros(B, Hkv, C, dtype=torch.bool)
    stale[..., ::3] = True
    bias = bias.masked_fill(stale, -math.inf)
    k2, v2 = keys.clone(), values.clone()
    k2[stale], v2[stale] = 1e3, -1e3  # would dominate the softmax if attended
    got = OP(q, k2, v2, bias, index, 0.25)
    skipped = torch.where(torch.gather(stale, 2, index.long()), -1, index)
    torch.testing.assert_close(got, OP(q, keys, values, bias, skipped, 0.25), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("softcap", [5.0, 30.0], ids=lambda c: f"cap{c:g}")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_softcap_matches_naive(impl, kind, softcap):
    """q ~ N(0, softcap**2): the scaled scores spread over about +-softcap, where the cap bends them. The fp32
    cap carries a few ulp of softcap per logit: outputs move by <= softcap * 2e-6."""
    shape = (2, 8, 2, 2, 30, 16, 20)
    q, keys, values, bias, index = make_inputs(*shape, torch.float32, kind, seed=8, q_std=softcap)
    got = IMPLS[impl](q, keys, values, bias, index, 0.25, softcap)
    want = naive_indexed_attention(q, keys, values, bias, index, 0.25, softcap)
    torch.testing.assert_close(got.double(), want, atol=max(2e-5, 2e-6 * softcap), rtol=1e-5)
    assert (got - IMPLS[impl](q, keys, values, bias, index, 0.25)).abs().max() > 1e-2  # the cap matters


def test_index_kinds_agree():
    """One list per KV head is the same as that list repeated for each query head of the group."""
    q, keys, values, bias, index = make_inputs(2, 12, 3, 2, 25, 16, 18, torch.float32, "per_kv", seed=9)
    per_q = index.repeat_interleave(4, dim=1)
    torch.testing.assert_close(OP(q, keys, values, bias, per_q, 0.25), OP(q, keys, values, bias, index, 0.25),
                               atol=1e-6, rtol=1e-6)


def test_output_is_contiguous_in_q_dtype():
    """q as the models pass it (a transposed view): the output is still a contiguous [B, Hq, T, D]."""
    q, keys, values, bias, index = make_inputs(2, 8, 2, 3, 20, 16, 9, torch.bfloat16, "per_q", seed=10)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = OP(qt, keys, values, bias, index, 0.25)
    assert out.is_contiguous() and out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.equal(out, OP(q, keys, values, bias, index, 0.25))


def _bad_inputs():
    q, keys, values, bias, index = make_inputs(2, 8, 2, 1, 10, 16, 5, torch.float32, "per_kv", seed=11)
    ok = dict(q=q, keys=keys, values=values, bias=bias, index=index, softcap=0.0)
    return [  # (case, the changed arguments, exception, message)
        ("index-int64", dict(index=index.long()), TypeError, "index must be int32"),
        ("index-Hsel", dict(index=torch.zeros(2, 4, 5, dtype=torch.int32)), ValueError, r"index must be \[B=2, Hsel"),
        ("index-B", dict(index=index[:1]), ValueError, r"index must be \[B=2, Hsel"),
        ("index-2d", dict(index=index[0]), ValueError, r"index must be \[B=2, Hsel"),
        ("index-entry-C", dict(index=index.clone().index_fill_(2, torch.tensor([3]), 10)), ValueError,
         r"index entries must be slots in \[0, C = 10\) or -1 \(skipped\), got 10 at index\[0, 0, 3\]"),
        ("index-entry-neg", dict(index=index.clone().index_fill_(2, torch.tensor([1]), -2)), ValueError,
         r"got -2 at index\[0, 0, 1\]"),
        ("bias-dtype", dict(bias=bias.double()), TypeError, "bias must be fp32"),
        ("bias-shape", dict(bias=bias[..., :9]), ValueError, r"bias must be \[B, Hkv, C\]"),
        ("keys-dtype", dict(keys=keys.half()), TypeError, "share one dtype"),
        ("values-shape", dict(values=values[..., :8]), ValueError, "values must be shaped like keys"),
        ("keys-D", dict(keys=keys[..., :8], values=values[..., :8]), ValueError, r"keys must be \[B=2, Hkv, C, D=16\]"),
        ("q-3d", dict(q=q[0]), ValueError, r"expected q \[B, Hq, T, D\]"),
        ("gqa", dict(q=q[:, :3]), ValueError, "multiple of Hkv"),
        ("no-slots", dict(keys=keys[:, :, :0], values=values[:, :, :0], bias=bias[..., :0]), ValueError, "C = 0"),
        ("softcap", dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    ], ok


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_inputs_raise_naming_the_field(impl):
    cases, ok = _bad_inputs()
    for case, change, exc, match in cases:
        a = dict(ok, **change)
        with pytest.raises(exc, match=match) as info:
            IMPLS[impl](a["q"], a["keys"], a["values"], a["bias"], a["index"], 0.25, a["softcap"])
        assert "indexed_attention: " in str(info.value), case  # the op's name


def test_opcheck():
    for kind, dtype, T, softcap in [("per_kv", torch.float32, 1, 0.0), ("per_q", torch.bfloat16, 2, 30.0)]:
        q, keys, values, bias, index = make_inputs(2, 8, 2, T, 11, 16, 7, dtype, kind, seed=12)
        torch.library.opcheck(OP, (q, keys, values, bias, index, 0.25), {"softcap": softcap} if softcap else {})
