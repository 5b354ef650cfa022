"""kvrewrite::attention_column_stats against a dense float64 softmax written here."""
import math

import pytest
import torch

from tests.kernels.test_clustered_attention import make_state

OP = torch.ops.kvrewrite.attention_column_stats.default
# fp32 probabilities summed over <= 300 queries: each p carries ~1e-6 relative error, sums of up
# to 300 terms of magnitude <= 1 stay within ~3e-5 absolute; a wrong mask, group or block boundary
# moves a column sum by O(1/C) >= 1e-3.
TOL = dict(atol=5e-5, rtol=1e-5)


def dense_probs(q, keys, bias, slot_pos, cache_position, scale, window):
    """float64 softmax probabilities [B, Hq, T, C]; rows that see nothing are 0."""
    B, Hq, T, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    k = keys.double().repeat_interleave(G, dim=1)
    logits = q.double() @ k.transpose(-1, -2) * scale + bias.double().repeat_interleave(G, 1)[:, :, None, :]
    sp = slot_pos.repeat_interleave(G, 1)[:, :, None, :]
    cp = cache_position[None, None, :, None]
    vis = (sp <= cp) & (sp > cp - window) if window > 0 else sp <= cp
    logits = logits.masked_fill(~vis, -math.inf)
    p = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(p, nan=0.0)


@pytest.mark.parametrize("B,Hq,Hkv,T,C,window,last", [
    (1, 4, 2, 1, 37, 0, 1), (2, 7, 1, 5, 100, 0, 3), (3, 8, 2, 300, 40, 0, 64), (1, 2, 2, 130, 200, 16, 130),
    (2, 4, 1, 9, 1, 0, 0),
], ids=lambda v: str(v))
@pytest.mark.parametrize("with_lse", [True, False], ids=["lse", "no-lse"])
def test_matches_dense_softmax(B, Hq, Hkv, T, C, window, last, with_lse):
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + C)
    keys, _, bias, slot_pos, cp = make_state(B, Hkv, C, 16, T, torch.float32, gen=g)
    q = torch.randn(B, Hq, T, 16, generator=g)
    scale = 0.25
    p = dense_probs(q, keys, bias, slot_pos, cp, scale, window)
    lse = None
    if with_lse:
        from kvrewrite.kernels.attention_column_stats import _visible_logits

        lse = _visible_logits(q, keys, bias, slot_pos, cp, scale, window).logsumexp(-1)
    total, recent = OP(q, keys, bias, slot_pos, cp, lse, scale, window, last)
    torch.testing.assert_close(total.double(), p.sum(dim=2), **TOL)
    torch.testing.assert_close(recent.double(), p[:, :, T - min(last, T):].sum(dim=2), **TOL)
    # each query that sees a slot distributes exactly one unit of attention
    seeing = (p.sum(-1) > 0).sum(-1).double()
    torch.testing.assert_close(total.double().sum(-1), seeing, **TOL)


@pytest.mark.parametrize("T,last", [(300, 64), (300, 1), (130, 130), (5, 9), (40, 0)], ids=lambda v: str(v))
def test_reference_recent_only(T, last):
    """need_total=False walks only the blocks of the last `last` queries: no total, the same recent."""
    from kvrewrite.kernels.attention_column_stats import reference_attention_column_stats

    g = torch.Generator().manual_seed(T + last)
    keys, _, bias, slot_pos, cp = make_state(2, 2, 60, 16, T, torch.float32, gen=g)
    q = torch.randn(2, 4, T, 16, generator=g)
    total, recent = reference_attention_column_stats(q, keys, bias, slot_pos, cp, None, 0.25, 0, last, need_total=False)
    assert total is None
    p = dense_probs(q, keys, bias, slot_pos, cp, 0.25, 0)
    torch.testing.assert_close(recent.double(), p[:, :, T - min(last, T):].sum(dim=2), **TOL)


def test_empty_and_invisible_slots_get_nothing():
    g = torch.Generator().manual_seed(7)
    keys, _, bias, slot_pos, cp = make_state(1, 1, 50, 16, 4, torch.float32, gen=g, empty_frac=0.0)
    bias[0, 0, :10] = float("-inf")
    slot_pos[0, 0, 10:15] = int(cp.max()) + 5  # in the future of every query
    total, recent = OP(torch.randn(1, 2, 4, 16, generator=g), keys, bias, slot_pos, cp, None, 0.25, 0, 4)
    assert (total[..., :15] == 0).all() and (recent[..., :15] == 0).all()
    assert (total[..., 15:] > 0).all()


def test_opcheck():
    g = torch.Generator().manual_seed(3)
    keys, _, bias, slot_pos, cp = make_state(2, 2, 30, 16, 3, torch.float32, gen=g)
    q = torch.randn(2, 4, 3, 16, generator=g)
    torch.library.opcheck(OP, (q, keys, bias, slot_pos, cp, None, 0.25, 0, 2))
