"""kvrewrite::expanded_attention_stats against dense float64 column sums over runtime slots (the per-slot
probabilities of tests/kernels/expanded_naive.py's materialised expanded attention), ems_spec.md §9."""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from tests.kernels.expanded_naive import make_state, naive_expanded

OP = torch.ops.kvrewrite.expanded_attention_stats.default
ATTN = torch.ops.kvrewrite.expanded_attention.default

# Column sums of fp32 probabilities (each within ~1e-6 relative of float64, from O(5) logits and the op's fp32 lse)
# over <= 6 queries: 2e-5 absolute bounds them for both input dtypes (the outputs are fp32 either way; bf16 inputs
# are exact in fp32). A wrong key scale, head or mask moves a column sum by >= 1e-2 here.
TOL = dict(atol=2e-5, rtol=1e-5)

# (B, Hq, Hkv, C, R, D, T, prefill, options)
CASES = {
    "prefill-G2": (2, 4, 2, 12, 24, 16, 6, True, {}),
    "prefill-MQA-odd": (1, 3, 1, 7, 13, 8, 5, True, {}),
    "decode-G4": (2, 8, 2, 9, 20, 16, 1, False, {}),
    "dead-slots": (2, 4, 2, 9, 20, 16, 3, True, {"dead": True}),
    "nothing-visible": (2, 4, 2, 8, 16, 16, 3, True, {"empty_row": True}),
}


def build(case, dtype=torch.float32, seed=0):
    B, Hq, Hkv, C, R, D, T, prefill, opts = CASES[case]
    g = torch.Generator().manual_seed(seed)
    st = make_state(B, Hkv, C, R, D, T, dtype, g, prefill=prefill, **opts)
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    return st, q, D**-0.5, not prefill


def naive_sums(st, q, scale, last, softcap=0.0):
    _, _, p = naive_expanded(st, q, scale, softcap)  # [B, Hq, T, R]
    T = q.shape[2]
    return p.sum(dim=2), p[:, :, T - min(last, T):].sum(dim=2)


@pytest.mark.parametrize("last", [0, 2, 6, 9], ids=lambda n: f"last{n}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_matches_dense_column_sums(case, dtype, last):
    st, q, scale, past_only = build(case, dtype)
    _, lse = ATTN(*st.attention_args(q), scale, past_only)
    total, recent = OP(*st.stats_args(q, lse), scale, last, past_only)
    want_total, want_recent = naive_sums(st, q, scale, last)
    assert total.dtype == recent.dtype == torch.float32 and total.shape == want_total.shape
    torch.testing.assert_close(total.double(), want_total, **TOL)
    torch.testing.assert_close(recent.double(), want_recent, **TOL)


def test_each_query_spreads_one_unit():
    """Every query that sees something gives its slots probability 1 in all; one that sees nothing gives 0."""
    st, q, scale, _ = build("nothing-visible")
    _, lse = ATTN(*st.attention_args(q), scale)
    total, _ = OP(*st.stats_args(q, lse), scale, 0)
    assert (total[0] == 0).all()
    torch.testing.assert_close(total[1].sum(-1), torch.full((4,), 3.0), atol=1e-5, rtol=0)


def test_softcap():
    st, q, scale, _ = build("prefill-G2", seed=1)
    q = 6 * q
    _, lse = ATTN(*st.attention_args(q), scale, False, 10.0)
    total, recent = OP(*st.stats_args(q, lse), scale, 3, False, 10.0)
    want_total, want_recent = naive_sums(st, q, scale, 3, softcap=10.0)
    torch.testing.assert_close(total.double(), want_total, **TOL)
    torch.testing.assert_close(recent.double(), want_recent, **TOL)
    assert (naive_sums(st, q, scale, 3)[0] - want_total).abs().max() > 1e-2  # the cap is exercised


def test_past_only_broken_promise_raises():
    st, q, scale, _ = build("decode-G4")
    _, lse = ATTN(*st.attention_args(q), scale, True)
    st.cache_position = st.cache_position - 1
    with pytest.raises(ValueError, match="past_only=True"):
        OP(*st.stats_args(q, lse), scale, 1, True)


def test_bad_arguments():
    st, q, scale, _ = build("decode-G4")
    _, lse = ATTN(*st.attention_args(q), scale)
    with pytest.raises(ValueError, match="lse must be torch.float32"):
        OP(*st.stats_args(q, lse[:, :1]), scale, 1)
    with pytest.raises(ValueError, match="last must be >= 0"):
        OP(*st.stats_args(q, lse), scale, -1)


@pytest.mark.parametrize("case, past_only, softcap", [("prefill-G2", False, 0.0), ("decode-G4", True, 20.0)])
def test_opcheck(case, past_only, softcap):
    st, q, scale, _ = build(case)
    _, lse = ATTN(*st.attention_args(q), scale, past_only, softcap)
    torch.library.opcheck(OP, (*st.stats_args(q, lse), scale, 4), {"past_only": past_only, "softcap": softcap})
