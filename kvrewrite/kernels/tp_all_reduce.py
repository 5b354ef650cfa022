"""kvrewrite::tp_all_reduce: the sum of `x` over a tensor-parallel group, in one kernel on CUDA.

Why: tp > 1 sums two row-parallel outputs per layer over the ranks (passes/insert_tensor_parallel_all_reduce.py),
each a few KB in a decode step. NCCL's all-reduce of such a row takes 10.8-11.7 us inside a CUDA graph on two H200s,
this op's one-shot path 6.8-7.0 us, and the 8B decode step at tp=2 went from 4.14-4.20 to 3.69 ms
(docs/tensor-parallel.md, "The one-shot all-reduce"). The one-shot all-reduce over symmetric memory is one kernel:
each rank copies its partial sum into a buffer every rank of the group can read over NVLink, meets the others at a
barrier, reads and adds every rank's buffer, and meets them again before the buffer can be reused
(torch.ops.symm_mem.one_shot_all_reduce_copy; multicast is not used).

Schema:    tp_all_reduce(Tensor x, str group_name) -> Tensor      (a new tensor; x is only read)
Paths:     one-shot when x is a contiguous CUDA float32 or bfloat16 tensor whose bytes are a multiple of 16 and fit
           the group's buffer (`prepare`, ONE_SHOT_MAX_BYTES); the group's own all-reduce (NCCL) otherwise, by
           design: far above the cut, one kernel that reads every peer's whole tensor is slower than NCCL
           (python -m kvrewrite.bench.all_reduce). Every rank sees the same shapes and dtypes, so every rank takes
           the same path. A CUDA tensor of a group that `prepare` did not set up is an error (the collective would
           hide a missing buffer).
Fake:      empty_like(x).
Reference: the group's all-reduce (_c10d_functional.all_reduce, gloo on the CPU): the CPU path, and what the
           one-shot path must equal (at tp=2 bit for bit: a + b is the same sum in either order).
Graphs:    the call is opaque to torch.compile and is recorded into CUDA graphs as its kernel; the buffer is
           allocated and exchanged by `prepare` (apply, on every rank), never inside a capture.
"""
import torch

# The buffer per (group, device) and the largest tensor the one-shot path takes. Decode rows are 8-16 KB at batch
# 1 (8B, 70B shapes) and up to 1 MB at batch 64 of a 70B shape; prefill chunks (16-32 MB) go to NCCL. Measured on
# two H200s (python -m kvrewrite.bench.all_reduce): one-shot 15.0 us against NCCL's 18.5 at 1 MiB, 118.7 against
# 87.7 at 16 MiB.
ONE_SHOT_MAX_BYTES = 1 << 20
_ONE_SHOT_DTYPES = (torch.float32, torch.bfloat16)
_BUFFERS: dict = {}  # (group_name, device) -> uint8 symmetric-memory tensor of ONE_SHOT_MAX_BYTES


def one_shot_unavailable(device: torch.device, group_name: str) -> str | None:
    """Why the one-shot path cannot run on `device` for the group (None when it can): a CPU device, a group that is
    not NCCL's, or a torch without symmetric-memory all-reduce."""
    import torch.distributed as dist

    if device.type != "cuda":
        return f"the model is on {device.type}, and the one-shot all-reduce runs on CUDA only"
    try:
        torch.ops.symm_mem.one_shot_all_reduce_copy.default
    except (AttributeError, RuntimeError):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce_copy"
    from torch.distributed.distributed_c10d import _resolve_process_group

    backend = dist.get_backend(_resolve_process_group(group_name))
    if backend != "nccl":
        return f"the process group's backend is {backend}, not nccl"
    return None


def prepare(group_name: str, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
    """The group's symmetric buffer on `device`, allocated and exchanged with every rank (a collective: every rank
    calls it at the same point, outside any CUDA-graph capture); a no-op when it exists already."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (group_name, device)
    if key in _BUFFERS:
        return
    if max_bytes % 16:
        raise ValueError(f"tp_all_reduce.prepare: max_bytes must be a multiple of 16, got {max_bytes}")
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buf, group_name)
    _BUFFERS[key] = buf


def one_shot_buffer(x: torch.Tensor, group_name: str) -> torch.Tensor | None:
    """The view of the group's buffer that the one-shot path sums `x` through, or None when x takes the collective
    (module docstring); RuntimeError for a CUDA tensor of a group without a buffer."""
    if x.device.type != "cuda":
        return None
    buf = _BUFFERS.get((group_name, x.device))
    if buf is None:
        raise RuntimeError(f"kvrewrite::tp_all_reduce: no symmetric buffer for group {group_name!r} on {x.device}: "
                           f"kvrewrite.tensor_parallel.prepare_all_reduce (apply with tp > 1 calls it) must run on "
                           f"every rank first")
    nbytes = x.numel() * x.element_size()
    if (x.dtype not in _ONE_SHOT_DTYPES or not x.is_contiguous() or nbytes % 16 or nbytes > buf.numel()
            or x.data_ptr() % 16):
        return None
    return buf.view(x.dtype)[: x.numel()].view(x.shape)


def _collective(x: torch.Tensor, group_name: str) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))


@torch.library.custom_op("kvrewrite::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    buf = one_shot_buffer(x, group_name)
    if buf is None:
        return _collective(x, group_name)
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x, "sum", group_name)


@tp_all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x)
