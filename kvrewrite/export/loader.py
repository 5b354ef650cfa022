"""Run generation from an exported directory (torch_export, aoti or onnx), without the capture
machinery: `kvrewrite.export.loader.load(path).generate(input_ids, attention_mask, ...)`.

The loader reads kvrewrite_export.json, rebuilds the method from its name and options (for the
per-generation budgets and thresholds), allocates the layer state at the recorded capacities (the
method's own state fields, e.g. H2O's scores, ClusterKV's cluster index or KVMerger's degrees, as the JSON's
"method_state" records them, each filled with its field's reset value: KVMerger's degree with 1), and drives the
exported step graphs with kvrewrite.host.HostGeneration, the prefill / decode_step / generate that
KVRewrittenModel runs: left-padding to whole prefill chunks, the HostSchedule that picks the decode variant with or
without compression, and generate's Hugging Face side (kvrewrite.generation: the model's generation config, as
exported, merged with the arguments; HF's processors, sampling, EOS and padding). Errors and `last_timings` behave
as in `rw.generate` (same arguments).

Backends: "torch_export" (.pt2 ExportedPrograms, run by ExportedProgram.module()), "aoti"
(AOTInductor packages, torch._inductor.aoti_load_package), "onnx" (onnxruntime sessions, CPU by
default; the state goes in and the updated state comes out of every step) and "tensorrt"
(torch-tensorrt programs, functional like onnx; written against the documented API, never run:
see kvrewrite/export/tensorrt_export.py). All need `import kvrewrite`: the ops are Python custom
ops (for onnx only to read the metadata; the model runs in onnxruntime).
"""
import os
from pathlib import Path

import torch
from transformers import GenerationConfig

import kvrewrite  # noqa: F401  (registers the kvrewrite:: ops the programs call)
from kvrewrite.context import LayerInfo
from kvrewrite.export.common import META_FILE, rank_dir, read_metadata
from kvrewrite.host import HostGeneration
from kvrewrite.methods import make_method
from kvrewrite.state import STATE_FIELDS, StateField, allocate_layer_state


class ExportedModel(HostGeneration):
    """Generation over exported step graphs; `steps[name](ids, pos, cpos, valid, state) -> logits [B, T, V]`
    must leave the updated state in the `state` tensors. `prefill`, `decode_step`, `generate` and
    `reset` are kvrewrite.host.HostGeneration's, the ones KVRewrittenModel runs."""

    BATCH_FIXED_BY = "exported"

    def __init__(self, meta: dict, steps: dict):
        self.meta = meta
        self.steps = steps
        self.model_tag = meta["model_tag"]
        self.batch_size = meta["batch_size"]
        self.prefill_chunk = meta["prefill_chunk"]
        self.max_length = meta["max_length"]
        self.capacities = meta["capacities"]
        self.layers = [LayerInfo(**d) for d in meta["layers"]]
        self.method = make_method(meta["method"]["name"], **meta["method"]["options"])
        if hasattr(self.method, "bind"):
            self.method.bind(self.layers)
        self.device = torch.device(meta["device"])
        dtype = getattr(torch, meta["dtype"])
        # the method's own fields per layer, at the shapes recorded (exports without the key have none)
        self.state_specs = [{name: StateField(tuple(d["shape"]), getattr(torch, d["dtype"]), d["reset"])
                             for name, d in fields.items()}
                            for fields in meta.get("method_state", [{}] * len(self.layers))]
        self.state, self._layer_state = [], {}
        for info, cap, specs in zip(self.layers, self.capacities, self.state_specs):
            s = allocate_layer_state(self.batch_size, info.num_kv_heads, cap, info.head_dim, dtype, self.device,
                                     specs)
            self._layer_state[info.index] = s
            self.state += [s[f] for f in (*STATE_FIELDS, *specs)]  # the graphs' input order
        self.vocab_size = meta["vocab_size"]
        self.tp = meta.get("tp", {}).get("size", 1)  # > 1: generate feeds every rank rank 0's draws (host.py)
        # the model's generation config as exported (older exports: its eos and pad ids only): generate's defaults
        self.generation_config = GenerationConfig.from_dict(meta["generation"])

    def layer_state(self, i: int) -> dict:
        return self._layer_state[i]

    def _state_device(self):
        return self.device

    def _run_graph(self, name: str, ids, pos, cpos, valid):
        if name not in self.steps:
            raise ValueError(f"{self.model_tag}: graph {name!r} was not exported (exported: {sorted(self.steps)})")
        return self.steps[name](ids, pos, cpos, valid, self.state)


def _pt2_step(file):
    module = torch.export.load(file).module()

    def step(ids, pos, cpos, valid, state):
        return module(ids, pos, cpos, valid, *state)

    return step


def _aoti_step(file, device):
    runner = torch._inductor.aoti_load_package(str(file), device_index=device.index if device.type == "cuda" else -1)

    def step(ids, pos, cpos, valid, state):
        # compiled for contiguous inputs: a package reads its inputs by the example inputs' strides
        out = runner(ids.contiguous(), pos.contiguous(), cpos.contiguous(), valid.contiguous(), *state)
        return out[0] if isinstance(out, (list, tuple)) else out

    return step


def _onnx_step(file, providers):
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(file), providers=providers or ["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def step(ids, pos, cpos, valid, state):
        feeds = dict(zip(names, (t.cpu().numpy() for t in (ids, pos, cpos, valid, *state))))
        logits, *new_state = session.run(None, feeds)
        for t, new in zip(state, new_state):
            t.copy_(torch.from_numpy(np.asarray(new)))
        return torch.from_numpy(logits)

    return step


def _tensorrt_step(file):
    from kvrewrite.export.tensorrt_export import require_tensorrt

    require_tensorrt()  # the engines' plugins and execute_engine op are registered by torch_tensorrt
    module = torch.export.load(str(file)).module()

    def step(ids, pos, cpos, valid, state):
        logits, *new_state = module(ids, pos, cpos, valid, *state)
        for t, new in zip(state, new_state):
            t.copy_(new)
        return logits

    return step


def _rank_directory(d: Path):
    """(the rank's directory, its metadata) of a tensor-parallel export at `d` (rank<r> subdirectories): the
    process group is the default one, started here from torchrun's environment when it is not yet (as apply does);
    its size must be the export's and its name the one the graphs' all-reduces call. A one-shot export prepares
    its symmetric buffer (a collective: every rank loads alike)."""
    from kvrewrite.tensor_parallel import init_distributed

    first = read_metadata(rank_dir(d, 0))
    tp = first["tp"]["size"]
    missing = [r for r in range(tp) if not (rank_dir(d, r) / META_FILE).is_file()]
    if missing:
        raise FileNotFoundError(f"{d}: a tp={tp} export needs rank0..rank{tp - 1}; {missing} are missing")
    # the device only picks the backend of a group started here (NCCL on CUDA, torchrun's LOCAL_RANK-th GPU)
    cuda = torch.device(first["device"]).type == "cuda"
    rank, group = init_distributed(tp, torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda
                                   else torch.device("cpu"), "kvrewrite.export.loader.load")
    meta = read_metadata(rank_dir(d, rank))
    want = meta["tp"]
    if want["rank"] != rank or want["size"] != tp:
        raise ValueError(f"{rank_dir(d, rank)}: written by rank {want['rank']} of {want['size']}, loaded by rank "
                         f"{rank} of {tp}")
    if want["group_name"] != group:
        raise ValueError(f"{d}: the graphs' all-reduces call process group {want['group_name']!r}, this process's "
                         f"default group is {group!r}: load before creating other groups, with the default group "
                         f"started as at export")
    if want["all_reduce"] == "one_shot":
        from kvrewrite.kernels.tp_all_reduce import prepare

        prepare(group, torch.device(meta["device"]))
    return rank_dir(d, rank), meta


def load(path, onnx_providers=None) -> ExportedModel:
    """An ExportedModel over the graphs of the directory `path` (any target). A tensor-parallel export (torch_export
    of a tp > 1 model: rank<r> subdirectories): call it on every rank of a group of the export's size; each rank
    runs its own graphs, and generate gives every rank the same tokens (docs/tensor-parallel.md, "Exports")."""
    d = Path(path)
    if not (d / META_FILE).is_file() and (rank_dir(d, 0) / META_FILE).is_file():
        d, meta = _rank_directory(d)
    else:
        meta = read_metadata(d)
        if "tp" in meta:
            raise ValueError(f"{d}: one rank's share of a tp={meta['tp']['size']} export: load its parent directory "
                             f"on every rank")
    target = meta["target"]
    device = torch.device(meta["device"])
    steps = {}
    for name, file in meta["files"].items():
        if target == "torch_export":
            steps[name] = _pt2_step(d / file)
        elif target == "aoti":
            steps[name] = _aoti_step(d / file, device)
        elif target == "onnx":
            steps[name] = _onnx_step(d / file, onnx_providers)
        elif target == "tensorrt":
            steps[name] = _tensorrt_step(d / file)
        else:
            raise ValueError(f"{d}: unknown export target {target!r} (torch_export, aoti, onnx, tensorrt)")
    return ExportedModel(meta, steps)
