"""kvrewrite::observed_attention on CUDA: the fused kernels against float64 attention and softmax column sums.

Fresh random inputs of several shapes (ragged C, GQA ratios 1, 3, 4, 7, 8, split and unsplit decode, prefill
chunks, windows, empty slots), fp32/fp16/bf16, in memory filled with NaN first (an unwritten output, score
or internal score row fails). Tolerances: the output's are clustered_attention's GPU table; the score is a
sum of fp32 probabilities computed from the same lse as the attention's, against the float64 softmax of
the same (rounded) inputs: ~1e-6 relative per term, so atol 5e-5 / rtol 5e-5 over <= 130 queries, ~1e2
below what a wrong group, mask or set/add moves (>= 1/C). Also: a CUDA graph replay without host sync.
On a GPU machine: `python -m pytest -m gpu -q tests/kernels/test_observed_attention_gpu.py`.
"""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import observed_attention as oa
from tests.kernels.poisoned import poisoned
from tests.kernels.test_attention_column_stats import dense_probs
from tests.kernels.test_clustered_attention import make_state, naive_attention
from tests.kernels.test_clustered_attention_gpu import TOL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(oa.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.observed_attention.default
SCORE_TOL = dict(atol=5e-5, rtol=5e-5)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (B, Hq, Hkv, T, C, window)
SHAPES = [
    (1, 4, 4, 1, 1, 0), (3, 9, 3, 1, 37, 0), (1, 32, 8, 1, 4099, 0), (2, 14, 2, 1, 1000, 16), (1, 7, 1, 1, 301, 0),
    (3, 8, 2, 1, 7001, 0), (1, 9, 3, 5, 1000, 0), (3, 8, 2, 5, 37, 16), (1, 14, 2, 130, 1000, 0),
    (2, 32, 8, 64, 301, 0),
]


def _inputs(B, Hq, Hkv, T, C, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    keys, values, bias, slot_pos, cp = make_state(B, Hkv, C, D, T, dtype, gen=g)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)  # a transposed view, as in the models
    score = torch.rand(B, Hkv, C, generator=g)  # what the state held before the step
    return [x.cuda() for x in (q, keys, values, bias, slot_pos, cp, score)]


def _expected(q, keys, values, bias, slot_pos, cp, score, scale, window, mode, last):
    """(float64 output, float64 score after the step), from the same rounded inputs."""
    B, Hq, T, _ = q.shape
    Hkv, C = keys.shape[1], keys.shape[2]
    cpu = [x.cpu() for x in (q, keys, values, bias, slot_pos, cp)]
    out = naive_attention(*cpu, scale, window)
    p = dense_probs(cpu[0], cpu[1], cpu[3], cpu[4], cpu[5], scale, window).view(B, Hkv, Hq // Hkv, T, C)
    before = score.cpu().double()
    if mode == "all":
        return out, before + p.sum(dim=(2, 3))
    observed = p[:, :, :, T - min(last, T):].sum(dim=3).mean(dim=2)
    return out, (before + observed if T == 1 else observed)


def _run(shape, D, dtype, mode, last, seed, past_only=False):
    B, Hq, Hkv, T, C, window = shape
    q, keys, values, bias, slot_pos, cp, score = _inputs(B, Hq, Hkv, T, C, D, dtype, seed)
    scale = D**-0.5
    want_out, want_score = _expected(q, keys, values, bias, slot_pos, cp, score, scale, window, mode, last)

    def step():
        s = score.clone()
        out = OP(q, keys, values, bias, slot_pos, cp, scale, window, s, mode, last, past_only)
        return out, s

    nbytes = B * Hq * T * (D * 4 + 64 * (D + 2) * 4) + B * Hq * C * 4 + B * Hkv * C * 4
    out, got = poisoned(step, nbytes)
    what = f"B{B} Hq{Hq} Hkv{Hkv} T{T} C{C} D{D} {dtype} window {window} {mode} last {last}"
    assert torch.isfinite(out).all() and torch.isfinite(got).all(), f"{what}: non-finite output or score (unwritten?)"
    torch.testing.assert_close(out.float().cpu(), want_out.float(), **TOL[dtype], msg=lambda m: f"{what}: out {m}")
    torch.testing.assert_close(got.cpu().double(), want_score, **SCORE_TOL, msg=lambda m: f"{what}: score {m}")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("mode,last", [("all", 0), ("window", 32)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}Hkv{}-T{}-C{}-w{}".format(*s))
def test_matches_float64(shape, mode, last, dtype):
    _run(shape, 128, dtype, mode, last, seed=hash((shape, mode, str(dtype))) % 2**31)


@pytest.mark.parametrize("D", (16, 64, 256))
def test_head_dims_and_past_only_decode(D):
    """Head dims of the tiny test models (16) to 256, and the decode graphs' past_only (slot_pos not read)."""
    _run((2, 8, 2, 1, 517, 0), D, torch.bfloat16, "all", 0, seed=D, past_only=True)
    _run((1, 12, 3, 1, 999, 0), D, torch.float16, "window", 32, seed=D + 1, past_only=True)


def test_queries_that_see_nothing_add_nothing():
    """Padding queries (positions before every slot): output 0, score untouched, in decode and prefill."""
    for T in (1, 7):
        q, keys, values, bias, slot_pos, cp, score = _inputs(2, 8, 2, T, 300, 64, torch.bfloat16, seed=T)
        s = score.clone()
        out = OP(q, keys, values, bias, slot_pos, cp - 10_000, 0.125, 0, s, "all", 0)
        assert torch.equal(s, score) and not out.any()


def test_cuda_graph_replay_without_host_sync():
    """Captured in a CUDA graph and replayed on new inputs copied in: equals eager on those inputs; the eager
    call runs under torch.cuda.set_sync_debug_mode("error")."""
    shape = (1, 32, 8, 1, 2049, 0)
    a = _inputs(*shape[:5], 128, torch.bfloat16, seed=1)
    b = _inputs(*shape[:5], 128, torch.bfloat16, seed=2)
    call = lambda x: OP(x[0], x[1], x[2], x[3], x[4], x[5], 0.088, 0, x[6], "all", 0, True)  # noqa: E731
    call(a)  # compile first (compilation may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call([t.clone() for t in a])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = [t.clone() for t in a]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call([t.clone() for t in a])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(static)
    for s, t in zip(static, b):
        s.copy_(t)
    graph.replay()
    eager = [t.clone() for t in b]
    want = call(eager)
    assert torch.equal(out, want) and torch.equal(static[6], eager[6])
