"""`kvrewrite bench --isolate`: every row of the grid in a fresh Python process.

Why: what one row leaves on the GPU (Inductor's compiled graphs and their CUDA-graph memory pools, cuBLAS and
cuDNN workspaces, blocks of the caching allocator) is not all given back by gc and torch.cuda.empty_cache, so a
row after a large one can run out of memory: the HF-compiled max-batch row after EMS's failed that way (72.8 GiB
still held; docs/bench.md). A process per row releases everything by construction, so the rows of one run,
"max" batches included, cannot starve each other. The cost: each row builds the model and captures its graphs
again (tens of seconds at the 8B shape).

"max" batches are found by trying: the byte estimate first (Bench.max_batch), then SHRINK times fewer rows after
an out-of-memory failure, at most MAX_TRIES tries; the row records the batches it tried (`max_batch_tries`).

The parent plans on the meta device (no weights on the GPU) and only reads the card's size; each row's process
measures its own copy bandwidth and floor (the row's `copy_gbps`), writes its row to a file the parent reads, and
prints its own progress.

    python -m kvrewrite.bench.e2e_isolated ROW_SPEC.json RESULT.json   (what the parent runs per row)
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvrewrite.bench.e2e import Bench, BenchConfig

MAX_TRIES = 3
SHRINK = 0.85
OOM_MARKERS = ("out of memory", "outofmemoryerror", "cublas_status_alloc_failed")


def out_of_memory(row: dict) -> bool:
    """Whether a row failed for want of device memory (the errors torch, cuBLAS and a killed process give)."""
    err = row.get("error", "").lower()
    return any(m in err for m in OOM_MARKERS)


def row_in_process(cfg: BenchConfig, planner: Bench, system: str, n: int, B: int, bspec: str, log=print) -> dict:
    """The row measured by a child process (this module's main); a child that dies without a result (killed for
    memory, a crash in a kernel) gives a row with its exit status as the error."""
    with tempfile.TemporaryDirectory(prefix="kvrewrite-bench-") as d:
        spec, out = Path(d) / "row.json", Path(d) / "result.json"
        spec.write_text(json.dumps(dict(config=dataclasses.asdict(cfg), system=system, context=n, batch=B,
                                        batch_spec=bspec)))
        proc = subprocess.run([sys.executable, "-m", "kvrewrite.bench.e2e_isolated", str(spec), str(out)])
        if out.is_file():
            return json.loads(out.read_text())
    row = planner.row_head(system, n, B, bspec)
    signal = " (killed: out of memory?)" if proc.returncode in (-9, 137) else ""
    row["error"] = f"the row's process exited with status {proc.returncode}{signal} and no result (its log is above)"
    log(f"{system} n={n} B={B}: {row['error']}")
    return row


def run_isolated(cfg: BenchConfig, log=print, run_row=row_in_process) -> dict:
    """`kvrewrite bench` with a process per row (module docstring); returns the written document."""
    cfg.validate()
    planner = Bench(cfg, planner=True)
    env = planner.env
    log(f"{env.get('gpu')} | torch {env['torch']} | transformers {env['transformers']} | triton "
        f"{env.get('triton', '-')} | git {env['git_sha'][:12]} | a process per row")
    planner.write()
    t_start = time.perf_counter()
    done = set()
    for system, n, bspec in planner.plan():
        B = planner.max_batch(system, n) if bspec == "max" else int(bspec)
        if (system, n, B) in done:
            continue
        done.add((system, n, B))
        if time.perf_counter() - t_start > cfg.time_budget:
            row = planner.row_head(system, n, B, bspec)
            row["skipped"] = f"time budget of {cfg.time_budget:.0f} s spent"
            planner.add(row, log)
            continue
        tries = []
        while True:
            tries.append(B)
            row = run_row(cfg, planner, system, n, B, bspec, log)
            if bspec != "max" or not out_of_memory(row) or len(tries) == MAX_TRIES or B == 1:
                break
            log(f"{system} n={n}: batch {B} ran out of memory; trying {max(1, int(B * SHRINK))}")
            B = max(1, int(B * SHRINK))
        if bspec == "max":
            row["max_batch_tries"] = tries
        if row.get("copy_gbps"):
            planner.copy_gbps = row["copy_gbps"]  # the document's figure: the latest row's own measurement
            planner.copy_rounds = row.get("copy_gbps_rounds")
        planner.add(row, log)
    return json.loads(Path(cfg.out).read_text())


def main(argv=None) -> int:
    """A child: measure the one row ROW_SPEC.json names and write it to RESULT.json."""
    spec_path, out_path = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(spec_path).read_text())
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["config"].items() if k in fields})
    cfg.validate()
    bench = Bench(cfg)
    with torch.no_grad():
        row = bench.measure(spec["system"], spec["context"], spec["batch"], spec["batch_spec"],
                            log=lambda s: print(s, flush=True))
    Path(out_path).write_text(json.dumps(row, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
