"""clustered_attention's prefill kernel for rows whose slots hold their tokens in position order (ORDERED: on).

A method that never moves a slot (`full`, ClusterKV: every token stays) appends its tokens in order: cache_append
writes at fill the tokens of consecutive cache positions, so slot j holds position j + delta, delta fixed per row (the
padding that rounds a prompt up to whole chunks takes the positions before 0: delta = -its length;
tests/methods/test_clusterkv.py checks the layout). A prefill chunk's attention over such a row is plain causal
attention by slot index: the query at position p sees the live slots j <= p - delta. _prefill_attention_kernel serves
slots in any order (per-slot positions, tile ranges, 64-row tiles that pack the GQA group); this kernel is the plain
form: one query head a program (BLOCK_M queries), the slot tiles wholly below the block's first query without a mask,
the rest up to its last query masked by slot index, the bias (-inf for padding and empty slots) added to every score.

Routing, on the device: with ORDERED (launch_prefill's `ordered`), _tile_ranges_kernel also takes, per (b, KV head)
row, the minima of position - index and of index - position over the live slots (ORDER, int64 atomics: exact in any
order); they sum to 0 exactly when every live slot sits at position index + delta (delta the first). This kernel
computes those rows and returns at once on the others, and _prefill_attention_kernel (SKIP_ORDERED) returns at once
on the rows this one takes. Any layout stays exact: a row with one slot out of order, or none live, goes to the general
kernel. Taken only without a window, soft cap or key scale (those keep the general kernel). Both load forms beat the
general kernel at every batch timed (1, 2 and 4 inside CUDA graphs, 8 eagerly: docs/bench.md "Stop 60 runs", "Stop 61
runs"), so the default takes the route wherever it can.

Loads: the keys and values through host-side TMA descriptors over the state viewed [B * Hkv, C, D], blocks [1, BLOCK_N,
D] (a tile past C reads zeros, not the next row), where `tma_refusal` allows: a Hopper-class GPU, 16-bit contiguous
device memory, real tensors (eager launches, CUDA graph capture, and `rw.compile`, which keeps the op opaque to
Inductor: runtime._OpaqueOpsCall). Pointer loads elsewhere, with their own tiles (POINTER_TILES): where Inductor or
the exporters trace the op's body (torch.compile of the model by hand, torch.export: wrap_triton outside Dynamo records
no descriptor metadata, a KeyError in triton_kernel_wrap.get_tensor_names, torch 2.11), for fp32, and for offload's
host-mapped state. Every tile loads the same way and the bias unmasked (read at min(slot, C - 1)): a masked bias load,
or pointer loads in the masked tiles, made sm_90 spill in the whole-tile loop (TMA form, 128 x 64 tiles: 17 local
stores and 36 loads a tile before, 7 and 8 now; the pointer form's 8 warps none). Dead slots (padding, past the fill)
are read and weighted 0, so their values must be finite: the state starts at zeros and cache_append writes only the
model's rows. A row out of order reads nothing (reading q first and skipping the branch spills less: 9.92 ms against
10.2-10.3 below, but costs chelsea's chunk 1-3%).

Measured (docs/bench.md "Stop 60 runs", "Stop 61 runs"; H200, bf16): ClusterKV's 2048-query chunk over 16k slots at
batch 8 10.17-10.34 ms with TMA, 10.98-11.00 with pointer loads, against the general kernel's 12.00-12.17 and cuDNN's
8.16-8.23 (SDPA over the same keys without the causal mask); `full`'s 1024-query chunk at batch 8 5.09-5.34 (TMA)
against 6.01-6.06. Inside CUDA graphs at batches 1, 2 and 4 both forms beat the general kernel: `full`'s chunk at
batch 1 0.621-0.626 ms (TMA) and 0.671-0.672 (pointer loads) against 0.776-0.781, ClusterKV's at batch 4 5.23-5.27
and 5.52-5.58 against 6.12-6.18 (eager launches at batch 1 show their host work). Rows out of order (chelsea's chunk
at batch 8): 5.46-5.48 against 5.45-5.50. ClusterKV's compiled batch-8 32k prefill (TMA: the op stays opaque):
1.14x dense in three runs with chunks of 2048 (1.13x in one with 4096), against 1.21-1.23x with the general
kernel. GPU tests: tests/kernels/test_ordered_prefill_gpu.py; without a GPU:
tests/kernels/test_ordered_prefill_triton.py.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite import offload
from kvrewrite.kernels._online_softmax import softmax_acc, softmax_probs, store_rows
from kvrewrite.kernels._pdl import gdc_launch_dependents, gdc_wait
from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs import this module too; only launching needs Triton
    triton = tl = None

# ORDERED: launch_prefill routes the rows whose slots are in position order to this kernel (above); False: every row
# to the general kernel (docs/bench.md "Stop 60 runs").
ORDERED = True
# (block_m, block_n, num_warps, num_stages) for 16-bit data and D <= 128, by load form (H200, bf16, ClusterKV's
# 2048-query chunk over 16k slots at batch 8, docs/bench.md "Stop 60 runs"). TMA: 10.17-10.34 ms (128 x 128 tiles
# with 8 warps 10.5-10.9; 128 x 64 with 8 warps 11.7-11.9, with 4 warps and 3 stages 13.7-13.9). Pointer loads (under
# torch.compile / torch.export tracing): 128 x 64, 8 warps, 3 stages 10.98-11.00 ms (4 warps, 2 stages 11.40-11.45:
# its tile loop spills on sm_90; 128 x 128 with 8 warps 11.41-11.42; 64 x 64 11.89-11.94). Halved where the tiles
# would pass shared memory (fp32, D = 256).
TILES = (128, 64, 4, 2)
POINTER_TILES = (128, 64, 8, 3)


def launch_config(D: int, itemsize: int, tma: bool, block_m=None, block_n=None, num_warps=None,
                  num_stages=None) -> dict:
    """Tiles, warps and stages of _ordered_prefill_kernel for its load form; keyword overrides for the tests and the
    bench."""
    m, n, w, s = TILES if tma else POINTER_TILES
    if D * itemsize > 256:  # fp32 at D 128, or D 256: the stages of K and V tiles and q within shared memory
        m, n, w, s = 64, 32, 4, 2
    return dict(block_m=block_m or m, block_n=block_n or n, num_warps=num_warps or w, num_stages=num_stages or s)


def routable(keys, values, window: int, softcap: float, key_scale) -> bool:
    """Can launch_prefill offer the rows of this call to the ordered kernel? No window, soft cap or key scale, and
    contiguous keys and values of fewer than 2**31 rows of B * Hkv * C (the kernel indexes them flat)."""
    return (window == 0 and softcap == 0 and key_scale is None and keys.is_contiguous() and values.is_contiguous()
            and keys.shape == values.shape and keys.numel() // max(int(keys.shape[-1]), 1) < 2**31)


def tma_refusal(keys, values):
    """Why the tiles cannot take TMA descriptors (a phrase), or None."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(keys):
        return "tracing (torch.compile / torch.export): no descriptor metadata outside Dynamo"
    if not keys.is_cuda or torch.cuda.get_device_capability(keys.device)[0] < 9:
        return "a CUDA device of compute capability 9.0 or newer"
    if keys.element_size() != 2 or keys.dtype != values.dtype:
        return f"16-bit keys and values (got {keys.dtype}, {values.dtype})"
    if int(keys.shape[-1]) * 2 % 16 or keys.data_ptr() % 16 or values.data_ptr() % 16:
        return "16-byte aligned rows"
    if offload.is_host_memory(keys) or offload.is_host_memory(values):
        return "keys and values in device memory (these are offload's host-mapped state)"
    return None


@triton_jit()
def _kv_tile(DESC, PTR, bh, start, row0, offs_n, n_ok, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
             TMA: tl.constexpr):
    """The keys or values [BLOCK_N, HEAD_DIM] of slots offs_n = start + [0, BLOCK_N) of row bh: through the descriptor
    (zeros from C on) with TMA, else pointer loads from row0 = bh * C, 0 where n_ok is False."""
    if TMA:
        return DESC.load([bh, start, 0]).reshape(BLOCK_N, HEAD_DIM)
    offs_d = tl.arange(0, HEAD_DIM)
    return tl.load(PTR + (row0 + offs_n).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], mask=n_ok[:, None],
                   other=0.0)


@triton_jit()
def _ordered_tile(m_i, l_i, acc, q, j, K, V, K_DESC, V_DESC, bh, row0, bias_base, stride_bc, qslot, C, qk_scale,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr):
    """The online softmax after slot tile j: (m_i, l_i, acc). qslot: each query's own slot (position - delta, at most
    C - 1). MASKED: some query of the block does not see some slot of the tile (a slot past its own, or from C on).
    TMA: the keys and values through the descriptors over [B * Hkv, C, D], which read zeros from C on; else pointer
    loads masked there. The bias is read at min(slot, C - 1), always in bounds: the mask drops the slots from C on
    (qslot < C). Every tile loads the same way and the bias unmasked: what keeps sm_90's whole-tile loop from
    spilling (module docstring)."""
    start = j * BLOCK_N
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = offs_n < C
    else:
        n_ok = tl.full([BLOCK_N], 1, tl.int1)
    k = _kv_tile(K_DESC, K, bh, start, row0, offs_n, n_ok, BLOCK_N, HEAD_DIM, TMA)
    if q.dtype == tl.float32:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if MASKED:
        bias = tl.load(bias_base + tl.minimum(offs_n, C - 1) * stride_bc)
    else:
        bias = tl.load(bias_base + offs_n * stride_bc)
    s = qk * qk_scale + (bias * 1.4426950408889634)[None, :]
    if MASKED:
        s = tl.where(offs_n[None, :] <= qslot[:, None], s, float("-inf"))
    m_new, l_i, alpha, p = softmax_probs(m_i, l_i, s)
    v = _kv_tile(V_DESC, V, bh, start, row0, offs_n, n_ok, BLOCK_N, HEAD_DIM, TMA)
    return m_new, l_i, softmax_acc(acc, alpha, p, v)


# Shape ints that only bound loops and masks are not specialised on: one compiled kernel per dtype, D and tiles.
@triton_jit(do_not_specialize=["Hkv", "G", "T", "C"])
def _ordered_prefill_kernel(
    Q, K, V, BIAS, CPOS,  # as _prefill_attention_kernel's; K and V contiguous [B, Hkv, C, D]
    ORDER,  # int64 [B * Hkv, 2] from _tile_ranges_kernel: min(position - index), min(index - position)
    K_DESC, V_DESC,  # TMA: descriptors of K and V viewed [B * Hkv, C, D], blocks [1, BLOCK_N, D]; else K and V
    OUT,  # [B, Hq, T, D] q's dtype
    LSE,  # fp32 [B * Hq * T] (WRITE_LSE only)
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_bb, stride_bh, stride_bc,
    Hkv, G, T, C, qk_scale,  # qk_scale = scale * log2(e)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid_m = tl.program_id(0)  # fastest: the query blocks of one head, then the heads of a group, share K/V in L2
    pid_q = tl.program_id(1)  # b * Hq + hq
    Hq = Hkv * G
    b = pid_q // Hq
    h = (pid_q % Hq) // G
    bh = b * Hkv + h
    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = t < T
    offs_d = tl.arange(0, HEAD_DIM)
    delta = tl.load(ORDER + bh.to(tl.int64) * 2)
    # every live slot j at position j + delta; else the general kernel's row, nothing read (an early return here
    # compiles to the same sm_90 code)
    if delta + tl.load(ORDER + bh.to(tl.int64) * 2 + 1) == 0:
        q = tl.load(Q + b.to(tl.int64) * stride_qb + (pid_q % Hq).to(tl.int64) * stride_qh + t[:, None] * stride_qt
                    + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        # each query's own slot (position - delta) clamped to [-1, C - 1], in int32 (int64 compares cost two
        # instructions an element): a query below slot -1 sees nothing, as -1 does; one past C - 1 every slot
        # below C
        qslot = tl.minimum(tl.maximum(tl.load(CPOS + t, mask=row_ok, other=0) - delta, -1), C - 1).to(tl.int32)
        s_lo = tl.min(tl.where(row_ok, qslot, C), axis=0)
        s_hi = tl.max(tl.where(row_ok, qslot, -1), axis=0)
        # tiles [0, n_whole): every slot at or before every query's own, inside C; [n_whole, n_end): masked; past
        # n_end no query sees a slot (a slot index below 0 or a query before slot 0 leaves the loops empty)
        n_end = tl.where(s_hi < 0, 0, tl.minimum(s_hi // BLOCK_N + 1, tl.cdiv(C, BLOCK_N)))
        n_whole = tl.minimum(tl.minimum((s_lo + 1) // BLOCK_N, C // BLOCK_N), n_end)
        row0 = bh * C  # < 2**31 (routable)
        bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for j in range(0, n_whole):  # every slot at or before every query's own, inside C
            m_i, l_i, acc = _ordered_tile(m_i, l_i, acc, q, j, K, V, K_DESC, V_DESC, bh, row0, bias_base, stride_bc,
                                          qslot, C, qk_scale, BLOCK_N, HEAD_DIM, TMA, False)
        for j in range(n_whole, n_end):
            m_i, l_i, acc = _ordered_tile(m_i, l_i, acc, q, j, K, V, K_DESC, V_DESC, bh, row0, bias_base, stride_bc,
                                          qslot, C, qk_scale, BLOCK_N, HEAD_DIM, TMA, True)
        store_rows(OUT, LSE, pid_q.to(tl.int64) * T + t, row_ok, offs_d, acc, m_i, l_i, HEAD_DIM, WRITE_LSE)


def launch_ordered(q, keys, values, bias, cache_position, order, out, lse, qk_scale, pdl, launch, tma=None, **tiles):
    """Launch _ordered_prefill_kernel into `out` (and `lse`) for the ordered rows of `order` (_prefill_attention_kernels
    .order_stats, filled by tile_ranges). tma: None (TMA where tma_refusal allows), True (forced: ValueError naming
    what refuses it, except on CPU tensors, where Triton's interpreter takes descriptors), False. tiles:
    launch_config's overrides."""
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C = int(keys.shape[1]), int(keys.shape[2])
    why = tma_refusal(keys, values) if tma is not False else "off"
    if tma is True and why is not None and keys.is_cuda:
        raise ValueError(f"ordered prefill: tma=True needs {why}")
    use_tma = tma is not False and (why is None or (tma is True and not keys.is_cuda))
    cfg = launch_config(D, q.element_size(), use_tma, **tiles)
    k_desc, v_desc = keys, values
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k_desc = TensorDescriptor.from_tensor(keys.view(B * Hkv, C, D), [1, cfg["block_n"], D])
        v_desc = TensorDescriptor.from_tensor(values.view(B * Hkv, C, D), [1, cfg["block_n"], D])
    wrap_triton(_ordered_prefill_kernel)[(triton.cdiv(T, cfg["block_m"]), B * Hq)](
        q, keys, values, bias, cache_position, order, k_desc, v_desc, out, out if lse is None else lse,
        *q.stride(), *bias.stride(), Hkv, Hq // Hkv, T, C, qk_scale,
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], TMA=use_tma, WRITE_LSE=lse is not None, PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )
