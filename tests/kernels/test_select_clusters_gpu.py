"""kvrewrite::select_clusters on CUDA: the Triton kernels against the CPU reference, bit for bit (the int32 index).

States are ClusterKV layers at realistic sizes (kvrewrite.bench.select_clusters.make_state: Llama-3.1-8B decode,
K up to 3280 and one 13k-cluster row, max_selected 1008, n_sink 16, window 320) and odd small ones; queries and
centroids are dyadic, so every fp32 dot product is exact in any order and the CPU reference's ranking is the
kernel's. Outputs (and the kernels' scratch) are allocated in NaN/0xFF-poisoned memory, so an entry the kernel
forgets to write fails the comparison. Also: no host sync, CUDA-graph capture and replay on new states, opcheck,
torch.compile(fullgraph=True). Skipped without CUDA or Triton.
On a GPU machine: `python -m pytest -m gpu -q tests/kernels/test_select_clusters_gpu.py`.
"""
import pytest
import torch

from kvrewrite.bench.select_clusters import ARGS, make_q, make_state
from kvrewrite.kernels import select_clusters as sc  # registers kvrewrite::select_clusters
from tests.kernels.poisoned import poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(sc.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.select_clusters.default
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _state(B, Hq, Hkv, K, used, D, n_sink, max_selected, window, budget, dtype, seed, C=None):
    st = make_state(B, Hkv, K, used, D, n_sink=n_sink, window=window, budget=budget, dtype=dtype, device="cpu",
                    seed=seed, C=C)
    return make_q(B, Hq, D, dtype, "cpu", seed), st


def _compare(q, st, n_sink, max_selected, window, per_query_head, what="", **tuning):
    """The op (or, with tuning, triton_select_clusters) on CUDA copies, in poisoned memory, against the CPU reference."""
    kw = dict(n_sink=n_sink, max_selected=max_selected, window=window, per_query_head=per_query_head)
    want = sc.reference_select_clusters(q, *(st[a] for a in ARGS), **kw)
    qc, args = q.cuda(), [st[a].cuda() for a in ARGS]
    fn = (lambda: sc.triton_select_clusters(qc, *args, **kw, **tuning)) if tuning else (lambda: OP(qc, *args, **kw))
    rows, K = want.shape[0] * want.shape[1], st["centroids"].shape[2]
    got = poisoned(fn, rows * (want.shape[2] * 4 + K * 4 + max_selected * 8)).cpu()
    bad = (got != want).nonzero()
    assert not len(bad), f"{what} {tuning}: {len(bad)} entries differ, first at {bad[0].tolist()}: " \
                         f"{int(got[tuple(bad[0])])} != {int(want[tuple(bad[0])])}"


# B, Hq, Hkv, K, used, D, n_sink, max_selected, window, budget. Llama-3.1-8B decode at 32k and 128k (budget 1024 =
# 16 sinks + 1008), then GQA 7 and 3 with ragged per-row cluster counts, small budgets (every row trims, the
# threshold among few clusters), budgets above every clustered token, K > 4096 (16 warps, 8192 key lanes).
LLAMA_32K = (1, 32, 8, 820, 410, 128, 16, 1008, 320, 1024)
LLAMA_128K = (1, 32, 8, 3280, 1640, 128, 16, 1008, 320, 1024)
SHAPES = [
    LLAMA_32K,
    LLAMA_128K,
    (4, 28, 4, 1000, [[1000, 3, 0, 517]] * 2 + [[640, 999, 12, 1]] * 2, 64, 4, 300, 64, 40),
    (2, 9, 3, 333, [[333, 100, 7], [0, 1, 333]], 128, 16, 1000, 320, 10**6),
    (2, 16, 2, 5000, 2600, 128, 8, 2000, 100, 1500),
]


def _shape_id(s):
    return "B{}-Hq{}-Hkv{}-K{}-D{}-m{}-b{}".format(s[0], s[1], s[2], s[3], s[5], s[7], s[9])


@pytest.mark.parametrize("per_query_head", [True, False], ids=["per_q", "shared"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=[_shape_id(s) for s in SHAPES])
def test_matches_reference(shape, dtype, per_query_head):
    B, Hq, Hkv, K, used, D, n_sink, max_selected, window, budget = shape
    q, st = _state(*shape, dtype, seed=K + D)
    _compare(q, st, n_sink, max_selected, window, per_query_head, _shape_id(shape))


@pytest.mark.parametrize("tuning", [dict(tiers=False), dict(key_chunk=512), dict(key_chunk=2048), dict(num_warps=4),
                                    dict(block_k=32, block_e=32, block_m=128),
                                    dict(block_k=128, num_warps=16, score_warps=8), dict(fused=False),
                                    dict(fused=False, num_warps=2, block_k=32), dict(num_warps=1, block_k=32),
                                    dict(num_warps=2), dict(num_warps=8, block_k=128), dict(fused=True, pdl=True),
                                    dict(fused=True), dict(fused=True, num_warps=4, block_k=32),
                                    dict(fused=True, block_k=128, tiers=False), dict(vector_loads=True),
                                    dict(vector_loads=True, fused=True)],
                         ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
def test_launch_variants_agree(tuning):
    """Register tiers off, the chunked passes (n_clusters > key_chunk), other tiers, block sizes and warps, the
    two-launch form (fused=False), a programmatic dependent launch, the scores' vector loads: the same index."""
    for per_query_head, budget in [(True, 1024), (False, 300)]:
        shape = LLAMA_128K[:-1] + (budget,)
        q, st = _state(*shape, torch.bfloat16, seed=budget)
        _compare(q, st, 16, 1008, 320, per_query_head, "llama 128k", **tuning)


def test_512k_context_row():
    """K = 13120 (a 512k-token context at 80 tokens per cluster, 16384 key lanes), half in use, and the chunked
    bisection over it."""
    shape = (1, 8, 2, 13120, 6560, 128, 16, 1008, 320, 1024)
    q, st = _state(*shape, torch.bfloat16, seed=5)
    for tuning in ({}, dict(key_chunk=4096)):
        _compare(q, st, 16, 1008, 320, True, "512k", **tuning)


def test_ties_and_empty_rows():
    """Centroids in {-1, 0, 1} and q all ones: few distinct scores, t* shared by hundreds of clusters (the lower ids
    first); one row with no clusters, one window longer than `window` (the kernel lists the first `window`)."""
    q, st = _state(*LLAMA_32K[:-1], 700, torch.bfloat16, seed=9)
    g = torch.Generator().manual_seed(9)
    st["centroids"] = torch.where(st["centroids"].isnan(), st["centroids"].float(),
                                  torch.randint(-1, 2, st["centroids"].shape, generator=g).float()).bfloat16()
    q = torch.ones_like(q)
    st["n_clusters"][0, 3] = 0
    _compare(q, st, 16, 1008, 320, True, "ties")
    _compare(q, st, 16, 1008, 320, False, "ties")
    st["fill"][0, 5] = st["cluster_end"][0, 5] + 400
    out = OP(q.cuda(), *(st[a].cuda() for a in ARGS), n_sink=16, max_selected=1008, window=320,
             per_query_head=False).cpu()
    assert out[0, 5, 1024:].tolist() == list(range(int(st["cluster_end"][0, 5]), int(st["cluster_end"][0, 5]) + 320))


def _cuda_state(seed, budget=1024):
    q, st = _state(*LLAMA_128K[:-1], budget, torch.bfloat16, seed=seed, C=160000)  # one C: the graph's buffers
    return q.cuda(), {k: v.cuda() for k, v in st.items()}


@pytest.mark.parametrize("per_query_head", [True, False], ids=["per_q", "shared"])
def test_no_host_sync_and_cuda_graph_replay(per_query_head):
    """The op under torch.cuda.set_sync_debug_mode("error"), then captured in a CUDA graph and replayed on new states
    (other cluster counts, sizes, budgets, windows; the same shapes) copied into the captured tensors: equal to the
    op run eagerly on them."""
    kw = dict(n_sink=16, max_selected=1008, window=320, per_query_head=per_query_head)
    q, st = _cuda_state(1)

    def step():
        return OP(q, *(st[a] for a in ARGS), **kw)

    step()  # compile first (compilation may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, budget in [(2, 1024), (3, 200), (4, 16)]:
        q2, st2 = _cuda_state(seed, budget)
        q.copy_(q2)
        for a in ARGS:
            st[a].copy_(st2[a])
        graph.replay()
        want = step()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {seed}: differs from eager"
        assert torch.equal(want.cpu(), sc.reference_select_clusters(q.cpu(), *(st[a].cpu() for a in ARGS), **kw))


def test_opcheck_cuda():
    q, st = _state(2, 8, 2, 100, [[100, 37], [0, 64]], 64, 4, 50, 16, 40, torch.bfloat16, seed=3)
    args = (q.cuda(), *(st[a].cuda() for a in ARGS))
    for per_query_head in (True, False):
        torch.library.opcheck(OP, args, dict(n_sink=4, max_selected=50, window=16, per_query_head=per_query_head))


@pytest.mark.parametrize("per_query_head", [True, False], ids=["per_q", "shared"])
def test_compile_fullgraph(per_query_head):
    """A decode-step-like function (q from a transposed projection-like view) around the op compiles whole
    (fullgraph=True), Inductor sees the Triton kernels, and the result equals eager; then under CUDA graphs
    (mode="reduce-overhead") on new queries."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    q, st = _cuda_state(6)
    B, Hq, _, D = q.shape
    kw = dict(n_sink=16, max_selected=1008, window=320, per_query_head=per_query_head)

    def step(x):
        qq = (x * 2).view(B, 1, Hq, D).transpose(1, 2)  # exact: a power of two
        return torch.ops.kvrewrite.select_clusters(qq, *(st[a] for a in ARGS), **kw)

    x = q.transpose(1, 2).reshape(B, Hq * D).contiguous()
    compiled = torch.compile(step, fullgraph=True)
    got, code = run_and_get_code(compiled, x)
    assert any("_select_clusters_kernel" in c for c in code), "Inductor did not see the Triton kernel"
    assert torch.equal(got, step(x))
    torch._dynamo.reset()
    graphed = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for seed in range(3):  # warm-up, recording, replays
        x = make_q(B, Hq, D, torch.bfloat16, "cuda", 10 + seed).transpose(1, 2).reshape(B, Hq * D).contiguous()
        assert torch.equal(graphed(x).clone(), step(x)), seed
    torch._dynamo.reset()


@pytest.mark.parametrize("per_query_head", [True, False], ids=["per_q", "shared"])
def test_step_graph_replays_fused_and_pdl(per_query_head):
    """Two decode steps (select_clusters then indexed_attention, twice: each launch's counters must be back at 0 for
    the next) captured in one CUDA graph: default launches, the one-launch selection (fused), and with programmatic
    dependent launches (pdl); replayed three times on new states and queries: the index equals the CPU reference's
    and the outputs the eager ops'."""
    from kvrewrite.kernels import indexed_attention as ia

    kw = dict(n_sink=16, max_selected=1008, window=320, per_query_head=per_query_head)
    q, st = _cuda_state(11)
    C, D = st["members"].shape[2], q.shape[-1]
    g = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(1, 8, C, D, device="cuda", dtype=torch.bfloat16, generator=g)
    values = torch.randn(1, 8, C, D, device="cuda", dtype=torch.bfloat16, generator=g)
    bias = torch.zeros(1, 8, C, device="cuda")
    for tuning, att_tuning in (({}, {}), (dict(fused=True), {}), (dict(fused=True, pdl=True), dict(pdl=True))):
        outs = []

        def steps():
            for _ in range(2):
                idx = sc.triton_select_clusters(q, *(st[a] for a in ARGS), **kw, **tuning)
                outs.append((idx, ia.triton_indexed_attention(q, keys, values, bias, idx, D**-0.5, **att_tuning)))

        steps()
        torch.cuda.synchronize()
        outs.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            steps()
        for seed, budget in [(12, 1024), (13, 300), (14, 1024)]:
            q2, st2 = _cuda_state(seed, budget)
            q.copy_(q2)
            for a in ARGS:
                st[a].copy_(st2[a])
            graph.replay()
            torch.cuda.synchronize()
            want_idx = sc.reference_select_clusters(q.cpu(), *(st[a].cpu() for a in ARGS), **kw)
            want = ia.triton_indexed_attention(q, keys, values, bias, want_idx.cuda(), D**-0.5, fuse_combine=False)
            for idx, out in outs:
                assert torch.equal(idx.cpu(), want_idx), f"{tuning} replay {seed}: index"
                torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2, msg=f"{tuning} replay {seed}")
        del graph
