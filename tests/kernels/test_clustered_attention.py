"""kvrewrite::clustered_attention: the reference against a naive float64 attention written here.

The naive version below is deliberately the paper's Eq. (2) spelled out query by query and slot by
slot (no einsum, no max-subtraction trick beyond what float64 needs): weight_j = exp(scale*q.k_j + b_j)
for every slot j visible to the query (slot_pos_j <= cache_position, and > cache_position - window for a
windowed layer), o = sum_j weight_j v_j / sum_j weight_j, and 0 when the query sees no slot. With a soft
cap, scale*q.k_j becomes softcap*tanh(scale*q.k_j/softcap) and the bias is added after it (Gemma-2).
"""
import itertools
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)

from kvrewrite.kernels.clustered_attention import reference_clustered_attention

OP = torch.ops.kvrewrite.clustered_attention.default
# The op (its CPU path is fused SDPA) and the plain reference (the spec) must both match the naive form.
IMPLS = {"op": OP, "reference": reference_clustered_attention}


# Tolerance table: output dtype -> (atol, rtol) of the op against the float64 naive attention.
# Both see the *same* inputs (the naive version upcasts the exact bf16/fp32 values), so input
# quantisation cancels; what remains is
#   fp32: fp32 logits/softmax/accumulation. Logits are O(5) (q, k ~ N(0,1), scale D**-0.5, biases up
#         to log 5), so exp() carries ~1e-6 relative error and outputs (|v| <= ~4) ~4e-6 absolute.
#         atol 2e-5 / rtol 1e-5 is 5x that, and ~1e4 below the smallest effect a real bug has here
#         (dropping the bias, a wrong GQA head or an off-by-one mask all move outputs by >= 1e-2).
#   bf16: the fp32 result rounded once to bf16: relative error <= 2**-8 (half an ulp of an 8-bit
#         significand), plus the fp32 error above for outputs near 0 after cancellation.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-5, rtol=2**-8),
}


def softcap_tol(dtype, softcap):
    """TOL[dtype] with the cap's own fp32 rounding: logits reach |softcap| and carry a few ulp of it (tanh, the
    divide and multiply: <= ~4 * softcap * 2**-23), which is the relative error of each weight; outputs
    (|v| <= ~4) move by <= softcap * 2e-6 (1e-4 at softcap 50), still ~1e2 below what a misplaced bias or a
    missing cap moves (>= 1e-2; test_softcap_matches_naive checks the cap matters)."""
    return dict(TOL[dtype], atol=max(TOL[dtype]["atol"], 2e-6 * softcap))


def naive_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, softcap=0.0):
    """float64 dense softmax, one (b, query head) at a time; GQA: query head h reads KV head h // (Hq // Hkv);
    softcap > 0 caps the scaled score, then the bias and the mask are added."""
    B, Hq, T, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    q, k, v, bias = q.double(), keys.double(), values.double(), bias.double()
    out = torch.zeros(B, Hq, T, D, dtype=torch.float64)
    cp = cache_position[:, None]
    for b in range(B):
        for h in range(Hq):
            kh = h // G
            sp = slot_pos[b, kh][None, :]
            vis = (sp <= cp) & (bias[b, kh] > -math.inf)[None, :]  # [T, C]
            if window > 0:
                vis &= sp > cp - window
            logits = (q[b, h] @ k[b, kh].T) * scale
            if softcap > 0:
                logits = softcap * torch.tanh(logits / softcap)
            logits = logits + bias[b, kh]
            logits = logits.masked_fill(~vis, -math.inf)
            m = logits.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
            w = torch.exp(logits - m)  # 0 where invisible
            den = w.sum(-1, keepdim=True)
            o = (w @ v[b, kh]) / torch.where(den > 0, den, 1.0)
            out[b, h] = o  # a query that sees nothing: w == 0, o == 0
    return out


def make_state(B, Hkv, C, D, T, dtype, n_past_max=50, gen=None, empty_frac=0.15):
    """A slot state whose last min(T, C) slots hold the fresh block (positions P..P+T-1) and whose
    other slots hold past tokens (random distinct positions < P, random degrees 1..5, ~15% empty)."""
    g = gen
    keys = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    values = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    P = max(n_past_max, C + 3)  # past positions are drawn from [0, P)
    n_fresh = min(T, C)
    n_past = C - n_fresh
    slot_pos = torch.empty(B, Hkv, C, dtype=torch.int64)
    bias = torch.empty(B, Hkv, C, dtype=torch.float32)
    for b in range(B):
        for h in range(Hkv):
            slot_pos[b, h, :n_past] = torch.randperm(P, generator=g)[:n_past].sort().values
            slot_pos[b, h, n_past:] = P + T - n_fresh + torch.arange(n_fresh)  # the fresh block (the last tokens)
            deg = torch.randint(1, 6, (C,), generator=g).float()
            deg[n_past:] = 1
            bias[b, h] = deg.log()
            empty = torch.rand(n_past, generator=g) < empty_frac
            bias[b, h, :n_past][empty] = -math.inf
    cache_position = torch.arange(P, P + T)  # the fresh block, which the last min(T, C) slots hold
    return keys, values, bias, slot_pos, cache_position


HEADS = [(1, 1), (2, 1), (4, 2), (8, 2), (7, 1)]  # Hq/Hkv = 1, 2, 2, 4, 7
GRID = list(itertools.product((1, 3), HEADS, (1, 5), (1, 37, 100), (16, 64)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,heads,T,C,D", GRID, ids=[f"B{b}-Hq{h[0]}Hkv{h[1]}-T{t}-C{c}-D{d}" for b, h, t, c, d in GRID])
def test_matches_naive(B, heads, T, C, D, dtype, impl):
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(hash((B, Hq, Hkv, T, C, D)) % 2**31)
    keys, values, bias, slot_pos, cp = make_state(B, Hkv, C, D, T, dtype, gen=g)
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    scale = D**-0.5
    out = IMPLS[impl](q, keys, values, bias, slot_pos, cp, scale, 0)
    assert out.dtype == dtype and out.shape == (B, Hq, T, D)
    ref = naive_attention(q, keys, values, bias, slot_pos, cp, scale, 0)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


def test_causal_fresh_block():
    """T > 1 prefill chunk written just before: query t sees the fresh slots up to itself only."""
    B, Hkv, C, D, T = 1, 1, 6, 16, 4
    keys = torch.randn(B, Hkv, C, D)
    values = torch.randn(B, Hkv, C, D)
    bias = torch.zeros(B, Hkv, C)
    slot_pos = torch.tensor([[[0, 1, 10, 11, 12, 13]]])  # 2 past tokens, then the chunk 10..13
    cp = torch.arange(10, 14)
    q = torch.randn(B, 1, T, D)
    out = OP(q, keys, values, bias, slot_pos, cp, 0.25, 0)
    for t in range(T):
        vis = 2 + t + 1
        exp = torch.softmax(q[0, 0, t] @ keys[0, 0, :vis].T * 0.25, -1) @ values[0, 0, :vis]
        torch.testing.assert_close(out[0, 0, t], exp, atol=2e-6, rtol=1e-5)


def test_bias_is_log_degree():
    """A slot with bias log n is n identical slots with bias 0 (the paper's Eq. 2), added after scaling."""
    D = 16
    k = torch.randn(1, 1, 4, D)
    v = torch.randn(1, 1, 4, D)
    q = torch.randn(1, 2, 1, D)
    deg = torch.tensor([3.0, 1.0, 2.0, 1.0])
    merged = OP(q, k, v, deg.log().view(1, 1, 4), torch.zeros(1, 1, 4, dtype=torch.long), torch.tensor([5]), 0.3, 0)
    rep = deg.long()
    k_exp, v_exp = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    n = int(rep.sum())
    expanded = OP(q, k_exp, v_exp, torch.zeros(1, 1, n), torch.zeros(1, 1, n, dtype=torch.long), torch.tensor([5]), 0.3, 0)
    torch.testing.assert_close(merged, expanded, atol=2e-6, rtol=1e-5)
    # and the bias matters: without it the result is measurably different
    plain = OP(q, k, v, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4, dtype=torch.long), torch.tensor([5]), 0.3, 0)
    assert (plain - merged).abs().max() > 1e-2


def test_empty_slots_are_ignored():
    """bias -inf marks an empty slot: whatever (finite) stale data it holds is never attended."""
    D = 16
    k, v = torch.randn(1, 1, 5, D), torch.randn(1, 1, 5, D)
    q = torch.randn(1, 1, 1, D)
    pos = torch.zeros(1, 1, 5, dtype=torch.long)
    bias = torch.tensor([[[0.0, -math.inf, 0.0, -math.inf, 0.0]]])
    k2, v2 = k.clone(), v.clone()
    k2[0, 0, [1, 3]] = 1e3 * torch.randn(2, D)  # large stale keys would dominate the softmax if attended
    v2[0, 0, [1, 3]] = 1e3
    out = OP(q, k2, v2, bias, pos, torch.tensor([0]), 0.25, 0)
    ref = OP(q, k[:, :, [0, 2, 4]], v[:, :, [0, 2, 4]], torch.zeros(1, 1, 3), pos[:, :, :3], torch.tensor([0]), 0.25, 0)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [1, 3, 7])
def test_window_masking(window):
    """Sliding window: slot visible iff cache_position - window < slot_pos <= cache_position."""
    B, Hkv, Hq, C, D, T = 2, 2, 4, 20, 16, 3
    g = torch.Generator().manual_seed(window)
    keys, values, bias, slot_pos, cp = make_state(B, Hkv, C, D, T, torch.float32, n_past_max=25, gen=g)
    q = torch.randn(B, Hq, T, D, generator=g)
    out = OP(q, keys, values, bias, slot_pos, cp, 0.25, window)
    ref = naive_attention(q, keys, values, bias, slot_pos, cp, 0.25, window)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
    # the window really cuts something: without it the answer differs
    full = OP(q, keys, values, bias, slot_pos, cp, 0.25, 0)
    assert (full - out).abs().max() > 1e-2
    # window == 1: each query sees exactly its own slot (the fresh token), so o = its value
    if window == 1:
        Gq = Hq // Hkv
        for t in range(T):
            fresh = (slot_pos == cp[t]).nonzero()
            for b, h, j in fresh.tolist():
                for hq in range(h * Gq, (h + 1) * Gq):
                    torch.testing.assert_close(out[b, hq, t], values[b, h, j])


def test_query_with_no_visible_slot_is_zero_not_nan():
    D = 16
    k, v = torch.randn(2, 1, 4, D), torch.randn(2, 1, 4, D)
    q = torch.randn(2, 3, 2, D)
    bias = torch.zeros(2, 1, 4)
    bias[1] = -math.inf  # batch row 1: every slot empty
    pos = torch.tensor([5, 6, 7, 8]).expand(2, 1, 4).contiguous()
    cp = torch.tensor([3, 6])  # query 0 precedes every slot; query 1 sees slots 5, 6
    for dtype in (torch.float32, torch.bfloat16):
        out = OP(q.to(dtype), k.to(dtype), v.to(dtype), bias, pos, cp, 0.25, 0)
        assert torch.isfinite(out).all()
        assert (out[0, :, 0] == 0).all()  # nothing visible yet
        assert (out[1] == 0).all()  # visible positions but every slot empty
        assert (out[0, :, 1] != 0).any()
    # the window can hide everything too
    out = OP(q, k, v, torch.zeros(2, 1, 4), pos, torch.tensor([20, 21]), 0.25, 4)
    assert torch.isfinite(out).all() and (out == 0).all()


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    for dtype, (Hq, Hkv), T, window in [(torch.float32, (4, 2), 3, 0), (torch.bfloat16, (7, 1), 1, 5)]:
        keys, values, bias, slot_pos, cp = make_state(2, Hkv, 11, 16, T, dtype, gen=g)
        q = torch.randn(2, Hq, T, 16, generator=g).to(dtype)
        torch.library.opcheck(OP, (q, keys, values, bias, slot_pos, cp, 0.25, window))
    # past_only, as decode graphs pass it (a keyword), on a state with no slot after the query
    keys, values, bias, slot_pos, cp = make_state(2, 2, 11, 16, 1, torch.float32, gen=g)
    q = torch.randn(2, 4, 1, 16, generator=g)
    torch.library.opcheck(OP, (q, keys, values, bias, slot_pos, cp, 0.25, 0), {"past_only": True})


# -- past_only: the caller's promise that no used slot lies after a query (decode graphs) ----------------------

PAST_ONLY_CASES = [(1, (4, 4), 1, 1, 0), (3, (8, 2), 1, 100, 0), (2, (7, 1), 1, 37, 5), (2, (4, 2), 3, 40, 0)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,heads,T,C,window", PAST_ONLY_CASES,
                         ids=[f"B{b}-Hq{h[0]}Hkv{h[1]}-T{t}-C{c}-w{w}" for b, h, t, c, w in PAST_ONLY_CASES])
def test_past_only_computes_the_same_function(B, heads, T, C, window, dtype, impl):
    """With the promise kept, past_only=True returns exactly what past_only=False does (same masks and
    arithmetic on the CPU), and that matches the naive attention. T = 3: every query after every slot."""
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(C * 10 + T)
    keys, values, bias, slot_pos, cp = make_state(B, Hkv, C, 16, 1, dtype, gen=g)
    if T > 1:
        cp = cp[0] + torch.arange(T)  # queries at and after the newest slot: the promise holds at every T
    q = torch.randn(B, Hq, T, 16, generator=g).to(dtype)
    want = IMPLS[impl](q, keys, values, bias, slot_pos, cp, 0.25, window)
    got = IMPLS[impl](q, keys, values, bias, slot_pos, cp, 0.25, window, past_only=True)
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), naive_attention(q, keys, values, bias, slot_pos, cp, 0.25, window),
                               **TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
def test_past_only_broken_promise_is_a_clear_error(impl):
    """A used slot after the query (or a prefill chunk's causal fresh block) with past_only=True raises,
    naming the slot and the positions; an empty slot (bias -inf) after the query is no breach."""
    g = torch.Generator().manual_seed(4)
    keys, values, bias, slot_pos, cp = make_state(2, 2, 30, 16, 1, torch.float32, gen=g, empty_frac=0.0)
    q = torch.randn(2, 4, 1, 16, generator=g)
    late = slot_pos.clone()
    late[1, 0, 7] = cp[0] + 3
    with pytest.raises(ValueError, match=rf"past_only=True, but used slot 7 of batch row 1, KV head 0 holds "
                                         rf"position {int(cp[0]) + 3}, after the query position {int(cp[0])}"):
        IMPLS[impl](q, keys, values, bias, late, cp, 0.25, 0, past_only=True)
    with pytest.raises(ValueError, match="past_only=True"):  # windowed layers are checked too
        IMPLS[impl](q, keys, values, bias, late, cp, 0.25, 4, past_only=True)
    empty = bias.clone()
    empty[1, 0, 7] = -math.inf  # the late slot is empty: nothing to break
    IMPLS[impl](q, keys, values, empty, late, cp, 0.25, 0, past_only=True)
    # a prefill chunk: its fresh block is causal, so the earlier queries precede slots
    keys, values, bias, slot_pos, cp = make_state(1, 2, 30, 16, 5, torch.float32, gen=g)
    with pytest.raises(ValueError, match="past_only=True"):
        IMPLS[impl](torch.randn(1, 2, 5, 16, generator=g), keys, values, bias, slot_pos, cp, 0.25, 0, past_only=True)


# -- softcap: Gemma-2's attention logit soft cap, softcap * tanh(scale * q.k / softcap), bias and mask after it -----

# (B, (Hq, Hkv), T, C, D, window): decode and prefill-chunk shapes, GQA 1/4/7/2, empty slots (make_state), windows
SOFTCAP_CASES = [(1, (4, 4), 1, 37, 16, 0), (3, (8, 2), 1, 100, 64, 0), (2, (7, 1), 5, 37, 16, 5),
                 (2, (4, 2), 16, 100, 16, 8)]


def softcap_inputs(B, Hq, Hkv, T, C, D, dtype, softcap, seed):
    """make_state, and queries scaled so that scale * q.k has a standard deviation of about `softcap` (tanh(1) =
    0.76: the cap bends most scores, and saturates the largest)."""
    g = torch.Generator().manual_seed(seed)
    keys, values, bias, slot_pos, cp = make_state(B, Hkv, C, D, T, dtype, gen=g)
    q = (torch.randn(B, Hq, T, D, generator=g) * softcap).to(dtype)
    return q, keys, values, bias, slot_pos, cp


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [5.0, 30.0, 50.0], ids=lambda c: f"cap{c:g}")
@pytest.mark.parametrize("B,heads,T,C,D,window", SOFTCAP_CASES,
                         ids=[f"B{b}-Hq{h[0]}Hkv{h[1]}-T{t}-C{c}-D{d}-w{w}" for b, h, t, c, d, w in SOFTCAP_CASES])
def test_softcap_matches_naive(B, heads, T, C, D, window, softcap, dtype, impl):
    Hq, Hkv = heads
    q, keys, values, bias, slot_pos, cp = softcap_inputs(B, Hq, Hkv, T, C, D, dtype, softcap,
                                                         seed=hash((B, Hq, T, C, D, window, softcap)) % 2**31)
    scale = D**-0.5
    out = IMPLS[impl](q, keys, values, bias, slot_pos, cp, scale, window, softcap=softcap)
    assert out.dtype == dtype and out.shape == (B, Hq, T, D)
    ref = naive_attention(q, keys, values, bias, slot_pos, cp, scale, window, softcap=softcap)
    torch.testing.assert_close(out.double(), ref, **softcap_tol(dtype, softcap))
    # the cap matters on these logits: the uncapped function is far away
    uncapped = naive_attention(q, keys, values, bias, slot_pos, cp, scale, window)
    assert (uncapped - ref).abs().max() > 1e-1


@pytest.mark.parametrize("impl", IMPLS)
def test_softcap_zero_is_no_cap_bit_for_bit(impl):
    """softcap=0.0 (positional or keyword) is the default: the very same bits as omitting it, past_only too."""
    g = torch.Generator().manual_seed(8)
    for dtype, (Hq, Hkv), T, window in [(torch.float32, (4, 2), 3, 0), (torch.bfloat16, (7, 1), 1, 5)]:
        keys, values, bias, slot_pos, cp = make_state(2, Hkv, 30, 16, T, dtype, gen=g)
        q = torch.randn(2, Hq, T, 16, generator=g).to(dtype)
        args = (q, keys, values, bias, slot_pos, cp, 0.25, window)
        want = IMPLS[impl](*args)
        assert torch.equal(IMPLS[impl](*args, softcap=0.0), want)
        assert torch.equal(IMPLS[impl](*args, False, 0.0), want)
        if T == 1:
            assert torch.equal(IMPLS[impl](*args, past_only=True, softcap=0.0), IMPLS[impl](*args, past_only=True))


@pytest.mark.parametrize("impl", IMPLS)
def test_softcap_bias_is_added_after_the_cap(impl):
    """A slot with bias log n is n identical slots with bias 0 under the cap too (the cap acts on the score
    alone); with the bias inside the tanh it would not be."""
    D, cap = 16, 5.0
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 1, 4, D, generator=g), torch.randn(1, 1, 4, D, generator=g)
    q = 4 * torch.randn(1, 2, 1, D, generator=g)
    deg = torch.tensor([3.0, 1.0, 2.0, 1.0])
    pos, cp = torch.zeros(1, 1, 4, dtype=torch.long), torch.tensor([5])
    merged = IMPLS[impl](q, k, v, deg.log().view(1, 1, 4), pos, cp, 0.3, 0, softcap=cap)
    rep = deg.long()
    n = int(rep.sum())
    expanded = IMPLS[impl](q, k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2), torch.zeros(1, 1, n),
                           torch.zeros(1, 1, n, dtype=torch.long), cp, 0.3, 0, softcap=cap)
    torch.testing.assert_close(merged, expanded, atol=2e-6, rtol=1e-5)
    # HF's order, spelled out: cap the scaled scores, then add the bias (here the log degrees)
    s = cap * torch.tanh((q[0] @ k[0, 0].T) * 0.3 / cap) + deg.log()
    torch.testing.assert_close(merged[0], torch.softmax(s, -1) @ v[0, 0], atol=2e-6, rtol=1e-5)
    inside = torch.softmax(cap * torch.tanh(((q[0] @ k[0, 0].T) * 0.3 + deg.log()) / cap), -1) @ v[0, 0]
    assert (inside - merged[0]).abs().max() > 1e-3


@pytest.mark.parametrize("impl", IMPLS)
def test_softcap_saturates_and_keeps_empty_rows_zero(impl):
    """Scores far beyond the cap (|scale * q.k| ~ 1e5) saturate to +-softcap: finite, and the naive formula's;
    a query that sees no slot is 0 and an empty slot's huge stale data is never attended, as without the cap."""
    D, cap = 16, 30.0
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 1, 5, D, generator=g), torch.randn(2, 1, 5, D, generator=g)
    q = 1e5 * torch.randn(2, 3, 2, D, generator=g)
    bias = torch.zeros(2, 1, 5)
    bias[1] = -math.inf  # batch row 1: every slot empty
    bias[0, 0, 2] = -math.inf
    k[0, 0, 2], v[0, 0, 2] = 1e3, 1e3  # stale data in the empty slot
    pos = torch.tensor([5, 6, 7, 8, 9]).expand(2, 1, 5).contiguous()
    cp = torch.tensor([3, 8])  # query 0 precedes every slot; query 1 sees slots 5..8
    out = IMPLS[impl](q, k, v, bias, pos, cp, 0.25, 0, softcap=cap)
    assert torch.isfinite(out).all()
    assert (out[:, :, 0] == 0).all() and (out[1] == 0).all()
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, bias, pos, cp, 0.25, 0, softcap=cap),
                               **softcap_tol(torch.float32, cap))


@pytest.mark.parametrize("impl", IMPLS)
def test_softcap_must_be_finite_and_not_negative(impl):
    keys, values, bias, slot_pos, cp = make_state(1, 1, 5, 16, 1, torch.float32, gen=torch.Generator().manual_seed(0))
    q = torch.randn(1, 1, 1, 16)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"softcap must be a finite number >= 0"):
            IMPLS[impl](q, keys, values, bias, slot_pos, cp, 0.25, 0, softcap=bad)


def test_softcap_opcheck():
    g = torch.Generator().manual_seed(1)
    for dtype, (Hq, Hkv), T, window, past_only in [(torch.float32, (4, 2), 3, 0, False),
                                                   (torch.bfloat16, (7, 1), 1, 5, True)]:
        keys, values, bias, slot_pos, cp = make_state(2, Hkv, 11, 16, T, dtype, gen=g)
        q = (30 * torch.randn(2, Hq, T, 16, generator=g)).to(dtype)
        torch.library.opcheck(OP, (q, keys, values, bias, slot_pos, cp, 0.25, window),
                              {"past_only": past_only, "softcap": 30.0})


def test_fewest_waves_splits_against_brute_force():
    """The split rule for grids that overflow the SMs: the S of least ceil(programs * S / capacity) / S, the smallest
    on ties, checked against exact fractions over many grids; and the H200 cases that set it."""
    from fractions import Fraction

    from kvrewrite.kernels.clustered_attention import fewest_waves_splits

    for programs in range(1, 700, 7):
        for capacity in (132, 264, 396):
            cost = {S: Fraction(-(-programs * S // capacity), S) for S in range(1, 9)}
            assert fewest_waves_splits(programs, capacity) == min(cost, key=lambda S: (cost[S], S))
    assert fewest_waves_splits(320, 264) == 4  # B = 40, Hkv = 8, pending rows (two per SM): 367 -> 287 us
    assert fewest_waves_splits(384, 264) == 2  # B = 48: 377 -> 332 us
    assert fewest_waves_splits(512, 396) == 3  # B = 64, plain kernel (three per SM): 455 -> 417 us
    assert fewest_waves_splits(512, 264) == 1  # B = 64, pending rows: two full waves, splitting gains nothing


def test_decode_splits_change_only_where_the_grid_overflows_the_sms():
    """`resident` changes the decode split count only where B * Hkv exceeds what the SMs hold at one split; below,
    the two-programs-per-SM rule stands (and without `resident`, one split as before)."""
    pytest.importorskip("triton")
    from kvrewrite.kernels.clustered_attention import _launch_config, fewest_waves_splits

    for B in (1, 4, 8, 16, 32, 33, 34, 40, 48, 50, 64, 100):
        base = _launch_config(B, 8, 4, 1, 6656, 128, 132)["num_splits"]
        for resident in (2, 3):
            S = _launch_config(B, 8, 4, 1, 6656, 128, 132, resident=resident)["num_splits"]
            if B * 8 <= resident * 132:
                assert S == base, (B, resident)
            else:
                assert base == 1 and S == fewest_waves_splits(B * 8, resident * 132), (B, resident, S)
    prefill = _launch_config(64, 8, 4, 64, 6656, 128, 132, resident=2)
    assert prefill == _launch_config(64, 8, 4, 64, 6656, 128, 132)  # prefill chunks keep their rule


def test_resident_program_counts_match_the_kernel_compiled_for_hopper():
    """RESIDENT_PROGRAMS(_PENDING), which size large-batch decode grids, are what the decode kernel compiled for sm_90
    by this Triton allows (registers and shared memory per SM; kvrewrite/bench/occupancy.py, no GPU needed): a Triton
    whose code generation changes them fails here. The occupancy arithmetic is checked on known cases first."""
    pytest.importorskip("triton")
    from kvrewrite.bench import occupancy
    from kvrewrite.kernels import clustered_attention as ca

    assert occupancy.programs_per_sm(152, 73728, 4) == 3  # 19456 registers a program; 74752 B with the reserve
    assert occupancy.programs_per_sm(196, 73728, 4) == 2  # 200 registers (whole 256-register units a warp)
    assert occupancy.programs_per_sm(32, 0, 4) == 16  # threads: 2048 a SM
    assert occupancy.programs_per_sm(32, 228 * 1024, 4) == 0  # more shared memory than a block may take
    for pending, want in ((False, ca.RESIDENT_PROGRAMS), (True, ca.RESIDENT_PROGRAMS_PENDING)):
        for split in (False, True):
            regs, shared, warps = occupancy.attention_decode_resources(pending, split)
            assert occupancy.programs_per_sm(regs, shared, warps) == want, (pending, split, regs, shared)
