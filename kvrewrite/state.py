"""The clustered-cache state of one layer: static-shape tensors the rewritten graphs read and update.

    keys, values: [B, Hkv, C, D]  model dtype
    bias:         [B, Hkv, C]     fp32, log of the slot's degree; -inf marks an empty slot
    slot_pos:     [B, Hkv, C]     int64, cache position of the slot (the largest of a merged slot)
    fill:         [B, Hkv]        int64, slots in use per row (the append pointer)
    budget:       [2]             int64, (target, threshold): a row whose fill reaches the threshold
                                  is compressed back to target slots (the method's B and B + g)
"""
import torch

STATE_FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "budget")
NO_LIMIT = 2**62  # a threshold that is never reached


def allocate_layer_state(B: int, Hkv: int, C: int, D: int, dtype, device) -> dict:
    """Fresh (empty) state for one layer with capacity C slots."""
    return {
        "keys": torch.zeros(B, Hkv, C, D, dtype=dtype, device=device),
        "values": torch.zeros(B, Hkv, C, D, dtype=dtype, device=device),
        "bias": torch.full((B, Hkv, C), float("-inf"), dtype=torch.float32, device=device),
        "slot_pos": torch.zeros(B, Hkv, C, dtype=torch.int64, device=device),
        "fill": torch.zeros(B, Hkv, dtype=torch.int64, device=device),
        "budget": torch.tensor([NO_LIMIT, NO_LIMIT], dtype=torch.int64, device=device),
    }


def reset_layer_state(state: dict, target: int, threshold: int) -> None:
    """Empty the state in place (keeps tensor identity, which CUDA graphs and compiled code rely on)."""
    state["keys"].zero_()
    state["values"].zero_()
    state["bias"].fill_(float("-inf"))
    state["slot_pos"].zero_()
    state["fill"].zero_()
    state["budget"].copy_(torch.tensor([target, threshold], dtype=torch.int64))
