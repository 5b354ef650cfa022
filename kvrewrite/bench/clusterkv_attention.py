"""ClusterKV's attention step against dense attention, one layer of a decode step on the GPU.

The step: kvrewrite::select_clusters (score every centroid, take clusters until the budget, write the index)
then kvrewrite::indexed_attention over the indexed slots; against kvrewrite::clustered_attention over every
slot (past_only, as the decode graph calls it). Llama-3.1-8B layout (Hq 32, Hkv 8, D 128, bf16), contexts 32k
and 128k, budget 1024 tokens (16 sinks included), m = 320 (the window at its worst, full), C0 = n / 80 prompt
clusters, random keys; both GQA selection modes. Each op is timed as the replay of a CUDA graph of `calls`
calls (a decode step's launches are latency-bound: graph replays are what the runtime does), median over reps.

    python -m kvrewrite.bench.clusterkv_attention --out docs/bench/clusterkv_attention_h100_run1.json --sweep

docs/bench/clusterkv_attention_h100_run{1,2}.json (H100, torch 2.11, triton 3.6; run 1 with --sweep): per KV head
at B 1 the step costs 16.3-18.5 us at 32k (dense 53.5-55.3: 3.0-3.3x) and 20.4-23.0 at 128k (dense 185.6-186.9:
8.1-9.1x); issue 15's targets (5x, 15x) are not met. The same run's "old" variant (the step before the launch
changes): 19.2 and 24.8 us.

--sweep also times the step under launch variants (triton_select_clusters' and triton_indexed_attention's tuning
keywords, VARIANTS below) at B = 1, in the same process as the default, into each row's "variants_step_us".
"""
import argparse
import json
import math
import statistics

import torch

import kvrewrite.kernels  # noqa: F401  (registers the ops)
from kvrewrite.bench.cuda_graphs import timed_replays_us
from kvrewrite.bench.e2e import env_info
from kvrewrite.kernels.indexed_attention import triton_indexed_attention
from kvrewrite.kernels.select_clusters import triton_select_clusters

# name -> (select tuning, attention tuning): the step's launch variants timed by --sweep
VARIANTS = {  # defaults: selection in two launches, 8 warps to 64 rows; last-split combine per KV head; 128-entry
    # tiles and early value loads where _launch_config picks them. "old": the step before this branch (its selection
    # warps, 4 up to 1024 key lanes, are set in case())
    "old": (dict(fused=False), dict(fuse_combine=False, early_v=False, block_n=64)),
    "fused_select": (dict(fused=True), {}),
    "fused_combine": ({}, dict(fuse_combine=True)),
    "combine_launch": ({}, dict(fuse_combine=False)),
    "pdl": (dict(fused=True, pdl=True), dict(pdl=True)),
    "vector_loads": (dict(vector_loads=True), {}),  # select_clusters.VECTOR_LOADS: the scores' tiles as vectors
}


def _graph_us(fn, calls: int, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return statistics.median(timed_replays_us(g, reps, calls))


def case(n: int, B: int, budget: int, per_query_head: bool, calls: int, reps: int, m: int = 320, n_sink: int = 16,
         sweep: bool = False):
    Hq, Hkv, D, dt, dev = 32, 8, 128, torch.bfloat16, "cuda"
    C = n + m
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(B, Hkv, C, D, device=dev, dtype=dt, generator=g)
    values = torch.randn(B, Hkv, C, D, device=dev, dtype=dt, generator=g)
    bias = torch.zeros(B, Hkv, C, device=dev)
    slot_pos = torch.arange(C, device=dev).expand(B, Hkv, C).contiguous()
    fill = torch.full((B, Hkv), C, device=dev, dtype=torch.int64)
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=dt, generator=g)
    cpos = torch.tensor([C], device=dev)
    K0 = math.ceil((n - n_sink) / 80)
    K = K0 * 2
    centroids = torch.randn(B, Hkv, K, D, device=dev, dtype=dt, generator=g)
    sizes = torch.zeros(B, Hkv, K, dtype=torch.int32, device=dev)
    base, extra = divmod(n - n_sink, K0)
    sizes[..., :K0] = base
    sizes[..., :extra] += 1
    starts = torch.zeros_like(sizes)
    starts[..., :K0] = (n_sink + sizes[..., :K0].cumsum(-1) - sizes[..., :K0]).int()
    members = torch.full((B, Hkv, C), -1, dtype=torch.int32, device=dev)
    members[..., :n] = torch.stack([torch.randperm(n, device=dev, generator=g) for _ in range(B * Hkv)]).view(
        B, Hkv, n).int()
    members[..., :n_sink] = torch.arange(n_sink, device=dev, dtype=torch.int32)
    n_clusters = torch.full((B, Hkv), K0, dtype=torch.int32, device=dev)
    cluster_end = torch.full((B, Hkv), n, dtype=torch.int64, device=dev)
    budget_t = torch.tensor([budget, n], device=dev)
    kw = dict(n_sink=n_sink, max_selected=budget - n_sink, window=m, per_query_head=per_query_head)
    sel = torch.ops.kvrewrite.select_clusters
    att = torch.ops.kvrewrite.indexed_attention
    dense = torch.ops.kvrewrite.clustered_attention
    index = sel(q, fill, budget_t, centroids, sizes, starts, members, n_clusters, cluster_end, **kw)
    scale = D ** -0.5
    us_sel = _graph_us(lambda: sel(q, fill, budget_t, centroids, sizes, starts, members, n_clusters, cluster_end,
                                   **kw), calls, reps)
    us_att = _graph_us(lambda: att(q, keys, values, bias, index, scale), calls, reps)
    us_step = _graph_us(lambda: att(q, keys, values, bias, sel(q, fill, budget_t, centroids, sizes, starts, members,
                                                               n_clusters, cluster_end, **kw), scale), calls, reps)
    us_dense = _graph_us(lambda: dense(q, keys, values, bias, slot_pos, cpos, scale, 0, past_only=True), calls, reps)
    row = dict(context=n, batch=B, budget=budget, per_query_head=per_query_head, clusters=K0,
               index_len=index.shape[-1], select_us=us_sel, indexed_attention_us=us_att, step_us=us_step,
               dense_us=us_dense, speedup=us_dense / us_step)
    if sweep:
        want = att(q, keys, values, bias, index, scale)
        splits = _default_splits(q, index)
        row["default_attention_splits"] = splits
        variants = {}
        for name, (st, at) in VARIANTS.items():
            if name == "old":
                kb = min(1 << max(centroids.shape[2] - 1, 0).bit_length(), 16384)
                st = dict(st, num_warps=4 if kb <= 1024 else 8 if kb <= 4096 else 16)
            if "splits" in at:
                at = dict(at)
                at["num_splits"] = {"half": max(1, splits // 2), "x2": 2 * splits, "x4": 4 * splits}[at.pop("splits")]

            def step(st=st, at=at):
                idx = triton_select_clusters(q, fill, budget_t, centroids, sizes, starts, members, n_clusters,
                                             cluster_end, **kw, **st)
                return triton_indexed_attention(q, keys, values, bias, idx, scale, **at)

            got = step()
            torch.cuda.synchronize()
            if not torch.equal(triton_select_clusters(q, fill, budget_t, centroids, sizes, starts, members,
                                                      n_clusters, cluster_end, **kw, **st), index):
                raise AssertionError(f"variant {name}: the index differs from the op's")
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=f"variant {name}")
            variants[name] = _graph_us(step, calls, reps)
        row["variants_step_us"] = variants
        b0 = torch.tensor([n_sink, n], device=dev)  # B_sel 0: launches, loads, sinks and window; no selection
        row["kernel_us"] = _kernel_us(lambda: att(q, keys, values, bias, sel(
            q, fill, budget_t, centroids, sizes, starts, members, n_clusters, cluster_end, **kw), scale))
        row["select_bsel0_us"] = _graph_us(lambda: sel(q, fill, b0, centroids, sizes, starts, members, n_clusters,
                                                       cluster_end, **kw), calls, reps)
    return row


def _kernel_us(fn, calls: int = 20) -> dict:
    """GPU time of each kernel of fn (torch.profiler's CUDA activity, eager calls), mean per call, by name (or the
    profiler's error, recorded as such)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        return _profile(fn, calls, ProfilerActivity, profile)
    except Exception as e:  # noqa: BLE001  (a diagnostic: the timings above stand without it)
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def _profile(fn, calls, ProfilerActivity, profile) -> dict:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count >= calls:
            out[e.key[:60]] = e.device_time_total / calls
    return out


def _default_splits(q, index) -> int:
    from kvrewrite.kernels import indexed_attention as ia

    B, Hq, T, D = q.shape
    Hsel, S = index.shape[1], index.shape[2]
    return ia._launch_config(B, Hsel, Hq // Hsel, T, S, D, ia._num_sms(q.device), q.element_size())["num_splits"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="clusterkv_attention.json")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--sweep", action="store_true", help="also time the step's launch variants")
    p.add_argument("--sweep-batches", default="1", help="the batch sizes --sweep applies to")
    a = p.parse_args(argv)
    rows = []
    for n in map(int, a.contexts.split(",")):
        for B in map(int, a.batches.split(",")):
            for pqh in (True, False):
                r = case(n, B, a.budget, pqh, a.calls, a.reps, sweep=a.sweep and str(B) in a.sweep_batches.split(","))
                rows.append(r)
                print(json.dumps(r), flush=True)
                torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({"env": env_info("cuda"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
