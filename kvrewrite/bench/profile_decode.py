"""Where the time of a kvrewrite decode step goes (torch.profiler, CUDA kernels), and how fast bare GEMVs are.

    python -m kvrewrite.bench.profile_decode --method chelsea --context 32768 [--batch B] [--fuse-projections] [--gemv]
    torchrun --nproc-per-node 2 -m kvrewrite.bench.profile_decode --tp 2 ...     (rank 0 prints; every rank profiles)

Same random Llama-3.1-8B-shaped model as `kvrewrite bench`. First the GEMVs of its shapes alone (batch 1,
bf16, each weight read from HBM: enough copies rotated past the L2, replayed as one CUDA graph), as a share
of the measured copy bandwidth. Then a real chunked prefill of `--context` random tokens (at `--batch` > 1 the
state `kvrewrite bench` fills synthetically for such rows: e2e.synthetic_fill), the decode steps
through rw.compile(fullgraph=True, mode="reduce-overhead") (or `--kv-compile graph`), and a profile of one
compressing step and of 16 plain steps: device time per kernel per step, most expensive first; with
`--layer-trace N`, N kernels of a plain step (from its 40th) in launch order, with their starts,
durations, the gaps between them and each one's cost to the step, PDL overlaps included (trace_rows; the
"where a layer's time goes" tables of docs/bench.md).
With `--tp N` (under torchrun, one GPU per rank): every rank builds only its share (bench/e2e.py,
build_rank_model) and applies with tp=N, the bare GEMV timings are skipped, and rank 0 prints.
Output: docs/bench/e2e_h100_decode_profile.txt is one such run.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

GEMV_SHAPES = ((4096, 4096), (1024, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336), (128256, 4096))


def gemv_us(n: int, k: int) -> float:
    """Per-call time of x[1, k] @ W[n, k]^T with W read from HBM (copies rotated past the L2), CUDA-graph timed."""
    from kvrewrite.bench.attention import _graph_us

    copies = min(64, max(2, (400 << 20) // (n * k * 2)))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    return _graph_us(F.linear, [(x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)])


def profile_steps(dec, rw, n_steps: int, compressing: bool, top: int, trace: int = 0) -> None:
    from torch.profiler import ProfilerActivity, profile

    while rw.schedule.due(1) != compressing:  # advance to the wanted kind of step
        dec.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n_steps):
            dec.step()
        torch.cuda.synchronize()
    timeline(p, n_steps)
    if trace:
        layer_trace(p, trace)
    events = [e for e in p.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / n_steps
    kernels = sum(e.count for e in events) / n_steps
    label = "compressing step" if compressing else "plain steps"
    print(f"\n== {label}: {n_steps} steps, kernel time per step {total / 1e3:.3f} ms, kernels per step {kernels:.0f}")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / n_steps:9.1f} us/step {e.count / n_steps:6.1f}/step  "
              f"{e.device_time_total / e.count:8.1f} us/call  {e.key[:100]}", flush=True)


def kernel_events(p) -> list:
    """The profile's CUDA kernels as (start, end, name) in launch order (us)."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in p.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)


def timeline(p, n_steps: int) -> None:
    """The kernels in launch order: per step the span from the first kernel's start to the last one's end, the idle
    time between kernels, and how many kernels started before the previous one ended (what programmatic dependent
    launch allows, kernels/_pdl.py; without it none do)."""
    spans = [(s, e) for s, e, _ in kernel_events(p)]
    if len(spans) < 2:
        return
    busy = sum(e - s for s, e in spans)
    idle = overlap = 0.0
    early = 0
    for (_, e0), (s1, _) in zip(spans, spans[1:]):
        if s1 < e0:
            early += 1
            overlap += e0 - s1
        else:
            idle += s1 - e0
    span = spans[-1][1] - spans[0][0]
    print(f"timeline: {len(spans) / n_steps:.0f} kernels/step, span {span / n_steps:.1f} us/step (kernels busy "
          f"{busy / n_steps:.1f}), idle between kernels {idle / n_steps:.1f} us/step, {early / n_steps:.0f} kernels/step "
          f"started before the previous one ended (overlapping {overlap / n_steps:.1f} us/step)", flush=True)


def trace_rows(stretch: list) -> list:
    """(start, duration, gap, cost, name) of each (start, end, name) kernel of `stretch`, in us: the start relative to
    the first kernel's, the gap since the previous kernel ended (negative: it started before, programmatic dependent
    launch), and the cost, the time from the latest end so far to its own end (0 if it ended before; the first
    kernel: its duration). With PDL a kernel starts before the one before it ends and waits, so the cost, not the
    duration, is what it adds to the step; the costs add up to the stretch's span."""
    if not stretch:
        return []
    t0 = latest = prev_end = stretch[0][0]
    rows = []
    for s, e, name in stretch:
        rows.append((s - t0, e - s, s - prev_end, max(0.0, e - latest), name))
        prev_end, latest = e, max(latest, e)
    return rows


def layer_trace(p, kernels: int = 14, skip: int = 40) -> None:
    """One stretch of a step's kernels in launch order (from the `skip`-th kernel of the profile: past the embedding
    and the first layers, a layer like the others): each kernel's start relative to the stretch, its duration, the
    gap since the previous kernel ended and its cost to the step (trace_rows)."""
    rows = trace_rows(kernel_events(p)[skip:skip + kernels])
    if not rows:
        return
    print(f"\nkernels {skip}-{skip + len(rows) - 1} of the profile (us: start, duration, gap since the previous end, "
          f"cost: from the latest end so far to its own)")
    for start, duration, gap, cost, name in rows:
        print(f"  {start:8.2f} {duration:8.2f} {gap:+7.2f} {cost:8.2f}  {name[:90]}")
    print(f"  stretch: {sum(r[3] for r in rows):.2f} us, kernels busy {sum(r[1] for r in rows):.2f} us", flush=True)


def main(argv=None):
    import os
    import sys

    import kvrewrite
    from kvrewrite.bench.e2e import (BenchConfig, KVDecoder, _free_cuda_graphs, _time_steps, apply_kernel_options,
                                     build_model, build_rank_model, copy_gbps, kernel_option, same_on_ranks,
                                     start_ranks, synthetic_fill)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="chelsea")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (> 1: synthetic state, no prefill)")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--prefill-chunk", type=int, default=1024)
    parser.add_argument("--kv-compile", default="inductor", choices=("inductor", "graph"))
    parser.add_argument("--fuse-projections", action="store_true")
    parser.add_argument("--gemv", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch without programmatic dependent launch (kernels/_pdl.py; rw.compile uses it)")
    parser.add_argument("--layer-trace", type=int, default=0, metavar="N",
                        help="print N kernels of a plain step in launch order, with their starts, durations and gaps")
    parser.add_argument("--no-gemv-timings", action="store_true", help="skip the bare GEMV timings")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (launch under torchrun)")
    parser.add_argument("--tp-all-reduce", default="auto", help="with --tp > 1: kvrewrite.apply's tp_all_reduce")
    parser.add_argument("--kernel-option", dest="kernel_options", action="append", type=kernel_option, default=[],
                        metavar="MODULE.NAME=VALUE", help="a kernel module's launch constant (as kvrewrite bench's)")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.batch > 1 and args.gemv:
        parser.error("--gemv is batch 1 only (kvrewrite::gemv takes one row); drop it with --batch > 1")
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode: needs a CUDA GPU")
    apply_kernel_options(dict(args.kernel_options))
    rank = start_ranks(BenchConfig(systems=(args.method,), device="cuda", tp=args.tp)) if args.tp > 1 else 0
    if rank:
        sys.stdout = open(os.devnull, "w")  # rank 0 speaks for all: every rank runs the same steps
    bw = copy_gbps("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | copy {bw:.0f} GB/s", flush=True)
    if args.no_pdl:
        from kvrewrite.kernels import _pdl

        _pdl.set_enabled(False)
    for n, k in () if args.no_gemv_timings or args.tp > 1 else GEMV_SHAPES:
        us = gemv_us(n, k)
        gbs = n * k * 2 / us / 1e3
        print(f"gemv {n}x{k}: {us:7.1f} us  {gbs:6.0f} GB/s  {gbs / bw * 100:5.1f}% of copy", flush=True)
    torch.cuda.empty_cache()

    dev = f"cuda:{torch.cuda.current_device()}"
    model = build_rank_model("llama-3.1-8b", args.tp, rank, dev) if args.tp > 1 else build_model("llama-3.1-8b", dev)
    opts = {} if args.method == "full" else {"budget": args.budget}
    if args.tp > 1:
        opts.update(tp=args.tp, tp_all_reduce=args.tp_all_reduce)
    rw = kvrewrite.apply(model, args.method, max_length=args.context + 320, prefill_chunk=args.prefill_chunk,
                         batch_size=args.batch, fuse_projections=args.fuse_projections, gemv=args.gemv, **opts)
    print(f"tp={args.tp} all-reduce {rw.tp_all_reduce}" if args.tp > 1 else "tp=1", flush=True)
    with torch.no_grad():
        if args.batch == 1:
            ids = same_on_ranks(torch.randint(1, model.config.vocab_size, (1, args.context), device=dev), args.tp)
            rw.prefill(ids, max_new_tokens=320)
        else:
            synthetic_fill(rw, args.context, 320)
        dec = KVDecoder(rw, args.kv_compile)
        t0 = time.perf_counter()
        dec.warm_up(3 * 32 + 2)
        torch.cuda.synchronize()
        print(f"decode warm-up (compile, CUDA graphs) {time.perf_counter() - t0:.1f} s", flush=True)
        steps = [s for _ in range(3) for s in _time_steps("cuda", 64, dec.step)]
        plain = [ms for ms, c in steps if not c]
        comp = [ms for ms, c in steps if c]
        print(f"{args.kv_compile}: ms/step {statistics.mean(ms for ms, _ in steps):.3f}  plain median "
              f"{statistics.median(plain):.3f}  compressing mean {statistics.mean(comp) if comp else float('nan'):.3f}")
        if dec.compresses:
            profile_steps(dec, rw, 1, True, args.top)
        profile_steps(dec, rw, 16, False, args.top, args.layer_trace)
    if args.tp > 1:  # the graphs first: NCCL's teardown hangs while a graph holding its kernels lives
        import torch.distributed as dist

        del dec, rw
        _free_cuda_graphs("cuda")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
