"""Shared by the ops with Triton kernels: ``triton_op`` registration, ``triton_jit``, input checks.

A triton_op's body is its kernel, its fake (it is traced on fake tensors) and, under torch.compile,
what Inductor inlines: CUDA launches Triton through ``wrap_triton`` (Inductor sees the kernel, CUDA
graphs capture it), other devices run plain PyTorch. `rw.compile` keeps the ops whole instead (Inductor
calls the op, whose body launches the kernel: runtime.py KVRewrittenModel.compile); torch.compile of
the model by hand, torch.export and AOTInductor inline the body.
"""
import logging

import torch

try:
    import triton
except ImportError:  # CPU-only installs import the kernel modules too; only launching needs Triton
    triton = None


def triton_jit(**options):
    """``triton.jit(**options)``, or the function left as plain Python where Triton is not installed."""
    return lambda fn: fn if triton is None else triton.jit(fn, **options)


def check_query_keys(name: str, q, keys) -> tuple:
    """ValueError naming the op and the shapes unless q is [B, Hq, T, D], keys [B, Hkv, C, D] and Hq a multiple
    of Hkv >= 1 (GQA); returns (B, Hq, T, D, Hkv, C)."""
    if q.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"{name}: expected q [B, Hq, T, D] and keys [B, Hkv, C, D], "
                         f"got q {tuple(q.shape)}, keys {tuple(keys.shape)}")
    B, Hq, T, D = q.shape
    Hkv, C = keys.shape[1], keys.shape[2]
    if keys.shape[0] != B or keys.shape[3] != D:
        raise ValueError(f"{name}: keys must be [B={B}, Hkv, C, D={D}] like q, got {tuple(keys.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{name}: Hq must be a multiple of Hkv >= 1 (GQA), got Hq={Hq}, Hkv={Hkv}")
    return B, Hq, T, D, Hkv, C


def check_attention_shapes(name: str, q, keys, bias, slot_pos, cache_position) -> tuple:
    """check_query_keys, and bias and slot_pos [B, Hkv, C], cache_position [T]; returns (B, Hq, T, D, Hkv, C)."""
    B, Hq, T, D, Hkv, C = check_query_keys(name, q, keys)
    if tuple(bias.shape) != (B, Hkv, C) or tuple(slot_pos.shape) != (B, Hkv, C):
        raise ValueError(f"{name}: bias and slot_pos must be [B, Hkv, C] = {(B, Hkv, C)}, "
                         f"got bias {tuple(bias.shape)}, slot_pos {tuple(slot_pos.shape)}")
    if tuple(cache_position.shape) != (T,):
        raise ValueError(f"{name}: cache_position must be [T] = ({T},), got {tuple(cache_position.shape)}")
    return B, Hq, T, D, Hkv, C


def check_head_offset(name: str, head_offset: int) -> None:
    """ValueError naming the op unless 0 <= head_offset < 2**31: the layer's index of the state's first KV head, which
    ops that hash a head's index add to it (tensor parallelism), so head_offset + h stays a uint32 in the hash."""
    if not 0 <= head_offset < 2**31:
        raise ValueError(f"{name}: head_offset must be an int in [0, 2**31), got {head_offset}")


def check_one_cuda_device(name: str, tensors) -> None:
    """ValueError naming the op and the devices unless every tensor is on one and the same CUDA device."""
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"{name}: all inputs must be on one CUDA device, got {sorted(map(str, devices))}")


def register_triton_op(name: str, fn, mutates_args, triton_available: bool):
    """torch.library.triton_op(name, fn). Without Triton torch logs "Triton not available" at WARNING
    while registering: expected on CPU installs, so it is silenced here and only here."""
    log = logging.getLogger("torch._library.triton")
    level = log.level
    if not triton_available:
        log.setLevel(logging.ERROR)
    try:
        return torch.library.triton_op(name, fn, mutates_args=mutates_args)
    finally:
        log.setLevel(level)
