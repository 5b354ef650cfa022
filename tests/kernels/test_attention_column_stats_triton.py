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
                                    dict(block_m=16, block_n=32, even_d=True, sum_once=True),
                                    dict(block_m=16, block_n=32, pipeline=True, num_stages=3)],
                         ids=["default", "16x32", "even-d-sum-once", "16x32-even-d-sum-once", "16x32-pipeline"])
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


@pytest.mark.parametrize("window", [0, 40], ids=["causal", "window40"])
@pytest.mark.parametrize("tuning", [None, dict(block_m=16, block_n=32), dict(block_m=16, block_n=32, pipeline=True)],
                         ids=["default", "16x32", "16x32-pipeline"])
def test_skip_masks_gives_the_masked_walks_sums(window, tuning):
    """skip_masks: blocks whose every row sees every slot of the tile drop the per-element mask; empty slots (bias
    -inf, ~15% of the 80 past ones), rows without an lse (two set to -inf here) and rows past T (70 is no multiple of
    the query block) must still add nothing: the sums equal the masked walk's bit for bit and the dense softmax."""
    B, Hq, Hkv, T, C, D = 2, 4, 2, 70, 150, 16
    g = torch.Generator().manual_seed(window)
    keys, _, bias, slot_pos, cp = make_state(B, Hkv, C, D, T, torch.float32, n_past_max=120, gen=g)
    q = torch.randn(B, Hq, T, D, generator=g)
    p = dense_probs(q, keys, bias, slot_pos, cp, 0.25, window)
    lse = acs._visible_logits(q, keys, bias, slot_pos, cp, 0.25, window).logsumexp(-1)
    lse[0, 1, 3] = lse[1, 2, 66] = float("-inf")
    p[0, 1, 3] = p[1, 2, 66] = 0.0
    sums = {}
    for skip in (True, False):
        sums[skip] = acs._launch(q, keys, bias, slot_pos, cp, lse, 0.25, window, 9,
                                 tuning={**(tuning or {}), "skip_masks": skip})
    for fast, masked in zip(sums[True], sums[False]):
        assert torch.equal(fast, masked)
    branchy = acs._launch(q, keys, bias, slot_pos, cp, lse, 0.25, window, 9,
                          tuning={**(tuning or {}), "pipeline": False})
    for got, want in zip(sums[True], branchy):  # the pipelined walk adds the same blocks in the same order
        assert torch.equal(got, want)
    torch.testing.assert_close(sums[True][0].double(), p.sum(dim=2), **TOL)
    torch.testing.assert_close(sums[True][1].double(), p[:, :, T - 9:].sum(dim=2), **TOL)


def test_total_only_default_is_the_timed_launch():
    """h2o's call (every query, no recent one, lse given) at D = 128 and T >= 128 takes the H200 sweep's fastest
    launch; with recent sums, or short chunks, the untuned tiles stay."""
    timed = acs._launch_config(2048, 128, total_only=True)
    assert (timed["block_m"], timed["block_n"], timed["num_warps"], timed["even_d"], timed["sum_once"]) == (
        128, 64, 4, True, True)
    for cfg in (acs._launch_config(2048, 128), acs._launch_config(64, 128, total_only=True),
                acs._launch_config(2048, 64, total_only=True)):
        assert (cfg["even_d"], cfg["sum_once"]) == (False, False) and cfg["block_m"] <= 64
    assert not timed["pipeline"] and timed["skip_masks"]
    assert acs._launch_config(2048, 128, dict(block_m=64), total_only=True)["block_m"] == 64
