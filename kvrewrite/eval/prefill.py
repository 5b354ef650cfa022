"""Shared prefill: prefill a context once with the `full` method, then start every method from it.

A method's own prefill with one chunk that holds the whole (padded) prompt is exact: every layer
attends to every token of the chunk before its compression op runs, so the state it ends with is
the method's compression op applied to the exact KV cache, and the last position's logits are the
full model's. `load_snapshot` reproduces that without running the model again: it copies the
exact state of a `full` prefill into the method's state and calls, per layer, the compression op
that the method's prefill graph holds (read from the graph, so the window eviction of
sliding-window layers and every method option come along as the passes emitted them).

A method allows this when its prefill graph does nothing but append, attend and compress, and each
compression op reads only its layer's state (`shares_prefill`). A method that needs more (e.g.
attention statistics of the prefill queries) gets its own prefill. tests/test_eval.py checks the
equivalence against `rw.prefill` with prefill_chunk = the padded prompt length (state and decode
logits), which also pins what this module mirrors of the runtime: the decode cursor
(`_next_position`, `_next_cache_position`) and the host schedule, set as `prefill` leaves them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrewrite.state import STATE_FIELDS

PREFILL_ROLES = {"cache_append", "attention", "compression"}


@dataclass
class PrefillSnapshot:
    """The exact KV state of the `full` method right after the prefill of one context (batch 1 rows).

    state: per layer, keys/values [B, Hkv, f, D], bias/slot_pos [B, Hkv, f] (f = the layer's
    largest fill) and fill [B, Hkv]; n_real: real prompt tokens; n_pad: slots appended (the prompt
    left-padded to whole prefill chunks), i.e. the one chunk a method's own prefill would see.
    """

    state: list
    logits: torch.Tensor  # [B, V] at the last prompt position
    n_real: int
    n_pad: int
    valid_per_row: list  # real tokens per batch row
    next_position: torch.Tensor  # [B]
    next_cache_position: object  # the runtime's decode cursor (a [1] tensor, or an int in older runtimes)


@torch.no_grad()
def take_snapshot(full_rw, input_ids, attention_mask=None, max_new_tokens: int = 0,
                  progress: bool = False) -> PrefillSnapshot:
    """Prefill `input_ids` [B, n] with `full_rw` (the `full` method) and copy what every method starts from."""
    if full_rw.method.name != "full":
        raise ValueError(f"take_snapshot: needs a model rewritten with method 'full', got {full_rw.method.name!r}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    logits = full_rw.prefill(input_ids, attention_mask, max_new_tokens=max_new_tokens, progress=progress)
    state = []
    for info in full_rw.layers:
        s = full_rw.layer_state(info.index)
        f = int(s["fill"].max())
        state.append({"keys": s["keys"][:, :, :f].clone(), "values": s["values"][:, :, :f].clone(),
                      "bias": s["bias"][:, :, :f].clone(), "slot_pos": s["slot_pos"][:, :, :f].clone(),
                      "fill": s["fill"].clone()})
    n = input_ids.shape[1]
    chunk = full_rw.prefill_chunk
    return PrefillSnapshot(
        state=state, logits=logits.clone(), n_real=int(attention_mask.sum(dim=1).max()),
        n_pad=-(-n // chunk) * chunk, valid_per_row=attention_mask.sum(dim=1).tolist(),
        next_position=full_rw._next_position.clone(), next_cache_position=_copy(full_rw._next_cache_position),
    )


def _copy(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def compression_nodes(gm):
    """The graph's compression op calls (the nodes the rewrite tagged with role "compression")."""
    return [n for n in gm.graph.nodes if (n.meta.get("kvrewrite") or {}).get("role") == "compression"]


def shares_prefill(rw) -> tuple[bool, str]:
    """(True, "") if `rw`'s method can start from a PrefillSnapshot, else (False, why not)."""
    for node in rw.prefill_graph.graph.nodes:
        role = (node.meta.get("kvrewrite") or {}).get("role")
        if role is not None and role not in PREFILL_ROLES:
            return False, f"its prefill graph holds a {role!r} op ({node.target}), which a snapshot cannot replay"
    for node in compression_nodes(rw.prefill_graph):
        layer = node.meta["kvrewrite"]["layer"]
        expected = [f"l{layer}_{f}" for f in STATE_FIELDS]
        names = [getattr(a, "name", None) for a in node.args]
        if names != expected:
            return False, f"layer {layer}'s compression op {node.target} reads {names}, not only the layer's state"
    return True, ""


@torch.no_grad()
def load_snapshot(rw, snap: PrefillSnapshot, max_new_tokens: int) -> torch.Tensor:
    """Start `rw` as if it had prefilled the snapshot's prompt in one chunk; returns the last logits [B, V].

    Raises ValueError when the method cannot (see `shares_prefill`) or the state does not fit.
    """
    ok, why = shares_prefill(rw)
    if not ok:
        raise ValueError(f"{rw.model_tag}: method {rw.method.name!r} cannot start from a shared prefill: {why}")
    B = rw.batch_size
    if len(snap.valid_per_row) != B:
        raise ValueError(f"{rw.model_tag}: snapshot of batch {len(snap.valid_per_row)}, model captured for batch {B}")
    if snap.n_real + max_new_tokens > rw.max_length:
        raise ValueError(f"{rw.model_tag}: prompt of {snap.n_real} tokens + max_new_tokens={max_new_tokens} exceeds "
                         f"max_length={rw.max_length}; apply() with a larger max_length")
    rw.method.check_generation(snap.n_real, max_new_tokens)
    rw.reset(snap.n_real, max_new_tokens)
    calls = {n.meta["kvrewrite"]["layer"]: n for n in compression_nodes(rw.prefill_graph)}
    for info, src, cap in zip(rw.layers, snap.state, rw.capacities):
        dst = rw.layer_state(info.index)
        f = src["keys"].shape[2]
        if f > cap:
            raise ValueError(f"{rw.model_tag}: layer {info.index} holds {cap} slots, the shared prefill needs {f}; "
                             f"apply() the method at budget 1 (its capacity is then the whole prompt)")
        for field in ("keys", "values", "bias", "slot_pos"):
            dst[field][:, :, :f].copy_(src[field])
        dst["fill"].copy_(src["fill"])
        node = calls.get(info.index)
        if node is not None:  # the op compresses only the rows whose fill reached the threshold
            node.target(*(dst[field] for field in STATE_FIELDS), **node.kwargs)
    # the host mirror of a one-chunk prefill of n_pad tokens (as rw.prefill leaves it)
    rw.schedule.step(list(snap.valid_per_row), snap.n_pad, compress=True)
    for info, fills in zip(rw.layers, rw.schedule.fill):
        on_device = rw.layer_state(info.index)["fill"].min(dim=1).values.tolist()  # outlier heads are not mirrored
        if on_device != fills:
            raise RuntimeError(f"{rw.model_tag}: layer {info.index}: host schedule {fills} != device fill {on_device} "
                               f"after loading a shared prefill (runtime semantics changed?)")
    rw._next_position = snap.next_position.clone()
    rw._next_cache_position = _copy(snap.next_cache_position)
    return snap.logits.clone()
