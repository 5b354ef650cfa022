"""kvrewrite::clustergen_fold — ClusterGen's compression op: fold the tokens leaving the exact window into the
sketches (docs/contracts/clustergen.md §1.5-1.11, §2, §3.2; SubGen, https://arxiv.org/abs/2402.06082, Algorithm 1).

Per row (b, kv head) with fill >= budget[1] (due; every other row untouched, bit for bit). B_t = budget[0],
S = B_t - n_sink - window (sketch slots), s = round(value_share * S) (value samples), M = (S - s) // t (clusters),
M_target = max(1, round(cluster_target * M)); all computed on the device (fp64 products, round half to even as
Python's round). The sketch region is slots [C - S, C): sketch index j = slot - (C - S); cluster i's t key samples
at j in [i t, (i + 1) t), the s value samples at j in [M t, M t + s), the (S - s) mod t others unused.

1. E = the valid exact slots (j < fill, role 0, bias > -inf) in index order, V = |E|. Sinks = the first n_sink of E,
   window = the last `window`, F = the rest in order (|F| = max(0, V - n_sink - window)).
2. If F is not empty:
   a. δ calibration if delta < 0 (§1.6): δ = 1.001·r, r = greedy_kcenter(F's keys, M_target) radius (kcenter.py);
      the margin keeps the key that realises r (often exactly r from the first centre, which is also the first
      leader) off the boundary, where fp32 and fp64 rounding would decide differently.
   b. Leader clustering (§1.7), F in order: i* = argmin over open clusters of ||x_i - k||^2 (fp32, ties: lowest i);
      join i* if ||x_{i*} - k||^2 <= δ^2 (δ^2 = fp32(delta)^2), else open cluster n_clusters with x = k; no free
      cluster (n_clusters >= M): force-assign to i*, n_forced += 1. count[i] += 1 for the cluster joined.
   c. Reservoirs (§1.8-1.9), one uniform per sketch slot: u = h24 * 2^-24, h24 = h >> 8,
      h = mix32(mix32(mix32(mix32(mix32(seed) ^ layer) ^ kv_head) ^ n_seen_after) ^ j) (_hash.py), kv_head =
      head_offset + the state's head index: the head's index in the model layer, so that under tensor parallelism
      a rank draws for its heads what tp=1 draws for the same heads.
      Key slot of open cluster i (n_old members before, c_i joining now as m_1..m_c, n = n_old + c_i):
      p = floor(u n), computed exactly as (h24 * n) >> 24; keeps its sample if p < n_old, else takes m_{p - n_old + 1}.
      Value slot (w = ||v||^2 in fp32 from the stored values; fp64 prefix sums P_l = mu_old + sum_{l' <= l} w_l',
      mu_new = P_|F|): x = u * mu_new (fp64); keeps its sample if x < mu_old, else takes the first l with P_l > x
      (clamped to the last folded token: mu_new = 0 takes the last, Algorithm 1's p = 1 for 0/0).
      A taken sample copies the folded token's key, value and slot_pos (its position: sketch_attention's
      causal test reads it).
   d. mu = fp32(mu_new), n_seen += |F|, n_clusters, count, rep updated; every sketch slot rewritten (§1.11, §2):
      key slot of open cluster i: bias log(count_i / t), role 1; of an unopened cluster: bias -inf, role 1;
      value slot: bias log(mu / (s ||v_j||^2)) (fp32; -inf where ||v_j|| = 0), role 2; unused: bias -inf, role 0.
3. Pack: sinks then window to [0, n_kept) in order (keys, values, slot_pos; bias 0, role 0), n_kept =
   min(V, n_sink + window), fill = n_kept; slots [n_kept, C - S): bias -inf, role 0 (other fields as they were).

State (mutated): keys, values [B, Hkv, C, D] (model dtype); bias [B, Hkv, C] fp32; slot_pos [B, Hkv, C] int64;
fill [B, Hkv] int64; role [B, Hkv, C] int8; rep [B, Hkv, M_max, D] keys' dtype; count [B, Hkv, M_max] int32;
n_clusters, n_seen, n_forced [B, Hkv] int64; mu, delta [B, Hkv] fp32. Read: budget [2] int64 (target, threshold).
Args: n_sink, window (ints >= 0), t (int >= 1), value_share in (0, 1), cluster_target in (0, 1], seed, layer,
head_offset (int in [0, 2^31), default 0: the model layer's index of the state's first KV head; a tensor-parallel
rank passes its first head, so its hash keys are tp=1's).

Decisions where the contract is silent (tell the lead):
- Preconditions M >= 1, s >= 1, M <= M_max, B_t <= C and fill <= C - S for due rows (the method's check_generation
  and capacity) are checked on CPU (ValueError naming them); CUDA reads nothing on the host, and there M is
  clamped to [1, M_max] so that no index leaves the state.
- floor(u n) is integer arithmetic (exact); the value test is in fp64 on the fp32 w and mu (the state stays fp32).
- Taken samples copy slot_pos too (above); unused slots get role 0; n_clusters beyond M (a budget that shrank
  between folds) is not supported: B_t must stay the same for a row's lifetime.
- Rows with no folded token (V <= n_sink + window) are only packed: δ stays uncalibrated, the sketch untouched.

Backends. CPU: the reference below. CUDA (_cuda_impl decides, in one place): the Triton kernels of
kvrewrite/kernels/_clustergen_fold_kernels.py (six launches: split, δ calibration, distances to the clusters open
before the fold, the sequential resolve, reservoirs, pack; loops bounded by each row's fill, |F| and open clusters;
no host reads, CUDA-graph capturable, int32 atomics only). They run once KERNELS_CHECKED_ON_GPU is set, which
records that on an H100 (torch 2.11, Triton 3.6) tests/kernels/test_clustergen_fold_gpu.py passed (6 tests:
bf16 / fp16 / fp32, D 64 / 128, Hkv 8 / 2 / 4, batch 1 / 3, ragged fills, left padding, rows not due, a prefill
fold, a second chunk, decode folds with new clusters and overflow, every field equal to this reference on integer
inputs; a CUDA graph replay; the op's dispatch; the Triton mix32) and tests/methods/test_clustergen_gpu.py with the
kernels as the CUDA path (its 15 tests passed; the run's time limit stopped pytest after the last one, before its
summary line). The kernels are also checked through Triton's interpreter (tests/kernels/
test_clustergen_fold_triton.py). Without Triton, CUDA runs the reference (logged once).
Measured (H100, Llama-3.1-8B layer: Hkv 8, D 128, bf16; 32k context, budget 0.2 = 6554 slots, C = 8633, random
keys; python -m kvrewrite.bench.clustergen_fold, one run each, replayed from a CUDA graph; the reference on CUDA
takes 3.3-4.5 s per call): the kernels without register spills (reservoir copies in D chunks, 32-slot blocks, a
16-entry joiner scan, 16-slot pack tiles, per-lane running maxima in the calibration, new leaders offered to the
block's later keys in the resolve; docs/bench/clustergen_fold_h100_opt.json, after their 6 GPU tests passed):
a decode-time fold of g = 32 tokens 120 us at B = 1 (2% of the 6.1 ms plain step once amortised over 32 layers and
32 tokens), 422 us at B = 8; a later prefill chunk's fold (|F| = 2048) 3.0 ms (B = 1) / 8.5 ms (B = 8); the first
chunk's fold 51 ms (B = 1) / 74 ms (B = 8), 42.5 / 60 ms of it the δ calibration (one program per row: 1.6 s over
32 layers, once per generation); with the calibration's 256-point chunks (stop 58, H200) that fold is 21.9 / 23.9 ms
(50.9 / 57.6-58.1 with 64-point chunks in the same run; docs/bench.md "Stop 58 runs"). The first version
(docs/bench/clustergen_fold_h100.json) took 663 us per decode fold, 549 of it a reservoir launch that spilled
registers. "Without register spills" held only where D's divisibility was known: until stop 63 every launch compiled
for an unspecialised D, with scalar loads and 168-255 registers a thread (the calibration spilling); with D
specialised (H200, CUDA-graph replays, docs/bench.md "Stop 63 runs") a decode fold takes 52 us (B = 1) / 101 us
(B = 8), a later chunk's 0.28 / 0.43 ms, the first chunk's 5.1 / 5.9 ms (112 / 357 us, 0.52 / 1.09 ms and 15.0 /
16.3 ms before, same lease).

The reference: static-shape tensor code vectorised over rows: the leader part is a loop over the static bound
C - n_sink - window of folded positions, the calibration a loop over M_max greedy steps; no host reads on CUDA,
deterministic (first-extremum argmin/argmax, stable sort, no float atomics). Cost: every call, due or not, runs
C - n_sink - window leader steps of [rows, M_max, D] work and M_max greedy steps of [rows, C, D] (about 15 small
launches per step on CUDA): fine for tests and tiny models, seconds per call at 32k. On the CPU (nothing to
capture) both loops stop at the most any due row needs (a host read; the skipped steps are no-ops, so the result is
the same); a call with no due row then does no leader step.
"""
import importlib

import torch

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels._hash import clustergen_hash24
from kvrewrite.kernels._triton_op import check_head_offset
from kvrewrite.kernels.kcenter import greedy_kcenter

DELTA_MARGIN = 1.001  # δ = DELTA_MARGIN · r (module docstring, step a)
NAME = "kvrewrite::clustergen_fold"
NEG_INF = float("-inf")
MUTATED = ("keys", "values", "bias", "slot_pos", "fill", "role", "rep", "count", "n_clusters", "mu", "delta",
           "n_seen", "n_forced")


def sketch_sizes(budget, n_sink, window, t, value_share, cluster_target):
    """(S, s, M, M_target) as 0-dim int64 device tensors from budget[0] (contract §1.5-1.6), M unclamped."""
    S = budget[0] - n_sink - window
    s = torch.round(S.double() * value_share).long()
    M = torch.div(S - s, t, rounding_mode="floor")
    M_target = torch.round(M.double() * cluster_target).long().clamp_min(1)
    return S, s, M, M_target


def _check_inputs(keys, values, bias, slot_pos, fill, budget, role, rep, count, n_clusters, mu, delta, n_seen,
                  n_forced, n_sink, window, t, value_share, cluster_target, seed, layer, head_offset=0):
    if keys.dim() != 4 or not keys.dtype.is_floating_point:
        raise ValueError(f"{NAME}: keys must be a floating [B, Hkv, C, D] tensor, got {keys.dtype} {list(keys.shape)}")
    B, H, C, D = keys.shape
    Mmax = rep.shape[2] if rep.dim() == 4 else -1
    expect = {"values": (values, (B, H, C, D), keys.dtype), "bias": (bias, (B, H, C), torch.float32),
              "slot_pos": (slot_pos, (B, H, C), torch.int64), "fill": (fill, (B, H), torch.int64),
              "budget": (budget, (2,), torch.int64), "role": (role, (B, H, C), torch.int8),
              "rep": (rep, (B, H, Mmax, D), keys.dtype), "count": (count, (B, H, Mmax), torch.int32),
              "n_clusters": (n_clusters, (B, H), torch.int64), "mu": (mu, (B, H), torch.float32),
              "delta": (delta, (B, H), torch.float32), "n_seen": (n_seen, (B, H), torch.int64),
              "n_forced": (n_forced, (B, H), torch.int64)}
    for field, (x, shape, dtype) in expect.items():
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise ValueError(f"{NAME}: {field} must be {dtype} {list(shape)} (keys {list(keys.shape)}, rep "
                             f"[B, Hkv, M_max, D]), got {x.dtype} {list(x.shape)}")
        if x.device != keys.device:
            raise ValueError(f"{NAME}: {field} is on {x.device}, keys on {keys.device}")
    if Mmax < 1:
        raise ValueError(f"{NAME}: rep must hold M_max >= 1 clusters, got {list(rep.shape)}")
    for field, v, lo in (("n_sink", n_sink, 0), ("window", window, 0), ("t", t, 1), ("layer", layer, 0)):
        if v < lo:
            raise ValueError(f"{NAME}: {field} must be an int >= {lo}, got {v}")
    check_head_offset(NAME, head_offset)
    if not 0 < value_share < 1:
        raise ValueError(f"{NAME}: value_share must be in (0, 1), got {value_share}")
    if not 0 < cluster_target <= 1:
        raise ValueError(f"{NAME}: cluster_target must be in (0, 1], got {cluster_target}")
    if keys.device.type == "cpu":  # host reads are free here; CUDA trusts the method's check_generation
        S, s, M, _ = (int(x) for x in sketch_sizes(budget, n_sink, window, t, value_share, cluster_target))
        what = (f"budget[0] = {int(budget[0])}, n_sink = {n_sink}, window = {window}, t = {t}, value_share = "
                f"{value_share}: S = {S}, s = {s}, M = {M}")
        if s < 1 or M < 1:
            raise ValueError(f"{NAME}: the sketch needs s >= 1 value samples and M >= 1 clusters, got {what}")
        if M > Mmax or S + n_sink + window > C:
            raise ValueError(f"{NAME}: the state is too small: M_max = {Mmax}, C = {C}, {what}")
        due = fill >= budget[1]
        if bool((due & (fill > C - S)).any()):
            raise ValueError(f"{NAME}: a due row's fill {int(fill[due].max())} reaches into the sketch region "
                             f"[C - S, C) = [{C - S}, {C}) (capacity too small)")


def reference_clustergen_fold(keys, values, bias, slot_pos, fill, budget, role, rep, count, n_clusters, mu, delta,
                              n_seen, n_forced, n_sink, window, t, value_share, cluster_target, seed, layer,
                              head_offset=0):
    B, H, C, D = keys.shape
    N, Mmax, dev = B * H, rep.shape[2], keys.device
    S, s, M, M_target = sketch_sizes(budget, n_sink, window, t, value_share, cluster_target)
    M = M.clamp(1, Mmax)
    base = C - S                                       # first sketch slot
    ar = torch.arange(C, device=dev)
    due = (fill >= budget[1]).view(N)
    fill_, bias_, role_ = fill.view(N), bias.view(N, C), role.view(N, C)
    keys_, values_, pos_ = keys.view(N, C, D), values.view(N, C, D), slot_pos.view(N, C)

    # 1. the valid exact slots: sinks, window, folded (F)
    exact = (ar < fill_[:, None]) & (role_ == 0) & (bias_ > NEG_INF)
    rank = exact.long().cumsum(-1) - 1
    V = exact.sum(-1)
    nF = torch.where(due, (V - n_sink - window).clamp_min(0), 0)
    folded = exact & (rank >= n_sink) & (rank < n_sink + nF[:, None])
    has_f = nF > 0
    keys_new, values_new, pos_new = keys_, values_, pos_
    bias_new, role_new = bias_, role_
    F = max(C - n_sink - window, 0)                    # static bound on |F|
    if dev.type == "cpu":  # no graph to capture: stop at the most any due row folds (the rest are no-op steps)
        F = min(F, int(nF.max()))
    if F > 0:
        fidx = torch.where(folded, rank - n_sink, F)
        fslot = torch.zeros(N, F + 1, dtype=torch.int64, device=dev).scatter_(1, fidx, ar.expand(N, C))[:, :F]
        fmask = torch.arange(F, device=dev) < nF[:, None]
        kf = keys_.gather(1, fslot[..., None].expand(N, F, D))
        vf = values_.gather(1, fslot[..., None].expand(N, F, D))
        pf = pos_.gather(1, fslot)

        # 2a. δ calibration (first fold of the row)
        calib = has_f & (delta.view(N) < 0)
        k_max = Mmax if dev.type != "cpu" else int(M_target.clamp(max=Mmax)) * bool(calib.any())
        _, r = greedy_kcenter(kf, fmask & calib[:, None], M_target.expand(N).contiguous(), k_max=k_max)
        delta_new = torch.where(calib, r * DELTA_MARGIN, delta.view(N))

        # 2b. leader clustering, sequential over F, vectorised over rows
        rep_new = rep.view(N, Mmax, D)
        rep32 = rep_new.float()
        cnt_old = count.view(N, Mmax).long()
        cnt, nc = cnt_old, n_clusters.view(N)
        forced = torch.zeros(N, dtype=torch.int64, device=dev)
        d2max = delta_new.square()
        ci = torch.arange(Mmax, device=dev)
        kf32 = kf.float()
        assign = []
        for f in range(F):
            act = fmask[:, f]
            d2 = torch.where(ci < nc[:, None], (rep32 - kf32[:, f, None]).square().sum(-1), float("inf"))
            istar = d2.argmin(-1)
            far = d2.gather(1, istar[:, None])[:, 0] > d2max
            opened = act & far & (nc < M)
            forced = forced + (act & far & (nc >= M))
            idx = torch.where(opened, nc, istar)
            slot = (ci == nc[:, None]) & opened[:, None]
            rep32 = torch.where(slot[..., None], kf32[:, f, None], rep32)
            rep_new = torch.where(slot[..., None], kf[:, f, None], rep_new)
            cnt = cnt + ((ci == idx[:, None]) & act[:, None])
            nc = nc + opened
            assign.append(torch.where(act, idx, Mmax))
        assign = torch.stack(assign, 1)

        # 2c. reservoirs: one uniform per sketch slot
        n_seen_new = n_seen.view(N) + nF
        kv_head = torch.arange(H, device=dev).repeat(B) + head_offset  # the model layer's head (tp ranks)
        j = ar - base
        h24 = clustergen_hash24(seed, layer, kv_head[:, None], n_seen_new[:, None], j[None, :])
        is_key = (j >= 0) & (j < M * t)
        is_val = (j >= M * t) & (j < M * t + s)
        ci_j = torch.div(j, t, rounding_mode="floor").clamp(0, Mmax - 1).expand(N, C)
        joined = cnt - cnt_old
        start = joined.cumsum(-1) - joined             # first of cluster i's joiners in F sorted by cluster
        by_cluster = torch.sort(assign, dim=-1, stable=True).indices
        open_j = is_key & (ci_j < nc[:, None])
        n_tot, n_old = cnt.gather(1, ci_j), cnt_old.gather(1, ci_j)
        pick = (h24 * n_tot) >> 24                     # floor(u * n), exact
        take_k = open_j & (pick >= n_old)
        src_k = by_cluster.gather(1, (start.gather(1, ci_j) + pick - n_old).clamp(0, F - 1))

        w = torch.where(fmask, vf.float().square().sum(-1), 0.0)
        mu_old = mu.view(N).double()
        prefix = mu_old[:, None] + w.double().cumsum(-1)
        mu_new = torch.where(has_f, prefix.gather(1, (nF - 1).clamp_min(0)[:, None])[:, 0], mu_old)
        x = h24.double() * 2.0 ** -24 * mu_new[:, None]
        first_above = torch.searchsorted(torch.where(fmask, prefix, float("inf")), x, right=True)
        take_v = is_val & ~(x < mu_old[:, None])
        src_v = torch.minimum(first_above, (nF - 1).clamp_min(0)[:, None])
        take = (take_k | take_v) & has_f[:, None]
        src = torch.where(take_k, src_k, src_v)
        keys_new = torch.where(take[..., None], kf.gather(1, src[..., None].expand(N, C, D)), keys_)
        values_new = torch.where(take[..., None], vf.gather(1, src[..., None].expand(N, C, D)), values_)
        pos_new = torch.where(take, pf.gather(1, src), pos_)

        # 2d. sketch weights (§1.11) and roles
        mu32 = mu_new.float()
        wj = values_new.float().square().sum(-1)
        b_key = torch.where(open_j, torch.log(n_tot.float() / t), NEG_INF)
        b_val = torch.where(wj > 0, torch.log(mu32[:, None] / (s.float() * wj)), NEG_INF)
        sk = has_f[:, None] & (j >= 0)
        bias_new = torch.where(sk, torch.where(is_key, b_key, torch.where(is_val, b_val, NEG_INF)), bias_)
        role_new = torch.where(sk, torch.where(is_key, 1, torch.where(is_val, 2, 0)).to(torch.int8), role_)

        rep.copy_(rep_new.view_as(rep))
        count.copy_(cnt.int().view_as(count))
        n_clusters.copy_(nc.view_as(n_clusters))
        n_forced.add_(forced.view_as(n_forced))
        n_seen.copy_(n_seen_new.view_as(n_seen))
        mu.copy_(torch.where(has_f, mu_new.float(), mu.view(N)).view_as(mu))
        delta.copy_(delta_new.view_as(delta))

    # 3. pack sinks + window to the front
    kept = exact & ~folded & due[:, None]
    n_kept = kept.sum(-1)
    dest = torch.where(kept, kept.long().cumsum(-1) - 1, C)
    src_p = torch.zeros(N, C + 1, dtype=torch.int64, device=dev).scatter_(1, dest, ar.expand(N, C))[:, :C]
    packed = due[:, None] & (ar < n_kept[:, None])
    freed = due[:, None] & ~packed & (ar < base)
    keys.copy_(torch.where(packed[..., None], keys_.gather(1, src_p[..., None].expand(N, C, D)), keys_new)
               .view_as(keys))
    values.copy_(torch.where(packed[..., None], values_.gather(1, src_p[..., None].expand(N, C, D)), values_new)
                 .view_as(values))
    slot_pos.copy_(torch.where(packed, pos_.gather(1, src_p), pos_new).view_as(slot_pos))
    bias.copy_(torch.where(packed, 0.0, torch.where(freed, NEG_INF, bias_new)).view_as(bias))
    role.copy_(torch.where(packed | freed, torch.zeros_like(role_new), role_new).view_as(role))
    fill.copy_(torch.where(due, n_kept, fill_).view_as(fill))


@torch.library.custom_op(NAME, mutates_args=MUTATED)
def clustergen_fold(keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, slot_pos: torch.Tensor,
                    fill: torch.Tensor, budget: torch.Tensor, role: torch.Tensor, rep: torch.Tensor,
                    count: torch.Tensor, n_clusters: torch.Tensor, mu: torch.Tensor, delta: torch.Tensor,
                    n_seen: torch.Tensor, n_forced: torch.Tensor, *, n_sink: int, window: int, t: int,
                    value_share: float, cluster_target: float, seed: int, layer: int, head_offset: int = 0) -> None:
    """Fold the due rows' tokens that left the window into the sketches, then pack (module docstring)."""
    args = (keys, values, bias, slot_pos, fill, budget, role, rep, count, n_clusters, mu, delta, n_seen, n_forced,
            n_sink, window, t, value_share, cluster_target, seed, layer, head_offset)
    _check_inputs(*args)
    reference_clustergen_fold(*args)


# -- the CUDA path -----------------------------------------------------------------------------------
# tests/kernels/test_clustergen_fold_gpu.py: 6 passed on an H100 (torch 2.11, Triton 3.6), and again on an H200 with
# its head_offset case (the reservoir hash's + hoff, added later)
KERNELS_CHECKED_ON_GPU = True


def _cuda_impl():
    """The Triton launcher once its GPU tests passed and Triton imports, else None (CUDA then runs the reference,
    logged once). THE one place that decides the CUDA path (module docstring, Backends)."""
    if not KERNELS_CHECKED_ON_GPU:
        return None
    try:
        import triton  # noqa: F401
        mod = importlib.import_module("kvrewrite.kernels._clustergen_fold_kernels")
    except ImportError:
        return None
    return mod.triton_clustergen_fold


@clustergen_fold.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, role, rep, count, n_clusters, mu, delta, n_seen, n_forced, *,
      n_sink, window, t, value_share, cluster_target, seed, layer, head_offset=0):
    args = (keys, values, bias, slot_pos, fill, budget, role, rep, count, n_clusters, mu, delta, n_seen, n_forced,
            n_sink, window, t, value_share, cluster_target, seed, layer, head_offset)
    _check_inputs(*args)
    launcher = _cuda_impl()
    if launcher is not None:
        launcher(*args[:14], n_sink=n_sink, window=window, t=t, value_share=value_share,
                 cluster_target=cluster_target, seed=seed, layer=layer, head_offset=head_offset)
        return
    reference_fallback("clustergen_fold: CUDA runs the tensor reference (static loops; slow): the Triton kernels "
                       "are used once their GPU tests have passed (KERNELS_CHECKED_ON_GPU=%s) and Triton imports",
                       KERNELS_CHECKED_ON_GPU)
    reference_clustergen_fold(*args)


@clustergen_fold.register_fake
def _(keys, values, bias, slot_pos, fill, budget, role, rep, count, n_clusters, mu, delta, n_seen, n_forced, *,
      n_sink, window, t, value_share, cluster_target, seed, layer, head_offset=0):
    return None
