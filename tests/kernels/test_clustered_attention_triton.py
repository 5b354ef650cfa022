"""clustered_attention's decode splits on the CPU, through Triton's interpreter: the balanced split boundaries
(_launch_config's `balance`, the kernel's BALANCE) against the reference and against whole-tile splits.

Runs only under the interpreter:
`TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_clustered_attention_triton.py` (with Triton installed;
skipped otherwise). fp32 and fp16 (the 3.6 interpreter's bf16 dot: test_indexed_attention_triton.py); the GPU
test (test_clustered_attention_gpu.py) runs the compiled kernel at realistic sizes.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels import clustered_attention as ca  # noqa: E402
from tests.kernels.test_clustered_attention import make_state  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _inputs(B, Hq, Hkv, C, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    keys, values, bias, slot_pos, cpos = make_state(B, Hkv, C, D, 1, dtype, gen=g)
    return torch.randn(B, Hq, 1, D, generator=g).to(dtype), keys, values, bias, slot_pos, cpos


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("B, Hq, Hkv, C, window, past_only, balance, num_splits", [
    (1, 4, 1, 333, 0, True, 16, 7),   # 333 / 7 = 47.6 slots: boundaries inside 32-slot tiles
    (2, 8, 2, 200, 16, False, 16, 5),  # a window and causal positions
    (1, 6, 2, 129, 0, False, 8, 4),   # the last split ends at C, past a BALANCE boundary
    (1, 4, 1, 100, 0, True, 16, None),  # the launch's own count: C // BLOCK_N = 3 at most
])
def test_balanced_splits_match_the_reference_and_whole_tiles(B, Hq, Hkv, C, window, past_only, balance, num_splits,
                                                             dtype):
    q, keys, values, bias, slot_pos, cpos = _inputs(B, Hq, Hkv, C, 32, dtype, seed=C + B)
    scale = 32**-0.5
    tuning = dict(block_n=32) if num_splits is None else dict(block_n=32, num_splits=num_splits)
    cfg = ca._launch_config(B, Hkv, Hq // Hkv, 1, C, 32, 8, q.element_size(), balance=balance, **tuning)
    assert cfg["balance"] == balance and cfg["num_splits"] == (num_splits or C // 32)
    balanced = ca._launch(q, keys, values, bias, slot_pos, cpos, scale, window, past_only, balance=balance, **tuning)
    tiles = ca._launch(q, keys, values, bias, slot_pos, cpos, scale, window, past_only, balance=0, **tuning)
    ref = ca.reference_clustered_attention(q.float(), keys.float(), values.float(), bias, slot_pos, cpos, scale,
                                           window, past_only)
    torch.testing.assert_close(balanced.float(), ref, **TOL[dtype])
    torch.testing.assert_close(tiles.float(), ref, **TOL[dtype])


def test_balance_is_for_decode_and_counts_splits_per_sm():
    """Balanced splits take the two-programs-per-SM count where whole tiles round it down (8 KV heads, 132 SMs, 6.6k
    slots: 33 against 26), never more than one tile's worth of slots per split, and leave prefill tiles alone."""
    base = dict(B=1, Hkv=8, G=4, C=6656, D=128, num_sms=132)
    assert ca._launch_config(**base, T=1)["num_splits"] == 26
    assert ca._launch_config(**base, T=1, balance=16)["num_splits"] == 33
    assert ca._launch_config(**dict(base, C=1000), T=1, balance=16)["num_splits"] == 1000 // 128
    prefill = ca._launch_config(**base, T=64, balance=16)
    assert prefill["balance"] == 0 and prefill == ca._launch_config(**base, T=64)
