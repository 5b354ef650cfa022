"""kvrewrite::kmeans_cluster on CUDA: the Triton kernel against the CPU reference, deterministic, in NaN-poisoned
memory, with no host sync, in a CUDA graph.

Keys are planted (test_kmeans_cluster.plant: no near-ties), so labels, sizes, starts, members, n_clusters and
cluster_end must equal the CPU's and centroids agree within the dtype's rounding (the kernel sums in another order).
Skipped without CUDA (and Triton). On a GPU machine (they pass on an H100, torch 2.11, triton 3.6; ~1.5 min),
`python -m pytest -m gpu -q tests/kernels/test_kmeans_cluster_gpu.py`.
"""
import math

import pytest
import torch

from kvrewrite.kernels import kmeans_cluster as km
from kvrewrite.kernels.kmeans_cluster import reference_kmeans_cluster as cpu_reference
from tests.kernels.poisoned import poisoned
from tests.kernels.test_kmeans_cluster import (
    FIELDS, METHOD, OP, Args, append_tokens, assert_state, clone, make_state, plant)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(km.triton is None, reason="needs Triton")]


@pytest.fixture
def triton_path(monkeypatch):
    """The CUDA op must run the Triton kernel: the tensor code raises if called."""
    def refuse(*args, **kwargs):
        raise AssertionError("kmeans_cluster ran the tensor code on CUDA, not the Triton kernel")

    monkeypatch.setattr(km, "reference_kmeans_cluster", refuse)


def run(s, a: Args, head_offset=0, **knobs):
    """The op on s's tensors (CPU: the reference; CUDA: the op, or triton_kmeans_cluster with knobs)."""
    tensors = [s[f] for f in FIELDS]
    if not s["keys"].is_cuda:
        cpu_reference(*tensors, *a.kwargs().values(), head_offset=head_offset)
    elif knobs:
        km.triton_kmeans_cluster(*tensors, *a.kwargs().values(), head_offset=head_offset, **knobs)
    else:
        OP(*tensors, **a.kwargs(), head_offset=head_offset)


def cpu_and_cuda(s, a, head_offset=0, **knobs):
    cpu, gpu = clone(s), {f: t.cuda() for f, t in s.items()}
    run(cpu, a, head_offset)
    run(gpu, a, head_offset, **knobs)
    return cpu, {f: t.cpu() for f, t in gpu.items()}


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


CASES = [  # B, H, C, D, K, fills, pads, threshold, dtype, args
    (1, 8, 2300, 128, 64, [[2300] * 8], None, None, torch.bfloat16, Args(n_sink=16, tokens_per_cluster=80, iters=20)),
    (2, 4, 3001, 64, 120, [[3001, 2900, 2999, 1500], [3001] * 4], [0, 37], 2000, torch.float16,
     Args(n_sink=16, tokens_per_cluster=40, iters=10, seed=5)),  # rows not due, left padding, 75 clusters
    (1, 2, 1500, 128, 48, [[1500, 1411]], [0], None, torch.float32, Args(n_sink=4, tokens_per_cluster=64, iters=8)),
    (3, 2, 704, 16, 300, [[701, 650], [602, 701], [701, 500]], [0, 3, 9], 600, torch.bfloat16,
     Args(n_sink=2, tokens_per_cluster=3, iters=5, seed=9)),  # 3 | L (disjoint initial strata); up to 233 clusters
]


@pytest.mark.parametrize("B,H,C,D,K,fills,pads,threshold,dtype,args", CASES,
                         ids=lambda v: "" if isinstance(v, (Args, list)) else str(v))
def test_prefill_matches_cpu(B, H, C, D, K, fills, pads, threshold, dtype, args, triton_path):
    s = make_state(B, H, C, D, K, fills, pads, threshold, dtype, seed=C)
    args = plant(s, args, seed=D)
    cpu, gpu = cpu_and_cuda(s, args)
    assert_state(gpu, cpu, dtype)


@pytest.mark.parametrize("knobs", [{}, dict(persistent=False)], ids=["op", "launches"])
def test_head_offset_matches_cpu(knobs, triton_path):
    """A tensor-parallel rank's state (head_offset 12: the layer's heads 12..15) against the reference."""
    s = make_state(2, 4, 900, 64, 40, [[900, 850, 899, 700], [900] * 4], [0, 21], 800, torch.bfloat16, seed=13)
    a = plant(s, Args(n_sink=4, tokens_per_cluster=40, iters=6, seed=2), seed=14, head_offset=12)
    cpu, gpu = cpu_and_cuda(s, a, head_offset=12, **knobs)
    assert_state(gpu, cpu, torch.bfloat16)


def test_llama_layer_8k(triton_path):
    """The benchmarked layout: Llama-3.1-8B layer (Hkv 8, D 128, bf16), an 8k prompt, ClusterKV's settings."""
    C = 8192 + 512
    s = make_state(1, 8, C, 128, 2 * math.ceil(C / 80), [[8192] * 8], dtype=torch.bfloat16, seed=1)
    a = plant(s, Args(n_sink=16, tokens_per_cluster=80, window=320, window_clusters=4, iters=20), seed=2)
    cpu, gpu = cpu_and_cuda(s, a)
    assert_state(gpu, cpu, torch.bfloat16)
    assert (gpu["n_clusters"] == 103).all()


def test_prefill_then_windows_match_cpu(triton_path):
    """Prefill, a not-due call, then two window clusterings (320 new tokens into 4 clusters) appended."""
    a = Args(n_sink=16, tokens_per_cluster=80, window=320, window_clusters=4, iters=20, seed=3)
    s = make_state(2, 4, 2600, 128, 40, [[1800] * 4, [1800] * 4], pads=[0, 100], dtype=torch.bfloat16, seed=4)
    a = plant(s, a)
    cpu, gpu = cpu_and_cuda(s, a)
    assert_state(gpu, cpu, torch.bfloat16, "prefill")
    for step in range(2):
        append_tokens(cpu, 200, seed=step)
        cpu, gpu = cpu_and_cuda(cpu, a)
        assert_state(gpu, cpu, torch.bfloat16, f"not due {step}")
        append_tokens(cpu, 120, seed=10 + step)
        a = plant(cpu, a, seed=20 + step)
        cpu, gpu = cpu_and_cuda(cpu, a)
        assert_state(gpu, cpu, torch.bfloat16, f"window {step}")
    assert (gpu["cluster_end"] == 1800 + 640).all() and (gpu["n_clusters"][0] == 23 + 8).all()


@pytest.mark.parametrize("knobs", [
    dict(persistent=False, stop_when_converged=False),
    dict(block_p=64, block_c=32, update_c=32, update_p=64, final_c=64, scatter_p=32, splits=5),
    dict(block_c=128, update_c=128, update_p=64, num_warps=4, splits=1),
    dict(programs=7),
    dict(update_sub=64, maxnreg=128, block_p=128),
    dict(persistent=False, update_sub=128, update_p=16),
    dict(assign_elem=True, block_p=128, splits=3),
], ids=["launches", "small", "large", "7 programs", "small compaction, 128 registers", "launches, small compaction",
        "elementwise argmax, 3 splits"])
def test_knobs_change_nothing_but_rounding(knobs):
    s = make_state(2, 4, 3001, 128, 120, [[3001, 2900, 2999, 1500], [3001] * 4], [0, 37], 2000, torch.bfloat16, seed=6)
    a = plant(s, Args(n_sink=16, tokens_per_cluster=40, iters=10), seed=7)
    cpu, gpu = cpu_and_cuda(s, a, **knobs)
    assert_state(gpu, cpu, torch.bfloat16, str(knobs))


def test_deterministic_and_poisoned(triton_path):
    """Two runs are bit-identical; scratch taken from NaN-filled memory (a scratch entry read before it is written
    shows up) changes nothing; rows not due are untouched bit for bit."""
    s = make_state(2, 4, 3001, 128, 120, [[3001, 2900, 2999, 1500], [3001] * 4], [0, 37], 2000, torch.bfloat16, seed=8)
    a = plant(s, Args(n_sink=16, tokens_per_cluster=40, iters=10), seed=9)
    outs = []
    for _ in range(2):
        gpu = {f: t.cuda() for f, t in s.items()}
        run(gpu, a)
        outs.append({f: gpu[f].cpu() for f in METHOD})
    gpu = {f: t.cuda() for f, t in s.items()}

    def call():
        run(gpu, a)
        return tuple(gpu[f] for f in METHOD)

    outs.append(dict(zip(METHOD, poisoned(call, 64 << 20))))
    for out in outs[1:]:
        for f in METHOD:
            assert torch.equal(bits(out[f].cpu()), bits(outs[0][f])), f"{f} differs between runs"
    assert torch.equal(outs[0]["members"][0, 3], s["members"][0, 3])  # fill 1500 < threshold
    cpu = clone(s)
    run(cpu, a)
    assert_state({**s, **{f: t.cpu() for f, t in outs[2].items()}}, cpu, torch.bfloat16, "poisoned")


def test_no_host_sync_and_cuda_graph_replay(triton_path):
    """The op under torch.cuda.set_sync_debug_mode("error"), then captured in a CUDA graph and replayed on new
    states copied into the captured tensors (a prefill state, then a state with no row due), matching eager calls."""
    a = Args(n_sink=16, tokens_per_cluster=40, window=320, window_clusters=4, iters=6, seed=1)

    def state(seed, due=True):
        s = make_state(1, 4, 2000, 128, 80, [[2000, 1900, 1990, 2000]], dtype=torch.bfloat16, seed=seed,
                       threshold=1990 if due else 2001)
        plant(s, a, seed=seed)  # (a's seed is kept: the replay's is the captured one, whatever plant picks)
        return {f: t.cuda() for f, t in s.items()}

    s = state(1)
    saved = clone(s)
    run(s, a)  # compile first (compilation may sync)
    torch.cuda.synchronize()
    for f in FIELDS:
        s[f].copy_(saved[f])
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(s, a)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(s, a)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(s, a)
    for seed, due in ((2, True), (3, True), (4, False)):
        new = state(seed, due)
        for f in FIELDS:
            s[f].copy_(new[f])
        graph.replay()
        run(new, a)
        torch.cuda.synchronize()
        for f in FIELDS:
            assert torch.equal(bits(s[f]), bits(new[f])), f"replay {seed}: {f} differs from the eager call"
        assert (new["n_clusters"][0, [0, 2, 3]] > 0).all() if due else (new["n_clusters"] == 0).all()
