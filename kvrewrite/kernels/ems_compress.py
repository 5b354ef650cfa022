"""kvrewrite::ems_compress — EMS's compression of the due rows: score, partition, redundancy, merge
(docs/contracts/ems.md §6.5).

due[b, h] = fill >= budget[1]; Bt = budget[0] (the entries a due row keeps: L_win window tokens + N_imp centres).
It runs kvrewrite::ems_score (§6.6) -> ems_partition (§6.7) -> ems_redundancy (§6.8) -> ems_merge (§6.9) for every
row; each stage leaves rows not due alone, so those are untouched bit for bit. The redundancy variant (pos) is
implied by raw_keys: [B, Hkv, C, D] is "without" (pre-RoPE keys), [B, Hkv, 0, D] is "with" (the stored keys).
win_count is not an argument: a compression does not touch it.

State (mutated: everything but budget): the EMS state of §3 (kvrewrite.kernels.ems_merge.check_ems_state). Args:
l_win (int >= 1), pool (odd int >= 1), gamma (float >= 1, inf allowed), tau (float in [0, 1]).

Backends: CPU runs the stages' references (reference_ems_compress: static shapes, no host reads, deterministic).
CUDA runs the chain through the stages' registered ops (torch.ops.kvrewrite.ems_score, ems_partition,
ems_redundancy, ems_merge: compress_by_ops), so each stage takes its own CUDA path: its Triton kernel where that
op's KERNELS_CHECKED_ON_GPU records passed GPU tests, else its reference. Every stage is free of host reads and of
shape-dependent launches, so the chain is CUDA-graph capturable either way. The reference raises ValueError when
Bt <= l_win, read from budget only when budget is on the CPU (the CUDA path would otherwise sync; there
ems_partition clamps N_imp >= 0). The op is a `custom_op`, opaque to Inductor.

Checked on an H100 (torch 2.11, Triton 3.6; tests/kernels/test_ems_compress_gpu.py: 13 passed, twice): the whole op
on CUDA with ems_redundancy's and ems_merge's kernels gives the CPU reference's state (three successive compressions,
pos with/without, gamma 1/1.25/4/inf, tau 0/0.6/1) and the naive model's, and replays in a CUDA graph. Measured there
(Llama-3.1-8B-shaped 32k state, budget 0.2, bf16, eager; ems_score and ems_partition still their references on this
branch): B = 1 prefill-chunk compression 2.8-3.8 ms vs the all-reference chain's 45.6 ms, decode-time 3.5-5.0 ms
vs 45-46.5 ms; B = 8: 5.6-5.7 ms vs 259 ms and 3.6-3.9 ms vs 258 ms (two runs).
"""
import torch

from kvrewrite.kernels.ems_merge import MUTATED, check_ems_state, reference_ems_merge
from kvrewrite.kernels.ems_partition import reference_ems_partition
from kvrewrite.kernels.ems_redundancy import reference_ems_redundancy
from kvrewrite.kernels.ems_score import reference_ems_score

NAME = "kvrewrite::ems_compress"


def reference_ems_compress(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale,
                           token_pos, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, l_win, pool, gamma, tau):
    due = fill >= budget[1]
    g, g_pooled = reference_ems_score(bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due,
                                      l_win, pool)
    cls = reference_ems_partition(bias, fill, entry_start, g_pooled, due, budget, l_win, gamma)
    dest = reference_ems_redundancy(keys, values, raw_keys, cls, due, tau)
    reference_ems_merge(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
                        slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, g, g_pooled, cls, dest, due, gamma)


def compress_by_ops(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
                    slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, l_win, pool, gamma, tau):
    """6.6 -> 6.7 -> 6.8 -> 6.9 through the stages' registered ops: each dispatches to its device's implementation
    (the CUDA path of ems_compress; module docstring)."""
    ops = torch.ops.kvrewrite
    due = fill >= budget[1]
    g, g_pooled = ops.ems_score(bias, fill, lut, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, due,
                                l_win=l_win, pool=pool)
    cls = ops.ems_partition(bias, fill, entry_start, g_pooled, due, budget, l_win=l_win, gamma=gamma)
    dest = ops.ems_redundancy(keys, values, raw_keys, cls, due, tau=tau)
    ops.ems_merge(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
                  slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, g, g_pooled, cls, dest, due, gamma=gamma)


def _check_inputs(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
                  slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, l_win, pool, gamma, tau):
    check_ems_state(NAME, keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale,
                    token_pos, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill)
    if l_win < 1:
        raise ValueError(f"{NAME}: l_win must be an int >= 1, got {l_win}")
    if pool < 1 or pool % 2 == 0:
        raise ValueError(f"{NAME}: pool must be an odd int >= 1 (1: no pooling), got {pool}")
    if not gamma >= 1:
        raise ValueError(f"{NAME}: gamma must be a float >= 1 (math.inf allowed), got {gamma}")
    if not 0 <= tau <= 1:
        raise ValueError(f"{NAME}: tau must be in [0, 1], got {tau}")
    if budget.device.type == "cpu" and int(budget[0]) <= l_win:
        raise ValueError(f"{NAME}: budget[0] = {int(budget[0])} entries cannot hold the {l_win}-token local window "
                         f"plus a class centre; raise the budget or lower l_win")


@torch.library.custom_op(NAME, mutates_args=MUTATED)
def ems_compress(keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, slot_pos: torch.Tensor,
                 fill: torch.Tensor, budget: torch.Tensor, entry_start: torch.Tensor, raw_keys: torch.Tensor,
                 lut: torch.Tensor, key_scale: torch.Tensor, token_pos: torch.Tensor, slot_order: torch.Tensor,
                 s_glo: torch.Tensor, s_loc_past: torch.Tensor, s_loc_cur: torch.Tensor, slot_fill: torch.Tensor,
                 *, l_win: int, pool: int, gamma: float, tau: float) -> None:
    """Compress the due rows in place (module docstring). CPU runs the stages' references."""
    args = (keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
            slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, l_win, pool, gamma, tau)
    _check_inputs(*args)
    reference_ems_compress(*args)


@ems_compress.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos, slot_order,
      s_glo, s_loc_past, s_loc_cur, slot_fill, *, l_win, pool, gamma, tau):
    args = (keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
            slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, l_win, pool, gamma, tau)
    _check_inputs(*args)
    compress_by_ops(*args)


@ems_compress.register_fake
def _(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos, slot_order,
      s_glo, s_loc_past, s_loc_cur, slot_fill, *, l_win, pool, gamma, tau):
    return None
