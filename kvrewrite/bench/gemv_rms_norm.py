"""The residual add + RMSNorm before a decode GEMV: kvrewrite::gemv_rms_norm (one kernel) vs what runs without it,
a torch.compile'd add + RMSNorm (Inductor's kernel, as in a compiled decode step) followed by kvrewrite::gemv.

Shapes: the GEMVs of a Llama-3.1-8B batch-1 decode step that follow an RMSNorm (bf16, K = 4096): qkv fused
(6144), gate/up fused (28672), the lm_head (128256). Each fused output is checked against the float64 reference
(kernels/gemv_rms_norm.py error_bound) and its h against the eager add; the run stops if one is off.

Also timed with the weight marked constant (constant_weight=True: the first weight tile loaded before the PDL
wait): the fused kernel, the split norm's two launches (the norm, then gemv's kernel; the op's choice from
kernels/gemv_rms_norm.py SPLIT_NORM_MIN_N rows on) and gemv alone. "fused" is the fused kernel at any N.

Timing as in kvrewrite/bench/gemv.py: N calls inside one CUDA graph over N weight copies rotated so that each
replay reads >= 256 MiB; median of do_bench. `--sweep` first times launch variants of the fused kernel (rows per
program, warps, first-tile preload, K tile); each row then also notes the sweep's best.

Run:  python -m kvrewrite.bench.gemv_rms_norm --out gemv_rms_norm.json [--sweep sweep.json]
"""
import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch
from torch._library.triton import set_wrap_triton_enabled

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import ROTATE_BYTES, _graph_us, start_run
from kvrewrite.bench.gemv import Config, _median_us
from kvrewrite.kernels import gemv_rms_norm as m

SHAPES = {"qkv fused": (6144, 4096), "gate/up fused": (28672, 4096), "lm_head": (128256, 4096)}
EPS = 1e-5


def get_configs() -> list[Config]:
    return [Config(name, N, K) for name, (N, K) in SHAPES.items()]


def _make_sets(cfg: Config):
    """(x, residual, norm_weight, weight) sets, the weight rotated."""
    dtype = torch.bfloat16
    n = max(1, min(16, math.ceil(ROTATE_BYTES / (cfg.N * cfg.K * 2))))
    return [(torch.randn(1, 1, cfg.K, device="cuda", dtype=dtype), torch.randn(1, 1, cfg.K, device="cuda", dtype=dtype),
             (1 + 0.1 * torch.randn(cfg.K, device="cuda")).to(dtype),
             torch.randn(cfg.N, cfg.K, device="cuda", dtype=dtype) / cfg.K**0.5) for _ in range(n)]


@torch.compile(fullgraph=True)
def add_rms_norm(x, residual, norm_weight):
    """HF's LlamaRMSNorm of x + residual, the baseline's first kernel: (normed, h)."""
    h = x + residual
    h32 = h.to(torch.float32)
    n = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)
    return norm_weight * n.to(h.dtype), h


def fused(x, r, nw, w):
    """The fused kernel (one launch; the op's choice below SPLIT_NORM_MIN_N rows)."""
    with set_wrap_triton_enabled(False):
        return m._launch(x, r, nw, EPS, w, split_norm=False)


def unfused(x, r, nw, w):
    n, h = add_rms_norm(x, r, nw)
    return torch.ops.kvrewrite.gemv(n, w), h


def check(x, r, nw, w, fn=None) -> float:
    """Largest error of the fused kernel (or fn, a variant of it) over error_bound (<= 1 passes); raises if its h is not
    the eager add."""
    y, h = (fn or fused)(x, r, nw, w)
    if not torch.equal(h, x + r):
        raise SystemExit("kvrewrite::gemv_rms_norm: h differs from x + residual")
    y64, _, n64 = m.reference_f64(x, r, nw, EPS, w)
    return ((y.double() - y64).abs() / m.error_bound(x, w, n64, y64)).max().item()


def fused_constant(x, r, nw, w):
    """The fused kernel with the weight marked constant (its first tile loaded before the PDL wait)."""
    with set_wrap_triton_enabled(False):
        return m._launch(x, r, nw, EPS, w, None, False, True, split_norm=False)


def split_constant(x, r, nw, w):
    """The split norm's two launches (the norm, then gemv's kernel), the weight marked constant."""
    with set_wrap_triton_enabled(False):
        return m._launch(x, r, nw, EPS, w, None, False, True, split_norm=True)


def run(cfg: Config, copy: float) -> dict:
    sets = _make_sets(cfg)
    err = check(*sets[0])
    err_split = max(check(*sets[0], fn) for fn in (fused_constant, split_constant))
    ours = _median_us(fused, sets)
    base = _median_us(unfused, sets)
    gemv_only = _median_us(lambda x, r, nw, w: torch.ops.kvrewrite.gemv(x, w), sets)
    norm_only = _median_us(lambda x, r, nw, w: add_rms_norm(x, r, nw), sets)
    nbytes = cfg.N * cfg.K * 2
    res = dict(fused_us=ours, unfused_us=base, gemv_only_us=gemv_only, add_rms_norm_only_us=norm_only,
               fused_constant_us=_median_us(fused_constant, sets), split_constant_us=_median_us(split_constant, sets),
               gemv_constant_us=_median_us(lambda x, r, nw, w: torch.ops.kvrewrite.gemv(x, w, None, True), sets),
               saved_us=base - ours, fused_over_gemv=ours / gemv_only, fused_frac_of_copy=nbytes / ours / 1e3 / copy,
               error_over_bound=max(err, err_split), launch=m.launch_config(cfg.N, cfg.K), copy_gbps=copy)
    del sets
    torch.cuda.empty_cache()
    return res


def sweep(configs, copy: float) -> list[dict]:
    """Rows per program, warps, first-tile preload of the fused kernel, K tiles of 2048 (gemv's choice) and 4096 (the
    prologue in one tile). A first sweep without preload (1, 2, 4, 8 rows x 4, 8 warps) found 4 rows x 4 warps best
    on the three shapes, 2.0-2.3 us slower than gemv alone."""
    variants = [dict(block_n=b, num_warps=w, preload=p) for b in (2, 4, 8) for w in (4, 8) for p in (False, True)]
    variants += [dict(block_n=b, num_warps=w, preload=p, block_k=4096) for b, w in ((2, 8), (4, 4), (4, 8))
                 for p in (False, True)]
    records = []
    for cfg in configs:
        sets = _make_sets(cfg)
        for t in variants:
            def fn(x, r, nw, w, t=t):
                with set_wrap_triton_enabled(False):
                    return m._launch(x, r, nw, EPS, w, split_norm=False, **t)  # the fused kernel at every N
            us = _graph_us(fn, sets, quick=True)
            records.append(dict(config=dataclasses.asdict(cfg), tuning=t, us=us,
                                frac_of_copy=cfg.N * cfg.K * 2 / us / 1e3 / copy))
        best = min((r for r in records if r["config"]["name"] == cfg.name), key=lambda r: r["us"])
        print(f"sweep {cfg.name} {cfg.N}x{cfg.K}: best {best['tuning']} {best['us']:.1f} us "
              f"{best['frac_of_copy']:.3f} of copy; "
              + " ".join(f"{r['tuning']['block_n']}x{r['tuning']['num_warps']}w{'p' if r['tuning']['preload'] else ''}"
                         f"{'k' + str(r['tuning']['block_k']) if 'block_k' in r['tuning'] else ''} {r['us']:.1f}"
                         for r in records if r["config"]["name"] == cfg.name), flush=True)
        del sets
        torch.cuda.empty_cache()
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gemv_rms_norm.json", help="JSON list of {config, result, env}")
    parser.add_argument("--sweep", default=None, help="also time launch variants, written to this JSON file")
    args = parser.parse_args()
    env, copy = start_run()
    records = sweep(get_configs(), copy) if args.sweep else []
    rows = []
    for cfg in get_configs():
        res = run(cfg, copy)
        mine = [r for r in records if r["config"]["name"] == cfg.name]
        if mine:
            best = min(mine, key=lambda r: r["us"])
            res.update(sweep_best_us=best["us"], sweep_best=best["tuning"])
        rows.append(dict(config=dataclasses.asdict(cfg), result=res, env=env))
        print(f"{cfg.name:14s} {cfg.N:6d}x{cfg.K:<5d} fused {res['fused_us']:7.2f} us | add+rms_norm (compiled) + gemv "
              f"{res['unfused_us']:7.2f} us (norm alone {res['add_rms_norm_only_us']:.2f}, gemv alone "
              f"{res['gemv_only_us']:.2f}) | saved {res['saved_us']:.2f} us | fused/gemv {res['fused_over_gemv']:.3f} | "
              f"error/bound {res['error_over_bound']:.2f} | constant weight: fused {res['fused_constant_us']:.2f}, "
              f"split norm {res['split_constant_us']:.2f}, gemv alone {res['gemv_constant_us']:.2f}", flush=True)
        if res["error_over_bound"] > 1:
            raise SystemExit(f"kvrewrite::gemv_rms_norm is wrong on {cfg}: error {res['error_over_bound']:.2f}x the bound")
    Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.sweep:
        Path(args.sweep).write_text(json.dumps([dict(r, env=env, copy_gbps=copy) for r in records], indent=1))


if __name__ == "__main__":
    main()
