"""expanded_attention's Triton kernel on the CPU, through Triton's interpreter, against the float64 dense attention
over materialised expanded keys (tests/kernels/expanded_naive.py) and against the reference.

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_expanded_attention_triton.py`
(with Triton installed; skipped otherwise). fp32 only (the 3.6 interpreter's 16-bit tl.dot is wrong). Small tiles
(16 entries, 16 slots per chunk) and 3 slot splits make a few dozen slots cross every tile, chunk and split boundary,
so merged entries straddle them. Prefill-sized blocks (G * T > 16) run the slot-walking prefill kernel
(_expanded_prefill_kernels.py): PREFILL_CASES, with 16-row query blocks across the fresh diagonal. The soft cap is
tested on the GPU only (tests/kernels/test_expanded_attention_gpu.py): its tanh is CUDA's libdevice, which the
interpreter does not provide.
"""
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels.expanded_attention import launch_expanded_forward, reference_expanded_attention  # noqa: E402
from tests.kernels.expanded_naive import make_state, naive_expanded  # noqa: E402

SMALL = dict(block_m=16, block_n=16, block_j=16)
# (B, Hq, Hkv, C, R, D, T, prefill, make_state options)
CASES = {
    "decode-G2": (2, 4, 2, 37, 80, 16, 1, False, {}),
    "decode-G4-dead": (1, 8, 2, 29, 61, 16, 1, False, {"dead": True}),
    "prefill-G1-odd": (1, 2, 2, 23, 47, 16, 5, True, {}),
    "prefill-G2-empty-row": (2, 4, 2, 19, 41, 16, 3, True, {"empty_row": True}),
}


def build(case, seed=0, cases=CASES):
    B, Hq, Hkv, C, R, D, T, prefill, opts = cases[case]
    g = torch.Generator().manual_seed(seed)
    st = make_state(B, Hkv, C, R, D, T, torch.float32, g, prefill=prefill, **opts)
    q = torch.randn(B, Hq, T, D, generator=g)
    return st, q, D**-0.5, not prefill


def check_naive(out, lse, st, q, scale):
    """out and lse against the float64 dense attention over the materialised expanded keys (naive_expanded): out to
    1e-5, lse -inf at the same queries and finite ones to 1e-5."""
    want, want_lse, _ = naive_expanded(st, q, scale)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("narrow", [True, False], ids=["narrow", "full-width"])  # decode: NARROW's two forms
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_naive_and_reference(case, splits, narrow):
    st, q, scale, past_only = build(case)
    out, lse = launch_expanded_forward(*st.attention_args(q), scale, past_only, 0.0, num_splits=splits,
                                       narrow=narrow, **SMALL)
    check_naive(out, lse, st, q, scale)
    ref, ref_lse = reference_expanded_attention(*st.attention_args(q), scale, past_only)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if "empty" in case:
        assert (out[0] == 0).all() and (lse[0] == -math.inf).all()


@pytest.mark.parametrize("case", ["decode-G4-dead", "prefill-G2-empty-row"])
@pytest.mark.parametrize("gather, scatter", [("onehot", "onehot"), ("onehot_tf32x3", "cumsum"), ("gather", "cumsum")])
def test_other_gathers_and_scatters(case, gather, scatter):
    st, q, scale, past_only = build(case, seed=2)
    out, lse = launch_expanded_forward(*st.attention_args(q), scale, past_only, 0.0, num_splits=3, gather=gather,
                                       scatter=scatter, **SMALL)
    check_naive(out, lse, st, q, scale)


NARROW_CASES = {**CASES, "decode-G1": (2, 2, 2, 31, 70, 16, 1, False, {"dead": True})}  # G * T = 1: one row


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", NARROW_CASES)
def test_narrow_form(case, splits):
    """expanded_attention.NARROW: the per-slot work on next_power_of_2(G * T) rows, at least NARROW_MIN_ROWS (4, 4, 4
    and 8 here for G * T = 1, 2, 4 and 5-8) of the 16-row block, with the running-sum segment sum: the float64 dense
    attention's output and lse, and S as the full-width form writes it."""
    st, q, scale, past_only = build(case, seed=4, cases=NARROW_CASES)
    out, lse = launch_expanded_forward(*st.attention_args(q), scale, past_only, 0.0, num_splits=splits, narrow=True,
                                       **SMALL)
    check_naive(out, lse, st, q, scale)
    if q.shape[2] == 1:  # S (decode): the same scores as the full-width form's
        B, Hq, _, _ = q.shape
        S, S_full = (torch.zeros(B, Hq, st.keys.shape[2]) for _ in range(2))
        launch_expanded_forward(*st.attention_args(q), scale, past_only, 0.0, S=S, num_splits=3, narrow=True, **SMALL)
        launch_expanded_forward(*st.attention_args(q), scale, past_only, 0.0, S=S_full, num_splits=3, **SMALL)
        assert torch.equal(S, S_full)


def test_narrow_rows():
    """The narrow form's row count: next_power_of_2(G * T), never below NARROW_MIN_ROWS (Triton 3.6 fails to compile
    1 and 2 rows for sm_90), never above block_m; the full width where a query block cannot hold every row or the
    tiles are ones the narrow form does not compile at."""
    from kvrewrite.kernels import expanded_attention as xa

    def gm(G, T):
        cfg = xa._launch_config(1, 8, G, T, 6656, 128, 132, 2, narrow=True)
        return cfg["gm"], cfg["block_m"]

    assert [gm(1, 1), gm(2, 1), gm(4, 1), gm(1, 5), gm(8, 2)] == [(4, 16), (4, 16), (4, 16), (8, 16), (16, 16)]
    assert gm(4, 8)[0] == gm(4, 8)[1] == 32  # 32 rows: the full width of a 32-row block
    assert xa._launch_config(1, 8, 4, 1, 6656, 128, 132, 2, narrow=False)["gm"] == 16
    # tiles the narrow form does not compile at (narrow_compiles) take the full width: one is 16, the other not
    for bn, bj, want in ((32, 16, 16), (16, 64, 16), (16, 16, 4), (32, 32, 4), (128, 64, 4)):
        assert xa._launch_config(1, 8, 4, 1, 6656, 128, 132, 2, narrow=True, block_n=bn, block_j=bj)["gm"] == want


def test_entry_scores_S():
    """S holds scale * q·keys[e] for every entry holding a slot below slot_fill; other entries keep their value."""
    st, q, scale, past_only = build("decode-G2", seed=3)
    B, Hq, _, D = q.shape
    Hkv, C = st.keys.shape[1], st.keys.shape[2]
    S = torch.full((B, Hq, C), float("nan"))
    launch_expanded_forward(*st.attention_args(q), scale, past_only, 0.0, S=S, num_splits=3, **SMALL)
    want = torch.einsum("bhgd,bhcd->bhgc", q.double().view(B, Hkv, Hq // Hkv, D), st.keys.double()) * scale
    want = want.reshape(B, Hq, C)
    for b in range(B):
        for h in range(Hkv):
            n = int(st.slot_fill[b, h])
            used = st.lut[b, h, :n]
            lo, hi = int(used[used >= 0].min()), int(used.max())
            rows = slice(h * (Hq // Hkv), (h + 1) * (Hq // Hkv))
            torch.testing.assert_close(S[b, rows, lo:hi + 1].double(), want[b, rows, lo:hi + 1], atol=1e-5, rtol=1e-5)
            assert S[b, rows, hi + 1:].isnan().all()


# prefill-sized blocks (G * T > 16): the slot-walking prefill kernel (_expanded_prefill_kernels.py)
PREFILL_CASES = {
    "G2-three-blocks": (2, 4, 2, 55, 131, 16, 20, {}),  # C <= T + 40: make_state has 40 past positions
    "G1-dead": (1, 2, 2, 70, 140, 16, 37, {"dead": True}),
    "G2-empty-row": (2, 4, 2, 47, 101, 16, 17, {"empty_row": True}),
}


@pytest.mark.parametrize("gathered", [False, True], ids=["walk", "gathered"])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_kernel_matches_naive_and_reference(case, gathered, monkeypatch):
    """16-row query blocks and 16-slot tiles: tiles straddle the fresh diagonal, freed and stale slots, padding
    entries and rows that see nothing; the launch goes through the prefill kernel, or with `gathered` through
    gather_slots and clustered_attention's prefill kernel with per-slot key scales (counted)."""
    from kvrewrite.kernels import _expanded_prefill_kernels as xp

    B, Hq, Hkv, C, R, D, T, opts = PREFILL_CASES[case]
    g = torch.Generator().manual_seed(5)
    st = make_state(B, Hkv, C, R, D, T, torch.float32, g, prefill=True, **opts)
    q = torch.randn(B, Hq, T, D, generator=g)
    calls = []
    name = "launch_gathered_prefill" if gathered else "launch_expanded_prefill"
    launch = getattr(xp, name)
    monkeypatch.setattr(xp, name, lambda *a, **k: calls.append(1) or launch(*a, **k))
    out, lse = launch_expanded_forward(*st.attention_args(q), D**-0.5, False, 0.0, num_splits=1, block_m=16,
                                       block_n=16, gathered=gathered)
    assert calls == [1]
    check_naive(out, lse, st, q, D**-0.5)
    old, old_lse = launch_expanded_forward(*st.attention_args(q), D**-0.5, False, 0.0, num_splits=1,
                                           prefill_kernel=False, **SMALL)
    torch.testing.assert_close(out, old, atol=1e-5, rtol=1e-5)
    if "empty" in case:
        assert (out[0] == 0).all() and (lse[0] == -math.inf).all()


def _poison_empty(monkeypatch):
    """torch.empty hands out NaN (floating) or -7 (integer) filled tensors: an output element a kernel leaves
    unwritten then differs from any real value (NaN equals nothing)."""
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (lambda t: t.fill_(math.nan if t.is_floating_point()
                                                                           else -7))(real(*a, **k)))


@pytest.mark.parametrize("D, dtype, block_j, strided", [(16, torch.float32, 4, False),
                                                        (24, torch.float32, 8, True),
                                                        (64, torch.bfloat16, None, False),
                                                        (16, torch.float16, 16, True)],
                         ids=["D16-fp32-j4", "D24-fp32-j8-strided", "D64-bf16", "D16-fp16-j16-strided"])
def test_gather_slots_kernel_is_the_tensor_code(D, dtype, block_j, strided, monkeypatch):
    """_expanded_prefill_kernels.GATHER_KERNEL's launch writes gather_slots' four outputs bit for bit as its tensor
    code does: freed and stale slots past the fill, padding entries, an R that is not a multiple of the slot block, a
    D below its power of two (24: masked columns), keys and values as strided views; outputs poisoned."""
    from kvrewrite.kernels import _expanded_prefill_kernels as xp

    g = torch.Generator().manual_seed(9)
    st = make_state(2, 2, 37, 83, D, 5, dtype, g, prefill=True, dead=True)
    keys, values = st.keys, st.values
    if strided:  # views of wider buffers: the kernel reads through their strides
        keys = torch.cat([keys, torch.zeros_like(keys)], -1)[..., :D]
        values = torch.cat([values, torch.zeros_like(values)], 2)[:, :, :values.shape[2]]
        assert not keys.is_contiguous() and not values.is_contiguous()
    args = (keys, values, st.bias, st.slot_pos, st.lut, st.slot_fill)
    want = xp.gather_slots(*args, kernel=False)
    _poison_empty(monkeypatch)
    got = xp.launch_gather_slots(*args, block_j=block_j)
    for name, a, b in zip(("keys", "values", "bias", "slot_pos"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
        assert torch.equal(a, b), name
    assert (want[2] == -math.inf).any() and (want[2] == 0).any()  # the case holds dead and live slots


def test_prefill_kernel_not_used_with_splits_or_S(monkeypatch):
    """A split launch (or one writing S) keeps the per-entry kernel: the prefill kernel has no partials."""
    from kvrewrite.kernels import _expanded_prefill_kernels as xp

    B, Hq, Hkv, C, R, D, T, opts = PREFILL_CASES["G2-three-blocks"]
    st = make_state(B, Hkv, C, R, D, T, torch.float32, torch.Generator().manual_seed(6), prefill=True, **opts)
    q = torch.randn(B, Hq, T, D, generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr(xp, "launch_expanded_prefill", lambda *a, **k: pytest.fail("prefill kernel launched"))
    out, _ = launch_expanded_forward(*st.attention_args(q), D**-0.5, False, 0.0, num_splits=2, **SMALL)
    want, _, _ = naive_expanded(st, q, D**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_prefill_kernel_past_only_decode_of_a_wide_group(monkeypatch):
    """A decode step of 32 query heads on one KV head is a block of 32 rows: without a split it runs the prefill
    kernel, with past_only (no slot_pos read), and matches the float64 model."""
    from kvrewrite.kernels import _expanded_prefill_kernels as xp

    g = torch.Generator().manual_seed(8)
    st = make_state(2, 1, 30, 70, 16, 1, torch.float32, g, prefill=False, dead=True)
    q = torch.randn(2, 32, 1, 16, generator=g)
    calls = []
    launch = xp.launch_expanded_prefill
    monkeypatch.setattr(xp, "launch_expanded_prefill", lambda *a, **k: calls.append(a[11]) or launch(*a, **k))
    out, lse = launch_expanded_forward(*st.attention_args(q), 0.25, True, 0.0, num_splits=1, block_m=16, block_n=16)
    assert calls == [True]  # past_only reached the kernel
    want, want_lse, _ = naive_expanded(st, q, 0.25)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
