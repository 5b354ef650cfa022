"""kvrewrite::tp_all_gather: every rank's slice of the logits, joined along the last dimension (tp > 1 only).

Why: tp > 1 splits the lm_head by vocabulary rows (kvrewrite/tensor_parallel.py, "vocab-parallel"): each rank reads
1/N of it per decode step (Llama-3.1-8B at tp=2: 0.53 of its 1.05 GB, about 0.13 ms at the copy bandwidth) and
computes its slice of the logits; every rank then needs all of them (the same logits, the same tokens everywhere).

Schema:    tp_all_gather(Tensor x, str group_name, int world) -> Tensor
           x [..., Vl] -> [..., world * Vl]: rank r's x in columns [r * Vl, (r + 1) * Vl). A new tensor.
Paths:     where the group has tp_all_reduce's symmetric buffer (apply prepared it: tp_all_reduce="one_shot" on
           CUDA) and the whole logits fit it (a decode step's: 256 KB at 8B, tp=2, batch 1), x padded with zeros to
           its columns in the whole row, then kvrewrite::tp_all_reduce: every other rank adds zeros, so the sum is
           the join (x + 0 is x; a -0.0 comes back +0.0), in one push kernel instead of NCCL's all-gather and a copy,
           and the decode graphs keep no NCCL kernel. Otherwise the group's all-gather
           (_c10d_functional.all_gather_into_tensor: NCCL on GPUs, gloo on the CPU) along the first dimension, then
           the ranks' blocks moved to the last. Every rank takes the same path (the same shapes everywhere).
Fake:      x.new_empty(x.shape[:-1] + (world * Vl,)).
Graphs:    opaque to torch.compile, recorded into CUDA graphs as its kernels (the pad and the push kernel, or the
           collective's).
"""
import torch
import torch.nn.functional as F

from kvrewrite.kernels import tp_all_reduce as _all_reduce

# True (the default): tensor_parallel splits the lm_head by vocabulary rows where tp divides them; False keeps it whole
# on every rank (the A/B baseline, `--kernel-option tp_all_gather.VOCAB_PARALLEL=False`). It was off in stop 45: the
# 8B tp=2 decode compile under rw.compile with the split did not finish in 165-250 s (~35 s without). Stop 46 found
# why: torch 2.11's Inductor printed this op's input's whole IR (2^layers lines) in the log line of its implicit
# fallback, since this op is met first at the end of the graph; rw.compile now bounds that message
# (kvrewrite/inductor_fallback_log.py).
VOCAB_PARALLEL = True


def pad_to_row(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """x [..., Vl] in its columns [rank * Vl, (rank + 1) * Vl) of a zero row [..., world * Vl]: summed over the
    ranks, the join."""
    vl = x.shape[-1]
    return F.pad(x, (rank * vl, (world - 1 - rank) * vl))


def join_blocks(gathered: torch.Tensor, world: int) -> torch.Tensor:
    """all_gather_into_tensor's output (the ranks' [..., Vl] stacked along the first dimension) as the join
    [..., world * Vl]: rank r's block in columns [r * Vl, (r + 1) * Vl)."""
    blocks = gathered.view(world, gathered.shape[0] // world, *gathered.shape[1:])
    return blocks.movedim(0, -2).reshape(*blocks.shape[1:-1], world * blocks.shape[-1])


def _padded_sum(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor | None:
    """The join as a sum of zero-padded rows through tp_all_reduce's one-shot path, or None where that path does
    not take the whole logits (no buffer for the group on x's device, or what one_shot_buffer refuses)."""
    buf = _all_reduce.prepared(group_name, x.device)
    if buf is None or x.numel() * world * x.element_size() > buf.max_bytes:  # prefill chunks: the collective
        return None
    full = pad_to_row(x, buf.rank, world)
    if _all_reduce.one_shot_buffer(full, group_name) is None:
        return None
    return torch.ops.kvrewrite.tp_all_reduce(full, group_name)


@torch.library.custom_op("kvrewrite::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    joined = _padded_sum(x, group_name, world)
    if joined is not None:
        return joined
    c10d = torch.ops._c10d_functional
    return join_blocks(c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world, group_name)), world)


@tp_all_gather.register_fake
def _(x, group_name, world):
    return x.new_empty((*x.shape[:-1], world * x.shape[-1]))
