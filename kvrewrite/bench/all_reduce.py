"""The all-reduce of tensor parallelism, measured: the group's NCCL all-reduce against kvrewrite::tp_all_reduce's
kernels over symmetric memory (kernels/tp_all_reduce.py), by message size, inside CUDA graphs.

    torchrun --standalone --nproc-per-node 2 -m kvrewrite.bench.all_reduce [--out all_reduce.json] [--plot p.png]
                                                                         [--sizes 8192,16384,...] [--chain 64]

Per size (bytes of bf16) and variant, one CUDA graph of `--chain` all-reduces, each summing the previous one's
output (what a decode step does: 2 per layer, one after the other); the time per call is the median replay over
the chain length, every rank replaying at once after a barrier. Variants:
  nccl       _c10d_functional.all_reduce + wait_tensor (what the graphs ran before the one-shot op)
  one_shot   torch.ops.symm_mem.one_shot_all_reduce_copy on a buffer of the largest size (the op's one-shot path
             with PUSH = False)
  push       kvrewrite::tp_all_reduce with its push kernel (the default; sizes up to ONE_SHOT_MAX_BYTES, the
             collective above: kernels/_tp_all_reduce_kernels.py)
  two_shot   copy into the buffer, torch.ops.symm_mem.two_shot_all_reduce_out (reduce-scatter + all-gather)
Each variant's last output is compared with NCCL's, bit for bit at 2 ranks. The one-shot cut of the op
(ONE_SHOT_MAX_BYTES) follows these numbers. Rank 0 writes the JSON (and the plot: time per call against size).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

SIZES = (8192, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 32 << 20)
VARIANTS = ("nccl", "one_shot", "two_shot", "push")


def _variant(name: str, group: str, buf: torch.Tensor):
    c10d, symm = torch.ops._c10d_functional, torch.ops.symm_mem

    def nccl(x):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    def one_shot(x):
        return symm.one_shot_all_reduce_copy(buf[: x.numel()], x, "sum", group)

    def two_shot(x):
        view = buf[: x.numel()]
        view.copy_(x)
        out = torch.empty_like(x)
        symm.two_shot_all_reduce_out(view, "sum", group, out)
        return out

    def push(x):
        return torch.ops.kvrewrite.tp_all_reduce(x, group)

    return {"nccl": nccl, "one_shot": one_shot, "two_shot": two_shot, "push": push}[name]


def measure(sizes, variants, chain: int, replays: int = 12) -> list:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from kvrewrite.bench.cuda_graphs import capture, timed_replays_us, warm_up

    group = dist.group.WORLD.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = symm_mem.empty(max(sizes) // 2, dtype=torch.bfloat16, device=dev)
    symm_mem.rendezvous(buf, group)
    if "push" in variants:
        from kvrewrite.kernels import tp_all_reduce

        tp_all_reduce.PUSH = True
        tp_all_reduce.prepare(group, dev)
    gen = torch.Generator(device=dev).manual_seed(dist.get_rank())
    rows = []
    for size in sizes:
        x0 = torch.randn(size // 2, generator=gen, device=dev).to(torch.bfloat16) * 1e-3
        row, ref = dict(bytes=size), None
        for name in variants:
            step = _variant(name, group, buf)
            x = x0.clone()

            def run():
                y = x
                for _ in range(chain):
                    y = step(y)
                return y

            warm_up(run, 2)
            graph = capture(run)
            times = timed_replays_us(graph, replays, chain, before=lambda: (dist.barrier(), torch.cuda.synchronize()))
            out = run()  # eagerly, for the comparison
            if ref is None:
                ref = out
            row[f"{name}_us"] = statistics.median(times[2:])
            row[f"{name}_same_as_{variants[0]}"] = bool(torch.equal(out, ref))
            del graph
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    return rows


def plot(rows, variants, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in variants:
        ax.plot([r["bytes"] for r in rows], [r[f"{name}_us"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message (bytes, bf16)")
    ax.set_ylabel("us per all-reduce (in a CUDA graph)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvrewrite.bench.all_reduce", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="all_reduce.json")
    p.add_argument("--plot", default="")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated message sizes in bytes")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--chain", type=int, default=64, help="all-reduces per CUDA graph, each on the previous output")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown or not variants:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if any(s < 16 or s % 16 for s in sizes):
        raise SystemExit(f"--sizes: every size must be a positive multiple of 16 bytes, got {sizes}")
    if "WORLD_SIZE" not in os.environ or not torch.cuda.is_available():
        raise SystemExit("kvrewrite.bench.all_reduce runs on GPUs under torchrun: "
                         "torchrun --standalone --nproc-per-node 2 -m kvrewrite.bench.all_reduce")
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        rows = measure(sizes, variants, args.chain)
        if dist.get_rank() == 0:
            doc = dict(device=torch.cuda.get_device_name(), world=dist.get_world_size(), torch=torch.__version__,
                       nccl=".".join(map(str, torch.cuda.nccl.version())), chain=args.chain, rows=rows,
                       env={k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                       "NCCL_PROTO", "NCCL_ALGO") if k in os.environ})
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
            if args.plot:
                plot(rows, variants, args.plot, f"{doc['world']} x {doc['device']}, torch {doc['torch']}, "
                                                f"NCCL {doc['nccl']}")
            print(f"wrote {args.out}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
