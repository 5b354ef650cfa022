"""kvrewrite::observed_attention — clustered_attention and accumulate_attention in one op, one pass over the keys.

    out = clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only)
    accumulate_attention(q, keys, bias, slot_pos, cache_position, score, scale, window, mode, last)

exactly (same function, same in-place update of `score`: see those two modules for the formulas); the pass
fuse_attention_observation puts it where a method's statistics op follows its attention (H2O, SnapKV).
Why an op of its own: the statistics need every query's probability of every slot, p = exp(z - lse),
and lse is known only once the attention has seen every slot. Computed apart, they are a second pass
over the keys after the attention's (and a third for lse): on the H100 that cost h2o 8 ms of a 14.5 ms
decode step (docs/bench/e2e_h100_h2o_second_pass.json). Here the attention computes them on the way:

- decode (T = 1, the step that repeats): the attention kernel also stores each row's masked log2-domain
  score s of every slot (fp32 [B * Hq, C]: G * 4 bytes per slot and KV head, next to the 4 * D bytes of
  keys and values it reads) and always leaves split partials; then one kernel (grid B * Hkv x slot
  blocks) combines the partials into the output rows and each row's log-sum-exp, and folds
  p = 2^(s - lse2) of the G query heads of a KV head into `score` (sum or mean over the group, as the
  mode says; each slot's score is written by one program: no atomics, deterministic). The keys are read
  once; the extra traffic is the scores' write and read and the score state's read and write: +9-14%
  over the attention alone on an H100 (docs/bench/observed_attention_h100.json; docs/methods.md).
- T > 1 (a prefill chunk, compute-bound): the attention kernel writes each query's lse; then
  attention_column_stats' single pass with that lse (its lse pass is skipped) and the group reduction.

Args: those of clustered_attention (softcap excluded: observing methods are refused on soft-capped
layers) and of accumulate_attention: score [B, Hkv, C] fp32 (mutated), mode "all" or "window", last.
Returns: the attention output [B, Hq, T, D] in q's dtype, contiguous.

Backends: CUDA with Triton runs the fused kernels (the dtypes and head dims of clustered_attention's);
everywhere else the op is the two ops called in turn (the CPU path), so it is exactly them. A
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


def triton_observed_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, score, mode, last=0,
                              past_only=False):
    """The op on CUDA through Triton (module docstring); validates its inputs."""
    if triton is None:
        raise NotImplementedError("triton_observed_attention needs Triton (pip install triton); "
                                  "kvrewrite::observed_attention itself runs without it")
    ca._check_inputs(q, keys, values, bias, slot_pos, cache_position, window)
    aa._check_inputs(q, keys, bias, slot_pos, cache_position, score, window, mode, last)
    return _launch(q, keys, values, bias, slot_pos, cache_position, scale, window, score, mode, last, past_only)


def _launch(q, keys, values, bias, slot_pos, cache_position, scale, window, score, mode, last, past_only):
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C = int(keys.shape[1]), int(keys.shape[2])
    G = Hq // Hkv
    if T > 1:  # prefill chunk: the attention's lse saves the statistics' own pass
        lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
        out = ca._launch(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only, lse=lse)
        total, recent = acs._launch(q, keys, bias, slot_pos, cache_position, lse, scale, window,
                                    last if mode == "window" else 0)
        aa.fold_into_score(score, total, recent, mode, T)
        return out
    logits = torch.empty((B * Hq, C), dtype=torch.float32, device=q.device)
    out, part, m_part, l_part, S = ca.launch_forward(q, keys, values, bias, slot_pos, cache_position, scale, window,
                                                     past_only, logits=logits)
    cfg = _fold_config(B, Hkv, G, C, ca._num_sms(q.device))
    wrap_triton(_observe_combine_kernel)[(B * Hkv, cfg["c_progs"])](
        part, m_part, l_part, out, logits, score, *score.stride(),
        Hkv, G, C, S, cfg["slots_per_prog"], 1.0 if mode == "all" else 1.0 / G,
        HEAD_DIM=D, BLOCK_G=cfg["block_g"], BLOCK_S=max(triton.next_power_of_2(S), 2), BLOCK_C=cfg["block_c"],
        num_warps=4,
    )
    return out


def reference_observed_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, score, mode, last=0,
                                 past_only=False):
    """The two ops' references in turn (the ground truth of the tests)."""
    out = ca.reference_clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, past_only)
    aa.reference_accumulate_attention(q, keys, bias, slot_pos, cache_position, score, scale, window, mode, last)
    return out.contiguous()


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
    mode: str,
    last: int = 0,
    past_only: bool = False,
) -> torch.Tensor:
    """The attention output, with the step's attention statistics folded into `score` (module docstring).

    The op's kernel, fake and what Inductor inlines: CUDA launches the fused Triton kernels; other devices
    call kvrewrite::clustered_attention and kvrewrite::accumulate_attention."""
    if q.is_cuda and triton is not None:
        return triton_observed_attention(q, keys, values, bias, slot_pos, cache_position, scale, window, score, mode,
                                         last, past_only)
    out = torch.ops.kvrewrite.clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, window,
                                                  past_only)
    torch.ops.kvrewrite.accumulate_attention(q, keys, bias, slot_pos, cache_position, score, scale, window, mode, last)
    return out


observed_attention = register_triton_op("kvrewrite::observed_attention", observed_attention, ("score",),
                                        triton is not None)
