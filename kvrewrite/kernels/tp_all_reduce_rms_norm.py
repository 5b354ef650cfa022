"""kvrewrite::tp_all_reduce_rms_norm: the sum of `x` over a tensor-parallel group (plus the residual), and the RMSNorm
of that sum, in one kernel on CUDA.

    h = tp_all_reduce(x, group_name, residual)        (kernels/tp_all_reduce.py: rounded to x's dtype, + residual)
    n = RMSNorm(h) with norm_weight, eps, unit_offset  (kernels/gemv_rms_norm.py's spelling: Llama's, or Gemma's)

Why: at tp > 1 every row-parallel sum of a decode step is followed by the next projection's norm: o_proj's sum by
post_attention_layernorm before gate/up, down_proj's by the next layer's input_layernorm before q/k/v, the last one
by the model's norm before the lm_head. As kvrewrite::gemv_rms_norm after kvrewrite::tp_all_reduce, the norm ran
inside the GEMV (every program re-reading the row) that could start only once the sum had completed: on two H200s
(8B, tp=2, stop 44) the gate/up GEMV took 35 us for 28 us of weights and q/k/v 12 us for 6, 13 us a layer over the
weights' time. Here the push kernel's one program holds the row, sums it, adds the residual and normalises it
(kernels/_tp_all_reduce_kernels.py, _push_all_reduce_rms_norm_kernel); the GEMV after it is kvrewrite::gemv on n, whose
programs launch (PDL) while the sum meets the peers and load their first constant-weight tiles then.
passes/fuse_rms_norm_into_tp_all_reduce.py puts the op in.

Schema:    tp_all_reduce_rms_norm(Tensor x, str group_name, Tensor? residual, Tensor norm_weight, float eps,
                                  bool unit_offset=False) -> (Tensor h, Tensor n)
           x: one row (x.numel() == norm_weight.numel()); h and n: new tensors of x's shape and dtype.
Paths:     the norm kernel when tp_all_reduce's one-shot path would take x (tp_all_reduce.one_shot_buffer), the row
           fits the norm channel and the kernel's registers (_tp_all_reduce_kernels.NORM_MAX_ELEMENTS),
           the norm weight is contiguous in x's dtype and FUSED is True; otherwise kvrewrite::tp_all_reduce, then the
           norm in aten (reference_rms_norm): the same function, two steps. FUSED = False is the A/B baseline
           (`--kernel-option tp_all_reduce_rms_norm.FUSED=False`): the push kernel, then the split norm's kernel of
           kvrewrite::gemv_rms_norm, in two launches (the second without PDL: wrap_triton in a custom op's body).
Reference: tp_all_reduce (gloo on the CPU), then reference_rms_norm: the graph's ops before the pass, the same bits.
Graphs:    as tp_all_reduce's: opaque to torch.compile, recorded into CUDA graphs as its kernel; every rank calls it in
           the same order (its slots alternate per call, in the norm channel's buffer of their own).
"""
import torch

from kvrewrite.kernels import tp_all_reduce as _sum
from kvrewrite.kernels.gemv_rms_norm import reference_rms_norm

FUSED = True  # the norm in the sum's kernel; False: the push kernel, then the split norm's kernel (A/B baseline)
# passes/fuse_rms_norm_into_tp_all_reduce.py puts the op into decode graphs; False leaves them as before it (the sum,
# then gemv_rms_norm: the A/B baseline of the pass, `--kernel-option tp_all_reduce_rms_norm.IN_GRAPHS=False`)
IN_GRAPHS = True


def fused_buffer(x: torch.Tensor, group_name: str, residual, norm_weight: torch.Tensor):
    """The norm channel's buffer the one-kernel path runs x through, or None when x takes the two steps (the module
    docstring's Paths); RuntimeError (tp_all_reduce's) for a CUDA tensor of a group without buffers."""
    from kvrewrite.kernels._tp_all_reduce_kernels import NORM_MAX_ELEMENTS

    if _sum.one_shot_buffer(x, group_name, residual) is None:
        return None
    buf = _sum.prepared(group_name, x.device, "norm")
    if (buf is None or x.numel() > NORM_MAX_ELEMENTS or x.numel() * x.element_size() > buf.max_bytes
            or norm_weight.dtype != x.dtype or norm_weight.device != x.device or not norm_weight.is_contiguous()):
        return None
    return buf


def _two_steps(x, group_name, residual, norm_weight, eps, unit_offset):
    h = torch.ops.kvrewrite.tp_all_reduce(x, group_name, residual)
    if h.is_cuda and not FUSED:
        from kvrewrite.kernels.gemv_rms_norm import split_norm

        return h, split_norm(h, norm_weight, eps, unit_offset)
    return h, reference_rms_norm(h, norm_weight, eps, unit_offset).contiguous()


@torch.library.custom_op("kvrewrite::tp_all_reduce_rms_norm", mutates_args=())
def tp_all_reduce_rms_norm(x: torch.Tensor, group_name: str, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                           eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if norm_weight.numel() != x.shape[-1] or x.numel() != x.shape[-1]:
        raise ValueError(f"kvrewrite::tp_all_reduce_rms_norm: x must be one row of the norm weight's "
                         f"{norm_weight.numel()} elements, got x of shape {tuple(x.shape)}")
    buf = fused_buffer(x, group_name, residual, norm_weight) if FUSED else None
    if buf is None:
        return _two_steps(x, group_name, residual, norm_weight, eps, unit_offset)
    from kvrewrite.kernels._tp_all_reduce_kernels import launch_push_rms_norm

    h, n = torch.empty_like(x), torch.empty_like(x)
    launch_push_rms_norm(x, residual, norm_weight, eps, unit_offset, h, n, buf.ptrs, buf.count, buf.rank, buf.world,
                         buf.max_bytes)
    return h, n


@tp_all_reduce_rms_norm.register_fake
def _(x, group_name, residual, norm_weight, eps, unit_offset=False):
    return torch.empty_like(x), torch.empty_like(x)
