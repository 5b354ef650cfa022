"""kvrewrite::kvmerger_compress — KVMerger's protected slots + merging sets of adjacent similar keys.

Based on "Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on Long-Context Tasks" (KVMerger,
https://arxiv.org/abs/2407.08454), Sec. 4; the contract is docs/contracts/kvmerger.md (issue 16), the paper's notes
shared/notes/001-kvmerger.md. The score is method state filled by kvrewrite::accumulate_attention (as H2O's);
`degree` is the number of tokens each slot stands for (1 for a fresh slot).

For every row (b, kv-head) whose fill + deficit reached the threshold (budget = [target Bt, threshold]; deficit
below), with its valid slots
(slot < fill, bias > -inf; padding is dropped) v_0 .. v_{N-1} in slot order (= sequence order):

1. N <= Bt: the valid slots are packed to the front (order kept), fill = N.
2. Protected, kept as they are: the first n_s = min(n_sink, Bt) valid slots, the last n_r = min(floor(recent_ratio
   * Bt), Bt - n_s), then among the others the n_h = min(floor(hh_ratio * Bt), Bt - n_s - n_r) with the largest
   score (ties: the earlier slot). P = n_s + n_r + n_h <= Bt.
3. The other M = N - P slots are mergeable; adjacent pair i = (v_i, v_{i+1}) is joinable when both are mergeable
   (sets never span a protected slot); c_i = cos(k_{v_i}, k_{v_{i+1}}) in fp32 (a zero-norm key: cos 0).
4. J = N - Bt joins are needed. reading "chain": the J joinable pairs with the largest c_i (budget_mode "exact"),
   or every pair with c_i > epsilon and, if fewer than J, the next most similar up to J ("epsilon"); ties: the
   earlier pair. reading "anchor": from the last mergeable slot backwards, slot j joins the set to its right iff
   cos(k_anchor, k_j) > epsilon (the anchor: the set's right-most member), else it starts a new set as its anchor;
   then, while the row holds more than Bt slots, the unjoined joinable pair with the largest c_i is joined.
   Fewer than J joinable pairs: all are joined, then the set slots with the lowest summed score are evicted
   (ties: the earlier first) until Bt slots remain.
5. A set (a maximal run of joined pairs) of >= 2 members becomes one slot: pivot p = the largest score (ties: the
   earlier); g_i = exp(-||k_p - k_i||^2 / (2 sigma^2)) (sigma = 0: g_i = 1), sigma per sigma_mode ("fixed": sigma;
   "distance": sum_i ||k_p - k_i|| / (sqrt(2) |S|); "paper": sigma, then 10 rounds of sigma <- sum_i g_i /
   (sqrt(2) |S|)); w_i = g_i d_i / sum_j g_j d_j; k = sum w_i k_i; values_mode "scale": v = D_S sum w_i v_i / d_i,
   bias 0; "bias": v = sum w_i v_i, bias log D_S; degree D_S = sum d_i, score sum_i score_i, slot_pos the pivot's.
   A one-member set and every protected slot pass unchanged.
6. The kept slots are packed to the front in slot order, fill = their count; the freed slots [fill, C) get bias
   -inf, score 0 and degree 1, their keys, values and slot_pos stay as they are (as kvrewrite::evict_by_score).
7. deficit = min(N + deficit, Bt) - fill: the slots the row holds below what kvrewrite.host.HostSchedule's mirror
   assumes (min(valid, target), Method.after_compression's default; the mirror's valid count is N + deficit). 0 in
   "exact" chain mode and the fallback; >= 0 where "epsilon"/"anchor" keep fewer than Bt. The due test adds it, so
   the row is due exactly when the host mirror says it is (without it such a row would be due later than the host
   expects: the host would run the plain decode step then, and the row would grow past its capacity).

Rows not due are untouched (bit for bit).

State (mutated): keys, values [B, Hkv, C, D]; bias fp32, slot_pos int64 [B, Hkv, C]; fill [B, Hkv] int64; score
fp32 and degree int32 [B, Hkv, C]; deficit [B, Hkv] int64. budget: [2] int64. The recent and heavy-hitter counts
are ratios of budget[0] read on the device (as evict_by_score's recent_ratio), so one captured graph serves every
prompt length (the contract's n_recent/n_heavy ints, computed on the host, would tie a graph to one budget).

Backends. The reference below (static-shape tensor code: one stable sort packs the valid slots, ranks by cumsum,
stable sorts for the top scores and joins, index_add segment sums for the sets; no host read, deterministic) is the
CPU path and the ground truth. The "anchor" reading is sequential by definition: the reference walks the C slots
in a Python loop over [B * Hkv]-row tensors (C small ops per call; an ablation, not the default).

CUDA path (_cuda_impl decides, in one place): the Triton kernels of kvrewrite/kernels/_kvmerger_kernels.py for
the default reading "chain" with budget_mode "exact", where a compression always keeps min(valid, B) slots and
`deficit` stays 0 (the kernels do not take it). The "epsilon" budget mode and the "anchor" reading (ablations that
can keep fewer than B slots and so update `deficit`) run THIS REFERENCE on the GPU, logged once. The kernels are
checked through Triton's interpreter against a float64 loop implementation of the same rules and against this
reference (tests/kernels/test_kvmerger_compress_triton.py), and compiled on an H100 against the float64 loop
(tests/kernels/test_kvmerger_compress_gpu.py: 22 passed with torch 2.11, Triton 3.6); KERNELS_CHECKED_ON_GPU
records that (a kernel that has never run on a GPU is not the default path).
"""
from __future__ import annotations

import importlib
import math

import torch

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels._slot_kernels import _check_state

NEG_INF = float("-inf")
SIGMA_MODES = ("fixed", "distance", "paper")
VALUES_MODES = ("scale", "bias")
READINGS = ("chain", "anchor")
BUDGET_MODES = ("exact", "epsilon")
PAPER_SIGMA_ITERS = 10  # iterations of the printed (circular) Eq. 6 in sigma_mode "paper"
NAME = "kvrewrite::kvmerger_compress"


def _check_inputs(keys, values, bias, slot_pos, fill, budget, score, degree, deficit, recent_ratio, hh_ratio, n_sink,
                  epsilon, sigma, sigma_mode, values_mode, reading, budget_mode):
    B, H, C, _ = _check_state(NAME, keys, values, bias, slot_pos, fill, budget)
    for field, t, dtype in (("score", score, torch.float32), ("degree", degree, torch.int32)):
        if tuple(t.shape) != (B, H, C) or t.dtype != dtype:
            raise ValueError(f"{NAME}: {field} must be {dtype} [B, Hkv, C] = {[B, H, C]}, got {t.dtype} "
                             f"{list(t.shape)}")
        if not t.is_contiguous() or t.device != keys.device:
            raise ValueError(f"{NAME}: {field} must be contiguous and on {keys.device} (the op updates it in place)")
    if tuple(deficit.shape) != (B, H) or deficit.dtype != torch.int64 or deficit.device != keys.device:
        raise ValueError(f"{NAME}: deficit must be torch.int64 [B, Hkv] = {[B, H]} on {keys.device}, got "
                         f"{deficit.dtype} {list(deficit.shape)}")
    if not (0 <= recent_ratio <= 1 and 0 <= hh_ratio <= 1 and recent_ratio + hh_ratio <= 1):
        raise ValueError(f"{NAME}: recent_ratio and hh_ratio must be in [0, 1] with recent_ratio + hh_ratio <= 1, "
                         f"got {recent_ratio}, {hh_ratio}")
    if n_sink < 0:
        raise ValueError(f"{NAME}: n_sink must be >= 0, got {n_sink}")
    if not -1 <= epsilon < 1:
        raise ValueError(f"{NAME}: epsilon must be a cosine threshold in [-1, 1), got {epsilon}")
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"{NAME}: sigma must be a finite number > 0, got {sigma}")
    for field, v, allowed in (("sigma_mode", sigma_mode, SIGMA_MODES), ("values_mode", values_mode, VALUES_MODES),
                              ("reading", reading, READINGS), ("budget_mode", budget_mode, BUDGET_MODES)):
        if v not in allowed:
            raise ValueError(f"{NAME}: {field} must be one of {allowed}, got {v!r}")


def _cosine_pairs(K):
    """cos(K[:, r], K[:, r + 1]) fp32 [R, C - 1]; a zero-norm key has cos 0 with everything."""
    n = K.norm(dim=-1)
    den = n[:, :-1] * n[:, 1:]
    dot = (K[:, :-1] * K[:, 1:]).sum(-1)
    return torch.where(den > 0, dot / torch.where(den > 0, den, 1.0), 0.0)


def _anchor_joins(K, mergeable, epsilon):
    """Reading "anchor": join[r] (pair (r, r + 1)) walking from the last slot backwards; the current set's anchor is
    its right-most member. Sequential by definition: a loop over the C slots of all rows at once."""
    R, C, D = K.shape
    join = torch.zeros(R, C, dtype=torch.bool, device=K.device)
    n = K.norm(dim=-1)
    anchor = K[:, C - 1]
    anchor_n = n[:, C - 1]
    for r in range(C - 2, -1, -1):
        joinable = mergeable[:, r] & mergeable[:, r + 1]
        den = anchor_n * n[:, r]
        dot = (anchor * K[:, r]).sum(-1)
        cos = torch.where(den > 0, dot / torch.where(den > 0, den, 1.0), 0.0)
        j = joinable & (cos > epsilon)
        join[:, r] = j
        start = ~j
        anchor = torch.where(start[:, None], K[:, r], anchor)
        anchor_n = torch.where(start, n[:, r], anchor_n)
    return join


def _top_flags(key, eligible, count):
    """eligible entries ranked by key descending (ties: the earlier), flag the first `count` [R] of each row."""
    R, C = key.shape
    ar = torch.arange(C, device=key.device)
    k = torch.where(eligible, key, NEG_INF)
    order = torch.sort(k, dim=-1, descending=True, stable=True).indices
    # eligible entries first: a second stable sort by eligibility keeps the key order among them
    order = order.gather(-1, torch.sort((~eligible).gather(-1, order).to(torch.int8), dim=-1, stable=True).indices)
    place = torch.empty_like(order).scatter_(-1, order, ar.expand(R, C))
    return eligible & (place < count[:, None])


def _sigma(dist, member_item, count, sigma, sigma_mode, n_items):
    """sigma per item [R * C] (flat index row * C + item)."""
    if sigma_mode == "fixed":
        return torch.full((n_items,), sigma, dtype=torch.float32, device=dist.device)
    denom = math.sqrt(2.0) * count.clamp_min(1).float()
    if sigma_mode == "distance":
        s = torch.zeros(n_items, dtype=torch.float32, device=dist.device).index_add_(0, member_item, dist.sqrt())
        return s / denom
    s = torch.full((n_items,), sigma, dtype=torch.float32, device=dist.device)
    for _ in range(PAPER_SIGMA_ITERS):
        g = _gauss(dist, s[member_item])
        s = torch.zeros(n_items, dtype=torch.float32, device=dist.device).index_add_(0, member_item, g) / denom
    return s


def _gauss(dist, sig):
    """exp(-dist / (2 sigma^2)); sigma = 0 (the members are the pivot): 1."""
    return torch.where(sig > 0, torch.exp(-dist / (2 * sig * sig).clamp_min(torch.finfo(torch.float32).tiny)), 1.0)


def reference_kvmerger_compress(keys, values, bias, slot_pos, fill, budget, score, degree, deficit, recent_ratio,
                                hh_ratio, n_sink, epsilon, sigma, sigma_mode, values_mode, reading, budget_mode):
    """The CPU path and the ground truth (module docstring): static shapes, no host read, deterministic."""
    B, H, C, D = keys.shape
    if B * H * C == 0:
        return
    R = B * H
    dev = keys.device
    ar = torch.arange(C, device=dev)
    bias_f, pos_f, score_f, deg_f = (t.reshape(R, C) for t in (bias, slot_pos, score, degree))
    fill_f = fill.reshape(R)
    target = budget[0]
    due = fill_f + deficit.reshape(R) >= budget[1]
    valid = (ar < fill_f[:, None]) & (bias_f > NEG_INF)
    N = valid.sum(-1)
    # -- pack the valid slots by rank (r < N valid): one stable sort of the slot index, padding last
    perm = torch.sort(torch.where(valid, ar, C + ar), dim=-1, stable=True).indices
    Kx = keys.reshape(R, C, D).gather(1, perm[..., None].expand(R, C, D))
    Vx = values.reshape(R, C, D).gather(1, perm[..., None].expand(R, C, D))
    bx, px, sx, dx = (t.gather(1, perm) for t in (bias_f, pos_f, score_f, deg_f))
    live = ar < N[:, None]
    over = N > target  # rows that merge (the others only pack)
    # -- protected: sinks, recent window, heavy hitters; sizes from the target on the device
    n_s = torch.clamp(torch.full_like(target, n_sink), max=target)
    n_r = torch.minimum(torch.floor(recent_ratio * target.double()).long(), target - n_s)
    n_h = torch.minimum(torch.floor(hh_ratio * target.double()).long(), target - n_s - n_r)
    sink = live & (ar < n_s)
    recent = live & ~sink & (ar >= (N - n_r)[:, None])
    heavy = _top_flags(sx, live & ~sink & ~recent, n_h.expand(R))
    protected = sink | recent | heavy
    mergeable = live & ~protected & over[:, None]
    # -- joins on pairs (r, r + 1), index r in [0, C - 1)
    Kf = Kx.float()
    joinable = mergeable[:, :-1] & mergeable[:, 1:]
    c = _cosine_pairs(Kf)
    J = (N - target).clamp_min(0)
    if reading == "chain":
        n_join = J if budget_mode == "exact" else torch.maximum(J, (joinable & (c > epsilon)).sum(-1))
        join = _top_flags(c, joinable, n_join)
    else:
        join = _anchor_joins(Kf, mergeable, epsilon)[:, :-1] & joinable
        extra = (J - join.sum(-1)).clamp_min(0)
        join = join | _top_flags(c, joinable & ~join, extra)
    join = torch.cat([join, torch.zeros(R, 1, dtype=torch.bool, device=dev)], dim=1)  # join[r]: r with r + 1
    # -- items: every protected slot and every set (a run of joined pairs), in slot order
    joined_left = torch.cat([torch.zeros(R, 1, dtype=torch.bool, device=dev), join[:, :-1]], dim=1)
    start = live & ~joined_left
    item = start.long().cumsum(-1) - 1  # the item of every live rank
    n_items_row = start.sum(-1)
    item_col = torch.where(start, item, C)  # each item once at its first member; the rest to a spare column
    is_set_item = torch.zeros(R, C + 1, dtype=torch.bool, device=dev).scatter_(1, item_col, start & mergeable)[:, :C]
    flat = (torch.arange(R, device=dev)[:, None] * C + item.clamp_min(0)).reshape(-1)
    livef = live.reshape(-1)
    flat = torch.where(livef, flat, R * C)  # dead ranks go to a spare item
    n_flat = R * C + 1

    def seg_sum(x):
        return torch.zeros((n_flat,) + x.shape[1:], dtype=x.dtype, device=dev).index_add_(0, flat, x)

    count = seg_sum(torch.ones(R * C, dtype=torch.long, device=dev))
    item_score = seg_sum(sx.reshape(-1))
    # fallback: too few joinable pairs -> evict the set items with the lowest summed score (ties: the earlier)
    keep_item = torch.arange(C, device=dev) < n_items_row[:, None]
    n_evict = (n_items_row - target).clamp_min(0) * over
    evict = _top_flags(-item_score[:R * C].view(R, C), is_set_item & keep_item, n_evict)
    keep_item = keep_item & ~evict
    # -- pivots: the largest score of each item, ties the earlier member
    smax = torch.full((n_flat,), NEG_INF, device=dev).scatter_reduce(0, flat, sx.reshape(-1), "amax")
    is_max = (sx.reshape(-1) == smax[flat]) & livef
    first_max = torch.full((n_flat,), C, dtype=torch.long, device=dev).scatter_reduce(
        0, flat, torch.where(is_max, ar.expand(R, C).reshape(-1), C), "amin")
    pivot = first_max.clamp(max=C - 1)  # rank within the row
    row_of = torch.arange(n_flat, device=dev).clamp(max=R * C - 1) // C
    Kp = Kf.reshape(R * C, D)[row_of * C + pivot]  # [n_flat, D]
    Kflat = Kf.reshape(R * C, D)
    dist = ((Kp[flat] - Kflat) ** 2).sum(-1)
    sig = _sigma(dist, flat, count, sigma, sigma_mode, n_flat)
    g = _gauss(dist, sig[flat])
    d = dx.reshape(-1).float()
    gd = g * d
    w = gd / seg_sum(gd)[flat]
    Dsum = seg_sum(dx.reshape(-1).long())
    k_new = seg_sum(w[:, None] * Kflat)
    Vflat = Vx.float().reshape(R * C, D)
    if values_mode == "scale":
        v_new = Dsum.float()[:, None] * seg_sum((w / d)[:, None] * Vflat)
        b_new = torch.zeros(n_flat, device=dev)
    else:
        v_new = seg_sum(w[:, None] * Vflat)
        b_new = torch.log(Dsum.float())
    pos_new = px.reshape(-1)[(row_of * C + pivot)]
    # -- each kept item's output: its first member's slot unless it merged (>= 2 members)
    first = torch.full((n_flat,), C, dtype=torch.long, device=dev).scatter_reduce(
        0, flat, ar.expand(R, C).reshape(-1), "amin").clamp(max=C - 1)
    src = (row_of * C + first)[:R * C]
    merged = (count >= 2)[:R * C]
    m4 = merged[:, None]
    out_k = torch.where(m4, k_new[:R * C].to(keys.dtype), Kx.reshape(R * C, D)[src]).view(R, C, D)
    out_v = torch.where(m4, v_new[:R * C].to(values.dtype), Vx.reshape(R * C, D)[src]).view(R, C, D)
    out_b = torch.where(merged, b_new[:R * C], bx.reshape(-1)[src]).view(R, C)
    out_p = torch.where(merged, pos_new[:R * C], px.reshape(-1)[src]).view(R, C)
    out_s = torch.where(merged, item_score[:R * C], sx.reshape(-1)[src]).view(R, C)
    out_d = torch.where(merged, Dsum[:R * C].to(torch.int32), dx.reshape(-1)[src]).view(R, C)
    # -- pack the kept items to the front (destination by cumsum), then write the due rows
    n_kept = keep_item.sum(-1)
    dest = torch.where(keep_item, keep_item.long().cumsum(-1) - 1, C + ar)
    take = torch.cat([ar, ar]).expand(R, 2 * C).scatter(-1, dest, ar.expand(R, C))[:, :C]  # item of each dest
    kept = due[:, None] & (ar < n_kept[:, None])
    freed = due[:, None] & ~kept
    k3 = kept[..., None]
    tk = take[..., None].expand(R, C, D)
    keys.copy_(torch.where(k3, out_k.gather(1, tk), keys.reshape(R, C, D)).view(B, H, C, D))
    values.copy_(torch.where(k3, out_v.gather(1, tk), values.reshape(R, C, D)).view(B, H, C, D))
    slot_pos.copy_(torch.where(kept, out_p.gather(1, take), pos_f).view(B, H, C))
    bias.copy_(torch.where(kept, out_b.gather(1, take), torch.where(freed, NEG_INF, bias_f)).view(B, H, C))
    score.copy_(torch.where(kept, out_s.gather(1, take), torch.where(freed, 0.0, score_f)).view(B, H, C))
    degree.copy_(torch.where(kept, out_d.gather(1, take), torch.where(freed, 1, deg_f)).view(B, H, C))
    fill.copy_(torch.where(due, n_kept, fill_f).view(B, H))
    d_old = deficit.reshape(R)
    deficit.copy_(torch.where(due, torch.minimum(N + d_old, target) - n_kept, d_old).view(B, H))


# -- the CUDA path -----------------------------------------------------------------------------------
KERNELS_CHECKED_ON_GPU = True  # tests/kernels/test_kvmerger_compress_gpu.py passed on an H100 (torch 2.11, Triton 3.6)


def _cuda_impl(reading: str, budget_mode: str, C: int):
    """The Triton launcher for reading "chain" + budget_mode "exact" (deficit stays 0 there) when Triton imports and
    C fits its kernels, else None (the CUDA kernel then runs the reference, logged once). THE one place that
    decides the CUDA path (module docstring)."""
    if not KERNELS_CHECKED_ON_GPU or reading != "chain" or budget_mode != "exact":
        return None
    try:
        import triton  # noqa: F401
        mod = importlib.import_module("kvrewrite.kernels._kvmerger_kernels")
    except ImportError:
        return None
    return mod.triton_kvmerger_compress  # any C (past MAX_SLOTS its bisections read the keys in chunks)


# -- op registration ---------------------------------------------------------------------------------
@torch.library.custom_op(NAME, mutates_args=("keys", "values", "bias", "slot_pos", "fill", "score", "degree",
                                                  "deficit"))
def kvmerger_compress(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    budget: torch.Tensor,
    score: torch.Tensor,
    degree: torch.Tensor,
    deficit: torch.Tensor,
    *,
    recent_ratio: float = 0.34,
    hh_ratio: float = 0.24,
    n_sink: int = 0,
    epsilon: float = 0.75,
    sigma: float = 5.0,
    sigma_mode: str = "fixed",
    values_mode: str = "scale",
    reading: str = "chain",
    budget_mode: str = "exact",
) -> None:
    """Protect the sinks, recent window and heavy hitters, merge the rest in sets of adjacent similar keys, for the
    rows at the threshold (module docstring)."""
    args = (keys, values, bias, slot_pos, fill, budget, score, degree, deficit, recent_ratio, hh_ratio, n_sink,
            epsilon, sigma, sigma_mode, values_mode, reading, budget_mode)
    _check_inputs(*args)
    reference_kvmerger_compress(*args)


@kvmerger_compress.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, score, degree, deficit, *, recent_ratio=0.34, hh_ratio=0.24,
      n_sink=0, epsilon=0.75, sigma=5.0, sigma_mode="fixed", values_mode="scale", reading="chain", budget_mode="exact"):
    opts = dict(recent_ratio=recent_ratio, hh_ratio=hh_ratio, n_sink=n_sink, epsilon=epsilon, sigma=sigma,
                sigma_mode=sigma_mode, values_mode=values_mode, reading=reading, budget_mode=budget_mode)
    state = (keys, values, bias, slot_pos, fill, budget, score, degree, deficit)
    _check_inputs(*state, *opts.values())
    launcher = _cuda_impl(reading, budget_mode, keys.shape[2])
    if launcher is not None:  # deficit is not an argument: 0 before, 0 after in this mode
        launcher(*state[:8], **opts)
        return
    reference_fallback("kvmerger_compress: CUDA runs the tensor reference (reading=%r, budget_mode=%r, %d slots): "
                       "the Triton kernels cover reading='chain' with budget_mode='exact' and are used once their "
                       "GPU tests have passed (KERNELS_CHECKED_ON_GPU=%s)", reading, budget_mode, keys.shape[2],
                       KERNELS_CHECKED_ON_GPU)
    reference_kvmerger_compress(*state, *opts.values())


@kvmerger_compress.register_fake
def _(keys, values, bias, slot_pos, fill, budget, score, degree, deficit, *, recent_ratio=0.34, hh_ratio=0.24,
      n_sink=0, epsilon=0.75, sigma=5.0, sigma_mode="fixed", values_mode="scale", reading="chain", budget_mode="exact"):
    return None
