"""kvrewrite::expanded_attention's prefill kernel: many queries (a prefill chunk) over EMS's runtime slots.

The decode kernel (_expanded_attention_kernels.py) computes q·k once per entry and gathers the score per slot
inside the tile (tl.gather, then a one-hot product to sum p back per entry): the fewest bytes, what a
bandwidth-bound decode step needs. A prefill chunk is compute-bound, and there the in-tile gather and segment sum
cost far more than the dot products they save: at batch 8, 32k, a 2048-query chunk over 28.5k slots of 8.7k
entries took 80.1 ms on an H200 (67.7-107.9 over the variants tried), this kernel 40.0 ms, clustered_attention's
prefill kernel over the 8.7k entries alone 6.3-6.4 (kvrewrite/bench/ems_prefill.py; docs/bench.md "Stop 42 runs"):
the slots are 3.3x the entries, and their rows are gathered. This kernel walks the slots, as a dense
attention over the expanded keys a_j·keys[lut[j]] and values values[lut[j]] whose rows are gathered per slot tile
(never written anywhere: read from L2 where slots share an entry):

    s = q @ keys[lut[tile]]ᵀ                         (one tl.dot per tile of BLOCK_N slots)
    z_j = a_j * scale * s_j  (softcap: softcap * tanh(a_j * scale * s_j / softcap)), -inf where slot j is not
          visible (j >= slot_fill, lut -1, bias -inf, or its entry's slot_pos after the query)
    online softmax in base 2;  acc += p @ values[lut[tile]]

the function of the module docstring of expanded_attention.py, slot for slot (p is rounded to the values' dtype
per slot here, per entry after the segment sum in the decode kernel: both sum in fp32). The causal test runs only
in tiles whose slots not every query of the block sees (the fresh diagonal), as clustered_attention's prefill
kernel does. One program per (query block, b, h), the query blocks of one (b, h) neighbours in the grid so that
the programs running at once share its K/V in L2 (the lesson of that kernel). expanded_attention.launch_expanded_forward
picks it for prefill-sized blocks (G * T > 16) without a split and without S (PREFILL_KERNEL there) that do not
run the gathered form (expanded_attention.uses_gathered: blocks of fewer than 512 queries, or PREFILL_GATHERED off).

The gathered form (`launch_gathered_prefill`, PREFILL_GATHERED there; the default since stop 48: 30.3 ms against
this kernel's 40.3 at the chunk above on an H200, docs/bench.md "Stop 48 runs"): gather_slots writes
each slot's key and value rows out in slot order, and clustered_attention's prefill kernel walks them as contiguous
slots with each score times a_j (its KEY_SCALE), so its loads need no lut entry first and its tile ranges skip the
tiles a query block cannot see; the price is the transient copy (gathered_bytes) and one pass to write it.

Checked: under Triton's interpreter against the float64 model (tests/kernels/test_expanded_attention_triton.py,
16-row blocks and 16-slot tiles across the fresh diagonal, freed and stale slots, padding, empty rows) and on an
H200 (torch 2.11, Triton 3.6: tests/kernels/test_expanded_attention_gpu.py::test_prefill_kernel, fp32/fp16/bf16, D
64/128/256, soft cap, four tilings, against float64 over materialised expanded keys; tests/methods/test_ems_gpu.py,
the model eager and under reduce-overhead), with 64 x 64 tiles as the default then; the 128 x 32 default since
matched that launch's output on the benchmark's chunk (bf16: 1e-3 apart; that launch 1e-3 from float32 there).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite.kernels import _prefill_attention_kernels as _clustered_prefill
from kvrewrite.kernels._online_softmax import softmax_tile, store_rows
from kvrewrite.kernels._prefill_attention_kernels import prefill_launch_config
from kvrewrite.kernels._query_block import block_rows, query_block
from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels.clustered_attention import libdevice

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its reference; only the launchers need Triton
    triton = tl = None


@triton_jit(do_not_specialize=["Hkv", "G", "T", "C", "R"])
def _expanded_prefill_kernel(
    Q, K, V,
    BIAS, POS,  # fp32 / int64 [B, Hkv, C], contiguous
    CPOS,  # int64 [T]
    LUT, KSCALE,  # int32 / fp32 [B, Hkv, R], contiguous
    SFILL,  # int64 [B, Hkv], contiguous
    OUT,  # [B, Hq, T, D] q's dtype, contiguous
    LSE,  # fp32 [B * Hq * T], natural log, -inf for a row that saw nothing
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    # qk_scale = scale * log2(e); with SOFTCAP, qk_scale = scale / softcap and softcap_log2 = softcap * log2(e)
    Hkv, G, T, C, R, qk_scale, softcap_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # slots per tile
    LOAD_POS: tl.constexpr,  # False (past_only): slot_pos is not read, every live slot is visible
    SOFTCAP: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest: the query blocks of one (b, h) run together and share its K/V in L2
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    Hq = Hkv * G
    row = b.to(tl.int64) * Hkv + h  # the (b, h) row of the state

    rows, row_ok, t, hq, offs_d = block_rows(h, pid_m, G, T, BLOCK_M, HEAD_DIM)
    q, qpos, qpos_min, qpos_max, q_rel = query_block(Q, CPOS, b, row_ok, t, hq, offs_d, stride_qb, stride_qh,
                                                     stride_qt, stride_qd)

    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    lut_base = LUT + row * R
    ks_base = KSCALE + row * R
    n_slots = tl.minimum(tl.load(SFILL + row), R).to(tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # the slot metadata is prefetched one tile ahead (loop-carried): the K/V row addresses hang on it
    e_next = tl.load(lut_base + offs_n, mask=offs_n < n_slots, other=-1)
    a_next = tl.load(ks_base + offs_n, mask=offs_n < n_slots, other=0.0)
    for j0 in range(0, n_slots, BLOCK_N):
        e = e_next
        a = a_next
        offs_j = j0 + BLOCK_N + offs_n
        e_next = tl.load(lut_base + offs_j, mask=offs_j < n_slots, other=-1)
        a_next = tl.load(ks_base + offs_j, mask=offs_j < n_slots, other=0.0)
        live = e >= 0  # -1: a freed slot, or past slot_fill
        e = tl.where(live, e, 0).to(tl.int64)
        bias = tl.load(BIAS + row * C + e, mask=live, other=float("-inf"))
        live = live & (bias > float("-inf"))
        k = tl.load(k_base + e[:, None] * stride_kc + offs_d[None, :] * stride_kd, mask=live[:, None], other=0.0)
        if Q.dtype.element_ty == tl.float32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        z = (qk * qk_scale).to(tl.float32) * a[None, :]
        if SOFTCAP:
            z = libdevice.tanh(z) * softcap_log2
        z = tl.where(live[None, :], z, float("-inf"))
        if LOAD_POS:
            pos = tl.load(POS + row * C + e, mask=live, other=0)
            # every query of the block sees every live slot of the tile: the causal test is not needed
            if tl.max(tl.where(live, pos, -(2**62)), axis=0) > qpos_min:
                p_rel = tl.minimum(tl.maximum(pos - qpos_min, -1), 2**30).to(tl.int32)
                z = tl.where(p_rel[None, :] <= q_rel[:, None], z, float("-inf"))

        v_ptrs = v_base + e[:, None] * stride_vc + offs_d[None, :] * stride_vd  # the tile's value rows, gathered
        m_i, l_i, acc = softmax_tile(m_i, l_i, acc, z, v_ptrs, live)

    store_rows(OUT, LSE, (b.to(tl.int64) * Hq + hq) * T + t, row_ok, offs_d, acc, m_i, l_i, HEAD_DIM, True)


def expanded_prefill_config(B, Hkv, G, T, C, D, itemsize=2, block_m=None, block_n=None, num_warps=None,
                            num_stages=None) -> dict:
    """Tiles, warps and stages of _expanded_prefill_kernel from the shapes alone; the keywords override them.
    16-bit inputs with D <= 128: 128-row query tiles (32 queries of a 4-head group) over 32-slot tiles, 4 warps, 2
    stages, the fastest of an H200 sweep at batch 8 (bf16, D 128, a 2048-query chunk over 28.5k slots; docs/bench.md
    "Stop 42 runs"): 40.0 ms, against 46.8 for 64 x 32, 47.4 for 128 x 64 with 8 warps, 51.7 for 64 x 32 with 3
    stages, 59.6 for 64 x 64 and 63.1 for 64 x 64 with 8 warps. Otherwise (fp32, D = 256: twice the registers
    a row) clustered_attention's prefill_launch_config, 64 x 64 tiles or smaller, as the GPU tests ran them.
    Compiled for sm_90 here, the 128 x 32 launch takes 255 registers and spills 224 bytes a thread: a launch that
    does not spill may be faster still (the benchmark's variants)."""
    if itemsize <= 2 and D <= 128:
        block_m = 128 if block_m is None else block_m
        block_n = 32 if block_n is None else block_n
    return prefill_launch_config(B, Hkv, G, T, C, D, itemsize, block_m=block_m, block_n=block_n,
                                 num_warps=num_warps, num_stages=num_stages)


def launch_expanded_prefill(q, keys, values, bias, slot_pos, cache_position, lut, key_scale, slot_fill, qk_scale,
                            softcap_log2, past_only, softcap, **overrides):
    """Launch the kernel; returns (out [B, Hq, T, D] in q's dtype, lse [B, Hq, T] fp32). No checks (the op's), no
    host read; runs under Triton's interpreter on CPU tensors. overrides: expanded_prefill_config's (block_m,
    block_n, num_warps, num_stages)."""
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C, R = int(keys.shape[1]), int(keys.shape[2]), int(lut.shape[2])
    G = Hq // Hkv
    cfg = expanded_prefill_config(B, Hkv, G, T, C, D, q.element_size(), **overrides)
    out = torch.empty((B, Hq, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    wrap_triton(_expanded_prefill_kernel)[(cfg["m_blocks"], B * Hkv)](
        q, keys, values, bias.contiguous(), slot_pos.contiguous(), cache_position, lut.contiguous(),
        key_scale.contiguous(), slot_fill.contiguous(), out, lse,
        *q.stride(), *keys.stride(), *values.stride(),
        Hkv, G, T, C, R, qk_scale, softcap_log2,
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], LOAD_POS=not past_only, SOFTCAP=softcap > 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


# -- the gathered form: the expanded keys' rows written out per slot, then clustered_attention's prefill kernel ----


# How gather_slots copies the key and value rows. The advanced index keys[b, h, lut] runs torch's element-wise
# index kernel: at batch 8, 32k (a 2048-query chunk over 28.5k slots a row) the H200 profile of EMS's prefill gives
# it 1.80 s of 21.0 (1024 calls, 3.5 ms each, ~0.5 GB of rows written per call; docs/bench.md "Stop 52 runs").
# GATHER_INDEX_SELECT copies whole rows instead, index_select over the [B * Hkv * C, D] view of contiguous keys and
# values (flat index (b * Hkv + h) * C + lut): the same values, bit for bit. H200, that chunk alone
# (bench/ems_prefill.py, docs/bench.md "Stop 53 runs"): 2.86 ms against 3.55 (one run, both in it). It applies where
# the tensor code runs (GATHER_KERNEL off, or not CUDA); non-contiguous keys or values take the advanced index.
GATHER_INDEX_SELECT = True
# GATHER_KERNEL (CUDA): _gather_slots_kernel writes all four outputs in one launch, its rows as 16-byte vectors (sm_90
# SASS of an offline compile with Triton 3.9: 8 LDG.E.128 and 8 STG.E.128 a thread for K and V together at D 128 and
# 96; 32 slots a program), where the tensor code takes several launches (live_slots' test, bias' and slot_pos'
# gathers, two row copies). H200, that chunk alone (stop 54, docs/bench.md "Stop 54 runs"): 0.381 ms against 2.854
# (index_select) and 3.554 (the advanced index), one run, the same outputs bit for bit; the batch-8 prefill with it
# and the fold's LEAN + PIPE 1.25-1.26x dense against 1.46-1.47x. `--kernel-option
# _expanded_prefill_kernels.GATHER_KERNEL=False` times the tensor code.
GATHER_KERNEL = True


@triton_jit(do_not_specialize=["Hkv", "R"])
def _gather_slots_kernel(
    K, V, BIAS, POS, LUT, FILL,
    KG, VG, BIAS_G, POS_G,  # outputs, contiguous: [B, Hkv, R, HEAD_DIM] x 2, [B, Hkv, R] fp32 and int64
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    stride_lb, stride_lh, stride_lj,
    stride_fb, stride_fh,
    Hkv, R,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """gather_slots' four outputs for BLOCK_J slots of one row (b, h): the same values as its tensor code, slot for
    slot (entry e = max(lut_j, 0) for every slot, live or not)."""
    row = tl.program_id(1).to(tl.int64)
    b = row // Hkv
    h = row % Hkv
    offs_j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_ok = offs_j < R
    lut = tl.load(LUT + b * stride_lb + h * stride_lh + offs_j * stride_lj, mask=j_ok, other=-1)
    fill = tl.load(FILL + b * stride_fb + h * stride_fh)
    e = tl.maximum(lut, 0).to(tl.int64)
    e_bias = tl.load(BIAS + b * stride_bb + h * stride_bh + e * stride_bc, mask=j_ok, other=float("-inf"))
    live = (offs_j < fill) & (lut >= 0) & (e_bias > float("-inf"))
    out = row * R + offs_j
    tl.store(BIAS_G + out, tl.where(live, 0.0, float("-inf")), mask=j_ok)
    pos = tl.load(POS + b * stride_pb + h * stride_ph + e * stride_pc, mask=j_ok & (lut >= 0), other=0)
    tl.store(POS_G + out, pos, mask=j_ok)
    offs_d = tl.arange(0, BLOCK_D)
    if HEAD_DIM == BLOCK_D:  # a mask constant along the row: the loads and stores stay 16-byte vectors
        m = j_ok[:, None]
    else:
        m = j_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + b * stride_kb + h * stride_kh + e[:, None] * stride_kc + offs_d[None, :] * stride_kd, mask=m)
    tl.store(KG + out[:, None] * HEAD_DIM + offs_d[None, :], k, mask=m)
    v = tl.load(V + b * stride_vb + h * stride_vh + e[:, None] * stride_vc + offs_d[None, :] * stride_vd, mask=m)
    tl.store(VG + out[:, None] * HEAD_DIM + offs_d[None, :], v, mask=m)


def launch_gather_slots(keys, values, bias, slot_pos, lut, slot_fill, block_j=None, num_warps=4):
    """gather_slots' outputs by _gather_slots_kernel (one launch; Triton, or its interpreter on CPU tensors)."""
    B, Hkv, R = (int(n) for n in lut.shape)
    D = int(keys.shape[-1])
    k_g = torch.empty((B, Hkv, R, D), dtype=keys.dtype, device=keys.device)
    v_g = torch.empty((B, Hkv, R, D), dtype=values.dtype, device=values.device)
    bias_g = torch.empty((B, Hkv, R), dtype=torch.float32, device=lut.device)
    pos_g = torch.empty((B, Hkv, R), dtype=slot_pos.dtype, device=lut.device)
    if bias_g.numel() == 0:
        return k_g, v_g, bias_g, pos_g
    block_d = triton.next_power_of_2(D)
    block_j = block_j or max(1, 4096 // block_d)  # 32 rows of D = 128 a program: 4 vectors a thread, K and V each
    wrap_triton(_gather_slots_kernel)[(triton.cdiv(R, block_j), B * Hkv)](
        keys, values, bias, slot_pos, lut, slot_fill, k_g, v_g, bias_g, pos_g,
        *keys.stride(), *values.stride(), *bias.stride(), *slot_pos.stride(), *lut.stride(), *slot_fill.stride(),
        Hkv, R, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_J=block_j, num_warps=num_warps,
    )
    return k_g, v_g, bias_g, pos_g


def _gather_rows(x, flat, b_idx, h_idx, idx, index_select):
    """x[b, h, idx] [B, Hkv, R, D]: by index_select over x's [B * Hkv * C, D] rows (flat: the row numbers) when
    asked and x is contiguous, else by the advanced index."""
    if index_select and x.is_contiguous():
        B, Hkv, R = idx.shape
        return x.view(-1, x.shape[-1]).index_select(0, flat).view(B, Hkv, R, x.shape[-1])
    return x[b_idx, h_idx, idx]


def gather_slots(keys, values, bias, slot_pos, lut, slot_fill, index_select=None, kernel=None):
    """Each runtime slot's own row, in slot order: (keys[lut_j], values[lut_j]) as [B, Hkv, R, D] in their dtype,
    bias' [B, Hkv, R] fp32 (0 where slot j is live: j < slot_fill, lut_j >= 0 and bias[lut_j] > -inf; -inf
    elsewhere) and slot_pos' = slot_pos[lut_j] [B, Hkv, R] int64 (0 where lut_j < 0). No host read: CUDA-graph
    capturable. The keys are NOT scaled: the kernel multiplies each slot's score by a_j, as the slot kernels do, so
    no key is rounded twice. On CUDA with kernel (default GATHER_KERNEL) one Triton launch (launch_gather_slots);
    otherwise tensor code (any device), index_select (default GATHER_INDEX_SELECT) saying how its rows are copied.
    The same values every way."""
    from kvrewrite.kernels.expanded_attention import live_slots  # (that module imports this one)

    if (GATHER_KERNEL if kernel is None else kernel) and keys.is_cuda and tl is not None:
        return launch_gather_slots(keys, values, bias, slot_pos, lut, slot_fill)
    B, Hkv, R = lut.shape
    C = keys.shape[2]
    live, idx = live_slots(bias, lut, slot_fill)
    bi = torch.arange(B, device=lut.device)[:, None, None]
    hi = torch.arange(Hkv, device=lut.device)[None, :, None]
    bias_g = torch.zeros(B, Hkv, R, dtype=torch.float32, device=lut.device).masked_fill_(~live, float("-inf"))
    pos_g = torch.where(lut >= 0, slot_pos[bi, hi, idx], 0)
    rows = GATHER_INDEX_SELECT if index_select is None else index_select
    flat = ((bi * Hkv + hi) * C + idx).reshape(-1) if rows else None
    return (_gather_rows(keys, flat, bi, hi, idx, rows), _gather_rows(values, flat, bi, hi, idx, rows), bias_g,
            pos_g)


def gathered_bytes(B, Hkv, R, D, itemsize) -> int:
    """Device memory gather_slots allocates for one call (freed when the call returns)."""
    return B * Hkv * R * (2 * D * itemsize + 4 + 8)


def launch_gathered_prefill(q, keys, values, bias, slot_pos, cache_position, lut, key_scale, slot_fill, qk_scale,
                            softcap_log2, softcap, **overrides):
    """The expanded attention of a prefill chunk as a dense attention over contiguous rows: gather_slots, then
    clustered_attention's prefill kernels (their tile ranges skip the tiles no query of a block sees, contiguous
    loads, each slot's score times a_j). Returns (out, lse) as launch_expanded_prefill. Costs gathered_bytes of
    transient memory (B 8, 32k, budget 0.2, gamma 4: 1.1 GB) and one pass over it; past_only is not needed (the
    positions are read either way). overrides: prefill_launch_config's."""
    B, Hq, T, _ = (int(n) for n in q.shape)
    k_g, v_g, bias_g, pos_g = gather_slots(keys, values, bias, slot_pos, lut, slot_fill)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    out = _clustered_prefill.launch_prefill(q, k_g, v_g, bias_g, pos_g, cache_position, 0, qk_scale, softcap_log2,
                                            softcap, lse, key_scale=key_scale.contiguous(), **overrides)
    return out, lse
