"""kvrewrite::attention_column_stats on CUDA: the Triton kernels against a dense float64 softmax, opcheck, compile.

Every check draws fresh random inputs (make_state: past slots with random degrees and ~15% empty, then a
causal fresh block of T tokens), and runs the op in memory filled with NaN first, so an output element the
kernel forgets to write fails the comparison. Both paths are checked: lse given (the float64 log-sum-exp,
rounded to fp32, as the attention would pass it) and lse=None (the op's own lse kernel).
Skipped without CUDA or Triton. On a GPU machine: `python -m pytest -m gpu -q tests/kernels/test_attention_column_stats_gpu.py`.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import attention_column_stats as acs
from tests.kernels.poisoned import poisoned as _poisoned
from tests.kernels.test_attention_column_stats import dense_probs
from tests.kernels.test_clustered_attention import make_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(acs.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.attention_column_stats.default

# Tolerance table: q's dtype -> assert_close(op output, float64 softmax column sums of the same values).
# The reference sees the exact input values (16-bit inputs upcast), so only the kernel's rounding remains,
# the same for every dtype: 16-bit q·k products are exact in fp32 (tensor cores, fp32 sums), fp32 inputs
# use ieee fp32 dots. Logits are O(5); fp32 dot, exp2 (~2 ulp) and the fp32 lse (given: rounded from
# float64; computed: a base-2 online log-sum-exp) leave each probability within ~5e-6 relative, and the
# fp32 sum of up to 300 of them adds at most 300 * 6e-8 = 2e-5 relative. rtol 5e-5 covers both; atol
# 1e-6 covers columns whose sum is ~0. A real bug (wrong mask, GQA head, window or block boundary, a lost
# query block) moves a column sum by >= one probability of a visible slot, ~1/C >= 2e-4 here.
TOL = {dt: dict(atol=1e-6, rtol=5e-5) for dt in (torch.float32, torch.float16, torch.bfloat16)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (B, Hq, Hkv, T, C, window, last). GQA ratios 1, 3, 4, 7, 8; T and C ragged (never a multiple of the
# 16/32/64 tiles, except T = 1 and C = 1); B > 1; windows; last = 0, < T, == T, > T (clamped).
SHAPES = [
    (1, 4, 4, 1, 1, 0, 1),
    (3, 9, 3, 1, 37, 0, 1),
    (2, 8, 2, 5, 1000, 16, 3),
    (1, 14, 2, 64, 4097, 0, 32),
    (3, 16, 2, 300, 600, 0, 64),
    (2, 7, 1, 130, 77, 16, 500),
    (1, 32, 8, 200, 2049, 0, 200),
    (2, 3, 3, 17, 129, 0, 0),
]
HEAD_DIMS = (64, 128, 256)


def _id(s):
    B, Hq, Hkv, T, C, w, last = s
    return f"B{B}-Hq{Hq}Hkv{Hkv}-T{T}-C{C}-w{w}-last{last}"


def _inputs(B, Hq, Hkv, T, C, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    keys, _, bias, slot_pos, cp = make_state(B, Hkv, C, D, T, dtype, gen=g)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)  # a transposed view, as in the models
    return [x.cuda() for x in (q, keys, bias, slot_pos, cp)]


def _dense_lse(q, keys, bias, slot_pos, cp, scale, window):
    """float64 log-sum-exp of each query's visible logits [B, Hq, T] (-inf for a query that sees nothing)."""
    G = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(G, dim=1)
    logits = q.double() @ k.transpose(-1, -2) * scale + bias.double().repeat_interleave(G, 1)[:, :, None, :]
    sp = slot_pos.repeat_interleave(G, 1)[:, :, None, :]
    c = cp[None, None, :, None]
    vis = (sp <= c) & (sp > c - window) if window > 0 else sp <= c
    return logits.masked_fill(~vis, -math.inf).logsumexp(-1)


def _run_and_compare(B, Hq, Hkv, T, C, D, dtype, window, last, with_lse, seed):
    q, keys, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, D, dtype, seed)
    scale = D**-0.5
    p = dense_probs(q, keys, bias, slot_pos, cp, scale, window)  # float64 [B, Hq, T, C]
    want_total, want_recent = p.sum(dim=2), p[:, :, T - min(last, T):].sum(dim=2)
    lse = _dense_lse(q, keys, bias, slot_pos, cp, scale, window).float() if with_lse else None
    nbytes = 2 * B * Hq * C * 4 + B * Hq * T * 4
    total, recent = _poisoned(lambda: OP(q, keys, bias, slot_pos, cp, lse, scale, window, last), nbytes)
    what = f"B{B} Hq{Hq} Hkv{Hkv} T{T} C{C} D{D} {dtype} window {window} last {last} lse {with_lse}"
    for name, got, want in (("total", total, want_total), ("recent", recent, want_recent)):
        assert got.dtype == torch.float32 and got.shape == (B, Hq, C) and got.is_contiguous(), what
        assert torch.isfinite(got).all(), f"{what}: {name} has {int((~torch.isfinite(got)).sum())} non-finite (unwritten?)"
        diff = (got.double() - want).abs().max().item()
        torch.testing.assert_close(got.double(), want, **TOL[dtype], msg=f"{what}: {name} max |diff| {diff:.3g}")
    # each query that sees a slot hands out exactly one unit of attention
    seeing = (p.sum(-1) > 0).sum(-1).double()
    torch.testing.assert_close(total.double().sum(-1), seeing, atol=1e-6 * C, rtol=5e-5, msg=what)


@pytest.mark.parametrize("with_lse", [True, False], ids=["lse", "no-lse"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("D", HEAD_DIMS, ids=[f"D{d}" for d in HEAD_DIMS])
@pytest.mark.parametrize("shape", SHAPES, ids=[_id(s) for s in SHAPES])
def test_triton_matches_dense_softmax(shape, D, dtype, with_lse):
    B, Hq, Hkv, T, C, window, last = shape
    seed = hash((shape, D, str(dtype), with_lse)) % 2**31
    _run_and_compare(B, Hq, Hkv, T, C, D, dtype, window, last, with_lse, seed)


@pytest.mark.parametrize("D", (16, 32, 80))
def test_small_and_odd_head_dims(D):
    """D = 16 (the tiny test models), 32, and 80 (not a power of two: the tile is masked)."""
    for i, dtype in enumerate(DTYPES.values()):
        _run_and_compare(2, 8, 2, 33, 150, D, dtype, 0, 7, with_lse=i % 2 == 0, seed=10 * D + i)


@pytest.mark.parametrize("case", [(2, 8, 2, 2048, 700, 128, 32, True), (1, 4, 1, 130, 300, 64, 70, False),
                                  (3, 7, 7, 65, 90, 80, 1, True), (1, 4, 2, 40, 64, 256, 40, False)],
                         ids=["chunk-2048-w32-lse", "w70-spans-blocks", "odd-D80-w1-lse", "D256-whole-chunk"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_recent_only_matches_dense(case, dtype):
    """need_total=False (SnapKV's prefill chunk): no total, and `recent` the dense window sums, with and without
    the caller's lse; the LSE kernel then writes only the walked rows, so a poisoned lse elsewhere is never read."""
    B, Hq, Hkv, T, C, D, last, with_lse = case
    q, keys, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, D, dtype, seed=T + C + D)
    scale = D**-0.5
    p = dense_probs(q, keys, bias, slot_pos, cp, scale, 0)
    lse = _dense_lse(q, keys, bias, slot_pos, cp, scale, 0).float() if with_lse else None
    if lse is not None:
        lse[:, :, : T - last - 64] = float("nan")  # rows the recent-only walk must not read
    totals = []

    def recent_only():
        total, recent = acs.triton_attention_column_stats(q, keys, bias, slot_pos, cp, lse, scale, 0, last,
                                                          need_total=False)
        totals.append(total)
        return recent

    recent = _poisoned(recent_only, 2 * B * Hq * C * 4)
    assert totals == [None]
    torch.testing.assert_close(recent.double(), p[:, :, T - last:].sum(dim=2), **TOL[dtype])
    seeing = (p[:, :, T - last:].sum(-1) > 0).sum(-1).double()  # each window query that sees a slot hands out 1
    torch.testing.assert_close(recent.double().sum(-1), seeing, atol=1e-6 * C, rtol=5e-5)


@pytest.mark.parametrize("tuning", [dict(even_d=True), dict(even_d=True, sum_once=True), dict(sum_once=True),
                                    dict(block_m=128, block_n=128, num_warps=8, even_d=True, sum_once=True),
                                    dict(num_stages=3, even_d=True)],
                         ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
@pytest.mark.parametrize("D", (64, 128, 80), ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_launch_overrides_match_dense(tuning, D, dtype):
    """bench/column_stats.py's variants (even_d: vector loads where D is a whole tile; sum_once: one reduction after
    the walk) give the dense sums; D = 80 keeps its column mask whatever even_d says."""
    B, Hq, Hkv, T, C = 2, 8, 2, 200, 333
    q, keys, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, D, dtype, seed=D + T)
    scale = D**-0.5
    p = dense_probs(q, keys, bias, slot_pos, cp, scale, 0)
    lse = _dense_lse(q, keys, bias, slot_pos, cp, scale, 0).float()
    for with_lse, last in ((lse, 40), (None, 40), (lse, 0)):  # last 0: H2O's call, no recent sums (zeros)
        total, recent = _poisoned(lambda: acs._launch(q, keys, bias, slot_pos, cp, with_lse, scale, 0, last,
                                                      tuning=tuning), 2 * B * Hq * C * 4 + B * Hq * T * 4)
        torch.testing.assert_close(total.double(), p.sum(dim=2), **TOL[dtype])
        torch.testing.assert_close(recent.double(), p[:, :, T - last:].sum(dim=2), **TOL[dtype])


@pytest.mark.parametrize("tuning", [{}, dict(skip_masks=False), dict(block_n=32), dict(num_warps=8),
                                    dict(pipeline=True), dict(pipeline=True, num_stages=3, num_warps=8)],
                         ids=["default", "masked", "n32", "w8", "pipeline", "pipeline-3-stages-w8"])
@pytest.mark.parametrize("window", [0, 100], ids=["causal", "w100"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_total_only_launch_matches_dense(tuning, window, dtype):
    """h2o's call (lse given, last 0, 16-bit, D = 128, T >= 128) takes _launch_config's timed total-only launch
    (128 x 64 tiles, 4 warps, even_d, sum_once, skip_masks; fp32 keeps the old tiles): the dense sums, a window
    included, with skip_masks on and off and bench/column_stats.py's --quick changes (the pipelined walk among
    them); T = 300 leaves a ragged last query block."""
    B, Hq, Hkv, T, C, D = 2, 8, 2, 300, 1333, 128
    q, keys, bias, slot_pos, cp = _inputs(B, Hq, Hkv, T, C, D, dtype, seed=window + len(tuning))
    scale = D**-0.5
    p = dense_probs(q, keys, bias, slot_pos, cp, scale, window)
    lse = _dense_lse(q, keys, bias, slot_pos, cp, scale, window).float()
    total, recent = _poisoned(lambda: acs._launch(q, keys, bias, slot_pos, cp, lse, scale, window, 0, tuning=tuning),
                              2 * B * Hq * C * 4)
    torch.testing.assert_close(total.double(), p.sum(dim=2), **TOL[dtype])
    assert (recent == 0).all()


def test_empty_invisible_and_blind_queries():
    """Empty and future slots get exactly 0; a query that sees nothing contributes nothing (no NaN)."""
    D = 64
    keys = torch.randn(2, 1, 40, D, device="cuda")
    bias = torch.zeros(2, 1, 40, device="cuda")
    bias[:, :, :10] = -math.inf
    bias[1] = -math.inf  # batch row 1: every slot empty
    pos = torch.arange(100, 140, device="cuda").expand(2, 1, 40).contiguous()
    pos[:, :, 30:] = 1000  # in the future of every query
    cp = torch.tensor([50, 120, 130], device="cuda")  # query 0 precedes every slot
    q = torch.randn(2, 3, 3, D, device="cuda")
    for dtype in DTYPES.values():
        total, recent = _poisoned(lambda: OP(q.to(dtype), keys.to(dtype), bias, pos, cp, None, 0.125, 0, 2), 1 << 20)
        assert torch.isfinite(total).all() and torch.isfinite(recent).all()
        assert (total[:, :, :10] == 0).all() and (total[:, :, 30:] == 0).all() and (total[1] == 0).all()
        torch.testing.assert_close(total[0].sum(-1), torch.full((3,), 2.0, device="cuda"), atol=1e-5, rtol=0)
        torch.testing.assert_close(recent[0].sum(-1), torch.full((3,), 2.0, device="cuda"), atol=1e-5, rtol=0)


def test_errors_are_clear():
    q, keys, bias, slot_pos, cp = _inputs(1, 4, 2, 3, 37, 64, torch.float16, seed=0)
    with pytest.raises(TypeError, match="share one dtype"):
        OP(q, keys.float(), bias, slot_pos, cp, None, 0.125, 0, 1)
    with pytest.raises(TypeError, match="bias fp32"):
        OP(q, keys, bias.half(), slot_pos, cp, None, 0.125, 0, 1)
    with pytest.raises(ValueError, match="lse must be"):
        OP(q, keys, bias, slot_pos, cp, torch.zeros(1, 4, 2, device="cuda"), 0.125, 0, 1)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        OP(q[:, :3], keys, bias, slot_pos, cp, None, 0.125, 0, 1)
    with pytest.raises(ValueError, match="CUDA device"):
        OP(q, keys, bias, slot_pos.cpu(), cp, None, 0.125, 0, 1)
    with pytest.raises(ValueError, match="must be >= 0"):
        OP(q, keys, bias, slot_pos, cp, None, 0.125, 0, -1)


@pytest.mark.parametrize("case", [(torch.bfloat16, 8, 2, 1, 300, 0, False), (torch.float16, 7, 1, 20, 100, 16, True),
                                  (torch.float32, 4, 4, 3, 37, 0, True)], ids=["bf16-decode", "fp16-window-lse", "fp32"])
def test_opcheck_cuda(case):
    dtype, Hq, Hkv, T, C, window, with_lse = case
    q, keys, bias, slot_pos, cp = _inputs(2, Hq, Hkv, T, C, 64, dtype, seed=C)
    lse = _dense_lse(q, keys, bias, slot_pos, cp, 0.125, window).float() if with_lse else None
    torch.library.opcheck(OP, (q, keys, bias, slot_pos, cp, lse, 0.125, window, T))


def test_compile_sees_the_kernels():
    """fullgraph compile inlines both Triton kernels (Inductor's code names them) and matches eager."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    q, keys, bias, slot_pos, cp = _inputs(2, 8, 2, 16, 500, 128, torch.bfloat16, seed=5)

    def stats(q):
        total, recent = torch.ops.kvrewrite.attention_column_stats(q * 2, keys, bias, slot_pos, cp, None, 0.1, 0, 4)
        return total.sum(1), recent.amax(1)

    compiled = torch.compile(stats, fullgraph=True)
    got, code = run_and_get_code(compiled, q)
    assert any("_column_stats_kernel" in c for c in code) and any("_column_stats_lse_kernel" in c for c in code)
    want = stats(q)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
