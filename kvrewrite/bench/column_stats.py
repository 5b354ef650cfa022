"""kvrewrite::attention_column_stats at a prefill chunk's shape: launch variants, next to the chunk's attention.

    python -m kvrewrite.bench.column_stats [--out s.json] [--batch 8] [--chunk 2048] [--slots 8704] [--quick]

Why: H2O's prefill chunk sums every query's probabilities (the full walk: as many q·k products as the chunk's
attention has q·k products); on an H200 at batch 8 and 32k that walk took 7.4 s of an 18.8 s compiled prefill, the
chunk's attention (q·k and p·v) 4.9 s (docs/bench.md, "Stop 39 runs"). This times the stats kernel's tiles, warps
and stages and its code paths, attention_column_stats._launch_config's overrides: even_d (q and key tiles loaded as
16-byte vectors), sum_once (column sums reduced once after the walk), skip_masks (no per-element mask in blocks that
see the whole tile), pipeline (the visible query blocks bounded first, then walked with their loads pipelined). The
stop-40 grid made 128 x 64 tiles, 4 warps, even_d and sum_once h2o's default; --quick times single changes to it.
Layout: Llama-3.1-8B's (32 query heads, 8 KV heads, D = 128, bf16), `slots` visible slots whose last `chunk` are the
chunk's own (causal), the attention's lse given, as kvrewrite::observed_attention calls it for h2o and kvmerger
(last 0: no recent sums); then the recent-only walk of SnapKV's 32-query window. Each variant is timed by CUDA-graph
replay (bench/attention.py's timing); a variant Triton cannot compile (shared memory, registers) is recorded with
its error. Writes JSON: the machine, every variant's microseconds and q·k TFLOP/s, and the attention's time on the
same inputs.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

VARIANTS = dict(block_m=(64, 128), block_n=(64, 128), num_warps=(4, 8), even_d=(False, True), sum_once=(False, True))
UNTUNED = dict(block_m=64, block_n=64, num_warps=8, even_d=False, sum_once=False)  # the tiles before stop 40
# around h2o's default (the fastest of the stop-40 grid: 128 x 64 tiles, 4 warps, even_d, sum_once, skip_masks)
FOCUS = [dict(skip_masks=False), dict(num_stages=3), dict(num_warps=8), dict(block_n=128, num_warps=8),
         dict(block_m=64), dict(block_n=32), dict(pipeline=True), dict(pipeline=True, num_stages=3),
         dict(pipeline=True, num_warps=8), dict(pipeline=True, block_n=128, num_warps=8)]


def variants(quick: bool = False) -> list:
    """The launch overrides to time: {} (the default launch) first; quick: FOCUS, single changes to the default;
    otherwise the grid of VARIANTS (2 stages), the untuned tiles with 3 stages, with and without even_d and
    sum_once, and FOCUS."""
    if quick:
        return [{}] + FOCUS
    return ([{}] + [dict(zip(VARIANTS, values)) for values in itertools.product(*VARIANTS.values())]
            + [dict(UNTUNED, num_stages=3), dict(UNTUNED, num_stages=3, even_d=True, sum_once=True)] + FOCUS)


def qk_tflops(B: int, Hq: int, T: int, C: int, D: int, us: float) -> float:
    """q·k products of every (query, slot) pair, in TFLOP/s (2 flops a multiply-add)."""
    return 2 * B * Hq * T * C * D / us / 1e6


def _inputs(B, Hq, Hkv, T, C, D, dtype):
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, C, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, C, D, device="cuda", dtype=dtype)
    bias = torch.zeros(B, Hkv, C, device="cuda")
    pos = torch.arange(C, device="cuda").expand(B, Hkv, C).contiguous()
    cp = torch.arange(C - T, C, device="cuda")
    return q, k, v, bias, pos, cp


def main(argv=None):
    from kvrewrite.bench.attention import _graph_us, direct, start_run
    from kvrewrite.kernels import attention_column_stats as acs
    from kvrewrite.kernels import clustered_attention as ca

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--chunk", type=int, default=2048, help="queries of the chunk (T)")
    p.add_argument("--slots", type=int, default=8704, help="slots the chunk sees, its own included (C)")
    p.add_argument("--window", type=int, default=32, help="SnapKV's observation window for the recent-only row")
    p.add_argument("--quick", action="store_true", help="fewer variants: single changes to the default launch")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.column_stats needs a CUDA GPU")
    B, Hq, Hkv, T, C, D = args.batch, 32, 8, args.chunk, args.slots, 128
    if T > C:
        raise SystemExit(f"bench.column_stats: --chunk {T} must be <= --slots {C} (the chunk's own slots are among "
                         f"them)")
    env, copy = start_run()
    q, k, v, bias, pos, cp = _inputs(B, Hq, Hkv, T, C, D, torch.bfloat16)
    scale = D**-0.5
    lse = torch.empty(B, Hq, T, device="cuda")
    attn_us = _graph_us(direct(lambda *s: ca._launch(*s, scale, 0, False, lse=lse)), [(q, k, v, bias, pos, cp)])
    print(f"attention of the chunk (lse written): {attn_us:.0f} us, {2 * qk_tflops(B, Hq, T, C, D, attn_us):.0f} "
          f"TFLOP/s (q·k and p·v)", flush=True)
    rows = []
    calls = [(t, True, 0) for t in variants(args.quick)] + [({}, False, args.window)]
    for tuning, need_total, last in calls:  # as h2o, then snapkv
        row = dict(tuning=tuning, need_total=need_total, last=last)
        try:
            launch = direct(lambda *s: acs._launch(*s, lse, scale, 0, row["last"], need_total, tuning))
            us = _graph_us(launch, [(q, k, bias, pos, cp)])
            row.update(us=us, tflops=qk_tflops(B, Hq, T, C, D, us), vs_attention=us / attn_us)
            print(f"{'full walk' if need_total else 'recent only'} {tuning or 'default'}: {us:.0f} us, "
                  f"{row['tflops']:.0f} TFLOP/s q·k, {row['vs_attention']:.2f}x the attention", flush=True)
        except Exception as e:  # noqa: BLE001  (a variant that does not compile is recorded, not fatal)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{tuning}: {row['error']}", flush=True)
        rows.append(row)
    doc = dict(env=env, copy_gbps=copy, shape=dict(B=B, Hq=Hq, Hkv=Hkv, T=T, C=C, D=D, dtype="bf16"),
               attention_us=attn_us, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
