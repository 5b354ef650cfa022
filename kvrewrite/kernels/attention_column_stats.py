"""kvrewrite::attention_column_stats — how much attention each slot receives, for score-based methods.

For the queries of a prefill chunk (or a decode step), with the same visibility and degree bias as
kvrewrite::clustered_attention:

    p[h, t, j] = exp(scale * q[h, t]·k_j + b_j - lse[h, t])       (the softmax probability)
    total[h, j]  = sum_t p[h, t, j]                                 (H2O's accumulated attention)
    recent[h, j] = sum_{t >= T - last} p[h, t, j]                   (SnapKV's observation window)

per query head h (methods pool the query heads of a KV head as their paper says). `lse` is the
log-sum-exp of each query's visible logits, which the attention computes anyway; given it, one pass
over the slots suffices and the T x C probability matrix is never materialised (the reference
walks T in blocks). Pass lse=None to compute it here (a second pass).

Args:
    q: [B, Hq, T, D]; keys: [B, Hkv, C, D]; bias, slot_pos: [B, Hkv, C]; cache_position: [T]
    lse: [B, Hq, T] fp32 or None; scale: softmax scale; window: sliding window (0: none);
    last: the number of most recent queries summed into `recent` (clamped to T)
Returns:
    (total, recent), each [B, Hq, C] fp32; invisible and empty slots get 0; queries that see no
    slot contribute nothing.
"""
import torch

BLOCK_T = 128  # queries per block of the reference: bounds its memory to B*Hq*BLOCK_T*C floats


def _visible_logits(q, keys, bias, slot_pos, cache_position, scale, window):
    """fp32 logits [B, Hq, t, C] with -inf where a slot is invisible or empty."""
    B, Hq, T, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    logits = torch.einsum("bhgtd,bhcd->bhgtc", q.float().view(B, Hkv, G, T, D), keys.float())
    logits = logits * scale + bias[:, :, None, None, :]
    qp, sp = cache_position[None, None, None, :, None], slot_pos[:, :, None, None, :]
    visible = sp <= qp
    if window > 0:
        visible = visible & (sp > qp - window)
    return logits.masked_fill(~visible, float("-inf")).reshape(B, Hq, T, -1)


def reference_attention_column_stats(q, keys, bias, slot_pos, cache_position, lse, scale, window, last):
    """Plain-PyTorch reference, blockwise over queries; fp32 throughout."""
    B, Hq, T, _ = q.shape
    C = keys.shape[2]
    total = torch.zeros(B, Hq, C, dtype=torch.float32, device=q.device)
    recent = torch.zeros_like(total)
    first_recent = T - min(max(last, 0), T)
    for t0 in range(0, T, BLOCK_T):
        t1 = min(t0 + BLOCK_T, T)
        logits = _visible_logits(q[:, :, t0:t1], keys, bias, slot_pos, cache_position[t0:t1], scale, window)
        block_lse = logits.logsumexp(dim=-1) if lse is None else lse[:, :, t0:t1].float()
        p = torch.exp(logits - block_lse[..., None])
        p = torch.nan_to_num(p, nan=0.0)  # a query seeing nothing: -inf - -inf
        total += p.sum(dim=2)
        if t1 > first_recent:
            recent += p[:, :, max(first_recent - t0, 0) :].sum(dim=2)
    return total, recent


@torch.library.custom_op("kvrewrite::attention_column_stats", mutates_args=())
def attention_column_stats(
    q: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    window: int,
    last: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column sums of the attention probabilities, over all queries and the last `last` ones."""
    return reference_attention_column_stats(q, keys, bias, slot_pos, cache_position, lse, scale, window, last)


@attention_column_stats.register_fake
def _(q, keys, bias, slot_pos, cache_position, lse, scale, window, last):
    B, Hq, _, _ = q.shape
    C = keys.shape[2]
    return q.new_empty(B, Hq, C, dtype=torch.float32), q.new_empty(B, Hq, C, dtype=torch.float32)
