"""kvrewrite::evict_to_budget — keep sink slots and the most recent slots, drop the rest.

The eviction used by StreamingLLM (https://arxiv.org/abs/2309.17453) and, with n_sink = 0, by
sliding-window layers (keeping the last window - 1 tokens is exact for them, since the attention
op masks by position as well).

State (mutated): keys, values [B, Hkv, C, D]; bias, slot_pos [B, Hkv, C]; fill [B, Hkv].
budget: [2] int64 (target, threshold). A row whose fill reached the threshold keeps its first
n_sink valid slots and its last target - n_sink valid slots, packed in order; padding slots go first.
Rows below the threshold are untouched.

Backends: the reference below reads fill and budget on the host (CPU, and CUDA without Triton); on
CUDA the Triton kernel in _compress_cuda.py does the same on the device, with no host sync (CUDA
graphs can capture it), bit-for-bit the same result.
"""
import torch

from kvrewrite.kernels import _compress_cuda
from kvrewrite.kernels._slots import load_row, rows_due, store_row


def reference_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink):
    target = int(budget[0])
    for b, h in rows_due(fill, budget):
        K, V, row_bias, pos = load_row(keys, values, bias, slot_pos, fill, b, h)
        L = K.shape[0]
        if L > target:
            keep = torch.cat([torch.arange(min(n_sink, target)), torch.arange(L - (target - min(n_sink, target)), L)])
            K, V, row_bias, pos = K[keep], V[keep], row_bias[keep], pos[keep]
        store_row(keys, values, bias, slot_pos, fill, b, h, K, V, row_bias, pos)


@torch.library.custom_op("kvrewrite::evict_to_budget", mutates_args=("keys", "values", "bias", "slot_pos", "fill"))
def evict_to_budget(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    budget: torch.Tensor,
    n_sink: int,
) -> None:
    """Sink + recent eviction of the rows that reached the threshold (see the module docstring)."""
    reference_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink)


@evict_to_budget.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, n_sink):
    if _compress_cuda.triton is None:
        reference_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink)
    else:
        _compress_cuda.triton_evict_to_budget(keys, values, bias, slot_pos, fill, budget, n_sink)


@evict_to_budget.register_fake
def _(keys, values, bias, slot_pos, fill, budget, n_sink):
    return None
