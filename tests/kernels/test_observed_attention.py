"""kvrewrite::observed_attention on the CPU: exactly clustered_attention then accumulate_attention (it calls them),
so here: the output and score against the float64 formulas, the argument checks, opcheck. The fused CUDA
kernels: test_observed_attention_gpu.py."""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels.observed_attention import reference_observed_attention
from tests.kernels.test_attention_column_stats import dense_probs
from tests.kernels.test_clustered_attention import make_state, naive_attention

OP = torch.ops.kvrewrite.observed_attention.default


def _inputs(B, Hq, Hkv, T, C, seed):
    g = torch.Generator().manual_seed(seed)
    keys, values, bias, slot_pos, cp = make_state(B, Hkv, C, 16, T, torch.float32, gen=g)
    return torch.randn(B, Hq, T, 16, generator=g), keys, values, bias, slot_pos, cp, torch.rand(B, Hkv, C, generator=g)


@pytest.mark.parametrize("T,mode,last", [(1, "all", 0), (6, "all", 0), (1, "window", 4), (6, "window", 4)])
def test_matches_float64(T, mode, last):
    q, keys, values, bias, slot_pos, cp, score = _inputs(2, 6, 2, T, 40, seed=T)
    before = score.clone()
    ref_score = score.clone()
    out = OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, mode, last)
    torch.testing.assert_close(out.double(), naive_attention(q, keys, values, bias, slot_pos, cp, 0.25, 0),
                               atol=2e-5, rtol=1e-5)
    p = dense_probs(q, keys, bias, slot_pos, cp, 0.25, 0).view(2, 2, 3, T, 40)
    if mode == "all":
        want = before.double() + p.sum(dim=(2, 3))
    else:
        observed = p[:, :, :, T - last:].sum(dim=3).mean(dim=2)
        want = before.double() + observed if T == 1 else observed
    torch.testing.assert_close(score.double(), want, atol=5e-5, rtol=1e-5)
    ref = reference_observed_attention(q, keys, values, bias, slot_pos, cp, 0.25, 0, ref_score, mode, last)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(score, ref_score, atol=1e-6, rtol=1e-6)


def test_bad_arguments_are_named():
    q, keys, values, bias, slot_pos, cp, score = _inputs(1, 2, 1, 3, 10, seed=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, "sum", 0)
    with pytest.raises(ValueError, match=r"score must be fp32 \[B, Hkv, C\]"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score[:, :, :5], "all", 0)


def test_opcheck():
    q, keys, values, bias, slot_pos, cp, score = _inputs(2, 4, 2, 1, 12, seed=1)
    torch.library.opcheck(OP, (q, keys, values, bias, slot_pos, cp, 0.25, 0, score, "window", 3, True))
