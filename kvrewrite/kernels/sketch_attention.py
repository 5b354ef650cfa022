"""kvrewrite::sketch_attention — ClusterGen's attention: exact slots plus a sketch with separate numerator and
denominator weights (SubGen, arXiv 2402.06082; contract docs/contracts/clustergen.md §3.1).

For query t (position c_t), query head hq and its KV head h = hq // G (GQA), slot j is visible when bias_j > -inf
and slot_pos_j <= c_t (causal: also covers a prefill chunk's fresh block). With z_j = scale·q_t·k_j + bias_j (fp32):

    N = sum over visible j with role_j in {0, 2} of e^(z_j - m_N) v_j,   m_N = the max of those z_j
    Z = sum over visible j with role_j in {0, 1} of e^(z_j - m_Z),       m_Z = the max of those z_j
    out = e^(m_N - m_Z) · N / Z;   0 when no denominator slot is visible

role 0: an exact token (both sums); 1: a cluster's key sample (denominator only, bias log(n_i / t)); 2: a value
sample (numerator only, bias log(μ / (s·|v|²))). Two shifts, not one: a value slot's weight can exceed every
denominator term by far, and one common shift would underflow the denominator (tested with a weight of +80). The
factor e^(m_N - m_Z) is applied in two halves, e^(gap/2)·(e^(gap/2)·N / Z): a gap past fp32's 88 (a large value
weight over a small |v|, whose product stays moderate) does not overflow where the output itself fits. With
every role 0 the op is kvrewrite::clustered_attention (window 0, no cap; tested). Roles other than 0, 1, 2 are
refused on the CPU (a data read); the CUDA kernel counts such a slot in neither sum. An empty slot's keys and values
must be finite, as for clustered_attention (prefill tiles read every slot and mask by score).

Args:
    q:              [B, Hq, T, D]   fp16/bf16/fp32 (any strides: often a transposed view)
    keys, values:   [B, Hkv, C, D]  q's dtype
    bias:           [B, Hkv, C]     fp32 (-inf: an empty or padding slot)
    slot_pos:       [B, Hkv, C]     int64
    cache_position: [T]             int64
    role:           [B, Hkv, C]     int8 in {0, 1, 2}
    scale:          softmax scale (the model's)
    past_only:      the caller's promise that no used slot lies after any query, as kvrewrite::clustered_attention:
                    the CUDA kernel then skips reading slot_pos; the CPU path checks the promise (ValueError)
    softcap:        must be 0: Algorithm 1 estimates e^(q·k), not a capped logit (the method refuses capped layers)
Returns:
    [B, Hq, T, D] in q's dtype, contiguous.
Mutates: nothing.

Backends: CPU runs the reference (an opaque op, kvrewrite::sketch_attention_cpu: it checks the roles and past_only's
promise, data reads). CUDA runs the Triton kernel below (fp16/bf16/fp32, D in 16..256, a power of two), the path since
its GPU tests passed (KERNELS_CHECKED_ON_GPU: tests/kernels/test_sketch_attention_gpu.py, 88 passed on an H100, torch
2.11, Triton 3.6; with the flag off CUDA would run the reference without its data checks). The kernel is
kvrewrite::clustered_attention's forward (its launch config and tile layout: one program per (b, KV head, split,
row block), rows = the G query heads at every query) with two running maxima, the role masks and a combine of its
own that merges both partial sums. A `torch.library.triton_op`, so Inductor sees the launches and CUDA graphs
capture them. At decode the kernel skips the value reads of denominator-only slots (role 1). Prefill chunks can
take _sketch_prefill_kernels.py instead (PREFILL_KERNEL: clustered_attention's prefill kernel with the two sums).
Measured (H100, torch 2.11, Triton 3.6, decode inside a CUDA graph, Llama-3.1-8B: Hq 32, Hkv 8, D 128, bf16, C =
6656 used slots, past_only; median of 15 replays of 50 calls): B 1: 11.42 us with a ClusterGen layout (68 exact
slots, the rest half role 1, half role 2) and 12.02 us with every role 0, against clustered_attention's 11.95 us;
B 8: 64.94 and 80.94 against 80.42 us. So the second max and the role masks cost ~0.5% and the skipped value reads
save ~19% at B 8.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite.kernels import _prefill_attention_kernels as _prefill
from kvrewrite.kernels import _sketch_prefill_kernels as _sketch_prefill
from kvrewrite.kernels._query_block import block_rows, query_block
from kvrewrite.kernels._triton_op import check_attention_shapes, check_one_cuda_device, register_triton_op, triton_jit
from kvrewrite.kernels.clustered_attention import _DTYPES, _HEAD_DIMS, _launch_config, _num_sms, check_past_only

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its reference; only triton_sketch_attention raises
    triton = tl = None

NAME = "sketch_attention"
QUERY_BLOCK = 128  # the reference's queries per block: [B, Hq, 128, C] fp32 scores at a time
KERNELS_CHECKED_ON_GPU = True  # tests/kernels/test_sketch_attention_gpu.py: 88 passed, H100 (torch 2.11, Triton 3.6)
# PREFILL_KERNEL: prefill chunks (G * T > 16 rows) through _sketch_prefill_kernels.py, clustered_attention's prefill
# kernel with this op's two sums (its tile loop bounded by the tiles' position ranges, the causal mask only where a
# block does not see a tile whole), instead of the decode kernel's slot loop. Why: ClusterGen's batch-8 32k prefill
# (H200, stop 57: 18.5 s of kernels against HF's dense 11.2) spent 6.22 s in this op's decode loop. Measured (H200):
# at a batch-8 2048-query chunk over 8.6k slots, roles 0/1/2 over the past (`python -m kvrewrite.bench.attention_prefill
# --batch 8 --cases "chelsea 32k chunk 2048" --sketch`), 7.94-7.96 ms against the decode loop's 10.86-11.09 in two
# runs (stops 57, 58), the same largest error against the reference (8.6e-4); ClusterGen's batch-8 32k prefill end to
# end (stop 58) 1.54-1.57x dense in two runs against 1.67x with this off in the same process as one of them.
# tests/kernels/test_sketch_attention_gpu.py (in scripts/gpu_tests.sh 2: 750 passed) and tests/methods/
# test_clustergen_gpu.py (15 passed) with it on. False: the decode kernel's slot loop for every block (an A/B switch,
# `kvrewrite bench ... --kernel-option sketch_attention.PREFILL_KERNEL=False`).
PREFILL_KERNEL = True


def check_inputs(name, q, keys, values, bias, slot_pos, cache_position, role, softcap) -> tuple:
    """ValueError naming the op and the field unless shapes and dtypes are the op's (module docstring) and softcap is
    0. Reads no data. Returns (B, Hq, T, D, Hkv, C)."""
    if softcap != 0:
        raise ValueError(f"{name}: softcap must be 0, got {softcap}: ClusterGen's estimator is of e^(q·k), not of a "
                         "soft-capped logit (the method refuses capped layers)")
    B, Hq, T, D, Hkv, C = check_attention_shapes(name, q, keys, bias, slot_pos, cache_position)
    if values.shape != keys.shape:
        raise ValueError(f"{name}: values must be shaped like keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if tuple(role.shape) != (B, Hkv, C):
        raise ValueError(f"{name}: role must be [B, Hkv, C] = {(B, Hkv, C)}, got {tuple(role.shape)}")
    if q.dtype not in _DTYPES or keys.dtype != q.dtype or values.dtype != q.dtype:
        raise ValueError(f"{name}: q, keys and values must share one dtype of fp16/bf16/fp32, "
                         f"got q {q.dtype}, keys {keys.dtype}, values {values.dtype}")
    for field, t, dtype in (("bias", bias, torch.float32), ("slot_pos", slot_pos, torch.int64),
                            ("cache_position", cache_position, torch.int64), ("role", role, torch.int8)):
        if t.dtype != dtype:
            raise ValueError(f"{name}: {field} must be {dtype}, got {t.dtype}")
    return B, Hq, T, D, Hkv, C


def check_roles(role, name=NAME):
    """ValueError naming the first bad slot unless every role is 0, 1 or 2. Reads the data: CPU path only."""
    if role.device.type == "meta" or role.numel() == 0:
        return
    bad = (role < 0) | (role > 2)
    if bool(bad.any()):
        b, h, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: role must be 0 (exact), 1 (denominator only) or 2 (numerator only), got "
                         f"{int(role[b, h, c])} at role[{b}, {h}, {c}] ({int(bad.sum())} such slots)")


def reference_sketch_attention(q, keys, values, bias, slot_pos, cache_position, role, scale, past_only=False,
                               softcap=0.0, check_data=True):
    """Plain-PyTorch reference, blocks of QUERY_BLOCK queries. Load-bearing choices: fp32 scores, sums and products;
    each sum shifted by its own max (m_N, m_Z; a max over nothing counts as 0), then e^(m_N - m_Z)·N / Z with the
    factor applied in two halves; 0 where Z is 0 (no visible denominator slot). Roles outside {0, 1, 2} are in
    neither sum. check_data: check the roles and past_only's promise (data reads; False in a traced body, where the
    CPU op checks instead)."""
    B, Hq, T, D, Hkv, C = check_inputs("reference_sketch_attention", q, keys, values, bias, slot_pos, cache_position,
                                       role, softcap)
    if check_data:
        check_roles(role, "reference_sketch_attention")
        if past_only:
            check_past_only(bias, slot_pos, cache_position, "reference_sketch_attention")
    G = Hq // Hkv
    kf, vf = keys.float(), values.float()
    used = (bias > float("-inf"))[:, :, None, None, :]  # [B, Hkv, 1, 1, C]
    num_role = ((role == 0) | (role == 2))[:, :, None, None, :]
    den_role = ((role == 0) | (role == 1))[:, :, None, None, :]
    sp = slot_pos[:, :, None, None, :]
    blocks = []
    for t0 in range(0, T, QUERY_BLOCK):
        qf = q[:, :, t0:t0 + QUERY_BLOCK].float()
        tb = qf.shape[2]
        z = torch.einsum("bhgtd,bhcd->bhgtc", qf.reshape(B, Hkv, G, tb, D), kf) * scale
        z = z + bias[:, :, None, None, :]
        visible = used & (sp <= cache_position[t0:t0 + tb][None, None, None, :, None])
        z_num = z.masked_fill(~(visible & num_role), float("-inf"))
        z_den = z.masked_fill(~(visible & den_role), float("-inf"))
        m_num = z_num.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)  # 0 where nothing is in the sum
        m_den = z_den.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)
        num = torch.einsum("bhgtc,bhcd->bhgtd", torch.exp(z_num - m_num), vf)
        den = torch.exp(z_den - m_den).sum(dim=-1, keepdim=True)
        half = torch.exp((m_num - m_den) * 0.5)  # e^(m_N - m_Z) in two halves (module docstring)
        out = half * (half * num / den.clamp_min(torch.finfo(torch.float32).tiny))
        blocks.append(out.masked_fill(den == 0, 0.0).reshape(B, Hq, tb, D))
    if not blocks:
        return q.new_empty((B, Hq, 0, D))
    return torch.cat(blocks, dim=2).to(q.dtype)


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA)
#
# clustered_attention's forward (kvrewrite/kernels/clustered_attention.py) with the role masks and two running
# maxima: (m_N, acc) for the numerator over roles 0 and 2, (m_Z, l) for the denominator over roles 0 and 1. Its
# launch config (_launch_config: tiles, split count from the shapes alone) and tile layout are reused as they are:
# program (split, b * Hkv + h, row block), rows = t * G + g. With several splits each program writes (acc, m_N,
# m_Z, l) and _sketch_attention_combine_kernel merges them, each sum against its own overall max.
# ---------------------------------------------------------------------------------------------------


@triton_jit(do_not_specialize=["Hkv", "G", "T", "C", "NUM_SPLITS"])
def _sketch_attention_fwd_kernel(
    Q, K, V, BIAS, POS, CPOS, ROLE,
    OUT,  # [B, Hq, T, D] q's dtype (SPLIT False), or fp32 partial acc [B * Hq * T, NUM_SPLITS, D]
    MN_PART, MZ_PART, L_PART,  # fp32 [B * Hq * T, NUM_SPLITS]: log2-domain maxima and the denominator (SPLIT)
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    stride_rb, stride_rh, stride_rc,
    Hkv, G, T, C, slots_per_split, qk_scale,  # qk_scale = scale * log2(e)
    NUM_SPLITS,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SKIP_UNSEEN: tl.constexpr,  # predicate off K/V reads no row needs (and V reads of denominator-only slots)
    LOAD_POS: tl.constexpr,  # False (past_only): slot_pos is not read, every used slot is visible
    CAUSAL_SKIP: tl.constexpr,  # test causality per element only in tiles holding a slot after the block's first query
):
    LOG2E: tl.constexpr = 1.4426950408889634
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    Hq = Hkv * G

    # -- rows of the tile: (query t, head g of the group); q stays in registers for the whole slot range --------
    rows, row_ok, t, hq, offs_d = block_rows(h, pid_m, G, T, BLOCK_M, HEAD_DIM)
    q, qpos, qpos_min, qpos_max, q_rel = query_block(Q, CPOS, b, row_ok, t, hq, offs_d, stride_qb, stride_qh,
                                                     stride_qt, stride_qd)

    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    pos_base = POS + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph
    role_base = ROLE + b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh
    out_row = (b.to(tl.int64) * Hq + hq) * T + t

    m_n = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # numerator's running max (roles 0, 2)
    m_z = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # denominator's running max (roles 0, 1)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    n_start = pid_s * slots_per_split
    n_end = tl.minimum(n_start + slots_per_split, C)
    for n0 in range(n_start, n_end, BLOCK_N):
        # -- slot metadata: bias (-inf = empty), role, position relative to the block's first query ----
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_end
        bias = tl.load(bias_base + offs_n * stride_bc, mask=n_ok, other=float("-inf"))
        role = tl.load(role_base + offs_n * stride_rc, mask=n_ok, other=3)
        in_num = (role == 0) | (role == 2)
        in_den = (role == 0) | (role == 1)
        if LOAD_POS:
            pos = tl.load(pos_base + offs_n * stride_pc, mask=n_ok, other=0)
            p_rel = tl.minimum(tl.maximum(pos - qpos_min, -1), 2**30).to(tl.int32)
            if SKIP_UNSEEN:
                need = (bias > float("-inf")) & (pos <= qpos_max)
            else:
                need = n_ok
        else:
            if SKIP_UNSEEN:
                need = bias > float("-inf")
            else:
                need = n_ok
        bias2 = tl.where(need, bias * LOG2E, float("-inf"))

        # -- scores: scale * q·k + bias (base 2), -inf where the slot is not visible to the row -------
        k = tl.load(k_base + offs_n[:, None] * stride_kc + offs_d[None, :] * stride_kd, mask=need[:, None], other=0.0)
        if Q.dtype.element_ty == tl.float32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        s = (qk * qk_scale).to(tl.float32) + bias2[None, :]
        if LOAD_POS:
            if CAUSAL_SKIP:
                if tl.max(tl.where(need, p_rel, -1), axis=0) > 0:
                    s = tl.where(p_rel[None, :] <= q_rel[:, None], s, float("-inf"))
            else:
                s = tl.where(p_rel[None, :] <= q_rel[:, None], s, float("-inf"))

        # -- denominator: its own online max (a row that has seen nothing keeps m = -inf, l = 0) -----
        s_z = tl.where(in_den[None, :], s, float("-inf"))
        m_z_new = tl.maximum(m_z, tl.max(s_z, axis=1))
        base_z = tl.where(m_z_new == float("-inf"), 0.0, m_z_new)
        l_i = l_i * tl.exp2(m_z - base_z) + tl.sum(tl.exp2(s_z - base_z[:, None]), axis=1)
        m_z = m_z_new

        # -- numerator: its own online max, p @ v ----------------------------------------------------
        s_n = tl.where(in_num[None, :], s, float("-inf"))
        m_n_new = tl.maximum(m_n, tl.max(s_n, axis=1))
        base_n = tl.where(m_n_new == float("-inf"), 0.0, m_n_new)
        alpha = tl.exp2(m_n - base_n)
        p = tl.exp2(s_n - base_n[:, None])
        if SKIP_UNSEEN:  # a denominator-only slot's value is never used: not read
            v_need = need & in_num
        else:
            v_need = need
        v = tl.load(v_base + offs_n[:, None] * stride_vc + offs_d[None, :] * stride_vd, mask=v_need[:, None],
                    other=0.0)
        if V.dtype.element_ty == tl.float32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(V.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_n = m_n_new

    # -- epilogue: output row (b, hq, t), contiguous [B, Hq, T, D] --------------------------------------
    if SPLIT:
        tl.store(OUT + (out_row[:, None] * NUM_SPLITS + pid_s) * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(MN_PART + out_row * NUM_SPLITS + pid_s, m_n, mask=row_ok)
        tl.store(MZ_PART + out_row * NUM_SPLITS + pid_s, m_z, mask=row_ok)
        tl.store(L_PART + out_row * NUM_SPLITS + pid_s, l_i, mask=row_ok)
    else:
        base_n = tl.where(m_n == float("-inf"), 0.0, m_n)
        base_z = tl.where(m_z == float("-inf"), 0.0, m_z)
        half = tl.exp2((base_n - base_z) * 0.5)  # 2^(m_N - m_Z) in two halves (module docstring)
        o = (acc * (half / tl.where(l_i > 0.0, l_i, 1.0))[:, None]) * half[:, None]
        o = tl.where((l_i > 0.0)[:, None], o, 0.0)  # no visible denominator slot: 0
        tl.store(OUT + out_row[:, None] * HEAD_DIM + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@triton_jit(do_not_specialize=["NUM_SPLITS"])
def _sketch_attention_combine_kernel(ACC, MN_PART, MZ_PART, L_PART, OUT, NUM_SPLITS, HEAD_DIM: tl.constexpr,
                                     BLOCK_S: tl.constexpr):
    """Merge one output row's split partials (program = row of [B * Hq * T]): numerator and denominator each
    rescaled to its own overall max (splits that saw nothing of a sum weigh 0 in it), then out = 2^(M_N - M_Z)
    N / Z, 0 where Z = 0. clustered_attention's combine_row merges one max, so it cannot serve here."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    m_n = tl.load(MN_PART + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m_z = tl.load(MZ_PART + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    l = tl.load(L_PART + row * NUM_SPLITS + offs_s, mask=s_ok, other=0.0)
    top_n = tl.max(m_n, axis=0)
    top_z = tl.max(m_z, axis=0)
    base_n = tl.where(top_n == float("-inf"), 0.0, top_n)
    base_z = tl.where(top_z == float("-inf"), 0.0, top_z)
    den = tl.sum(tl.exp2(m_z - base_z) * l, axis=0)
    acc = tl.load(ACC + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None],
                  other=0.0)
    num = tl.sum(acc * tl.exp2(m_n - base_n)[:, None], axis=0)
    half = tl.exp2((base_n - base_z) * 0.5)  # 2^(M_N - M_Z) in two halves (module docstring)
    o = (num * (half / tl.where(den > 0.0, den, 1.0))) * half
    o = tl.where(den > 0.0, o, 0.0)
    tl.store(OUT + row * HEAD_DIM + offs_d, o.to(OUT.dtype.element_ty))


def triton_sketch_attention(q, keys, values, bias, slot_pos, cache_position, role, scale, past_only=False,
                            softcap=0.0, **tuning):
    """The op on CUDA through Triton; validates shapes, dtypes, devices and D, not the data (roles, past_only's
    promise). ``tuning`` overrides clustered_attention's launch choices (block_m, block_n, num_splits, num_warps,
    num_stages, skip_unseen; a prefill launch takes the tiles, warps and stages), prefill_kernel (PREFILL_KERNEL) and
    full_tiles (the prefill kernel's); for the tests and benchmarks, the op never passes it."""
    if triton is None:
        raise NotImplementedError("triton_sketch_attention needs Triton (pip install triton); "
                                  "kvrewrite::sketch_attention itself runs without it")
    name = "triton_sketch_attention"
    D, C = check_inputs(name, q, keys, values, bias, slot_pos, cache_position, role, softcap)[3::2]
    if D not in _HEAD_DIMS:
        raise ValueError(f"{name}: head dim D must be one of {_HEAD_DIMS}, got D={D}")
    if C == 0:
        raise ValueError(f"{name}: the state has no slots (C = 0)")
    check_one_cuda_device(name, (q, keys, values, bias, slot_pos, cache_position, role))
    return _launch(q, keys, values, bias, slot_pos, cache_position, role, scale, past_only, **tuning)


def _launch(q, keys, values, bias, slot_pos, cache_position, role, scale, past_only=False, causal_skip=True,
            **overrides):
    """Allocate the output (and the split partials), launch the slot loop, then the combine when split; with
    prefill_kernel (default PREFILL_KERNEL) a block of more than 16 rows goes to _sketch_prefill_kernels.py. No checks:
    Triton's interpreter (TRITON_INTERPRET=1) runs it on CPU tensors (tests/kernels/test_sketch_attention_triton.py).
    past_only: the decode kernel never reads slot_pos (LOAD_POS False; the caller's promise); the prefill kernel reads
    it for its tile ranges either way."""
    # int(): the launch depends on the shapes, so a dynamic-shape trace specialises on them (a guard)
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C = int(keys.shape[1]), int(keys.shape[2])
    G = Hq // Hkv
    prefill_kernel = overrides.pop("prefill_kernel", PREFILL_KERNEL)
    full_tiles = overrides.pop("full_tiles", None)
    if prefill_kernel and G * T > 16 and B * Hq * T * D > 0:  # a prefill chunk (the decode launch takes <= 16 rows)
        return _sketch_prefill.launch_sketch_prefill(q, keys, values, bias, slot_pos, cache_position, role,
                                                     scale * 1.4426950408889634, full_tiles,
                                                     **_prefill.prefill_overrides(overrides))
    if full_tiles is not None:
        raise ValueError("sketch_attention: full_tiles tunes the prefill kernel (_sketch_prefill_kernels.py); this "
                         f"launch takes the decode kernel (G * T = {G * T}, prefill_kernel {prefill_kernel})")
    out = torch.empty((B, Hq, T, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    num_sms = _num_sms(q.device) if q.is_cuda else 8  # 8: Triton's interpreter on CPU tensors
    cfg = _launch_config(B, Hkv, G, T, C, D, num_sms, q.element_size(), **overrides)
    S = cfg["num_splits"]
    split = S > 1
    if split:
        part = torch.empty((B * Hq * T, S, D), dtype=torch.float32, device=q.device)
        mn, mz, lp = (torch.empty((B * Hq * T, S), dtype=torch.float32, device=q.device) for _ in range(3))
    else:
        part = mn = mz = lp = out  # the partials are never touched without splits
    wrap_triton(_sketch_attention_fwd_kernel)[(S, B * Hkv, cfg["m_blocks"])](
        q, keys, values, bias, slot_pos, cache_position, role, part, mn, mz, lp,
        *q.stride(), *keys.stride(), *values.stride(), *bias.stride(), *slot_pos.stride(), *role.stride(),
        Hkv, G, T, C, cfg["slots_per_split"], scale * 1.4426950408889634, S,
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], SPLIT=split, SKIP_UNSEEN=cfg["skip_unseen"],
        LOAD_POS=not past_only, CAUSAL_SKIP=causal_skip, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split:
        wrap_triton(_sketch_attention_combine_kernel)[(B * Hq * T,)](
            part, mn, mz, lp, out, S, HEAD_DIM=D, BLOCK_S=max(triton.next_power_of_2(S), 2), num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------


@torch.library.custom_op("kvrewrite::sketch_attention_cpu", mutates_args=(), device_types="cpu")
def sketch_attention_cpu(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    role: torch.Tensor,
    scale: float,
    past_only: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The CPU path of kvrewrite::sketch_attention, an opaque op of its own: the reference with its data checks
    (the roles, past_only's promise: host reads a traced body may not do, so the triton_op calls this op)."""
    return reference_sketch_attention(q, keys, values, bias, slot_pos, cache_position, role, scale, past_only,
                                      softcap).contiguous()


@sketch_attention_cpu.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, role, scale, past_only=False, softcap=0.0):
    check_inputs("sketch_attention", q, keys, values, bias, slot_pos, cache_position, role, softcap)
    return q.new_empty(q.shape)  # contiguous, like the real output


def sketch_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    role: torch.Tensor,
    *,
    scale: float,
    past_only: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention over exact slots and ClusterGen's sketch (module docstring).

    This body is the op's kernel, its fake (traced on fake tensors) and, under torch.compile, what Inductor inlines:
    no data-dependent Python. CPU calls the opaque kvrewrite::sketch_attention_cpu, CUDA launches the Triton kernel
    (KERNELS_CHECKED_ON_GPU), other devices run the reference without its data checks.
    """
    if q.is_cuda and triton is not None and KERNELS_CHECKED_ON_GPU:
        return triton_sketch_attention(q, keys, values, bias, slot_pos, cache_position, role, scale, past_only,
                                       softcap)
    check_inputs(NAME, q, keys, values, bias, slot_pos, cache_position, role, softcap)
    if q.device.type == "cpu":
        return torch.ops.kvrewrite.sketch_attention_cpu(q, keys, values, bias, slot_pos, cache_position, role, scale,
                                                        past_only, softcap)
    return reference_sketch_attention(q, keys, values, bias, slot_pos, cache_position, role, scale, past_only,
                                      softcap, check_data=False).contiguous()


sketch_attention = register_triton_op("kvrewrite::sketch_attention", sketch_attention, (), triton is not None)
