"""Compress a context once, ask it many questions (issue 19, part 2): ContextState and the ContextGeneration mixin.

    state = rw.prefill_context(context_ids)             # compressed by rw's method, kept as a detached copy
    out = rw.generate(question_ids, context=state, ...)  # continues from a COPY: `state` is never changed
    state.save("doc.kvctx"); state = rw.load_context("doc.kvctx")

Decisions (docs/context.md gives the reasons at more length; the tests in tests/test_context_state.py pin them):
- The context is prefilled exactly as a prompt with max_new_tokens = 0: chunked, compressed by the method while
  it streams, so its budget is B = round(budget * n_context) for a fraction (the question and the answer are
  unknown when it is compressed), or `budget` slots for an int.
- The question continues that generation: it is appended after the context, chunked like a prefill (left-padded
  to whole chunks: the padding slots sit between the context and the question, invalid, until the next
  compression drops them), positions continuing after each row's context. The method's schedule carries on
  unchanged: a row reaching its threshold is compressed again at the end of a question chunk or a decode step,
  the question's and the answer's tokens included, as generated tokens are in the whole-prompt mode. So every
  row holds at most B + g - 1 slots after a compression, whatever was asked. (Appending the question and the
  answer uncompressed, as kvpress does, is not generic: ClusterKV must cluster every m tokens and ClusterGen's
  exact part must not grow into its sketch; it would need a per-method rule.)
- A state holds 1 row (one context, copied into every batch row) or batch_size rows (row b continues context b).
  A [1, n] context on a batch-B rewrite is run replicated (the graphs are static in B) and its row 0 is kept:
  correct, but B times the work of a batch-1 rewrite, whose state a batch-B rewrite of the same model, method,
  budget, max_length and prefill_chunk takes as is (the efficient path).
- Every use (generate with context=, load_context) checks the state's facts against the rewrite: model, config,
  weights (a digest of the vocabulary-sized matrices), method and each option, max_length, prefill_chunk, dtype,
  layer layout, capacities and state fields; a mismatch is refused naming it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from pathlib import Path

import torch

from kvrewrite.state import STATE_FIELDS

# kvrewrite.host imports this module (HostGeneration inherits ContextGeneration): its names are imported
# inside the functions

FORMAT = 1  # bump when the saved layout changes; load refuses other versions
_VOLATILE_CONFIG = ("transformers_version", "_attn_implementation_autoset", "torch_dtype", "dtype",
                    "_attn_implementation", "attn_implementation")


def _digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()[:16]


def config_digest(rw) -> str | None:
    """A digest of the model config (the version- and dtype-dependent keys left out), or None without one."""
    cfg = getattr(rw, "config", None)
    if cfg is None:
        return None
    d = {k: v for k, v in cfg.to_dict().items() if k not in _VOLATILE_CONFIG}
    return _digest(json.dumps(d, sort_keys=True, default=str).encode())


def weights_digest(rw) -> str | None:
    """A digest of the first 4096 values of every [vocab, hidden] matrix (embedding, LM head): tells two
    checkpoints of one architecture apart at a negligible cost. None for a rewrite without parameters (an
    exported model). Cached on the rewrite (weights do not change under it)."""
    cached = getattr(rw, "_kvctx_weights_digest", False)
    if cached is not False:
        return cached
    vocab = getattr(rw, "vocab_size", None)
    parts = []
    if vocab and isinstance(rw, torch.nn.Module):
        for p in rw.parameters():
            if p.dim() == 2 and p.shape[0] == vocab:
                parts.append(p.detach().flatten()[:4096].to("cpu", torch.float64).numpy().tobytes())
    digest = _digest(b"".join(sorted(parts))) if parts else None
    try:
        object.__setattr__(rw, "_kvctx_weights_digest", digest)
    except AttributeError:
        pass
    return digest


def _batch_dim(name: str, spec, info, cap: int, L: int) -> bool:
    """True when a method state field has one entry per batch row (along dim 0), False when it is shared by the
    rows; ValueError when its batch dimension is another one (a state could not be cut into rows)."""
    a = spec.size(1, info.num_kv_heads, cap, info.head_dim, L)
    b = spec.size(2, info.num_kv_heads, cap, info.head_dim, L)
    changed = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if not changed:
        return False
    if changed != [0]:
        raise ValueError(f"layer {info.index}: state field {name!r} varies with the batch along dims {changed}; "
                         f"a context state needs the batch as dim 0")
    return True


def _per_row(rw) -> list:
    """Per layer, {field: True if it has a batch row dim 0}. The method's own fields are read from the method (an
    exported model's state_specs hold concrete shapes, which cannot tell the batch dimension)."""
    from kvrewrite.host import layer_state_fields
    from kvrewrite.state import full_length

    L = full_length(rw.max_length, rw.prefill_chunk)
    out = []
    for info, cap, specs in zip(rw.layers, rw.capacities, rw.state_specs):
        rows = {f: f != "budget" for f in STATE_FIELDS}
        fields = layer_state_fields(info, rw.method)
        if set(fields) != set(specs):
            raise ValueError(f"{rw.model_tag}: layer {info.index}: the method's state fields {sorted(fields)} are not "
                             f"the state's {sorted(specs)}")
        rows.update({f: _batch_dim(f, s, info, cap, L) for f, s in fields.items()})
        out.append(rows)
    return out


def context_facts(rw) -> dict:
    """What a state must share with a rewrite to continue on it (the keys name the mismatch in errors)."""
    m = rw.method
    options = {f.name: repr(getattr(m, f.name)) for f in dataclasses.fields(m) if f.init}
    fields = []
    for info, rows in zip(rw.layers, _per_row(rw)):
        st = rw.layer_state(info.index)
        fields.append({f: [list(st[f].shape[1:] if r else st[f].shape), str(st[f].dtype)] for f, r in rows.items()})
    return {
        "model_tag": rw.model_tag, "config": config_digest(rw), "weights": weights_digest(rw),
        "method": m.name, "method_options": options, "max_length": int(rw.max_length),
        "prefill_chunk": int(rw.prefill_chunk), "dtype": str(rw.layer_state(rw.layers[0].index)["keys"].dtype),
        "layers": [dataclasses.asdict(info) for info in rw.layers], "capacities": [int(c) for c in rw.capacities],
        "fields": fields,
    }


def _mismatch(made: dict, here: dict) -> str | None:
    """The first fact that differs, described for an error; None when they all agree."""
    for key in ("model_tag", "config", "weights", "method"):
        if made[key] != here[key] and None not in (made[key], here[key]):
            return f"{key}: the state's {made[key]!r}, this rewrite's {here[key]!r}"
    mo, ho = made["method_options"], here["method_options"]
    for k in sorted(set(mo) | set(ho), key=lambda k: (k != "budget", k)):
        if mo.get(k) != ho.get(k):
            return f"method option {k}: the state's {mo.get(k)}, this rewrite's {ho.get(k)}"
    for key in ("max_length", "prefill_chunk", "dtype"):
        if made[key] != here[key]:
            return f"{key}: the state's {made[key]}, this rewrite's {here[key]}"
    if made["layers"] != here["layers"]:
        diff = next((a, b) for a, b in itertools.zip_longest(made["layers"], here["layers"]) if a != b)
        return f"layer layout: the state's {diff[0]}, this rewrite's {diff[1]}"
    for key in ("capacities", "fields"):
        if made[key] != here[key]:
            i = next(i for i, (a, b) in enumerate(zip(made[key], here[key])) if a != b)
            return f"{key} of layer {here['layers'][i]['index']}: the state's {made[key][i]}, this rewrite's " \
                   f"{here[key][i]}"
    return None


@dataclasses.dataclass(eq=False)
class ContextState:
    """A compressed context: every layer's state for its rows and what the host needs to continue after it.

    Attributes:
        tensors: per layer, {field: tensor}: the base fields and the method's (kvrewrite/state.py), per-row fields
            [rows, ...] (the budget [2] is shared).
        schedule: the host mirror after the context (HostSchedule's "budgets", and per layer and row "fill",
            "valid", "threshold").
        next_position: [rows] int64, the position of each row's next token (its context's real tokens).
        next_cache_position: the cache position of the next token (the context's length n).
        input_ids: [rows, n] the context's ids; attention_mask: [rows, n] or None.
        facts: what a rewrite must share to continue from it (context_facts).
    """

    tensors: list
    schedule: dict
    next_position: torch.Tensor
    next_cache_position: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    facts: dict

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def length(self) -> int:
        """n, the context's length in tokens (its padded rows included)."""
        return int(self.input_ids.shape[1])

    def slots(self) -> int:
        """The most slots any row of any layer holds (the host mirror's fill)."""
        return max(max(f) for f in self.schedule["fill"])

    def save(self, path) -> None:
        """Write the state to `path` (torch.save of CPU tensors and plain values: bit-exact on load)."""
        data = {"format": FORMAT, "facts": self.facts, "schedule": self.schedule,
                "next_cache_position": self.next_cache_position,
                "tensors": [{k: v.cpu() for k, v in t.items()} for t in self.tensors],
                "next_position": self.next_position.cpu(), "input_ids": self.input_ids.cpu(),
                "attention_mask": None if self.attention_mask is None else self.attention_mask.cpu()}
        torch.save(data, Path(path))

    @classmethod
    def load(cls, path, map_location=None) -> "ContextState":
        """Read a state written by `save` (tensors onto `map_location`, as torch.load). Use rw.load_context(path)
        to also check it against the rewrite that will continue from it (generate checks it too)."""
        data = torch.load(Path(path), map_location=map_location, weights_only=True)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{path}: not a kvrewrite context state of format {FORMAT} (got {got!r}); "
                             f"save it again with this version")
        return cls(data["tensors"], data["schedule"], data["next_position"], data["next_cache_position"],
                   data["input_ids"], data["attention_mask"], data["facts"])


class ContextGeneration:
    """prefill_context / load_context / _start_from_context, mixed into kvrewrite.host.HostGeneration (it uses
    that class's static facts, `prefill`, `layer_state` and `_run_graph`)."""

    @torch.no_grad()
    def prefill_context(self, context_ids, attention_mask=None, progress: bool = False) -> ContextState:
        """Compress a context with the rewrite's method; returns a detached ContextState (the module docstring
        says what the budget counts). context_ids: [1, n] (copied into every row of a later question batch) or
        [batch_size, n] (one context per row), left-padded with attention_mask."""
        from kvrewrite.host import check_prompt

        check_prompt(context_ids, attention_mask, self.model_tag)
        rows = context_ids.shape[0]
        if rows not in (1, self.batch_size):
            raise ValueError(f"{self.model_tag}: prefill_context takes one context [1, n] or one per row "
                             f"[{self.batch_size}, n], got {rows} rows")
        ids, mask = context_ids, attention_mask
        if rows != self.batch_size:  # replicated: the graphs are static in B (a batch-1 rewrite is cheaper)
            ids = ids.expand(self.batch_size, -1)
            mask = None if mask is None else mask.expand(self.batch_size, -1)
        self.prefill(ids, mask, max_new_tokens=0, progress=progress)
        keep = slice(0, rows)
        tensors = []
        for info, per_row in zip(self.layers, _per_row(self)):
            st = self.layer_state(info.index)
            tensors.append({f: (st[f][keep] if r else st[f]).detach().clone() for f, r in per_row.items()})
        sched = self.schedule
        return ContextState(
            tensors=tensors,
            schedule={"budgets": [list(b) for b in sched.budgets],
                      **{k: [list(v[:rows]) for v in getattr(sched, k)] for k in ("fill", "valid", "threshold")}},
            next_position=self._next_position[keep].detach().clone(),
            next_cache_position=int(self._next_cache_position[0]),
            input_ids=context_ids.detach().clone(),
            attention_mask=None if attention_mask is None else attention_mask.detach().clone(),
            facts=context_facts(self),
        )

    def load_context(self, path, map_location=None) -> ContextState:
        """ContextState.load(path) onto this rewrite's device (or map_location), checked against this rewrite."""
        state = ContextState.load(path, map_location=self._state_device() if map_location is None else map_location)
        self.check_context(state)
        return state

    def check_context(self, state) -> None:
        """ValueError naming the first fact the state does not share with this rewrite, or a row count that
        is neither 1 nor batch_size."""
        if not isinstance(state, ContextState):
            raise ValueError(f"{self.model_tag}: context must be a kvrewrite.ContextState (rw.prefill_context or "
                             f"rw.load_context), got {type(state).__name__}")
        diff = _mismatch(state.facts, context_facts(self))
        if diff:
            raise ValueError(f"{self.model_tag}: this context state was made by another rewrite ({diff}); "
                             f"prefill the context again with this rewrite")
        if state.rows not in (1, self.batch_size):
            raise ValueError(f"{self.model_tag}: the context state holds {state.rows} rows; a rewrite of batch size "
                             f"{self.batch_size} takes 1 (copied into every row) or {self.batch_size}")

    def _check_continuation(self, state, n_q: int, q_slots: int, valid_new: list, max_new_tokens: int,
                            schedule) -> None:
        """Refuse a question + answer that does not fit: max_length (positions) and, by running the host mirror
        over the question's chunks and every decode step on a copy, each layer's capacity."""
        from kvrewrite.host import HostSchedule

        tag, n = self.model_tag, state.length
        if n + n_q + max_new_tokens > self.max_length:
            raise ValueError(f"{tag}: context of {n} tokens + question of {n_q} + max_new_tokens={max_new_tokens} "
                             f"exceeds max_length={self.max_length}; apply() with a larger max_length")
        sim = HostSchedule(schedule.budgets, self.batch_size, schedule.rules)
        sim.fill, sim.valid, sim.threshold = ([list(r) for r in getattr(schedule, k)]
                                              for k in ("fill", "valid", "threshold"))
        T = self.prefill_chunk
        steps = [(T, valid_new[c]) for c in range(q_slots // T)] + [(1, [1] * self.batch_size)] * max_new_tokens
        for k, (t, valid) in enumerate(steps):
            over = sim.overflow(t, self.capacities)
            if over is not None:
                i, fill, cap = over
                where = f"question chunk {k + 1}" if t > 1 else f"answer token {k - q_slots // T + 1}"
                raise ValueError(
                    f"{tag}: layer {self.layers[i].index} holds {cap} slots; after the context ({state.slots()} "
                    f"slots at most) and a question of {n_q} tokens (padded to {q_slots}), {where} of "
                    f"max_new_tokens={max_new_tokens} would need {fill + t}; ask fewer new tokens, or apply() with a "
                    f"larger max_length")
            sim.step(valid, t, compress=t > 1 or sim.due(1))

    @torch.no_grad()
    def _start_from_context(self, input_ids, attention_mask, max_new_tokens: int, context, progress: bool = False):
        """Load a copy of `context` into the state and append the question; returns (logits [B, V] of the last
        question position, history [B, n + n_q]: the context's ids then the question's). decode_step may follow
        for max_new_tokens steps. Everything is checked before any state is touched."""
        from tqdm.auto import tqdm

        from kvrewrite.host import HostSchedule, check_count, check_prompt, layer_rules

        self.check_context(context)
        check_prompt(input_ids, attention_mask, self.model_tag)
        check_count(self.model_tag, "max_new_tokens", max_new_tokens, 0)
        max_new_tokens = int(max_new_tokens)
        self._check_batch(input_ids.shape[0])
        device, B, T = self._state_device(), self.batch_size, self.prefill_chunk
        n_q = input_ids.shape[1]
        q_slots = math.ceil(n_q / T) * T
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        valid = torch.nn.functional.pad(mask.to(device), (q_slots - n_q, 0), value=False)
        valid_host = valid.cpu()
        valid_new = [valid_host[:, c:c + T].sum(dim=1).tolist() for c in range(0, q_slots, T)]

        def rows(v: list) -> list:  # a 1-row state's host values, copied into every row
            return list(v) * B if len(v) == 1 else list(v)

        sched = HostSchedule([tuple(b) for b in context.schedule["budgets"]], B, layer_rules(self.method, self.layers))
        for k in ("fill", "valid", "threshold"):
            setattr(sched, k, [rows(v) for v in context.schedule[k]])
        self._check_continuation(context, n_q, q_slots, valid_new, max_new_tokens, sched)

        # the copy: every state tensor from the context (a 1-row state expanded to every row)
        for info, per_row, saved in zip(self.layers, _per_row(self), context.tensors):
            st = self.layer_state(info.index)
            for f, r in per_row.items():
                src = saved[f]
                st[f].copy_(src.expand_as(st[f]) if r and src.shape[0] == 1 else src)
        self.schedule = sched
        self._decode_steps, self._decode_limit = 0, max_new_tokens
        self._next_position = self._next_cache_position = None  # no generation in progress until the question is in

        base = context.next_position.to(device)
        base = base.expand(B) if base.shape[0] == 1 else base
        ids = torch.nn.functional.pad(input_ids.to(device), (q_slots - n_q, 0), value=0)
        position_ids = base[:, None] + (valid.long().cumsum(dim=1) - 1).clamp_min(0)
        c0 = context.next_cache_position
        cache_position = torch.arange(c0, c0 + q_slots, device=device)
        # [B, T] views with strides (T, 1) whatever n_q is, as prefill does (the compiled step guards on strides)
        chunks = [x.reshape(B, -1, T).transpose(0, 1).clone(memory_format=torch.contiguous_format)
                  for x in (ids, position_ids, valid)]
        logits = None
        for i in tqdm(range(q_slots // T), desc="question", unit="chunk", disable=not progress):
            logits = self._run_graph("prefill", chunks[0][i], chunks[1][i], cache_position[i * T:(i + 1) * T],
                                     chunks[2][i])
            self.schedule.step(valid_new[i], T, compress=True)
        self._next_position = position_ids[:, -1] + 1
        self._next_cache_position = torch.tensor([c0 + q_slots], device=device)
        ctx_ids = context.input_ids.to(device)
        history = torch.cat([ctx_ids.expand(B, -1) if ctx_ids.shape[0] == 1 else ctx_ids, input_ids.to(device)], 1)
        return logits[:, -1], history
