"""What every deployment target shares: the graphs exported, their example inputs, and the metadata
JSON written next to the artifacts (everything the loader needs to run generation without the
capture machinery: layer facts and capacities, the method and its options, from which the per-
generation budgets and thresholds follow, the static sizes, the generation defaults and versions)."""
import dataclasses
import importlib.metadata
import json
from pathlib import Path

import torch

from kvrewrite.state import STATE_FIELDS

FORMAT = 1
META_FILE = "kvrewrite_export.json"
GRAPHS = ("prefill", "decode", "decode_compress")  # rw.<name>_graph
INPUT_NAMES = ("input_ids", "position_ids", "cache_position", "token_valid")


def check_exportable(rw, per_rank: bool = False) -> None:
    """NotImplementedError for a tensor-parallel model (tp > 1) unless the target exports per rank (per_rank:
    torch_export, whose ExportedPrograms keep the rank's all-reduces and run them in the loader's process group;
    AOTInductor, ONNX and TensorRT have no collective to run them with here: docs/tensor-parallel.md, "Exports")."""
    if getattr(rw, "tp", 1) > 1 and not per_rank:
        raise NotImplementedError(f"{rw.model_tag}: this target does not export a tensor-parallel model (tp={rw.tp}): "
                                  "use kvrewrite.export.torch_export on every rank (one directory per rank), or "
                                  "apply the model with tp=1 (the default) and export that one")


def tp_metadata(rw) -> dict:
    """The rank's place in its group, for the loader (tp > 1 only): size, rank and the group name its graphs'
    all-reduces call (the capture's), how they sum (rw.tp_all_reduce) and the backend."""
    import torch.distributed as dist

    return {"size": rw.tp, "rank": rw.tp_rank, "group_name": rw.tp_group, "all_reduce": rw.tp_all_reduce,
            "backend": dist.get_backend()}


def rank_dir(path, rank: int) -> Path:
    """Where rank `rank` of a tensor-parallel export writes its graphs and metadata: <path>/rank<rank>."""
    return Path(path) / f"rank{rank}"


def graph_of(rw, name: str, per_rank: bool = False):
    check_exportable(rw, per_rank)  # every target reads its graphs here
    if name not in GRAPHS:
        raise ValueError(f"unknown graph {name!r}; the graphs are {GRAPHS}")
    return getattr(rw, f"{name}_graph")


def step_tokens(rw, name: str) -> int:
    return rw.prefill_chunk if name == "prefill" else 1


def example_inputs(rw, name: str) -> tuple:
    """(input_ids, position_ids, cache_position, token_valid, *state) for graph `name`, on rw's device;
    the state tensors are rw's own (export traces them with fake tensors, they are not written)."""
    B, T = rw.batch_size, step_tokens(rw, name)
    dev = rw.l0_fill.device
    ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    pos = torch.arange(T, device=dev).expand(B, T).contiguous()
    cpos = torch.arange(T, device=dev)
    valid = torch.ones(B, T, dtype=torch.bool, device=dev)
    return (ids, pos, cpos, valid, *rw.state_tensors())


def _version(pkg: str):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None  # recorded as null: informative only, never checked


def method_options(method) -> dict:
    """The method's constructor options (dataclass init fields), JSON-ready."""
    out = {}
    for f in dataclasses.fields(method):
        if not f.init:
            continue
        v = getattr(method, f.name)
        out[f.name] = {str(k): list(h) for k, h in v.items()} if isinstance(v, dict) else v
    return out


def method_state(rw) -> list:
    """Per layer, the method's own state fields as allocated: {name: {"shape", "dtype", "reset"}} (Method.
    state_fields; placed after the base fields of the layer in the graphs' inputs), for the loader."""
    out = []
    for info, specs in zip(rw.layers, rw.state_specs):
        out.append({name: {"shape": list(getattr(rw, f"l{info.index}_{name}").shape),
                           "dtype": str(getattr(rw, f"l{info.index}_{name}").dtype).removeprefix("torch."),
                           "reset": spec.reset}
                    for name, spec in specs.items()})
    return out


def metadata(rw, target: str, files: dict, **extra) -> dict:
    gen = getattr(rw, "generation_config", None)
    return {
        "format": FORMAT,
        "target": target,
        "files": files,
        "model_tag": rw.model_tag,
        "batch_size": rw.batch_size,
        "prefill_chunk": rw.prefill_chunk,
        "max_length": rw.max_length,
        "vocab_size": rw.vocab_size,
        "dtype": str(rw.l0_keys.dtype).removeprefix("torch."),
        "device": str(rw.l0_fill.device),
        "layers": [dataclasses.asdict(info) for info in rw.layers],
        "capacities": list(rw.capacities),
        "state_fields": list(STATE_FIELDS),
        "method_state": method_state(rw),
        "method": {"name": rw.method.name, "options": method_options(rw.method)},
        # the model's generation config (its non-default fields): the loader's generate defaults, as rw.generate's
        "generation": {} if gen is None else json.loads(gen.to_json_string(use_diff=True)),
        "versions": {"kvrewrite": _version("kvrewrite"), "torch": torch.__version__,
                     "transformers": _version("transformers")},
        **extra,
    }


def write_metadata(directory, meta: dict) -> Path:
    path = Path(directory) / META_FILE
    path.write_text(json.dumps(meta, indent=1))
    return path


def read_metadata(directory) -> dict:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no kvrewrite export metadata here (expected the directory written by "
                                f"kvrewrite.export.torch_export / aoti / onnx)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: export format {meta.get('format')!r}, this kvrewrite reads format {FORMAT}")
    return meta


def out_dir(path) -> Path:
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    return p


def write_export(rw, path, graphs, target: str, suffix: str, save, per_rank: bool = False, **extra) -> Path:
    """What every target's entry point does around its own export: check `graphs` (default: all three),
    create the directory `path` (<path>/rank<r> for rank r of a tensor-parallel model, for a target that exports
    per rank: `per_rank`), `save(name, file)` each graph to it as <name><suffix>, then write the metadata JSON
    (target, files, `extra`, and for tp > 1 the rank's place in its group). Returns the directory."""
    check_exportable(rw, per_rank)  # before the directory is made
    graphs = check_graphs(graphs)
    if getattr(rw, "tp", 1) > 1:  # every rank writes its own directory under `path`
        extra = dict(extra, tp=tp_metadata(rw))
        path = rank_dir(path, extra["tp"]["rank"])
    d = out_dir(path)
    files = {}
    for name in graphs:
        files[name] = f"{name}{suffix}"
        save(name, d / files[name])
    write_metadata(d, metadata(rw, target, files, **extra))
    return d


def check_graphs(graphs) -> tuple:
    graphs = tuple(GRAPHS if graphs is None else graphs)
    bad = [g for g in graphs if g not in GRAPHS]
    if bad:
        raise ValueError(f"unknown graph(s) {bad}; the graphs are {GRAPHS}")
    return graphs
