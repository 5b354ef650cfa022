"""kvrewrite::observed_attention on CUDA: the fused kernels against float64 attention and softmax column sums.

Fresh random inputs of several shapes (ragged C, GQA ratios 1, 3, 4, 7, 8, split and unsplit decode, prefill
chunks, windows, empty slots), fp32/fp16/bf16, in memory filled with NaN first (an unwritten output, score
or internal score row fails). Tolerances: the output's are clustered_attention's GPU table; the score is a
sum of fp32 probabilities computed from the same lse as the attention's, against the float64 softmax of
the same (rounded) inputs: ~1e-6 relative per term, so atol 5e-5 / rtol 5e-5 over <= 130 queries, ~1e2
below what a wrong group, mask or set/add moves (>= 1/C). Decode sequences (tests/kernels/decode_sequence.py) whose
statistics are deferred step to step (the pending queries in the attention tile's free rows) against the two ops on
the CPU. Also: a CUDA graph replay without host sync, deferring.
On a GPU machine: `python -m pytest -m gpu -q tests/kernels/test_observed_attention_gpu.py`.
"""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import observed_attention as oa
from kvrewrite.kernels.observed_attention import pending_entries
from tests.kernels import decode_sequence as ds
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


def _nothing_pending(q, keys):
    B, Hq, _, D = q.shape
    Hkv, C = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    P = pending_entries(G)
    return (torch.zeros(B, Hkv, P, G, D, device="cuda"), torch.full((B, Hkv, P, G), float("inf"), device="cuda"),
            torch.full((B, Hkv), C, dtype=torch.int64, device="cuda"))


def _run(shape, D, dtype, mode, last, seed, past_only=False):
    B, Hq, Hkv, T, C, window = shape
    q, keys, values, bias, slot_pos, cp, score = _inputs(B, Hq, Hkv, T, C, D, dtype, seed)
    scale = D**-0.5
    want_out, want_score = _expected(q, keys, values, bias, slot_pos, cp, score, scale, window, mode, last)

    def step():
        s = score.clone()
        out = OP(q, keys, values, bias, slot_pos, cp, scale, window, s, *_nothing_pending(q, keys), mode, last, past_only)
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
        out = OP(q, keys, values, bias, slot_pos, cp - 10_000, 0.125, 0, s, *_nothing_pending(q, keys), "all", 0)
        assert torch.equal(s, score) and not out.any()


def test_cuda_graph_replay_without_host_sync():
    """Captured in a CUDA graph and replayed on new inputs copied in: equals eager on those inputs; the eager
    call runs under torch.cuda.set_sync_debug_mode("error")."""
    shape = (1, 32, 8, 1, 2049, 0)
    a = _inputs(*shape[:5], 128, torch.bfloat16, seed=1)
    b = _inputs(*shape[:5], 128, torch.bfloat16, seed=2)
    G = shape[1] // shape[2]
    P = pending_entries(G)
    a = [*a, torch.randn(1, 8, P, G, 128, device="cuda"), torch.full((1, 8, P, G), 9.0, device="cuda"),
         torch.full((1, 8), 2049, device="cuda")]
    b = [*b, torch.randn(1, 8, P, G, 128, device="cuda"), torch.full((1, 8, P, G), 11.0, device="cuda"),
         torch.full((1, 8), 2049, device="cuda")]
    call = lambda x: OP(*x[:6], 0.088, 0, *x[6:10], "all", 0, True, True)  # noqa: E731  (deferring)
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
    assert torch.equal(out, want) and all(torch.equal(s, e) for s, e in zip(static[6:9], eager[6:9]))


# (B, Hq, Hkv, C, D, prompt): unsplit and split decode, G = 3, 4, 7, 8 (P = 4, 3, 1, 1 pending entries fill the
# 16-row tile; at G = 4 the steps at positions 3000-3007 fold a full set of 3 entries at 3003); B * Hkv = 272 rows,
# more than two programs per SM on a 132-SM GPU: the large-batch split rule (clustered_attention.fewest_waves_splits,
# 8 splits there)
SEQUENCES = [(2, 6, 2, 64, 64, 20), (1, 32, 8, 4100, 128, 3000), (3, 14, 2, 1500, 64, 999), (1, 8, 1, 700, 128, 600),
             (34, 16, 8, 2200, 64, 2100)]
SEQ_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
           torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("past_only", [True, False])
@pytest.mark.parametrize("seq", SEQUENCES, ids=lambda s: "B{}-Hq{}Hkv{}-C{}-D{}-n{}".format(*s))
def test_deferred_decode_sequence(seq, past_only, dtype):
    """8 decode steps, statistics deferred but at steps 4 and 7 (compressing steps, which fold every entry and their
    own query): every output and the score after the last step equal the two ops' on the CPU (in
    fp32 from the same rounded inputs); the score tolerance is fp32's whatever the dtype (the probabilities
    are fp32 from fp32 scores of the same rounded keys; the output's is the dtype's)."""
    B, Hq, Hkv, C, D, n = seq
    steps, folds = 8, (4, 7)
    gpu, _ = ds.prompt_state(B, Hq, Hkv, C, D, n, dtype, seed=C, device="cuda")
    cpu = {k: v.cpu().float() if v.dtype == dtype else v.cpu() for k, v in gpu.items()}
    args = (n, Hq, dtype, D**-0.5, "all", 0, past_only)
    got = ds.run(gpu, torch.Generator().manual_seed(3), steps, *args, lambda step: step not in folds, True)
    cpu_args = (n, Hq, torch.float32, D**-0.5, "all", 0, past_only)
    # the CPU run draws the same numbers, rounded to dtype first (ds.append / the queries: .to(dtype))
    want = _run_rounded(cpu, steps, cpu_args, dtype)
    for step, (x, y) in enumerate(zip(got, want)):
        torch.testing.assert_close(x.float().cpu(), y, **SEQ_TOL[dtype], msg=lambda m: f"step {step}: out {m}")
    torch.testing.assert_close(gpu["score"].cpu(), cpu["score"], atol=5e-5, rtol=5e-5)
    assert torch.isinf(gpu["pending_lse"]).all()


def _run_rounded(state, steps, args, dtype):
    """ds.run's two-op path on fp32 state, with every new key, value and query rounded to `dtype` first."""
    n, Hq, _, scale, mode, last, past_only = args
    g = torch.Generator().manual_seed(3)
    B, Hkv, _, D = state["keys"].shape
    outs = []
    for step in range(steps):
        k, v = torch.randn(2, B, Hkv, 1, D, generator=g).to(dtype).float()
        cp = torch.tensor([n + step])
        torch.ops.kvrewrite.cache_append(state["keys"], state["values"], state["bias"], state["slot_pos"],
                                         state["fill"], k, v, cp, torch.ones(B, 1, dtype=torch.bool))
        q = torch.randn(B, Hq, 1, D, generator=g).to(dtype).float()
        s = state
        outs.append(torch.ops.kvrewrite.clustered_attention(q, s["keys"], s["values"], s["bias"], s["slot_pos"], cp,
                                                            scale, 0, past_only))
        torch.ops.kvrewrite.accumulate_attention(q, s["keys"], s["bias"], s["slot_pos"], cp, s["score"], scale, 0,
                                                 mode, last)
    return outs
