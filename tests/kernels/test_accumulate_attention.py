"""kvrewrite::accumulate_attention against dense float64 softmax column sums (test_attention_column_stats's)."""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from tests.kernels.test_attention_column_stats import dense_probs
from tests.kernels.test_clustered_attention import make_state

OP = torch.ops.kvrewrite.accumulate_attention.default
# fp32 probabilities summed over <= 130 queries and <= 7 heads: ~1e-6 relative error per term; a wrong
# group, mask or set/add moves a score by O(1/C) >= 1e-3
TOL = dict(atol=5e-5, rtol=1e-5)
CASES = [(1, 4, 2, 1, 37, 0), (2, 7, 1, 5, 100, 0), (3, 8, 2, 130, 40, 0), (1, 2, 2, 9, 50, 6)]


def _inputs(B, Hq, Hkv, T, C, window, seed):
    g = torch.Generator().manual_seed(seed)
    keys, _, bias, slot_pos, cp = make_state(B, Hkv, C, 16, T, torch.float32, gen=g)
    q = torch.randn(B, Hq, T, 16, generator=g)
    score = torch.rand(B, Hkv, C, generator=g)  # whatever the state held before the step
    return q, keys, bias, slot_pos, cp, score


def _grouped(p, Hkv):
    """[B, Hq, T, C] probabilities -> [B, Hkv, G, T, C]."""
    B, Hq, T, C = p.shape
    return p.view(B, Hkv, Hq // Hkv, T, C)


@pytest.mark.parametrize("B,Hq,Hkv,T,C,window", CASES, ids=lambda v: str(v))
def test_mode_all_adds_column_sums_summed_over_the_group(B, Hq, Hkv, T, C, window):
    q, keys, bias, slot_pos, cp, score = _inputs(B, Hq, Hkv, T, C, window, seed=T * 100 + C)
    before = score.clone()
    OP(q, keys, bias, slot_pos, cp, score, 0.25, window, "all")
    p = _grouped(dense_probs(q, keys, bias, slot_pos, cp, 0.25, window), Hkv)
    torch.testing.assert_close(score.double(), before.double() + p.sum(dim=(2, 3)), **TOL)


@pytest.mark.parametrize("B,Hq,Hkv,T,C,window", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("last", [1, 4, 200])
def test_mode_window_sets_from_the_last_queries_and_adds_in_decode(B, Hq, Hkv, T, C, window, last):
    """A prefill chunk (T > 1) replaces the score by the last `last` queries' column sums, averaged over the
    group; a decode step (T = 1) adds its query's."""
    q, keys, bias, slot_pos, cp, score = _inputs(B, Hq, Hkv, T, C, window, seed=T * 100 + C + last)
    before = score.clone()
    OP(q, keys, bias, slot_pos, cp, score, 0.25, window, "window", last)
    p = _grouped(dense_probs(q, keys, bias, slot_pos, cp, 0.25, window), Hkv)
    observed = p[:, :, :, T - min(last, T):].sum(dim=3).mean(dim=2)
    expected = before.double() + observed if T == 1 else observed
    torch.testing.assert_close(score.double(), expected, **TOL)


def test_empty_padding_and_future_slots_receive_nothing():
    """Slots past the fill and padding slots (bias -inf) keep their 0; a padding query (it sees no slot) adds
    nothing anywhere."""
    g = torch.Generator().manual_seed(3)
    keys, _, bias, slot_pos, cp = make_state(2, 2, 30, 16, 4, torch.float32, gen=g, empty_frac=0.0)
    bias[:, :, 20:] = -math.inf  # past the fill
    bias[1, :, :6] = -math.inf  # padding slots of row 1
    score = torch.zeros(2, 2, 30)
    OP(torch.randn(2, 4, 4, 16, generator=g), keys, bias, slot_pos, cp, score, 0.25, 0, "all")
    assert torch.equal(score[:, :, 20:], torch.zeros(2, 2, 10)) and torch.equal(score[1, :, :6], torch.zeros(2, 6))
    assert bool((score[:, :, 6:20] > 0).all())
    before = score.clone()
    none_visible = cp - 1000  # queries before every slot: like padding queries, they see nothing
    OP(torch.randn(2, 4, 4, 16, generator=g), keys, bias, slot_pos, none_visible, score, 0.25, 0, "all")
    assert torch.equal(score, before)


def test_bad_arguments_are_named():
    q, keys, bias, slot_pos, cp, score = _inputs(1, 2, 1, 3, 10, 0, seed=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        OP(q, keys, bias, slot_pos, cp, score, 0.25, 0, "sum")
    with pytest.raises(ValueError, match="mode 'window' needs last >= 1"):
        OP(q, keys, bias, slot_pos, cp, score, 0.25, 0, "window", 0)
    with pytest.raises(ValueError, match=r"score must be fp32 \[B, Hkv, C\]"):
        OP(q, keys, bias, slot_pos, cp, score.double(), 0.25, 0, "all")


@pytest.mark.parametrize("mode,last,T", [("all", 0, 5), ("window", 3, 5), ("window", 3, 1)])
def test_opcheck(mode, last, T):
    q, keys, bias, slot_pos, cp, score = _inputs(2, 4, 2, T, 12, 0, seed=1)
    torch.library.opcheck(OP, (q, keys, bias, slot_pos, cp, score, 0.25, 0, mode, last))
