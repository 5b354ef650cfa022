"""State tensors kept in page-locked host memory that CUDA kernels read and write in place (zero-copy).

ClusterKV's `offload="cpu"` keeps the full keys and values of its clustered layers in host memory; a decode step
then reads over PCIe only the rows its index selects. `host_alias(shape, dtype, device)` returns an ordinary CUDA
tensor whose storage IS that host memory: a plain CPU tensor of the exact size, page-locked and mapped into the
GPU's address space (cudaHostRegister, portable + mapped), viewed at the device address the driver gives for it
(cuMemHostGetDevicePointer). Every kernel, Triton or ATen, takes it as a CUDA tensor: device checks pass, a CUDA
graph records its address like any other, torch.compile sees a cuda tensor; each access is a PCIe transaction, so
reading everything (a prefill chunk's dense attention, zero_) costs what the bus costs.

Why not torch.empty(pin_memory=True): PyTorch's caching host allocator rounds every block up to a power of two
(up to 2x the host memory) and keeps freed blocks cached; registering a CPU tensor pins exactly its bytes and
unpins them when the alias dies. The host tensor lives as long as the alias (and every view of it): the alias's
storage holds it and, when freed, synchronises the device, unregisters the memory and lets the CPU tensor go.
"""
from __future__ import annotations

import ctypes
import math
import sys

import torch

_REGISTER_FLAGS = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


def check_offload_device(device, owner: str = "offload='cpu'") -> None:
    """ValueError unless `device` is a usable CUDA device: host-resident state is read by CUDA kernels in place."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        where = "CUDA is not available" if not torch.cuda.is_available() else f"the model is on {device}"
        raise ValueError(f"{owner} keeps keys and values in pinned host memory that CUDA kernels read in place, so it "
                         f"needs the model on a CUDA GPU ({where}): drop the offload option or load the model on a GPU")


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"offload: cannot load the CUDA driver library libcuda.so.1 ({e}); host-mapped state needs "
                           f"it for the device address of registered memory (Linux with an NVIDIA driver)") from None


def _device_pointer(host_ptr: int) -> int:
    """The device address of registered, mapped host memory (equal to host_ptr on most UVA systems, not on all)."""
    lib = _libcuda()
    dptr = ctypes.c_uint64()
    res = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(host_ptr), ctypes.c_uint(0))
    if res != 0:
        raise RuntimeError(f"offload: cuMemHostGetDevicePointer failed with CUresult {res} for host address "
                           f"{host_ptr:#x}")
    return dptr.value


class _MappedHostMemory:
    """Owner of a registered CPU tensor; exposes its device address through __cuda_array_interface__ (bytes)."""

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host = host
        self.device = device
        self.nbytes = host.numel() * host.element_size()
        with torch.cuda.device(device):
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), self.nbytes, _REGISTER_FLAGS))
            self.registered = True
            dptr = _device_pointer(host.data_ptr())
        self.__cuda_array_interface__ = {"shape": (self.nbytes,), "typestr": "|u1", "data": (dptr, False),
                                         "version": 3, "strides": None}

    def __del__(self):
        if not getattr(self, "registered", False) or sys.is_finalizing():
            return  # at interpreter exit the driver releases everything
        torch.cuda.synchronize(self.device)  # no kernel may still read the memory the CPU allocator gets back
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr()))
        self.registered = False


def host_alias(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero-filled CUDA tensor of `shape` and `dtype` whose storage is page-locked host memory (see the module
    docstring); `device` the CUDA device whose kernels use it."""
    check_offload_device(device)
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    numel = math.prod(shape)
    host = torch.zeros(max(numel, 1), dtype=dtype)  # never 0 bytes: registering nothing fails
    owner = _MappedHostMemory(host, device)
    raw = torch.as_tensor(owner, device=device)  # uint8 [nbytes]; its storage keeps `owner` alive
    if raw.device != device:
        raise RuntimeError(f"offload: the mapped host memory was attributed to {raw.device}, expected {device}")
    return raw.view(dtype)[:numel].view(shape)


def is_host_memory(t: torch.Tensor) -> bool:
    """Is `t`'s storage page-locked host memory? (A CUDA tensor from host_alias, or a pinned CPU tensor.)"""
    if t.device.type == "cpu":
        return t.is_pinned()
    lib = _libcuda()
    mem_type = ctypes.c_uint(0)
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_MEMORYTYPE_HOST = 2, 1
    res = lib.cuPointerGetAttribute(ctypes.byref(mem_type), ctypes.c_int(CU_POINTER_ATTRIBUTE_MEMORY_TYPE),
                                    ctypes.c_uint64(t.data_ptr()))
    if res != 0:
        raise RuntimeError(f"offload: cuPointerGetAttribute failed with CUresult {res}")
    return mem_type.value == CU_MEMORYTYPE_HOST
