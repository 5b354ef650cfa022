"""kvrewrite::accumulate_attention — fold the attention a step's queries pay each slot into a per-slot score.

The statistics of score-based eviction (H2O, SnapKV), kept as method state (Method.state_fields) and
updated right after the layer's attention (Method.observe_call). With the probabilities of
kvrewrite::attention_column_stats (same visibility, degree bias and GQA grouping as
kvrewrite::clustered_attention)

    p[hq, t, j] = softmax_j(scale * q[hq, t]·k_j + b_j)   over the slots j visible to query t

and G = Hq / Hkv query heads per KV head h (hq = h * G + g):

    mode "all"    (H2O):    score[h, j] += sum_g sum_t p[hq, t, j]          every query of the step
    mode "window" (SnapKV): T > 1 (a prefill chunk): score[h, j]  = mean_g sum_{t >= T - last} p[hq, t, j]
                            T = 1 (a decode step):   score[h, j] += mean_g p[hq, 0, j]

so H2O's score is the attention a slot has received from every query since it arrived (summed over the
group), and SnapKV's is the attention from the last `last` queries of the newest prefill chunk plus every
decode query since (averaged over the group); the method resets it when it compresses (evict_by_score's
reset_score). Empty, padding and invisible slots receive 0, so a slot past the fill keeps the 0 the
compression op or the reset left there; a query that sees no slot (padding) adds nothing.

Args:
    q: [B, Hq, T, D]; keys: [B, Hkv, C, D]; bias, slot_pos: [B, Hkv, C]; cache_position: [T]
    score: [B, Hkv, C] fp32 (mutated)
    scale: the attention's softmax scale; window: its sliding window (0: none)
    stats_mode: "all" or "window"; last: the observation window in queries (mode "window"; >= 1). (Not named
        "mode": a mutating custom op's argument of that name collides with torch's fake-tensor dispatch of
        auto_functionalized, which rw.compile's opaque ops go through.)
Returns: nothing; `score` is updated in place.

Backends: CUDA runs attention_column_stats' Triton kernels (triton_attention_column_stats, fp16/bf16/
fp32, D <= 256) and reduces their [B, Hq, C] column sums over the group; other devices (and CUDA outside
those limits or without Triton) run reference_attention_column_stats. No host sync on either path, so
CUDA graphs capture it; the op is a `torch.library.triton_op`, so Inductor sees the launches.
"""
import torch

from kvrewrite.kernels import attention_column_stats as acs
from kvrewrite.kernels._triton_op import check_attention_shapes, register_triton_op

MODES = ("all", "window")


def _check_inputs(q, keys, bias, slot_pos, cache_position, score, window, mode, last):
    name = "kvrewrite::accumulate_attention"
    B, _, _, _, Hkv, C = check_attention_shapes(name, q, keys, bias, slot_pos, cache_position)
    if tuple(score.shape) != (B, Hkv, C) or score.dtype != torch.float32:
        raise ValueError(f"{name}: score must be fp32 [B, Hkv, C] = {(B, Hkv, C)}, got {score.dtype} "
                         f"{tuple(score.shape)}")
    if mode not in MODES:
        raise ValueError(f"{name}: mode must be one of {MODES}, got {mode!r}")
    if mode == "window" and last < 1:
        raise ValueError(f"{name}: mode 'window' needs last >= 1 (the observation window), got {last}")
    if window < 0:
        raise ValueError(f"{name}: window must be >= 0 (0 = none), got {window}")


def _triton_ok(q, keys) -> bool:
    return (q.is_cuda and acs.triton is not None and q.dtype in acs._DTYPES and keys.dtype == q.dtype
            and q.shape[-1] <= acs.MAX_HEAD_DIM)


def column_sums(q, keys, bias, slot_pos, cache_position, scale, window, last, need_total=True):
    """(total, recent) [B, Hq, C] fp32 of attention_column_stats, by the backend of the device; need_total=False:
    (None, recent), from the last `last` queries' blocks only (attention_column_stats' module docstring)."""
    if _triton_ok(q, keys):
        return acs.triton_attention_column_stats(q, keys, bias, slot_pos, cache_position, None, scale, window, last,
                                                 need_total)
    return acs.reference_attention_column_stats(q, keys, bias, slot_pos, cache_position, None, scale, window, last,
                                                need_total)


def needs_total(mode: str, T: int) -> bool:
    """Whether fold_into_score reads `total`: all but a prefill chunk (T > 1) in mode "window", which sets the
    score from `recent` alone."""
    return not (mode == "window" and T > 1)


def reference_accumulate_attention(q, keys, bias, slot_pos, cache_position, score, scale, window, mode, last=0):
    """The op on any device (the CPU path): column sums, reduced over the group, added or set."""
    T = q.shape[2]
    total, recent = column_sums(q, keys, bias, slot_pos, cache_position, scale, window,
                                last if mode == "window" else 0, needs_total(mode, T))
    fold_into_score(score, total, recent, mode, T)


def fold_into_score(score, total, recent, mode, T):
    """The update of `score` [B, Hkv, C] from the per-query-head column sums `total` and `recent` [B, Hq, C]
    (module docstring): mode "all" adds total summed over the group; mode "window" sets recent averaged over
    it after a prefill chunk (T > 1), adds total averaged over it after a decode step."""
    B, Hkv, C = score.shape
    G = recent.shape[1] // Hkv
    if mode == "all":
        score.add_(total.view(B, Hkv, G, C).sum(dim=2))
    elif T > 1:
        score.copy_(recent.view(B, Hkv, G, C).mean(dim=2))
    else:
        score.add_(total.view(B, Hkv, G, C).mean(dim=2))


def accumulate_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    score: torch.Tensor,
    scale: float,
    window: int,
    stats_mode: str,
    last: int = 0,
) -> None:
    """Add (or, for a prefill chunk in mode "window", set) the step's attention column sums into `score`.

    The op's kernel, fake and what Inductor inlines (see _triton_op.py); shapes in the module docstring."""
    _check_inputs(q, keys, bias, slot_pos, cache_position, score, window, stats_mode, last)
    reference_accumulate_attention(q, keys, bias, slot_pos, cache_position, score, scale, window, stats_mode, last)


accumulate_attention = register_triton_op("kvrewrite::accumulate_attention", accumulate_attention, ("score",),
                                          acs.triton is not None)
