"""Run generation from an exported directory (torch_export, aoti or onnx), without the capture
machinery: `kvrewrite.export.loader.load(path).generate(input_ids, attention_mask, ...)`.

The loader reads kvrewrite_export.json, rebuilds the method from its name and options (for the
per-generation budgets and thresholds), allocates the layer state at the recorded capacities, and
drives the exported step graphs with the host logic of kvrewrite.host, the same functions
KVRewrittenModel uses: left-padding to whole prefill chunks, the HostSchedule that picks the decode
variant with or without compression, and the token loop. Greedy and sampled decoding, EOS and
padding behave as in `rw.generate` (same arguments).

Backends: "torch_export" (.pt2 ExportedPrograms, run by ExportedProgram.module()), "aoti"
(AOTInductor packages, torch._inductor.aoti_load_package), "onnx" (onnxruntime sessions, CPU by
default; the state goes in and the updated state comes out of every step) and "tensorrt"
(torch-tensorrt programs, functional like onnx; written against the documented API, never run:
see kvrewrite/export/tensorrt_export.py). All need `import kvrewrite`: the ops are Python custom
ops (for onnx only to read the metadata; the model runs in onnxruntime).
"""
import time
from pathlib import Path

import torch

import kvrewrite  # noqa: F401  (registers the kvrewrite:: ops the programs call)
from kvrewrite.context import LayerInfo
from kvrewrite.export.common import read_metadata
from kvrewrite.host import HostSchedule, eos_and_pad, layer_budgets, prepare_prompt, token_loop
from kvrewrite.methods import make_method
from kvrewrite.state import STATE_FIELDS, allocate_layer_state, reset_layer_state


class _Generation:
    """eos/pad defaults read by kvrewrite.host.eos_and_pad (a GenerationConfig's two fields)."""

    def __init__(self, eos_token_id, pad_token_id):
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id


class ExportedModel:
    """Generation over exported step graphs; `steps[name](ids, pos, cpos, valid, state) -> logits [B, T, V]`
    must leave the updated state in the `state` tensors."""

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
        self.state = []
        for info, cap in zip(self.layers, self.capacities):
            s = allocate_layer_state(self.batch_size, info.num_kv_heads, cap, info.head_dim, dtype, self.device)
            self.state += [s[f] for f in STATE_FIELDS]
        self.generation_config = _Generation(**meta["generation"])

    def layer_state(self, i: int) -> dict:
        k = len(STATE_FIELDS)
        return dict(zip(STATE_FIELDS, self.state[i * k:(i + 1) * k]))

    def reset(self, n_prompt: int, max_new_tokens: int) -> None:
        budgets = layer_budgets(self.method, self.layers, n_prompt, max_new_tokens)
        for j, (target, threshold) in enumerate(budgets):
            reset_layer_state(self.layer_state(j), target, threshold)
        self.schedule = HostSchedule(budgets, self.batch_size)

    def step(self, name: str, ids, pos, cpos, valid):
        if name not in self.steps:
            raise ValueError(f"{self.model_tag}: graph {name!r} was not exported (exported: {sorted(self.steps)})")
        return self.steps[name](ids, pos, cpos, valid, self.state)

    @torch.no_grad()
    def prefill(self, input_ids, attention_mask=None, max_new_tokens: int = 0):
        ids, valid, position_ids, cache_position, n_real, n = prepare_prompt(
            input_ids, attention_mask, model_tag=self.model_tag, method=self.method, layers=self.layers,
            capacities=self.capacities, max_length=self.max_length, prefill_chunk=self.prefill_chunk,
            max_new_tokens=max_new_tokens, device=self.device)
        if ids.shape[0] != self.batch_size:
            raise ValueError(f"{self.model_tag}: exported for batch size {self.batch_size}, got {ids.shape[0]}")
        self.reset(n_real, max_new_tokens)
        valid_host = valid.cpu()
        logits = None
        for c in range(0, ids.shape[1], self.prefill_chunk):
            sl = slice(c, c + self.prefill_chunk)
            logits = self.step("prefill", ids[:, sl], position_ids[:, sl], cache_position[sl], valid[:, sl])
            self.schedule.step(valid_host[:, sl].sum(dim=1).tolist(), self.prefill_chunk, compress=True)
        self._next_position = position_ids[:, -1] + 1
        self._next_cache_position = torch.tensor([n], device=self.device)
        return logits[:, -1]

    @torch.no_grad()
    def decode_step(self, tokens):
        pos, cpos = self._next_position, self._next_cache_position
        valid = torch.ones(tokens.shape[0], 1, dtype=torch.bool, device=self.device)
        compress = self.schedule.due(1)
        name = "decode_compress" if compress else "decode"
        logits = self.step(name, tokens[:, None].to(self.device), pos[:, None], cpos, valid)
        self.schedule.step([1] * tokens.shape[0], 1, compress)
        self._next_position, self._next_cache_position = pos + 1, cpos + 1
        return logits[:, -1]

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 64, do_sample: bool = False,
                 temperature: float = 1.0, top_k=None, top_p=None, eos_token_id=None, pad_token_id=None,
                 generator=None, progress: bool = False):
        """As KVRewrittenModel.generate: [B, n + new], pad after EOS; timings in `last_timings`."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        eos, pad_token_id = eos_and_pad(eos_token_id, pad_token_id, self.generation_config)
        t0 = time.perf_counter()
        logits = self.prefill(input_ids, attention_mask, max_new_tokens)
        t1 = time.perf_counter()
        out = token_loop(logits, self.decode_step, max_new_tokens=max_new_tokens, eos=eos, pad_token_id=pad_token_id,
                         do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                         progress=progress)
        self.last_timings = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "new_tokens": len(out)}
        return torch.cat([input_ids.to(self.device), torch.stack(out, dim=1)], dim=1)


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


def load(path, onnx_providers=None) -> ExportedModel:
    """An ExportedModel over the graphs of the directory `path` (any target)."""
    d = Path(path)
    meta = read_metadata(d)
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
