"""kvrewrite::ems_append — give the tokens just appended by cache_append their EMS runtime slots.

EMS (contract docs/contracts/ems.md §6.1, issue 17) keeps two tables per row (b, kv-head): C entries (the base state
keys/values/bias/slot_pos of cache_append, one stored key per entry) and R runtime slots, one per token the
attention still covers (`lut` maps a slot to its entry; a merged entry owns several slots). This op runs right
after cache_append, so `fill` has already grown by T; for each row and t < T:

    e = fill - T + t,   j = slot_fill + t
    lut[j] = e;  key_scale[j] = 1;  token_pos[j] = cache_position[t];  slot_order[j] = j;  entry_start[e] = j
    raw_keys[e] = k_pre[t]   (rounded to raw_keys' dtype; skipped when raw_keys holds 0 entries: pos="with")
    slot_fill += T

- Padding tokens get entries and slots as well: their entry's bias is -inf (cache_append), so every attention
  masks them and the row's first compression drops them.
- slot_order[j] = j: the new tokens have the largest positions, so appending keeps the order sorted.
- The scores (s_glo, s_loc_past, s_loc_cur) are not written: slots >= slot_fill already hold their reset 0.
- keys and bias are read only by the checks; they keep the op's read set explicit (the future kernel's too).

Args:
    keys:           [B, Hkv, C, D] model dtype (read: shapes)
    bias:           [B, Hkv, C] fp32 (read: shapes)
    fill:           [B, Hkv] int64, entries in use, already advanced by cache_append
    k_pre:          [B, Hkv, T, D] the new tokens' pre-RoPE keys (any float dtype)
    cache_position: [T] int64; token_valid: [B, T] bool (read: shapes; padding is already in bias)
Mutates:
    entry_start [B, Hkv, C] int32; raw_keys [B, Hkv, C, D] or [B, Hkv, 0, D], model dtype;
    lut, token_pos, slot_order [B, Hkv, R] int32; key_scale [B, Hkv, R] fp32; slot_fill [B, Hkv] int64.

Capacity: the method sizes R so that slot_fill + T <= R always holds (spec §3). Past it the reference raises
IndexError from index_put_'s bounds check, after writing at most the in-range slots of `lut` (nothing else is
written and slot_fill is not advanced), as kvrewrite::cache_append's reference does.

Backends. The reference (index_put_ with device-side indices: no host read, sync-free, deterministic) is the CPU
path and the ground truth. CUDA runs the Triton kernel of kvrewrite/kernels/_ems_rank_kernels.py (_cuda_impl
decides: KERNELS_CHECKED_ON_GPU, Triton installed, a contiguous state; otherwise the reference, logged once): one
launch per layer and step, one program per row, the same state bit for bit; past R it masks its stores and slot_fill
stops at R (as cache_append's kernel; the reference raises). Checked through Triton's interpreter
(tests/kernels/test_ems_append_triton.py, fp32) and on an H100 80GB HBM3 with torch 2.11.0+cu130, Triton 3.6.0
(tests/kernels/test_ems_append_gpu.py: 20 passed, bit for bit against the reference: fp16/bf16/fp32 raw keys from
k_pre of another dtype, prefill chunks and decode steps, a CUDA graph replayed). Llama-3.1-8B shape (Hkv 8, D 128,
bf16, C 6866, R 27464), a decode step in a CUDA graph: 1.8 us (B = 1) / 1.9 us (B = 8) against the reference's 35 /
42 us. Inside the rewritten model too: tests/methods/test_ems_gpu.py (4 passed, eager and
rw.compile(mode="reduce-overhead"), the same run with this kernel on). The op is an opaque
`torch.library.custom_op`.
"""
import importlib

import torch

from kvrewrite.kernels._fallbacks import reference_fallback

NAME = "kvrewrite::ems_append"


def _expect(field, t, shape, dtype):
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{NAME}: {field} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


def _check_inputs(keys, bias, fill, k_pre, cache_position, token_valid, entry_start, raw_keys, lut, key_scale,
                  token_pos, slot_order, slot_fill):
    """ValueError naming the argument, its expected shape and dtype."""
    if keys.dim() != 4:
        raise ValueError(f"{NAME}: keys must be [B, Hkv, C, D], got {list(keys.shape)}")
    B, H, C, D = keys.shape
    if k_pre.dim() != 4 or tuple(k_pre.shape[:2]) != (B, H) or k_pre.shape[3] != D:
        raise ValueError(f"{NAME}: k_pre must be [B={B}, Hkv={H}, T, D={D}], got {list(k_pre.shape)}")
    T = k_pre.shape[2]
    _expect("bias", bias, (B, H, C), torch.float32)
    _expect("fill", fill, (B, H), torch.int64)
    _expect("cache_position", cache_position, (T,), torch.int64)
    _expect("token_valid", token_valid, (B, T), torch.bool)
    _expect("entry_start", entry_start, (B, H, C), torch.int32)
    if tuple(raw_keys.shape) not in ((B, H, C, D), (B, H, 0, D)):
        raise ValueError(f"{NAME}: raw_keys must be [B, Hkv, C, D] = {[B, H, C, D]} (pos='without') or "
                         f"[B, Hkv, 0, D] (pos='with'), got {list(raw_keys.shape)}")
    if lut.dim() != 3 or tuple(lut.shape[:2]) != (B, H):
        raise ValueError(f"{NAME}: lut must be [B={B}, Hkv={H}, R], got {list(lut.shape)}")
    R = lut.shape[2]
    for field, t, dtype in (("lut", lut, torch.int32), ("key_scale", key_scale, torch.float32),
                            ("token_pos", token_pos, torch.int32), ("slot_order", slot_order, torch.int32)):
        _expect(field, t, (B, H, R), dtype)
    _expect("slot_fill", slot_fill, (B, H), torch.int64)
    tensors = (keys, bias, fill, k_pre, cache_position, token_valid, entry_start, raw_keys, lut, key_scale,
               token_pos, slot_order, slot_fill)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{NAME}: all inputs must be on one device, got {sorted({str(t.device) for t in tensors})}")


def reference_ems_append(fill, k_pre, cache_position, entry_start, raw_keys, lut, key_scale, token_pos, slot_order,
                         slot_fill):
    """The CPU path and the ground truth (module docstring). `lut` is written first: an overflowing slot index
    raises IndexError there, before any other tensor is touched."""
    B, H, T, _ = k_pre.shape
    dev = lut.device
    ar = torch.arange(T, device=dev)
    rows_b = torch.arange(B, device=dev)[:, None, None]
    rows_h = torch.arange(H, device=dev)[None, :, None]
    e = fill[:, :, None] - T + ar  # [B, H, T] the new entries
    j = slot_fill[:, :, None] + ar  # [B, H, T] their slots
    lut.index_put_((rows_b, rows_h, j), e.to(torch.int32))
    key_scale.index_put_((rows_b, rows_h, j), torch.ones((), dtype=key_scale.dtype, device=dev).expand(B, H, T))
    token_pos.index_put_((rows_b, rows_h, j), cache_position.to(torch.int32).expand(B, H, T))
    slot_order.index_put_((rows_b, rows_h, j), j.to(torch.int32))
    entry_start.index_put_((rows_b, rows_h, e), j.to(torch.int32))
    if raw_keys.shape[2] > 0:
        raw_keys.index_put_((rows_b, rows_h, e), k_pre.to(raw_keys.dtype))
    slot_fill.add_(T)


@torch.library.custom_op(NAME, mutates_args=("entry_start", "raw_keys", "lut", "key_scale", "token_pos",
                                             "slot_order", "slot_fill"))
def ems_append(
    keys: torch.Tensor,
    bias: torch.Tensor,
    fill: torch.Tensor,
    k_pre: torch.Tensor,
    cache_position: torch.Tensor,
    token_valid: torch.Tensor,
    entry_start: torch.Tensor,
    raw_keys: torch.Tensor,
    lut: torch.Tensor,
    key_scale: torch.Tensor,
    token_pos: torch.Tensor,
    slot_order: torch.Tensor,
    slot_fill: torch.Tensor,
) -> None:
    """Give the T tokens cache_append just wrote one slot each (module docstring); CPU runs the reference, CUDA the
    Triton kernel."""
    _check_inputs(keys, bias, fill, k_pre, cache_position, token_valid, entry_start, raw_keys, lut, key_scale,
                  token_pos, slot_order, slot_fill)
    reference_ems_append(fill, k_pre, cache_position, entry_start, raw_keys, lut, key_scale, token_pos, slot_order,
                         slot_fill)


# -- the CUDA path -----------------------------------------------------------------------------------
KERNELS_CHECKED_ON_GPU = True  # tests/kernels/test_ems_append_gpu.py: 20 passed on an H100


def _cuda_impl(entry_start, raw_keys, lut, key_scale, token_pos, slot_order, slot_fill, fill):
    """The Triton launcher when its GPU tests have passed, Triton imports and the state is contiguous, else None
    (the CUDA kernel then runs the reference, logged once). THE one place that decides the CUDA path."""
    if not KERNELS_CHECKED_ON_GPU:
        return None
    try:
        import triton  # noqa: F401
        mod = importlib.import_module("kvrewrite.kernels._ems_rank_kernels")
    except ImportError:
        return None
    state = (entry_start, raw_keys, lut, key_scale, token_pos, slot_order, slot_fill, fill)
    return mod.triton_ems_append if all(t.is_contiguous() for t in state) else None


@ems_append.register_kernel("cuda")
def _(keys, bias, fill, k_pre, cache_position, token_valid, entry_start, raw_keys, lut, key_scale, token_pos,
      slot_order, slot_fill):
    _check_inputs(keys, bias, fill, k_pre, cache_position, token_valid, entry_start, raw_keys, lut, key_scale,
                  token_pos, slot_order, slot_fill)
    args = (fill, k_pre, cache_position, entry_start, raw_keys, lut, key_scale, token_pos, slot_order, slot_fill)
    launcher = _cuda_impl(entry_start, raw_keys, lut, key_scale, token_pos, slot_order, slot_fill, fill)
    if launcher is not None:
        launcher(*args)
        return
    reference_fallback("ems_append: CUDA runs the tensor reference (the Triton kernel needs Triton, a contiguous "
                       "state, and its GPU tests passed: KERNELS_CHECKED_ON_GPU=%s)", KERNELS_CHECKED_ON_GPU)
    reference_ems_append(*args)


@ems_append.register_fake
def _(keys, bias, fill, k_pre, cache_position, token_valid, entry_start, raw_keys, lut, key_scale, token_pos,
      slot_order, slot_fill):
    return None
