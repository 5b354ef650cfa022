"""clustered_attention's prefill kernels (kernels/_prefill_attention_kernels.py) on CUDA against the reference.

Fresh random inputs (make_state: past slots with random degrees and ~15% empty, then the causal fresh block),
outputs in memory filled with NaN first (an element the kernel forgets to write fails), every dtype, head dims
64-256, GQA 1-8, windows, the soft cap, slots in any order, each launch override the sweep takes, and the op's
routing of a prefill chunk to these kernels. On a GPU machine:
`python -m pytest -m gpu -q tests/kernels/test_prefill_attention_gpu.py`.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import _prefill_attention_kernels as pk
from kvrewrite.kernels import clustered_attention as ca
from tests.kernels.poisoned import poisoned as _poisoned
from tests.kernels.test_clustered_attention_gpu import DTYPES, _check, _inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(ca.triton is None, reason="needs Triton"),
]
LOG2E = 1.4426950408889634

# (B, Hq, Hkv, T, C, window): GQA 4, 3, 7, 1, 8; T and C ragged against every tile; a window that cuts the past
SHAPES = [(2, 32, 8, 300, 1500, 0), (1, 9, 3, 257, 4097, 0), (3, 14, 2, 100, 1000, 16), (1, 8, 8, 129, 700, 64),
          (2, 16, 2, 65, 333, 0)]


def _id(s):
    return "B{}-Hq{}Hkv{}-T{}-C{}-w{}".format(*s)


def _prefill(q, keys, values, bias, slot_pos, cp, window, softcap=0.0, lse=None, **tuning):
    scale = q.shape[-1] ** -0.5
    qk_scale, cap_log2 = (scale / softcap, softcap * LOG2E) if softcap else (scale * LOG2E, 0.0)
    return pk.launch_prefill(q, keys, values, bias, slot_pos, cp, window, qk_scale, cap_log2, softcap, lse, **tuning)


def _compare(shape, D, dtype, seed, softcap=0.0, shuffle=False, **tuning):
    B, Hq, Hkv, T, C, window = shape
    q, keys, values, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, D, dtype, seed, q_std=softcap or 1.0)
    if shuffle:
        perm = torch.randperm(C, device="cuda")
        keys, values, bias, slot_pos = (x[:, :, perm] for x in (keys, values, bias, slot_pos))
    ref = ca.reference_clustered_attention(q.float(), keys.float(), values.float(), bias, slot_pos, cp, D**-0.5,
                                           window, False, softcap)
    nbytes = B * Hq * T * D * q.element_size()
    out = _poisoned(lambda: _prefill(q, keys, values, bias, slot_pos, cp, window, softcap, **tuning), nbytes)
    _check(out, ref, dtype, f"{_id(shape)} D{D} {dtype} softcap {softcap} shuffle {shuffle} {tuning}", softcap)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("D", (64, 128, 256), ids=lambda d: f"D{d}")
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_matches_reference(shape, D, dtype):
    _compare(shape, D, dtype, seed=hash((shape, D)) % 2**31)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=_id)
def test_slots_in_any_order(shape):
    """Shuffled slots: the tile ranges then bound little and most tiles take the masks; the output is the same."""
    _compare(shape, 128, torch.bfloat16, seed=7, shuffle=True)


@pytest.mark.parametrize("tuning", [dict(block_m=128, num_warps=8), dict(block_m=128, block_n=128, num_warps=8),
                                    dict(block_n=32, num_stages=3), dict(block_n=128), dict(num_stages=3),
                                    dict(block_m=128, num_warps=8, num_stages=3), dict(block_m=64, num_warps=8)],
                         ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_launch_variants_agree(tuning, dtype):
    _compare(SHAPES[0], 128, dtype, seed=11, **tuning)
    _compare(SHAPES[2], 128, dtype, seed=12, **tuning)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES + [(1, 8, 2, 70, 1024, 0)], ids=_id)
def test_full_tiles_match_the_masked_loop(shape, dtype):
    """FULL_TILES (the full slot tiles' loads without a mask) against the masked loop, with key scales, at C ragged
    against the tiles and at C a multiple of them, slots in order and shuffled: fp32 bit for bit; fp16/bf16 within
    one rounding of a probability times the largest value (sm_90 orders the unmasked tile's score arithmetic
    otherwise, and a probability rounded to 16 bits for p @ v may flip: stop 57 measured at most 0.002 bf16, 0.0005
    fp16, lse 1e-6) and as close to the reference."""
    B, Hq, Hkv, T, C, window = shape
    q, keys, values, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, 128, dtype, 5, q_std=1.0)
    ks = 0.5 + torch.rand(B, Hkv, C, device="cuda")
    for shuffle in (False, True):
        if shuffle:
            perm = torch.randperm(C, device="cuda")
            keys, values, bias, slot_pos, ks = (x[:, :, perm] for x in (keys, values, bias, slot_pos, ks))
        outs = []
        for full in (False, True):
            lse = torch.full((B, Hq, T), math.nan, device="cuda")
            outs.append((_prefill(q, keys, values, bias, slot_pos, cp, window, 0.0, lse, key_scale=ks,
                                  full_tiles=full), lse))
        (masked, lse_masked), (full, lse_full) = outs
        if dtype == torch.float32:
            assert torch.equal(masked, full) and torch.equal(lse_masked, lse_full), (shape, shuffle)
        else:
            bound = torch.finfo(dtype).eps * values.float().abs().max().item()
            assert (full.float() - masked.float()).abs().max().item() <= bound, (shape, shuffle)
            torch.testing.assert_close(lse_full, lse_masked, rtol=1e-6, atol=1e-6)
        ref = ca.reference_clustered_attention(q.float(), keys.float() * ks[..., None], values.float(), bias,
                                               slot_pos, cp, 128**-0.5, window, False, 0.0)
        _check(full, ref, dtype, f"{_id(shape)} {dtype} full tiles shuffle {shuffle}", 0.0)
        err_masked, err_full = ((x.float() - ref).abs().max().item() for x in (masked, full))
        assert err_full <= err_masked + torch.finfo(dtype).eps * ref.abs().max().item(), (err_full, err_masked)


@pytest.mark.parametrize("softcap", [5.0, 50.0], ids=lambda c: f"cap{c:g}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_softcap_matches_reference(dtype, softcap):
    _compare(SHAPES[1], 128, dtype, seed=3, softcap=softcap)
    _compare(SHAPES[2], 64, dtype, seed=4, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_lse_and_queries_that_see_nothing(dtype):
    """lse is each query's natural-log log-sum-exp of its visible scores; a query before every slot gets zeros and
    lse -inf (its tile loop is empty), never NaN."""
    B, Hq, Hkv, T, C, D = 2, 16, 4, 200, 900, 128
    q, keys, values, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, D, dtype, seed=5)
    slot_pos = slot_pos + int(cp[40])  # queries 0-39 precede every slot
    lse = torch.full((B, Hq, T), math.nan, device="cuda")
    out = _prefill(q, keys, values, bias, slot_pos, cp, 0, lse=lse)
    ref = ca.reference_clustered_attention(q.float(), keys.float(), values.float(), bias, slot_pos, cp, D**-0.5, 0)
    _check(out, ref, dtype, "queries before the slots")
    G = Hq // Hkv
    s = (q.double() @ keys.double().repeat_interleave(G, 1).transpose(-1, -2)) * D**-0.5
    s = s + bias.double().repeat_interleave(G, 1)[:, :, None]
    vis = slot_pos.repeat_interleave(G, 1)[:, :, None] <= cp[:, None]
    want = s.masked_fill(~vis, -math.inf).logsumexp(-1)
    assert (want[:, :, :40] == -math.inf).all() and (out[:, :, :40] == 0).all()
    torch.testing.assert_close(lse.double(), want, atol=1e-3 if dtype != torch.float32 else 1e-5, rtol=1e-3)


def test_op_routes_a_prefill_chunk_to_the_prefill_kernels(monkeypatch):
    """A Llama-layout chunk (32 heads over 8, 1024 queries) through the op: it takes the prefill kernels (no split
    at that grid) and matches the reference; with PREFILL_KERNEL False the slot-loop kernel gives the same."""
    calls = []
    real = pk.launch_prefill
    monkeypatch.setattr(pk, "launch_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, keys, values, bias, slot_pos, cp = _inputs(1, 32, 8, 1024, 3000, 128, torch.bfloat16, seed=9)
    args = (q, keys, values, bias, slot_pos, cp, 128**-0.5, 0)
    out = torch.ops.kvrewrite.clustered_attention(*args)
    assert calls == [1]
    ref = ca.reference_clustered_attention(q.float(), keys.float(), values.float(), *args[3:])
    _check(out, ref, torch.bfloat16, "op, Llama chunk")
    monkeypatch.setattr(ca, "PREFILL_KERNEL", False)
    old = torch.ops.kvrewrite.clustered_attention(*args)
    assert calls == [1]
    torch.testing.assert_close(out, old, atol=1.6e-2, rtol=1.6e-2)


def test_split_grids_switch_routes_small_chunks(monkeypatch):
    """A chunk of 256 queries at batch 1 (128 programs of 64 rows: the slot loop splits it) goes to the prefill
    kernels, unsplit, with PREFILL_SPLIT_GRIDS, and matches the reference."""
    calls = []
    real = pk.launch_prefill
    monkeypatch.setattr(pk, "launch_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(ca, "PREFILL_SPLIT_GRIDS", True)
    q, keys, values, bias, slot_pos, cp = _inputs(1, 32, 8, 256, 3000, 128, torch.bfloat16, seed=10)
    args = (q, keys, values, bias, slot_pos, cp, 128**-0.5, 0)
    out = _poisoned(lambda: torch.ops.kvrewrite.clustered_attention(*args), 32 * 256 * 128 * 2)
    assert calls == [1]
    ref = ca.reference_clustered_attention(q.float(), keys.float(), values.float(), *args[3:])
    _check(out, ref, torch.bfloat16, "op, chunk 256 at batch 1, split grids switch")
