"""The slot state of a row whose slots hold their tokens in position order (`full`, ClusterKV), for the ordered prefill
kernel's tests (test_ordered_prefill_triton.py on the CPU, test_ordered_prefill_gpu.py on CUDA)."""
import math

import torch


def ordered_state(B, Hq, Hkv, T, n_prev, C, D=16, pads=(0,), seed=0, degrees=True, dtype=torch.float32,
                  device="cpu", delta=0):
    """(q, keys, values, bias, slot_pos, cache_position) as `full` or ClusterKV leave a layer after appending a chunk:
    slot j holds position j + delta for j < n_prev + T (the chunk's T queries in slots n_prev..n_prev + T - 1; delta
    < 0: the runtime's padding to whole chunks takes the positions before 0), row b's first pads[b % len(pads)] slots
    are left padding (bias -inf), slots from the fill on are empty (bias -inf, stale keys and positions). degrees:
    live slots carry random log degrees (the kernels add any bias); else 0."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, Hkv, C, D, generator=g)
    values = torch.randn(B, Hkv, C, D, generator=g)
    fill = n_prev + T
    bias = torch.full((B, Hkv, C), -math.inf)
    bias[..., :fill] = torch.rand(B, Hkv, fill, generator=g) * 2 if degrees else 0.0
    for b in range(B):
        bias[b, :, :pads[b % len(pads)]] = -math.inf
    slot_pos = torch.arange(C).expand(B, Hkv, C).clone() + delta
    slot_pos[..., fill:] = 0  # never read where the bias is -inf
    q = torch.randn(B, T, Hq, D, generator=g).transpose(1, 2)  # a transposed view, as in the models
    cp = torch.arange(n_prev, n_prev + T) + delta
    out = (q.to(dtype), keys.to(dtype), values.to(dtype), bias, slot_pos, cp)
    return tuple(x.to(device) for x in out)
