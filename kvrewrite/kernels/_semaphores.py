"""Zeroed int32 counters for the kernels' "last program" pattern (select_clusters, indexed_attention).

A launch whose programs of one row each add 1 to the row's counter (an acq_rel atomic, after a barrier: their
stores are released) lets the program that sees n - 1 (the last to arrive) read everything the others wrote
(acquire) and finish the row: no second launch. That program also sets the counter back to 0, so every launch
finds its counters at 0: the buffer is zeroed once, when it is made, and never by the host again (no memset per
call, and CUDA graph replays find it at 0 too).

The buffer is one per (name, device), kept for the process: calls of one op on one device must therefore be
ordered (one stream, or streams that wait on each other), as a decode step's are; two launches running at once
would share counters. It is made on the first call outside a CUDA graph capture (the warm-up every capture
needs); a first call (or one needing more counters than made) inside a capture raises. Traced calls (fake or
functional tensors: torch.compile, export, opcheck) get fresh zeros instead, an op of the traced graph (one
small memset per call), so the compiled graph holds no hidden state. Older buffers are kept alive when a larger
one replaces them: a captured graph may still use them.
"""
import torch

_BUFFERS: dict = {}  # (name, device) -> [buffers], the newest (largest) last


def _device_key(device: torch.device):
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def counters(name: str, like: torch.Tensor, n: int) -> torch.Tensor:
    """At least n (>= 1) int32 counters at 0 on like's device, for the op `name` (module docstring)."""
    n = max(int(n), 1)
    if type(like) is not torch.Tensor or torch.compiler.is_compiling():  # traced: a plain op of the graph
        return torch.zeros(n, dtype=torch.int32, device=like.device)
    key = (name, _device_key(like.device))
    bufs = _BUFFERS.setdefault(key, [])
    if bufs and bufs[-1].numel() >= n:
        return bufs[-1]
    if like.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{name}: its zeroed semaphore buffer for {key[1]} ({n} counters) does not exist yet "
                           "and cannot be made inside a CUDA graph capture; call the op once with these shapes "
                           "before capturing (the usual warm-up)")
    bufs.append(torch.zeros(max(n, 2 * bufs[-1].numel() if bufs else 4096), dtype=torch.int32, device=key[1]))
    return bufs[-1]
