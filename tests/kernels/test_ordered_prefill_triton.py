"""The ordered prefill kernel (kernels/_ordered_prefill_kernels.py) and its routing, on the CPU through Triton's
interpreter: rows whose live slots hold their positions in order, slot j position j + delta (a `full` or ClusterKV row:
left padding, the past, the chunk's fresh block, empty slots after the fill; delta < 0 where padding rounds the prompt
up to whole chunks) against the float64 attention and the general prefill kernel; a row with one slot out of order
routed to the general kernel; the tile ranges' order statistics; TMA descriptors (forced: the interpreter reads them)
against pointer loads, bit for bit.

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_ordered_prefill_triton.py`.
fp32 only (the 3.6 interpreter's 16-bit tl.dot is wrong): the 16-bit inputs, the TMA hardware path and the timing are
tests/kernels/test_ordered_prefill_gpu.py's.
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
from tests.kernels.ordered_state import ordered_state  # noqa: E402
from tests.kernels.test_clustered_attention import TOL, naive_attention  # noqa: E402
from tests.kernels.test_prefill_attention_triton import _prefill, _visible_lse  # noqa: E402

LOG2E = 1.4426950408889634
TILES = dict(block_m=16, block_n=16, tma=False)  # small tiles: several whole and diagonal tiles per row


# (B, Hq, Hkv, T, n_prev, C, pads, delta): GQA 4, 1, 3, 2; T ragged against the 16-query blocks; C ragged against the
# 16-slot tiles and past the fill; left padding longer than a tile; a chunk at the very start (n_prev 0); one that ends
# at C; positions that start before 0 (the chunk padding: delta -5, -21) and after it (delta 7)
CASES = [(2, 8, 2, 37, 40, 100, (0, 21), -21), (1, 3, 3, 15, 0, 20, (0,), 0), (2, 6, 2, 20, 33, 64, (5, 0), -5),
         (1, 4, 2, 16, 48, 64, (0,), 7)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hq{}Hkv{}-T{}-prev{}-C{}-pads{}-delta{}".format(*c))
def test_ordered_rows_match_naive_and_the_general_kernel(case):
    B, Hq, Hkv, T, n_prev, C, pads, delta = case
    args = ordered_state(B, Hq, Hkv, T, n_prev, C, pads=pads, seed=sum(case[:6]), delta=delta)
    want = naive_attention(*args, args[0].shape[-1] ** -0.5, 0)
    lse = torch.full((B, Hq, T), math.nan)
    got = _prefill(*args, 0, lse, ordered=TILES)
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    torch.testing.assert_close(lse.double(), _visible_lse(*args[:2], *args[3:], 0), atol=1e-5,
                               rtol=1e-5)
    general = _prefill(*args, 0, ordered=False)
    torch.testing.assert_close(got, general, atol=2e-6, rtol=1e-5)
    # every row is ordered, so the ordered kernel alone wrote the output: into NaN, with no general kernel
    order = pk.order_stats(B, Hkv, "cpu")
    pk.tile_ranges(args[3], args[4], math.ceil(C / 16), 16, False, {}, order)
    assert (order[:, 0] == delta).all() and (order.sum(1) == 0).all()
    alone = torch.full_like(got, math.nan)
    pk._ordered.launch_ordered(*args[:4], args[5], order, alone, None, args[0].shape[-1] ** -0.5 * LOG2E, False, {},
                               **TILES)
    assert torch.equal(alone, got)


def test_queries_that_see_only_padding_give_zeros_and_lse_minus_inf():
    """A chunk whose first queries are left padding (every slot up to them -inf): 0 and lse -inf there, as the
    general kernel's."""
    args = ordered_state(1, 4, 2, 24, 0, 40, pads=(10,), seed=3)
    lse = torch.full((1, 4, 24), math.nan)
    got = _prefill(*args, 0, lse, ordered=TILES)
    assert (got[:, :, :10] == 0).all() and (lse[:, :, :10] == -math.inf).all()
    torch.testing.assert_close(got.double(), naive_attention(*args, 0.25, 0), **TOL[torch.float32])


def test_a_row_with_a_slot_out_of_order_goes_to_the_general_kernel():
    """Row 1's slots 3 and 30 swapped (their positions with them): its causal mask by slot index would be wrong, so the
    tile ranges count it and the general kernel takes it; row 0 stays ordered. Both equal the float64 attention."""
    q, keys, values, bias, slot_pos, cp = ordered_state(2, 8, 2, 20, 30, 64, seed=4)
    perm = torch.arange(64)
    perm[3], perm[30] = 30, 3
    for x in (keys, values, bias, slot_pos):
        x[1] = x[1][:, perm]
    args = (q, keys, values, bias, slot_pos, cp)
    order = pk.order_stats(2, 2, "cpu")
    pk.tile_ranges(bias, slot_pos, 4, 16, False, {}, order)
    assert order.sum(1).tolist() == [0, 0, -54, -54]  # row 1: min(position - index) - max(it) = -27 - 27
    torch.testing.assert_close(_prefill(*args, 0, ordered=TILES).double(), naive_attention(*args, 0.25, 0),
                               **TOL[torch.float32])


def test_tile_ranges_order_statistics_read_only_live_slots():
    """The minima of position - index and index - position run over the live slots (bias > -inf): stale positions of
    padding and empty slots do not count; five live slots moved by 100 make their row's sum -100 (min - max of
    position - index); a row without a live slot sums to 2**62 (the general kernel's too)."""
    q, keys, values, bias, slot_pos, cp = ordered_state(3, 4, 2, 10, 20, 48, pads=(4, 0, 0), seed=5, delta=-3)
    slot_pos[0, :, :4] = 999  # padding: dead
    slot_pos[..., 30:] = 7  # past the fill: dead
    slot_pos[1, 1, 5:10] += 100  # five live slots out of order
    bias[2, 0] = -math.inf  # a row with nothing live
    order = pk.order_stats(3, 2, "cpu")
    pk.tile_ranges(bias, slot_pos, 3, 16, False, {}, order)
    assert order[:, 0].tolist()[:4] == [-3, -3, -3, -3] and order.sum(1).tolist() == [0, 0, 0, -100, 2**62, 0]


def test_tma_descriptors_give_the_pointer_loads_output_bit_for_bit():
    """The keys and values through tensor descriptors over the [B * Hkv, C, D] view (forced on CPU tensors: the
    interpreter reads them like the hardware's bounds-checked copy) against pointer loads, through the op and the
    kernel alone. The chunk ends at C (100 slots, 16-slot tiles), so the row's last tile passes C: a descriptor's tile
    there reads zeros, not the next row's first slots, which hold inf here (that row left to the general kernel): 0 *
    inf would be NaN."""
    args = ordered_state(2, 8, 2, 37, 63, 100, pads=(0, 21), seed=6)
    outs = [_prefill(*args, 0, ordered=dict(TILES, tma=tma)) for tma in (False, True)]
    assert torch.equal(outs[0], outs[1])
    q, keys, values, bias, slot_pos, cp = args
    values = values.clone()
    values[0, 1, :16] = math.inf
    order = pk.order_stats(2, 2, "cpu")
    pk.tile_ranges(bias, slot_pos, math.ceil(100 / 16), 16, False, {}, order)
    order[1] = torch.tensor([0, 5])  # row (0, 1): out of order, so the ordered kernel leaves it
    alone = []
    for tma in (False, True):
        out = torch.full_like(outs[0], math.nan)  # contiguous, as launch_prefill allocates it
        pk._ordered.launch_ordered(q, keys, values, bias, cp, order, out, None, q.shape[-1] ** -0.5 * LOG2E, False, {},
                                   **dict(TILES, tma=tma))
        alone.append(out)
    G = 8 // 2
    assert alone[0][0, :G].isfinite().all() and torch.equal(alone[0][0, :G], alone[1][0, :G])
    assert alone[1][0, G:].isnan().all()  # row (0, 1) not written


def test_routing_needs_no_window_cap_or_key_scale_and_contiguous_state():
    """A window, a key scale or strided keys keep the general kernel (the ordered kernel has none of them): the same
    output with ordered on and off."""
    args = list(ordered_state(1, 4, 2, 20, 30, 64, seed=7))
    for kw in (dict(window=9), dict(key_scale=0.5 + torch.rand(1, 2, 64))):
        window = kw.pop("window", 0)
        outs = [_prefill(*args, window, ordered=o, **kw) for o in (TILES, False)]
        assert torch.equal(outs[0], outs[1])
    strided = torch.randn(1, 2, 64, 32)[..., :16]
    assert not pk._ordered.routable(strided, strided, 0, 0.0, None)
    assert pk._ordered.routable(args[1], args[2], 0, 0.0, None)
    assert not pk._ordered.routable(args[1], args[2], 0, 30.0, None)
