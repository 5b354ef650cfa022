"""kvrewrite::evict_by_score — keep a recent window plus the highest-scoring older slots, drop the rest.

The compression of H2O (https://arxiv.org/abs/2306.14048: heavy hitters by accumulated attention +
recent tokens) and SnapKV (https://arxiv.org/abs/2404.14469: the observation window + the top pooled
scores of the window's attention). The score is method state, filled by kvrewrite::accumulate_attention.

For every row (b, kv-head) whose fill reached the threshold (budget = [target B, threshold]):

1. its valid slots (slot < fill, bias > -inf; padding slots are dropped) in slot order, which is
   temporal order; L of them. A row with L <= B keeps them all (only the padding goes);
2. otherwise R = min(n_recent + floor(recent_ratio * B), B) most recent valid slots are kept, and
   among the L - R older ones the B - R with the highest score, where the score is first max-pooled
   over a window of `pool` neighbouring older slots (in temporal order, the window clipped at both
   ends; pool = 1: the raw score). Ties go to the earlier slot;
3. the kept slots are packed at the front of the row in temporal order, each with its keys, values,
   bias, position and score; the freed slots get bias -inf and score 0; fill = the slots kept. With
   reset_score the kept slots' scores restart at 0 too (SnapKV's window restarts).

Rows below the threshold are untouched (bit for bit).

State (mutated): keys, values [B, Hkv, C, D]; bias, slot_pos [B, Hkv, C]; fill [B, Hkv]; score [B, Hkv, C]
fp32. budget: [2] int64. Args: n_recent (int >= 0), recent_ratio (float in [0, 1]), pool (odd int >= 1),
reset_score (bool).

One implementation for every device: static-shape tensor code (ranks by cumsum, a stable sort for the
top scores, scatter/gather compaction), no host reads, so CUDA graphs capture it and no step syncs.
Its cost is one gather of the layer's keys and values (a temporary copy of both), on compressing steps
only; a Triton kernel writing only the due rows is future work (docs/methods.md).
"""
import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def _check_inputs(keys, bias, score, n_recent, recent_ratio, pool):
    name = "kvrewrite::evict_by_score"
    B, H, C, _ = keys.shape
    if tuple(score.shape) != (B, H, C) or score.dtype != torch.float32:
        raise ValueError(f"{name}: score must be fp32 [B, Hkv, C] = {(B, H, C)}, "
                         f"got {score.dtype} {tuple(score.shape)}")
    if tuple(bias.shape) != (B, H, C):
        raise ValueError(f"{name}: bias must be [B, Hkv, C] = {(B, H, C)}, got {tuple(bias.shape)}")
    if n_recent < 0 or not 0 <= recent_ratio <= 1:
        raise ValueError(f"{name}: n_recent must be >= 0 and recent_ratio in [0, 1], got {n_recent}, {recent_ratio}")
    if pool < 1 or pool % 2 == 0:
        raise ValueError(f"{name}: pool must be an odd int >= 1 (1: no pooling), got {pool}")


def kept_slots(bias, fill, budget, score, n_recent: int, recent_ratio: float, pool: int):
    """The selection of evict_by_score: (due [B, H], keep [B, H, C] bool) for every row, due or not."""
    B, H, C = bias.shape
    ar = torch.arange(C, device=bias.device)
    target = budget[0]
    due = fill >= budget[1]
    valid = (ar < fill[..., None]) & (bias > NEG_INF)
    L = valid.sum(dim=-1, keepdim=True)
    rank = valid.long().cumsum(dim=-1) - 1  # temporal rank among the valid slots
    recent = torch.minimum(n_recent + torch.floor(recent_ratio * target.double()).long(), target)
    n_old = (L - recent).clamp_min(0)
    old = valid & (rank < n_old)
    s = score.masked_fill(~old, NEG_INF)
    if pool > 1:  # max-pool the older slots' scores in temporal order (the padding and recent slots are -inf)
        dest = torch.where(old, rank, C)
        packed = torch.full((B, H, C + 1), NEG_INF, device=bias.device).scatter(-1, dest, s)[..., :C]
        pooled = F.max_pool1d(packed.reshape(B * H, 1, C), pool, stride=1, padding=pool // 2).view(B, H, C)
        s = pooled.gather(-1, rank.clamp(0, C - 1)).masked_fill(~old, NEG_INF)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # ties: the earlier slot first
    place = torch.empty_like(order).scatter_(-1, order, ar.expand(B, H, C))
    keep = valid & ((rank >= n_old) | (place < target - recent))
    return due, torch.where(L > target, keep, valid)


def reference_evict_by_score(keys, values, bias, slot_pos, fill, budget, score, n_recent, recent_ratio, pool,
                             reset_score):
    """The op (every device): selection, then compaction of the due rows by one gather per state tensor."""
    B, H, C, D = keys.shape
    due, keep = kept_slots(bias, fill, budget, score, n_recent, recent_ratio, pool)
    ar = torch.arange(C, device=keys.device)
    keep = keep & due[..., None]
    n_kept = keep.sum(dim=-1)
    # source slot of every destination: kept slots scatter to their packed place, the others past C;
    # destinations past the packed ones (and every slot of a row not due) keep their own slot
    dest = torch.where(keep, keep.long().cumsum(dim=-1) - 1, C + ar)
    src = torch.cat([ar, ar]).expand(B, H, 2 * C).scatter(-1, dest, ar.expand(B, H, C))[..., :C]
    src = torch.where(due[..., None], src, ar)
    freed = due[..., None] & (ar >= n_kept[..., None])
    src4 = src[..., None].expand(B, H, C, D)
    keys.copy_(keys.gather(2, src4))
    values.copy_(values.gather(2, src4))
    slot_pos.copy_(slot_pos.gather(2, src))
    bias.copy_(bias.gather(2, src).masked_fill(freed, NEG_INF))
    moved = score.gather(2, src).masked_fill(freed, 0.0)
    score.copy_(moved.masked_fill(due[..., None], 0.0) if reset_score else moved)
    fill.copy_(torch.where(due, n_kept, fill))


@torch.library.custom_op("kvrewrite::evict_by_score",
                         mutates_args=("keys", "values", "bias", "slot_pos", "fill", "score"))
def evict_by_score(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    budget: torch.Tensor,
    score: torch.Tensor,
    n_recent: int,
    recent_ratio: float = 0.0,
    pool: int = 1,
    reset_score: bool = False,
) -> None:
    """Recent window + top older slots by (pooled) score, for the rows at the threshold (module docstring)."""
    _check_inputs(keys, bias, score, n_recent, recent_ratio, pool)
    reference_evict_by_score(keys, values, bias, slot_pos, fill, budget, score, n_recent, recent_ratio, pool,
                             reset_score)


@evict_by_score.register_fake
def _(keys, values, bias, slot_pos, fill, budget, score, n_recent, recent_ratio=0.0, pool=1, reset_score=False):
    return None
