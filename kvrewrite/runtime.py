"""KVRewrittenModel: runs the rewritten prefill-chunk and decode-step graphs over the slot state.

Prefill is chunked: the prompt is left-padded to a whole number of `prefill_chunk` tokens and each
chunk runs the prefill graph, which appends to every layer's state and attends, then compresses
every layer's state (at the end of the step, see insert_cache_compression); so a layer never holds
more than its static capacity (the full-length dense cache never exists). Decode steps run the
decode graph; on the steps where the host-side schedule knows some layer reaches its threshold
(every g tokens) they run the variant that also holds the compression ops, so re-compression
happens inside the step without reading the device.
"""
import logging
import types

import torch
import torch._functorch.config  # noqa: F401  (_OpaqueOpsCall)
from torch import nn

from kvrewrite import offload
from kvrewrite.host import (  # noqa: F401  (HostSchedule and WINDOW_INTERVAL are re-exported)
    WINDOW_INTERVAL,
    HostGeneration,
    HostSchedule,
    layer_capacity,
    layer_state_fields,
)
from kvrewrite.inductor_fallback_log import shallow_operator_str
from kvrewrite.state import STATE_FIELDS, allocate_layer_state, full_length

logger = logging.getLogger(__name__)


class KVRewrittenModel(HostGeneration, nn.Module):
    """A Hugging Face causal LM whose KV cache is the clustered state of `method`.

    Call it like a step function, `rw(input_ids, position_ids, cache_position, token_valid)` ->
    logits [B, T, V], with T == prefill_chunk or 1; or use `generate`. `rw.compile(...)` compiles the
    step in place, so `generate` then runs compiled. `prefill`, `decode_step`, `generate` and `reset`
    come from kvrewrite.host.HostGeneration, shared with the exported-model loader.
    """

    def __init__(self, captured, graphs: dict, method, max_length: int, config=None):
        super().__init__()
        self.prefill_graph = graphs["prefill"]
        self.decode_graph = graphs["decode"]
        self.decode_compress_graph = graphs["decode_compress"]
        self.method = method
        self.layers = captured.layers
        self.model_tag = captured.model_tag
        self.batch_size = captured.batch_size
        self.prefill_chunk = captured.prefill_chunk
        self.max_length = max_length
        self.vocab_size = captured.vocab_size
        self.config = config
        self.tp = captured.tp  # tensor-parallel ranks: > 1 holds this rank's heads only (kvrewrite/tensor_parallel.py)
        self.tp_rank, self.tp_group = captured.tp_rank, captured.tp_group  # its rank; the group its all-reduces call
        self.tp_all_reduce = "collective"  # how tp > 1 sums over the ranks: apply sets what it chose (prepare_all_reduce)
        self.capacities = []
        self.state_specs = []  # per layer, the method's own state fields (Method.state_fields)
        self.host_fields = [tuple(method.host_fields(info)) for info in self.layers]  # per layer, in host memory
        if any(self.host_fields):
            offload.check_offload_device(captured.device, f"{method.name} offload='cpu'")
        for info, on_host in zip(self.layers, self.host_fields):
            cap = layer_capacity(info, method, max_length, self.prefill_chunk)
            specs = layer_state_fields(info, method)
            self.capacities.append(cap)
            self.state_specs.append(specs)
            state = allocate_layer_state(
                self.batch_size, info.num_kv_heads, cap, info.head_dim, captured.dtype, captured.device, specs, on_host,
                L=full_length(max_length, self.prefill_chunk),
            )
            for field in (*STATE_FIELDS, *specs):
                self.register_buffer(f"l{info.index}_{field}", state[field], persistent=False)

    # -- state ---------------------------------------------------------------------------------------
    def layer_fields(self, k: int) -> tuple:
        """The state field names of the k-th layer (of self.layers): the base ones, then the method's."""
        return (*STATE_FIELDS, *self.state_specs[k])

    def layer_state(self, i: int) -> dict:
        k = next(k for k, info in enumerate(self.layers) if info.index == i)
        return {f: getattr(self, f"l{i}_{f}") for f in self.layer_fields(k)}

    def state_tensors(self) -> list:
        """Every state tensor in the graphs' input order: per layer, the base fields then the method's."""
        return [getattr(self, f"l{info.index}_{f}") for k, info in enumerate(self.layers) for f in self.layer_fields(k)]

    def cache_bytes(self, seq_len: int | None = None) -> dict:
        """Bytes of the kvrewrite state (all fields as allocated, the method's own included) vs a dense HF static cache.

        "kvrewrite" is the whole state, wherever it lives; "host" the part in pinned host memory (ClusterKV's
        offload="cpu"), "device" the rest (on the model's device). The dense figure is keys + values for
        `seq_len` tokens (default max_length) per layer (sliding-window layers hold at most their window), at the
        state's dtype; "ratio" is kvrewrite / dense.
        """
        seq_len = self.max_length if seq_len is None else seq_len
        state = sum(t.numel() * t.element_size() for t in self.state_tensors())
        host = sum(getattr(self, f"l{info.index}_{f}").numel() * getattr(self, f"l{info.index}_{f}").element_size()
                   for info, fields in zip(self.layers, self.host_fields) for f in fields)
        dense = 0
        for info in self.layers:
            k = getattr(self, f"l{info.index}_keys")
            tokens = min(seq_len, info.window) if info.window else seq_len
            dense += 2 * self.batch_size * info.num_kv_heads * tokens * info.head_dim * k.element_size()
        return {"kvrewrite": state, "device": state - host, "host": host, "dense": dense, "ratio": state / dense}

    # -- compilation ---------------------------------------------------------------------------------
    def compile(self, *args, **kwargs):
        """nn.Module.compile (torch.compile of the step, in place), with the kvrewrite ops kept whole: Inductor calls
        each op, which launches its own Triton kernels, instead of tracing the kernels into its graph. Arguments as
        torch.compile's (e.g. fullgraph=True, mode="reduce-overhead").

        Why: measured on H200s (Llama-3.1-8B shape, 32k, batch 1, snapkv, Inductor + CUDA graphs; docs/bench.md
        "Stop 34 runs"), the decode step is faster than with the kernels traced in (one run with both, on an earlier
        commit: 5.31 vs 5.48 ms/token, PDL off; on this code 4.94 against other runs' 5.17-5.19) and compiles in a
        third of the time (warm-up 46-68 s against 142-165 s). And Inductor's
        launcher does not pass launch attributes to user kernels, so this is what lets them run with programmatic
        dependent launch (kernels/_pdl.py). torch.compile of the model by hand and the exporters still trace the
        kernels in (kernels/_triton_op.py).

        On CUDA, the batch-1 decode steps compile with Inductor's combo kernels unless `options` say otherwise
        (COMPILE_INDUCTOR_DEFAULTS): they launch the rotary embeddings of q and k as one kernel, so the cache append
        and the attention follow each other with programmatic dependent launch. Measured on an H200 (snapkv, 32k,
        batch 1; docs/bench.md "Stop 38 runs"): 4.56 against 4.63 ms/token in one device call. Prefill chunks and
        larger batches compile as before: combo kernels were not timed there.

        Each model compiles through a forward of its own (a copy of the method's code object): Dynamo keeps one cache
        of compiled variants per code object and counts recompiles against torch._dynamo.config.recompile_limit (8),
        so with one shared forward the third model compiled in a process (three step variants each) failed with
        FailOnRecompileLimitHit under fullgraph=True (docs/bench.md, "Stop 40 runs")."""
        self.forward = types.MethodType(_own_code(type(self).forward), self)
        super().compile(*args, **kwargs)
        defaults = COMPILE_INDUCTOR_DEFAULTS if self._state_device().type == "cuda" else {}
        self._compiled_call_impl = _OpaqueOpsCall(self._compiled_call_impl, defaults)

    # -- one step ------------------------------------------------------------------------------------
    def forward(self, input_ids, position_ids, cache_position, token_valid, compress: bool = True):
        """One step: T == prefill_chunk runs the prefill graph, T == 1 a decode graph (with the
        compression ops when `compress`, else the variant without them)."""
        B, T = input_ids.shape
        if B != self.batch_size:
            raise ValueError(f"{self.model_tag}: captured for batch size {self.batch_size}, got input of batch {B}")
        if T == 1:
            graph = self.decode_compress_graph if compress else self.decode_graph
        elif T == self.prefill_chunk:
            graph = self.prefill_graph
        else:
            raise ValueError(f"{self.model_tag}: a step takes 1 or prefill_chunk={self.prefill_chunk} tokens, got {T}")
        return graph(input_ids, position_ids, cache_position, token_valid, *self.state_tensors())

    # -- generation (prefill, decode_step, generate: kvrewrite.host.HostGeneration) ------------------
    def _state_device(self):
        return self.l0_fill.device

    def _run_graph(self, name: str, ids, pos, cpos, valid):
        """A step through `self(...)`, so that after `rw.compile()` the compiled forward runs."""
        if name == "prefill":
            return self(ids, pos, cpos, valid)
        return self(ids, pos, cpos, valid, name == "decode_compress")


def _own_code(fn):
    """A copy of function fn with a code object of its own (equal to fn's, not the same object): Dynamo's cache of
    compiled variants, and its recompile count, belong to the code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


# Inductor configs rw.compile sets on CUDA for the steps whose input_ids are one token of one sequence (see
# KVRewrittenModel.compile); torch.compile(options=...) overrides them (its options are patched in inside these).
COMPILE_INDUCTOR_DEFAULTS = {"combo_kernels": True}


class _OpaqueOpsCall:
    """A compiled step called with torch._functorch.config.decompose_custom_triton_ops off (the switch
    torch.export uses for the same purpose): AOTAutograd, which compiles on a call, then keeps each
    torch.library.triton_op as an op of the graph instead of decomposing it into its kernel launches.
    `inductor`: Inductor configs patched in around a call whose first argument (input_ids) is [1, 1], a batch-1
    decode step (Dynamo and Inductor compile inside the call, on a first call or a recompile, so each compiled
    graph keeps the configs of its shapes), under the ones torch.compile's `options` patch in.

    Inductor's own kernels keep Inductor's PDL setting (triton.enable_pdl, off unless TORCHINDUCTOR_ENABLE_PDL=1 or
    rw.compile(options={"triton.enable_pdl": True})). With it on, an Inductor kernel loads before its gdc_wait
    whatever the scheduler's previous node did not write; which buffers an opaque op that mutates its inputs
    counts as written there is Inductor's bookkeeping, not something this library can check, and the whole of PDL
    measured 0.1-0.3% end to end (kernels/_pdl.py). So it is not turned on here.
    Inductor's message for each op it falls back on is bounded inside the call (inductor_fallback_log.py: torch 2.11
    printed the inputs' whole IR, 2^layers lines, and held the 8B tp=2 compile with the vocab-parallel lm_head)."""

    def __init__(self, fn, inductor=None):
        self.fn = fn
        self.inductor = dict(inductor or {})

    def __call__(self, *args, **kwargs):
        import torch._inductor.config as inductor_config

        config = torch._functorch.config
        old = config.decompose_custom_triton_ops
        config.decompose_custom_triton_ops = False
        try:
            with shallow_operator_str():  # a compile inside the call logs each op's fallback without its IR's depth
                if not self.inductor or tuple(getattr(args[0] if args else None, "shape", ())) != (1, 1):
                    return self.fn(*args, **kwargs)
                with inductor_config.patch(self.inductor):
                    return self.fn(*args, **kwargs)
        finally:
            config.decompose_custom_triton_ops = old
