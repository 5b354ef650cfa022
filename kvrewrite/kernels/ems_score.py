"""kvrewrite::ems_score — EMS's Global-Local score (Eq. 2) of every runtime slot, and its pooled ranking score.

EMS ("Adaptive KV cache compression by Evict-then-Merge", the contract docs/contracts/ems.md §6.6, notes
shared/notes/003-ems.md §2.2-2.4). Per row (b, kv head) that is due, with live(j) = j < slot_fill, lut_j >= 0 and
bias[lut_j] > -inf:

    loc_j = s_loc_past_j + s_loc_cur_j                                        (fp32)
    alpha = fp32(sum_live loc (fp64) / sum_live s_glo (fp64)), 0 if sum s_glo == 0    (Eq. 2's mean alignment)
    g_j = max(alpha * s_glo_j, loc_j) for live j, else 0                      (fp32)
    window slots = the slots of the last l_win valid entries (entry < fill, bias > -inf)
    P = the live non-window slots in slot_order order (token-position order), P_0 .. P_{n-1}
    g_pooled[P_i] = (sum_{k=i-h}^{i+h} g[P_k], a missing k as 0, summed in increasing k) / pool, h = (pool-1)/2
    g_pooled = -inf for window, dead and padding slots

Rows not due: g = 0, g_pooled = -inf. g weighs a merge (ems_merge), g_pooled ranks (ems_partition, the LUT cap).

Inputs: bias [B, Hkv, C] fp32, fill [B, Hkv] int64, lut, slot_order [B, Hkv, R] int32, s_glo, s_loc_past,
s_loc_cur [B, Hkv, R] fp32, slot_fill [B, Hkv] int64, due [B, Hkv] bool. Args: l_win (int >= 1), pool (odd
int >= 1; 1: no pooling). Returns (g, g_pooled), fp32 [B, Hkv, R].

Backends. The reference below (static-shape tensor code, no host reads, deterministic) is the CPU path and the
ground truth. CUDA runs the Triton kernels of kvrewrite/kernels/_ems_rank_kernels.py (_cuda_impl decides:
KERNELS_CHECKED_ON_GPU, Triton installed, contiguous inputs; otherwise the reference, logged once): 3 launches of
(blocks of 1024 slots) x rows programs, alpha's fp64 partial sums per block summed in a fixed order, P packed by a
count prefix, the pooled sums in increasing k with a halo of h read from the packed row and an IEEE division (the
reference divides by a 0-dim tensor for the same rounding on every device). g and g_pooled equal the reference's bit
for bit: checked through Triton's interpreter (tests/kernels/test_ems_score_triton.py) and on an H100 80GB HBM3 with
torch 2.11.0+cu130, Triton 3.6.0 (tests/kernels/test_ems_score_gpu.py: 17 passed, ragged rows, padding, rows not
due, kernel 1/3/7, l_win 1/32/all, a CUDA graph replayed on a new state). Llama-3.1-8B shape at budget 0.2 (C 6866,
R 27464, Hkv 8, a due row of 6611 entries and 26348 slots), in a CUDA graph: 23 us (B = 1) / 127 us (B = 8) against
the reference's 235 / 527 us.
"""
import importlib

import torch

from kvrewrite.kernels._fallbacks import reference_fallback

NAME = "kvrewrite::ems_score"
NEG_INF = float("-inf")


def check_slot_table(name, bias, fill, slot_fill, **fields):
    """ValueError unless bias is fp32 [B, H, C], fill and slot_fill int64 [B, H] and every keyword field has
    the [B, H, R] shape and the dtype given as (tensor, dtype); all on bias's device. Returns (B, H, C, R)."""
    if bias.dim() != 3 or bias.dtype != torch.float32:
        raise ValueError(f"{name}: bias must be fp32 [B, Hkv, C], got {bias.dtype} {list(bias.shape)}")
    B, H, C = bias.shape
    for field, t in (("fill", fill), ("slot_fill", slot_fill)):
        if tuple(t.shape) != (B, H) or t.dtype != torch.int64:
            raise ValueError(f"{name}: {field} must be torch.int64 [B, Hkv] = {[B, H]}, got {t.dtype} {list(t.shape)}")
    R = None
    for field, (t, dtype) in fields.items():
        if R is None:
            R = t.shape[-1] if t.dim() == 3 else -1
        if tuple(t.shape) != (B, H, R) or t.dtype != dtype:
            raise ValueError(f"{name}: {field} must be {dtype} [B, Hkv, R] = {[B, H, R]}, got {t.dtype} "
                             f"{list(t.shape)}")
    for field, t in (("fill", fill), ("slot_fill", slot_fill), *((f, t) for f, (t, _) in fields.items())):
        if t.device != bias.device:
            raise ValueError(f"{name}: {field} is on {t.device}, bias on {bias.device}")
    return B, H, C, R


def check_due(name, due, B, H):
    if tuple(due.shape) != (B, H) or due.dtype != torch.bool:
        raise ValueError(f"{name}: due must be torch.bool [B, Hkv] = {[B, H]}, got {due.dtype} {list(due.shape)}")


def valid_entries(bias, fill):
    """[B, H, C] bool: entry < fill with bias > -inf."""
    return (torch.arange(bias.shape[-1], device=bias.device) < fill[..., None]) & (bias > NEG_INF)


def window_entries(valid, l_win):
    """[B, H, C] bool: the last l_win valid entries of each row."""
    from_end = valid.flip(-1).long().cumsum(-1).flip(-1)  # valid entries at index >= e
    return valid & (from_end <= l_win)


def live_slots(bias, fill, lut, slot_fill):
    """([B, H, R] bool live slots, [B, H, R] int64 entry index clamped to [0, C))."""
    R = lut.shape[-1]
    e = lut.long().clamp(0, bias.shape[-1] - 1)
    j = torch.arange(R, device=lut.device)
    live = (j < slot_fill[..., None]) & (lut >= 0) & (bias.gather(-1, e) > NEG_INF) & (lut.long() < fill[..., None])
    return live, e


def reference_ems_score(bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due, l_win, pool):
    B, H, R = lut.shape
    live, e = live_slots(bias, fill, lut, slot_fill)
    loc = s_loc_past + s_loc_cur
    den = torch.where(live, s_glo, 0).double().sum(-1, keepdim=True)
    num = torch.where(live, loc, 0).double().sum(-1, keepdim=True)
    alpha = torch.where(den == 0, 0.0, num / torch.where(den == 0, 1.0, den)).float()
    g = torch.where(live, torch.maximum(alpha * s_glo, loc), 0.0)
    window = window_entries(valid_entries(bias, fill), l_win).gather(-1, e)
    pooled_slot = live & ~window
    # P in token-position order: walk slot_order, pack the pooled slots by their rank
    k = torch.arange(R, device=lut.device)
    order = slot_order.long().clamp(0, R - 1)
    in_p = (k < slot_fill[..., None]) & (slot_order >= 0) & pooled_slot.gather(-1, order)
    rank = in_p.long().cumsum(-1) - 1
    dest = torch.where(in_p, rank, R)
    packed = torch.zeros(B, H, R + 1, device=lut.device).scatter(-1, dest, g.gather(-1, order))[..., :R]
    h = (pool - 1) // 2
    padded = torch.nn.functional.pad(packed, (h, h))
    acc = torch.zeros_like(packed)
    for o in range(pool):  # k = i - h .. i + h, in increasing k; the zero padding counts
        acc = acc + padded[..., o:o + R]
    # a 0-dim tensor divisor, not the int: torch's CUDA division by a Python scalar multiplies by its fp32 reciprocal
    # (1 ulp off in ~20% of the sums), its CPU division and the Triton kernel divide (IEEE): one rounding everywhere
    pooled = acc / torch.full((), float(pool), device=acc.device)
    # back to slots: P_i = order[k] for the k with rank i
    g_pooled = torch.full((B, H, R + 1), NEG_INF, device=lut.device)
    g_pooled = g_pooled.scatter(-1, torch.where(in_p, order, R), pooled.gather(-1, rank.clamp(0, R - 1)))[..., :R]
    d = due[..., None]
    return torch.where(d, g, 0.0), torch.where(d & pooled_slot, g_pooled, NEG_INF)


def _check_inputs(bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due, l_win, pool):
    B, H, _, _ = check_slot_table(NAME, bias, fill, slot_fill, lut=(lut, torch.int32),
                                  slot_order=(slot_order, torch.int32), s_glo=(s_glo, torch.float32),
                                  s_loc_past=(s_loc_past, torch.float32), s_loc_cur=(s_loc_cur, torch.float32))
    check_due(NAME, due, B, H)
    if l_win < 1:
        raise ValueError(f"{NAME}: l_win must be an int >= 1, got {l_win}")
    if pool < 1 or pool % 2 == 0:
        raise ValueError(f"{NAME}: pool must be an odd int >= 1 (1: no pooling), got {pool}")


@torch.library.custom_op(NAME, mutates_args=())
def ems_score(bias: torch.Tensor, fill: torch.Tensor, lut: torch.Tensor, slot_order: torch.Tensor,
              s_glo: torch.Tensor, s_loc_past: torch.Tensor, s_loc_cur: torch.Tensor, slot_fill: torch.Tensor,
              due: torch.Tensor, *, l_win: int, pool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, g_pooled) of every slot of the due rows (module docstring). CPU runs the reference, CUDA the Triton
    kernels."""
    args = (bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due, l_win, pool)
    _check_inputs(*args)
    return reference_ems_score(*args)


# -- the CUDA path -----------------------------------------------------------------------------------
KERNELS_CHECKED_ON_GPU = True  # tests/kernels/test_ems_score_gpu.py: 17 passed on an H100


def _cuda_impl(*tensors):
    """The Triton launcher when its GPU tests have passed, Triton imports and the inputs are contiguous, else None
    (the CUDA kernel then runs the reference, logged once). THE one place that decides the CUDA path."""
    if not KERNELS_CHECKED_ON_GPU:
        return None
    try:
        import triton  # noqa: F401
        mod = importlib.import_module("kvrewrite.kernels._ems_rank_kernels")
    except ImportError:
        return None
    return mod.triton_ems_score if all(t.is_contiguous() for t in tensors) else None


@ems_score.register_kernel("cuda")
def _(bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due, *, l_win, pool):
    args = (bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due, l_win, pool)
    _check_inputs(*args)
    launcher = _cuda_impl(*args[:9])
    if launcher is not None:
        return launcher(*args)
    reference_fallback("ems_score: CUDA runs the tensor reference (the Triton kernels need Triton, contiguous "
                       "inputs, and their GPU tests passed: KERNELS_CHECKED_ON_GPU=%s)", KERNELS_CHECKED_ON_GPU)
    return reference_ems_score(*args)


@ems_score.register_fake
def _(bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due, *, l_win, pool):
    return torch.empty_like(s_glo), torch.empty_like(s_glo)
