"""KVRewrittenModel: runs the rewritten prefill-chunk and decode-step graphs over the slot state.

Prefill is chunked: the prompt is left-padded to a whole number of `prefill_chunk` tokens and each
chunk runs the prefill graph, which appends to every layer's state, attends and compresses layer by
layer; so a layer never holds more than its static capacity (the full-length dense cache never
exists). Decode steps run the decode graph; on the steps where the host-side schedule knows some
layer reaches its threshold (every g tokens) they run the variant that also holds the compression
ops, so re-compression happens inside the step without reading the device.
"""
import logging
import math
import time

import torch
from torch import nn

from kvrewrite.state import STATE_FIELDS, allocate_layer_state, reset_layer_state

logger = logging.getLogger(__name__)
WINDOW_INTERVAL = 32  # sliding-window layers evict every 32 tokens (exact at any interval)


class HostSchedule:
    """Host mirror of every layer's fill per batch row, kept from what the host already knows (the
    tokens appended, the padding mask, each layer's target and threshold), never from the device.

    A compression op shrinks a due row to min(valid tokens, target) slots, so the mirror is exact
    for every compressible head (outlier heads never compress and are not tracked). The runtime runs
    the decode variant with compression ops only on steps where `due()` says some layer reaches its
    threshold: no host sync, and no compression kernels launched on the other steps.
    """

    def __init__(self, budgets: list, batch_size: int):
        self.budgets = budgets  # per layer (target, threshold); threshold NO_LIMIT: never compressed
        self.fill = [[0] * batch_size for _ in budgets]
        self.valid = [[0] * batch_size for _ in budgets]

    def due(self, T: int) -> bool:
        """Would appending T tokens bring some row of some layer to its threshold?"""
        return any(f + T >= thr for (_, thr), fills in zip(self.budgets, self.fill) for f in fills)

    def step(self, valid_new: list, T: int, compress: bool) -> None:
        """Mirror one step: T tokens appended (valid_new[b] of them real), then compression if run."""
        for (target, thr), fills, valids in zip(self.budgets, self.fill, self.valid):
            for b in range(len(fills)):
                fills[b] += T
                valids[b] += valid_new[b]
                if compress and fills[b] >= thr:
                    fills[b] = valids[b] = min(valids[b], target)


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
            if info.window:
                cap = min(info.window - 1 + WINDOW_INTERVAL - 1 + self.prefill_chunk, max_length + self.prefill_chunk - 1)
            else:
                cap = method.capacity(info, max_length, self.prefill_chunk)
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
        budgets = []
        for info in self.layers:
            if info.window:
                target, threshold = info.window - 1, info.window - 1 + WINDOW_INTERVAL
            else:
                target, threshold = self.method.targets(info, n_prompt, max_new_tokens)
            reset_layer_state(self.layer_state(info.index), target, threshold)
            budgets.append((target, threshold))
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

        B, n = input_ids.shape
        device = self.l0_fill.device
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        input_ids = input_ids.to(device)
        if not attention_mask[:, -1].all():
            raise ValueError(f"{self.model_tag}: right padding is not supported; left-pad the batch")
        n_pad = math.ceil(n / self.prefill_chunk) * self.prefill_chunk
        for info, cap in zip(self.layers, self.capacities):
            need = n_pad + max_new_tokens if not info.window else 0
            if need > cap and self.method.compression_call(info) is None:
                raise ValueError(
                    f"{self.model_tag}: prompt of {n} tokens (padded to {n_pad}) + max_new_tokens={max_new_tokens} "
                    f"exceeds the capacity of layer {info.index} ({cap} slots, max_length={self.max_length}); "
                    f"apply() with a larger max_length"
                )
        if n + max_new_tokens > self.max_length:
            raise ValueError(
                f"{self.model_tag}: prompt of {n} tokens + max_new_tokens={max_new_tokens} exceeds "
                f"max_length={self.max_length}; apply() with a larger max_length"
            )
        n_real = int(attention_mask.sum(dim=1).max())
        self.method.check_generation(n_real, max_new_tokens)
        self.reset(n_real, max_new_tokens)

        pad = n_pad - n
        ids = torch.nn.functional.pad(input_ids, (pad, 0), value=0)
        valid = torch.nn.functional.pad(attention_mask, (pad, 0), value=False)
        position_ids = (valid.long().cumsum(dim=1) - 1).clamp_min(0)
        cache_position = torch.arange(-pad, n, device=device)
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
        from tqdm.auto import tqdm

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        cfg = getattr(self, "generation_config", None)
        if eos_token_id is None and cfg is not None:
            eos_token_id = cfg.eos_token_id
        eos = torch.tensor([] if eos_token_id is None else
                           ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)))
        if pad_token_id is None:
            pad_token_id = (cfg.pad_token_id if cfg is not None and cfg.pad_token_id is not None else
                            (int(eos[0]) if len(eos) else 0))
        device = self.l0_fill.device
        t0 = time.perf_counter()
        logits = self.prefill(input_ids, attention_mask, max_new_tokens, progress)
        t1 = time.perf_counter()
        eos = eos.to(device)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
        out = []
        for step in tqdm(range(max_new_tokens), desc="decode", unit="tok", disable=not progress):
            tok = _pick(logits, do_sample, temperature, top_k, top_p, generator)
            tok = torch.where(done, torch.full_like(tok, pad_token_id), tok)
            out.append(tok)
            done = done | torch.isin(tok, eos)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            logits = self.decode_step(tok)
        # host-side wall clock; the .all() above already synchronises every step
        self.last_timings = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "new_tokens": len(out)}
        return torch.cat([input_ids.to(device), torch.stack(out, dim=1)], dim=1)


def _pick(logits, do_sample, temperature, top_k, top_p, generator):
    """Next token per row from logits [B, V]: argmax, or a sample after temperature/top-k/top-p."""
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float() / max(temperature, 1e-5)
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) > top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
