"""torch.export target: one .pt2 ExportedProgram per rewritten graph, plus the metadata JSON.

Each graph (prefill chunk, decode step, decode step with compression) is exported as it runs in the
runtime: inputs (input_ids, position_ids, cache_position, token_valid, *state), the state updated in
place by the kvrewrite ops (the programs keep the in-place custom ops; ExportedProgram.module() and
AOTInductor apply the writes to the caller's tensors), output the logits. Shapes are static (batch
size and prefill chunk fixed at apply time, as in the runtime). Loading needs `import kvrewrite`
(the ops are Python custom ops); kvrewrite.export.loader.load() runs generation from the directory.

Limits: every .pt2 holds its own copy of the weights (three copies on disk); the programs run on the
device they were exported on (the loader allocates the state there). Tensor parallel: one directory per rank.
"""
import torch

from kvrewrite.export.common import example_inputs, graph_of, write_export


def export_graph(rw, name: str) -> torch.export.ExportedProgram:
    """torch.export (non-strict) of one rewritten graph with its example inputs."""
    return torch.export.export(graph_of(rw, name, per_rank=True), example_inputs(rw, name), strict=False)


def torch_export(rw, path, graphs=None):
    """Write <path>/<graph>.pt2 for each graph (default: all three) and <path>/kvrewrite_export.json.

    Returns the directory; `kvrewrite.export.loader.load(path)` runs `generate` from it. A tensor-parallel model
    (tp > 1): call it on every rank with the same `path`; rank r writes <path>/rank<r> (its graphs with their
    all-reduces, its weight shards, its state layout), and `load(path)` on every rank of a group of the same size
    runs them (docs/tensor-parallel.md, "Exports").
    """
    return write_export(rw, path, graphs, "torch_export", ".pt2",
                        lambda name, file: torch.export.save(export_graph(rw, name), file), per_rank=True)
