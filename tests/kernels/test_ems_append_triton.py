"""ems_append's Triton kernel on the CPU, through Triton's interpreter, against the reference and the spec's
per-token loop (tests/kernels/test_ems_append.py's `expected_after`).

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_ems_append_triton.py`
(with Triton installed; skipped otherwise). fp32 only: the 3.6 interpreter truncates fp32 -> bf16 where the GPU
rounds to nearest even (the 16-bit dtypes' rounding is checked on the GPU, test_ems_append_gpu.py).
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels._ems_rank_kernels import triton_ems_append  # noqa: E402
from kvrewrite.kernels.cache_append import reference_cache_append  # noqa: E402
from kvrewrite.kernels.ems_append import reference_ems_append  # noqa: E402
from tests.kernels.test_ems_append import TABLE, expected_after, make_state  # noqa: E402


def grow(s, T, valid):
    """cache_append of T tokens (the fill and bias ems_append then reads)."""
    B, H, _, D = s["keys"].shape
    reference_cache_append(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"],
                           torch.randn(B, H, T, D).to(s["keys"].dtype), torch.randn(B, H, T, D).to(s["keys"].dtype),
                           torch.arange(20, 20 + T), valid)


@pytest.mark.parametrize("pos", ["without", "with"])
def test_prefill_then_decode_matches_the_loop_and_reference(pos):
    s = make_state(C=40, R=50, pos=pos)
    B, H, _, D = s["keys"].shape
    steps = [(torch.arange(5, 14), torch.tensor([[True] * 9, [False] * 3 + [True] * 6])),  # padding in row 1
             (torch.tensor([14]), torch.ones(B, 1, dtype=torch.bool)),
             (torch.tensor([15]), torch.ones(B, 1, dtype=torch.bool))]
    for cp, valid in steps:
        T = cp.numel()
        k_pre = torch.randn(B, T, H, D).transpose(1, 2)  # a non-contiguous [B, H, T, D] view, as the graph's
        want = expected_after(s, k_pre, cp)
        grow(s, T, valid)
        ref = {n: s[n].clone() for n in TABLE}
        reference_ems_append(s["fill"], k_pre, cp, *(ref[n] for n in TABLE))
        triton_ems_append(s["fill"], k_pre, cp, *(s[n] for n in TABLE))
        for n in TABLE:
            assert torch.equal(s[n], want[n]), n
            assert torch.equal(s[n], ref[n]), n


def test_past_capacity_the_stores_are_masked():
    s = make_state(R=6)  # row 0 holds 5 slots: of 2 more only 1 fits
    before = {n: s[n].clone() for n in TABLE}
    k_pre = torch.randn(2, 3, 2, 8)
    want = expected_after(make_state(R=8), k_pre, torch.tensor([7, 8]))  # the same state with room: the loop
    grow(s, 2, torch.ones(2, 2, dtype=torch.bool))
    triton_ems_append(s["fill"], k_pre, torch.tensor([7, 8]), *(s[n] for n in TABLE))
    assert (s["slot_fill"][0] == 6).all() and (s["slot_fill"][1] == 3).all()  # min(slot_fill + T, R)
    for n in ("lut", "key_scale", "token_pos", "slot_order"):
        assert torch.equal(s[n][0, :, :6], want[n][0, :, :6]) and torch.equal(s[n][1], want[n][1, :, :6]), n
    assert torch.equal(s["entry_start"], want["entry_start"])  # the entries exist: both get their (slot) index
    assert torch.equal(s["raw_keys"], want["raw_keys"]) and not torch.equal(s["raw_keys"], before["raw_keys"])
