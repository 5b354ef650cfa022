"""The clustered-cache state of one layer: static-shape tensors the rewritten graphs read and update.

Base state (every method, every layer):

    keys, values: [B, Hkv, C, D]  model dtype
    bias:         [B, Hkv, C]     fp32, log of the slot's degree; -inf marks an empty slot
    slot_pos:     [B, Hkv, C]     int64, cache position of the slot (the largest of a merged slot)
    fill:         [B, Hkv]        int64, slots in use per row (the append pointer)
    budget:       [2]             int64, (target, threshold): a row whose fill reaches the threshold
                                  is compressed back to target slots (the method's B and B + g)

Method state: what a method owns besides (Method.state_fields, e.g. H2O's accumulated scores
[B, Hkv, C] fp32), one StateField per name, allocated and reset with the base state and placed
after it, layer by layer: l<i>_keys, ..., l<i>_budget, l<i>_<method field>, ..., then layer i + 1.

Host fields: a method may keep some base fields of a layer in page-locked host memory that the GPU reads in place
(ClusterKV's offload="cpu": keys and values); they are CUDA tensors all the same (kvrewrite/offload.py).
"""
import inspect
from dataclasses import dataclass

import torch

STATE_FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "budget")
NO_LIMIT = 2**62  # a threshold that is never reached
DIMS = ("B", "Hkv", "C", "D", "L")


def full_length(max_length: int, prefill_chunk: int) -> int:
    """L, the most tokens a layer can see: max_length plus the left padding of the prompt to whole prefill chunks."""
    return max_length + prefill_chunk - 1


@dataclass(frozen=True)
class StateField:
    """One state tensor a method owns, per layer.

    Args:
        shape: a tuple of dimension names ("B", "Hkv", "C", "D", "L": batch, KV heads, slots, head dim, and the
            layer's full length `full_length(max_length, prefill_chunk)`, e.g. for one value per token seen) and
            ints, e.g. ("B", "Hkv", "C") for one value per slot; or a callable (B, Hkv, C, D) -> tuple, or
            (B, Hkv, C, D, L) -> tuple.
        dtype: its dtype (fp32 for scores), or None for the model's (the keys' dtype: e.g. ClusterKV's centroids).
        reset: the value every element takes when a generation starts (and the state is allocated).
    """

    shape: object
    dtype: torch.dtype | None = torch.float32
    reset: float = 0.0

    def size(self, B: int, Hkv: int, C: int, D: int, L: int | None = None) -> tuple:
        """The concrete shape; L (the layer's full length) is needed only by a shape that names it."""
        if callable(self.shape):
            params = inspect.signature(self.shape).parameters.values()
            takes_l = len(params) >= 5 or any(p.kind == p.VAR_POSITIONAL for p in params)
            if takes_l and L is None:
                raise ValueError("StateField.shape: the callable takes L (the layer's full length) but none was given "
                                 "(allocate_layer_state(..., L=full_length(max_length, prefill_chunk)))")
            return tuple(int(d) for d in (self.shape(B, Hkv, C, D, L) if takes_l else self.shape(B, Hkv, C, D)))
        bad = [d for d in self.shape if not (isinstance(d, int) or d in DIMS)]
        if bad:
            raise ValueError(f"StateField.shape: {bad} are neither ints nor one of {DIMS}")
        if "L" in self.shape and L is None:
            raise ValueError(f"StateField.shape {self.shape} names L (the layer's full length) but none was given "
                             f"(allocate_layer_state(..., L=full_length(max_length, prefill_chunk)))")
        dims = dict(zip(DIMS, (B, Hkv, C, D, L)))
        return tuple(dims[d] if isinstance(d, str) else int(d) for d in self.shape)


def allocate_layer_state(B: int, Hkv: int, C: int, D: int, dtype, device, extra: dict | None = None,
                         host_fields: tuple = (), L: int | None = None) -> dict:
    """Fresh (empty) state for one layer with capacity C slots; `extra` the method's {name: StateField};
    `host_fields` the base fields ("keys", "values") to place in mapped host memory (kvrewrite.offload.host_alias,
    CUDA devices only), zero-filled like the others; L the layer's full length (`full_length`), for the fields
    that name it."""
    bad = [f for f in host_fields if f not in ("keys", "values")]
    if bad:
        raise ValueError(f"allocate_layer_state: only keys and values can live in host memory, got {bad}")

    def kv(field):
        if field in host_fields:
            from kvrewrite.offload import host_alias

            return host_alias((B, Hkv, C, D), dtype, device)
        return torch.zeros(B, Hkv, C, D, dtype=dtype, device=device)

    state = {
        "keys": kv("keys"),
        "values": kv("values"),
        "bias": torch.full((B, Hkv, C), float("-inf"), dtype=torch.float32, device=device),
        "slot_pos": torch.zeros(B, Hkv, C, dtype=torch.int64, device=device),
        "fill": torch.zeros(B, Hkv, dtype=torch.int64, device=device),
        "budget": torch.tensor([NO_LIMIT, NO_LIMIT], dtype=torch.int64, device=device),
    }
    for name, spec in (extra or {}).items():
        if name in state:
            raise ValueError(f"method state field {name!r} clashes with the base state {STATE_FIELDS}")
        state[name] = torch.full(spec.size(B, Hkv, C, D, L), spec.reset, dtype=spec.dtype or dtype, device=device)
    return state


def reset_layer_state(state: dict, target: int, threshold: int, extra: dict | None = None) -> None:
    """Empty the state in place (keeps tensor identity, which CUDA graphs and compiled code rely on);
    `extra` the method's {name: StateField}, each set to its reset value."""
    state["keys"].zero_()
    state["values"].zero_()
    state["bias"].fill_(float("-inf"))
    state["slot_pos"].zero_()
    state["fill"].zero_()
    state["budget"].copy_(torch.tensor([target, threshold], dtype=torch.int64))
    for name, spec in (extra or {}).items():
        state[name].fill_(spec.reset)
