"""kvrewrite::tp_all_gather: every rank's slice of the logits, joined along the last dimension (tp > 1 only).

Why: tp > 1 splits the lm_head by vocabulary rows (kvrewrite/tensor_parallel.py, "vocab-parallel"): each rank reads
1/N of it per decode step (Llama-3.1-8B at tp=2: 0.53 of its 1.05 GB, about 0.13 ms at the copy bandwidth) and
computes its slice of the logits; every rank then needs all of them (the same logits, the same tokens everywhere).

Schema:    tp_all_gather(Tensor x, str group_name, int world) -> Tensor
           x [..., Vl] -> [..., world * Vl]: rank r's x in columns [r * Vl, (r + 1) * Vl). A new tensor.
Path:      the group's all-gather (_c10d_functional.all_gather_into_tensor: NCCL on GPUs, gloo on the CPU) along
           the first dimension, then the ranks' blocks moved to the last. The same on every device: no kernel of
           its own yet (a decode row is 128 KB a rank at 8B; the one-shot kernels of tp_all_reduce.py would serve).
Fake:      x.new_empty(x.shape[:-1] + (world * Vl,)).
Graphs:    opaque to torch.compile, recorded into CUDA graphs as the collective's kernels.
"""
import torch


@torch.library.custom_op("kvrewrite::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    lead, vl = tuple(x.shape[:-1]), x.shape[-1]
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world, group_name))  # [world * lead0, ...]
    blocks = gathered.view(world, *lead, vl)
    return blocks.movedim(0, -2).reshape(*lead, world * vl)


@tp_all_gather.register_fake
def _(x, group_name, world):
    return x.new_empty((*x.shape[:-1], world * x.shape[-1]))
