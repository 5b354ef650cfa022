"""kvrewrite::ems_redundancy — each to-be-merged entry's merge destination (docs/contracts/ems.md §6.8).

a = raw_keys (pre-RoPE keys: pos "without") when raw_keys has entries, else keys (post-RoPE: pos "with"). For every
TBM entry d (cls 3) of a due row, over the centres c (cls 2):

    cos(x, y) = (x . y) / (||x|| ||y||) in fp32 from the stored dtype (dot first, then divide); 0 if a norm is 0
    R_dc = max(cos(a_d, a_c), 0) * max(cos(v_d, v_c), 0)       (two negative cosines are anti-similar: decision 8)
    best_d = max_c R_dc;  c* = the smallest c with R_dc == best_d
    dest_d = c* if (tau < 1 and best_d >= tau) else -1           (-1: the zero class; tau >= 1 never merges)

dest = e for cls 1 and 2 (kept as themselves), -1 for cls 0 and 4 and for every entry of a row not due.

Inputs: keys, values [B, Hkv, C, D]; raw_keys [B, Hkv, C or 0, D]; cls [B, Hkv, C] int32 (kvrewrite::ems_partition);
due [B, Hkv] bool. Args: tau (float in [0, 1]). Returns dest [B, Hkv, C] int32.

Backends: the reference below (static-shape tensor code: the cosine matrices by matmuls in blocks of BLOCK TBM rows,
no host reads, deterministic) is the CPU path and, until a Triton kernel passes its GPU tests, the CUDA path too.
"""
import torch

from kvrewrite.kernels.ems_score import check_due

NAME = "kvrewrite::ems_redundancy"
CENTRE, TBM = 2, 3


BLOCK = 1024  # TBM rows per step of the reference: bounds its [B, Hkv, BLOCK, C] temporaries


def _unit(x):
    """(x fp32, ||x|| fp32) of x [B, H, C, D]."""
    x = x.float()
    return x, x.norm(dim=-1)


def _cosines(x, n, d0, d1):
    """[B, H, d1 - d0, C] fp32 cosines of rows d0..d1 of x against every row (dot first, then divide by the
    product of the norms; 0 where a norm is 0)."""
    den = n[..., d0:d1, None] * n[..., None, :]
    dot = x[..., d0:d1, :] @ x.transpose(-1, -2)
    return torch.where(den > 0, dot / torch.where(den > 0, den, 1.0), 0.0)


def reference_ems_redundancy(keys, values, raw_keys, cls, due, tau):
    B, H, C, _ = keys.shape
    a, na = _unit(raw_keys if raw_keys.shape[2] > 0 else keys)
    v, nv = _unit(values)
    centre = (cls == CENTRE)[..., None, :]
    ar = torch.arange(C, device=keys.device)
    args = []
    for d0 in range(0, C, BLOCK):  # a loop over static sizes
        d1 = min(d0 + BLOCK, C)
        r = _cosines(a, na, d0, d1).clamp_min(0) * _cosines(v, nv, d0, d1).clamp_min(0)  # r[d, c]
        r = torch.where(centre, r, float("-inf"))
        best = r.amax(-1, keepdim=True)
        arg = torch.where(centre & (r == best), ar, C).amin(-1)  # the smallest centre at the maximum
        merge = (best[..., 0] >= tau) & (arg < C) if tau < 1 else torch.zeros_like(arg, dtype=torch.bool)
        args.append(torch.where(merge, arg, -1))
    arg = torch.cat(args, dim=-1)
    dest = torch.where(cls == TBM, arg, torch.where((cls == 1) | (cls == CENTRE), ar, -1))
    return torch.where(due[..., None], dest, -1).to(torch.int32)


def _check_inputs(keys, values, raw_keys, cls, due, tau):
    if keys.dim() != 4:
        raise ValueError(f"{NAME}: keys must be [B, Hkv, C, D], got {list(keys.shape)}")
    B, H, C, D = keys.shape
    if tuple(values.shape) != (B, H, C, D) or values.dtype != keys.dtype:
        raise ValueError(f"{NAME}: values must be {keys.dtype} {[B, H, C, D]} like keys, got {values.dtype} "
                         f"{list(values.shape)}")
    if (raw_keys.dim() != 4 or tuple(raw_keys.shape) not in ((B, H, C, D), (B, H, 0, D))
            or raw_keys.dtype != keys.dtype):
        raise ValueError(f"{NAME}: raw_keys must be {keys.dtype} {[B, H, C, D]} (pos 'without') or {[B, H, 0, D]} "
                         f"(pos 'with'), got {raw_keys.dtype} {list(raw_keys.shape)}")
    if tuple(cls.shape) != (B, H, C) or cls.dtype != torch.int32:
        raise ValueError(f"{NAME}: cls must be torch.int32 {[B, H, C]}, got {cls.dtype} {list(cls.shape)}")
    check_due(NAME, due, B, H)
    for field, t in (("values", values), ("raw_keys", raw_keys), ("cls", cls), ("due", due)):
        if t.device != keys.device:
            raise ValueError(f"{NAME}: {field} is on {t.device}, keys on {keys.device}")
    if not 0 <= tau <= 1:
        raise ValueError(f"{NAME}: tau must be in [0, 1], got {tau}")


@torch.library.custom_op(NAME, mutates_args=())
def ems_redundancy(keys: torch.Tensor, values: torch.Tensor, raw_keys: torch.Tensor, cls: torch.Tensor,
                   due: torch.Tensor, *, tau: float) -> torch.Tensor:
    """dest [B, Hkv, C] int32 of every entry (module docstring). CPU and CUDA run the reference."""
    _check_inputs(keys, values, raw_keys, cls, due, tau)
    return reference_ems_redundancy(keys, values, raw_keys, cls, due, tau)


@ems_redundancy.register_fake
def _(keys, values, raw_keys, cls, due, *, tau):
    return torch.empty_like(cls)
