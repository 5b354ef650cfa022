"""kvrewrite::expanded_attention_stats — the attention each EMS runtime slot receives; column sums, never T x T.

The statistics of EMS's Global-Local score (contract docs/contracts/ems.md §6.3, issue 17). With the slot logits
z_tj of kvrewrite::expanded_attention (same visibility, key scales, soft cap and GQA grouping) and that op's lse:

    p_tj      = exp(z_tj - lse_t)                                  (query t's softmax probability of slot j)
    total_j   = sum_t p_tj                                         (every query: s_glo's increment)
    recent_j  = sum_{t >= T - min(last, T)} p_tj                   (the last `last` queries: s_loc after a chunk)

per query head (kvrewrite::ems_attention sums the G heads of a KV head). A slot that is not live or not visible gets
0; a query with lse = -inf (it saw nothing) adds 0. Given lse, one pass over the slots suffices; the reference
walks the queries in blocks of 128, so at most [B, Hq, 128, R] probabilities exist at a time.

Args:
    q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill: as kvrewrite::expanded_attention
    lse:       [B, Hq, T] fp32, natural log (expanded_attention's second output)
    scale:     the model's softmax scale;  last: queries summed into `recent` (>= 0, clamped to T)
    past_only: the promise of expanded_attention, checked here too (off CUDA, as there)
    softcap:   the model's cap, 0 for none
Returns:
    (total, recent), each [B, Hq, R] fp32. Mutates nothing.

Backends. The reference below (tensor code, fp32) is the CPU path and the ground truth. CUDA runs the Triton kernel
of kvrewrite/kernels/_ems_fold_kernels.py (`_stats_kernel`: one program per (row, block of slots) walking the query
blocks, recomputing s for its slots' entries, no atomics; fp16/bf16/fp32, D <= 256), gated by KERNELS_CHECKED_ON_GPU
(else this same reference, logged once). On CUDA the past_only promise is not checked (a host read; as
expanded_attention). The op is an opaque `torch.library.custom_op`. Checked: through Triton's interpreter against
this reference and the float64 naive model (tests/kernels/test_expanded_attention_stats_triton.py, fp32), and
compiled on an H100 (torch 2.11, Triton 3.6) against this reference on the GPU and the float64 naive model
(tests/kernels/test_expanded_attention_stats_gpu.py: 20 passed; fp16/bf16/fp32, D 64/128/256, G 1/4 and MQA,
`last` > T, the soft cap, a row that sees nothing). Cost (H100, Llama-3.1-8B shape at 32k, 27464 slots per row,
bf16): a 256-query chunk's statistics folded per KV head (ems_attention's prefill) take 0.67 ms per layer at B = 1,
4.8 ms at B = 8; the kernel recomputes one dot per (query, slot), i.e. γ x the per-entry products once entries
are merged (an in-tile per-entry dot with a gather by lut is the known next step).
"""
import importlib

import torch

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels.expanded_attention import (BLOCK_T, check_expanded_inputs, check_promise, entry_scores,
                                                  slot_logits)

NAME = "kvrewrite::expanded_attention_stats"
# tests/kernels/test_expanded_attention_stats_gpu.py: 20 passed on an H100 (torch 2.11, Triton 3.6)
KERNELS_CHECKED_ON_GPU = True


def _check_inputs(q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill, lse, last,
                  softcap):
    B, Hq, T, _, _, _, R = check_expanded_inputs(NAME, q, keys, bias, slot_pos, cache_position, entry_start, lut,
                                                 key_scale, slot_fill, softcap=softcap)
    if tuple(lse.shape) != (B, Hq, T) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"{NAME}: lse must be torch.float32 [B, Hq, T] = {[B, Hq, T]} on {q.device}, got "
                         f"{lse.dtype} {list(lse.shape)} on {lse.device}")
    if last < 0:
        raise ValueError(f"{NAME}: last must be >= 0 (the recent queries summed into `recent`), got {last}")
    return B, Hq, T, R


def reference_expanded_attention_stats(q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale,
                                       slot_fill, lse, scale, last, past_only=False, softcap=0.0):
    """The CPU path and the ground truth (module docstring); fp32 throughout."""
    B, Hq, T, R = _check_inputs(q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill,
                                lse, last, softcap)
    if past_only:
        check_promise(bias, slot_pos, cache_position, NAME)
    Hkv = keys.shape[1]
    G = Hq // Hkv
    total = torch.zeros(B, Hkv, G, R, dtype=torch.float32, device=q.device)
    recent = torch.zeros_like(total)
    first_recent = T - min(last, T)
    for t0 in range(0, T, BLOCK_T):
        t1 = min(t0 + BLOCK_T, T)
        z = slot_logits(entry_scores(q[:, :, t0:t1], keys, scale), bias, slot_pos, cache_position[t0:t1], lut,
                        key_scale, slot_fill, softcap)  # [B, Hkv, G, t, R]
        block_lse = lse[:, :, t0:t1].reshape(B, Hkv, G, t1 - t0, 1)
        p = torch.exp(z - block_lse).nan_to_num(nan=0.0)  # a query that saw nothing: -inf - -inf
        total += p.sum(dim=3)
        if t1 > first_recent:
            recent += p[:, :, :, max(first_recent - t0, 0):].sum(dim=3)
    return total.reshape(B, Hq, R), recent.reshape(B, Hq, R)


@torch.library.custom_op(NAME, mutates_args=())
def expanded_attention_stats(
    q: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    entry_start: torch.Tensor,
    lut: torch.Tensor,
    key_scale: torch.Tensor,
    slot_fill: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    last: int,
    past_only: bool = False,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column sums of the slot probabilities (module docstring); every device runs the reference."""
    return reference_expanded_attention_stats(q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale,
                                              slot_fill, lse, scale, last, past_only, softcap)


def fold_kernels():
    """kvrewrite.kernels._ems_fold_kernels when Triton imports, else None (THE import point of the CUDA path, shared
    with ems_attention)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return importlib.import_module("kvrewrite.kernels._ems_fold_kernels")


def check_cuda_inputs(name, q, keys, lut, key_scale):
    """TypeError/ValueError naming what the Triton kernels cannot take (the op's checks ran first)."""
    mod = fold_kernels()
    if mod is None:
        raise NotImplementedError(f"{name}: the Triton kernels need Triton (pip install triton)")
    if q.dtype not in mod.DTYPES or keys.dtype != q.dtype:
        raise TypeError(f"{name}: q and keys must share one dtype of fp16/bf16/fp32, got {q.dtype}, {keys.dtype}")
    if q.shape[-1] > mod.MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim D must be <= {mod.MAX_HEAD_DIM}, got D={q.shape[-1]}")
    if lut.stride() != key_scale.stride():  # the kernels index both with lut's strides
        lut, key_scale = lut.contiguous(), key_scale.contiguous()
    return mod, lut, key_scale


def triton_expanded_attention_stats(q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill,
                                    lse, scale, last, past_only=False, softcap=0.0, **tuning):
    """The op through the Triton kernel (module docstring); validates its inputs. `tuning` (block_j, block_m) is for
    the tests' small tiles. past_only is not checked (a host read); the causal test is applied regardless."""
    _check_inputs(q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill, lse, last, softcap)
    mod, lut, key_scale = check_cuda_inputs("triton_expanded_attention_stats", q, keys, lut, key_scale)
    return mod.launch_stats(q, keys, bias, slot_pos, cache_position, lut, key_scale, slot_fill, lse, scale, last,
                            softcap, **tuning)


@expanded_attention_stats.register_kernel("cuda")
def _(q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill, lse, scale, last,
      past_only=False, softcap=0.0):
    args = (q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill, lse, scale, last,
            past_only, softcap)
    if KERNELS_CHECKED_ON_GPU and fold_kernels() is not None:
        return triton_expanded_attention_stats(*args)
    reference_fallback("expanded_attention_stats: CUDA runs the tensor reference (KERNELS_CHECKED_ON_GPU=%s, Triton "
                       "%s)", KERNELS_CHECKED_ON_GPU, "found" if fold_kernels() is not None else "missing")
    return reference_expanded_attention_stats(*args)


@expanded_attention_stats.register_fake
def _(q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill, lse, scale, last,
      past_only=False, softcap=0.0):
    B, Hq, _, R = _check_inputs(q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill, lse,
                                last, softcap)
    return (q.new_empty((B, Hq, R), dtype=torch.float32), q.new_empty((B, Hq, R), dtype=torch.float32))
