"""kvrewrite::chelsea_compress — Chelsea's chunked soft matching + degree-weighted star merge.

Based on "Efficient Long-Context LLM Inference via KV Cache Clustering" (Chelsea,
https://arxiv.org/abs/2506.11418), Algorithm 1 and Sec. 5. For every row (b, kv-head) whose fill
reached the threshold (budget = [target B, threshold B + g]) and that is not an outlier head:

1. load its valid slots in temporal order; protect the first n_sink and the last n_recent;
2. repeat CSM rounds on the middle region until the row holds `target` slots:
   - split the middle into consecutive chunks of `chunk`; inside each chunk, 1st/3rd/5th... slots
     form set A and 2nd/4th/6th... set B (the alternation restarts in every chunk); every round
     re-chunks the middle it starts from, so boundaries move as the middle shrinks (see ChelseaMethod);
   - every A slot draws one edge to its most cosine-similar B slot of the same chunk (keys only);
   - edges of all chunks are ranked together and the top n_merge kept, with
     r_i = max(r_init - r_alpha * min(r_steps, i), r_min), n_merge = min(max(1, floor(r_i * M)),
     L - target), i the round index inside this call, M the middle length;
   - every B slot and the A slots pointing to it form a star, merged by degree:
     k = sum n_i k_i / sum n_i, v likewise, n = sum n_i; the centroid keeps the B slot's place
     (temporal order is preserved) and the largest cache position of its members;
3. store the row packed, bias = log n.

State (mutated): keys, values [B, Hkv, C, D]; bias, slot_pos [B, Hkv, C]; fill [B, Hkv].

Load-bearing details of the reference (the CUDA kernel follows them): cosine in fp32 of the
normalised keys; argmax ties go to the first B; a star is summed as n_b k_b, then its members in
ranking order (scatter_add's order), then divided by the degree sum, and every other middle slot is
divided back, (k n) / n; centroids stay fp32 between the rounds of one call and are cast to the
state's dtype at the end. Exact ties in the edge ranking are broken by torch.topk (an unspecified
order); the CUDA kernel breaks them toward the earlier edge, which `pinned_ties()` makes the reference
do too (for the CUDA tests: identical keys tie exactly). Generic fp32 similarities never tie exactly.

Backends: the reference reads fill and budget on the host (CPU; CUDA without Triton, or with a chunk
above 512 or D above 256); on CUDA the Triton kernels in _compress_cuda.py run every round on the
device with no host sync (CUDA graphs can capture them).
"""
import contextlib
import logging
import math

import torch
import torch.nn.functional as F

from kvrewrite.kernels import _compress_cuda
from kvrewrite.kernels._slots import load_row, rows_due, store_row

logger = logging.getLogger(__name__)
_PINNED_TIES = False


@contextlib.contextmanager
def pinned_ties():
    """Inside: the reference breaks exact ties of the edge ranking toward the earlier edge (a stable
    sort), as the CUDA kernel does, instead of torch.topk's unspecified order."""
    global _PINNED_TIES
    _PINNED_TIES = True
    try:
        yield
    finally:
        _PINNED_TIES = False


def csm_round(K, V, n, pos, n_merge: int, chunk: int):
    """One chunked-soft-matching round over R rows of equal middle length M.

    K, V: [R, M, D] fp32; n: [R, M] fp32 degrees; pos: [R, M] int64.
    Returns the merged (K, V, n, pos) of length M - m, m <= n_merge the edges actually kept.
    """
    R, M, D = K.shape
    nc = math.ceil(M / chunk)
    P = nc * chunk
    Kn = F.pad(F.normalize(K, dim=-1), (0, 0, 0, P - M))
    idx = torch.arange(P, device=K.device).view(nc, chunk)
    a_idx, b_idx = idx[:, 0::2], idx[:, 1::2]  # [nc, ca], [nc, cb]
    sim = Kn[:, a_idx] @ Kn[:, b_idx].transpose(-1, -2)  # [R, nc, ca, cb]
    sim = sim.masked_fill((b_idx >= M)[None, :, None, :], float("-inf"))
    best, arg = sim.max(dim=-1)  # [R, nc, ca]
    best = best.masked_fill((a_idx >= M)[None], float("-inf"))
    dst = torch.gather(b_idx[None].expand(R, -1, -1), 2, arg).flatten(1)  # [R, E]
    src = a_idx[None].expand(R, -1, -1).flatten(1)
    best = best.flatten(1)
    m = min(n_merge, int(torch.isfinite(best[0]).sum()))
    if m <= 0:
        return K, V, n, pos
    if _PINNED_TIES:  # ties to the earlier edge, as the CUDA kernel
        top = best.sort(dim=1, descending=True, stable=True).indices[:, :m]
    else:
        top = best.topk(m, dim=1).indices
    src, dst = src.gather(1, top), dst.gather(1, top)  # [R, m]; src in A, dst in B: disjoint
    w = n[..., None]
    Ks, Vs = K * w, V * w
    gidx = src[..., None].expand(-1, -1, D)
    k_add, v_add, n_add, p_add = Ks.gather(1, gidx), Vs.gather(1, gidx), n.gather(1, src), pos.gather(1, src)
    didx = dst[..., None].expand(-1, -1, D)
    Ks, Vs = Ks.scatter_add(1, didx, k_add), Vs.scatter_add(1, didx, v_add)
    n2 = n.scatter_add(1, dst, n_add)
    pos2 = pos.scatter_reduce(1, dst, p_add, reduce="amax")
    removed = torch.zeros(R, M, dtype=torch.int8, device=K.device).scatter_(1, src, 1)
    keep = torch.argsort(removed, dim=1, stable=True)[:, : M - m]  # survivors, in order
    n2 = n2.gather(1, keep)
    kidx = keep[..., None].expand(-1, -1, D)
    return Ks.gather(1, kidx) / n2[..., None], Vs.gather(1, kidx) / n2[..., None], n2, pos2.gather(1, keep)


def chelsea_rows(K, V, n, pos, target, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min):
    """Compress R rows of equal length L to `target` slots with repeated CSM rounds."""
    L = K.shape[1]
    i = 0
    while L > target:
        M = L - n_sink - n_recent
        r = max(r_init - r_alpha * min(r_steps, i), r_min)
        # floor(r * M); the 1e-9 absorbs binary rounding (0.35 - 0.1 * 2 == 0.1499..., floor(0.15 * 20) is 3)
        n_merge = min(max(1, int(r * M + 1e-9)), L - target)
        mid = slice(n_sink, L - n_recent)
        Km, Vm, nm, pm = csm_round(K[:, mid], V[:, mid], n[:, mid], pos[:, mid], n_merge, chunk)
        if Km.shape[1] == M:  # no edge left: the middle cannot shrink further
            break
        K = torch.cat([K[:, :n_sink], Km, K[:, L - n_recent :]], dim=1)
        V = torch.cat([V[:, :n_sink], Vm, V[:, L - n_recent :]], dim=1)
        n = torch.cat([n[:, :n_sink], nm, n[:, L - n_recent :]], dim=1)
        pos = torch.cat([pos[:, :n_sink], pm, pos[:, L - n_recent :]], dim=1)
        L = K.shape[1]
        i += 1
    return K, V, n, pos


def reference_chelsea_compress(
    keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min, outlier_heads
):
    target = int(budget[0])
    groups: dict[int, list] = {}
    for b, h in rows_due(fill, budget, skip_heads=set(outlier_heads)):
        K, V, row_bias, pos = load_row(keys, values, bias, slot_pos, fill, b, h)
        groups.setdefault(K.shape[0], []).append((b, h, K, V, row_bias, pos))
    for rows in groups.values():
        K = torch.stack([r[2] for r in rows]).float()
        V = torch.stack([r[3] for r in rows]).float()
        n = torch.stack([r[4] for r in rows]).exp().round()
        pos = torch.stack([r[5] for r in rows])
        K, V, n, pos = chelsea_rows(K, V, n, pos, target, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min)
        for j, (b, h, *_) in enumerate(rows):
            store_row(keys, values, bias, slot_pos, fill, b, h, K[j], V[j], n[j].log(), pos[j])


@torch.library.custom_op(
    "kvrewrite::chelsea_compress", mutates_args=("keys", "values", "bias", "slot_pos", "fill")
)
def chelsea_compress(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    budget: torch.Tensor,
    n_sink: int,
    n_recent: int,
    chunk: int,
    r_init: float,
    r_alpha: float,
    r_steps: int,
    r_min: float,
    outlier_heads: list[int],
) -> None:
    """Chelsea compression of the rows that reached the threshold (see the module docstring)."""
    reference_chelsea_compress(
        keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min, outlier_heads
    )


@chelsea_compress.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min,
      outlier_heads):
    args = (keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min,
            outlier_heads)
    if _compress_cuda.supports_chelsea(keys, chunk):
        _compress_cuda.triton_chelsea_compress(*args)
        return
    if _compress_cuda.triton is not None:
        logger.warning("chelsea_compress: chunk=%d, D=%d has no Triton kernel (chunk <= %d, D <= %d); running the "
                       "reference, which syncs with the host", chunk, keys.shape[-1], _compress_cuda.MAX_CHUNK,
                       _compress_cuda.MAX_HEAD_DIM)
    reference_chelsea_compress(*args)


@chelsea_compress.register_fake
def _(keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps, r_min, outlier_heads):
    return None
