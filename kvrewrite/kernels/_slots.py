"""Row-level helpers shared by the compression references (not ops themselves).

A row is one (batch, kv-head) pair of a layer's slot state. Compression references read the valid
slots of a row in slot order (append order, which is temporal order), decide what to keep or merge,
and store the result packed at the front of the row, clearing the rest (bias -inf).

These read fill and budget on the host: they serve the references (the CPU path). The CUDA kernels
(in each op's file, with their shared device-side helpers in _slot_kernels.py) do the same on the device.
"""
import torch

NEG_INF = float("-inf")


def rows_due(fill: torch.Tensor, budget: torch.Tensor, skip_heads=()) -> list[tuple[int, int]]:
    """Rows whose fill reached the threshold (budget = [target, threshold]); a host read, CPU path."""
    threshold = int(budget[1])
    due = (fill >= threshold).nonzero().tolist()
    return [(b, h) for b, h in due if h not in skip_heads]


def load_row(keys, values, bias, slot_pos, fill, b, h):
    """The valid slots of row (b, h) in slot order: K, V [L, D], bias [L] fp32, pos [L] int64."""
    n = int(fill[b, h])
    idx = (bias[b, h, :n] > NEG_INF).nonzero().squeeze(1)
    return keys[b, h, idx], values[b, h, idx], bias[b, h, idx], slot_pos[b, h, idx]


def store_row(keys, values, bias, slot_pos, fill, b, h, K, V, row_bias, pos):
    """Write L slots packed at the front of row (b, h), clear the rest, set fill = L."""
    L = K.shape[0]
    keys[b, h, :L] = K.to(keys.dtype)
    values[b, h, :L] = V.to(values.dtype)
    bias[b, h, :L] = row_bias
    slot_pos[b, h, :L] = pos
    bias[b, h, L:] = NEG_INF
    fill[b, h] = L
