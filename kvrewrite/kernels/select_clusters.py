"""kvrewrite::select_clusters — ClusterKV's per-step selection: which slots a decode query attends.

ClusterKV (notes/002-clusterkv.md §1.5-1.8; the contract is clusterkv_spec.md, "Op 2") keeps every token and
groups the older ones of each (batch row, KV head) into clusters by k-means (kvrewrite::kmeans_cluster). At each
decode step, per selection head, the clusters are ranked by q . centroid and taken whole in that order until the
selection budget, the last one trimmed; attention (kvrewrite::indexed_attention) then runs over the sinks, the
selected members and the unclustered recent window, listed here in one slot index per head.

    select_clusters(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters, cluster_end, *,
                    n_sink, max_selected, window, per_query_head) -> index [B, Hsel, S] int32

    q               [B, Hq, 1, D]  model dtype (decode: T = 1)
    fill            [B, Hkv]       int64, slots in use
    budget          [2]            int64, budget[0] = sinks + selected tokens (the method's budget)
    centroids       [B, Hkv, K, D] float (the keys' dtype)
    cluster_size    [B, Hkv, K]    int32, members of cluster k (0 for unused ids)
    cluster_start   [B, Hkv, K]    int32, offset of cluster k's first member in `members`
    members         [B, Hkv, C]    int32, [0, n_sink): the sink slots (-1 where absent); then slot ids by cluster
    n_clusters      [B, Hkv]       int32, cluster ids in use
    cluster_end     [B, Hkv]       int64, slots [cluster_end, fill) are the unclustered window

Rule, per selection row (b, s), Hsel = Hq (per_query_head: KV head h = s // G, query q[b, s]) or Hkv (h = s, the
query is the fp32 sum of the group's G queries: the mean query's ranking, the authors' "qavg"):
- score_k = qvec . centroid_k in fp32 for the valid clusters k < n_clusters with cluster_size > 0;
- B_sel = clamp(budget[0] - n_sink, 0, max_selected); clusters in descending score (ties: the lower id first)
  take take_k = min(size_k, B_sel - the members taken before it in that order): whole clusters, the last trimmed
  to its first take_k members in `members` order (as the authors' kernel);
- index[b, s] = [sinks: members[b, h, :n_sink]] + [the taken members cluster by cluster IN CLUSTER-ID ORDER, each
  cluster's first take_k, then -1 up to max_selected] + [the window cluster_end .. fill - 1 ascending, then -1
  up to `window`]. S = n_sink + max_selected + window. With B_sel >= every clustered token the index lists every
  valid slot once (attention over it is full attention).
Scores are assumed finite. Mutates nothing.

Backends. The reference (static-shape tensor code: a stable sort of the scores, cumsums, searchsorted and
gathers) is the CPU path (an opaque CPU op: it checks fill - cluster_end <= window, a host read) and the ground
truth. CUDA runs the Triton kernels below: no host sync, launches from the shapes only, every entry of the index
written (-1 where unused), so CUDA graphs capture it and no stale value survives. The op is a
`torch.library.triton_op` (as kvrewrite::clustered_attention): Inductor sees the kernels.

Triton design. Sorting the clusters is not needed: only the cumulative sizes in score order matter. With
int32 keys that order like the fp32 scores (-0.0 as +0.0), the cluster where the running size reaches B_sel has
the key t* = max{t : sum of sizes with key >= t >= B_sel}; clusters with key > t* are taken whole, those with key
== t* in id order (a cumsum of their sizes) until B_sel, the others not at all. t* comes from a bisection over
key values, one reduction per step (size-weighted count, the smallest key >= mid, the largest key < mid), the
bracket snapped to present keys each step and stopping when the count hits B_sel exactly: ~log2 of the key
range around t* steps (15-25 on random scores, at most 32), each a register reduction over next_pow2(K) lanes.
The layout then needs no sort either: an id-order cumsum of the takes gives each cluster's output offset; each
taken cluster writes a marker (offset << 32 | cluster_start) at its offset in a per-row scratch (-1 elsewhere),
and a running max (associative scan) over the output positions finds every position's cluster and member.

Launches: a row's selection is one program (grid B * Hsel: 32 programs for Llama-3.1-8B per query head, 8 per
KV head). The scores need the used centroids read (n_clusters * D * 2 bytes per KV head: 105 KB at 32k context,
420 KB at 128k), which one program per row can only pull at one SM's bandwidth (~4 us at 128k). So by default a
first kernel computes the scores spread over (K / BLOCK_K blocks, B * Hkv) programs (each block's centroids read
once for the group's G query heads) into an int32 key scratch [B * Hsel, K], and the selection kernel reads the
keys from there (L2). With `fused=True` the selection kernel scores its own row first (one launch; the choice by
K is in _launch_config). Keys are held in registers while K <= MAX_KEYS (16384, 512k-token contexts at the
notes' 80 tokens per cluster); a larger K runs the same bisection chunk by chunk from the scratch (slower, same
result).
Cost (H100, Llama-3.1-8B decode: B 1, Hq 32, Hkv 8, D 128, bf16, max_selected 1008, n_sink 16, window 320):
measured by kvrewrite.bench.select_clusters (its JSON; figures in the report of the branch that adds it).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite.kernels._triton_op import check_one_cuda_device, register_triton_op, triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference; only triton_select_clusters raises
    triton = tl = None

NAME = "kvrewrite::select_clusters"
MAX_KEYS = 16384  # clusters whose keys one program holds in registers (a power of two); more: chunked passes
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


# -- checks and reference ----------------------------------------------------------------------------------
def check_inputs(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters, cluster_end,
                 n_sink, max_selected, window, name=NAME) -> tuple:
    """ValueError naming the op and the bad input unless the shapes and dtypes are the contract's (module
    docstring); returns (B, Hq, D, Hkv, K, C, G). Reads no data."""
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"{name}: q must be [B, Hq, 1, D] (decode, T = 1), got {tuple(q.shape)}")
    B, Hq, _, D = q.shape
    if centroids.dim() != 4 or centroids.shape[0] != B or centroids.shape[3] != D:
        raise ValueError(f"{name}: centroids must be [B={B}, Hkv, K, D={D}], got {tuple(centroids.shape)}")
    Hkv, K = centroids.shape[1], centroids.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{name}: Hq must be a multiple of Hkv >= 1 (GQA), got Hq={Hq}, Hkv={Hkv}")
    if q.dtype not in _FLOAT or centroids.dtype not in _FLOAT:
        raise ValueError(f"{name}: q and centroids must be fp16/bf16/fp32, got {q.dtype}, {centroids.dtype}")
    for field, t in (("cluster_size", cluster_size), ("cluster_start", cluster_start)):
        if tuple(t.shape) != (B, Hkv, K) or t.dtype != torch.int32:
            raise ValueError(f"{name}: {field} must be int32 [B, Hkv, K] = {(B, Hkv, K)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if members.dim() != 3 or tuple(members.shape[:2]) != (B, Hkv) or members.dtype != torch.int32:
        raise ValueError(f"{name}: members must be int32 [B, Hkv, C] = {(B, Hkv)} + (C,), "
                         f"got {members.dtype} {tuple(members.shape)}")
    C = members.shape[2]
    if C == 0:
        raise ValueError(f"{name}: members has no slots (C = 0)")
    for field, t, dtype in (("n_clusters", n_clusters, torch.int32), ("fill", fill, torch.int64),
                            ("cluster_end", cluster_end, torch.int64)):
        if tuple(t.shape) != (B, Hkv) or t.dtype != dtype:
            raise ValueError(f"{name}: {field} must be {str(dtype).replace('torch.', '')} [B, Hkv] = {(B, Hkv)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if tuple(budget.shape) != (2,) or budget.dtype != torch.int64:
        raise ValueError(f"{name}: budget must be int64 [2], got {budget.dtype} {tuple(budget.shape)}")
    if not 0 <= n_sink <= C:
        raise ValueError(f"{name}: n_sink must be in [0, C={C}], got {n_sink}")
    if max_selected < 0 or window < 0:
        raise ValueError(f"{name}: max_selected and window must be >= 0, got {max_selected}, {window}")
    return B, Hq, D, Hkv, K, C, Hq // Hkv


def reference_select_clusters(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters,
                              cluster_end, *, n_sink: int, max_selected: int, window: int, per_query_head: bool):
    """The CPU path and the ground truth (module docstring). Raises ValueError when a row's window holds more
    than `window` slots (fill - cluster_end > window: a host read), which the kernel cannot report."""
    name = "reference_select_clusters"
    B, Hq, D, Hkv, K, C, G = check_inputs(q, fill, budget, centroids, cluster_size, cluster_start, members,
                                          n_clusters, cluster_end, n_sink, max_selected, window, name)
    over = fill - cluster_end > window
    if bool(over.any()):
        b, h = (int(i) for i in over.nonzero()[0])
        raise ValueError(f"{name}: batch row {b}, KV head {h} has {int(fill[b, h] - cluster_end[b, h])} unclustered "
                         f"slots (fill - cluster_end), more than window = {window}")
    dev = q.device
    qf = q[:, :, 0].float()
    if per_query_head:
        qvec, head = qf, torch.arange(Hq, device=dev) // G
    else:
        qvec, head = qf.view(B, Hkv, G, D).sum(2), torch.arange(Hkv, device=dev)
    Hsel = head.numel()
    score = torch.einsum("bsd,bskd->bsk", qvec, centroids[:, head].float())  # [B, Hsel, K]
    size = cluster_size[:, head].long()
    ids = torch.arange(K, device=dev)
    w = torch.where((ids < n_clusters[:, head, None]) & (size > 0), size, 0)  # invalid clusters weigh nothing
    b_sel = (budget[0] - n_sink).clamp(0, max_selected)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices  # ties: the lower id first
    ws = w.gather(-1, order)
    take_sorted = torch.minimum(ws, (b_sel - (ws.cumsum(-1) - ws)).clamp_min(0))
    take = torch.zeros_like(w).scatter(-1, order, take_sorted)  # back in id order
    sinks = members[:, head, :n_sink]
    p = torch.arange(max_selected, device=dev).expand(B, Hsel, max_selected)
    if K > 0:
        incl = take.cumsum(-1)  # id-order output offsets
        owner = torch.searchsorted(incl, p.contiguous(), right=True).clamp_max(K - 1)  # the cluster holding p
        src = cluster_start[:, head].long().gather(-1, owner) + p - (incl - take).gather(-1, owner)
        used = p < incl[..., -1:]
        middle = torch.where(used, members[:, head].long().gather(-1, torch.where(used, src, 0)), -1)
    else:
        middle = torch.full_like(p, -1)
    slot = cluster_end[:, head, None] + torch.arange(window, device=dev)
    win = torch.where(slot < fill[:, head, None], slot, -1)
    return torch.cat([sinks, middle.int(), win.int()], dim=-1)


# -- Triton kernels ------------------------------------------------------------------------------------------
@triton_jit()
def _score_key(x):
    """int32 key of fp32 x in the order of a descending torch.sort: -0.0 as +0.0, NaN as one value above +inf."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    bits = tl.where(mag == 0, 0, bits)
    bits = tl.where(mag > 0x7F800000, 0x7FC00000, bits)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton_jit()
def _sum_min_max(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.minimum(a1, b1), tl.maximum(a2, b2)


@triton_jit()
def _max_i64(a, b):
    return tl.maximum(a, b)


@triton_jit()
def _chunk(KEYS_ROW, SIZE_BH, c0, n_cl, KB: tl.constexpr):
    """Keys and weights of clusters [c0, c0 + KB): weight = size for a valid cluster (k < n_cl, size > 0), else 0
    with the key -2**31 (below every score's key)."""
    k = c0 + tl.arange(0, KB)
    live = k < n_cl
    size = tl.load(SIZE_BH + k, mask=live, other=0)
    valid = live & (size > 0)
    key = tl.load(KEYS_ROW + k, mask=valid, other=-2147483648)
    return tl.where(valid, key, -2147483648), tl.where(valid, size, 0)


@triton_jit()
def _count(key, w, cand):
    """Per candidate threshold m of cand [NC]: (F(m) = sum of w over key >= m, the smallest such key, the largest
    valid key < m), each [NC]; w > 0 marks the valid clusters."""
    ge = key[None, :] >= cand[:, None]
    ok = (w > 0)[None, :]
    return tl.reduce((tl.where(ge, w[None, :], 0), tl.where(ge & ok, key[None, :], 2147483647),
                      tl.where((~ge) & ok, key[None, :], -2147483648)), 1, _sum_min_max)


@triton_jit()
def _max_min_min_max(a0, a1, a2, a3, b0, b1, b2, b3):
    return tl.maximum(a0, b0), tl.minimum(a1, b1), tl.minimum(a2, b2), tl.maximum(a3, b3)


@triton_jit()
def _takes(key, w, thr, room, start, MARK_ROW, carry):
    """A chunk of clusters in id order: cluster k takes w_k above thr, at thr min(w_k, room - the tied weight before
    it) (clamped at 0), else nothing; its output offset is the weight above thr before it plus min(the tied weight
    before it, room). Writes the markers of the taken clusters; carry: the packed sums of earlier chunks (int64:
    weight above thr << 32 | tied weight). Returns the carry with this chunk's."""
    v = (tl.where(key > thr, w, 0).to(tl.int64) << 32) | tl.where((key == thr) & (w > 0), w, 0).to(tl.int64)
    before = carry + tl.cumsum(v, axis=0) - v
    above_before = before >> 32
    tie_before = (before - (above_before << 32)).to(tl.int32)
    take = tl.where(key > thr, w, tl.where((key == thr) & (w > 0), tl.minimum(tl.maximum(room - tie_before, 0), w), 0))
    off = above_before + tl.minimum(tie_before, room).to(tl.int64)
    tl.store(MARK_ROW + off, (off << 32) | start.to(tl.int64), mask=take > 0)
    return carry + tl.sum(v, axis=0)


@triton_jit()
def _centroid_tile(CEN_BH, k, n_cl, offs_d, d_ok, stride_ck, stride_cd):
    """Centroids of cluster ids k (< n_cl; others 0), [len(k), BLOCK_D]."""
    return tl.load(CEN_BH + k[:, None] * stride_ck + offs_d[None, :] * stride_cd,
                   mask=(k < n_cl)[:, None] & d_ok[None, :], other=0.0)


@triton_jit()
def _group_queries(Q, b, h, G, stride_qb, stride_qh, stride_qd, offs_d, d_ok, GB: tl.constexpr):
    """The G queries of KV head h, [GB, BLOCK_D] (rows >= G: 0)."""
    offs_g = tl.arange(0, GB)
    return tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                   mask=(offs_g < G)[:, None] & d_ok[None, :], other=0.0)


@triton_jit()
def _tile_dots(c, qg, NATIVE_DOT: tl.constexpr):
    """fp32 [BLOCK_K, GB]: centroid tile . each query. NATIVE_DOT: fp16/bf16 products on the tensor cores (exact in
    fp32, fp32 sums); else fp32 IEEE products (no TF32)."""
    if NATIVE_DOT:
        return tl.dot(c, tl.trans(qg))
    else:
        return tl.dot(c.to(tl.float32), tl.trans(qg.to(tl.float32)), input_precision="ieee")


@triton_jit(do_not_specialize=["Hsel", "Hkv", "G", "K", "D"])
def _cluster_scores_kernel(
    Q, CEN, NCL, KEYS,  # KEYS: int32 [B * Hsel, K], row (b, s)'s key of cluster k (written for k < n_clusters)
    stride_qb, stride_qh, stride_qd, stride_cb, stride_ch, stride_ck, stride_cd,
    Hsel, Hkv, G, K, D,
    PER_HEAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, GB: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    """Scores, grid (cluster blocks, B * Hkv): the block's centroids read once, times the KV head's G queries (one
    tl.dot); per query head each column, shared their sum (the summed query's score)."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // Hkv
    h = bh % Hkv
    n_cl = tl.minimum(tl.load(NCL + bh), K)
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    if tl.program_id(0) * BLOCK_K < n_cl:
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        offs_g = tl.arange(0, GB)
        qg = _group_queries(Q, b, h, G, stride_qb, stride_qh, stride_qd, offs_d, d_ok, GB)
        c = _centroid_tile(CEN + b * stride_cb + h * stride_ch, k, n_cl, offs_d, d_ok, stride_ck, stride_cd)
        sc = _tile_dots(c, qg, NATIVE_DOT)
        if PER_HEAD:
            tl.store(KEYS + (b * Hsel + h * G + offs_g[None, :]) * K + k[:, None], _score_key(sc),
                     mask=(k < n_cl)[:, None] & (offs_g < G)[None, :])
        else:
            tl.store(KEYS + (b * Hsel + h) * K + k, _score_key(tl.sum(sc, axis=1)), mask=k < n_cl)


@triton_jit(do_not_specialize=["Hsel", "Hkv", "G", "K", "C", "D", "n_sink", "max_selected", "window", "S"])
def _select_clusters_kernel(
    Q, CEN, SIZE, START, MEMBERS, NCL, FILL, CEND, BUDGET,
    KEYS,  # int32 [B * Hsel, K]: the scores' keys (written here first with FUSED, else by _cluster_scores_kernel)
    MARK,  # int64 [B * Hsel, M] scratch, M = max(max_selected, 1): per output position a marker or -1
    OUT,  # int32 [B * Hsel, S]
    stride_qb, stride_qh, stride_qd, stride_cb, stride_ch, stride_ck, stride_cd,
    Hsel, Hkv, G, K, C, D, n_sink, max_selected, window, S,
    PER_HEAD: tl.constexpr, FUSED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, GB: tl.constexpr,
    NATIVE_DOT: tl.constexpr, KB: tl.constexpr, NC: tl.constexpr, ONE_CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, ONE_M: tl.constexpr,
):
    """Selection, grid (B * Hsel,): one program per selection row (module docstring). Latency-bound: every load
    that does not depend on the selection is issued first, so the chain is loads -> bisection -> marker scatter ->
    marker load -> member gather."""
    row = tl.program_id(0).to(tl.int64)
    b = row // Hsel
    s = row % Hsel
    if PER_HEAD:
        h = s // G
    else:
        h = s
    bh = b * Hkv + h
    n_cl = tl.load(NCL + bh)
    budget = tl.load(BUDGET)
    cend = tl.load(CEND + bh)
    fill = tl.load(FILL + bh)
    mark_row = MARK + row * tl.maximum(max_selected, 1)
    keys_row = KEYS + row * K
    size_bh = SIZE + bh * K
    mem_bh = MEMBERS + bh * C
    out_row = OUT + row * S
    if ONE_CHUNK:  # the row's cluster metadata, whatever n_clusters (masked below)
        kk = tl.arange(0, KB)
        size = tl.load(size_bh + kk, mask=kk < K, other=0)
        start = tl.load(START + bh * K + kk, mask=kk < K, other=0)
        if not FUSED:
            key = tl.load(keys_row + kk, mask=kk < K, other=0)
    # -- sinks and window (independent of the selection); no marker anywhere yet
    offs_e = tl.arange(0, BLOCK_E)
    for p0 in range(0, n_sink, BLOCK_E):
        p = p0 + offs_e
        tl.store(out_row + p, tl.load(mem_bh + p, mask=p < n_sink, other=-1), mask=p < n_sink)
    for j0 in range(0, window, BLOCK_E):
        slot = cend + j0 + offs_e
        tl.store(out_row + n_sink + max_selected + j0 + offs_e, tl.where(slot < fill, slot, -1).to(tl.int32),
                 mask=j0 + offs_e < window)
    offs_m = tl.arange(0, BLOCK_M)
    for p0 in range(0, max_selected, BLOCK_M):  # ordered before the scatter by the barrier below
        tl.store(mark_row + p0 + offs_m, tl.full([BLOCK_M], -1, tl.int64), mask=p0 + offs_m < max_selected)
    n_cl = tl.minimum(tl.maximum(n_cl, 0), K)
    b_sel = tl.minimum(tl.maximum(budget - n_sink, 0), max_selected).to(tl.int32)

    if FUSED:  # -- this row's scores (the loads of the tiles are software-pipelined: they feed tl.dot)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        offs_g = tl.arange(0, GB)
        qg = _group_queries(Q, b, h, G, stride_qb, stride_qh, stride_qd, offs_d, d_ok, GB)
        if PER_HEAD:
            pick = offs_g == s - h * G
        else:
            pick = offs_g < G
        cen = CEN + b * stride_cb + h * stride_ch
        for k0 in range(0, n_cl, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            sc = _tile_dots(_centroid_tile(cen, k, n_cl, offs_d, d_ok, stride_ck, stride_cd), qg, NATIVE_DOT)
            tl.store(keys_row + k, _score_key(tl.sum(tl.where(pick[None, :], sc, 0.0), axis=1)), mask=k < n_cl)
        tl.debug_barrier()
        if ONE_CHUNK:
            key = tl.load(keys_row + kk, mask=kk < n_cl, other=0)

    # -- t*, the key of the cluster where the running size in score order reaches B_sel (bisection)
    if ONE_CHUNK:
        valid = (kk < n_cl) & (size > 0)
        key = tl.where(valid, key, -2147483648)
        w = tl.where(valid, size, 0)
        total, kmin, kmax = tl.reduce((w, tl.where(valid, key, 2147483647), key), 0, _sum_min_max)
    else:
        total = tl.zeros([], tl.int32)
        kmin = tl.full([], 2147483647, tl.int32)
        kmax = tl.full([], -2147483648, tl.int32)
        for c0 in range(0, n_cl, KB):
            key_c, w_c = _chunk(keys_row, size_bh, c0, n_cl, KB)
            t_c, mn_c, mx_c = tl.reduce((w_c, tl.where(w_c > 0, key_c, 2147483647), key_c), 0, _sum_min_max)
            total, kmin, kmax = _sum_min_max(total, kmin, kmax, t_c, mn_c, mx_c)
    # thr = t*; room = B_sel less the members above t* (the share of the clusters at t*, in id order); exact: the
    # clusters >= t* fill B_sel exactly (room is then no limit)
    thr = tl.full([], -2147483648, tl.int32)  # every valid cluster whole (total <= B_sel)
    room = tl.full([], 2147483647, tl.int32)
    if b_sel == 0:
        thr = tl.full([], 2147483647, tl.int32)  # none
    elif total > b_sel:
        # invariant: F(lo) >= B_sel > G(hi), F(t) = sum(w[key >= t]), G(t) = sum(w[key > t]) = g_hi at t = hi;
        # lo and hi keys of valid clusters
        lo = kmin.to(tl.int64)
        hi = kmax.to(tl.int64)
        g_hi = tl.zeros([], tl.int32)
        exact = tl.zeros([], tl.int32)
        ci = tl.arange(0, NC)
        while lo < hi:
            # NC thresholds spread over (lo, hi]: the bracket shrinks to one gap between them, snapped to keys
            cand = (lo + 1 + ((hi - lo - 1) * (ci + 1)) // (NC + 1)).to(tl.int32)
            if ONE_CHUNK:
                cnt, mn, mx = _count(key, w, cand)
            else:
                cnt = tl.zeros([NC], tl.int32)
                mn = tl.full([NC], 2147483647, tl.int32)
                mx = tl.full([NC], -2147483648, tl.int32)
                for c0 in range(0, n_cl, KB):
                    key_c, w_c = _chunk(keys_row, size_bh, c0, n_cl, KB)
                    cnt_c, mn_c, mx_c = _count(key_c, w_c, cand)
                    cnt, mn, mx = _sum_min_max(cnt, mn, mx, cnt_c, mn_c, mx_c)
            # F falls with m: the last candidate with F >= B_sel gives lo (F(mn) = F(m): no key in [m, mn)), the next
            # one hi (G(mx) = F(m): no key in (mx, m)); mn and mx grow with m
            keep = cnt >= b_sel
            new_lo, f_lo, new_hi, g_new = tl.reduce(
                (tl.where(keep, mn, -2147483648), tl.where(keep, cnt, 2147483647), tl.where(keep, 2147483647, mx),
                 tl.where(keep, -1, cnt)), 0, _max_min_min_max)
            if new_lo != -2147483648:
                lo = new_lo.to(tl.int64)
                if f_lo == b_sel:
                    exact = 1
            if new_hi != 2147483647:
                hi = new_hi.to(tl.int64)
                g_hi = g_new
            if exact == 1:
                hi = lo  # the clusters >= lo fill B_sel exactly: t* = lo
        thr = lo.to(tl.int32)
        if exact == 0:
            room = b_sel - g_hi

    # -- takes in id order: the output offset of cluster k is (w above t* before k) + min(w at t* before k, room),
    # one scan of both sums packed in an int64; a marker (offset << 32 | cluster_start) per taken cluster
    tl.debug_barrier()
    n_taken = tl.minimum(total, b_sel)
    if ONE_CHUNK:
        _takes(key, w, thr, room, start, mark_row, 0)
    else:
        carry = tl.zeros([], tl.int64)
        for c0 in range(0, n_cl, KB):
            key_c, w_c = _chunk(keys_row, size_bh, c0, n_cl, KB)
            start_c = tl.load(START + bh * K + c0 + tl.arange(0, KB), mask=w_c > 0, other=0)
            carry = _takes(key_c, w_c, thr, room, start_c, mark_row, carry)
    tl.debug_barrier()

    # -- the taken members: each position's cluster is the running max of the markers
    carry = tl.full([], -1, tl.int64)
    for p0 in range(0, max_selected, BLOCK_M):
        j = p0 + offs_m
        used = j < n_taken
        mark = tl.load(mark_row + j, mask=used, other=-1)
        run = tl.maximum(tl.associative_scan(mark, 0, _max_i64), carry)
        if not ONE_M:
            carry = tl.maximum(carry, tl.max(mark, axis=0))
        owner_off = run >> 32  # the owning cluster's output offset, then its cluster_start in the low bits
        src = (run - (owner_off << 32)) + (j - owner_off)
        tl.store(out_row + n_sink + j, tl.load(mem_bh + src, mask=used, other=-1), mask=j < max_selected)


# -- launcher ------------------------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _launch_config(K, D, n_sink, max_selected, window, fused=None, block_k=None, key_chunk=None, block_e=None,
                   block_m=None, num_warps=None, score_warps=None, num_stages=None, candidates=None) -> dict:
    """The kernels' shape-based choices (keyword overrides for the tests and the benchmark's sweep)."""
    kb = min(_pow2(max(K, 1)), key_chunk or MAX_KEYS)
    if fused is None:
        fused = K <= 512  # few clusters: one launch; more: spread the centroid reads over the GPU
    if num_warps is None:
        num_warps = 4 if kb <= 1024 else 8 if kb <= 4096 else 16
    return dict(fused=bool(fused), block_k=block_k or 64, kb=kb, one_chunk=kb >= K,
                block_e=block_e or min(_pow2(max(n_sink, window, 1)), 1024),
                block_m=block_m or min(_pow2(max(max_selected, 1)), 4096), block_d=max(_pow2(D), 16),
                num_warps=num_warps, score_warps=score_warps or 4, num_stages=num_stages or 3,
                candidates=candidates or 4)


def _launch(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters, cluster_end, n_sink,
            max_selected, window, per_query_head, **overrides):
    """Allocate the index and scratch, launch. No checks and no data reads: Triton's interpreter
    (TRITON_INTERPRET=1) runs it on CPU tensors, which is how the kernels are tested without a GPU."""
    B, Hq, _, D = (int(n) for n in q.shape)
    Hkv, K = int(centroids.shape[1]), int(centroids.shape[2])
    C = int(members.shape[2])
    G = Hq // Hkv
    Hsel = Hq if per_query_head else Hkv
    S = n_sink + max_selected + window
    out = torch.empty((B, Hsel, S), dtype=torch.int32, device=q.device)
    rows = B * Hsel
    if rows == 0 or S == 0:
        return out
    cfg = _launch_config(K, D, n_sink, max_selected, window, **overrides)
    keys = torch.empty((rows, max(K, 1)), dtype=torch.int32, device=q.device)
    mark = torch.empty((rows, max(max_selected, 1)), dtype=torch.int64, device=q.device)
    size, start, mem, ncl = (t.contiguous() for t in (cluster_size, cluster_start, members, n_clusters))
    fill, cend = fill.contiguous(), cluster_end.contiguous()
    strides = (q.stride(0), q.stride(1), q.stride(3), *centroids.stride())
    # fp16/bf16 products on the tensor cores; Triton's interpreter (CPU tensors) gets the fp32 dot, its fp16/bf16 dot
    # being wrong
    native = q.is_cuda and q.dtype == centroids.dtype and q.dtype != torch.float32
    gb = max(_pow2(G), 16)  # tl.dot's minimum
    block_k = max(cfg["block_k"], 16)
    if not cfg["fused"] and K > 0:
        wrap_triton(_cluster_scores_kernel)[(triton.cdiv(K, block_k), B * Hkv)](
            q, centroids, ncl, keys, *strides, Hsel, Hkv, G, K, D,
            PER_HEAD=bool(per_query_head), BLOCK_K=block_k, BLOCK_D=cfg["block_d"], GB=gb, NATIVE_DOT=native,
            num_warps=cfg["score_warps"],
        )
    wrap_triton(_select_clusters_kernel)[(rows,)](
        q, centroids, size, start, mem, ncl, fill, cend, budget, keys, mark, out, *strides,
        Hsel, Hkv, G, K, C, D, n_sink, max_selected, window, S,
        PER_HEAD=bool(per_query_head), FUSED=cfg["fused"], BLOCK_K=block_k, BLOCK_D=cfg["block_d"], GB=gb,
        NATIVE_DOT=native, KB=cfg["kb"], NC=cfg["candidates"], ONE_CHUNK=cfg["one_chunk"], BLOCK_E=cfg["block_e"], BLOCK_M=cfg["block_m"],
        ONE_M=cfg["block_m"] >= max_selected, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def triton_select_clusters(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters,
                           cluster_end, *, n_sink: int, max_selected: int, window: int, per_query_head: bool,
                           **tuning):
    """The op on CUDA through Triton; validates shapes, dtypes and devices (reads no data). ``tuning`` overrides
    the launch choices (_launch_config's keywords: fused, block_k, key_chunk, block_e, block_m, num_warps,
    score_warps); it
    is for the tests and the benchmark, the op never passes it. Every setting gives the same index."""
    if triton is None:
        raise NotImplementedError("triton_select_clusters needs Triton (pip install triton); "
                                  "kvrewrite::select_clusters itself runs without it")
    args = (q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters, cluster_end)
    check_inputs(*args, n_sink, max_selected, window, "triton_select_clusters")
    check_one_cuda_device("triton_select_clusters", args)
    return _launch(*args, n_sink, max_selected, window, per_query_head, **tuning)


# -- the op --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kvrewrite::select_clusters_cpu", mutates_args=(), device_types="cpu")
def select_clusters_cpu(q: torch.Tensor, fill: torch.Tensor, budget: torch.Tensor, centroids: torch.Tensor,
                        cluster_size: torch.Tensor, cluster_start: torch.Tensor, members: torch.Tensor,
                        n_clusters: torch.Tensor, cluster_end: torch.Tensor, *, n_sink: int, max_selected: int,
                        window: int, per_query_head: bool) -> torch.Tensor:
    """The CPU path of kvrewrite::select_clusters, an opaque op of its own (the reference checks the window's
    length, a host read that cannot be traced)."""
    return reference_select_clusters(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters,
                                     cluster_end, n_sink=n_sink, max_selected=max_selected, window=window,
                                     per_query_head=per_query_head)


def _empty_index(q, centroids, n_sink, max_selected, window, per_query_head):
    Hsel = q.shape[1] if per_query_head else centroids.shape[1]
    return q.new_empty((q.shape[0], Hsel, n_sink + max_selected + window), dtype=torch.int32)


@select_clusters_cpu.register_fake
def _(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters, cluster_end, *, n_sink,
      max_selected, window, per_query_head):
    return _empty_index(q, centroids, n_sink, max_selected, window, per_query_head)


def select_clusters(q: torch.Tensor, fill: torch.Tensor, budget: torch.Tensor, centroids: torch.Tensor,
                    cluster_size: torch.Tensor, cluster_start: torch.Tensor, members: torch.Tensor,
                    n_clusters: torch.Tensor, cluster_end: torch.Tensor, *, n_sink: int, max_selected: int,
                    window: int, per_query_head: bool) -> torch.Tensor:
    """ClusterKV's slot index for one decode step (module docstring).

    This body is the op's kernel, its fake and, under torch.compile, what Inductor inlines: it stays free of
    data-dependent Python. CPU calls the opaque kvrewrite::select_clusters_cpu; CUDA launches Triton."""
    args = (q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters, cluster_end)
    kw = dict(n_sink=n_sink, max_selected=max_selected, window=window, per_query_head=per_query_head)
    if q.is_cuda and triton is not None:
        return triton_select_clusters(*args, **kw)
    if q.device.type == "cpu":
        check_inputs(*args, n_sink, max_selected, window)
        return torch.ops.kvrewrite.select_clusters_cpu(*args, **kw)
    return reference_select_clusters(*args, **kw)


select_clusters = register_triton_op(NAME, select_clusters, (), triton is not None)
