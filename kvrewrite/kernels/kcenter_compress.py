"""kvrewrite::kcenter_compress — clustergen-kcenter's compression: the last ℓ tokens exact plus k greedy k-center
centres among the older ones (SubGen's experiments, arXiv 2402.06082; contract docs/contracts/clustergen.md §1.13,
§3.3).

For every row (b, kv-head) whose fill reached the threshold (budget = [B, threshold]; other rows untouched, bit for
bit), with E its valid slots (slot < fill, bias > -inf; padding is dropped) in slot order (= position order), V = |E|:

1. V <= B: every valid slot is kept.
2. Else the last ℓ = floor(recent_ratio·B) of E are kept, and k = B - ℓ of the other V - ℓ by greedy k-center on
   their keys (kvrewrite/kernels/kcenter.py: start at the oldest candidate, the attention sink; then the candidate
   farthest from the chosen ones, ties to the lowest index; Euclidean in fp32 on the stored, post-RoPE keys).
3. The kept slots are packed to the front in slot order (keys, values, slot_pos), bias 0 (no counts at attention
   time: the paper keeps "the KV pairs of the k centres" unweighted), fill = their count = min(V, B); the freed
   slots [fill, C) get bias -inf, their keys, values and slot_pos stay as they are (as kvrewrite::evict_to_budget).

State (mutated): keys, values [B, Hkv, C, D]; bias fp32, slot_pos int64 [B, Hkv, C]; fill [B, Hkv] int64. budget:
[2] int64, read on the device (one captured graph serves every B).

Backends. The reference below is the CPU path and the ground truth: static-shape tensor code (a loop over a static
number of k-center steps, every row at once; no host read, so CUDA graphs capture it; deterministic). The step count
is the largest k any B <= C can ask for, k(C) = C - floor(recent_ratio·C) (k(B) grows with B; B > C never
compresses): O(k(C)·B·Hkv·C·D) work per call. On the CPU (nothing to capture) the loop stops at the most centres a
due row needs (a host read; the skipped steps are no-ops, so the result is the same).

CUDA path (_cuda_impl decides, in one place): the Triton kernels of kvrewrite/kernels/_kcenter_kernels.py once
KERNELS_CHECKED_ON_GPU, else this reference (logged once). The kernels do work bounded by the data (k steps over the
row's n candidates, split over up to 16 programs per row that exchange their best points through L2, several greedy
steps per exchange); they are checked through Triton's interpreter against this reference and the naive float64
greedy (tests/kernels/test_kcenter_compress_triton.py) and on an H100 (torch 2.11, Triton 3.6;
tests/kernels/test_kcenter_compress_gpu.py, integer keys bit for bit against this reference: 44 passed on the
merged tree, every knob set: bf16/fp16/fp32, D 64/128, batch 1/3, padding, holes, rows not due, 1-16 programs per
row, 8 or 16 warps, recent_ratio 0 / 0.3 / 1, Gaussian keys, CUDA graph replay at new budgets, no host sync, the
op's CUDA path), and with the kernels as the CUDA path tests/methods/test_clustergen_gpu.py passed too (both
ClusterGen methods on every family, CUDA = CPU, CUDA graphs = eager; 19 passed with the GPU smoke tests). Hence
KERNELS_CHECKED_ON_GPU. The exchange spins on L2 words, so every program of a row must be resident at once: the
launch keeps programs x rows in flight <= the SM count.

Cost (H100, Llama-3.1-8B layer: 8 KV heads, D 128, bf16, 32k context, budget 0.2 = 6554 slots, C 8665; python -m
kvrewrite.bench.kcenter_compress, docs/bench/kcenter_compress_h100_run3.json): the decode-time re-selection (6618 ->
6554: 3277 centres among 3341 candidates) 6.7 ms per call at B = 1 (the reference: 1.43 s), after a prefill chunk of
2048 (3277 among 5325) 10.7 ms (reference 2.05 s); ~64 exchange rounds per row (~51 greedy steps each). The greedy's
3277 sequential steps cost ~2 us each (the select launch spills: 64 registers, 3.8 KB of stack per thread at 16
warps). Every row of every layer is due in the same decode step once per interval: 32 x 6.7 ms / 64 = 3.4 ms per step
amortised, 55% of a plain 32k step (~6.1 ms): the decode rule cannot meet 1.15x of the floor with this kernel; even
the arithmetic alone (3277 x 3341 x 128 fp32 differences and squares per row, one SM per 1/16 of a row) is ~0.7 ms
per layer, ~6% of the step amortised.
"""
import importlib
import math

import torch

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels._slot_kernels import _check_state
from kvrewrite.kernels.kcenter import greedy_kcenter

NAME = "kvrewrite::kcenter_compress"
NEG_INF = float("-inf")


def _check_inputs(keys, values, bias, slot_pos, fill, budget, recent_ratio):
    _check_state(NAME, keys, values, bias, slot_pos, fill, budget)
    if budget.device != keys.device:
        raise ValueError(f"{NAME}: budget is on {budget.device}, keys on {keys.device}")
    if not 0 <= recent_ratio <= 1:
        raise ValueError(f"{NAME}: recent_ratio must be in [0, 1] (the exact recent share of the budget), "
                         f"got {recent_ratio}")


def n_recent(B, recent_ratio):
    """ℓ = floor(recent_ratio·B) in float64 (Python's arithmetic), for an int or an int64 tensor B."""
    if isinstance(B, torch.Tensor):
        return torch.floor(B.double() * recent_ratio).long()
    return math.floor(B * recent_ratio)


def kept_slots(keys, bias, fill, budget, recent_ratio):
    """(kept [R, C] bool, due [R] bool) over the rows r = b * Hkv + h: the slots each due row keeps (module docstring
    steps 1-2; a row not due keeps nothing here, the caller leaves it as it is)."""
    B, H, C, D = keys.shape
    R = B * H
    ar = torch.arange(C, device=keys.device)
    fill_f = fill.reshape(R)
    valid = (ar < fill_f[:, None]) & (bias.reshape(R, C) > NEG_INF)
    due = fill_f >= budget[1]
    target = budget[0]
    ell = n_recent(target, recent_ratio)
    V = valid.sum(-1)
    rank = valid.cumsum(-1) - 1  # the slot's rank among its row's valid slots
    over = due & (V > target)
    recent = valid & (rank >= (V - ell)[:, None])
    candidates = valid & ~recent & over[:, None]
    steps = C - n_recent(C, recent_ratio)  # k(C) >= k(B) for every B <= C (module docstring)
    k = (target - ell).expand(R).contiguous()
    if keys.device.type == "cpu":  # no graph to capture: stop at the most centres a due row needs (no-op steps)
        steps = min(steps, int(torch.where(over, k, 0).max()))
    order, _ = greedy_kcenter(keys.reshape(R, C, D), candidates, k, k_max=steps)
    chosen = torch.zeros(R, C + 1, dtype=torch.bool, device=keys.device)
    chosen.scatter_(1, torch.where(order >= 0, order, C), True)  # -1 (no centre) lands in the spare column C
    kept = torch.where(over[:, None], recent | chosen[:, :C], valid) & due[:, None]
    return kept, due


def reference_kcenter_compress(keys, values, bias, slot_pos, fill, budget, recent_ratio):
    """The op (module docstring) in tensor code: kept_slots, then one stable sort packs the kept slots to the front
    in slot order."""
    B, H, C, D = keys.shape
    R = B * H
    kept, due = kept_slots(keys, bias, fill, budget, recent_ratio)
    n_kept = kept.sum(-1)
    take = torch.sort((~kept).to(torch.int8), dim=-1, stable=True).indices  # kept slots first, in slot order
    ar = torch.arange(C, device=keys.device)
    packed = due[:, None] & (ar < n_kept[:, None])  # destination slots that receive a kept slot
    k_f, v_f = keys.reshape(R, C, D), values.reshape(R, C, D)
    pos_f, bias_f = slot_pos.reshape(R, C), bias.reshape(R, C)
    tk = take[:, :, None].expand(R, C, D)
    keys.copy_(torch.where(packed[:, :, None], k_f.gather(1, tk), k_f).view(B, H, C, D))
    values.copy_(torch.where(packed[:, :, None], v_f.gather(1, tk), v_f).view(B, H, C, D))
    slot_pos.copy_(torch.where(packed, pos_f.gather(1, take), pos_f).view(B, H, C))
    new_bias = torch.where(packed, 0.0, NEG_INF)
    bias.copy_(torch.where(due[:, None], new_bias, bias_f).view(B, H, C))
    fill.copy_(torch.where(due, n_kept, fill.reshape(R)).view(B, H))


# -- the CUDA path -----------------------------------------------------------------------------------
KERNELS_CHECKED_ON_GPU = True  # tests/kernels/test_kcenter_compress_gpu.py: 44 passed on an H100 (torch 2.11, Triton 3.6)


def _cuda_impl(C: int):
    """The Triton launcher when the kernels were checked on a GPU, Triton imports and C fits them, else None (CUDA
    then runs the reference, logged once). THE one place that decides the CUDA path (module docstring)."""
    if not KERNELS_CHECKED_ON_GPU:
        return None
    try:
        import triton  # noqa: F401
        mod = importlib.import_module("kvrewrite.kernels._kcenter_kernels")
    except ImportError:
        return None
    return mod.triton_kcenter_compress if C <= mod.MAX_SLOTS else None


# -- op registration ---------------------------------------------------------------------------------
@torch.library.custom_op(NAME, mutates_args=("keys", "values", "bias", "slot_pos", "fill"))
def kcenter_compress(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    budget: torch.Tensor,
    *,
    recent_ratio: float = 0.5,
) -> None:
    """Keep the last ℓ tokens and k greedy k-center centres of the rows at the threshold (module docstring)."""
    _check_inputs(keys, values, bias, slot_pos, fill, budget, recent_ratio)
    reference_kcenter_compress(keys, values, bias, slot_pos, fill, budget, recent_ratio)


@kcenter_compress.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, *, recent_ratio=0.5):
    _check_inputs(keys, values, bias, slot_pos, fill, budget, recent_ratio)
    launcher = _cuda_impl(keys.shape[2])
    if launcher is not None:
        launcher(keys, values, bias, slot_pos, fill, budget, recent_ratio=recent_ratio)
        return
    reference_fallback("kcenter_compress: CUDA runs the tensor reference (%d slots; a static loop of k(C) steps): "
                       "the Triton kernels of kvrewrite.kernels._kcenter_kernels take up to MAX_SLOTS slots and are "
                       "used once their GPU tests have passed (KERNELS_CHECKED_ON_GPU=%s)", keys.shape[2],
                       KERNELS_CHECKED_ON_GPU)
    reference_kcenter_compress(keys, values, bias, slot_pos, fill, budget, recent_ratio)


@kcenter_compress.register_fake
def _(keys, values, bias, slot_pos, fill, budget, *, recent_ratio=0.5):
    _check_inputs(keys, values, bias, slot_pos, fill, budget, recent_ratio)
    return None
