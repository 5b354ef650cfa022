"""kvrewrite::observed_attention — clustered_attention and accumulate_attention in one op, one pass over the keys,
with the statistics of decode steps' queries deferred to a later step (the pending queries).

    out = clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only)

and the statistics of accumulate_attention(q, keys, bias, slot_pos, cache_position, score, scale, window, mode,
last), with one difference of timing. Up to P = pending_entries(G) decode queries wait in `pending_q` (with
their log-sum-exps in `pending_lse`; P = 3 for G = 4), entry e holding the query of k_e steps before the current
one (pending_steps_ago). Folding an entry adds to `score` its softmax over the slots it saw, which are this step's
slots up to position c - k_e (c = cache_position[0]; nothing else changes between decode steps), summed (mode
"all") or averaged (mode "window") over the G query heads of a KV head: exactly what accumulate_attention added
for it. A step:
  - defer=True (the decode graph that does not compress; T must be 1): at c mod P == 0 it first folds every
    entry and empties them; then its own q and lse become entry c mod P, their statistics wait;
  - defer=False (prefill chunks, and the decode step that compresses): it folds every entry, then its own
    statistics, as accumulate_attention folds them; nothing stays pending (pending_lse = +inf).
So whenever a compression reads `score`, it is exactly accumulate_attention's (the pass defers only in graphs
without compression ops), and between steps score + fold_pending's fold is. The pass fuse_attention_observation
puts the op where a method's statistics op follows its attention (H2O, SnapKV).

Why: the statistics need every query's probability of every slot, p = exp(z - lse), and lse is known only
once the attention has seen every slot: computed apart they are a second pass over the keys (and a third
for lse): on the H100 that cost h2o 8 ms of a 14.5 ms decode step (docs/bench/e2e_h100_h2o_second_pass.json).
An earlier query's lse IS known, so its G heads ride in the attention tile's free rows (a decode tile has
16 rows for G = 4 heads, tl.dot's minimum: room for P = 3 earlier queries): the same q·k products, plus a read
and write of the score per slot (8 bytes next to the 4 * D bytes of keys and values) at one step in P, and no
extra kernel. The decode step that
compresses keeps the earlier scheme (the attention kernel stores the scores, one kernel combines the output
and folds them: docs/methods.md), and a prefill chunk (compute-bound) runs attention_column_stats' single
pass with the attention's lse. docs/methods.md has the measurements.

Args: those of clustered_attention (softcap excluded: observing methods are refused on soft-capped layers),
score [B, Hkv, C] fp32 (mutated), pending_q fp32 [B, Hkv, P, G, D] and pending_lse fp32 [B, Hkv, P, G] (mutated;
the pending queries and their natural-log lse; lse +inf: empty, -inf: it saw no slot, both add 0), fill
[B, Hkv] (the layer's), mode "all" or "window", last (accumulate_attention's), past_only, defer.
The entries' positions follow from c alone because decode steps advance cache_position by one and append one
slot per row (cache_append writes a slot for every row, valid or not). With past_only and window 0 the CUDA kernel
does not read slot_pos, so it takes the slots an entry of k steps ago saw as those before fill - k (this step's
token is the one cache_append just wrote at fill - 1): the op's promise, which the CPU path checks (ValueError
when broken).
Returns: the attention output [B, Hq, T, D] in q's dtype, contiguous.

Backends: CUDA with Triton runs the fused kernels (the dtypes and head dims of clustered_attention's); other
devices run the same steps with the two ops and the reference fold (the CPU path). A
`torch.library.triton_op` (Inductor sees the launches), no host sync: CUDA graphs capture it.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite.kernels import accumulate_attention as aa
from kvrewrite.kernels import attention_column_stats as acs
from kvrewrite.kernels import clustered_attention as ca
from kvrewrite.kernels._triton_op import register_triton_op, triton_jit
from kvrewrite.kernels.clustered_attention import combine_row

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the two ops it fuses
    triton = tl = None


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA), decode: the combine + fold kernel. Program (b * Hkv + h, c) owns the G output rows of
# KV head h (row = (b * Hkv + h) * G + g when T = 1) and slots [c * slots_per_prog, ...) of its score.
# Every program recomputes the G rows' log-sum-exp from the split partials (S floats per row); program c
# also merges the partials into output rows c, c + c_progs, ... of its group (in parallel, not one
# program walking G rows: that serial tail cost ~3 us per layer on the H100).
# ---------------------------------------------------------------------------------------------------


@triton_jit(do_not_specialize=["G", "C", "NUM_SPLITS", "slots_per_prog"])
def _observe_combine_kernel(
    ACC, M_PART, L_PART, OUT,  # split partials of the attention kernel (always written here), OUT [B * Hq, D]
    LOGITS,  # fp32 [B * Hq, C], the attention kernel's masked log2-domain scores
    SCORE,  # fp32 [B, Hkv, C], mutated: += group_scale * sum_g p
    stride_sb, stride_sh, stride_sc,
    Hkv, G, C, NUM_SPLITS, slots_per_prog, group_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    LOG2E: tl.constexpr = 1.4426950408889634
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    for g in range(pid_c, G, tl.num_programs(1)):  # the G output rows, spread over the slot-block programs
        combine_row(ACC, M_PART, L_PART, OUT, pid_bh * G + g, NUM_SPLITS, HEAD_DIM, BLOCK_S)

    # the group's log-sum-exp in the log2 domain; +inf for a row that saw nothing (it then adds 0)
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    rows = pid_bh * G + offs_g
    offs_s = tl.arange(0, BLOCK_S)
    ms_ok = g_ok[:, None] & (offs_s < NUM_SPLITS)[None, :]
    m = tl.load(M_PART + rows[:, None] * NUM_SPLITS + offs_s[None, :], mask=ms_ok, other=float("-inf"))
    l = tl.load(L_PART + rows[:, None] * NUM_SPLITS + offs_s[None, :], mask=ms_ok, other=0.0)
    m_max = tl.max(m, axis=1)
    m_base = tl.where(m_max == float("-inf"), 0.0, m_max)
    den = tl.sum(tl.exp2(m - m_base[:, None]) * l, axis=1)
    lse2 = tl.where(den > 0.0, m_base + tl.log2(tl.where(den > 0.0, den, 1.0)), float("inf"))

    b = pid_bh // Hkv
    h = pid_bh % Hkv
    score_base = SCORE + b * stride_sb + h * stride_sh
    c_start = pid_c * slots_per_prog
    c_end = tl.minimum(c_start + slots_per_prog, C)
    for c0 in range(c_start, c_end, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_ok = offs_c < c_end
        s = tl.load(LOGITS + rows[:, None] * C + offs_c[None, :], mask=g_ok[:, None] & c_ok[None, :],
                    other=float("-inf"))
        col = tl.sum(tl.exp2(s - lse2[:, None]), axis=0) * group_scale  # -inf - x and x - inf: 0
        old = tl.load(score_base + offs_c * stride_sc, mask=c_ok, other=0.0)
        tl.store(score_base + offs_c * stride_sc, old + col, mask=c_ok)


def _fold_config(B, Hkv, G, C, num_sms) -> dict:
    """Slot blocks of the combine + fold kernel from the shapes alone: about four programs per SM (the fold is
    a short stream per program: more programs keep more loads in flight), and at least G per KV head when
    the slots allow (each combines one output row)."""
    block_g = max(triton.next_power_of_2(G), 2)
    block_c = max(64, min(512, 2048 // block_g))
    blocks = triton.cdiv(C, block_c)
    progs = max(1, min(blocks, max(G, triton.cdiv(4 * num_sms, B * Hkv))))
    per_prog = triton.cdiv(blocks, progs) * block_c
    return dict(block_g=block_g, block_c=block_c, slots_per_prog=per_prog, c_progs=triton.cdiv(C, per_prog))


def _check_inputs(q, keys, bias, score, pending_q, pending_lse, fill, defer):
    name = "kvrewrite::observed_attention"
    B, Hq, T, D = q.shape
    Hkv, C = keys.shape[1], keys.shape[2]
    G = Hq // Hkv if Hkv else 0
    P = pending_entries(G) if G else 1
    if tuple(pending_q.shape) != (B, Hkv, P, G, D) or pending_q.dtype != torch.float32:
        raise ValueError(f"{name}: pending_q must be fp32 [B, Hkv, P, G, D] = {(B, Hkv, P, G, D)} (P = "
                         f"pending_entries(G)), got {pending_q.dtype} {tuple(pending_q.shape)}")
    if tuple(pending_lse.shape) != (B, Hkv, P, G) or pending_lse.dtype != torch.float32:
        raise ValueError(f"{name}: pending_lse must be fp32 [B, Hkv, P, G] = {(B, Hkv, P, G)}, got "
                         f"{pending_lse.dtype} {tuple(pending_lse.shape)}")
    if tuple(fill.shape) != (B, Hkv):
        raise ValueError(f"{name}: fill must be [B, Hkv] = {(B, Hkv)}, got {tuple(fill.shape)}")
    if defer and T != 1:
        raise ValueError(f"{name}: defer=True keeps decode queries pending, one per step: T must be 1, got T = {T}")
    if not (pending_q.is_contiguous() and pending_lse.is_contiguous()):
        raise ValueError(f"{name}: pending_q and pending_lse must be contiguous (state tensors are)")


def pending_entries(G: int) -> int:
    """How many decode queries stay pending (P): as many groups of G heads as fit next to the step's own G in the
    attention kernel's decode tile of max(16, next_pow2(2G)) rows (16 // G - 1 for G <= 8: 3 at G = 4)."""
    rows = max(16, 1 << (2 * G - 1).bit_length())
    return max(1, rows // G - 1)


def pending_steps_ago(cache_position, P: int):
    """k [P] (int64, cache_position's device): entry e of the pending queries at a step at position
    c = cache_position[0] holds the query of k_e steps before it, k_e = ((c - e - 1) mod P) + 1: the deferring steps
    write entry c mod P and fold every entry at c mod P == 0 (module docstring). Empty entries (lse +inf) get a
    k too; they add nothing."""
    e = torch.arange(P, device=cache_position.device)
    return torch.remainder(cache_position[:1] - e - 1, P) + 1


def check_pending_promise(bias, slot_pos, fill, cache_position, pending_lse):
    """ValueError unless, in every row with a query pending, the used slots up to each pending entry's position
    c - k are exactly those before fill - T - k + 1 (c = cache_position[0]; the promise the CUDA kernel relies on
    with past_only and window 0). Reads the data: the CPU path and the reference."""
    if slot_pos.device.type == "meta" or cache_position.numel() == 0:
        return
    ar = torch.arange(bias.shape[-1], device=bias.device)
    ks = pending_steps_ago(cache_position, pending_lse.shape[2])
    for e in range(pending_lse.shape[2]):
        k = int(ks[e])
        used = (bias > float("-inf")) & torch.isfinite(pending_lse[:, :, e]).any(dim=-1, keepdim=True)
        by_pos = slot_pos <= cache_position[0] - k
        by_index = ar < (fill - cache_position.numel() - k + 1)[..., None]
        broken = used & (by_pos != by_index)
        if bool(broken.any()):
            b, h, c = (int(i) for i in broken.nonzero()[0])
            raise ValueError(f"kvrewrite::observed_attention: past_only=True, but used slot {c} of batch row {b}, KV "
                             f"head {h} (position {int(slot_pos[b, h, c])}, fill {int(fill[b, h])}) breaks the promise "
                             f"that the slots up to position {int(cache_position[0]) - k} (a query pending since {k} "
                             f"step(s)) are those before fill - T - {k - 1}; pass past_only=False when the steps' "
                             f"tokens are not the last ones appended")


def fold_pending(keys, bias, slot_pos, cache_position, score, pending_q, pending_lse, scale, window, mode):
    """score += every pending entry's attention over the slots it saw (those up to its position c - k_e,
    pending_steps_ago), summed (mode "all") or averaged (mode "window") over the G heads of a KV head; the entries
    are left as they are (reference; CUDA: the T > 1 path's launch)."""
    B, Hkv, P, G, D = pending_q.shape
    # the entries as P queries of each head: [B, Hq, P, D] (exact: they were stored from queries of this dtype)
    q = pending_q.permute(0, 1, 3, 2, 4).reshape(B, Hkv * G, P, D).to(keys.dtype)
    lse = pending_lse.permute(0, 1, 3, 2).reshape(B, Hkv * G, P)
    position = cache_position[:1] - pending_steps_ago(cache_position, P)
    if keys.is_cuda and acs.triton is not None:
        total, _ = acs._launch(q, keys, bias, slot_pos, position, lse, scale, window, 0)
    else:
        total, _ = acs.reference_attention_column_stats(q, keys, bias, slot_pos, position, lse, scale, window, 0)
    aa.fold_into_score(score, total, total, mode, 1)


def triton_observed_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, score, pending_q,
                              pending_lse, fill, mode, last=0, past_only=False, defer=False):
    """The op on CUDA through Triton (module docstring); validates its inputs."""
    if triton is None:
        raise NotImplementedError("triton_observed_attention needs Triton (pip install triton); "
                                  "kvrewrite::observed_attention itself runs without it")
    ca._check_inputs(q, keys, values, bias, slot_pos, cache_position, window)
    aa._check_inputs(q, keys, bias, slot_pos, cache_position, score, window, mode, last)
    _check_inputs(q, keys, bias, score, pending_q, pending_lse, fill, defer)
    return _launch(q, keys, values, bias, slot_pos, cache_position, scale, window, score, pending_q, pending_lse, fill,
                   mode, last, past_only, defer)


def _launch(q, keys, values, bias, slot_pos, cache_position, scale, window, score, pending_q, pending_lse, fill, mode,
            last, past_only, defer):
    """The CUDA steps, unchecked (Triton's interpreter runs them on CPU tensors)."""
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C = int(keys.shape[1]), int(keys.shape[2])
    G = Hq // Hkv
    group_scale = 1.0 if mode == "all" else 1.0 / G
    if T > 1:  # prefill chunk: fold the pending entries apart, then the attention's lse saves the statistics' pass
        fold_pending(keys, bias, slot_pos, cache_position, score, pending_q, pending_lse, scale, window, mode)
        lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
        out = ca._launch(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only, lse=lse)
        total, recent = acs._launch(q, keys, bias, slot_pos, cache_position, lse, scale, window,
                                    last if mode == "window" else 0, aa.needs_total(mode, T))
        aa.fold_into_score(score, total, recent, mode, T)
        pending_lse.fill_(float("inf"))
        return out
    # the state tensors themselves, not views (the kernels index them flat: contiguous rows); a view of a
    # mutated input would make the traced op copy it in and out
    pending = dict(q=pending_q, lse=pending_lse, score=score, fill=fill, scale=group_scale)
    if defer:  # at c mod P == 0 fold the entries on the way; this step's q and lse become entry c mod P
        return ca._launch(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only,
                          lse=pending["lse"], pending=pending, save_q=pending["q"])
    logits = torch.empty((B * Hq, C), dtype=torch.float32, device=q.device)
    out, part, m_part, l_part, S = ca.launch_forward(q, keys, values, bias, slot_pos, cache_position, scale, window,
                                                     past_only, logits=logits, pending=pending)
    cfg = _fold_config(B, Hkv, G, C, ca._num_sms(q.device) if q.is_cuda else 8)
    wrap_triton(_observe_combine_kernel)[(B * Hkv, cfg["c_progs"])](
        part, m_part, l_part, out, logits, score, *score.stride(),
        Hkv, G, C, S, cfg["slots_per_prog"], group_scale,
        HEAD_DIM=D, BLOCK_G=cfg["block_g"], BLOCK_S=max(triton.next_power_of_2(S), 2), BLOCK_C=cfg["block_c"],
        num_warps=4,
    )
    pending_lse.fill_(float("inf"))
    return out


def reference_observed_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, score, pending_q,
                                 pending_lse, fill, mode, last=0, past_only=False, defer=False):
    """The module docstring's steps with the references (the ground truth of the tests)."""
    return _steps(q, keys, values, bias, slot_pos, cache_position, scale, window, score, pending_q, pending_lse, fill,
                  mode, last, past_only, defer, ca.reference_clustered_attention, aa.reference_accumulate_attention)


def _steps(q, keys, values, bias, slot_pos, cache_position, scale, window, score, pending_q, pending_lse, fill, mode,
           last, past_only, defer, attend, accumulate):
    """The op off CUDA, with `attend` and `accumulate` as the attention and statistics (the references or the ops):
    checks, the pending entries' fold (deferring: at c mod P == 0 only), the attention, then this step's statistics
    or its save as entry c mod P."""
    aa._check_inputs(q, keys, bias, slot_pos, cache_position, score, window, mode, last)
    _check_inputs(q, keys, bias, score, pending_q, pending_lse, fill, defer)
    if past_only and window == 0 and q.shape[2] == 1:
        check_pending_promise(bias, slot_pos, fill, cache_position, pending_lse)
    entry = int(cache_position[0]) % pending_q.shape[2] if defer else 0  # the entry this step's query takes
    if entry == 0:  # every step that does not defer, and the deferring ones at c mod P == 0
        fold_pending(keys, bias, slot_pos, cache_position, score, pending_q, pending_lse, scale, window, mode)
        pending_lse.fill_(float("inf"))
    out = attend(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only)
    if defer:  # this step's q and lse become entry c mod P
        lse = acs._visible_logits(q, keys, bias, slot_pos, cache_position, scale, window).logsumexp(dim=-1)
        B, Hkv, _, G, D = pending_q.shape
        pending_q[:, :, entry].copy_(q.view(B, Hkv, G, D))
        pending_lse[:, :, entry].copy_(lse.view(B, Hkv, G))
    else:
        accumulate(q, keys, bias, slot_pos, cache_position, score, scale, window, mode, last)
    return out.contiguous()


@torch.library.custom_op("kvrewrite::observed_attention_eager", mutates_args=("score", "pending_q", "pending_lse"))
def observed_attention_eager(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    scale: float,
    window: int,
    score: torch.Tensor,
    pending_q: torch.Tensor,
    pending_lse: torch.Tensor,
    fill: torch.Tensor,
    stats_mode: str,
    last: int = 0,
    past_only: bool = False,
    defer: bool = False,
) -> torch.Tensor:
    """The op off CUDA, an opaque op of its own (its checks read the data, which an inlined body cannot): the
    reference fold of the pending entries, kvrewrite::clustered_attention, then kvrewrite::accumulate_attention or
    this step's save as a pending entry. (`stats_mode`, as in the fused op: an argument named "mode" collides with
    torch's fake-tensor dispatch of a custom op.)"""
    return _steps(q, keys, values, bias, slot_pos, cache_position, scale, window, score, pending_q, pending_lse, fill,
                  stats_mode, last, past_only, defer, torch.ops.kvrewrite.clustered_attention,
                  torch.ops.kvrewrite.accumulate_attention)


@observed_attention_eager.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, scale, window, score, pending_q, pending_lse, fill, stats_mode,
      last=0, past_only=False, defer=False):
    return q.new_empty(q.shape)


def observed_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    scale: float,
    window: int,
    score: torch.Tensor,
    pending_q: torch.Tensor,
    pending_lse: torch.Tensor,
    fill: torch.Tensor,
    stats_mode: str,
    last: int = 0,
    past_only: bool = False,
    defer: bool = False,
) -> torch.Tensor:
    """The attention output; the pending entries' statistics folded into `score` (deferring: at c mod P == 0),
    this step's folded too or left pending (module docstring).

    The op's kernel, fake and what Inductor inlines: CUDA launches the fused Triton kernels; other devices call
    kvrewrite::clustered_attention and kvrewrite::accumulate_attention around the reference fold."""
    if q.is_cuda and triton is not None:
        return triton_observed_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, score,
                                         pending_q, pending_lse, fill, stats_mode, last, past_only, defer)
    return torch.ops.kvrewrite.observed_attention_eager(q, keys, values, bias, slot_pos, cache_position, scale,
                                                        window, score, pending_q, pending_lse, fill, stats_mode, last,
                                                        past_only, defer)


observed_attention = register_triton_op("kvrewrite::observed_attention", observed_attention,
                                        ("score", "pending_q", "pending_lse"), triton is not None)
