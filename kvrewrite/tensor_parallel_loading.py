"""The rank's share of a Hugging Face checkpoint, read from its safetensors files slice by slice.

    shard = kvrewrite.tensor_parallel_loading.load_rank_model(path, tp, rank, device=f"cuda:{rank}")
    rw = kvrewrite.apply(shard, "chelsea", budget=0.2, tp=tp)

Why: at tp = N a rank computes with 1/N of q/k/v/o, gate/up/down and the lm_head, but `from_pretrained` loads the
whole model on every rank, which a model as large as the card (Llama-3-70B: 141 GB in bf16 against an H200's 143 GB)
cannot do. Here the model is built with its parameters on the meta device (no memory) and its buffers real (RoPE's
inv_freq, Gemma's embed_scale: what the modules compute at construction), split by tensor_parallel.rank_model, which
records the slice each split tensor keeps (RankShard.slices), and each parameter is then read from the checkpoint:
the rank's rows or columns of a split one (safetensors reads only those bytes: `get_slice`), the whole tensor of
the rest, in the checkpoint's dtype unless `dtype`, straight to `device`. A tied output embedding is tied again to
the input embedding (split by vocabulary rows: a row view of it, as rank_model makes). The result is what
rank_model gives from the whole model loaded by from_pretrained, bit for bit (tests/test_tensor_parallel_loading.py).

Refused, by name: a folder without config.json or safetensors files, a parameter the checkpoint does not hold
(besides a tied output embedding), a tensor of another shape; the model types and splits rank_model refuses.
Reads local folders only (no hub download: give the folder huggingface_hub's snapshot_download made).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside goes to the meta device as it is registered (before a module's own
    initialisation touches it), buffers stay where they are made: the model's shapes and its computed buffers
    without its weights' memory. (nn.Module.register_parameter is patched for the duration.)"""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_files(path: Path) -> dict:
    """{tensor name: safetensors file} of the checkpoint in folder `path` (its index, or its one file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"load_rank_model: {path} has no model.safetensors.index.json and no *.safetensors "
                                f"file (save with save_pretrained(..., safe_serialization=True))")
    from safetensors import safe_open

    names = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            names.update({k: f for k in st.keys()})
    return names


def _read(st, key: str, cut) -> torch.Tensor:
    """The tensor `key` of an open safetensors file, or only its slice `cut` = (dim, start, stop)."""
    if cut is None:
        return st.get_tensor(key)
    dim, a, z = cut
    part = st.get_slice(key)
    return part[a:z] if dim == 0 else part[:, a:z].contiguous()  # as rank_model's row-parallel copy


@torch.no_grad()
def load_rank_model(path, tp: int, rank: int, *, device="cpu", dtype: torch.dtype | None = None):
    """The rank's model of the Hugging Face checkpoint in folder `path` (module docstring), on `device`, in eval
    mode, marked as rank_model marks it: pass it to kvrewrite.apply(..., tp=tp) on that rank."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from kvrewrite.tensor_parallel import rank_model

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"load_rank_model: {path} has no config.json (a Hugging Face model folder, e.g. "
                                f"what save_pretrained or huggingface_hub.snapshot_download wrote)")
    config = AutoConfig.from_pretrained(path)
    with _parameters_on_meta():  # dtype None: from_config takes the checkpoint's (config.dtype)
        model = AutoModelForCausalLM.from_config(config, **({} if dtype is None else {"dtype": dtype}))
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    tag = f"load_rank_model({path.name})"
    shard = rank_model(model, tp, rank, tag)
    cuts = {name: (dim, a, z) for name, dim, a, z in shard.kvrewrite_shard.slices}
    # a tied lm_head split by vocabulary rows: a row view of the input embedding once that is read (the checkpoint
    # of a tied model need not hold it)
    vocab, tied = shard.kvrewrite_shard.vocab_parallel, shard.kvrewrite_shard.tied_output
    files = checkpoint_files(path)
    groups = {}  # one parameter under several names (a tied output embedding): read once, under the name saved
    for name, p in shard.named_parameters(remove_duplicate=False):
        if not (tied and name == vocab):
            groups.setdefault(id(p), (p, []))[1].append(name)
    saved = [(p, names, next((n for n in names if n in files), None)) for p, names in groups.values()]
    missing = [names[0] for p, names, key in saved if key is None]
    if missing:
        raise KeyError(f"{tag}: the checkpoint has no tensor for {len(missing)} parameters of the model (first: "
                       f"{missing[:3]}); its tensors are named like {sorted(files)[:3]}")
    buffers = [n for n, _ in shard.named_buffers() if n in files]  # persistent buffers the checkpoint holds
    with contextlib.ExitStack() as stack:
        opened = {}

        def read(key, cut):
            if files[key] not in opened:
                opened[files[key]] = stack.enter_context(safe_open(files[key], framework="pt"))
            return _read(opened[files[key]], key, cut)

        for p, names, key in saved:
            t = read(key, cuts.get(key))
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{tag}: the checkpoint's {key} has shape {tuple(t.shape)} where the rank's model "
                                 f"takes {tuple(p.shape)} (of a {config.model_type} config)")
            new = nn.Parameter(t.to(device=device, dtype=p.dtype), requires_grad=p.requires_grad)
            for name in names:
                owner, _, attr = name.rpartition(".")
                setattr(shard.get_submodule(owner), attr, new)
        if tied:
            _, a, z = cuts[vocab]
            owner, _, attr = vocab.rpartition(".")
            emb = shard.get_parameter(tied)
            setattr(shard.get_submodule(owner), attr, nn.Parameter(emb[a:z], requires_grad=emb.requires_grad))
        for name in buffers:
            owner, _, attr = name.rpartition(".")
            module = shard.get_submodule(owner)
            module._buffers[attr] = read(name, None).to(device=device, dtype=module._buffers[attr].dtype)
    for module in shard.modules():  # the buffers the modules computed at construction (RoPE, embedding scales)
        for attr, buf in module._buffers.items():
            if buf is not None:
                module._buffers[attr] = buf.to(device)
    return shard.eval()
