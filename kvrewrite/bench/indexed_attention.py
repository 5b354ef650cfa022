"""ClusterKV's decode attention on the GPU: kvrewrite::indexed_attention over S selected slots vs dense
kvrewrite::clustered_attention over every slot.

Llama-3.1-8B layout (Hq 32, Hkv 8, D 128, bf16), one query per sequence (T = 1), B = 1 and 8, caches of C = 32k
and 128k slots (every slot in use, bias 0). indexed_attention gets S = 1344 entries (16 sinks + 1008 selected +
320 window, ClusterKV's budget), all valid: random distinct slots of the cache, one list per KV head (shared by
its 4 query heads: `per_kv`) or one per query head (`per_q`, drawn independently: no overlap between the heads
of a group, the most K/V traffic). clustered_attention is called as the rewritten decode graph calls it:
past_only=True (window 0, slot_pos not read).

Timing: each variant runs `--calls` (20) times inside one CUDA graph and the replay time (triton.testing.do_bench,
median) is divided by the calls: launch overhead is left out, as in a CUDA-graphed decode step, but each call's
own latency (two dependent kernels: the split kernel and the combine) is in. Reported: the median of `--repeats`
such measurements, and each. The calls must not hit each other's data in the L2 (in a model, a layer's next call
comes after every other layer's): the indexed calls of one graph read disjoint slots (call i takes the i-th
S-slice of a random permutation of each row's C slots) with their own q; the dense calls alternate over enough
caches to read >= 4x the L2 (kvrewrite.bench.attention's input sets). The indexed output is checked against
the reference before timing.

Target (the ClusterKV attention step, selection + this op): >= 5x faster than dense at 32k slots and >= 15x at
128k; `selection_budget_us` = dense / target - indexed is what that leaves to kvrewrite::select_clusters.
Bytes the indexed op must move: the S listed keys and values of each selection row (2 * B * Hsel * S * D * 2),
their biases and entries (8 * B * Hsel * S), q and the output (2 * B * Hq * D * 2); GB/s = that / time.

With --sweep FILE: the indexed op's launch variants (tile, warps, stages, split count), same timing, one repeat.

Run:  python -m kvrewrite.bench.indexed_attention --out indexed_attention.json [--sweep indexed_sweep.json]
"""
import argparse
import dataclasses
import json
import math
import statistics
from dataclasses import dataclass

import torch
from torch._library.triton import set_wrap_triton_enabled

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import DTYPES, Config as DenseConfig, _bench_ms, _make_sets, start_run
from kvrewrite.bench.cuda_graphs import capture, warm_up
from kvrewrite.kernels import indexed_attention as ia

TARGET = {32768: 5.0, 131072: 15.0}  # dense / (selection + indexed) wanted, by cache size


@dataclass(frozen=True)
class Config:
    B: int
    C: int
    kind: str  # "per_kv" (index [B, Hkv, S]) or "per_q" ([B, Hq, S])
    S: int = 1344  # 16 sinks + 1008 selected + 320 window
    Hq: int = 32
    Hkv: int = 8
    D: int = 128
    dtype: str = "bf16"

    @property
    def Hsel(self) -> int:
        return self.Hkv if self.kind == "per_kv" else self.Hq

    @property
    def bytes_moved(self) -> int:
        e = DTYPES[self.dtype].itemsize
        return self.B * self.Hsel * self.S * (2 * self.D * e + 8) + 2 * self.B * self.Hq * self.D * e


def get_configs() -> list[Config]:
    return [Config(B, C, kind) for B in (1, 8) for C in (32768, 131072) for kind in ("per_kv", "per_q")]


def _graph_us(calls, repeats: int = 1) -> tuple[float, list]:
    """Per-call time of the zero-argument `calls` run in order inside one CUDA graph: (median over `repeats`
    measurements, each measurement)."""
    outs = []
    warm_up(lambda: [c() for c in calls])
    graph = capture(lambda: outs.extend(c() for c in calls))  # outs keeps the outputs alive while replaying
    times = [_bench_ms(graph.replay) * 1e3 / len(calls) for _ in range(repeats)]
    del graph, outs
    return statistics.median(times), times


def _index_sets(cfg: Config, n: int, seed: int) -> list:
    """n index tensors [B, Hsel, S] int32 of distinct slots, pairwise disjoint per row (S-slices of a random
    permutation of the row's C slots)."""
    if n * cfg.S > cfg.C:
        raise ValueError(f"{n} calls of {cfg.S} disjoint entries need C >= {n * cfg.S}, got C = {cfg.C}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.rand(cfg.B, cfg.Hsel, cfg.C, device="cuda", generator=g).argsort(-1).int()
    return [perm[..., i * cfg.S:(i + 1) * cfg.S].contiguous() for i in range(n)]


def _indexed(q, k, v, bias, index, scale, **tuning):
    """The op, or with tuning overrides its launcher called directly (as the op's eager kernel does)."""
    if tuning:
        with set_wrap_triton_enabled(False):  # launch the kernel itself, not the tracing wrapper
            return ia._launch(q, k, v, bias, index, scale, **tuning)
    return torch.ops.kvrewrite.indexed_attention(q, k, v, bias, index, scale)


def _inputs(cfg: Config, calls: int):
    """(dense sets of kvrewrite.bench.attention, [(q, index)] for the indexed calls, over the first set's cache)."""
    sets = _make_sets(DenseConfig(B=cfg.B, C=cfg.C, Hq=cfg.Hq, Hkv=cfg.Hkv, D=cfg.D, dtype=cfg.dtype))
    dtype = DTYPES[cfg.dtype]
    qs = [torch.randn(cfg.B, cfg.Hq, 1, cfg.D, device="cuda", dtype=dtype) for _ in range(calls)]
    return sets, list(zip(qs, _index_sets(cfg, calls, seed=cfg.C + cfg.B)))


def run(cfg: Config, calls: int, repeats: int, dense_cache: dict) -> dict:
    free, _ = torch.cuda.mem_get_info()
    dense_bytes = 2 * cfg.B * cfg.Hkv * cfg.C * cfg.D * DTYPES[cfg.dtype].itemsize
    if 2.5 * max(dense_bytes, 256 << 20) > free:
        return dict(config=dataclasses.asdict(cfg), skipped="does not fit in GPU memory")
    sets, queries = _inputs(cfg, calls)
    _, k, v, bias, _, _ = sets[0]
    scale = cfg.D**-0.5
    ref = ia.reference_indexed_attention(queries[0][0], k, v, bias, queries[0][1], scale)  # gathers, then fp32
    torch.testing.assert_close(_indexed(queries[0][0], k, v, bias, queries[0][1], scale), ref, atol=1.6e-2,
                               rtol=1.6e-2, msg=f"{cfg}: the op differs from the reference")
    indexed_us, indexed_all = _graph_us([lambda q=q, i=i: _indexed(q, k, v, bias, i, scale) for q, i in queries],
                                        repeats)
    eager_us = _bench_ms(lambda: _indexed(queries[0][0], k, v, bias, queries[0][1], scale)) * 1e3
    key = (cfg.B, cfg.C)
    if key not in dense_cache:  # the dense time does not depend on the index kind

        def dense(s):
            return lambda: torch.ops.kvrewrite.clustered_attention(*s, scale, 0, past_only=True)

        dense_cache[key] = _graph_us([dense(sets[i % len(sets)]) for i in range(calls)], repeats)
    dense_us, dense_all = dense_cache[key]
    del sets, queries, ref
    torch.cuda.empty_cache()
    G = cfg.Hq // cfg.Hkv
    launch = ia._launch_config(cfg.B, cfg.Hsel, cfg.Hq // cfg.Hsel, 1, cfg.S, cfg.D, ia._num_sms(torch.device("cuda")),
                               DTYPES[cfg.dtype].itemsize)
    target = TARGET.get(cfg.C, math.nan)
    return dict(config=dataclasses.asdict(cfg), G=G, indexed_us=indexed_us, indexed_us_repeats=indexed_all,
                indexed_eager_us=eager_us, indexed_gbps=cfg.bytes_moved / indexed_us / 1e3,
                bytes_moved=cfg.bytes_moved, dense_us=dense_us, dense_us_repeats=dense_all,
                dense_over_indexed=dense_us / indexed_us, target=target,
                selection_budget_us=dense_us / target - indexed_us, launch=launch)


def sweep(configs, calls: int) -> list[dict]:
    """Launch variants of the indexed op, one repeat each: stage 1 crosses tile, warps and stages on the first
    config; stage 2 varies the split count around the best of stage 1 on every config."""
    records = []

    def time_variant(cfg, queries, k, v, bias, **tuning):
        scale = cfg.D**-0.5
        try:
            us = _graph_us([lambda q=q, i=i: _indexed(q, k, v, bias, i, scale, **tuning) for q, i in queries])[0]
        except Exception as e:  # e.g. out of shared memory for a large tile with many stages
            us, tuning = math.nan, dict(tuning, error=str(e).splitlines()[0][:80])
        records.append(dict(config=dataclasses.asdict(cfg), tuning=tuning, us=us))
        print(f"sweep B{cfg.B} C{cfg.C} {cfg.kind} {tuning}: {us:.2f} us", flush=True)
        return us

    sms = ia._num_sms(torch.device("cuda"))
    best = None
    for n, cfg in enumerate(configs):
        sets, queries = _inputs(cfg, calls)
        _, k, v, bias, _, _ = sets[0]
        if n == 0:
            stage1 = {}
            for block_n in (32, 64, 128):
                for num_warps in (2, 4, 8):
                    for num_stages in (1, 2, 3):
                        t = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                        stage1[tuple(t.items())] = time_variant(cfg, queries, k, v, bias, **t)
            best = dict(min((t for t in stage1 if not math.isnan(stage1[t])), key=stage1.get))
        own = ia._launch_config(cfg.B, cfg.Hsel, cfg.Hq // cfg.Hsel, 1, cfg.S, cfg.D, sms,
                                DTYPES[cfg.dtype].itemsize, block_n=best["block_n"])["num_splits"]
        tiles = math.ceil(cfg.S / best["block_n"])
        for splits in sorted({1, max(1, own // 2), max(1, own - 1), own, own + 1, 2 * own, tiles}):
            time_variant(cfg, queries, k, v, bias, **best, num_splits=splits)
        time_variant(cfg, queries, k, v, bias)  # the op's own choice
        del sets, queries
        torch.cuda.empty_cache()
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="indexed_attention.json", help="JSON {env, copy_gbps, rows}")
    parser.add_argument("--calls", type=int, default=20, help="op calls per CUDA graph")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per variant (the median is reported)")
    parser.add_argument("--sweep", default=None, help="also time launch variants, written to this JSON file")
    args = parser.parse_args()
    env, copy = start_run()
    rows, dense_cache = [], {}
    for cfg in get_configs():
        row = run(cfg, args.calls, args.repeats, dense_cache)
        rows.append(row)
        if "skipped" in row:
            print(f"B={cfg.B} C={cfg.C:<6} {cfg.kind}: skipped, {row['skipped']}", flush=True)
            continue
        print(f"B={cfg.B} C={cfg.C:<6} {cfg.kind:<6} indexed S={cfg.S} {row['indexed_us']:7.2f} us "
              f"(eager {row['indexed_eager_us']:6.1f}, {row['indexed_gbps']:5.0f} GB/s, splits "
              f"{row['launch']['num_splits']}) | dense {row['dense_us']:8.1f} us | dense/indexed "
              f"{row['dense_over_indexed']:6.1f}x (target {row['target']:g}x with the selection: "
              f"{row['selection_budget_us']:6.1f} us left for it)", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, copy_gbps=copy, calls_per_graph=args.calls, repeats=args.repeats, rows=rows), f,
                  indent=1)
    if args.sweep:
        configs = [Config(1, 32768, "per_kv"), Config(1, 32768, "per_q"), Config(8, 32768, "per_kv"),
                   Config(8, 32768, "per_q")]
        records = sweep(configs, args.calls)
        with open(args.sweep, "w") as f:
            json.dump([dict(r, env=env) for r in records], f, indent=1)


if __name__ == "__main__":
    main()
