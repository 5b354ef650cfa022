"""Programmatic dependent launch (kernels/_pdl.py), measured: with and without it, in one process.

    python -m kvrewrite.bench.pdl [--out pdl.json] [--e2e snapkv,h2o] [--context 32768] [--variants pdl,no-pdl]
                                  [--kernel-option gemv_rms_norm.PRELOAD=True]

1. chain: the 128 projections of a Llama-3.1-8B decode step (32 layers x qkv 6144x4096, o 4096x4096, gate/up
   28672x4096, down 4096x14336, bf16) as kvrewrite::gemv calls in one CUDA graph, each reading the previous one's
   output; PDL off, on, on with constant weights (constant_weight=True: the first weight tile before the wait),
   twice (the order cancels drift). Outputs are compared bit for bit: PDL changes only when a kernel starts,
   never what it computes.
2. e2e (--e2e): kvrewrite bench's decode row (32k, B = 1, budget 0.2, Inductor + CUDA graphs, fused projections,
   gemv) per method and variant: "pdl" (rw.compile: the kvrewrite kernels with PDL, as by default: the model's
   weights are constant, so the GEMVs load their first tile before the wait), "pdl-wait-first" (the same with
   kernels.gemv.EARLY_WEIGHT off: every load after the wait), "no-pdl"
   (rw.compile after kernels._pdl.set_enabled(False)), "inductor-pdl" (PDL on Inductor's own kernels too:
   rw.compile(options={"triton.enable_pdl": True}), an experiment: runtime.py _OpaqueOpsCall says why it is not
   the default) and "decomposed" (nn.Module.compile, as before rw.compile kept the ops whole: Inductor traces them
   into its graph and launches their kernels itself, without PDL).
   The copy-bandwidth floor is measured once; each row's ratio uses it.
Writes JSON (--out): the machine, versions, every timing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvrewrite.bench.cuda_graphs import capture, warm_up
from kvrewrite.bench.e2e import apply_kernel_options, kernel_option

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # qkv, o, gate/up, down: out x in
LAYERS = 32


def gemv_chain(reps: int = 30, repeats: int = 5) -> dict:
    from kvrewrite.kernels import _pdl

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    ws = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02 for n, k in SHAPES]
          for _ in range(LAYERS)]
    x0 = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16, generator=gen)
    weight_bytes = sum(w.numel() * w.element_size() for layer in ws for w in layer)

    def chain(constant: bool):
        x = x0
        for layer in ws:
            for w in layer:
                x = torch.ops.kvrewrite.gemv(x[..., : w.shape[1]].contiguous(), w, None, constant)
        return x

    def run(pdl: bool, constant: bool) -> tuple[dict, torch.Tensor]:
        _pdl.set_enabled(pdl)
        outs = []
        try:
            warm_up(lambda: chain(constant))  # compiles
            g = capture(lambda: outs.append(chain(constant)))
        finally:
            _pdl.set_enabled(True)
        out = outs[0]
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(reps):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / reps)
        return dict(pdl=pdl, constant_weight=constant, ms=times, ms_median=statistics.median(times),
                    gbps=weight_bytes / (statistics.median(times) * 1e-3) / 1e9), out.clone()

    rows, outs = [], []
    for pdl, constant in ((False, False), (True, False), (True, True)) * 2:
        row, out = run(pdl, constant)
        rows.append(row)
        outs.append(out)
        print(f"chain pdl={pdl} constant_weight={constant}: {row['ms_median']:.3f} ms ({row['gbps']:.0f} GB/s)",
              flush=True)
    return dict(weight_bytes=weight_bytes, kernels=LAYERS * len(SHAPES), rows=rows,
                outputs_identical=all(torch.equal(outs[0], o) for o in outs[1:]))


VARIANTS = ("pdl", "pdl-wait-first", "no-pdl", "inductor-pdl", "decomposed")


def e2e(methods: list[str], context: int, variants=VARIANTS, done=lambda rows, bench: None) -> tuple:
    from torch import nn

    from kvrewrite.bench.e2e import Bench, BenchConfig
    from kvrewrite.kernels import _pdl
    from kvrewrite.kernels import gemv as gemv_kernel
    from kvrewrite.runtime import KVRewrittenModel

    cfg = BenchConfig(systems=tuple(methods), contexts=(context,), batches=("1",), kv_compile="inductor",
                      fuse_projections=True, gemv=True, prefill=False, out="/dev/null")
    cfg.validate()
    bench = Bench(cfg)
    own_compile = KVRewrittenModel.compile
    rows = []
    for method in methods:
        for variant in variants:
            torch._dynamo.reset()
            _pdl.set_enabled(variant in ("pdl", "pdl-wait-first", "inductor-pdl"))
            early = gemv_kernel.EARLY_WEIGHT
            gemv_kernel.EARLY_WEIGHT = early and variant != "pdl-wait-first"
            cfg.inductor_options = {"triton.enable_pdl": True} if variant == "inductor-pdl" else {}
            KVRewrittenModel.compile = nn.Module.compile if variant == "decomposed" else own_compile
            try:
                t0 = time.perf_counter()
                row = bench.measure(method, context, 1, "1")
            finally:
                KVRewrittenModel.compile = own_compile
                _pdl.set_enabled(True)
                gemv_kernel.EARLY_WEIGHT = early
            row.update(variant=variant, wall_s=time.perf_counter() - t0)
            rows.append(row)
            done(rows, bench)
            print(f"{method} {variant}: {row.get('ms_per_step', float('nan')):.3f} ms/token, plain "
                  f"{row.get('ms_plain_step_median', float('nan')):.3f}, {row.get('ratio_to_floor', float('nan')):.3f}x "
                  f"floor {row.get('error', '')}", flush=True)
    return rows, bench


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvrewrite.bench.pdl", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="pdl.json")
    p.add_argument("--e2e", default="", help="comma-separated methods for the end-to-end rows (none: chain only)")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--no-chain", action="store_true")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--kernel-option", dest="kernel_options", action="append", type=kernel_option, default=[],
                   metavar="MODULE.NAME=VALUE", help="a kernel module's launch constant, as kvrewrite bench takes it")
    args = p.parse_args(argv)
    apply_kernel_options(dict(args.kernel_options))
    if not torch.cuda.is_available():
        raise SystemExit("kvrewrite.bench.pdl measures a CUDA device; none is available")
    import triton

    import kvrewrite.kernels  # noqa: F401  (registers the ops)

    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               capability=list(torch.cuda.get_device_capability()), kernel_options=dict(args.kernel_options))

    def write():
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    def rows_done(rows, bench):  # written after every row: a run cut short keeps what it measured
        doc.update(e2e=rows, copy_gbps=bench.copy_gbps, env=bench.env)
        write()

    if not args.no_chain:
        doc["chain"] = gemv_chain()
        write()
    if args.e2e:
        variants = args.variants.split(",")
        unknown = set(variants) - set(VARIANTS)
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
        e2e(args.e2e.split(","), args.context, variants, rows_done)
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
