"""Where the time of a kvrewrite prefill goes, next to a dense HF prefill (torch.profiler, CUDA kernels).

    python -m kvrewrite.bench.profile_e2e --methods chelsea,full --context 32768 [--batch 8] [--compile]
                                          [--fuse-projections] [--prefill-chunk 2048]

Same random Llama-3.1-8B-shaped model as `kvrewrite bench`; one warm-up prefill, then one profiled prefill
per method and one dense HF forward, of a [batch, context] prompt. --compile: the prefill chunks run through
rw.compile, as `kvrewrite bench --kv-compile inductor` runs them (its warm-up compiles and records the graphs).
Prints, per run, the wall time and the CUDA kernels with the most device time, grouped into attention /
compression / matmul / other.
"""
import argparse
import time

import torch

GROUPS = (("attention", ("clustered", "attn", "flash", "fmha", "sdpa")),
          ("compression", ("chelsea", "evict", "compress", "_merge", "_plan", "_select", "_similarity", "_prepare")),
          ("matmul", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "matmul")))


def _group(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k in low for k in keys):
            return g
    return "other"


def profile(fn, label: str, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    fn()  # warm-up
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = [e for e in p.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / 1e6
    groups = {}
    for e in events:
        groups[_group(e.key)] = groups.get(_group(e.key), 0) + e.device_time_total / 1e6
    print(f"\n== {label}: wall {wall:.2f} s, kernel time {total:.2f} s | " +
          ", ".join(f"{g} {s:.2f} s" for g, s in sorted(groups.items(), key=lambda x: -x[1])), flush=True)
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / 1e6:7.3f} s  {e.count:6d} x  {e.key[:110]}", flush=True)


def main():
    import kvrewrite
    from kvrewrite.bench.e2e import build_model, compile_rw
    from kvrewrite.cli import _csv

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", type=_csv(str), default=["chelsea", "full"])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--prefill-chunk", type=int, default=1024)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="rw.compile (Inductor + CUDA graphs) before prefill")
    parser.add_argument("--fuse-projections", action="store_true")
    args = parser.parse_args()
    model = build_model("llama-3.1-8b", "cuda")
    n = args.context
    ids = torch.randint(1, model.config.vocab_size, (args.batch, n), device="cuda")
    shape = f"n={n} batch={args.batch}"
    with torch.no_grad():
        profile(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), f"dense HF prefill {shape}", args.top)
        for m in args.methods:
            opts = {} if m == "full" else {"budget": args.budget}
            rw = kvrewrite.apply(model, m, max_length=n + 320, batch_size=args.batch,
                                 prefill_chunk=args.prefill_chunk, fuse_projections=args.fuse_projections, **opts)
            if args.compile:
                compile_rw(rw)
            profile(lambda rw=rw: rw.prefill(ids, max_new_tokens=320), f"kvrewrite {m} prefill {shape} chunk "
                    f"{args.prefill_chunk}{' compiled' if args.compile else ''}", args.top)
            rw = None  # free the state before the next method
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
