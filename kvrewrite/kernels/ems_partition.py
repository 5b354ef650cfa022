"""kvrewrite::ems_partition — EMS's evict / merge / keep partition of a row's entries (docs/contracts/ems.md §6.7).

Codes: 0 free (not valid, or row not due), 1 window, 2 centre, 3 to-be-merged (TBM), 4 evicted (level 1).

E is the valid entries (e < fill, bias > -inf) in index order (= head-position order), V = |E|, Bt = budget[0],
N_imp = max(Bt - l_win, 0), N_tbm = floor((gamma - 1) * Bt) (every remaining candidate for gamma = inf).
- V <= Bt: the last l_win of E are 1, the others 2 (everything is kept; only padding goes).
- V > Bt: the last l_win of E are 1 (the window). The other candidates are ranked by (g_pooled[entry_start[e]]
  descending, e ascending): an entry's rank is its head slot's pooled Global-Local score (decision 6). The first
  N_imp are 2, the next N_tbm are 3, the rest 4.

Inputs: bias [B, Hkv, C] fp32, fill [B, Hkv] int64, entry_start [B, Hkv, C] int32, g_pooled [B, Hkv, R] fp32
(kvrewrite::ems_score), due [B, Hkv] bool, budget [2] int64 (read on the device). Args: l_win (int >= 1),
gamma (float >= 1, inf allowed). Returns cls [B, Hkv, C] int32.

Backends. The reference below (static-shape tensor code: a stable sort ranks the candidates, no host reads,
deterministic) is the CPU path and the ground truth. CUDA runs the Triton kernel of kvrewrite/kernels/
_ems_rank_kernels.py (_cuda_impl decides: KERNELS_CHECKED_ON_GPU, Triton installed, contiguous inputs, R >= 1;
otherwise the reference, logged once): one program per row packs the candidates' order keys (evict_by_score's
`_order_key`), finds the N_imp-th and (N_imp + N_tbm)-th largest by evict_by_score's bisection (`_kth_largest`; past
MAX_ENTRIES = 32768 entries `_kth_largest_chunked`, over the keys read in chunks) and ranks ties at each threshold to
the earlier entry by a cumsum; no sort. The codes equal the reference's exactly: checked through Triton's interpreter (tests/kernels/test_ems_partition_triton.py) and
on an H100 80GB HBM3 with torch 2.11.0+cu130, Triton 3.6.0 (tests/kernels/test_ems_partition_gpu.py: 25 passed:
gamma 1/1.5/4/inf, budgets below and above the valid count, planted ties and -inf candidates, a CUDA graph
replayed). Llama-3.1-8B shape at budget 0.2 (C 6866, R 27464, Hkv 8, 6611 valid entries, Bt 6579, gamma 4), in a
CUDA graph: 49 us (B = 1) / 50 us (B = 8) against the reference's 188 / 272 us.
"""
import importlib
import math

import torch

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels.ems_score import check_due, valid_entries, window_entries

NAME = "kvrewrite::ems_partition"
NEG_INF = float("-inf")
WINDOW, CENTRE, TBM, EVICTED = 1, 2, 3, 4


def tbm_count(bt, gamma, C):
    """N_tbm = floor((gamma - 1) * Bt) as a device tensor (C, i.e. every candidate, for gamma = inf)."""
    if math.isinf(gamma):
        return torch.full_like(bt, C)
    return torch.floor((gamma - 1) * bt.double()).long()


def reference_ems_partition(bias, fill, entry_start, g_pooled, due, budget, l_win, gamma):
    B, H, C = bias.shape
    R = g_pooled.shape[-1]
    bt = budget[0]
    valid = valid_entries(bias, fill)
    window = window_entries(valid, l_win)
    cand = valid & ~window
    key = g_pooled.gather(-1, entry_start.long().clamp(0, max(R - 1, 0))) if R > 0 else torch.zeros_like(bias)
    key = torch.where(cand, key, NEG_INF)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # ties: the earlier entry
    cand_sorted = cand.gather(-1, order)
    place = torch.empty_like(order).scatter_(-1, order, cand_sorted.long().cumsum(-1) - 1)  # rank among candidates
    n_imp = (bt - l_win).clamp_min(0)
    n_tbm = tbm_count(bt, gamma, C)
    ranked = torch.where(place < n_imp, CENTRE, torch.where(place < n_imp + n_tbm, TBM, EVICTED))
    over = valid.sum(-1, keepdim=True) > bt
    cls = torch.where(window, WINDOW, torch.where(cand, torch.where(over, ranked, CENTRE), 0))
    return torch.where(due[..., None], cls, 0).to(torch.int32)


def _check_inputs(bias, fill, entry_start, g_pooled, due, budget, l_win, gamma):
    if bias.dim() != 3 or bias.dtype != torch.float32:
        raise ValueError(f"{NAME}: bias must be fp32 [B, Hkv, C], got {bias.dtype} {list(bias.shape)}")
    B, H, C = bias.shape
    expect = {"fill": (fill, (B, H), torch.int64), "entry_start": (entry_start, (B, H, C), torch.int32),
              "budget": (budget, (2,), torch.int64)}
    for field, (t, shape, dtype) in expect.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{NAME}: {field} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    if g_pooled.dim() != 3 or tuple(g_pooled.shape[:2]) != (B, H) or g_pooled.dtype != torch.float32:
        raise ValueError(f"{NAME}: g_pooled must be fp32 [B, Hkv, R] with [B, Hkv] = {[B, H]}, got "
                         f"{g_pooled.dtype} {list(g_pooled.shape)}")
    check_due(NAME, due, B, H)
    for field, t in (("fill", fill), ("entry_start", entry_start), ("g_pooled", g_pooled), ("due", due),
                     ("budget", budget)):
        if t.device != bias.device:
            raise ValueError(f"{NAME}: {field} is on {t.device}, bias on {bias.device}")
    if l_win < 1:
        raise ValueError(f"{NAME}: l_win must be an int >= 1, got {l_win}")
    if not gamma >= 1:
        raise ValueError(f"{NAME}: gamma must be a float >= 1 (math.inf allowed), got {gamma}")


@torch.library.custom_op(NAME, mutates_args=())
def ems_partition(bias: torch.Tensor, fill: torch.Tensor, entry_start: torch.Tensor, g_pooled: torch.Tensor,
                  due: torch.Tensor, budget: torch.Tensor, *, l_win: int, gamma: float) -> torch.Tensor:
    """cls [B, Hkv, C] int32 of every entry (module docstring). CPU runs the reference, CUDA the Triton kernel."""
    args = (bias, fill, entry_start, g_pooled, due, budget, l_win, gamma)
    _check_inputs(*args)
    return reference_ems_partition(*args)


# -- the CUDA path -----------------------------------------------------------------------------------
KERNELS_CHECKED_ON_GPU = True  # tests/kernels/test_ems_partition_gpu.py: 25 passed on an H100


def _cuda_impl(bias, fill, entry_start, g_pooled, due, budget):
    """The Triton launcher when its GPU tests have passed, Triton imports, the inputs are contiguous and R >= 1, else
    None (the CUDA kernel then runs the reference, logged once). THE one place that decides the CUDA path."""
    if not KERNELS_CHECKED_ON_GPU:
        return None
    try:
        import triton  # noqa: F401
        mod = importlib.import_module("kvrewrite.kernels._ems_rank_kernels")
    except ImportError:
        return None
    fits = g_pooled.shape[2] >= 1  # any C: past MAX_ENTRIES the kernel's bisections read the keys in chunks
    tensors = (bias, fill, entry_start, g_pooled, due, budget)
    return mod.triton_ems_partition if fits and all(t.is_contiguous() for t in tensors) else None


@ems_partition.register_kernel("cuda")
def _(bias, fill, entry_start, g_pooled, due, budget, *, l_win, gamma):
    args = (bias, fill, entry_start, g_pooled, due, budget, l_win, gamma)
    _check_inputs(*args)
    launcher = _cuda_impl(*args[:6])
    if launcher is not None:
        return launcher(*args)
    reference_fallback("ems_partition: CUDA runs the tensor reference (C=%d; the Triton kernel needs Triton, "
                       "contiguous inputs, R >= 1, and its GPU "
                       "tests passed: KERNELS_CHECKED_ON_GPU=%s)", bias.shape[2], KERNELS_CHECKED_ON_GPU)
    return reference_ems_partition(*args)


@ems_partition.register_fake
def _(bias, fill, entry_start, g_pooled, due, budget, *, l_win, gamma):
    return torch.empty_like(bias, dtype=torch.int32)
