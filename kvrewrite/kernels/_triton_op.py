"""Registering an op as a ``torch.library.triton_op`` (shared by the ops with a Triton kernel).

A triton_op's body is its kernel, its fake (it is traced on fake tensors) and, under torch.compile,
what Inductor inlines: CUDA launches Triton through ``wrap_triton`` (Inductor sees the kernel, CUDA
graphs capture it), other devices run plain PyTorch.
"""
import logging

import torch


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
