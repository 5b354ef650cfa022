"""kvrewrite::kmeans_cluster on the GPU: ClusterKV's clustering of one Llama-3.1-8B layer.

Layout: B 1 (--batch: B sequences, 8 B rows), Hkv 8, D 128, bf16, prompts of 8k, 32k and 128k tokens, capacity
C = prompt + 1024, K = ceil(2 C / 80) cluster ids; ClusterKV's settings (n_sink 16, 80 tokens per cluster, window 320
into 4 clusters, 20 iterations).
Keys: a mixture (one random direction per 80 tokens, random norms, noise), so the k-means has structure. Calls:
- prefill: every row due (fill = prompt, cluster_end 0): L = prompt - 16 points into ceil(L / 80) clusters (410 at
  32k); a row stops iterating once its labels stop changing (exact: the rest would change nothing), so this depends on
  the keys; prefill_all_iters: every iteration runs (the worst case); iters = 0: count, write, final assignment, index
  (the fixed cost); per_iter_us = (all iterations - iters 0) / 20;
- window: after the prefill clustering, 320 new tokens per row: 4 clusters each;
- not_due: 100 new tokens (no row due: what a decode step that compresses pays, two launches that return at once).
Target (the brief): prefill <= ~4 ms per layer (30 compressed layers < 10% of a ~1.46 s 32k dense prefill), window
well under 1 ms, not_due a few launch latencies.

Timing (triton.testing.do_bench, median): a CUDA graph of [restore cluster_end and n_clusters (what the due rule
reads and the call changes); the op] replayed, minus the graph of the restores alone (graph_us); the same eagerly
(eager_us: Python, allocation and launch included). Also the one-launch-per-phase mode (launches_us, graph) and, at
8k and 32k, the reference (tensor code with host syncs) on CUDA, once (reference_ms), and the share of clustered
slots whose label (cluster id) the kernel and the reference agree on (random data has near-ties: one flip moves a
centroid and can move others, so this is a sanity figure, not a test; the tests use well-separated keys).

The cost in a real prefill (prefill_cost, --prefill-out): kvrewrite's 32k prefill with `full` and `clusterkv`
timed alternately, and HF's dense prefill; the clustering = clusterkv - full (30 compressed layers).

Run:  python -m kvrewrite.bench.kmeans_cluster --out kmeans_cluster.json [--sweep] [--batch B] [--prompts 32768]
      python -m kvrewrite.bench.kmeans_cluster --prefill-out clusterkv_prefill.json
"""
import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field

import torch

import kvrewrite.kernels.kmeans_cluster as km
from kvrewrite.bench.attention import _bench_ms, start_run
from kvrewrite.bench.cuda_graphs import capture, warm_up

FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "budget", "centroids", "cluster_size", "cluster_start",
          "members", "n_clusters", "cluster_end")
SWEEP = [  # triton_kmeans_cluster's tuning knobs (the defaults first; `programs` is left alone: the persistent launch
    # needs all of its programs resident at once)
    {}, dict(splits=4), dict(splits=8), dict(num_warps=4), dict(block_p=128), dict(update_sub=1024),
    dict(update_c=32), dict(splits=8, num_warps=4), dict(persistent=False),
]


@dataclass(frozen=True)
class Config:
    prompt: int
    B: int = 1
    Hkv: int = 8
    D: int = 128
    n_sink: int = 16
    tokens_per_cluster: int = 80
    window: int = 320
    window_clusters: int = 4
    iters: int = 20
    seed: int = 0

    @property
    def C(self) -> int:
        return self.prompt + 1024

    @property
    def K(self) -> int:
        return math.ceil(2 * self.C / self.tokens_per_cluster)

    def kwargs(self, **over) -> dict:
        kw = dict(n_sink=self.n_sink, tokens_per_cluster=self.tokens_per_cluster, window=self.window,
                  window_clusters=self.window_clusters, iters=self.iters, seed=self.seed)
        return {**kw, **over}


@dataclass
class Result:
    prefill_graph_us: float = math.nan
    prefill_eager_us: float = math.nan
    prefill_iters0_graph_us: float = math.nan
    per_iter_us: float = math.nan
    prefill_all_iters_graph_us: float = math.nan  # stop_when_converged=False: every iteration runs (worst case)
    prefill_launches_us: float = math.nan  # persistent=False, graph
    window_graph_us: float = math.nan
    window_eager_us: float = math.nan
    not_due_graph_us: float = math.nan
    not_due_eager_us: float = math.nan
    restore_graph_us: float = math.nan
    reference_ms: float = math.nan
    label_agreement: float = math.nan
    n_clusters: int = 0
    programs: int = 0  # of the persistent launch (all resident: SMs x CTAs per SM)
    sweep_us: list = field(default_factory=list)  # [(knobs, prefill graph us)] with --sweep


def get_configs() -> list[Config]:
    return [Config(8192), Config(32768), Config(131072)]


def make_state(cfg: Config) -> dict:
    """The layer after a `prompt`-token prefill, room for 1024 more tokens, an empty cluster index."""
    g = torch.Generator(device="cuda").manual_seed(cfg.seed)
    B, H, C, D, K = cfg.B, cfg.Hkv, cfg.C, cfg.D, cfg.K
    n_dir = math.ceil(C / cfg.tokens_per_cluster)
    dirs = torch.nn.functional.normalize(torch.randn(B * H, n_dir, D, device="cuda", generator=g), dim=-1)
    label = torch.randint(0, n_dir, (B * H, C), device="cuda", generator=g)
    norm = 0.5 + 1.5 * torch.rand(B * H, C, 1, device="cuda", generator=g)
    noise = 0.3 * torch.randn(B * H, C, D, device="cuda", generator=g)
    keys = (norm * (dirs.gather(1, label[..., None].expand(-1, -1, D)) + noise)).view(B, H, C, D)
    bias = torch.full((B, H, C), -math.inf, device="cuda")
    bias[..., :cfg.prompt] = 0.0
    i32 = dict(dtype=torch.int32, device="cuda")
    return dict(keys=keys.bfloat16(), values=torch.zeros(B, H, C, D, dtype=torch.bfloat16, device="cuda"), bias=bias,
                slot_pos=torch.arange(C, device="cuda").expand(B, H, C).contiguous(),
                fill=torch.full((B, H), cfg.prompt, dtype=torch.int64, device="cuda"),
                budget=torch.tensor([2**62, cfg.prompt], device="cuda"),
                centroids=torch.zeros(B, H, K, D, dtype=torch.bfloat16, device="cuda"),
                cluster_size=torch.zeros(B, H, K, **i32), cluster_start=torch.zeros(B, H, K, **i32),
                members=torch.full((B, H, C), -1, **i32), n_clusters=torch.zeros(B, H, **i32),
                cluster_end=torch.zeros(B, H, dtype=torch.int64, device="cuda"))


def _op(s, kw, knobs=None):
    args = [s[f] for f in FIELDS]
    if knobs is None:
        torch.ops.kvrewrite.kmeans_cluster(*args, **kw)
    else:
        km.triton_kmeans_cluster(*args, *kw.values(), **knobs)


def _graph_us(fn) -> float:
    warm_up(fn)
    graph = capture(fn)
    ms = _bench_ms(graph.replay)
    del graph
    return ms * 1e3


def _labels(s) -> torch.Tensor:
    """[B, Hkv, C] cluster id of every clustered slot (-1 elsewhere), read off the CSR index."""
    B, H, C = s["members"].shape
    out = torch.full((B, H, C + 1), -1, dtype=torch.int64, device=s["members"].device)
    for b in range(B):
        for h in range(H):
            n = int(s["n_clusters"][b, h])
            size = s["cluster_size"][b, h, :n].long()
            start = int(s["cluster_start"][b, h, 0]) if n else 0
            mem = s["members"][b, h, start:start + int(size.sum())].long()
            out[b, h, mem] = torch.repeat_interleave(torch.arange(n, device=mem.device), size)
    return out[..., :C]


def run(cfg: Config, sweep: bool = False) -> dict:
    res = Result()
    s = make_state(cfg)
    kw = cfg.kwargs()
    end0, n0 = s["cluster_end"].clone(), s["n_clusters"].clone()

    def restore(end, n):
        return lambda: (s["cluster_end"].copy_(end), s["n_clusters"].copy_(n))

    def timed(end, n, knobs=None, **over):
        rest = restore(end, n)
        return lambda: (rest(), _op(s, cfg.kwargs(**over), knobs))

    def eager_us(fn, rest):
        fn()
        torch.cuda.synchronize()
        return (_bench_ms(fn) - _bench_ms(rest)) * 1e3

    res.restore_graph_us = _graph_us(restore(end0, n0))
    res.prefill_graph_us = _graph_us(timed(end0, n0)) - res.restore_graph_us
    res.prefill_eager_us = eager_us(timed(end0, n0), restore(end0, n0))
    res.prefill_iters0_graph_us = _graph_us(timed(end0, n0, iters=0)) - res.restore_graph_us
    res.prefill_all_iters_graph_us = _graph_us(timed(end0, n0, dict(stop_when_converged=False))) - res.restore_graph_us
    res.per_iter_us = (res.prefill_all_iters_graph_us - res.prefill_iters0_graph_us) / cfg.iters
    res.prefill_launches_us = _graph_us(timed(end0, n0, dict(persistent=False))) - res.restore_graph_us
    if sweep:
        res.sweep_us = [(k, _graph_us(timed(end0, n0, k)) - res.restore_graph_us) for k in SWEEP]
    restore(end0, n0)()
    _op(s, kw)  # the prefill clustering, then the decode-time calls
    res.n_clusters = int(s["n_clusters"][0, 0])
    res.programs = max(km._GRIDS.values(), default=0)
    if cfg.prompt <= 32768 and cfg.B == 1:  # (its host loop over the rows: minutes at batch 8)
        ref = {f: t.clone() for f, t in s.items()}
        ref["cluster_end"].copy_(end0)
        ref["n_clusters"].copy_(n0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        km.reference_kmeans_cluster(*(ref[f] for f in FIELDS), *kw.values())
        torch.cuda.synchronize()
        res.reference_ms = (time.perf_counter() - t0) * 1e3
        a, b = _labels(s), _labels(ref)
        clustered = b >= 0
        res.label_agreement = float((a == b)[clustered].float().mean())
        del ref
    end1, n1 = s["cluster_end"].clone(), s["n_clusters"].clone()
    s["bias"][..., cfg.prompt:cfg.prompt + 320] = 0.0
    s["fill"] += 100  # not due: 100 < window new tokens
    res.not_due_graph_us = _graph_us(timed(end1, n1)) - res.restore_graph_us
    res.not_due_eager_us = eager_us(timed(end1, n1), restore(end1, n1))
    s["fill"] += 220  # a full window
    res.window_graph_us = _graph_us(timed(end1, n1)) - res.restore_graph_us
    res.window_eager_us = eager_us(timed(end1, n1), restore(end1, n1))
    s.clear()  # the state's tensors freed before the next prompt length (the closures keep the dict)
    torch.cuda.empty_cache()
    print(f"prompt {cfg.prompt:>6} batch {cfg.B} ({res.n_clusters} clusters): prefill "
          f"{res.prefill_graph_us / 1e3:6.2f} ms graph ({res.prefill_eager_us / 1e3:6.2f} eager; every iteration "
          f"{res.prefill_all_iters_graph_us / 1e3:6.2f}; iters=0 {res.prefill_iters0_graph_us:7.1f} us, "
          f"{res.per_iter_us:6.1f} us/iter; one launch per phase {res.prefill_launches_us / 1e3:6.2f} ms) | "
          f"window {res.window_graph_us:6.1f} us ({res.window_eager_us:6.1f} eager) | not due "
          f"{res.not_due_graph_us:5.1f} us ({res.not_due_eager_us:5.1f} eager) | reference {res.reference_ms:7.1f} ms,"
          f" labels agree {res.label_agreement:.4f} | {res.programs} programs", flush=True)
    for knobs, us in res.sweep_us:
        print(f"    {knobs or 'defaults'}: {us / 1e3:.3f} ms", flush=True)
    return dict(config=asdict(cfg), result=asdict(res))


def prefill_cost(out: str, n: int = 32768, reps: int = 2, model: str = "llama-3.1-8b", device: str = "cuda") -> dict:
    """The clustering's share of a real prefill: kvrewrite's chunked prefill of n random tokens with `full` and with
    `clusterkv` (the settings of `kvrewrite bench --systems full,clusterkv --contexts n --batches 1 --budget 1024
    --prefill-chunk 2048 --fuse-projections --gemv`; the same graphs but ClusterKV's compression ops), timed `reps`
    times alternately in one process, and HF's dense prefill (one forward, SDPA) after each pair. clustering_s =
    clusterkv - full: the kmeans_cluster calls of the compressed layers (and the method's other per-chunk ops)."""
    import argparse as ap

    import kvrewrite
    from kvrewrite.bench import e2e

    p = ap.ArgumentParser()
    e2e.add_arguments(p)
    cfg = e2e.config_from_args(p.parse_args(
        f"--systems full,clusterkv --contexts {n} --batches 1 --budget 1024 --prefill-chunk 2048 --fuse-projections "
        f"--gemv --kv-compile graph --intervals 1 --reps 2 --device {device} --model {model}".split()))
    cfg.validate()
    bench = e2e.Bench(cfg)
    cap, _ = bench.captured(1)
    ids = torch.randint(1, bench.mcfg.vocab_size, (1, n), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    doc = dict(env=bench.env, context=n, budget=cfg.budget, prefill_chunk=cfg.prefill_chunk, new_tokens=cfg.new_tokens,
               prefill_s={"full": [], "clusterkv": []}, dense_prefill_s=[])
    rws = {}
    for method in ("full", "clusterkv"):
        opts = {} if method == "full" else {"budget": cfg.budget}
        rws[method] = kvrewrite.apply(bench.model, method, max_length=n + cfg.new_tokens, captured=cap,
                                      fuse_projections=cfg.fuse_projections, gemv=cfg.gemv, **opts)
        rws[method].prefill(ids[:, :3 * cfg.prefill_chunk], max_new_tokens=cfg.new_tokens)  # warm-up (compiles)
    for rep in range(reps):
        for method in ("full", "clusterkv"):
            e2e._sync(device)
            t0 = time.perf_counter()
            rws[method].prefill(ids, max_new_tokens=cfg.new_tokens)
            e2e._sync(device)
            doc["prefill_s"][method].append(time.perf_counter() - t0)
        doc["dense_prefill_s"].append(e2e.hf_prefill_s(bench.model, n))
        cost = [c - f for c, f in zip(doc["prefill_s"]["clusterkv"], doc["prefill_s"]["full"])]
        doc.update(clustering_s=cost, clustering_vs_dense=[c / d for c, d in zip(cost, doc["dense_prefill_s"])],
                   clustering_vs_full=[c / f for c, f in zip(cost, doc["prefill_s"]["full"])])
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"prefill of {n}: full {doc['prefill_s']['full'][-1]:.3f} s, clusterkv "
              f"{doc['prefill_s']['clusterkv'][-1]:.3f} s: clustering {cost[-1] * 1e3:.0f} ms "
              f"({doc['clustering_vs_dense'][-1]:.1%} of HF's dense prefill {doc['dense_prefill_s'][-1]:.3f} s, "
              f"{doc['clustering_vs_full'][-1]:.1%} of kvrewrite's full)", flush=True)
    return doc


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="kmeans_cluster.json")
    parser.add_argument("--sweep", action="store_true", help="also time the prefill call under the SWEEP knobs")
    parser.add_argument("--prompts", default=None, help="comma-separated prompt lengths (default 8192,32768,131072)")
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences per call: 8 x batch rows (the reference runs at batch 1 only)")
    parser.add_argument("--prefill-out", default=None,
                        help="instead: the clustering's share of a real 32k prefill (prefill_cost) into this JSON")
    args = parser.parse_args()
    if args.prefill_out:
        prefill_cost(args.prefill_out)
        return
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    env, copy = start_run()
    prompts = [int(p) for p in args.prompts.split(",")] if args.prompts else [c.prompt for c in get_configs()]
    configs = [Config(p, B=args.batch) for p in prompts]
    rows = [run(cfg, args.sweep) for cfg in configs]
    with open(args.out, "w") as f:
        json.dump(dict(env=env, copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
