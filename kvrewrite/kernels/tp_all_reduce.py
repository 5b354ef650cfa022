"""kvrewrite::tp_all_reduce: the sum of `x` over a tensor-parallel group (plus the residual), in one kernel on CUDA.

Why: tp > 1 sums two row-parallel outputs per layer over the ranks (passes/insert_tensor_parallel_all_reduce.py),
each a few KB in a decode step. NCCL's all-reduce of such a row takes 10.8-11.7 us inside a CUDA graph on two
H200s, torch's one-shot kernel over symmetric memory 6.8-7.0 us (the 8B decode step at tp=2 went from 4.14-4.20 to
3.69 ms with it: docs/tensor-parallel.md, "The one-shot all-reduce"). That kernel meets every peer twice (after
copying its partial sum into its own buffer, and again before the buffer may be written again). The push kernel
(kernels/_tp_all_reduce_kernels.py) writes the rank's partial sum into every peer's buffer and meets each peer
once (flags, double-buffered slots), 4.2 us against 6.8-7.6 in one run (docs/tensor-parallel.md); it also adds the
residual, which the graph adds right after the sum: passes/insert_tensor_parallel_all_reduce.py folds that add
into the op, and the next GEMV's norm then has no add to do (fused there instead, the 8B gate/up GEMV took 35 us
instead of 31 at tp=2). PUSH = False keeps torch's one-shot kernel (torch.ops.symm_mem.one_shot_all_reduce_copy,
the residual then added by a second kernel) as the A/B baseline (`--kernel-option tp_all_reduce.PUSH=False`).
Multicast is not used.

Schema:    tp_all_reduce(Tensor x, str group_name, Tensor? residual=None) -> Tensor
           the sum over the group of x rounded to x's dtype, then + residual rounded again when given (the graph's
           all-reduce and its add, as one op). A new tensor; x and residual are only read.
Paths:     one-shot when x is a contiguous CUDA float32 or bfloat16 tensor whose bytes are a multiple of 16 and fit
           the group's buffer (`prepare`, ONE_SHOT_MAX_BYTES), and the residual (if any) is contiguous with x's
           shape, dtype and device; the group's own all-reduce (NCCL), then the add, otherwise, by design: far
           above the cut, one kernel that reads every peer's whole tensor is slower than NCCL
           (python -m kvrewrite.bench.all_reduce).
           Every rank sees the same shapes and dtypes, so every rank takes the same path. A CUDA tensor of a group
           that `prepare` did not set up is an error (the collective would hide a missing buffer).
Fake:      empty_like(x).
Reference: the group's all-reduce (_c10d_functional.all_reduce, gloo on the CPU), then + residual: the CPU path,
           and what the one-shot path must equal (at tp=2 bit for bit: a + b is the same sum in either order).
Graphs:    the call is opaque to torch.compile and is recorded into CUDA graphs as its kernel; the buffer, its peer
           addresses and the per-program call counts are allocated and exchanged by `prepare` (apply, on every
           rank), never inside a capture. Every rank must call the op in the same order (the push kernel's slots
           alternate per call).
"""
import torch

# The buffer per (group, device) and the largest tensor the one-shot path takes. Decode rows are 8-16 KB at batch
# 1 (8B, 70B shapes) and up to 1 MB at batch 64 of a 70B shape; prefill chunks (16-32 MB) go to NCCL. Measured on
# two H200s (python -m kvrewrite.bench.all_reduce): one-shot 15.0 us against NCCL's 18.5 at 1 MiB, 118.7 against
# 87.7 at 16 MiB.
ONE_SHOT_MAX_BYTES = 1 << 20
_ONE_SHOT_DTYPES = (torch.float32, torch.bfloat16)
PUSH = True  # the one-shot path's kernel: the push kernel, or (False) torch's one-shot kernel (the A/B baseline)
# The norm channel: a second buffer of its own slots, flags and call count for kvrewrite::tp_all_reduce_rms_norm's
# one-program kernel (kernels/tp_all_reduce_rms_norm.py), sized for its longest row (NORM_MAX_ELEMENTS) in float32.
# Its calls alternate slots among themselves; sharing the sum channel's slots with the push kernel's programs would
# let one kernel's write meet the other's read.
_BUFFERS: dict = {}  # (group_name, device, channel) -> _Buffer; channel "sum" or "norm"


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


class _Buffer:
    """A group's symmetric buffer on one device (kernels/_tp_all_reduce_kernels.py, buffer_bytes), every rank's
    address of it (int64, on the device), this rank's call count per push-kernel program, and the sizes."""

    def __init__(self, buf, ptrs, count, rank: int, world: int, max_bytes: int):
        self.buf, self.ptrs, self.count = buf, ptrs, count
        self.rank, self.world, self.max_bytes = rank, world, max_bytes


def prepare(group_name: str, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
    """The group's symmetric buffers on `device` (the sum channel of max_bytes, the norm channel of the norm kernel's
    longest float32 row), zeroed, allocated and exchanged with every rank (a collective: every rank calls it at the
    same point, outside any CUDA-graph capture); a no-op when they exist already."""
    from kvrewrite.kernels._tp_all_reduce_kernels import NORM_MAX_ELEMENTS

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if max_bytes % 16:
        raise ValueError(f"tp_all_reduce.prepare: max_bytes must be a multiple of 16, got {max_bytes}")
    widest = max(t.itemsize for t in _ONE_SHOT_DTYPES)
    for channel, nbytes in (("sum", max_bytes), ("norm", NORM_MAX_ELEMENTS * widest)):
        _prepare_channel(group_name, device, channel, nbytes)


def _prepare_channel(group_name: str, device: torch.device, channel: str, max_bytes: int) -> None:
    key = (group_name, device, channel)
    if key in _BUFFERS:
        return
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    from torch.distributed.distributed_c10d import _resolve_process_group

    from kvrewrite.kernels._tp_all_reduce_kernels import MAX_PROGRAMS, buffer_bytes

    group = _resolve_process_group(group_name)
    world = dist.get_world_size(group)
    buf = symm_mem.empty(buffer_bytes(world, max_bytes), dtype=torch.uint8, device=device)
    buf.zero_()  # the flags start at epoch 0, as the call counts
    handle = symm_mem.rendezvous(buf, group_name)
    ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    count = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
    torch.cuda.synchronize(device)
    dist.barrier(group)  # no peer raises a flag here before this rank zeroed them
    _BUFFERS[key] = _Buffer(buf, ptrs, count, handle.rank, world, max_bytes)


def prepared(group_name: str, device: torch.device, channel: str = "sum") -> "_Buffer | None":
    """The buffer `prepare` set up for the group on `device` (a CUDA device) and channel ("sum", "norm"), or None."""
    return _BUFFERS.get((group_name, device, channel)) if device.type == "cuda" else None


def one_shot_buffer(x: torch.Tensor, group_name: str, residual: torch.Tensor | None = None) -> "_Buffer | None":
    """The group's buffer that the one-shot path sums `x` through, or None when x takes the collective (module
    docstring); RuntimeError for a CUDA tensor of a group without a buffer."""
    if x.device.type != "cuda":
        return None
    buf = prepared(group_name, x.device)
    if buf is None:
        raise RuntimeError(f"kvrewrite::tp_all_reduce: no symmetric buffer for group {group_name!r} on {x.device}: "
                           f"kvrewrite.tensor_parallel.prepare_all_reduce (apply with tp > 1 calls it) must run on "
                           f"every rank first")
    nbytes = x.numel() * x.element_size()
    if (x.dtype not in _ONE_SHOT_DTYPES or not x.is_contiguous() or nbytes % 16 or nbytes > buf.max_bytes
            or x.data_ptr() % 16):
        return None
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or not residual.is_contiguous()):
        return None
    return buf


def _collective(x: torch.Tensor, group_name: str) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))


def _plus(summed: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return summed if residual is None else summed + residual


@torch.library.custom_op("kvrewrite::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group_name: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    buf = one_shot_buffer(x, group_name, residual)
    if buf is None:
        return _plus(_collective(x, group_name), residual)
    if not PUSH:
        view = buf.buf.view(x.dtype)[: x.numel()].view(x.shape)
        return _plus(torch.ops.symm_mem.one_shot_all_reduce_copy(view, x, "sum", group_name), residual)
    from kvrewrite.kernels._tp_all_reduce_kernels import launch_push

    out = torch.empty_like(x)
    launch_push(x, residual, out, buf.ptrs, buf.count, buf.rank, buf.world, buf.max_bytes)
    return out


@tp_all_reduce.register_fake
def _(x, group_name, residual=None):
    return torch.empty_like(x)
