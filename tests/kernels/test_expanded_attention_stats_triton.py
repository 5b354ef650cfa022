"""expanded_attention_stats' Triton kernel (kvrewrite/kernels/_ems_fold_kernels.py) on the CPU, through Triton's
interpreter, against the op's reference and the dense float64 column sums of tests/kernels/expanded_naive.py.

Runs only under the interpreter:
`TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_expanded_attention_stats_triton.py` (with Triton
installed; skipped otherwise). fp32 only (the 3.6 interpreter's 16-bit tl.dot is wrong). Tiles of 16 slots and 16
queries put block boundaries inside the tiny tables. The interpreter has no libdevice: test_softcap swaps the kernel
module's `libdevice` for numpy's tanh (as test_indexed_attention_triton.py), so it checks the arithmetic around the
cap; CUDA's tanhf is the GPU test's.
"""
import dataclasses
import os

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from kvrewrite.kernels import _ems_fold_kernels as fk  # noqa: E402
from kvrewrite.kernels.expanded_attention import reference_expanded_attention  # noqa: E402
from kvrewrite.kernels.expanded_attention_stats import (reference_expanded_attention_stats,  # noqa: E402
                                                        triton_expanded_attention_stats)
from tests.kernels.expanded_naive import make_state, naive_expanded  # noqa: E402

SMALL = dict(block_j=16, block_m=16)
TOL = dict(atol=2e-5, rtol=1e-5)  # fp32 column sums of <= 40 queries against float64 (test_expanded_attention_stats)


class NumpyLibdevice:
    """libdevice.tanh for the interpreter: numpy's tanh of the block's data."""

    @staticmethod
    def tanh(x):
        return tl.core.tensor(interpreter.TensorHandle(np.tanh(x.handle.data), x.handle.dtype.scalar), x.type)


def state(B, Hq, Hkv, C, R, D, T, prefill, seed, **opts):
    g = torch.Generator().manual_seed(seed)
    st = make_state(B, Hkv, C, R, D, T, torch.float32, g, prefill=prefill, **opts)
    return st, torch.randn(B, Hq, T, D, generator=g)


def check(st, q, last, past_only=False, softcap=0.0, **knobs):
    scale = q.shape[-1] ** -0.5
    _, lse = reference_expanded_attention(*st.attention_args(q), scale, past_only, softcap)
    total, recent = triton_expanded_attention_stats(*st.stats_args(q, lse), scale, last, past_only, softcap, **SMALL,
                                                    **knobs)
    ref_t, ref_r = reference_expanded_attention_stats(*st.stats_args(q, lse), scale, last, past_only, softcap)
    torch.testing.assert_close(total, ref_t, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(recent, ref_r, atol=1e-6, rtol=1e-5)
    p = naive_expanded(st, q, scale, softcap)[2]
    T = q.shape[2]
    torch.testing.assert_close(total.double(), p.sum(dim=2), **TOL)
    torch.testing.assert_close(recent.double(), p[:, :, T - min(last, T):].sum(dim=2), **TOL)
    return total


# (B, Hq, Hkv, C, R, D, T, prefill, options): T = 20 crosses a 16-query block; R up to 45 crosses slot blocks
CASES = {
    "prefill-G2-odd-D": (2, 4, 2, 31, 45, 12, 20, True, {}),
    "prefill-MQA": (1, 3, 1, 27, 40, 16, 17, True, {}),
    "prefill-even-T": (1, 4, 2, 50, 80, 16, 32, True, {}),  # T % 16 == 0: LEAN's unmasked loads (EVEN_T)
    "decode-G4": (2, 8, 2, 11, 33, 16, 1, False, {}),
    "dead-slots": (1, 4, 2, 12, 36, 16, 5, True, {"dead": True}),
    "nothing-visible": (2, 2, 2, 8, 18, 8, 3, True, {"empty_row": True}),
}


OFF = dict(lean=False, pipe=False)  # the TRANS form's step and loop before LEAN and PIPE became the defaults


@pytest.mark.parametrize("knobs", [dict(OFF, trans=False), dict(acc2d=True, trans=False), dict(OFF),
                                   dict(acc2d=True, trans=True), dict(lean=False, pipe=True),
                                   dict(lean=False, pipe=True, trans=False), dict(lean=True, pipe=False),
                                   dict(lean=True, pipe=True, pipe_stages=3), {}],
                         ids=["plain", "acc2d", "trans", "acc2d-trans", "pipe", "pipe-plain", "lean", "lean-pipe-s3",
                              "default"])
@pytest.mark.parametrize("last", [3, 40], ids=["last3", "last-past-T"])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_and_naive(case, last, knobs):
    """Every form of the sums over the queries (_ems_fold_kernels.ACC2D, TRANS, PIPE, LEAN); last = 3 leaves the first
    16-query block without a recent query (ACC2D skips its recent sum)."""
    B, Hq, Hkv, C, R, D, T, prefill, opts = CASES[case]
    st, q = state(B, Hq, Hkv, C, R, D, T, prefill, seed=1, **opts)
    total = check(st, q, last, past_only=not prefill, **knobs)
    if case == "nothing-visible":
        assert (total[0] == 0).all()


@pytest.mark.parametrize("order", ["reversed", "swapped"])
@pytest.mark.parametrize("knobs", [dict(OFF), dict(lean=False, pipe=True), dict(lean=True, pipe=False),
                                   dict(lean=True, pipe=True)], ids=["skip-branch", "pipe", "lean", "lean-pipe"])
def test_unordered_query_positions(order, knobs):
    """The chunk's positions out of order: each tile's skipped query blocks (the branch's, or PIPE's start at the
    first seeing block) hold no query that sees a slot of the tile. swapped puts the chunk's last position in the
    first block and an early one in the last; 48 queries make three 16-query blocks (LEAN: its causal mask goes by
    each block's smallest position)."""
    st, q = state(2, 4, 2, 80, 110, 16, 48, True, seed=5)
    cpos = st.cache_position.clone()
    if order == "reversed":
        cpos = cpos.flip(0)
    else:
        cpos[[3, 47]] = cpos[[47, 3]]
    st = dataclasses.replace(st, cache_position=cpos)
    check(st, q, 7, **knobs)


@pytest.mark.parametrize("knobs, lean_block_m, T, want", [
    ({}, 64, 70, 64), ({}, 64, 20, 32), ({}, 32, 70, 32), (dict(block_m=16), 64, 70, 16),
    (dict(lean=False, pipe=False), 64, 70, 32), (dict(acc2d=True), 64, 70, 32)],
    ids=["lean", "lean-short-chunk", "lean-32", "launch-override", "not-lean", "acc2d"])
def test_lean_block_m(knobs, lean_block_m, T, want, monkeypatch):
    """LEAN_BLOCK_M sets LEAN's query block where the launch gives none (at most next_power_of_2(T)); the other forms
    and an explicit block_m keep theirs; ACC2D asked for runs without LEAN and PIPE (the defaults)."""
    launches = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(k)

    monkeypatch.setattr(fk, "LEAN_BLOCK_M", lean_block_m)
    monkeypatch.setattr(fk, "_stats_kernel", Spy())
    st, q = state(1, 2, 1, T + 40, 3 * T + 120, 16, T, True, seed=6)  # make_state: C <= T + 40
    _, lse = reference_expanded_attention(*st.attention_args(q), 0.25)
    triton_expanded_attention_stats(*st.stats_args(q, lse), 0.25, 3, False, 0.0, **knobs)
    lean = knobs in ({}, dict(block_m=16))
    assert (launches[0]["BLOCK_M"], launches[0]["LEAN"], launches[0]["PIPE"]) == (want, lean, lean)
    assert launches[0]["ACC2D"] == knobs.get("acc2d", False)


@pytest.mark.parametrize("knob", ["pipe", "lean"])
def test_refuses_acc2d(knob):
    st, q = state(1, 2, 1, 12, 20, 16, 5, True, seed=6)
    with pytest.raises(ValueError, match="ACC2D"):
        check(st, q, 3, acc2d=True, **{knob: True})


@pytest.mark.parametrize("knobs", [dict(OFF), {}], ids=["trans", "default"])
def test_softcap(monkeypatch, knobs):
    """The cap (LEAN asked for: the capped blocks keep _block_p's form)."""
    monkeypatch.setattr(fk, "libdevice", NumpyLibdevice)
    st, q = state(1, 4, 2, 28, 45, 16, 18, True, seed=2)
    q = 6 * q
    total = check(st, q, 5, softcap=10.0, **knobs)
    scale = 0.25
    _, lse = reference_expanded_attention(*st.attention_args(q), scale)
    uncapped, _ = reference_expanded_attention_stats(*st.stats_args(q, lse), scale, 5)
    assert (uncapped - total).abs().max() > 1e-2  # the cap is exercised
