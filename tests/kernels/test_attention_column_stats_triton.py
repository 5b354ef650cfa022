"""attention_column_stats' Triton kernels on the CPU, through Triton's interpreter: the recent-only walk
(need_total=False, SnapKV's prefill chunk) against the dense float64 softmax, and the full walk beside it.

Runs only under the interpreter:
`TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_attention_column_stats_triton.py` (with Triton
installed; skipped otherwise). fp32 only (the 3.6 interpreter's 16-bit tl.dot is wrong). T of 130 puts the window's
first query inside the last 64-query block or across two; 16-query tiles (the launch override) move it across more.
D = 16 is a whole tile (block_d 16), so even_d's unmasked columns run; test_odd_head_dim_keeps_the_column_mask
takes D = 24 (block_d 32), where even_d must leave the mask on.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels import attention_column_stats as acs  # noqa: E402
from tests.kernels.test_attention_column_stats import TOL, dense_probs  # noqa: E402
from tests.kernels.test_clustered_attention import make_state  # noqa: E402


@pytest.mark.parametrize("last", [1, 2, 70, 130, 0], ids=lambda v: f"last{v}")
@pytest.mark.parametrize("with_lse", [True, False], ids=["lse", "no-lse"])
@pytest.mark.parametrize("tuning", [None, dict(block_m=16, block_n=32, num_stages=3), dict(even_d=True, sum_once=True),
                                    dict(block_m=16, block_n=32, even_d=True, sum_once=True)],
                         ids=["default", "16x32", "even-d-sum-once", "16x32-even-d-sum-once"])
def test_recent_only_matches_dense_and_full_walk(last, with_lse, tuning):
    B, Hq, Hkv, T, C, D = 1, 4, 2, 130, 90, 16
    g = torch.Generator().manual_seed(last)
    keys, _, bias, slot_pos, cp = make_state(B, Hkv, C, D, T, torch.float32, gen=g)
    q = torch.randn(B, Hq, T, D, generator=g)
    p = dense_probs(q, keys, bias, slot_pos, cp, 0.25, 0)
    lse = acs._visible_logits(q, keys, bias, slot_pos, cp, 0.25, 0).logsumexp(-1) if with_lse else None
    total, recent = acs._launch(q, keys, bias, slot_pos, cp, lse, 0.25, 0, last, need_total=False, tuning=tuning)
    assert total is None
    want = p[:, :, T - last:].sum(dim=2)
    torch.testing.assert_close(recent.double(), want, **TOL)
    full_total, full_recent = acs._launch(q, keys, bias, slot_pos, cp, lse, 0.25, 0, last, tuning=tuning)
    torch.testing.assert_close(full_total.double(), p.sum(dim=2), **TOL)
    torch.testing.assert_close(full_recent, recent, atol=1e-6, rtol=1e-6)


def test_unknown_launch_override_is_named():
    with pytest.raises(ValueError, match="unknown launch overrides \\['block_k'\\]"):
        acs._launch_config(128, 64, dict(block_k=32))


@pytest.mark.parametrize("tuning", [None, dict(even_d=True, sum_once=True)], ids=["default", "even-d-sum-once"])
def test_odd_head_dim_keeps_the_column_mask(tuning):
    """D = 24 in tiles of 32 columns: the 8 past D load as 0 whatever even_d says (keys and q poisoned past D would
    otherwise enter q·k)."""
    B, Hq, Hkv, T, C, D = 2, 4, 2, 40, 50, 24
    g = torch.Generator().manual_seed(24)
    keys, _, bias, slot_pos, cp = make_state(B, Hkv, C, 32, T, torch.float32, gen=g)
    q = torch.randn(B, Hq, T, 32, generator=g)
    keys[..., D:] = float("nan")  # views of D = 24 columns over rows of 32: the 8 after them poisoned
    q[..., D:] = float("nan")
    keys, q = keys[..., :D], q[..., :D]
    p = dense_probs(q, keys, bias, slot_pos, cp, 0.25, 0)
    total, recent = acs._launch(q, keys, bias, slot_pos, cp, None, 0.25, 0, 7, tuning=tuning)
    torch.testing.assert_close(total.double(), p.sum(dim=2), **TOL)
    torch.testing.assert_close(recent.double(), p[:, :, T - 7:].sum(dim=2), **TOL)
