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
import time

import torch
from torch import nn

from kvrewrite.host import (  # noqa: F401  (HostSchedule and WINDOW_INTERVAL are re-exported)
    WINDOW_INTERVAL,
    HostSchedule,
    eos_and_pad,
    layer_budgets,
    layer_capacity,
    prepare_prompt,
    token_loop,
)
from kvrewrite.state import STATE_FIELDS, allocate_layer_state, reset_layer_state

logger = logging.getLogger(__name__)


class KVRewrittenModel(nn.Module):
    """A Hugging Face causal LM whose KV cache is the clustered state of `method`.

    Call it like a step function, `rw(input_ids, position_ids, cache_position, token_valid)` ->
    logits [B, T, V], with T == prefill_chunk or 1; or use `generate`. `rw.compile(...)` compiles the
    step in place, so `generate` then runs compiled.
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
        self.capacities = []
        for info in self.layers:
            cap = layer_capacity(info, method, max_length, self.prefill_chunk)
            self.capacities.append(cap)
            state = allocate_layer_state(
                self.batch_size, info.num_kv_heads, cap, info.head_dim, captured.dtype, captured.device
            )
            for field in STATE_FIELDS:
                self.register_buffer(f"l{info.index}_{field}", state[field], persistent=False)

    # -- state ---------------------------------------------------------------------------------------
    def layer_state(self, i: int) -> dict:
        return {f: getattr(self, f"l{i}_{f}") for f in STATE_FIELDS}

    def state_tensors(self) -> list:
        return [getattr(self, f"l{info.index}_{f}") for info in self.layers for f in STATE_FIELDS]

    def reset(self, n_prompt: int, max_new_tokens: int) -> None:
        """Empty every layer's state and set this generation's targets (B, B + g)."""
        budgets = layer_budgets(self.method, self.layers, n_prompt, max_new_tokens)
        for info, (target, threshold) in zip(self.layers, budgets):
            reset_layer_state(self.layer_state(info.index), target, threshold)
        self.schedule = HostSchedule(budgets, self.batch_size)

    def cache_bytes(self, seq_len: int | None = None) -> dict:
        """Bytes of the kvrewrite state (all fields, as allocated) vs a dense HF static cache.

        The dense figure is keys + values for `seq_len` tokens (default max_length) per layer
        (sliding-window layers hold at most their window), at the state's dtype.
        """
        seq_len = self.max_length if seq_len is None else seq_len
        state = sum(t.numel() * t.element_size() for t in self.state_tensors())
        dense = 0
        for info in self.layers:
            k = getattr(self, f"l{info.index}_keys")
            tokens = min(seq_len, info.window) if info.window else seq_len
            dense += 2 * self.batch_size * info.num_kv_heads * tokens * info.head_dim * k.element_size()
        return {"kvrewrite": state, "dense": dense, "ratio": state / dense}

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

    # -- generation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids, attention_mask=None, max_new_tokens: int = 0, progress: bool = False):
        """Reset the state and run the prompt through in chunks; returns the last position's logits [B, V]."""
        from tqdm.auto import tqdm

        device = self.l0_fill.device
        ids, valid, position_ids, cache_position, n_real, n = prepare_prompt(
            input_ids, attention_mask, model_tag=self.model_tag, method=self.method, layers=self.layers,
            capacities=self.capacities, max_length=self.max_length, prefill_chunk=self.prefill_chunk,
            max_new_tokens=max_new_tokens, device=device)
        self.reset(n_real, max_new_tokens)
        n_pad = ids.shape[1]
        logits = None
        valid_host = valid.cpu()  # the mask is the caller's: one copy per generation, not per step
        for c in tqdm(range(0, n_pad, self.prefill_chunk), desc="prefill", unit="chunk", disable=not progress):
            sl = slice(c, c + self.prefill_chunk)
            logits = self(ids[:, sl], position_ids[:, sl], cache_position[sl], valid[:, sl])
            self.schedule.step(valid_host[:, sl].sum(dim=1).tolist(), self.prefill_chunk, compress=True)
        self._next_position = position_ids[:, -1] + 1
        self._next_cache_position = torch.tensor([n], device=device)  # advanced on the device: no H2D copy per step
        return logits[:, -1]

    @torch.no_grad()
    def decode_step(self, tokens):
        """Feed one token per row [B]; returns the logits [B, V]."""
        device = self.l0_fill.device
        pos = self._next_position
        cpos = self._next_cache_position
        valid = torch.ones(tokens.shape[0], 1, dtype=torch.bool, device=device)
        compress = self.schedule.due(1)
        logits = self(tokens[:, None].to(device), pos[:, None], cpos, valid, compress)
        self.schedule.step([1] * tokens.shape[0], 1, compress)
        self._next_position = pos + 1
        self._next_cache_position = cpos + 1
        return logits[:, -1]

    @torch.no_grad()
    def generate(
        self,
        input_ids,
        attention_mask=None,
        max_new_tokens: int = 64,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id=None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        progress: bool = False,
    ):
        """Greedy or sampled generation; returns [B, n + new] like HF's generate (pad after EOS).

        Wall-clock prefill/decode seconds of the call are left in `self.last_timings`.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        eos, pad_token_id = eos_and_pad(eos_token_id, pad_token_id, getattr(self, "generation_config", None))
        device = self.l0_fill.device
        t0 = time.perf_counter()
        logits = self.prefill(input_ids, attention_mask, max_new_tokens, progress)
        t1 = time.perf_counter()
        out = token_loop(logits, self.decode_step, max_new_tokens=max_new_tokens, eos=eos, pad_token_id=pad_token_id,
                         do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                         progress=progress)
        # host-side wall clock; the .all() above already synchronises every step
        self.last_timings = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "new_tokens": len(out)}
        return torch.cat([input_ids.to(device), torch.stack(out, dim=1)], dim=1)

