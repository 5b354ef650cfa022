"""Programmatic dependent launch (PDL): a kernel is launched while the one before it in the stream is finishing.

Why: a batch-1 decode step is ~300 kernel launches (Llama-3.1-8B shape), and between two of them the GPU drains
the first kernel's last wave, then launches and ramps up the next: under CUDA graphs still about a microsecond
each. With PDL (Hopper and later) a kernel launched with the attribute may be scheduled as soon as the kernel
before it signals (`gdc_launch_dependents`, or its programs exit), and waits at `gdc_wait` for that kernel to
complete and its writes to be visible.

The rule every kernel launched with PDL here follows: `gdc_wait()` before any load and any store. The kernel is
then ordered exactly as without PDL (what it gains is its launch and scheduling, overlapped with the previous
kernel's tail); `gdc_launch_dependents()` right after the wait lets the next kernel be scheduled on the SMs this
one frees.

Constant weights: the one exception. Loading weights before the wait gains more (measured below), and is not safe
for a weight that the kernel just before may have written (a merged LoRA, a dequantized matrix): the early load
would read the old values, and an op cannot tell. So the GEMV ops (gemv, gemv_rms_norm, gemv_glu) take the
caller's word: `constant_weight=True` says no kernel of the graph writes the weight, and their kernels then load
the first weight tile before `gdc_wait` (EARLY_W; everything else still waits). passes/replace_linear_with_gemv.py
gives that word for a get_attr weight that no node of the graph writes in place (passes/utils.written_sources); a
weight changed between calls (load_state_dict) is written by kernels that completed before the step's first kernel
(the embedding's gather) started, so the early loads see it. `kernels.gemv.EARLY_WEIGHT = False` turns the early
loads off (an A/B switch: `--kernel-option gemv.EARLY_WEIGHT=False`).

Measured (kvrewrite/bench/pdl.py; docs/bench.md "Stop 34 runs"), with the GEMVs' first weight tile loaded before
the wait and, end to end, Inductor's own kernels launched with PDL too (the form before stop 34 made every load wait;
the early tile came back for constant weights in stop 37, docs/bench.md "Stop 37 runs"):
- 128 decode GEMVs of the Llama-3.1-8B shapes in one CUDA graph: on an H100 4.685 ms without PDL, 4.615 with the
  wait first (-1.5%), 4.542 with the first tile before it (-3.1%); on an H200 3.43-3.61 without, 3.31-3.35 with the
  tile first (-3.4 to -7.2%).
- End to end (H200, snapkv, 32k, batch 1, rw.compile): 4.921-4.935 ms/token with it against 4.936-4.943 without
  (two runs each; within 0.4%); not timed with the wait first. The fused norm GEMVs (65 of the ~300 kernels, the
  largest) waited first in both.

Trigger first: the two one-wave kernels whose successor is a GEMV with a constant weight, clustered_attention's
combine (then the o-projection) and gemv_rms_norm's split norm (then gate/up or the lm_head), call
`gdc_launch_dependents()` before their `gdc_wait()`. The GEMV's programs then launch while the kernel before the
combine (the attention, latency-bound: half the copy bandwidth) still runs, and load their first weight tiles
beside it. The order stays the rule's: the GEMV's wait returns only when the combine has completed, which its own
wait put after the attention. A kernel launched with PDL is scheduled only once every program of the kernel before
it has signalled or exited, so programs waiting early never keep that kernel's programs off the SMs.
`TRIGGER_FIRST = False` restores wait-then-signal (an A/B switch: `--kernel-option _pdl.TRIGGER_FIRST=False`).
Measured: docs/bench.md "Stop 38 runs".

Tried and dropped (stop 47): an L2 prefetch of the GEMV's weight before its wait. The first 256 programs of every
GEMV (gemv, gemv_rms_norm, gemv_glu) asked for the weight's first L2_PREFETCH_BYTES (`prefetch.global.L2`, a
128-byte line each, through inline PTX) before gdc_wait, to fill the time the GPU's memory idles while a
latency-bound kernel (the attention, the tensor-parallel sum) finishes. Slower in every row (two H200s, 8B shape,
chelsea, 32k, batch 1, rw.compile; one lease, each row against its own row without it): tp=2 3.07 ms/token with 16 MB
and 3.35 with 48 MB against 2.91 without; tp=1 4.78 against 4.65 (docs/tensor-parallel.md, "Stop 47"). Removed.
Tried and dropped (stop 49): clustered_attention's decode programs prefetched their split's used K/V rows into L2
the same way, before their wait (while cache_append runs), or right after it. No faster: snapkv, one H200, 8B shape,
32k, batch 1, rw.compile: 4.66 and 4.66 ms/token before the wait and 4.69 after it, against 4.63 and 4.64 without it.
In a profile the attention still ended at the same time after the rotary kernel, so the slot loop does not wait on
its first tiles from DRAM (docs/bench.md, "Stop 49 runs"). Removed.

When: `launch_options(t)` gives the launch keywords and the kernels' PDL constexpr. PDL is used where the op
launches its kernel itself (eager calls, and under `rw.compile`, which keeps the ops opaque to Inductor:
runtime.py; a plain custom op that launches its kernel itself, kvrewrite::tp_all_reduce's, says so with
`direct=True`), on a CUDA device of compute capability >= 9, unless `set_enabled(False)`. Inductor's own kernels
keep Inductor's switch (off by default; runtime.py _OpaqueOpsCall says why rw.compile does not turn it on). A
kernel of ours after one launched without PDL starts when that one completes, as without PDL. Where Inductor or
AOTInductor trace the op (torch.compile of the model by hand, exports), the kernel is traced without it
(PDL = False: the wait and launch instructions are not compiled in), since their launchers do not take the
attribute for user kernels; the kernel is then the same as before.
"""
from __future__ import annotations

import functools

import torch

from kvrewrite.kernels._triton_op import triton_jit

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401 (the kernels' import)
except ImportError:  # CPU-only installs, and Triton builds without the CUDA extras: no PDL
    triton = tl = None
    gdc_wait = gdc_launch_dependents = None

_enabled = True
TRIGGER_FIRST = True  # the module docstring, "Trigger first"


@triton_jit()
def wait_and_signal(TRIGGER_FIRST: tl.constexpr):
    """A PDL kernel's prologue: gdc_wait() then gdc_launch_dependents() (the rule), or with TRIGGER_FIRST the
    signal before the wait (the module docstring, "Trigger first")."""
    if TRIGGER_FIRST:
        gdc_launch_dependents()
    gdc_wait()
    if not TRIGGER_FIRST:
        gdc_launch_dependents()


def set_enabled(enabled: bool) -> None:
    """Turn PDL launches on or off for launches from now on (a CUDA graph or compiled step keeps what it captured):
    for A/B benchmarks and for ruling PDL out when debugging an ordering bug."""
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    return _enabled


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _launching_directly() -> bool:
    """True where a wrap_triton launch runs the kernel itself (a triton_op's real call), False while torch traces
    it into a graph (the launch attribute would not reach the launch there)."""
    from torch._library.triton import is_wrap_triton_enabled

    return not is_wrap_triton_enabled()


def launch_options(t: torch.Tensor, direct: bool = False) -> tuple[bool, dict]:
    """(PDL, launch keywords) for a kernel launch on t's device: (True, {"launch_pdl": True}) where PDL applies
    (module docstring), else (False, {}). direct: the caller launches the kernel itself (kernel[grid](...), not
    through wrap_triton) in the body of a torch.library.custom_op, which torch.compile and the exporters keep whole:
    that launch is always real, and wrap_triton's state, which tells a triton_op's real call from its tracing, says
    nothing about it (it reads "tracing" there: kvrewrite::tp_all_reduce's kernels ran without PDL until stop 45)."""
    if (not _enabled or gdc_wait is None or not t.is_cuda or not (direct or _launching_directly())
            or not _device_supports(t.device.index if t.device.index is not None else torch.cuda.current_device())):
        return False, {}
    return True, {"launch_pdl": True}
