"""Decode attention with H2O/SnapKV statistics on the GPU: the fused op vs the attention alone vs the two ops.

What the statistics cost (issue: at most 3% of the attention time): per config, CUDA-graph time per call of
  - attention:  kvrewrite::clustered_attention (past_only, as the decode graphs call it)
  - fused:      kvrewrite::observed_attention, mode "all" (H2O) and "window" (SnapKV; the same kernels)
  - two ops:    clustered_attention then accumulate_attention (the graph before fuse_attention_observation)
Llama-3.1-8B layout (Hq 32, Hkv 8, D 128, bf16), T = 1, every slot used and visible (as kvrewrite.bench.attention,
whose timing this reuses: N calls in one CUDA graph over input sets rotated past the L2). The fused op's extra
traffic is the score rows (G * 4 bytes per slot and KV head, written and read back) and the score state
(4 bytes read, 4 written), against 4 * D bytes of keys and values.

Run:  python -m kvrewrite.bench.observed_attention --out observed_attention.json
"""
import argparse
import json

import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import Config, _graph_us, _make_sets, start_run

CONFIGS = [(1, 4096), (1, 6656), (1, 16384), (1, 32768), (1, 131072), (8, 6656), (8, 32768)]


def run(B: int, C: int) -> dict:
    cfg = Config(B=B, C=C)
    sets = [(*s, torch.zeros(B, cfg.Hkv, C, device="cuda")) for s in _make_sets(cfg)]  # + a score state
    scale = cfg.D**-0.5
    ops = torch.ops.kvrewrite

    def attention(q, k, v, bias, pos, cp, score):
        return ops.clustered_attention(q, k, v, bias, pos, cp, scale, 0, past_only=True)

    def fused(mode):
        return lambda q, k, v, bias, pos, cp, score: ops.observed_attention(q, k, v, bias, pos, cp, scale, 0, score,
                                                                            mode, 32, True)

    def two_ops(q, k, v, bias, pos, cp, score):
        out = ops.clustered_attention(q, k, v, bias, pos, cp, scale, 0, past_only=True)
        ops.accumulate_attention(q, k, bias, pos, cp, score, scale, 0, "all")
        return out

    us = {name: _graph_us(fn, sets) for name, fn in
          (("attention", attention), ("fused_all", fused("all")), ("fused_window", fused("window")),
           ("two_ops", two_ops))}
    del sets
    torch.cuda.empty_cache()
    row = dict(B=B, C=C, Hq=cfg.Hq, Hkv=cfg.Hkv, D=cfg.D, dtype=cfg.dtype, us=us,
               fused_overhead=us["fused_all"] / us["attention"] - 1,
               fused_window_overhead=us["fused_window"] / us["attention"] - 1,
               two_ops_overhead=us["two_ops"] / us["attention"] - 1)
    print(f"B={B:<2} C={C:<7} attention {us['attention']:7.1f} us | fused all {us['fused_all']:7.1f} "
          f"(+{100 * row['fused_overhead']:.1f}%) window {us['fused_window']:7.1f} "
          f"(+{100 * row['fused_window_overhead']:.1f}%) | two ops {us['two_ops']:8.1f} "
          f"(+{100 * row['two_ops_overhead']:.0f}%)", flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="observed_attention.json")
    parser.add_argument("--reruns", type=int, default=2, help="times the whole grid is measured (a range)")
    args = parser.parse_args()
    env, copy = start_run()
    rows = [dict(run(B, C), rerun=i) for i in range(args.reruns) for B, C in CONFIGS]
    with open(args.out, "w") as f:
        json.dump(dict(env=env, copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
