"""kvrewrite::tp_all_gather's two forms agree, without a process group: the sum of the ranks' zero-padded rows (the
one-shot path through tp_all_reduce) and the all-gather's blocks moved to the last dimension (the collective path)
both give the ranks' slices side by side in rank order, bit for bit, negative zeros aside (x + 0.0 is +0.0 for
x = -0.0). The op in a group: tests/test_tensor_parallel.py (gloo on the CPU, NCCL on 2 GPUs)."""
import pytest
import torch

from kvrewrite.kernels.tp_all_gather import join_blocks, pad_to_row


@pytest.mark.parametrize("shape", [(5,), (1, 1, 6), (2, 3, 5)])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_sum_and_gathered_blocks_are_the_join(shape, world, dtype):
    gen = torch.Generator().manual_seed(world)
    xs = [torch.randn(shape, generator=gen).to(dtype) for _ in range(world)]
    xs[0].view(-1)[0] = -0.0
    want = torch.cat(xs, dim=-1)  # rank r's slice in columns [r * Vl, (r + 1) * Vl)
    summed = torch.zeros_like(want, dtype=torch.float32)
    for r, x in enumerate(xs):  # the one-shot path: the push kernel sums in rank order in float32
        summed += pad_to_row(x, r, world).float()
    assert torch.equal(summed.to(dtype), want)
    gathered = torch.cat([x.reshape(-1, *shape[1:]) if x.dim() else x for x in xs], dim=0)  # all_gather_into_tensor
    joined = join_blocks(gathered, world)
    assert joined.shape == want.shape and torch.equal(joined, want)
    assert torch.equal(torch.signbit(joined), torch.signbit(want))  # the collective keeps a -0.0 as it is
