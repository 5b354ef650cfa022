"""Decode attention with H2O/SnapKV statistics on the GPU: the fused op vs the attention alone vs the two ops.

What the statistics cost (issue: at most 3% of the attention time): per config, CUDA-graph time per call of
  - attention:  kvrewrite::clustered_attention (past_only, as the decode graphs call it)
  - deferred:   kvrewrite::observed_attention, defer=True, mode "all" (H2O's plain decode step): the mean over
                the P steps of a cycle (P = pending_entries(G), 3 here) of the step that folds the P pending
                queries in the attention kernel's free tile rows (deferred_fold: position c mod P == 0) and the
                P - 1 that only save their query (deferred_save)
  - folded:     the same with defer=False, mode "all" and "window" (SnapKV; the same kernels): the decode step
                that compresses (scores stored by the attention kernel, one combine + fold kernel)
  - two ops:    clustered_attention then accumulate_attention (the graph before fuse_attention_observation)
Llama-3.1-8B layout (Hq 32, Hkv 8, D 128, bf16), T = 1, every slot used and visible (as kvrewrite.bench.attention,
whose timing this reuses: N calls in one CUDA graph over input sets rotated past the L2); the kernels do the
same work whether a query is pending or not. Extra traffic per slot and KV head, next to the 4 * D bytes of keys
and values: deferred, the score state's read and write (8 bytes) at one step in P; folded, also the G score rows'
write and read (8 * G bytes).

Run:  python -m kvrewrite.bench.observed_attention --out observed_attention.json
"""
import argparse
import json

import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import Config, _graph_us, _make_sets, start_run
from kvrewrite.kernels.observed_attention import pending_entries

CONFIGS = [(1, 4096), (1, 6656), (1, 16384), (1, 32768), (1, 131072), (8, 6656), (8, 32768)]


def run(B: int, C: int) -> dict:
    cfg = Config(B=B, C=C)
    G = cfg.Hq // cfg.Hkv

    P = pending_entries(G)

    def method_state():  # score, P pending queries (finite lse: something to fold), fill
        return (torch.zeros(B, cfg.Hkv, C, device="cuda"), torch.randn(B, cfg.Hkv, P, G, cfg.D, device="cuda"),
                torch.full((B, cfg.Hkv, P, G), 30.0, device="cuda"), torch.full((B, cfg.Hkv), C, device="cuda"))

    sets = [(*s, *method_state()) for s in _make_sets(cfg)]
    cycle = P * (C // P + 1)  # a position that folds (c mod P == 0); cycle + 1 only saves its query

    def at(c):  # the sets with the step's position c (past_only: it only picks fold or save)
        return [(*s[:5], torch.full_like(s[5], c), *s[6:]) for s in sets]
    scale = cfg.D**-0.5
    ops = torch.ops.kvrewrite

    def attention(q, k, v, bias, pos, cp, *state):
        return ops.clustered_attention(q, k, v, bias, pos, cp, scale, 0, past_only=True)

    def fused(mode, defer):
        def call(q, k, v, bias, pos, cp, score, pq, plse, fill):  # (the work does not depend on the data)
            return ops.observed_attention(q, k, v, bias, pos, cp, scale, 0, score, pq, plse, fill, mode, 32, True,
                                          defer)
        return call

    def two_ops(q, k, v, bias, pos, cp, score, *state):
        out = ops.clustered_attention(q, k, v, bias, pos, cp, scale, 0, past_only=True)
        ops.accumulate_attention(q, k, bias, pos, cp, score, scale, 0, "all")
        return out

    us = {name: _graph_us(fn, sets) for name, fn in
          (("attention", attention), ("folded_all", fused("all", False)), ("folded_window", fused("window", False)),
           ("two_ops", two_ops))}
    us["deferred_fold"] = _graph_us(fused("all", True), at(cycle))
    us["deferred_save"] = _graph_us(fused("all", True), at(cycle + 1))
    us["deferred"] = (us["deferred_fold"] + (P - 1) * us["deferred_save"]) / P
    del sets
    torch.cuda.empty_cache()
    over = {k: us[k] / us["attention"] - 1 for k in us if k != "attention"}
    row = dict(B=B, C=C, Hq=cfg.Hq, Hkv=cfg.Hkv, D=cfg.D, dtype=cfg.dtype, pending_entries=P, us=us, overhead=over)
    print(f"B={B:<2} C={C:<7} attention {us['attention']:7.1f} us | deferred {us['deferred']:7.1f} "
          f"(+{100 * over['deferred']:.1f}%; fold +{100 * over['deferred_fold']:.1f}%, save "
          f"+{100 * over['deferred_save']:.1f}%) | folded all {us['folded_all']:7.1f} (+{100 * over['folded_all']:.1f}%) "
          f"window {us['folded_window']:7.1f} (+{100 * over['folded_window']:.1f}%) | two ops {us['two_ops']:8.1f} "
          f"(+{100 * over['two_ops']:.0f}%)", flush=True)
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
