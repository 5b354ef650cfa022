"""evict_by_score's rule row by row in plain Python, on the temporal view: what the op leaves, read through `order`.

Before `order` existed the op packed the kept slots at the front of each row in temporal order. That layout is the
spec the op's new one must match when viewed through `order` (kvrewrite/kernels/evict_by_score.py): `packed_evict`
applies it, row by row, to a state whose slots are in temporal order, and `temporal` reads any state that way.
"""
import math

import torch

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
