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

Triton design. Sorting the clusters is not needed: only the cumulative sizes in score order matter. With int32 keys
that order like the fp32 scores (-0.0 as +0.0), the cluster where the running size reaches B_sel has the key
t* = max{t : sum of sizes with key >= t >= B_sel}; clusters with key > t* are taken whole, those at t* in id order
until B_sel, the others not at all. t* comes from a bisection over key values, one reduction per step (weighted
count, the smallest key >= mid, the largest key < mid) that snaps the bracket to present keys, stopping when the
count hits B_sel exactly: ~log2(clusters) steps (9-13 for 410-1640 clusters), each a register reduction. The layout
needs no sort either: one id-order scan (the sizes above t* and at t*, packed in an int64) gives each cluster's take
and output offset; each taken cluster writes a marker (offset << 32 | cluster_start) at its offset in a per-row
scratch (-1 elsewhere), and a running max (associative scan) over the output positions gives every position's
cluster and member.

Two launches (the default). (1) _cluster_scores_kernel, grid (K / BLOCK_K, B * Hkv): a block of centroids times the KV
head's G queries (one tl.dot; per query head each column, else their sum: the summed query's score, equal to the
reference's qvec . centroid up to fp32 rounding order, as every fp32 dot product here), keys to an int32 scratch [B *
Hsel, K]. The index equals the reference's bit for bit wherever the scores do (the tests use exact dyadic inputs); on
real data two clusters whose scores differ by an fp32 rounding may trade places at the budget's edge. (2)
_select_clusters_kernel, grid (B * Hsel,), one program per selection row (32 for Llama-3.1-8B per query head, 8 per KV
head): the bisection, the takes, the index row. One launch with one program per row was tried (each row's program
scoring its own clusters first): the scores need the used centroids read (n_clusters * D * 2 bytes per KV head: 105 KB
at 32k context, 420 KB at 128k), which one program can only pull at one SM's pace: H100, 15 us against 11 at 32k, 34
against 20 at 128k. The selection holds the keys in L lanes, the fewest of K' / 8, K' / 2, K' (K' = next_pow2(K) up to
MAX_KEYS = 16384: 512k-token contexts at 80 tokens per cluster) that hold n_clusters, so a state sized for a long
context costs what its clusters in use cost; past MAX_KEYS it reads them chunk by chunk from the scratch (slower, the
same result). A k-ary search (3-15 thresholds per step) was slower: each step's work grows with the thresholds, and
the steps are not latency-bound enough to pay for it.
One launch with the scores' grid (fused=True, _select_fused_kernel, kept as a tested option): grid (K / BLOCK_K,
B * Hsel), each program scores a block for its row and arrives at the row's counter (an acq_rel atomic,
kvrewrite.kernels._semaphores: zeroed once, reset by the kernel); the last to arrive runs the selection. It saves
the second launch, but measured slower in the ClusterKV step (H100, torch 2.11, triton 3.6,
kvrewrite.bench.clusterkv_attention --sweep, B 1): per KV head 17.8 us against 17.1 at 32k; per query head 25.6
against 22.3 at 32k and 50 against 26 at 128k (per query head its grid re-reads each centroid block G times, and
all of it runs at the selection's warp count). A programmatic dependent launch (pdl=True, Hopper; an experiment
option) was slower still (18.8 / 29.0 us at 32k). Inside a CUDA graph the launch boundary costs about what the
fence and atomic of the last-program hand-off cost: the time is in each kernel's own chain of dependent round trips.
Reading each score block's centroids without waiting for n_clusters (one dependent round trip less, unused ids
read too) measured -0.1 to +0.9 us: not kept.
The selection kernel runs 8 warps up to 4096 key lanes (16 past): 8 over 4 measured -0.3 to -0.7 us per step at
32k; 2 warps +1.6 (32k) to +6.5 us (128k); 2 score warps or 128-cluster score blocks +0.2 to +1 us.
Cost (H100, kvrewrite.bench.select_clusters: Llama-3.1-8B decode, B 1, Hq 32, Hkv 8, D 128, bf16, max_selected
1008, n_sink 16, window 320; CUDA graph, centroids cold in L2): 12.5-12.9 us per call at 32k (410 clusters), 17.4-17.8
at 128k (1640), either per_query_head; 13.0 at 32k in a state sized for 128k (before the 8-warp default).
In the ClusterKV step (kvrewrite.bench.clusterkv_attention, H100, torch 2.11, triton 3.6, centroids warm): 10.2-11.4
us per call at 32k, 14.7-15.9 at 128k. Per kernel (torch.profiler, B 1): scores 2.5-2.6 us at 32k, 4.3-4.4 at
128k; selection 7.1-7.7 us at 32k, 10.1-10.6 at 128k. With B_sel = 0 (no bisection, no takes) the op still costs
6.7-8.0 us at 32k and 9.8-11.2 at 128k: the bisection, takes and member gather are ~3-4 us, the rest is the two
launches, the scores and the selection kernel's fixed chain (n_clusters -> keys, sizes, starts -> reductions ->
scans over the 1008 output positions), which is where a further cut has to come from.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite.kernels._semaphores import counters
from kvrewrite.kernels._triton_op import check_one_cuda_device, register_triton_op, triton_jit
from kvrewrite.kernels.attention_column_stats import _load_rows  # the tiles' loads, by column only when D < BLOCK_D
from kvrewrite.kernels.evict_by_score import _add_min_max, _order_key  # fp32 order keys, (sum, min, max) combine

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
def _max_i64(a, b):
    return tl.maximum(a, b)


@triton_jit()
def _chunk(KEYS_ROW, SIZE_BH, c0, n_cl, KB: tl.constexpr):
    """Keys and weights of clusters [c0, c0 + KB): weight = size for a valid cluster (k < n_cl, size > 0), else 0
    with the key -2**31 (below every score's key)."""
    k = c0 + tl.arange(0, KB)
    live = k < n_cl
    size = tl.load(SIZE_BH + k, mask=live, other=0)
    key = tl.load(KEYS_ROW + k, mask=live, other=0, cache_modifier=".cg")  # with the sizes: one round trip
    valid = live & (size > 0)
    return tl.where(valid, key, -2147483648), tl.where(valid, size, 0)


@triton_jit()
def _count(key, w, mid):
    """(sum of w over key >= mid, the smallest such key, the largest valid key < mid); w > 0 marks valid."""
    ge = key >= mid
    return tl.reduce((tl.where(ge, w, 0), tl.where(ge & (w > 0), key, 2147483647),
                      tl.where((~ge) & (w > 0), key, -2147483648)), 0, _add_min_max)


@triton_jit()
def _bisect_step(lo, hi, g_hi, exact, cnt, mn, mx, b_sel):
    """One step of the search for t* (_select_in_registers) from the counts at mid."""
    if cnt >= b_sel:
        lo = mn.to(tl.int64)  # F(mn) = cnt: no key in [mid, mn)
        if cnt == b_sel:
            hi = lo  # the clusters >= mn fill B_sel exactly: t* = mn
            exact = 1
    else:
        hi = mx.to(tl.int64)  # G(mx) = F(mid) = cnt: no key in (mx, mid)
        g_hi = cnt
    return lo, hi, g_hi, exact


@triton_jit()
def _select_in_registers(KEYS_ROW, SIZE_BH, START_BH, MARK_ROW, n_cl, b_sel, L: tl.constexpr):
    """The selection of a row of n_cl <= L clusters, its keys, sizes and starts in registers (L lanes): t* by
    bisection, then the takes and their markers (_takes). Returns the members taken, min(B_sel, valid members).

    t* = max{t : F(t) >= B_sel}, F(t) = sum(w[key >= t]). The bracket [lo, hi] keeps F(lo) >= B_sel > G(hi), G(t) =
    sum(w[key > t]) (g_hi), lo and hi keys of valid clusters: each step (one reduction: F(mid), the smallest key
    >= mid, the largest < mid) snaps it to keys. room = B_sel - G(t*) is what the clusters at t* share, in id order;
    exact: they fit whole."""
    kk = tl.arange(0, L)
    live = kk < n_cl
    size = tl.load(SIZE_BH + kk, mask=live, other=0)
    key = tl.load(KEYS_ROW + kk, mask=live, other=0, cache_modifier=".cg")
    start = tl.load(START_BH + kk, mask=live, other=0)
    valid = live & (size > 0)
    key = tl.where(valid, key, -2147483648)
    w = tl.where(valid, size, 0)
    total, kmin, kmax = tl.reduce((w, tl.where(valid, key, 2147483647), key), 0, _add_min_max)
    thr = tl.full([], -2147483648, tl.int32)  # every valid cluster whole (total <= B_sel)
    room = tl.full([], 2147483647, tl.int32)
    if b_sel == 0:
        thr = tl.full([], 2147483647, tl.int32)  # none
    elif total > b_sel:
        lo = kmin.to(tl.int64)
        hi = kmax.to(tl.int64)
        g_hi = tl.zeros([], tl.int32)
        exact = tl.zeros([], tl.int32)
        while lo < hi:
            cnt, mn, mx = _count(key, w, (lo + (hi - lo + 1) // 2).to(tl.int32))
            lo, hi, g_hi, exact = _bisect_step(lo, hi, g_hi, exact, cnt, mn, mx, b_sel)
        thr = lo.to(tl.int32)
        if exact == 0:
            room = b_sel - g_hi
    tl.debug_barrier()  # the markers' -1 (written by any thread) before the scatter
    _takes(key, w, thr, room, start, MARK_ROW, 0)
    return tl.minimum(total, b_sel)


@triton_jit()
def _select_in_chunks(KEYS_ROW, SIZE_BH, START_BH, MARK_ROW, n_cl, b_sel, KB: tl.constexpr):
    """_select_in_registers for any n_cl: every pass reads the keys and sizes chunk by chunk (KB lanes) from memory."""
    total = tl.zeros([], tl.int32)
    kmin = tl.full([], 2147483647, tl.int32)
    kmax = tl.full([], -2147483648, tl.int32)
    for c0 in range(0, n_cl, KB):
        key, w = _chunk(KEYS_ROW, SIZE_BH, c0, n_cl, KB)
        t_c, mn_c, mx_c = tl.reduce((w, tl.where(w > 0, key, 2147483647), key), 0, _add_min_max)
        total, kmin, kmax = _add_min_max(total, kmin, kmax, t_c, mn_c, mx_c)
    thr = tl.full([], -2147483648, tl.int32)
    room = tl.full([], 2147483647, tl.int32)
    if b_sel == 0:
        thr = tl.full([], 2147483647, tl.int32)
    elif total > b_sel:
        lo = kmin.to(tl.int64)
        hi = kmax.to(tl.int64)
        g_hi = tl.zeros([], tl.int32)
        exact = tl.zeros([], tl.int32)
        while lo < hi:
            mid = (lo + (hi - lo + 1) // 2).to(tl.int32)
            cnt = tl.zeros([], tl.int32)
            mn = tl.full([], 2147483647, tl.int32)
            mx = tl.full([], -2147483648, tl.int32)
            for c0 in range(0, n_cl, KB):
                key, w = _chunk(KEYS_ROW, SIZE_BH, c0, n_cl, KB)
                cnt_c, mn_c, mx_c = _count(key, w, mid)
                cnt, mn, mx = _add_min_max(cnt, mn, mx, cnt_c, mn_c, mx_c)
            lo, hi, g_hi, exact = _bisect_step(lo, hi, g_hi, exact, cnt, mn, mx, b_sel)
        thr = lo.to(tl.int32)
        if exact == 0:
            room = b_sel - g_hi
    tl.debug_barrier()
    carry = tl.zeros([], tl.int64)
    for c0 in range(0, n_cl, KB):
        key, w = _chunk(KEYS_ROW, SIZE_BH, c0, n_cl, KB)
        start = tl.load(START_BH + c0 + tl.arange(0, KB), mask=w > 0, other=0)
        carry = _takes(key, w, thr, room, start, MARK_ROW, carry)
    return tl.minimum(total, b_sel)


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
def _centroid_tile(CEN_BH, k, n_cl, offs_d, d_ok, stride_ck, stride_cd, EVEN_D: tl.constexpr):
    """Centroids of cluster ids k (< n_cl; others 0), [len(k), BLOCK_D]."""
    return _load_rows(CEN_BH + k[:, None] * stride_ck + offs_d[None, :] * stride_cd, k < n_cl, d_ok, EVEN_D)


@triton_jit()
def _group_queries(Q, b, h, G, stride_qb, stride_qh, stride_qd, offs_d, d_ok, row_ok, GB: tl.constexpr,
                   EVEN_D: tl.constexpr):
    """KV head h's query heads h·G + r for the rows r with row_ok, [GB, BLOCK_D] (other rows: 0)."""
    offs_g = tl.arange(0, GB)
    return _load_rows(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                      row_ok, d_ok, EVEN_D)


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
    EVEN_D: tl.constexpr = False,  # D == BLOCK_D and VECTOR_LOADS: the tiles load as 16-byte vectors
):
    """Scores, grid (cluster blocks, B * Hkv): the block's centroids read once, times the KV head's G queries (one
    tl.dot); per query head each column, shared their sum (the summed query's score)."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // Hkv
    h = bh % Hkv
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_g = tl.arange(0, GB)
    n_cl = tl.minimum(tl.load(NCL + bh), K)
    if tl.program_id(0) * BLOCK_K < n_cl:
        qg = _group_queries(Q, b, h, G, stride_qb, stride_qh, stride_qd, offs_d, d_ok, offs_g < G, GB, EVEN_D)
        c = _centroid_tile(CEN + b * stride_cb + h * stride_ch, k, n_cl, offs_d, d_ok, stride_ck, stride_cd, EVEN_D)
        sc = _tile_dots(c, qg, NATIVE_DOT)
        if PER_HEAD:
            tl.store(KEYS + (b * Hsel + h * G + offs_g[None, :]) * K + k[:, None], _order_key(sc),
                     mask=(k < n_cl)[:, None] & (offs_g < G)[None, :])
        else:
            tl.store(KEYS + (b * Hsel + h) * K + k, _order_key(tl.sum(sc, axis=1)), mask=k < n_cl)


@triton_jit()
def _row_prologue(MEMBERS, MARK, OUT, bh, row, cend, fill, C, n_sink, max_selected, window, S,
                  BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, SINKS_FROM: tl.constexpr):
    """What does not depend on the selection: the sinks from SINKS_FROM on and the window into the index row, -1
    into the row's markers (before any marker is scattered)."""
    mem_bh = MEMBERS + bh * C
    out_row = OUT + row * S
    offs_e = tl.arange(0, BLOCK_E)
    for p0 in range(SINKS_FROM, n_sink, BLOCK_E):
        p = p0 + offs_e
        tl.store(out_row + p, tl.load(mem_bh + p, mask=p < n_sink, other=-1), mask=p < n_sink)
    for j0 in range(0, window, BLOCK_E):
        slot = cend + j0 + offs_e
        tl.store(out_row + n_sink + max_selected + j0 + offs_e, tl.where(slot < fill, slot, -1).to(tl.int32),
                 mask=j0 + offs_e < window)
    mark_row = MARK + row * tl.maximum(max_selected, 1)
    offs_m = tl.arange(0, BLOCK_M)
    for p0 in range(0, max_selected, BLOCK_M):
        tl.store(mark_row + p0 + offs_m, tl.full([BLOCK_M], -1, tl.int64), mask=p0 + offs_m < max_selected)


@triton_jit()
def _row_selection(SIZE, START, MEMBERS, KEYS, MARK, OUT, bh, row, n_cl, budget, K, C, n_sink, max_selected, S,
                   KB: tl.constexpr, TIERS: tl.constexpr, ONE_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                   ONE_M: tl.constexpr):
    """The selection of one row once its keys are written and its markers are -1: t*, the takes, the markers, then
    the taken members into the index row. The keys are held in the fewest lanes of KB / 8, KB / 2, KB (TIERS)
    that hold n_clusters; past KB (K > KB), chunk by chunk from memory. The chain is keys -> bisection -> marker
    scatter -> marker load -> member gather."""
    mark_row = MARK + row * tl.maximum(max_selected, 1)
    keys_row = KEYS + row * K
    size_bh = SIZE + bh * K
    start_bh = START + bh * K
    mem_bh = MEMBERS + bh * C
    out_row = OUT + row * S
    n_cl = tl.minimum(tl.maximum(n_cl, 0), K)
    b_sel = tl.minimum(tl.maximum(budget - n_sink, 0), max_selected).to(tl.int32)
    if TIERS:
        if n_cl <= KB // 8:
            n_taken = _select_in_registers(keys_row, size_bh, start_bh, mark_row, n_cl, b_sel, KB // 8)
        elif n_cl <= KB // 2:
            n_taken = _select_in_registers(keys_row, size_bh, start_bh, mark_row, n_cl, b_sel, KB // 2)
        elif ONE_CHUNK:
            n_taken = _select_in_registers(keys_row, size_bh, start_bh, mark_row, n_cl, b_sel, KB)
        elif n_cl <= KB:
            n_taken = _select_in_registers(keys_row, size_bh, start_bh, mark_row, n_cl, b_sel, KB)
        else:
            n_taken = _select_in_chunks(keys_row, size_bh, start_bh, mark_row, n_cl, b_sel, KB)
    elif ONE_CHUNK:
        n_taken = _select_in_registers(keys_row, size_bh, start_bh, mark_row, n_cl, b_sel, KB)
    elif n_cl <= KB:
        n_taken = _select_in_registers(keys_row, size_bh, start_bh, mark_row, n_cl, b_sel, KB)
    else:
        n_taken = _select_in_chunks(keys_row, size_bh, start_bh, mark_row, n_cl, b_sel, KB)
    tl.debug_barrier()

    # -- the taken members: each position's cluster is the running max of the markers
    offs_m = tl.arange(0, BLOCK_M)
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


@triton_jit(do_not_specialize=["Hsel", "Hkv", "G", "K", "C", "n_sink", "max_selected", "window", "S"])
def _select_clusters_kernel(
    SIZE, START, MEMBERS, NCL, FILL, CEND, BUDGET,
    KEYS,  # int32 [B * Hsel, K]: the scores' keys (_cluster_scores_kernel)
    MARK,  # int64 [B * Hsel, M] scratch, M = max(max_selected, 1): per output position a marker or -1
    OUT,  # int32 [B * Hsel, S]
    Hsel, Hkv, G, K, C, n_sink, max_selected, window, S,
    PER_HEAD: tl.constexpr, KB: tl.constexpr, TIERS: tl.constexpr, ONE_CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, ONE_M: tl.constexpr,
):
    """Selection (two-launch form, fused=False), grid (B * Hsel,): one program per selection row after
    _cluster_scores_kernel. Latency-bound: what does not depend on the selection is issued first."""
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
    # the first BLOCK_E sinks: loaded now, stored last (a store waiting on its load would stall the selection)
    offs_e = tl.arange(0, BLOCK_E)
    sinks = tl.load(MEMBERS + bh * C + offs_e, mask=offs_e < n_sink, other=-1)
    _row_prologue(MEMBERS, MARK, OUT, bh, row, tl.load(CEND + bh), tl.load(FILL + bh), C, n_sink, max_selected,
                  window, S, BLOCK_E, BLOCK_M, BLOCK_E)  # ordered before the scatter by the selection's barrier
    _row_selection(SIZE, START, MEMBERS, KEYS, MARK, OUT, bh, row, n_cl, budget, K, C, n_sink, max_selected, S,
                   KB, TIERS, ONE_CHUNK, BLOCK_M, ONE_M)
    tl.store(OUT + row * S + offs_e, sinks, mask=offs_e < n_sink)


@triton_jit(do_not_specialize=["Hsel", "Hkv", "G", "K", "D", "C", "n_sink", "max_selected", "window", "S", "NB"])
def _select_fused_kernel(
    Q, CEN, SIZE, START, MEMBERS, NCL, FILL, CEND, BUDGET,
    KEYS,  # int32 [B * Hsel, K] scratch: row (b, s)'s key of cluster k (written for k < n_clusters)
    MARK,  # int64 [B * Hsel, M] scratch, M = max(max_selected, 1): per output position a marker or -1
    SEM,  # int32 [>= B * Hsel] counters at 0 (kvrewrite.kernels._semaphores); left at 0
    OUT,  # int32 [B * Hsel, S]
    stride_qb, stride_qh, stride_qd, stride_cb, stride_ch, stride_ck, stride_cd,
    Hsel, Hkv, G, K, D, C, n_sink, max_selected, window, S, NB,
    PER_HEAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, GB: tl.constexpr,
    NATIVE_DOT: tl.constexpr, KB: tl.constexpr, TIERS: tl.constexpr, ONE_CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, ONE_M: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch: wait for the previous grid, free the next
    EVEN_D: tl.constexpr = False,  # as _cluster_scores_kernel's
):
    """Scores and selection in one launch, grid (NB = cdiv(K, BLOCK_K), B * Hsel): program (i, row) scores
    clusters [i * BLOCK_K, (i + 1) * BLOCK_K) for its selection row (its query head's query, or the sum of the KV
    head's G queries: the same tl.dot as _cluster_scores_kernel, the other columns masked to 0) and stores their
    keys; program 0 also writes the row's sinks, window and -1 markers; then each arrives at the row's counter,
    and the last to arrive (acquire: it sees every key) resets it to 0 and runs the row's selection."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(1).to(tl.int64)
    b = row // Hsel
    s = row % Hsel
    if PER_HEAD:
        h = s // G
    else:
        h = s
    bh = b * Hkv + h
    n_cl = tl.load(NCL + bh)
    n_cl_k = tl.minimum(n_cl, K)
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    if tl.program_id(0) * BLOCK_K < n_cl_k:
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        offs_g = tl.arange(0, GB)
        if PER_HEAD:
            g_ok = offs_g == s % G
        else:
            g_ok = offs_g < G
        qg = _group_queries(Q, b, h, G, stride_qb, stride_qh, stride_qd, offs_d, d_ok, g_ok, GB, EVEN_D)
        c = _centroid_tile(CEN + b * stride_cb + h * stride_ch, k, n_cl_k, offs_d, d_ok, stride_ck, stride_cd,
                           EVEN_D)
        sc = _tile_dots(c, qg, NATIVE_DOT)
        tl.store(KEYS + row * K + k, _order_key(tl.sum(tl.where(g_ok[None, :], sc, 0.0), axis=1)), mask=k < n_cl_k)
    if tl.program_id(0) == 0:
        _row_prologue(MEMBERS, MARK, OUT, bh, row, tl.load(CEND + bh), tl.load(FILL + bh), C, n_sink,
                      max_selected, window, S, BLOCK_E, BLOCK_M, 0)
    tl.debug_barrier()  # the program's stores before its arrival (released by the atomic)
    if tl.atomic_add(SEM + row, 1, sem="acq_rel", scope="gpu") == NB - 1:
        tl.store(SEM + row, 0)  # every program of the row has arrived: ready for the next launch
        _row_selection(SIZE, START, MEMBERS, KEYS, MARK, OUT, bh, row, n_cl, tl.load(BUDGET), K, C, n_sink,
                       max_selected, S, KB, TIERS, ONE_CHUNK, BLOCK_M, ONE_M)


# -- launcher ------------------------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# The scores' tiles (a block of centroids, the group's queries) were masked by column against D, a runtime argument
# (do_not_specialize): compiled for sm_90 (the scores kernel at K 2048, D 128, bf16; bench/occupancy.py's
# sm90_resources) every element loads with a 2-byte LDG.E.U16 of its own, 80 a thread. VECTOR_LOADS drops the column
# mask where D == BLOCK_D (attention_column_stats' _load_rows, as the EMS statistics fold, where the same change took
# the kernel from 24.7-24.9 ms to 18.7 in one run; docs/bench.md "Stop 53 runs"). Built in stop 53 after its device
# time: off until bench/clusterkv_attention.py times it (`--kernel-option select_clusters.VECTOR_LOADS=True` end to
# end). Its sweep on an H200 (stops 54 and 55, one run each; docs/bench.md): at 128k 3-8% faster than without in both
# runs and both selections, at 32k per query head 2-3% slower in both, per KV head once slower, once faster: off.
VECTOR_LOADS = False


def _launch_config(K, D, n_sink, max_selected, window, block_k=None, key_chunk=None, block_e=None, block_m=None,
                   num_warps=None, score_warps=None, tiers=None, fused=False, pdl=False, rows=1,
                   vector_loads=None) -> dict:
    """The kernels' shape-based choices (keyword overrides for the tests and the benchmark's sweep). fused: one
    launch (_select_fused_kernel), else the scores and the selection as two (score_warps: the scores'). pdl (fused
    only, an experiment of the benchmark): a programmatic dependent launch (Hopper). vector_loads (default
    VECTOR_LOADS): the centroid and query tiles without the column mask when D fills BLOCK_D."""
    kb = min(_pow2(max(K, 1)), key_chunk or MAX_KEYS)
    if num_warps is None:
        # 8 over 4 at kb <= 1024 for up to 64 rows: -0.3 to -0.7 us per step at B 1, 32k (H100); 4 past (B 8 per
        # query head, 256 rows: 8 measured +2 us)
        num_warps = (8 if rows <= 64 else 4) if kb <= 1024 else 8 if kb <= 4096 else 16
    return dict(block_k=max(block_k or 64, 16), kb=kb, one_chunk=kb >= K, tiers=kb >= 64 if tiers is None else tiers,
                block_e=block_e or min(_pow2(max(n_sink, window, 1)), 1024),
                block_m=block_m or min(_pow2(max(max_selected, 1)), 4096), block_d=max(_pow2(D), 16),
                num_warps=num_warps, score_warps=score_warps or 4, fused=fused, pdl=pdl,
                even_d=(VECTOR_LOADS if vector_loads is None else vector_loads) and D == max(_pow2(D), 16))


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
    cfg = _launch_config(K, D, n_sink, max_selected, window, **{"rows": rows, **overrides})
    keys = torch.empty((rows, max(K, 1)), dtype=torch.int32, device=q.device)
    mark = torch.empty((rows, max(max_selected, 1)), dtype=torch.int64, device=q.device)
    size, start, mem, ncl = (t.contiguous() for t in (cluster_size, cluster_start, members, n_clusters))
    fill, cend = fill.contiguous(), cluster_end.contiguous()
    sel = dict(KB=cfg["kb"], TIERS=cfg["tiers"], ONE_CHUNK=cfg["one_chunk"], BLOCK_E=cfg["block_e"],
               BLOCK_M=cfg["block_m"], ONE_M=cfg["block_m"] >= max_selected)
    score = dict(
        BLOCK_K=cfg["block_k"], BLOCK_D=cfg["block_d"],
        GB=max(_pow2(G), 16),  # tl.dot's minimum
        # fp16/bf16 products on the tensor cores; Triton's interpreter (CPU tensors) gets the fp32 dot, its
        # fp16/bf16 dot being wrong
        NATIVE_DOT=q.is_cuda and q.dtype == centroids.dtype and q.dtype != torch.float32,
        EVEN_D=cfg["even_d"],
    )
    if cfg["fused"]:
        nb = triton.cdiv(max(K, 1), cfg["block_k"])
        sem = counters(NAME, q, rows)
        wrap_triton(_select_fused_kernel)[(nb, rows)](
            q, centroids, size, start, mem, ncl, fill, cend, budget, keys, mark, sem, out,
            q.stride(0), q.stride(1), q.stride(3), *centroids.stride(),
            Hsel, Hkv, G, K, D, C, n_sink, max_selected, window, S, nb,
            PER_HEAD=bool(per_query_head), **score, **sel, PDL=cfg["pdl"], num_warps=cfg["num_warps"],
            **({"launch_pdl": True} if cfg["pdl"] else {}),
        )
        return out
    if K > 0:
        wrap_triton(_cluster_scores_kernel)[(triton.cdiv(K, cfg["block_k"]), B * Hkv)](
            q, centroids, ncl, keys, q.stride(0), q.stride(1), q.stride(3), *centroids.stride(), Hsel, Hkv, G, K, D,
            PER_HEAD=bool(per_query_head), **score, num_warps=cfg["score_warps"],
        )
    wrap_triton(_select_clusters_kernel)[(rows,)](
        size, start, mem, ncl, fill, cend, budget, keys, mark, out, Hsel, Hkv, G, K, C, n_sink, max_selected, window, S,
        PER_HEAD=bool(per_query_head), **sel, num_warps=cfg["num_warps"],
    )
    return out


def triton_select_clusters(q, fill, budget, centroids, cluster_size, cluster_start, members, n_clusters,
                           cluster_end, *, n_sink: int, max_selected: int, window: int, per_query_head: bool,
                           **tuning):
    """The op on CUDA through Triton; validates shapes, dtypes and devices (reads no data). ``tuning`` overrides
    the launch choices (_launch_config's keywords: block_k, key_chunk, block_e, block_m, num_warps, score_warps,
    tiers, fused, pdl); it
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
