"""kvrewrite::cache_append — write the new tokens' keys and values into a layer's slot state.

State of one layer (all mutated in place):
    keys:     [B, Hkv, C, D]   model dtype
    values:   [B, Hkv, C, D]   model dtype
    bias:     [B, Hkv, C]      fp32, log of the slot's degree (0 for an exact token, -inf for empty)
    slot_pos: [B, Hkv, C]      int64, cache position of the slot (max over a merged slot's tokens)
    fill:     [B, Hkv]         int64, slots in use per row (the append pointer)
New tokens:
    k_new, v_new:   [B, Hkv, T, D]
    cache_position: [T] int64, the tokens' cache positions (shared by the batch, pads included)
    token_valid:    [B, T] bool, False for padding (its slot gets bias -inf and is never attended)

Slots [fill, fill + T) of each (b, h) row are written and fill grows by T. The write index is
computed on the device (fill + arange(T), an index_put_), so the op never syncs with the host. Rows keep
their own fill because compression may leave them different (outlier heads are never compressed).

Capacity: the runtime guarantees fill + T <= C (kvrewrite.host refuses a prompt or a decode step that
would pass it, before launching anything). Past it, no backend writes outside the state: the Triton
kernel masks its stores to slots < C, so a row's tokens that do not fit are dropped and its fill
stops at C (min(fill + T, C): every op reading the fill stays inside the state); the reference raises
IndexError from index_put_'s bounds check, after writing at most the slots [fill, C) of `keys` (fill
is not advanced). On CUDA without Triton the reference's index_put_ fails a device-side assert instead.

Backends: CUDA runs the Triton kernel below (one launch per call: each program moves a block of
tokens of one row; with a single block per row the program also advances the fill, otherwise a
second tiny launch does, after every program has read it); other devices run the reference, an
index_put_. The op is a `torch.library.triton_op`, so Inductor sees the kernel and CUDA graphs work.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import torch
from torch.library import wrap_triton

from kvrewrite.kernels import _pdl
from kvrewrite.kernels._pdl import gdc_launch_dependents, gdc_wait
from kvrewrite.kernels._triton_op import check_one_cuda_device, register_triton_op, triton_jit

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its reference; only triton_cache_append raises
    triton = tl = None

NEG_INF = float("-inf")


def reference_cache_append(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid):
    """Plain-PyTorch reference; an index_put_ with a device-side index keeps it sync-free.

    index_put_, not scatter_: under torch.compile the op's body is inlined on non-CUDA devices, and
    Inductor's reinplace pass turns the functionalised index_put back into an in-place write into the
    state; a functional scatter would become a copy of the layer's whole state (and a copy back)."""
    B, Hkv, T, D = k_new.shape
    idx = fill[:, :, None] + torch.arange(T, device=keys.device)  # [B, Hkv, T]
    dev = keys.device
    rows = (torch.arange(B, device=dev)[:, None, None], torch.arange(Hkv, device=dev)[None, :, None], idx)
    keys.index_put_(rows, k_new.to(keys.dtype))
    values.index_put_(rows, v_new.to(values.dtype))
    new_bias = torch.zeros(B, T, dtype=bias.dtype, device=bias.device).masked_fill(~token_valid, NEG_INF)
    bias.index_put_(rows, new_bias[:, None, :].expand(B, Hkv, T))
    slot_pos.index_put_(rows, cache_position.to(slot_pos.dtype)[None, None, :].expand(B, Hkv, T))
    fill.add_(T)


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA)
# ---------------------------------------------------------------------------------------------------


@triton_jit(do_not_specialize=["Hkv", "T", "D", "C"])
def _cache_append_kernel(
    K, V, BIAS, POS, FILL, KN, VN, CPOS, VALID,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_bb, stride_bh, stride_bc,
    stride_pb, stride_ph, stride_pc,
    stride_fb, stride_fh,
    stride_knb, stride_knh, stride_knt, stride_knd,
    stride_vnb, stride_vnh, stride_vnt, stride_vnd,
    stride_cp, stride_tb, stride_tt,
    Hkv, T, D, C,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    UPDATE_FILL: tl.constexpr,  # the grid has one token block per row: this program advances the fill
    PDL: tl.constexpr,  # launched with PDL: wait for the previous kernel before any load (kernels/_pdl.py)
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    b = (row // Hkv).to(tl.int64)
    h = (row % Hkv).to(tl.int64)
    fill_ptr = FILL + b * stride_fb + h * stride_fh
    f = tl.load(fill_ptr).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    offs_d = tl.arange(0, BLOCK_D)
    m2 = t_ok[:, None] & (offs_d < D)[None, :]
    slot = f + offs_t
    # stores stop at the capacity: slots >= C lie outside the row (see "Capacity" in the module docstring)
    s_ok = t_ok & (slot < C)
    s2 = m2 & s_ok[:, None]

    kn = tl.load(KN + b * stride_knb + h * stride_knh + offs_t[:, None] * stride_knt + offs_d[None, :] * stride_knd,
                 mask=m2)
    tl.store(K + b * stride_kb + h * stride_kh + slot[:, None] * stride_kc + offs_d[None, :] * stride_kd,
             kn.to(K.dtype.element_ty), mask=s2)
    vn = tl.load(VN + b * stride_vnb + h * stride_vnh + offs_t[:, None] * stride_vnt + offs_d[None, :] * stride_vnd,
                 mask=m2)
    tl.store(V + b * stride_vb + h * stride_vh + slot[:, None] * stride_vc + offs_d[None, :] * stride_vd,
             vn.to(V.dtype.element_ty), mask=s2)

    valid = tl.load(VALID + b * stride_tb + offs_t * stride_tt, mask=t_ok, other=0)
    tl.store(BIAS + b * stride_bb + h * stride_bh + slot * stride_bc, tl.where(valid != 0, 0.0, float("-inf")),
             mask=s_ok)
    cp = tl.load(CPOS + offs_t * stride_cp, mask=t_ok, other=0)
    tl.store(POS + b * stride_pb + h * stride_ph + slot * stride_pc, cp.to(POS.dtype.element_ty), mask=s_ok)
    if UPDATE_FILL:
        tl.store(fill_ptr, tl.minimum(f + T, C))


@triton_jit(do_not_specialize=["Hkv", "T", "C"])
def _cache_append_fill_kernel(FILL, stride_fb, stride_fh, Hkv, T, C):
    # a multi-block call's fill update, one program per row, after every token block has read the old fill
    row = tl.program_id(0)
    fill_ptr = FILL + (row // Hkv).to(tl.int64) * stride_fb + (row % Hkv).to(tl.int64) * stride_fh
    f = tl.load(fill_ptr).to(tl.int64)
    tl.store(fill_ptr, tl.minimum(f + T, C))


# Launch (H100 sweep over BLOCK_T x num_warps, 32 layer states of the Llama-3.1-8B layout, CUDA graphs): the
# kernel is fastest with 4 elements of K (and of V) per thread, whatever the block: BLOCK_T 4 / 8 / 16 with
# 4 / 8 / 16 warps at D = 128 moved a 256-token chunk at B = 8 in 8.5-8.9 us, while 8 or more elements per
# thread took 19-26 us and 2 per thread 11 us (B = 8, T = 2048: 54 vs 114 us; B = 1, T = 2048: 8.5 vs 22.7 us).
# A call of up to SINGLE_BLOCK_ELEMENTS per row runs one block per row, which also advances the fill (no
# second launch: at T = 5 that is 2.1 instead of 3.3 us); longer calls take blocks of BLOCK_ELEMENTS.
ELEMENTS_PER_THREAD = 4
BLOCK_ELEMENTS = 512  # BLOCK_T * BLOCK_D of a multi-block call's program (4 warps)
SINGLE_BLOCK_ELEMENTS = 2048  # at most 16 warps


def _check_inputs(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid):
    """Shape and dtype checks of the op (every device); names what is wrong."""
    name = "kvrewrite::cache_append"
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"{name}: keys and values must be one shape [B, Hkv, C, D], "
                         f"got {tuple(keys.shape)}, {tuple(values.shape)}")
    B, Hkv, C, D = keys.shape
    if k_new.dim() != 4 or tuple(k_new.shape[:2]) != (B, Hkv) or k_new.shape[3] != D or v_new.shape != k_new.shape:
        raise ValueError(f"{name}: k_new and v_new must be [B={B}, Hkv={Hkv}, T, D={D}], "
                         f"got {tuple(k_new.shape)}, {tuple(v_new.shape)}")
    T = k_new.shape[2]
    if tuple(bias.shape) != (B, Hkv, C) or tuple(slot_pos.shape) != (B, Hkv, C) or tuple(fill.shape) != (B, Hkv):
        raise ValueError(f"{name}: expected bias and slot_pos [B, Hkv, C] = {(B, Hkv, C)} and fill [B, Hkv], got "
                         f"{tuple(bias.shape)}, {tuple(slot_pos.shape)}, {tuple(fill.shape)}")
    if tuple(cache_position.shape) != (T,) or tuple(token_valid.shape) != (B, T):
        raise ValueError(f"{name}: expected cache_position [T] = ({T},) and token_valid [B, T] = {(B, T)}, "
                         f"got {tuple(cache_position.shape)}, {tuple(token_valid.shape)}")
    if token_valid.dtype != torch.bool or fill.dtype != torch.int64:
        raise TypeError(f"{name}: expected token_valid bool and fill int64, got {token_valid.dtype}, {fill.dtype}")


def triton_cache_append(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid) -> None:
    """The op on CUDA through Triton (shapes in the module docstring); validates its inputs."""
    if triton is None:
        raise NotImplementedError("triton_cache_append needs Triton (pip install triton); "
                                  "kvrewrite::cache_append itself runs without it")
    _check_inputs(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid)
    check_one_cuda_device("triton_cache_append", (keys, values, bias, slot_pos, fill, k_new, v_new, cache_position,
                                                  token_valid))
    _launch(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid)


def _launch(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid) -> None:
    # int(): the launch depends on the shapes, so a dynamic-shape trace specialises on them (a guard)
    B, Hkv, T, D = (int(n) for n in k_new.shape)
    C = int(keys.shape[2])
    if B * Hkv == 0 or T == 0:
        return
    block_d = max(triton.next_power_of_2(D), 16)
    block_t = triton.next_power_of_2(T)
    if block_t * block_d > SINGLE_BLOCK_ELEMENTS:
        block_t = max(BLOCK_ELEMENTS // block_d, 1)
    t_blocks = triton.cdiv(T, block_t)
    num_warps = min(max(block_t * block_d // (32 * ELEMENTS_PER_THREAD), 4), 16)
    pdl, launch = _pdl.launch_options(keys)
    wrap_triton(_cache_append_kernel)[(B * Hkv, t_blocks)](
        keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid,
        *keys.stride(), *values.stride(), *bias.stride(), *slot_pos.stride(), *fill.stride(),
        *k_new.stride(), *v_new.stride(), *cache_position.stride(), *token_valid.stride(),
        Hkv, T, D, C, BLOCK_T=block_t, BLOCK_D=block_d, UPDATE_FILL=t_blocks == 1, PDL=pdl, num_warps=num_warps,
        **launch,
    )
    if t_blocks > 1:  # after every program has read the old fill (stream order); one launch, like fill.add_(T)
        wrap_triton(_cache_append_fill_kernel)[(B * Hkv,)](fill, *fill.stride(), Hkv, T, C, num_warps=1)


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------


def cache_append(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    fill: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_position: torch.Tensor,
    token_valid: torch.Tensor,
) -> None:
    """Append T tokens to the slot state of one layer (see the module docstring for shapes).

    The op's kernel, fake and what Inductor inlines (see _triton_op.py): CUDA launches the Triton
    kernel, other devices run the reference index_put_ (traceable: no host reads)."""
    if keys.is_cuda and triton is not None:
        triton_cache_append(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid)
        return
    _check_inputs(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid)
    reference_cache_append(keys, values, bias, slot_pos, fill, k_new, v_new, cache_position, token_valid)


cache_append = register_triton_op("kvrewrite::cache_append", cache_append,
                                  ("keys", "values", "bias", "slot_pos", "fill"), triton is not None)
