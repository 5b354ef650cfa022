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

Backends: one path on every device: the two pure references (expanded_attention, expanded_attention_stats) and the
fold above, in plain tensor code (the T > 1 / T = 1 branch is on a static shape; the rotation is a torch.where on
the device, no host read). There is NO Triton kernel yet, in particular not the fused decode fold of spec §6.4: CUDA
runs this same reference until those kernels land and pass their GPU tests. So far it has run on CPU only
(tests/kernels). The op is an opaque `torch.library.custom_op`.
"""
import torch

from kvrewrite.kernels.expanded_attention import check_expanded_inputs, reference_expanded_attention
from kvrewrite.kernels.expanded_attention_stats import reference_expanded_attention_stats

NAME = "kvrewrite::ems_attention"


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


@ems_attention.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past, s_loc_cur,
      slot_fill, win_count, *, scale, past_only, softcap, l_win):
    _check_inputs(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, s_glo, s_loc_past,
                  s_loc_cur, slot_fill, win_count, softcap, l_win)
    return q.new_empty(q.shape)  # contiguous, like the real output
