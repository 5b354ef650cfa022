"""sketch_attention's Triton kernels (the slot loop and its combine) on the CPU through Triton's interpreter, fp32,
against the reference (itself checked against a float64 naive form in test_sketch_attention.py).

Runs only under the interpreter:
`TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_sketch_attention_triton.py` (with Triton installed;
skipped otherwise). 16-slot tiles and forced split counts put tile and split boundaries inside a few dozen slots;
the GPU test (test_sketch_attention_gpu.py) runs the kernels compiled at realistic sizes and in fp16/bf16 too.
"""
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels import sketch_attention as sa  # noqa: E402
from tests.kernels.test_sketch_attention import make_inputs  # noqa: E402

# fp32 ieee dots, exp2 and another summation order against the reference's fp32: ~1e-6 on outputs of size <= ~4
# (as test_clustered_attention_gpu.py's fp32 row); a wrong role mask or a shared shift moves outputs by >= 1e-2
TOL = dict(atol=2e-5, rtol=1e-5)


def check(q, keys, values, bias, slot_pos, cp, role, scale, past_only=False, tol=TOL, **tuning):
    """The launcher (interpreted) against the reference; returns the kernel's output."""
    out = sa._launch(q, keys, values, bias, slot_pos, cp, role, scale, past_only, **tuning)
    ref = sa.reference_sketch_attention(q, keys, values, bias, slot_pos, cp, role, scale, past_only)
    what = f"{tuple(q.shape)} C{keys.shape[2]} past_only {past_only} {tuning}"
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous(), what
    assert torch.isfinite(out).all(), what
    diff = (out - ref).abs().max().item()
    torch.testing.assert_close(out, ref, **tol, msg=f"{what}: max |diff| {diff:.3g}")
    return out


# (B, Hq, Hkv, T, C, D): G = 1, 2, 4; C never a multiple of the 16-slot tile; T = 5 and 9 x 4 heads = 36 rows span
# several 16-row blocks (causal prefill)
SHAPES = [(2, 2, 2, 1, 37, 16), (1, 8, 2, 1, 70, 32), (1, 4, 1, 5, 45, 16), (1, 8, 2, 9, 29, 16)]
TUNINGS = {"default": {}, "one-split": dict(block_n=16, num_splits=1), "splits": dict(block_n=16, num_splits=3),
           "read-all": dict(block_n=16, num_splits=2, skip_unseen=False),
           "skip": dict(block_n=16, num_splits=2, skip_unseen=True), "rows16": dict(block_m=16, block_n=16)}


@pytest.mark.parametrize("tuning", TUNINGS, ids=TUNINGS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=["B{}-Hq{}Hkv{}-T{}-C{}-D{}".format(*s) for s in SHAPES])
def test_matches_reference(shape, tuning):
    B, Hq, Hkv, T, C, D = shape
    q, keys, values, bias, slot_pos, cp, role = make_inputs(B, Hq, Hkv, T, C, D, torch.float32, seed=hash(shape) % 999)
    check(q, keys, values, bias, slot_pos, cp, role, D**-0.5, **TUNINGS[tuning])


@pytest.mark.parametrize("tuning", [{}, dict(block_n=16, num_splits=3)], ids=["default", "splits"])
def test_past_only(tuning):
    """Decode with past_only (slot_pos never read): the same function when the promise holds."""
    q, keys, values, bias, slot_pos, cp, role = make_inputs(2, 8, 2, 1, 53, 16, torch.float32, seed=3)
    out = check(q, keys, values, bias, slot_pos, cp, role, 0.25, past_only=True, **tuning)
    torch.testing.assert_close(out, sa._launch(q, keys, values, bias, slot_pos, cp, role, 0.25, **tuning),
                               atol=0, rtol=0)


def test_large_value_weight_across_splits():
    """Value slots of weight +80 in one split only, denominator slots of weight -20 in others (values scaled by
    e^-60): each split's partial has its own two maxima (one of them -inf), the combine rescales each sum to its own
    overall max; one shared shift would leave the denominator at e^-100 (fp32 denormals)."""
    B, Hkv, C, D = 1, 1, 48, 16
    g = torch.Generator().manual_seed(4)
    keys, values = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    role = torch.ones(B, Hkv, C, dtype=torch.int8)
    role[..., 16:32] = 2  # split 1 (of 3 splits of 16 slots): value slots only
    bias = torch.where(role == 2, 80.0, -20.0)
    values = torch.where((role == 2)[..., None], values * math.exp(-60), values)
    slot_pos, cp = torch.zeros(B, Hkv, C, dtype=torch.int64), torch.tensor([3])
    q = torch.randn(B, 4, 1, D, generator=g)
    ref = sa.reference_sketch_attention(q, keys, values, bias, slot_pos, cp, role, 0.25)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e10
    for tuning in ({}, dict(block_n=16, num_splits=3), dict(block_n=16, num_splits=1)):
        out = sa._launch(q, keys, values, bias, slot_pos, cp, role, 0.25, **tuning)
        # fp32 scores near +-100 (base 2: +-144) carry a few ulp(128) = 1.5e-5 each: 1e-4 of each output row's
        # largest element (elementwise relative errors are larger where an element cancels towards 0)
        err = ((out - ref).abs() / ref.abs().amax(-1, keepdim=True)).max().item()
        assert err < 1e-4, f"{tuning}: max |diff| / row max {err:.3g}"


def test_nothing_visible_is_zero():
    """Heads with every slot empty, only value slots (no denominator), only future slots: 0, split or not; a split
    that sees nothing at all (its slots empty) weighs 0 in the combine."""
    q, keys, values, bias, slot_pos, cp, role = make_inputs(1, 8, 4, 1, 48, 16, torch.float32, seed=5)
    bias[0, 0] = -math.inf
    role[0, 1], bias[0, 1] = 2, 0.0
    slot_pos[0, 2] = cp[0] + 1
    bias[0, 3, 16:32] = -math.inf
    for tuning in ({}, dict(block_n=16, num_splits=3)):
        out = check(q, keys, values, bias, slot_pos, cp, role, 0.25, **tuning)
        assert (out[0, :6] == 0).all() and (out[0, 6:] != 0).any()


def test_every_role_zero_is_clustered_attention():
    from kvrewrite.kernels import clustered_attention as ca

    q, keys, values, bias, slot_pos, cp, role = make_inputs(2, 8, 2, 3, 40, 16, torch.float32, seed=6)
    out = sa._launch(q, keys, values, bias, slot_pos, cp, role.zero_(), 0.25, block_n=16, num_splits=2)
    torch.testing.assert_close(out, ca._launch(q, keys, values, bias, slot_pos, cp, 0.25, 0, block_n=16, num_splits=2),
                               atol=2e-6, rtol=1e-5)


# -- the prefill kernel (_sketch_prefill_kernels.py: PREFILL_KERNEL's path for G * T > 16 rows) ---------------------
# (B, Hq, Hkv, T, C, D): G = 4, 1, 2; C ragged against the 16-slot tiles, and a multiple of them; the fresh causal
# block of T spans several 16-row query blocks
PREFILL_SHAPES = [(2, 8, 2, 20, 70, 16), (1, 4, 4, 33, 50, 32), (1, 4, 2, 12, 64, 16)]


@pytest.mark.parametrize("full_tiles", [True, False], ids=["full_tiles", "masked"])
@pytest.mark.parametrize("order", ["appended", "shuffled"])
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=["B{}-Hq{}Hkv{}-T{}-C{}-D{}".format(*s) for s in PREFILL_SHAPES])
def test_prefill_kernel_matches_reference(shape, order, full_tiles):
    """The prefill kernel against the reference: slots appended (the ranges skip the tiles after a block's last
    query and mask only the diagonal) and shuffled (the masks in most tiles); a full last tile and a partial one;
    the same output with and without FULL_TILES."""
    B, Hq, Hkv, T, C, D = shape
    q, keys, values, bias, slot_pos, cp, role = make_inputs(B, Hq, Hkv, T, C, D, torch.float32, seed=C + T)
    if order == "shuffled":
        perm = torch.randperm(C, generator=torch.Generator().manual_seed(1))
        keys, values, bias, slot_pos, role = (x[:, :, perm] for x in (keys, values, bias, slot_pos, role))
    tiles = dict(block_m=16, block_n=16)
    out = check(q, keys, values, bias, slot_pos, cp, role, D**-0.5, prefill_kernel=True, full_tiles=full_tiles,
                **tiles)
    other = sa._launch(q, keys, values, bias, slot_pos, cp, role, D**-0.5, prefill_kernel=True,
                       full_tiles=not full_tiles, **tiles)
    assert torch.equal(out, other)


def test_prefill_kernel_is_taken_for_prefill_rows(monkeypatch):
    """_launch's routing: G * T > 16 rows with prefill_kernel (PREFILL_KERNEL by default) take the prefill kernel,
    otherwise the decode kernel; full_tiles on a decode launch is refused with the reason."""
    from kvrewrite.kernels import _sketch_prefill_kernels as sp

    calls = []
    real = sp.launch_sketch_prefill
    monkeypatch.setattr(sp, "launch_sketch_prefill", lambda *a, **k: calls.append(k) or real(*a, **k))
    q, keys, values, bias, slot_pos, cp, role = make_inputs(1, 4, 1, 5, 45, 16, torch.float32, seed=8)  # 20 rows
    check(q, keys, values, bias, slot_pos, cp, role, 0.25, prefill_kernel=True, block_n=16)
    assert calls == [dict(block_n=16)]
    check(q, keys, values, bias, slot_pos, cp, role, 0.25, prefill_kernel=False, block_n=16)
    monkeypatch.setattr(sa, "PREFILL_KERNEL", True)
    check(q, keys, values, bias, slot_pos, cp, role, 0.25)
    assert len(calls) == 2
    q1 = q[:, :, :4]  # 16 rows: the decode launch
    check(q1, keys, values, bias, slot_pos, cp[:4], role, 0.25)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="full_tiles tunes the prefill kernel"):
        sa._launch(q1, keys, values, bias, slot_pos, cp[:4], role, 0.25, full_tiles=True)


def test_prefill_kernel_large_value_weight_and_nothing_visible():
    """Value slots of weight +80 over denominator slots of weight -20 (values scaled by e^-60): the two running
    maxima keep the denominator off fp32's denormals; heads with every slot empty, with only value slots (no
    denominator) and with every slot after the queries give 0."""
    B, Hq, Hkv, T, C, D = 1, 8, 4, 12, 48, 16  # 24 rows a KV head: the prefill launch
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, Hq, T, D, generator=g)
    keys, values = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    role = torch.ones(B, Hkv, C, dtype=torch.int8)
    role[..., 16:32] = 2
    bias = torch.where(role == 2, 80.0, -20.0)
    values = torch.where((role == 2)[..., None], values * math.exp(-60), values)
    slot_pos, cp = torch.zeros(B, Hkv, C, dtype=torch.int64), torch.arange(10, 10 + T)
    bias[0, 1] = -math.inf  # head 1: nothing
    role[0, 2], bias[0, 2] = 2, 0.0  # head 2: value slots only
    slot_pos[0, 3] = 100  # head 3: every slot after every query
    ref = sa.reference_sketch_attention(q, keys, values, bias, slot_pos, cp, role, 0.25)
    assert torch.isfinite(ref).all() and ref[0, :2].abs().max() > 1e10
    for full_tiles in (True, False):
        out = sa._launch(q, keys, values, bias, slot_pos, cp, role, 0.25, prefill_kernel=True, full_tiles=full_tiles,
                         block_m=16, block_n=16)
        assert (out[0, 2:] == 0).all() and (ref[0, 2:] == 0).all()
        err = ((out - ref).abs() / ref.abs().amax(-1, keepdim=True).clamp_min(1e-30)).max().item()
        assert err < 1e-4, f"full_tiles {full_tiles}: max |diff| / row max {err:.3g}"


def test_prefill_kernel_every_role_zero_is_clustered_attention():
    """Every slot exact (role 0): clustered_attention's prefill kernel, within the epilogue's rounding (a product
    by 2^0 / l against a division by l)."""
    from kvrewrite.kernels import _prefill_attention_kernels as pk

    q, keys, values, bias, slot_pos, cp, role = make_inputs(2, 8, 2, 20, 70, 16, torch.float32, seed=6)
    out = sa._launch(q, keys, values, bias, slot_pos, cp, role.zero_(), 0.25, prefill_kernel=True, block_m=16,
                     block_n=16)
    want = pk.launch_prefill(q, keys, values, bias, slot_pos, cp, 0, 0.25 * 1.4426950408889634, 0.0, 0.0, None,
                             block_m=16, block_n=16)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_attention_prefill_bench_sketch_rows(monkeypatch):
    """bench.attention_prefill --sketch's rows (interpreted, one call each instead of the timing): the decode
    kernel and the prefill kernel with and without FULL_TILES, then the prefill kernel over ClusterGen's layout, each
    within the bench's bound of the reference (fp32 inputs: the interpreter's bf16 is not the GPU's)."""
    from kvrewrite.bench import attention_prefill as ap

    monkeypatch.setattr(ap, "_bench_ms", lambda f: f() is not None and 1.0)
    args = [x.float() if x.is_floating_point() else x for x in ap.make_inputs(20, 40, 70, 100, device="cpu")]
    rows = ap.sketch_rows(args, 40, ap.D**-0.5, 1e9)
    assert [r["tuning"].get("full_tiles") for r in rows] == [None, True, False, None]
    assert [r["layout"] for r in rows] == ["drawn"] * 3 + ["clustergen"]
    assert all(r["err"] < ap.MAX_ERR_BF16 and r["ms"] == 1.0 for r in rows), rows
