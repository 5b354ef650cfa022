"""clustered_attention's prefill kernels (kernels/_prefill_attention_kernels.py) on the CPU, through Triton's
interpreter: against the naive float64 attention, with slots in any order, windows, ragged T and tiles, and the
tile ranges against their definition.

Runs only under the interpreter:
`TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_prefill_attention_triton.py` (with Triton installed;
skipped otherwise). fp32 only (the 3.6 interpreter's 16-bit tl.dot is wrong) and no soft cap (its libdevice tanh is
a stub): the GPU tests (test_prefill_attention_gpu.py) take the 16-bit inputs and the cap.
"""
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels import _prefill_attention_kernels as pk  # noqa: E402
from kvrewrite.kernels import clustered_attention as ca  # noqa: E402
from tests.kernels.test_clustered_attention import TOL, make_state, naive_attention  # noqa: E402

LOG2E = 1.4426950408889634
# (B, Hq, Hkv, T, C, window): GQA 4, 1, 7 and 2; T ragged against every query tile (rows G * T: 148, 45, 140,
# 32); C ragged against the slot tiles, with slots past the fresh block's (make_state fills C - T past slots)
CASES = [(2, 8, 2, 37, 100, 0), (1, 3, 3, 15, 60, 0), (2, 7, 1, 20, 90, 16), (1, 4, 2, 16, 50, 5)]
TILES = [dict(block_m=16, block_n=16), dict(block_m=32, block_n=64), dict(block_m=64, block_n=32)]


def _case(B, Hq, Hkv, T, C, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys, values, bias, slot_pos, cp = make_state(B, Hkv, C, D, T, torch.float32, gen=g)
    q = torch.randn(B, Hq, T, D, generator=g)
    return q, keys, values, bias, slot_pos, cp, g


def _prefill(q, keys, values, bias, slot_pos, cp, window, lse=None, **tiles):
    D = q.shape[-1]
    return pk.launch_prefill(q, keys, values, bias, slot_pos, cp, window, D**-0.5 * LOG2E, 0.0, 0.0, lse, **tiles)


def _visible_lse(q, keys, bias, slot_pos, cp, window):
    """float64 natural-log log-sum-exp of each query's visible scaled scores plus bias (-inf where it sees none)."""
    G = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(G, dim=1)
    s = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias.double().repeat_interleave(G, dim=1)[:, :, None]
    pos = slot_pos.repeat_interleave(G, dim=1)[:, :, None, :]
    vis = pos <= cp[:, None]
    if window > 0:
        vis = vis & (pos > cp[:, None] - window)
    return s.masked_fill(~vis, -math.inf).logsumexp(-1)


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t['block_m']}x{t['block_n']}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hq{}Hkv{}-T{}-C{}-w{}".format(*c))
def test_matches_naive_in_any_slot_order(case, tiles):
    """The appended layout (past slots, then the fresh block in position order) and the same slots shuffled, where
    the tile ranges no longer bound the loop tightly and most tiles take the masks: both equal the float64
    attention, and the lse its log-sum-exp."""
    B, Hq, Hkv, T, C, window = case
    q, keys, values, bias, slot_pos, cp, g = _case(B, Hq, Hkv, T, C, seed=sum(case))
    want = naive_attention(q, keys, values, bias, slot_pos, cp, q.shape[-1] ** -0.5, window)
    lse = torch.full((B, Hq, T), math.nan)
    out = _prefill(q, keys, values, bias, slot_pos, cp, window, lse, **tiles)
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    torch.testing.assert_close(lse.double(), _visible_lse(q, keys, bias, slot_pos, cp, window), atol=1e-5, rtol=1e-5)
    perm = torch.randperm(C, generator=g)
    shuffled = _prefill(q, keys[:, :, perm], values[:, :, perm], bias[:, :, perm], slot_pos[:, :, perm], cp, window,
                        **tiles)
    torch.testing.assert_close(shuffled.double(), want, **TOL[torch.float32])


@pytest.mark.parametrize("C, block_n", [(100, 32), (96, 32), (20, 32), (100, 16)],
                         ids=["ragged", "whole-tiles", "one-partial-tile", "ragged-16"])
@pytest.mark.parametrize("window", [0, 9])
def test_full_tiles_give_the_same_output_bit_for_bit(C, block_n, window):
    """FULL_TILES (the full slot tiles' loads without a mask, then the partial last tile with one): the output and
    lse of the masked loop, bit for bit, with key scales, a window, slots shuffled (the masks in most tiles), a last
    tile that is partial, none that is, and a row of one partial tile; and the float64 attention."""
    B, Hq, Hkv, T = 2, 8, 2, 11
    q, keys, values, bias, slot_pos, cp, g = _case(B, Hq, Hkv, T, C, seed=C + block_n + window)
    ks = 0.5 + torch.rand(B, Hkv, C, generator=g)
    for order in ("appended", "shuffled"):
        if order == "shuffled":
            perm = torch.randperm(C, generator=g)
            keys, values, bias, slot_pos, ks = (x[:, :, perm] for x in (keys, values, bias, slot_pos, ks))
        outs = []
        for full in (False, True):
            lse = torch.full((B, Hq, T), math.nan)
            D = q.shape[-1]
            out = pk.launch_prefill(q, keys, values, bias, slot_pos, cp, window, D**-0.5 * LOG2E, 0.0, 0.0, lse,
                                    key_scale=ks, full_tiles=full, block_m=16, block_n=block_n)
            outs.append((out, lse))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), order
        want = naive_attention(q, keys * ks[..., None], values, bias, slot_pos, cp, q.shape[-1] ** -0.5, window)
        torch.testing.assert_close(outs[1][0].double(), want, **TOL[torch.float32])


def test_matches_the_slot_loop_kernel():
    """The same launch through launch_forward with and without PREFILL_KERNEL: the two kernels agree to fp32 rounding
    (the same online softmax over tiles of the same size, in the same order)."""
    q, keys, values, bias, slot_pos, cp, _ = _case(2, 8, 2, 37, 100)
    args = (q, keys, values, bias, slot_pos, cp, 0.25, 0)
    new = ca._launch(*args, prefill_kernel=True)
    old = ca._launch(*args, prefill_kernel=False)
    torch.testing.assert_close(new, old, atol=1e-6, rtol=1e-6)


def test_queries_that_see_nothing_give_zeros_and_lse_minus_inf():
    """A block whose queries precede every slot (its loop bounds are empty: lo >= hi) and rows of a block that sees
    only some tiles: zeros, never NaN, and lse -inf."""
    B, Hq, Hkv, T, C, D = 1, 4, 2, 24, 40, 16
    q, keys, values, bias, slot_pos, _, _ = _case(B, Hq, Hkv, T, C)
    slot_pos = slot_pos + 100  # every slot after the first 100 positions
    cp = torch.arange(90, 90 + T)  # queries 0-9 (positions 90-99) see nothing, queries 10- see the early slots
    lse = torch.full((B, Hq, T), math.nan)
    out = _prefill(q, keys, values, bias, slot_pos, cp, 0, lse, block_m=16, block_n=16)
    want = naive_attention(q, keys, values, bias, slot_pos, cp, D**-0.5, 0)
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    want_lse = _visible_lse(q, keys, bias, slot_pos, cp, 0)
    blind = want_lse == -math.inf  # [B, Hq, T]: queries that see no live slot
    assert blind[..., :10].all() and not blind.all()
    assert (out[blind] == 0).all()
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)  # -inf exactly where blind


def test_empty_tiles_inside_the_loop_add_nothing():
    """Whole tiles of empty slots between live ones (a row compressed into two runs): inside the loop's bounds, taken
    as whole (their range is the empty one), they add exact zeros."""
    B, Hq, Hkv, T, C, D = 1, 4, 1, 20, 96, 16
    q, keys, values, bias, slot_pos, cp, _ = _case(B, Hq, Hkv, T, C)
    bias[:, :, 16:48] = -math.inf
    values[:, :, 16:48] = 1e4  # finite (the op's contract), but would show in the output if they were weighed
    out = _prefill(q, keys, values, bias, slot_pos, cp, 0, block_m=16, block_n=16)
    torch.testing.assert_close(out.double(), naive_attention(q, keys, values, bias, slot_pos, cp, D**-0.5, 0),
                               **TOL[torch.float32])


@pytest.mark.parametrize("block_n", [16, 64])
def test_tile_ranges_are_the_live_slots_least_and_greatest_positions(block_n):
    B, Hkv, C = 2, 3, 150
    g = torch.Generator().manual_seed(block_n)
    bias = torch.randn(B, Hkv, C, generator=g)
    bias[torch.rand(B, Hkv, C, generator=g) < 0.3] = -math.inf
    bias[0, 0, :block_n] = -math.inf  # an empty tile
    slot_pos = torch.randint(0, 10**6, (B, Hkv, C), generator=g)
    n_tiles = -(-C // block_n)
    ranges = pk.tile_ranges(bias, slot_pos, n_tiles, block_n, False, {})
    for bh in range(B * Hkv):
        b, h = divmod(bh, Hkv)
        for j in range(n_tiles):
            sl = slice(j * block_n, min((j + 1) * block_n, C))
            live = slot_pos[b, h, sl][bias[b, h, sl] > -math.inf]
            want = (int(live.min()), int(live.max())) if live.numel() else (pk.EMPTY_MIN, pk.EMPTY_MAX)
            assert tuple(ranges[bh, j].tolist()) == want, (bh, j)


def test_launch_forward_routes_prefill_blocks_without_splits(monkeypatch):
    """Prefill-sized blocks (G * T > 16 rows) whose grid needs no split go to the prefill kernels, split grids too
    with PREFILL_SPLIT_GRIDS; decode steps, split grids otherwise and PREFILL_KERNEL = False keep the slot-loop
    kernel."""
    calls = []
    real = pk.launch_prefill
    monkeypatch.setattr(pk, "launch_prefill", lambda *a, **k: calls.append(k) or real(*a, **k))
    q, keys, values, bias, slot_pos, cp, _ = _case(2, 8, 2, 37, 100)  # 2 * 2 * 3 = 12 programs of 64 rows: no split
    args = (q, keys, values, bias, slot_pos, cp, 0.25, 0)
    ca._launch(*args)
    assert len(calls) == 1
    ca._launch(*args, num_splits=2)  # a split grid
    ca._launch(*args, prefill_kernel=False)
    assert len(calls) == 1
    ca._launch(*args, num_splits=2, prefill_split_grids=True)  # the split grid, unsplit in the prefill kernels
    assert len(calls) == 2
    monkeypatch.setattr(ca, "PREFILL_KERNEL", False)
    ca._launch(*args)
    ca._launch(q[:, :, :4], keys, values, bias, slot_pos, cp[:4], 0.25, 0)  # 16 rows: the decode launch
    assert len(calls) == 2
