"""kvrewrite::cache_append — write the new tokens' keys and values into a layer's slot state.

State of one layer (all mutated in place):
    keys:     [B, Hkv, C, D]   model dtype
    values:   [B, Hkv, C, D]   model dtype
    bias:     [B, Hkv, C]      fp32, log of the slot's degree (0 for an exact token, -inf for empty)
    slot_pos: [B, Hkv, C]      int64, cache position of the slot (max over a merged slot's tokens)
    fill:     [B, Hkv]         int64, slots in use per row (the append pointer)
New tokens:
    k_new, v_new:   [B, Hkv, T, D]
    cache_position: [T] int64, the tokens' cache positions (shared by the batch, pads included)
    token_valid:    [B, T] bool, False for padding (its slot gets bias -inf and is never attended)

Slots [fill, fill + T) of each (b, h) row are written and fill grows by T. The write index is
computed on the device (fill + arange(T), a scatter), so the op never syncs with the host. Rows keep
their own fill because compression may leave them different (outlier heads are never compressed).
The runtime guarantees fill + T <= C.
"""
import torch

NEG_INF = float("-inf")


def reference_cache_append(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid):
    """Plain-PyTorch reference; a scatter with a device-side index keeps it sync-free."""
    B, Hkv, T, D = k_new.shape
    idx = fill[:, :, None] + torch.arange(T, device=keys.device)  # [B, Hkv, T]
    keys.scatter_(2, idx[..., None].expand(B, Hkv, T, D), k_new.to(keys.dtype))
    values.scatter_(2, idx[..., None].expand(B, Hkv, T, D), v_new.to(values.dtype))
    new_bias = torch.zeros(B, T, dtype=bias.dtype, device=bias.device).masked_fill(~token_valid, NEG_INF)
    bias.scatter_(2, idx, new_bias[:, None, :].expand(B, Hkv, T))
    slot_pos.scatter_(2, idx, cache_position.to(slot_pos.dtype)[None, None, :].expand(B, Hkv, T))
    fill.add_(T)


@torch.library.custom_op("kvrewrite::cache_append", mutates_args=("keys", "values", "bias", "slot_pos", "fill"))
def cache_append(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_position: torch.Tensor,
    token_valid: torch.Tensor,
) -> None:
    """Append T tokens to the slot state of one layer (see the module docstring for shapes)."""
    reference_cache_append(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid)


@cache_append.register_fake
def _(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid):
    return None
