"""evict_by_score's rule in the layout it had before `order`: what the op must leave, read through `order`.

Before `order` existed the op packed the kept slots at the front of each row in temporal order. That layout is the
spec the op's new one must match when viewed through `order` (kvrewrite/kernels/evict_by_score.py), in two forms:
`packed_evict` applies the rule row by row in plain Python (finite and +inf scores: its max and sort do not rank NaN
as the op does, and it keeps exactly B - R older slots, where the op's stable sort, at a threshold of -inf, also
counts the row's padding ranks among the -inf ones and can keep fewer), and `packed_reference` is the op's tensor
code as it was then (the selection and the packing, copied), for every input. `temporal` reads any state in order.
"""
import math

import torch
import torch.nn.functional as F

PER_SLOT = ("keys", "values", "bias", "slot_pos", "score")  # the fields `order` permutes


def temporal(s) -> dict:
    """A copy of state `s` with its per-slot fields in temporal order (rank r at index r); order becomes zeros."""
    slot = torch.arange(s["order"].shape[-1]) + s["order"].long()
    out = {f: t.clone() for f, t in s.items()}
    for f in PER_SLOT:
        idx = slot[..., None].expand_as(s[f]) if s[f].dim() == 4 else slot
        out[f] = s[f].gather(2, idx)
    out["order"] = torch.zeros_like(s["order"])
    return out


def expected_row(before, b, h, target, n_recent, recent_ratio, pool):
    """The ranks a due row keeps, oldest first, of a state in temporal order (`temporal`): plain Python over its
    valid ranks."""
    n = int(before["fill"][b, h])
    valid = [j for j in range(n) if before["bias"][b, h, j] > -math.inf]
    L = len(valid)
    if L <= target:
        return valid
    R = min(n_recent + math.floor(recent_ratio * target), target)
    old = valid[:L - R]
    raw = [float(before["score"][b, h, j]) for j in old]
    half = pool // 2
    pooled = [max(raw[max(0, i - half):i + half + 1]) for i in range(len(old))]
    ranked = sorted(range(len(old)), key=lambda i: (-pooled[i], i))  # ties: the earlier slot
    heavy = sorted(old[i] for i in ranked[:target - R])
    return heavy + valid[L - R:]


def packed_evict(s, n_recent, recent_ratio, pool, reset_score) -> None:
    """The rule on a temporal-order state, in place: each due row's kept ranks packed at its front in order, the
    rest freed (bias -inf, score 0; keys, values, slot_pos as they were), fill = the kept count."""
    target, threshold = (int(x) for x in s["budget"])
    B, H = s["fill"].shape
    for b in range(B):
        for h in range(H):
            if int(s["fill"][b, h]) < threshold:
                continue
            kept = expected_row(s, b, h, target, n_recent, recent_ratio, pool)
            K = len(kept)
            for f in PER_SLOT:
                s[f][b, h, :K] = s[f][b, h, kept].clone()
            s["bias"][b, h, K:] = -math.inf
            s["score"][b, h, K:] = 0.0
            if reset_score:
                s["score"][b, h] = 0.0
            s["fill"][b, h] = K


def same(a, b) -> bool:
    """Bit equality (NaN == NaN of the same bits, -0.0 != 0.0)."""
    if a.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(bits), b.view(bits)
    return a.shape == b.shape and torch.equal(a, b)


def check_order(s) -> None:
    """`order`'s invariant: per row, ranks < fill map onto slots [0, fill) one to one, ranks >= fill onto themselves
    (delta 0)."""
    C = s["order"].shape[-1]
    slot = torch.arange(C) + s["order"].long()
    B, H = s["fill"].shape
    for b in range(B):
        for h in range(H):
            n = min(int(s["fill"][b, h]), C)
            assert sorted(slot[b, h, :n].tolist()) == list(range(n)), (b, h, slot[b, h].tolist())
            assert bool((s["order"][b, h, n:] == 0).all()), (b, h, s["order"][b, h].tolist())


def check_view(got, want) -> None:
    """State `got` (any layout) read through its order holds what `want` (temporal layout, packed_evict's) does:
    fill, and every per-slot field of the ranks in use, bit for bit; bias -inf and score 0 past the fill (the
    keys, values and slot_pos there are garbage either way)."""
    check_order(got)
    view = temporal(got)
    assert torch.equal(got["fill"], want["fill"]), (got["fill"].tolist(), want["fill"].tolist())
    B, H = want["fill"].shape
    for b in range(B):
        for h in range(H):
            n = int(want["fill"][b, h])
            bad = [f for f in PER_SLOT if not same(view[f][b, h, :n], want[f][b, h, :n])]
            assert not bad, f"row ({b}, {h}): {bad} differ from the packed rule"
            assert bool((view["bias"][b, h, n:] == -math.inf).all()), (b, h)
            assert same(view["score"][b, h, n:], want["score"][b, h, n:]), (b, h)


def packed_reference(keys, values, bias, slot_pos, fill, budget, score, n_recent, recent_ratio, pool, reset_score):
    """The op's reference before `order` (main at cfcb29a), on a state in temporal order: selection, then the kept
    slots packed in order by one gather per tensor (through integer views, so that NaN payloads stay as they are)."""
    B, H, C, D = keys.shape
    ar = torch.arange(C)
    target = budget[0]
    due = fill >= budget[1]
    valid = (ar < fill[..., None]) & (bias > -math.inf)
    L = valid.sum(dim=-1, keepdim=True)
    rank = valid.long().cumsum(dim=-1) - 1
    recent = torch.minimum(n_recent + torch.floor(recent_ratio * target.double()).long(), target)
    n_old = (L - recent).clamp_min(0)
    old = valid & (rank < n_old)
    s = score.masked_fill(~old, -math.inf)
    if pool > 1:
        dest = torch.where(old, rank, C)
        packed = torch.full((B, H, C + 1), -math.inf).scatter(-1, dest, s)[..., :C]
        pooled = F.max_pool1d(packed.reshape(B * H, 1, C), pool, stride=1, padding=pool // 2).view(B, H, C)
        s = pooled.gather(-1, rank.clamp(0, C - 1)).masked_fill(~old, -math.inf)
    ranked = torch.sort(s, dim=-1, descending=True, stable=True).indices
    place = torch.empty_like(ranked).scatter_(-1, ranked, ar.expand(B, H, C))
    keep = valid & ((rank >= n_old) | (place < target - recent))
    keep = torch.where(L > target, keep, valid) & due[..., None]
    n_kept = keep.sum(dim=-1)
    dest = torch.where(keep, keep.long().cumsum(dim=-1) - 1, C + ar)
    src = torch.cat([ar, ar]).expand(B, H, 2 * C).scatter(-1, dest, ar.expand(B, H, C))[..., :C]
    src = torch.where(due[..., None], src, ar)
    freed = due[..., None] & (ar >= n_kept[..., None])

    def gathered(x, index):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return x.view(bits).gather(2, index).view(x.dtype) if x.dtype.is_floating_point else x.gather(2, index)

    src4 = src[..., None].expand(B, H, C, D)
    keys.copy_(gathered(keys, src4))
    values.copy_(gathered(values, src4))
    slot_pos.copy_(slot_pos.gather(2, src))
    bias.copy_(gathered(bias, src).masked_fill(freed, -math.inf))
    moved = gathered(score, src).masked_fill(freed, 0.0)
    score.copy_(moved.masked_fill(due[..., None], 0.0) if reset_score else moved)
    fill.copy_(torch.where(due, n_kept, fill))
