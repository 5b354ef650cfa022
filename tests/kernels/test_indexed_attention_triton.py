"""indexed_attention's Triton kernel (and clustered_attention's combine) on the CPU, through Triton's interpreter,
against reference_indexed_attention.

Runs only under the interpreter:
`TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_indexed_attention_triton.py` (with Triton installed;
skipped otherwise). Tiles of 16 entries and forced split counts put tile and split boundaries inside a few dozen
entries; the GPU test (test_indexed_attention_gpu.py) runs the same kernel compiled at realistic sizes.

Triton 3.6's interpreter multiplies bf16 tl.dot operands as their raw 16-bit patterns (it stores bf16 as uint16
and hands those to numpy.matmul); the fixture below converts them to fp32 first, which is what the GPU's bf16
MMA computes (exact products, fp32 sums). The interpreter has no libdevice either: test_softcap swaps the kernel
module's `libdevice` for numpy's tanh, so it checks the cap's arithmetic around tanh; CUDA's tanhf is the GPU
test's. Nothing else of the interpreter is changed.
"""
import math
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

from kvrewrite.kernels import indexed_attention as ia  # noqa: E402
from tests.kernels.test_indexed_attention import make_inputs  # noqa: E402

# Tolerance: q's dtype -> assert_close(kernel output, reference on the fp32-upcast inputs). Same inputs, so only
# the kernel's rounding remains: fp32 (ieee dots, exp2, another summation order) ~1e-6 on outputs <= ~4; fp16 and
# bf16 round p to the input dtype before p @ v and the output once (2**-11 / 2**-8 relative): 2e-3 and 1.6e-2,
# as tests/kernels/test_clustered_attention_gpu.py. A dropped entry or a wrong head moves outputs by >= 1e-1.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True, scope="module")
def _bf16_dot():
    original = interpreter.InterpreterBuilder.create_dot

    def to_fp32(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, to_fp32(a), to_fp32(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot
    yield
    interpreter.InterpreterBuilder.create_dot = original


class _NumpyLibdevice:
    """libdevice.tanh for the interpreter: numpy's tanh of the block's data."""

    @staticmethod
    def tanh(x):
        return tl.core.tensor(interpreter.TensorHandle(np.tanh(x.handle.data), x.handle.dtype.scalar), x.type)


def check(q, keys, values, bias, index, scale, softcap=0.0, **tuning):
    """The launcher (interpreted) against the reference; returns the kernel's output."""
    out = ia._launch(q, keys, values, bias, index, scale, softcap, **tuning)
    ref = ia.reference_indexed_attention(q.float(), keys.float(), values.float(), bias, index, scale, softcap)
    what = f"{tuple(q.shape)} {q.dtype} index {tuple(index.shape)} softcap {softcap} {tuning}"
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous(), what
    assert torch.isfinite(out).all(), what
    rel = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    tol = dict(TOL[q.dtype], atol=max(TOL[q.dtype]["atol"], 2e-6 * softcap))
    torch.testing.assert_close(out.float(), ref, **tol, msg=f"{what}: max |diff| / max |ref| = {rel:.3g}")
    return out


# (B, Hq, Hkv, T, C, D, S): G = 1, 3, 4, 7; D = 16, 64, 128; S never a multiple of the 16-entry tile
SHAPES = [
    (2, 4, 4, 1, 40, 16, 37),
    (1, 9, 3, 1, 70, 64, 53),
    (1, 8, 2, 1, 50, 128, 45),
    (1, 7, 1, 1, 60, 64, 83),
    (1, 8, 2, 3, 30, 16, 21),
]
# splits: merged by the last split of each tile (fuse_combine: the default per KV head), or by the combine launch;
# combine_rows 1 and 2: the last split merges its tile's rows in several passes
TUNINGS = {"default": {}, "one-split": dict(block_n=16, num_splits=1), "splits": dict(block_n=16, num_splits=3),
           "combine-launch": dict(block_n=16, num_splits=3, fuse_combine=False),
           "rows1": dict(block_n=16, num_splits=3, combine_rows=1, fuse_combine=True),
           "rows2": dict(block_n=16, num_splits=4, combine_rows=2, fuse_combine=True),
           "late-v": dict(block_n=16, num_splits=2, early_v=False)}


def _id(shape):
    return "B{}-Hq{}Hkv{}-T{}-C{}-D{}-S{}".format(*shape)


# (dtype, tuning): fp32 and bf16 split and not (fp32 with the launcher's own choice), fp16 split
RUNS = [("fp32", "default"), ("fp32", "splits"), ("bf16", "splits"), ("bf16", "one-split"), ("fp16", "splits"),
        ("fp32", "combine-launch"), ("fp32", "rows1"), ("bf16", "rows2"), ("fp32", "late-v")]


@pytest.mark.parametrize("kind", ("per_kv", "per_q"))
@pytest.mark.parametrize("dtype,tuning", RUNS, ids=[f"{d}-{t}" for d, t in RUNS])
@pytest.mark.parametrize("shape", SHAPES, ids=[_id(s) for s in SHAPES])
def test_matches_reference(shape, dtype, tuning, kind):
    q, keys, values, bias, index = make_inputs(*shape, DTYPES[dtype], kind, seed=hash((shape, kind)) % 2**31)
    check(q, keys, values, bias, index, shape[5] ** -0.5, **TUNINGS[tuning])


@pytest.mark.parametrize("kind", ("per_kv", "per_q"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_minus_one_tiles_and_splits(dtype, kind):
    """Whole tiles of -1 (loads predicated off), a whole split of -1 (its partial m = -inf, l = 0 weighs 0 in
    the combine), a row of only -1 (zeros, not NaN), -1 and duplicates scattered elsewhere."""
    B, Hq, Hkv, T, C, D, S = 2, 4, 2, 1, 40, 64, 50
    q, keys, values, bias, index = make_inputs(B, Hq, Hkv, T, C, D, S, dtype, kind, seed=1)
    index[0, :, 16:32] = -1  # tile 1 of 16 entries; with 4 splits of 1 tile, split 1 is all -1
    index[1, 0] = -1
    for tuning in ({}, dict(block_n=16, num_splits=4), dict(block_n=16, num_splits=4, fuse_combine=False)):
        out = check(q, keys, values, bias, index, 0.125, **tuning)
        heads = range(Hq // Hkv) if kind == "per_kv" else [0]
        assert all((out[1, hq] == 0).all() for hq in heads)


def test_row_with_only_empty_slots_is_zero():
    """Entries whose slots all have bias -inf: zeros, split or not; other rows unaffected."""
    q, keys, values, bias, index = make_inputs(2, 4, 2, 1, 30, 16, 40, torch.float32, "per_kv", seed=2)
    bias[1, 1, :10] = -math.inf
    index[1, 1] = torch.randint(0, 10, (40,), dtype=torch.int32)
    for tuning in ({}, dict(block_n=16, num_splits=3)):
        out = check(q, keys, values, bias, index, 0.25, **tuning)
        assert (out[1, 2:4] == 0).all() and (out[1, :2] != 0).any()


def test_out_of_range_entries_are_skipped():
    """The kernel cannot raise on an entry outside [0, C) (the reference does): it skips it like -1 and never
    reads outside the cache."""
    q, keys, values, bias, index = make_inputs(1, 8, 2, 1, 30, 16, 40, torch.float32, "per_q", seed=3)
    bad = index.clone()
    bad[..., ::5] = torch.tensor([30, 1000, -2, -(2**31), 2**31 - 1], dtype=torch.int32).repeat(2)[: bad[..., ::5].shape[-1]]
    want = ia._launch(q, keys, values, bias, torch.where((bad < 0) | (bad >= 30), -1, bad), 0.25, block_n=16)
    torch.testing.assert_close(ia._launch(q, keys, values, bias, bad, 0.25, block_n=16), want, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ("per_kv", "per_q"))
@pytest.mark.parametrize("dtype,softcap", [(torch.float32, 5.0), (torch.float32, 50.0), (torch.bfloat16, 30.0)],
                         ids=["fp32-cap5", "fp32-cap50", "bf16-cap30"])
def test_softcap(dtype, softcap, kind, monkeypatch):
    """q ~ N(0, softcap**2): the cap bends most scores; split and not."""
    monkeypatch.setattr(ia, "libdevice", _NumpyLibdevice)
    q, keys, values, bias, index = make_inputs(2, 9, 3, 1, 40, 64, 45, dtype, kind, seed=4, q_std=softcap)
    for tuning in ({}, dict(block_n=16, num_splits=1)):
        check(q, keys, values, bias, index, 0.125, softcap, **tuning)


@pytest.mark.parametrize("kind", ("per_kv", "per_q"))
def test_many_rows_and_strides(kind):
    """T > 1 past one row block (G * T = 28 rows in 16-row blocks; per query head T = 20), q a transposed view,
    keys and values strided views, the index a strided slice."""
    B, Hq, Hkv, C, D = 1, 7, 1, 30, 16
    T = 4 if kind == "per_kv" else 20
    q, keys, values, bias, index = make_inputs(B, Hq, Hkv, T, C, D, 50, torch.float32, kind, seed=5)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    kv = torch.stack([keys, values], dim=3)  # [B, Hkv, C, 2, D]: keys and values interleaved per slot
    check(q, kv[:, :, :, 0], kv[:, :, :, 1], bias, index[..., ::2], 0.25, block_m=16, block_n=16, num_splits=2)


def test_s_zero_gives_zeros():
    q, keys, values, bias, index = make_inputs(1, 4, 2, 1, 10, 16, 3, torch.bfloat16, "per_kv", seed=6)
    out = ia._launch(q, keys, values, bias, index[..., :0], 0.25)
    assert out.shape == q.shape and (out == 0).all()


@pytest.mark.parametrize("B", (1, 2, 8, 16))
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (28, 4), (9, 3)])
@pytest.mark.parametrize("kind", ("per_kv", "per_q"))
@pytest.mark.parametrize("S", (1344, 100, 5000))
def test_decode_launch_config(B, Hq, Hkv, kind, S):
    """The decode split rule on an H100 (132 SMs; pure Python, no launch): the grid stays within two programs per
    SM unless one split per selection row already exceeds that, no split is empty, and the room is used (one
    split more would break the rule, or the tiles run out)."""
    sms, Hsel = 132, (Hkv if kind == "per_kv" else Hq)
    cfg = ia._launch_config(B, Hsel, Hq // Hsel, 1, S, 128, sms)
    n, tiles = cfg["num_splits"], math.ceil(S / cfg["block_n"])
    assert cfg["m_blocks"] == 1 and cfg["block_m"] == 16
    assert B * Hsel * n <= max(2 * sms, B * Hsel), cfg
    assert (n - 1) * cfg["entries_per_split"] < S <= n * cfg["entries_per_split"], cfg
    more = ia._launch_config(B, Hsel, Hq // Hsel, 1, S, 128, sms, num_splits=n + 1)["num_splits"]
    assert B * Hsel * (n + 1) > 2 * sms or more == n or n == tiles, (cfg, more)
    if (B, Hq, Hkv, S) == (1, 32, 8, 1344):  # Llama-3.1-8B, ClusterKV's S: 21 tiles of 64
        assert (n, cfg["entries_per_split"]) == ((11, 128) if kind == "per_kv" else (7, 192)), cfg


def test_counters_are_left_at_zero():
    """The last split of each tile resets its counter (kvrewrite.kernels._semaphores): 0 after every launch, and a
    second launch (other splits, rows and heads) is right too."""
    from kvrewrite.kernels._semaphores import counters

    for kind, tuning in (("per_kv", dict(block_n=16, num_splits=3)),
                         ("per_q", dict(block_n=16, num_splits=2, fuse_combine=True))):
        q, keys, values, bias, index = make_inputs(2, 8, 2, 3, 40, 16, 45, torch.float32, kind, seed=7)
        first = check(q, keys, values, bias, index, 0.25, **tuning)
        assert counters("kvrewrite::indexed_attention", q, 64).eq(0).all()
        torch.testing.assert_close(check(q, keys, values, bias, index, 0.25, **tuning), first, atol=0, rtol=0)
