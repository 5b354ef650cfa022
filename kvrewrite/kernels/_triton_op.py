"""Shared by the ops with Triton kernels: ``triton_op`` registration, ``triton_jit``, the device check.

A triton_op's body is its kernel, its fake (it is traced on fake tensors) and, under torch.compile,
what Inductor inlines: CUDA launches Triton through ``wrap_triton`` (Inductor sees the kernel, CUDA
graphs capture it), other devices run plain PyTorch.
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
