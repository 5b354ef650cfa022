"""Quality evaluation of the compression methods on real models: `kvrewrite eval`.

Tasks (one file each): nll (continuation NLL on Gutenberg text), needle (passphrase retrieval in
Paul Graham essays), fidelity (per-layer attention error and top-k recall against the full cache).
grid.py runs every method x budget x context with `full` as the reference and writes JSON;
report.py draws the plots and writes docs/results.md from that JSON.
"""
from kvrewrite.eval import fidelity, needle, nll
from kvrewrite.eval.grid import QUICK, EvalConfig, run_grid

TASKS = {t.name: t for t in (nll.TASK, needle.TASK, fidelity.TASK)}
__all__ = ["TASKS", "EvalConfig", "QUICK", "run_grid"]
