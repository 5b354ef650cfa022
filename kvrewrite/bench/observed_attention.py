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

With --sweep-splits, per config instead: the attention kernel alone and with the pending rows (a step that only
saves its query, and one that folds) at split counts 1, 2, 3, 4, 6, 8 and the op's own, with 128- and 64-slot
tiles, the kernel launched directly with those choices (docs/bench/attention_notes.md, "Large batches").

Run:  python -m kvrewrite.bench.observed_attention --out observed_attention.json [--configs 1x6656,40x6656]
      [--sweep-splits]
"""
import argparse
import json

import torch
from torch._library.triton import set_wrap_triton_enabled

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import Config, _graph_us, _make_sets, start_run
from kvrewrite.kernels import clustered_attention as ca
from kvrewrite.kernels.observed_attention import pending_entries

CONFIGS = [(1, 4096), (1, 6656), (1, 16384), (1, 32768), (1, 131072), (8, 6656), (8, 32768)]


def method_state(cfg: Config, P: int) -> tuple:
    """(score, pending q, pending lse, fill) of one input set: P pending queries (finite lse: something to fold)."""
    B, Hkv, C, G = cfg.B, cfg.Hkv, cfg.C, cfg.Hq // cfg.Hkv
    return (torch.zeros(B, Hkv, C, device="cuda"), torch.randn(B, Hkv, P, G, cfg.D, device="cuda"),
            torch.full((B, Hkv, P, G), 30.0, device="cuda"), torch.full((B, Hkv), C, device="cuda"))


def folding_position(C: int, P: int) -> int:
    """A step position that folds the pending entries (c mod P == 0); the one after it only saves its query."""
    return P * (C // P + 1)


def run(B: int, C: int) -> dict:
    cfg = Config(B=B, C=C)
    G = cfg.Hq // cfg.Hkv

    P = pending_entries(G)
    sets = [(*s, *method_state(cfg, P)) for s in _make_sets(cfg)]
    cycle = folding_position(C, P)

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


def sweep_splits(B: int, C: int) -> list:
    """Rows of (splits, block_n) -> us of the decode kernel alone ("attention"), with P pending queries at a step
    that only saves its own ("save") and at one that folds them ("fold"); the launch choices forced, the rest of
    the launch the op's (module docstring)."""
    cfg = Config(B=B, C=C)
    G = cfg.Hq // cfg.Hkv
    P = pending_entries(G)
    sets = _make_sets(cfg)
    states = [dict(zip(("score", "q", "lse", "fill"), method_state(cfg, P)), scale=1.0) for _ in sets]
    cycle = folding_position(C, P)

    def call(pending, fold, **tuning):
        def fn(i):
            q, k, v, bias, pos, cp = sets[i]
            cp = torch.full_like(cp, cycle if fold else cycle + 1)
            st = states[i]
            with set_wrap_triton_enabled(False):  # launch the kernel itself, with the forced choices
                if pending:
                    return ca._launch(q, k, v, bias, pos, cp, cfg.D**-0.5, 0, True, lse=st["lse"], pending=st,
                                      save_q=st["q"], **tuning)
                return ca._launch(q, k, v, bias, pos, cp, cfg.D**-0.5, 0, True, **tuning)
        return fn

    sms = ca._num_sms(torch.device("cuda"))
    own = {name: ca._launch_config(B, cfg.Hkv, G, 1, C, cfg.D, sms, resident=r)["num_splits"]
           for name, r in (("attention", ca.RESIDENT_PROGRAMS), ("pending", ca.RESIDENT_PROGRAMS_PENDING))}
    index = [(i,) for i in range(len(sets))]
    rows = []
    for splits in sorted({1, 2, 3, 4, 6, 8, *own.values()}):
        for block_n in (128, 64):
            tuning = dict(num_splits=splits, block_n=block_n)
            us = dict(attention=_graph_us(call(False, False, **tuning), index),
                      save=_graph_us(call(True, False, **tuning), index),
                      fold=_graph_us(call(True, True, **tuning), index))
            rows.append(dict(B=B, C=C, splits=splits, block_n=block_n, own_splits=own, us=us))
            print(f"B={B:<3} C={C:<6} splits {splits} block_n {block_n:3}: attention {us['attention']:7.1f} us, "
                  f"pending save {us['save']:7.1f}, fold {us['fold']:7.1f} (the op's splits: {own})", flush=True)
    del sets, states
    torch.cuda.empty_cache()
    return rows


def parse_configs(text: str) -> list:
    """"BxC,BxC,..." (batch x slots, e.g. "1x6656,40x6656") as [(B, C)]; ValueError naming a bad item."""
    out = []
    for item in text.split(","):
        b, _, c = item.strip().partition("x")
        if not (b.isdigit() and c.isdigit() and int(b) > 0 and int(c) > 0):
            raise ValueError(f"--configs: {item!r} is not BxC with positive integers (e.g. 40x6656)")
        out.append((int(b), int(c)))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="observed_attention.json")
    parser.add_argument("--reruns", type=int, default=2, help="times the whole grid is measured (a range)")
    parser.add_argument("--sweep-splits", action="store_true",
                        help="time the kernel at forced split counts and tile sizes instead (module docstring)")
    parser.add_argument("--configs", default=None,
                        help="BxC,... batch x slots to measure instead of the default grid " +
                        ",".join(f"{b}x{c}" for b, c in CONFIGS))
    args = parser.parse_args(argv)
    try:
        configs = CONFIGS if args.configs is None else parse_configs(args.configs)
    except ValueError as e:
        parser.error(str(e))
    env, copy = start_run()
    if args.sweep_splits:
        rows = [dict(row, rerun=i) for i in range(args.reruns) for B, C in configs for row in sweep_splits(B, C)]
    else:
        rows = [dict(run(B, C), rerun=i) for i in range(args.reruns) for B, C in configs]
    with open(args.out, "w") as f:
        json.dump(dict(env=env, copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
