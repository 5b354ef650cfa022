"""Host-side generation logic, shared by KVRewrittenModel and the deployment loaders (kvrewrite.export).

Everything here runs on the host and depends only on the method, the layer facts and the static sizes
fixed at apply time, never on the capture machinery: the per-layer capacities and budgets, the
checks of a prompt against them, the left-padding of the prompt to whole prefill chunks, the host
mirror of every layer's fill that picks the decode variant (HostSchedule), greedy_tokens (argmax in two
reductions), and HostGeneration, the prefill / decode_step / generate methods built on them (generate's
Hugging Face side, its processors and token loop, is kvrewrite.generation). KVRewrittenModel and
kvrewrite.export.loader.ExportedModel both inherit HostGeneration, so an exported model generates exactly
what `rw.generate` does.
"""
import functools
import math
import numbers
import time

import torch

from kvrewrite.context_cache import ContextGeneration
from kvrewrite.state import STATE_FIELDS, reset_layer_state

WINDOW_INTERVAL = 32  # sliding-window layers evict every 32 tokens (exact at any interval)


def shrink_to_target(fill: int, valid: int, target: int, threshold: int) -> tuple[int, int, int]:
    """The host mirror of a compression op run on a due row: (fill, valid, threshold) after it. The default
    rule (Method.after_compression's): the row keeps min(valid tokens, target) slots; the threshold stays."""
    kept = min(valid, target)
    return kept, kept, threshold


class HostSchedule:
    """Host mirror of every layer's fill per batch row, kept from what the host already knows (the
    tokens appended, the padding mask, each layer's target and threshold), never from the device.

    A compression op runs on a row once its fill reaches the threshold and leaves it as the layer's
    rule says (Method.after_compression; by default min(valid tokens, target) slots, the threshold
    unchanged; ClusterKV keeps every slot and moves the threshold on by its interval), so the mirror is
    exact for every compressible head (outlier heads never compress and are not tracked). The runtime
    runs the decode variant with compression ops only on steps where `due()` says some layer reaches its
    threshold: no host sync, and no compression kernels launched on the other steps.
    """

    def __init__(self, budgets: list, batch_size: int, rules: list | None = None):
        self.budgets = budgets  # per layer (target, threshold); threshold NO_LIMIT: never compressed
        self.rules = rules or [shrink_to_target] * len(budgets)  # per layer (fill, valid, target, thr) -> (...)
        self.fill = [[0] * batch_size for _ in budgets]
        self.valid = [[0] * batch_size for _ in budgets]
        self.threshold = [[thr] * batch_size for _, thr in budgets]

    def due(self, T: int) -> bool:
        """Would appending T tokens bring some row of some layer to its threshold?"""
        return any(f + T >= thr for fills, thrs in zip(self.fill, self.threshold) for f, thr in zip(fills, thrs))

    def overflow(self, T: int, capacities: list):
        """(layer position, fill, capacity) of the first layer where appending T tokens would pass the
        capacity of some row, or None."""
        for i, (fills, cap) in enumerate(zip(self.fill, capacities)):
            f = max(fills, default=0)
            if f + T > cap:
                return i, f, cap
        return None

    def step(self, valid_new: list, T: int, compress: bool) -> None:
        """Mirror one step: T tokens appended (valid_new[b] of them real), then compression if run."""
        for (target, _), rule, fills, valids, thrs in zip(self.budgets, self.rules, self.fill, self.valid,
                                                           self.threshold):
            for b in range(len(fills)):
                fills[b] += T
                valids[b] += valid_new[b]
                if compress and fills[b] >= thrs[b]:
                    fills[b], valids[b], thrs[b] = rule(fills[b], valids[b], target, thrs[b])


def layer_capacity(info, method, max_length: int, prefill_chunk: int) -> int:
    """Static slots of one layer (sliding-window layers: window + eviction interval + a chunk)."""
    if info.window:
        return min(info.window - 1 + WINDOW_INTERVAL - 1 + prefill_chunk, max_length + prefill_chunk - 1)
    return method.capacity(info, max_length, prefill_chunk)


def layer_state_fields(info, method) -> dict:
    """The method's own state of one layer, {name: StateField} (Method.state_fields); {} for a sliding-window
    layer, which keeps its window exactly and never runs the method's ops."""
    if info.window:
        return {}
    fields = dict(method.state_fields(info))
    clash = sorted(set(fields) & set(STATE_FIELDS))
    if clash:
        raise ValueError(f"{type(method).__name__}.state_fields: {clash} clash with the base state {STATE_FIELDS}")
    return fields


def layer_budgets(method, layers, n_prompt: int, max_new_tokens: int, prompt_slots: int) -> list:
    """(target, threshold) per layer for one generation, as written into each layer's `budget` state;
    prompt_slots: the slots the prompt fills (its length padded to whole prefill chunks)."""
    budgets = []
    for info in layers:
        if info.window:
            budgets.append((info.window - 1, info.window - 1 + WINDOW_INTERVAL))
        else:
            budgets.append(method.targets(info, n_prompt, max_new_tokens, prompt_slots))
    return budgets


def layer_rules(method, layers) -> list:
    """Per layer, the host mirror's rule for a compression (HostSchedule): the method's after_compression
    for a full-attention layer, the default shrink for a sliding-window one."""
    return [shrink_to_target if info.window else method.after_compression for info in layers]


def check_count(model_tag: str, name: str, value, minimum: int) -> None:
    """ValueError unless `value` is an int >= minimum; a bool is refused (True is not a count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{model_tag}: {name} must be an int >= {minimum}, got {value!r}")


def check_prompt(input_ids, attention_mask, model_tag: str) -> None:
    """ValueError unless input_ids is an integer tensor [B, n] (n >= 1) and attention_mask, if given, is
    [B, n] too, with at least one real token per row and none of them right-padded."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"{model_tag}: input_ids must be a tensor [B, n] of token ids, got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        hint = "; for one prompt pass input_ids[None]" if input_ids.dim() == 1 else ""
        raise ValueError(f"{model_tag}: input_ids must be [B, n] (a batch of prompts), got shape "
                         f"{tuple(input_ids.shape)}{hint}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"{model_tag}: input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[1] == 0:
        raise ValueError(f"{model_tag}: input_ids has no tokens (shape {tuple(input_ids.shape)}); "
                         f"a prompt needs at least one")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"{model_tag}: attention_mask must be [B, n] = {tuple(input_ids.shape)} like input_ids, "
                         f"got {got}")
    mask = attention_mask.bool()
    real = mask.any(dim=1)
    if not bool(real.all()):
        empty = (~real).nonzero().flatten().tolist()
        rows = f"row {empty[0]} of attention_mask has" if len(empty) == 1 else \
            f"rows {', '.join(map(str, empty))} of attention_mask have"
        raise ValueError(f"{model_tag}: {rows} no real token (all zeros); every row needs at least one")
    if not mask[:, -1].all():
        raise ValueError(f"{model_tag}: right padding is not supported; left-pad the batch")


def prepare_prompt(input_ids, attention_mask, *, model_tag: str, method, layers, capacities, max_length: int,
                   prefill_chunk: int, max_new_tokens: int, device):
    """Check a prompt against the static sizes and left-pad it to whole prefill chunks.

    Returns (ids, valid, position_ids, cache_position, n_real, n): the padded ids and mask [B, n_pad] on
    `device`, their positions, the cache positions [n_pad] (negative for the added padding), the longest
    real prompt and the caller's prompt length n.
    """
    check_prompt(input_ids, attention_mask, model_tag)
    check_count(model_tag, "max_new_tokens", max_new_tokens, 0)
    max_new_tokens = int(max_new_tokens)
    B, n = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device=device, dtype=torch.bool)
    input_ids = input_ids.to(device)
    n_pad = math.ceil(n / prefill_chunk) * prefill_chunk
    for info, cap in zip(layers, capacities):
        need = n_pad + max_new_tokens if not info.window else 0
        if need > cap and method.compression_call(info) is None:
            raise ValueError(
                f"{model_tag}: prompt of {n} tokens (padded to {n_pad}) + max_new_tokens={max_new_tokens} "
                f"exceeds the capacity of layer {info.index} ({cap} slots, max_length={max_length}); "
                f"apply() with a larger max_length"
            )
    if n + max_new_tokens > max_length:
        raise ValueError(
            f"{model_tag}: prompt of {n} tokens + max_new_tokens={max_new_tokens} exceeds "
            f"max_length={max_length}; apply() with a larger max_length"
        )
    n_real = int(attention_mask.sum(dim=1).max())
    method.check_generation(n_real, max_new_tokens)
    pad = n_pad - n
    ids = torch.nn.functional.pad(input_ids, (pad, 0), value=0)
    valid = torch.nn.functional.pad(attention_mask, (pad, 0), value=False)
    position_ids = (valid.long().cumsum(dim=1) - 1).clamp_min(0)
    cache_position = torch.arange(-pad, n, device=device)
    return ids, valid, position_ids, cache_position, n_real, n


@functools.cache
def _argmax_chunks(V: int) -> int:
    """greedy_tokens' chunk count for a vocabulary of V: its largest divisor <= 256 (chunks of V // n tokens)."""
    return max(d for d in range(1, min(V, 256) + 1) if V % d == 0)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) for [..., V], in two reductions: the max of each of up to 256 equal chunks of the
    vocabulary, then the first chunk holding the overall max (ties go to the lowest index, as argmax's; NaN counts
    as the max, as there). ATen reduces one long row with a single block: a 128256-token bf16 row took 27 us on an
    H100 alone (38 us in a decode step's profile, docs/bench.md), 12 us in two reductions."""
    V = logits.shape[-1]
    n = _argmax_chunks(V)
    if n == 1:
        return logits.argmax(dim=-1)
    best, where = logits.unflatten(-1, (n, V // n)).max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return (chunk * (V // n) + where.gather(-1, chunk)).squeeze(-1)


class HostGeneration(ContextGeneration):
    """prefill / decode_step / generate over the three step graphs, one implementation for
    KVRewrittenModel (nn.Module) and kvrewrite.export.loader.ExportedModel.

    The class using it provides the static facts `model_tag`, `method`, `layers`, `capacities`,
    `batch_size`, `prefill_chunk`, `max_length` (and optionally `generation_config`), `state_specs` (per layer,
    the method's {name: StateField}, reset with the base state), `layer_state(i)`,
    `BATCH_FIXED_BY` (how the batch size was fixed, for the error: "captured", "exported"), and two hooks:
    `_state_device()` (where the state and the step inputs live) and
    `_run_graph(name, ids, pos, cpos, valid) -> logits [B, T, V]` for name in prefill / decode /
    decode_compress, leaving the updated state in the state tensors. Between calls the generation's
    position is kept in `schedule`, `_next_position`, `_next_cache_position` and `_decode_steps` (the
    decode steps run, at most `_decode_limit`, the max_new_tokens the state was prefilled for).

    Every call checks its arguments and the generation's sizes before it touches any state, so a
    refused call (ValueError) leaves the generation in progress as it was.
    """

    BATCH_FIXED_BY = "captured"

    def _check_batch(self, b: int) -> None:
        """Refuse a batch of the wrong size, before any state is touched (nothing is lost)."""
        if b != self.batch_size:
            raise ValueError(f"{self.model_tag}: {self.BATCH_FIXED_BY} for batch size {self.batch_size}, "
                             f"got input of batch {b}")

    def reset(self, n_prompt: int, max_new_tokens: int, prompt_slots: int | None = None) -> None:
        """Empty every layer's state and set this generation's targets (B, B + g). prompt_slots: the slots the
        prompt will fill (its padded length; default n_prompt rounded up to whole prefill chunks). Refuses targets the
        method cannot run with (its check_generation) before any state is touched: callers that fill the state
        themselves (the bench's synthetic fill) get the refusal a prefill gives."""
        self.method.check_generation(n_prompt, max_new_tokens)
        if prompt_slots is None:
            prompt_slots = math.ceil(n_prompt / self.prefill_chunk) * self.prefill_chunk
        budgets = layer_budgets(self.method, self.layers, n_prompt, max_new_tokens, prompt_slots)
        for info, specs, (target, threshold) in zip(self.layers, self.state_specs, budgets):
            reset_layer_state(self.layer_state(info.index), target, threshold, specs)
        self.schedule = HostSchedule(budgets, self.batch_size, layer_rules(self.method, self.layers))
        # decode_step runs at most max_new_tokens steps; the caller sets the positions once the state is filled
        self._decode_steps, self._decode_limit = 0, max_new_tokens
        self._next_position = self._next_cache_position = None

    def _check_decode(self, tokens) -> None:
        """Refuse a decode step that cannot run, before anything is launched (nothing is lost)."""
        tag = self.model_tag
        if getattr(self, "_next_position", None) is None or getattr(self, "_decode_limit", None) is None:
            raise ValueError(f"{tag}: decode_step: no generation in progress; call prefill (or generate) first")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            hint = "; pass tokens[:, 0]" if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 \
                and tokens.shape[1] == 1 else ""
            raise ValueError(f"{tag}: decode_step: tokens must be [B] (one token id per row), got {got}{hint}")
        self._check_batch(tokens.shape[0])
        n_new, step = self._decode_limit, self._decode_steps + 1
        if step > n_new:
            raise ValueError(
                f"{tag}: decode_step: this generation was prefilled for max_new_tokens={n_new}; step {step} "
                f"would go past the prompt + {n_new} tokens its state was sized for (max_length={self.max_length}); "
                f"call prefill(..., max_new_tokens={step} or more)"
            )
        over = self.schedule.overflow(1, self.capacities)
        if over is not None:
            i, fill, cap = over
            raise ValueError(
                f"{tag}: decode_step: layer {self.layers[i].index} holds {cap} slots and a row already uses {fill}; "
                f"step {step} would write past its capacity; call prefill(...) again, or apply() with a larger "
                f"max_length"
            )

    @torch.no_grad()
    def prefill(self, input_ids, attention_mask=None, max_new_tokens: int = 0, progress: bool = False):
        """Reset the state and run the prompt through in chunks; returns the last position's logits [B, V].

        The state is sized for the prompt + `max_new_tokens` (an int >= 0): that many decode_step calls may
        follow. A prompt that cannot run (shapes, batch size, padding, sizes) is refused before the state is reset."""
        from tqdm.auto import tqdm

        device = self._state_device()
        ids, valid, position_ids, cache_position, n_real, n = prepare_prompt(
            input_ids, attention_mask, model_tag=self.model_tag, method=self.method, layers=self.layers,
            capacities=self.capacities, max_length=self.max_length, prefill_chunk=self.prefill_chunk,
            max_new_tokens=max_new_tokens, device=device)
        self._check_batch(ids.shape[0])
        self.reset(n_real, max_new_tokens, prompt_slots=ids.shape[1])
        logits = None
        valid_host = valid.cpu()  # the mask is the caller's: one copy per generation, not per step
        # chunk c of each [B, n] input as a [B, T] view with the strides (T, 1) whatever n is: the compiled step
        # (rw.compile) guards on input strides, and slices of [B, n] would recompile it for every prompt length
        T = self.prefill_chunk
        chunks = [x.reshape(x.shape[0], -1, T).transpose(0, 1).clone(memory_format=torch.contiguous_format)
                  for x in (ids, position_ids, valid)]  # (.contiguous() would keep the size-1 dims' strides)
        for i, c in enumerate(tqdm(range(0, ids.shape[1], T), desc="prefill", unit="chunk", disable=not progress)):
            sl = slice(c, c + T)
            logits = self._run_graph("prefill", chunks[0][i], chunks[1][i], cache_position[sl], chunks[2][i])
            self.schedule.step(valid_host[:, sl].sum(dim=1).tolist(), T, compress=True)
        self._next_position = position_ids[:, -1] + 1
        self._next_cache_position = torch.tensor([n], device=device)  # advanced on the device: no H2D copy per step
        return logits[:, -1]

    @torch.no_grad()
    def decode_step(self, tokens):
        """Feed one token per row [B]; returns the logits [B, V]. At most max_new_tokens steps (of the
        prefill) follow a prefill; a step that cannot run is refused before anything is launched."""
        self._check_decode(tokens)
        device = self._state_device()
        pos, cpos = self._next_position, self._next_cache_position
        valid = torch.ones(tokens.shape[0], 1, dtype=torch.bool, device=device)
        compress = self.schedule.due(1)
        name = "decode_compress" if compress else "decode"
        logits = self._run_graph(name, tokens[:, None].to(device), pos[:, None], cpos, valid)
        self.schedule.step([1] * tokens.shape[0], 1, compress)
        self._next_position, self._next_cache_position = pos + 1, cpos + 1
        self._decode_steps += 1
        return logits[:, -1]

    def _start_generation(self, input_ids, attention_mask, max_new_tokens, context, progress):
        """-> (logits [B, V] of the last position, history [B, n] the token ids the logits processors see
        before the first new token)"""
        if context is not None:
            return self._start_from_context(input_ids, attention_mask, max_new_tokens, context, progress)
        return self.prefill(input_ids, attention_mask, max_new_tokens, progress), input_ids

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, generation_config=None, *, logits_processor=None,
                 stopping_criteria=None, streamer=None, context=None, generator=None, progress=False, **kwargs):
        """Generate as Hugging Face's `model.generate` does (greedy or sampled, kvrewrite.generation): returns the
        sequences [B, n + new] (input_ids, then the new tokens, pad after EOS), or a GenerateDecoderOnlyOutput
        (sequences, scores, logits) if return_dict_in_generate.

        The settings are a GenerationConfig and/or its fields as keyword arguments (do_sample, temperature, top_k,
        top_p, min_p, repetition_penalty, eos_token_id (an int or a list; [] for none), pad_token_id,
        max_new_tokens or max_length (which counts the prompt), min_new_tokens, no_repeat_ngram_size, ...), merged
        over `self.generation_config` as HF merges them; HF's `tokenizer` (for stop_strings) and
        `prefix_allowed_tokens_fn` are taken too. `logits_processor` / `stopping_criteria` extend HF's lists,
        `streamer` gets the prompt then each token (put / end). Sampling draws from `generator` if given, else from
        torch's global RNG (as HF); with tensor parallelism every rank takes rank 0's draws. Anything a kvrewrite
        generation cannot honour (beam search, assisted generation, attentions or hidden states out, HF's cache
        options, an unknown argument) is refused by name before any state is touched. `context`: a ContextState to
        continue from (rw.prefill_context; docs/context.md).

        Wall-clock prefill/decode seconds of the call are left in `self.last_timings`.
        """
        from kvrewrite.generation import GenerationPlan, decode_loop

        device = self._state_device()
        plan = GenerationPlan.build(self, input_ids, attention_mask, generation_config, kwargs, logits_processor,
                                    stopping_criteria, device)
        t0 = time.perf_counter()
        logits, history = self._start_generation(plan.input_ids, plan.attention_mask, plan.max_new_tokens, context,
                                                 progress)
        if history.shape[1] != plan.n_history:
            plan.bind(history)
        t1 = time.perf_counter()
        if streamer is not None:
            streamer.put(plan.input_ids.cpu())
        same_sample = None
        if getattr(self, "tp", 1) > 1:  # every rank must feed the same tokens: rank 0's draws (greedy ones agree)
            from kvrewrite.tensor_parallel import rank0_tokens as same_sample
        new, scores, raw = decode_loop(plan, logits, history.to(device), self.decode_step, streamer=streamer,
                                       generator=generator, progress=progress, same_sample=same_sample)
        # host-side wall clock; decode_loop synchronises at its end
        self.last_timings = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "new_tokens": new.shape[1]}
        return plan.output(torch.cat([plan.input_ids, new], dim=1), scores, raw)
