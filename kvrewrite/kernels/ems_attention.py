"""kvrewrite::ems_attention — EMS's attention in the graph: expanded attention plus the Global-Local statistics.

The method's attention_call (contract docs/contracts/ems.md §6.4, issue 17). It returns expanded_attention's output and
folds the step's attention into the per-slot scores EMS ranks by (Eq. 2: a global score over every query, a local
one over the last L_win queries). With (out, lse) = kvrewrite::expanded_attention(...) and (tot, rec) =
kvrewrite::expanded_attention_stats(..., lse, last=l_win) summed over the G query heads of each KV head (one decision
per KV head, as H2O's statistics), per row:

    T > 1 (a prefill chunk): s_glo += tot;  s_loc_past := rec;  s_loc_cur := 0;  win_count := 0
    T = 1 (a decode step):   s_glo += tot;  s_loc_cur += tot;   win_count += 1;
                             if win_count == l_win: s_loc_past := s_loc_cur; s_loc_cur := 0; win_count := 0

So after a chunk the local window is the chunk's last l_win queries (the paper's initialisation after the prompt;
the method needs prefill_chunk >= l_win), and decode ranks by s_loc_past + s_loc_cur, a window of l_win to
2 l_win - 1 queries, the paper's two buffers. Slots that are free, padding or not visible receive 0, so slots past
slot_fill keep their reset 0 (the table's invariant). The soft cap, when the model has one, is part of the softmax
the statistics count (those of the capped attention the model runs).

Args:
    q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill: as
        kvrewrite::expanded_attention (shapes and dtypes there)
    s_glo, s_loc_past, s_loc_cur: [B, Hkv, R] fp32 (mutated);  win_count: [B, Hkv] int64 (mutated)
    scale, past_only, softcap: as kvrewrite::expanded_attention;  l_win: the local window L_win (>= 1)
Returns:
    out [B, Hq, T, D] in q's dtype, contiguous.

Backends. The CPU path (and the ground truth) is the two pure references plus fold_statistics above, in plain tensor
code (the T > 1 / T = 1 branch is on a static shape; the rotation is a torch.where on the device, no host read).

CUDA path (triton_ems_attention; used once KERNELS_CHECKED_ON_GPU says its GPU tests passed, else the reference,
logged once). Three steps, no [B, Hq, R] tensor, no host read, CUDA-graph capturable:
- `_expanded_forward(...)` = expanded_attention.py's `launch_expanded_forward(..., S=S)`, the Triton forward of
  §6.2 and its combine: (out, lse) and, for decode, S [B, Hq, C] fp32 (s_e = scale·q·keys[e], pre-cap); a large
  prefill chunk runs its slot-walking prefill kernel (expanded_attention.PREFILL_KERNEL).
  `_reference_forward` (the reference plus an einsum for S, same signature) is what the interpreter tests use.
- T > 1: the statistics kernel of _ems_fold_kernels.py in its FOLD variant recomputes the probabilities from lse
  and applies the prefill rule per KV head inside the kernel.
- T = 1: the decode fold kernel of _ems_fold_kernels.py reads S and lse and applies the decode rule; win_count is
  read by every program and advanced by a dedicated one-program-per-row-block pass after it (that module's
  docstring says why). So a decode step is: forward (+ its combine), fold, count.

Status of the CUDA path: the default (KERNELS_CHECKED_ON_GPU). On an H100 (torch 2.11, Triton 3.6), with the Triton
forward swapped in, tests/kernels/test_ems_attention_gpu.py (a prefill chunk with NaN-poisoned local buffers, then 70
decode steps with l_win = 32 replayed from a CUDA graph under set_sync_debug_mode("error"), fp32 and bf16, Hq/Hkv/D
32/8/128 and 4/1/64, state equal to the CPU reference to 5e-5, win_count exact, rotations at 32 and 64; the eager
step under the sync debug mode with a soft cap) and tests/methods/test_ems_gpu.py (the model, eager and
reduce-overhead, both key variants, against the CPU run) passed in one run (37 passed with the ClusterGen and
ems_compress GPU files). Through the interpreter: tests/kernels/test_ems_attention_triton.py (fp32).
Cost of the decode fold (fold + count launches, H100, Llama-3.1-8B shape at 32k: 27464 slots per row, 26316 live,
G = 4; 50 calls back to back in a CUDA graph, so warm L2 at B = 1): 4.5 us at B = 1 (of which the count pass
1.3 us), 17.8 us at B = 8; the reference statistics + fold it replaces took 172 us and 763 us there.
"""

import torch

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels.expanded_attention import (check_expanded_inputs, entry_scores, launch_expanded_forward,
                                                 reference_expanded_attention)
from kvrewrite.kernels.expanded_attention_stats import (check_cuda_inputs, fold_kernels,
                                                        reference_expanded_attention_stats)

NAME = "kvrewrite::ems_attention"
KERNELS_CHECKED_ON_GPU = True  # tests/kernels/test_ems_attention_gpu.py and tests/methods/test_ems_gpu.py passed on an H100


def _check_inputs(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past,
                  s_loc_cur, slot_fill, win_count, softcap, l_win):
    B, _, T, _, Hkv, _, R = check_expanded_inputs(NAME, q, keys, bias, slot_pos, cache_position, entry_start, lut,
                                                  key_scale, slot_fill, values, softcap)
    for field, t in (("s_glo", s_glo), ("s_loc_past", s_loc_past), ("s_loc_cur", s_loc_cur)):
        if tuple(t.shape) != (B, Hkv, R) or t.dtype != torch.float32 or t.device != q.device:
            raise ValueError(f"{NAME}: {field} must be torch.float32 [B, Hkv, R] = {[B, Hkv, R]} on {q.device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    if tuple(win_count.shape) != (B, Hkv) or win_count.dtype != torch.int64 or win_count.device != q.device:
        raise ValueError(f"{NAME}: win_count must be torch.int64 [B, Hkv] = {[B, Hkv]} on {q.device}, got "
                         f"{win_count.dtype} {list(win_count.shape)} on {win_count.device}")
    if T < 1:
        raise ValueError(f"{NAME}: q must hold at least one query (T >= 1), got q {list(q.shape)}")
    if l_win < 1:
        raise ValueError(f"{NAME}: l_win must be >= 1 (the local window in queries), got {l_win}")


def fold_statistics(s_glo, s_loc_past, s_loc_cur, win_count, total, recent, T, l_win):
    """The fold of the module docstring, in place, from per-query-head column sums total, recent [B, Hq, R]."""
    B, Hkv, R = s_glo.shape
    tot = total.view(B, Hkv, -1, R).sum(dim=2)
    s_glo.add_(tot)
    if T > 1:
        s_loc_past.copy_(recent.view(B, Hkv, -1, R).sum(dim=2))
        s_loc_cur.zero_()
        win_count.zero_()
        return
    s_loc_cur.add_(tot)
    win_count.add_(1)
    rotate = (win_count == l_win)[:, :, None]
    s_loc_past.copy_(torch.where(rotate, s_loc_cur, s_loc_past))
    s_loc_cur.masked_fill_(rotate, 0.0)
    win_count.masked_fill_(rotate[:, :, 0], 0)


def reference_ems_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo,
                            s_loc_past, s_loc_cur, slot_fill, win_count, scale, past_only, softcap, l_win):
    """The CPU path and the ground truth: the two pure references, then fold_statistics."""
    _check_inputs(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past,
                  s_loc_cur, slot_fill, win_count, softcap, l_win)
    slots = (entry_start, lut, key_scale, slot_fill)
    out, lse = reference_expanded_attention(q, keys, values, bias, slot_pos, cache_position, *slots, scale,
                                            past_only, softcap)
    # past_only was checked by the attention just above; the statistics' function is the same either way
    total, recent = reference_expanded_attention_stats(q, keys, bias, slot_pos, cache_position, *slots, lse, scale,
                                                       l_win, False, softcap)
    fold_statistics(s_glo, s_loc_past, s_loc_cur, win_count, total, recent, q.shape[2], l_win)
    return out.contiguous()


@torch.library.custom_op(NAME, mutates_args=("s_glo", "s_loc_past", "s_loc_cur", "win_count"))
def ems_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    entry_start: torch.Tensor,
    lut: torch.Tensor,
    key_scale: torch.Tensor,
    s_glo: torch.Tensor,
    s_loc_past: torch.Tensor,
    s_loc_cur: torch.Tensor,
    slot_fill: torch.Tensor,
    win_count: torch.Tensor,
    *,
    scale: float,
    past_only: bool,
    softcap: float,
    l_win: int,
) -> torch.Tensor:
    """Expanded attention plus the fold of its statistics (module docstring); every device runs the reference."""
    return reference_ems_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo,
                                   s_loc_past, s_loc_cur, slot_fill, win_count, scale, past_only, softcap, l_win)


def _reference_forward(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill, scale,
                       past_only, softcap, S=None):
    """(out, lse) of expanded_attention with, when S (fp32 [B, Hq, C]) is given, the per-entry scores written into
    it: the signature of expanded_attention.py's launch_expanded_forward (the Triton forward), which replaces it."""
    out, lse = reference_expanded_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut,
                                            key_scale, slot_fill, scale, past_only, softcap)
    if S is not None:
        S.copy_(entry_scores(q, keys, scale).view(S.shape))
    return out, lse


_expanded_forward = launch_expanded_forward  # the Triton forward + combine (expanded_attention.py)


def _check_fold_state(name, s_glo, s_loc_past, s_loc_cur, win_count):
    for field, t in (("s_glo", s_glo), ("s_loc_past", s_loc_past), ("s_loc_cur", s_loc_cur),
                     ("win_count", win_count)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: {field} must be contiguous (the kernels update it in place)")


def triton_ems_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo,
                         s_loc_past, s_loc_cur, slot_fill, win_count, scale, past_only, softcap, l_win, **tuning):
    """The op's CUDA path (module docstring, Backends); validates its inputs. `tuning` (block_j, block_m) is for the
    tests' small tiles."""
    _check_inputs(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past,
                  s_loc_cur, slot_fill, win_count, softcap, l_win)
    mod, lut_k, ks_k = check_cuda_inputs("triton_ems_attention", q, keys, lut, key_scale)
    _check_fold_state("triton_ems_attention", s_glo, s_loc_past, s_loc_cur, win_count)
    B, Hq, T, _ = q.shape
    S = None if T > 1 else torch.empty((B, Hq, keys.shape[2]), dtype=torch.float32, device=q.device)
    out, lse = _expanded_forward(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale,
                                 slot_fill, scale, past_only, softcap, S=S)
    if T > 1:
        mod.launch_prefill_fold(q, keys, bias, slot_pos, cache_position, lut_k, ks_k, slot_fill, lse, s_glo,
                                s_loc_past, s_loc_cur, win_count, scale, l_win, softcap, **tuning)
    else:
        mod.launch_decode_fold(S, lse, bias, slot_pos, cache_position, lut_k, ks_k, slot_fill, s_glo, s_loc_past,
                               s_loc_cur, win_count, l_win, softcap, past_only, block_j=tuning.get("block_j"))
    return out.contiguous()


@ems_attention.register_kernel("cuda")
def _(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past, s_loc_cur,
      slot_fill, win_count, *, scale, past_only, softcap, l_win):
    args = (q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past,
            s_loc_cur, slot_fill, win_count, scale, past_only, softcap, l_win)
    if KERNELS_CHECKED_ON_GPU and fold_kernels() is not None:
        return triton_ems_attention(*args)
    reference_fallback("ems_attention: CUDA runs the tensor reference (KERNELS_CHECKED_ON_GPU=%s, Triton %s)",
                       KERNELS_CHECKED_ON_GPU, "found" if fold_kernels() is not None else "missing")
    return reference_ems_attention(*args)


@ems_attention.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past, s_loc_cur,
      slot_fill, win_count, *, scale, past_only, softcap, l_win):
    _check_inputs(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past,
                  s_loc_cur, slot_fill, win_count, softcap, l_win)
    return q.new_empty(q.shape)  # contiguous, like the real output
