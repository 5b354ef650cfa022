"""Decode matrix-vector products on the GPU: kvrewrite::gemv (Triton) vs F.linear (cuBLAS) vs copy bandwidth.

Shapes: the projections of a Llama-3.1-8B batch-1 decode step (bf16), fused (q/k/v 6144x4096, gate/up
28672x4096) and not (q and o 4096x4096, k and v 1024x4096, gate and up 14336x4096), down 4096x14336 and the
lm_head 128256x4096. Each output is checked against the fp32 product of the same inputs
(kernels/gemv.py error_bound); the run stops if one is off.

Timing as in kvrewrite/bench/attention.py: N calls inside one CUDA graph over N weight copies rotated so
that each replay reads >= 256 MiB (more than 4x the L2), median of do_bench; launch overhead left out as in
a CUDA-graphed decode step. GB/s counts the weight bytes (x and y are < 0.1% of them).

Run:  python -m kvrewrite.bench.gemv --out gemv.json [--sweep sweep.json]     (writes gemv.json and gemv.png)
      [--grid 'block_n=1,2,4;block_k=1024,2048,4096;num_warps=4,8;num_stages=3,4'] [--shapes 'qkv fused,down']
"""
import argparse
import dataclasses
import itertools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._library.triton import set_wrap_triton_enabled

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import ROTATE_BYTES, _graph_us, start_run
from kvrewrite.bench.plot import env_label
from kvrewrite.kernels import gemv as g

SHAPES = {  # name: (N, K)
    "qkv fused": (6144, 4096), "q / o": (4096, 4096), "k / v": (1024, 4096), "gate/up fused": (28672, 4096),
    "gate / up": (14336, 4096), "down": (4096, 14336), "lm_head": (128256, 4096),
}


@dataclass(frozen=True)
class Config:
    name: str
    N: int
    K: int
    dtype: str = "bf16"


def get_configs() -> list[Config]:
    return [Config(name, N, K) for name, (N, K) in SHAPES.items()]


def _make_sets(cfg: Config):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    n = max(1, min(16, math.ceil(ROTATE_BYTES / (cfg.N * cfg.K * 2))))
    return [(torch.randn(1, 1, cfg.K, device="cuda", dtype=dtype),
             torch.randn(cfg.N, cfg.K, device="cuda", dtype=dtype) / cfg.K**0.5) for _ in range(n)]


def _median_us(fn, sets, repeats=3) -> float:
    return statistics.median(_graph_us(fn, sets, quick=True) for _ in range(repeats))


def check(out, x, w) -> float:
    """Largest error over kernels/gemv.py's error_bound (<= 1 passes)."""
    ref = F.linear(x.float(), w.float())
    return ((out.float() - ref).abs() / g.error_bound(x, w, ref)).max().item()


def run(cfg: Config, copy: float) -> dict:
    sets = _make_sets(cfg)
    err = check(torch.ops.kvrewrite.gemv(*sets[0]), *sets[0])
    ours = _median_us(torch.ops.kvrewrite.gemv, sets)
    cublas = _median_us(lambda x, w: F.linear(x, w), sets)
    nbytes = cfg.N * cfg.K * 2
    res = dict(gemv_us=ours, cublas_us=cublas, gemv_frac_of_copy=nbytes / ours / 1e3 / copy,
               cublas_frac_of_copy=nbytes / cublas / 1e3 / copy, cublas_over_gemv=cublas / ours,
               error_over_bound=err, launch=g._launch_config(cfg.N, cfg.K), copy_gbps=copy)
    del sets
    torch.cuda.empty_cache()
    return res


DEFAULT_GRID = "block_n=1,2,4;block_k=512,1024,2048;num_warps=2,4,8;num_stages=3,1;evict_first=0,1"


def parse_grid(text: str) -> dict:
    """'name=v,v;name=v' -> {name: [ints]} over _launch_config's keywords; anything else is refused by name."""
    keys = ("block_n", "block_k", "num_warps", "num_stages", "evict_first")
    grid = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, values = part.partition("=")
        if name not in keys:
            raise SystemExit(f"--grid: unknown knob {name!r}; knobs are {', '.join(keys)}")
        try:
            grid[name] = [int(v) for v in values.split(",")]
        except ValueError:
            raise SystemExit(f"--grid: {name} takes comma-separated integers, got {values!r}") from None
    return grid


def sweep(configs, copy: float, grid: str = DEFAULT_GRID) -> list[dict]:
    """Launch variants of the kernel on each config: the product of `grid`'s values (parse_grid) over weight rows
    per program, K tile, warps, stages and the eviction hint. (A first sweep over rows 2-16, K tiles 256-1024, 4 or
    8 warps left its corner, 2 rows x 1024 x 4 warps, the best everywhere; the default grid is centred on it; the
    eviction hint is timed with 3 stages only.)"""
    knobs = parse_grid(grid)
    names = list(knobs)
    records = []
    for cfg in configs:
        sets = _make_sets(cfg)
        for values in itertools.product(*(knobs[n] for n in names)):
            t = dict(zip(names, values))
            if t.get("evict_first") and t.get("num_stages", 3) != 3:
                continue
            if "evict_first" in t:
                t["evict_first"] = bool(t["evict_first"])

            def fn(x, w, t=t):
                with set_wrap_triton_enabled(False):
                    return g._launch(x, w, **t)
            us = _graph_us(fn, sets, quick=True)
            records.append(dict(config=dataclasses.asdict(cfg), tuning=t, us=us,
                                frac_of_copy=cfg.N * cfg.K * 2 / us / 1e3 / copy))
        best = min((r for r in records if r["config"]["name"] == cfg.name), key=lambda r: r["us"])
        print(f"sweep {cfg.name} {cfg.N}x{cfg.K}: best {best['tuning']} {best['us']:.1f} us "
              f"{best['frac_of_copy']:.3f} of copy", flush=True)
        del sets
        torch.cuda.empty_cache()
    return records


def plot(rows, out) -> None:
    """Fraction of the copy bandwidth per shape, kvrewrite::gemv vs cuBLAS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["result"]["cublas_frac_of_copy"] for r in rows], 0.4, label="F.linear (cuBLAS)")
    ax.bar([x + 0.2 for x in xs], [r["result"]["gemv_frac_of_copy"] for r in rows], 0.4, label="kvrewrite::gemv")
    ax.set_xticks(list(xs), [f"{r['config']['name']}\n{r['config']['N']}x{r['config']['K']}" for r in rows], fontsize=7)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_ylabel("weight bytes / time / copy bandwidth")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(f"batch-1 decode GEMV, bf16 | {env_label(rows[0]['env'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gemv.json", help="JSON list of {config, result, env}; the plot goes next to it")
    parser.add_argument("--sweep", default=None, help="also time launch variants, written to this JSON file")
    parser.add_argument("--grid", default=DEFAULT_GRID, help="the sweep's launch variants, e.g. "
                        "'block_n=1,2,4;block_k=1024,2048;num_warps=8;num_stages=3,4' (knobs left out take the default)")
    parser.add_argument("--shapes", default=None, help=f"comma-separated subset of: {', '.join(SHAPES)}")
    args = parser.parse_args()
    parse_grid(args.grid)  # refuse a bad grid before any GPU work
    configs = get_configs()
    if args.shapes:
        wanted = [s.strip() for s in args.shapes.split(",")]
        unknown = [s for s in wanted if s not in SHAPES]
        if unknown:
            raise SystemExit(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
        configs = [c for c in configs if c.name in wanted]
    env, copy = start_run()
    rows = []
    for cfg in configs:
        res = run(cfg, copy)
        rows.append(dict(config=dataclasses.asdict(cfg), result=res, env=env))
        print(f"{cfg.name:14s} {cfg.N:6d}x{cfg.K:<5d} gemv {res['gemv_us']:7.1f} us "
              f"({res['gemv_frac_of_copy']:.3f} of copy) | cuBLAS {res['cublas_us']:7.1f} us "
              f"({res['cublas_frac_of_copy']:.3f}) | cuBLAS/gemv {res['cublas_over_gemv']:.3f} | "
              f"error/bound {res['error_over_bound']:.2f}", flush=True)
        if res["error_over_bound"] > 1:
            raise SystemExit(f"kvrewrite::gemv is wrong on {cfg}: error {res['error_over_bound']:.2f}x the bound")
    Path(args.out).write_text(json.dumps(rows, indent=1))
    plot(rows, Path(args.out).with_suffix(".png"))
    if args.sweep:
        records = sweep(configs, copy, args.grid)
        Path(args.sweep).write_text(json.dumps([dict(r, env=env, copy_gbps=copy) for r in records], indent=1))


if __name__ == "__main__":
    main()
