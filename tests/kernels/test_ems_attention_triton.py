"""ems_attention's CUDA path (triton_ems_attention: the forward, then the fold kernels of
kvrewrite/kernels/_ems_fold_kernels.py) on the CPU, through Triton's interpreter, against the op's reference
(reference_ems_attention) and the naive float64 fold of the dense per-slot probabilities.

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_ems_attention_triton.py`
(with Triton installed; skipped otherwise). fp32 only; slot blocks of 16 so a few dozen slots cross them.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

import kvrewrite  # noqa: E402, F401  (registers the ops)
from kvrewrite.kernels import _ems_fold_kernels as fk  # noqa: E402
from kvrewrite.kernels.ems_attention import reference_ems_attention, triton_ems_attention  # noqa: E402
from tests.kernels.expanded_naive import make_state, naive_expanded  # noqa: E402
from tests.kernels.test_ems_attention import with_room  # noqa: E402
from tests.kernels.test_expanded_attention_stats_triton import NumpyLibdevice  # noqa: E402

SMALL = dict(block_j=16, block_m=16)
TOL = dict(atol=3e-5, rtol=1e-5)
CACHE_APPEND = torch.ops.kvrewrite.cache_append.default
EMS_APPEND = torch.ops.kvrewrite.ems_append.default


def both(st, q, s, win_count, past_only, l_win, softcap=0.0, **knobs):
    """Runs the kernel path on s / win_count and the reference on copies; returns the reference's (out, s, wc)."""
    s_ref, wc_ref = [x.clone() for x in s], win_count.clone()
    scale = q.shape[-1] ** -0.5
    args = st.attention_args(q)[:9]
    out = triton_ems_attention(*args, *s, st.slot_fill, win_count, scale, past_only, softcap, l_win, **SMALL, **knobs)
    want = reference_ems_attention(*args, *s_ref, st.slot_fill, wc_ref, scale, past_only, softcap, l_win)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # the reference forward or the Triton one
    for name, got, ref in zip(("s_glo", "s_loc_past", "s_loc_cur"), s, s_ref):
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(win_count, wc_ref)
    return s_ref


@pytest.mark.parametrize("knobs", [dict(lean=False, pipe=False, trans=False), dict(acc2d=True),
                                   dict(lean=False, pipe=False), dict(lean=False, pipe=True),
                                   dict(lean=True, pipe=False), {}],
                         ids=["plain", "acc2d", "trans", "pipe", "lean", "default"])
@pytest.mark.parametrize("Hq, Hkv", [(4, 2), (3, 1)], ids=["G2", "MQA"])
def test_prefill_fold(Hq, Hkv, knobs):
    """T = 20 > l_win = 6: s_glo grows, s_loc_past := the last 6 queries (NaN-poisoned before), s_loc_cur := 0
    (NaN-poisoned before), win_count := 0; against the naive model too; every form of the sums (ACC2D, TRANS, PIPE,
    LEAN)."""
    g = torch.Generator().manual_seed(0)
    B, C, R, D, T, l_win = 2, 31, 45, 16, 20, 6
    st = make_state(B, Hkv, C, R, D, T, torch.float32, g, prefill=True, dead=True)
    q = torch.randn(B, Hq, T, D, generator=g)
    glo0 = torch.rand(B, Hkv, R, generator=g)
    s = (glo0.clone(), torch.full((B, Hkv, R), float("nan")), torch.full((B, Hkv, R), float("nan")))
    win_count = torch.tensor([[5] * Hkv, [2] * Hkv])
    both(st, q, s, win_count, False, l_win, **knobs)
    p = naive_expanded(st, q, D**-0.5)[2].view(B, Hkv, Hq // Hkv, T, R).sum(dim=2)
    torch.testing.assert_close(s[0].double(), glo0.double() + p.sum(dim=2), **TOL)
    torch.testing.assert_close(s[1].double(), p[:, :, T - l_win:].sum(dim=2), **TOL)
    assert (s[2] == 0).all() and (win_count == 0).all()


@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "walk"])
def test_prefill_through_each_prefill_form(gathered, monkeypatch):
    """The op's prefill with expanded_attention.PREFILL_GATHERED on (the default: the slots' rows written out,
    clustered_attention's prefill kernel with per-slot key scales) and off (the slots walked in place): its output
    and folded statistics match the reference, through the form asked for (counted)."""
    from kvrewrite.kernels import _expanded_prefill_kernels as xp
    from kvrewrite.kernels import expanded_attention as xa

    calls = []
    name = "launch_gathered_prefill" if gathered else "launch_expanded_prefill"
    launch = getattr(xp, name)
    monkeypatch.setattr(xp, name, lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setattr(xa, "PREFILL_GATHERED", gathered)
    monkeypatch.setattr(xa, "PREFILL_GATHERED_MIN_QUERIES", 1)  # this test's 20 queries
    g = torch.Generator().manual_seed(4)
    B, Hq, Hkv, C, R, D, T, l_win = 2, 4, 2, 31, 45, 16, 20, 6
    st = make_state(B, Hkv, C, R, D, T, torch.float32, g, prefill=True, dead=True)
    q = torch.randn(B, Hq, T, D, generator=g)
    s = (torch.rand(B, Hkv, R, generator=g), torch.zeros(B, Hkv, R), torch.zeros(B, Hkv, R))
    both(st, q, s, torch.tensor([[5] * Hkv, [2] * Hkv]), False, l_win)
    assert calls == [1]


@pytest.mark.parametrize("past_only", [True, False], ids=["past_only", "causal"])
def test_decode_steps_rotate(past_only):
    """9 decode steps with l_win = 4 (rotations at steps 4 and 8), each after cache_append and ems_append; rows start
    at different win_count so they rotate at different steps."""
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, C, R, D, steps, l_win = 2, 4, 2, 9, 28, 8, 9, 4
    st = make_state(B, Hkv, C, R, D, 1, torch.float32, g, prefill=False)
    fill, raw_keys, token_pos, slot_order = with_room(st, steps, steps)
    s = [torch.rand(B, Hkv, R + steps, generator=g) for _ in range(3)]
    for x in s:  # the invariant: slots past slot_fill hold 0
        x.masked_fill_(torch.arange(R + steps) >= st.slot_fill[:, :, None], 0.0)
    win_count = torch.tensor([[0, 1], [3, 2]])
    cp = int(st.cache_position[0])
    for step in range(steps):
        cp += 1
        st.cache_position = torch.tensor([cp])
        k, v = torch.randn(2, B, Hkv, 1, D, generator=g)
        valid = torch.ones(B, 1, dtype=torch.bool)
        CACHE_APPEND(st.keys, st.values, st.bias, st.slot_pos, fill, k, v, st.cache_position, valid)
        EMS_APPEND(st.keys, st.bias, fill, k, st.cache_position, valid, st.entry_start, raw_keys, st.lut,
                   st.key_scale, token_pos, slot_order, st.slot_fill)
        q = torch.randn(B, Hq, 1, D, generator=g)
        before = win_count.clone()
        both(st, q, s, win_count, past_only, l_win)
        assert torch.equal(win_count, (before + 1) % l_win)


def test_decode_softcap(monkeypatch):
    monkeypatch.setattr(fk, "libdevice", NumpyLibdevice)
    try:  # the Triton forward's module, once ems_attention's forward is it (module docstring, SWAP)
        from kvrewrite.kernels import _expanded_attention_kernels
        monkeypatch.setattr(_expanded_attention_kernels, "libdevice", NumpyLibdevice)
    except ImportError:
        pass
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, C, R, D = 2, 8, 2, 11, 33, 16
    st = make_state(B, Hkv, C, R, D, 1, torch.float32, g, prefill=False, dead=True)
    q = 6 * torch.randn(B, Hq, 1, D, generator=g)
    s = [torch.zeros(B, Hkv, R) for _ in range(3)]
    both(st, q, s, torch.tensor([[2, 0], [1, 2]]), True, 3, softcap=10.0)
    p = naive_expanded(st, q, D**-0.5, softcap=10.0)[2][:, :, 0].view(B, Hkv, 4, R).sum(dim=2)
    torch.testing.assert_close(s[0].double(), p, **TOL)
