"""kvrewrite::clustered_attention — degree-biased attention of new queries over a layer's slots.

    o[t] = sum_j exp(scale * q[t]·k_j + b_j) v_j / sum_j exp(scale * q[t]·k_j + b_j)

over the slots j visible to query t: slot_pos[j] <= cache_position[t] (causality, which also covers
the fresh tokens of a prefill chunk written just before), and, for a sliding-window layer
(window > 0), slot_pos[j] > cache_position[t] - window. b_j = log n_j is the slot's degree bias
(0 for an exact token, -inf for an empty or padding slot), so merging identical keys is exact
(Chelsea eq. 2). GQA is index math: query head h reads KV head h // (Hq // Hkv).

Args:
    q:              [B, Hq, T, D]   model dtype
    keys, values:   [B, Hkv, C, D]  model dtype
    bias:           [B, Hkv, C]     fp32
    slot_pos:       [B, Hkv, C]     int64
    cache_position: [T]             int64
    scale:          softmax scale (the model's, e.g. D**-0.5)
    window:         sliding window of the layer, 0 for none
Returns:
    [B, Hq, T, D] in q's dtype, contiguous (whatever q's strides: q is often a transposed view,
    and Inductor checks the real output's strides against the fake's); a query that sees no slot
    gets zeros (padding queries).
"""
import torch


def reference_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window):
    """Plain-PyTorch reference. Load-bearing choices: fp32 logits, softmax and accumulation; the bias
    is added after scaling; rows with no visible slot return 0 instead of NaN."""
    B, Hq, T, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    qf = q.float().view(B, Hkv, G, T, D)
    logits = torch.einsum("bhgtd,bhcd->bhgtc", qf, keys.float()) * scale + bias[:, :, None, None, :]
    qp = cache_position[None, None, None, :, None]
    sp = slot_pos[:, :, None, None, :]
    visible = sp <= qp
    if window > 0:
        visible = visible & (sp > qp - window)
    logits = logits.masked_fill(~visible, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(logits - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgtc,bhcd->bhgtd", p, values.float()) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    return out.reshape(B, Hq, T, D).to(q.dtype)


def cpu_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window):
    """The CPU path: the same function through PyTorch's fused SDPA with an additive fp32 mask
    (bias, -inf where invisible); query groups are folded into the query axis for GQA. Checked
    against the float64 spelling of the formula in tests/kernels/test_clustered_attention.py."""
    B, Hq, T, D = q.shape
    Hkv, C = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    qp = cache_position[None, None, :, None]
    sp = slot_pos[:, :, None, :]
    visible = sp <= qp
    if window > 0:
        visible = visible & (sp > qp - window)
    mask = bias[:, :, None, :].masked_fill(~visible, float("-inf"))  # [B, Hkv, T, C]
    seen = torch.isfinite(mask).any(dim=-1, keepdim=True)  # [B, Hkv, T, 1]
    mask = mask.masked_fill(~seen, 0.0)  # no NaN rows; their output is zeroed below
    mask = mask[:, :, None].expand(B, Hkv, G, T, C).reshape(B, Hkv, G * T, C)
    f32 = torch.float32
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(f32).reshape(B, Hkv, G * T, D), keys.to(f32), values.to(f32), attn_mask=mask, scale=scale
    )
    out = out.view(B, Hkv, G, T, D).masked_fill(~seen[:, :, None], 0.0)
    return out.reshape(B, Hq, T, D).to(q.dtype)


@torch.library.custom_op("kvrewrite::clustered_attention", mutates_args=())
def clustered_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Degree-biased attention over cache slots (see the module docstring)."""
    if not q.is_cuda:
        # CPU: attend only up to the last used slot (slots past it are empty, bias -inf); the host
        # read is free here, and the result is the same.
        used = torch.isfinite(bias).flatten(0, 1).any(dim=0).nonzero()
        last = int(used[-1]) + 1 if used.numel() else 1
        keys, values, bias, slot_pos = keys[:, :, :last], values[:, :, :last], bias[:, :, :last], slot_pos[:, :, :last]
        return cpu_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window).contiguous()
    return reference_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window).contiguous()


@clustered_attention.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, scale, window):
    return q.new_empty(q.shape)  # contiguous, like the real output (empty_like would copy q's strides)
