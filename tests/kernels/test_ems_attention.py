"""kvrewrite::ems_attention: the output is expanded_attention's, and the statistics fold (ems_spec.md §6.4) matches a
naive float64 fold of the dense per-slot probabilities (tests/kernels/expanded_naive.py), summed over the group."""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from tests.kernels.expanded_naive import make_state, naive_expanded

OP = torch.ops.kvrewrite.ems_attention.default
ATTN = torch.ops.kvrewrite.expanded_attention.default
STATS = torch.ops.kvrewrite.expanded_attention_stats.default
CACHE_APPEND = torch.ops.kvrewrite.cache_append.default
EMS_APPEND = torch.ops.kvrewrite.ems_append.default

# fp32 statistics against float64: each step adds G probabilities per slot with ~1e-6 relative error; 70 decode steps
# accumulate to <= ~1e-5 absolute on sums of O(1). A missed rotation or a mean instead of a sum moves them by >= 1e-2.
TOL = dict(atol=3e-5, rtol=1e-5)


def scores(B, Hkv, R, g, random=True):
    make = (lambda: torch.rand(B, Hkv, R, generator=g)) if random else (lambda: torch.zeros(B, Hkv, R))
    return make(), make(), make()


def group_sum(p, Hkv):
    """[B, Hq, T, R] float64 probabilities -> [B, Hkv, T, R], summed over each KV head's G query heads."""
    B, Hq, T, R = p.shape
    return p.view(B, Hkv, Hq // Hkv, T, R).sum(dim=2)


def call(st, q, s, win_count, past_only, l_win, softcap=0.0):
    return OP(*st.attention_args(q)[:9], *s, st.slot_fill, win_count, scale=q.shape[-1] ** -0.5,
              past_only=past_only, softcap=softcap, l_win=l_win)


@pytest.mark.parametrize("l_win", [3, 8], ids=lambda n: f"lwin{n}")
@pytest.mark.parametrize("Hq, Hkv", [(4, 2), (4, 1)], ids=["G2", "MQA"])
def test_prefill_chunk_sets_past_and_zeroes_cur_and_count(Hq, Hkv, l_win):
    g = torch.Generator().manual_seed(0)
    B, C, R, D, T = 2, 12, 24, 16, 6
    st = make_state(B, Hkv, C, R, D, T, torch.float32, g, prefill=True)
    q = torch.randn(B, Hq, T, D, generator=g)
    s_glo, s_past, s_cur = scores(B, Hkv, R, g)
    glo0 = s_glo.clone()
    win_count = torch.tensor([[5] * Hkv, [31] * Hkv])
    out = call(st, q, (s_glo, s_past, s_cur), win_count, False, l_win)
    torch.testing.assert_close(out, ATTN(*st.attention_args(q), D**-0.5)[0], rtol=0, atol=0)
    p = group_sum(naive_expanded(st, q, D**-0.5)[2], Hkv)  # [B, Hkv, T, R]
    torch.testing.assert_close(s_glo.double(), glo0.double() + p.sum(dim=2), **TOL)
    torch.testing.assert_close(s_past.double(), p[:, :, T - min(l_win, T):].sum(dim=2), **TOL)
    assert (s_cur == 0).all() and (win_count == 0).all()


def with_room(st, extra_c, extra_r):
    """st with extra_c free entries and extra_r free slots appended (reset values), and the fill, token_pos and
    slot_order an EMS layer holds, so cache_append and ems_append can grow it."""
    B, H, C, D = st.keys.shape
    R = st.lut.shape[2]
    cat = lambda t, n, v: torch.cat([t, torch.full((*t.shape[:2], n, *t.shape[3:]), v, dtype=t.dtype)], dim=2)
    st.keys, st.values = cat(st.keys, extra_c, 0.0), cat(st.values, extra_c, 0.0)
    st.bias, st.slot_pos = cat(st.bias, extra_c, float("-inf")), cat(st.slot_pos, extra_c, 0)
    st.entry_start = cat(st.entry_start, extra_c, 0)
    st.lut, st.key_scale = cat(st.lut, extra_r, -1), cat(st.key_scale, extra_r, 1.0)
    fill = st.lut.gather(2, (st.slot_fill - 1)[:, :, None]).squeeze(2).long() + 1
    raw_keys = torch.zeros(B, H, C + extra_c, D)
    token_pos = torch.zeros(B, H, R + extra_r, dtype=torch.int32)
    slot_order = torch.full((B, H, R + extra_r), -1, dtype=torch.int32)
    return fill, raw_keys, token_pos, slot_order


def test_decode_70_steps_fold_like_the_naive_model():
    """70 decode steps with l_win = 32, each appending its token first (cache_append, ems_append) as the graph does:
    s_glo, s_loc_cur, s_loc_past and win_count follow the naive float64 fold after every step, with the rotations
    at steps 32 and 64."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, C, R, D, steps, l_win = 2, 4, 2, 8, 16, 8, 70, 32
    st = make_state(B, Hkv, C, R, D, 1, torch.float32, g, prefill=False)
    fill, raw_keys, token_pos, slot_order = with_room(st, steps, steps)
    s = scores(B, Hkv, R + steps, g, random=False)
    s[1].copy_(torch.rand(B, Hkv, R + steps, generator=g))  # s_loc_past as a chunk left it
    win_count = torch.zeros(B, Hkv, dtype=torch.int64)
    glo, past, cur = (x.double() for x in s)
    cp = int(st.cache_position[0])
    for step in range(1, steps + 1):
        cp += 1
        st.cache_position = torch.tensor([cp])
        k, v = torch.randn(2, B, Hkv, 1, D, generator=g)
        valid = torch.ones(B, 1, dtype=torch.bool)
        CACHE_APPEND(st.keys, st.values, st.bias, st.slot_pos, fill, k, v, st.cache_position, valid)
        EMS_APPEND(st.keys, st.bias, fill, k, st.cache_position, valid, st.entry_start, raw_keys, st.lut,
                   st.key_scale, token_pos, slot_order, st.slot_fill)
        q = torch.randn(B, Hq, 1, D, generator=g)
        out = call(st, q, s, win_count, True, l_win)
        want_out, _, p = naive_expanded(st, q, D**-0.5)
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
        p = group_sum(p, Hkv)[:, :, 0]
        glo, cur = glo + p, cur + p
        if step % l_win == 0:
            past, cur = cur, torch.zeros_like(cur)
        assert (win_count == step % l_win).all(), f"step {step}: win_count {win_count.tolist()}"
        for name, got, want in (("s_glo", s[0], glo), ("s_loc_past", s[1], past), ("s_loc_cur", s[2], cur)):
            torch.testing.assert_close(got.double(), want, **TOL, msg=lambda m, n=name: f"step {step}, {n}: {m}")
    assert step == 70 and (s[2] != 0).any()  # 6 queries in the current buffer after the second rotation


def test_statistics_are_summed_over_the_group():
    """s_glo grows by the stats op's per-query-head column sums summed (not averaged) over the G = 4 heads."""
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, C, R, D = 2, 8, 2, 9, 20, 16
    st = make_state(B, Hkv, C, R, D, 1, torch.float32, g, prefill=False)
    q = torch.randn(B, Hq, 1, D, generator=g)
    s = scores(B, Hkv, R, g, random=False)
    win_count = torch.zeros(B, Hkv, dtype=torch.int64)
    call(st, q, s, win_count, True, 4)
    _, lse = ATTN(*st.attention_args(q), D**-0.5, True)
    total, _ = STATS(*st.stats_args(q, lse), D**-0.5, 4, True)
    torch.testing.assert_close(s[0], total.view(B, Hkv, 4, R).sum(dim=2), rtol=0, atol=1e-6)
    torch.testing.assert_close(s[2], s[0], rtol=0, atol=0)
    torch.testing.assert_close(s[0].sum(-1), torch.full((B, Hkv), 4.0), rtol=0, atol=1e-5)  # G queries' units


def test_softcap_statistics_are_the_capped_ones():
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, C, R, D, T = 1, 4, 2, 10, 20, 16, 4
    st = make_state(B, Hkv, C, R, D, T, torch.float32, g, prefill=True)
    q = 6 * torch.randn(B, Hq, T, D, generator=g)
    s = scores(B, Hkv, R, g, random=False)
    call(st, q, s, torch.zeros(B, Hkv, dtype=torch.int64), False, 2, softcap=10.0)
    p = group_sum(naive_expanded(st, q, D**-0.5, softcap=10.0)[2], Hkv)
    torch.testing.assert_close(s[0].double(), p.sum(dim=2), **TOL)
    torch.testing.assert_close(s[1].double(), p[:, :, 2:].sum(dim=2), **TOL)


def test_bad_arguments():
    g = torch.Generator().manual_seed(0)
    st = make_state(1, 2, 8, 16, 16, 1, torch.float32, g, prefill=False)
    q = torch.randn(1, 4, 1, 16, generator=g)
    s = scores(1, 2, 16, g)
    with pytest.raises(ValueError, match="l_win must be >= 1"):
        call(st, q, s, torch.zeros(1, 2, dtype=torch.int64), True, 0)
    with pytest.raises(ValueError, match="win_count must be torch.int64"):
        call(st, q, s, torch.zeros(1, 2, dtype=torch.int32), True, 4)
    with pytest.raises(ValueError, match="s_loc_cur must be torch.float32"):
        call(st, q, (s[0], s[1], s[2][..., :-1]), torch.zeros(1, 2, dtype=torch.int64), True, 4)


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
def test_opcheck(prefill):
    g = torch.Generator().manual_seed(4)
    T = 5 if prefill else 1
    st = make_state(2, 2, 9, 20, 16, T, torch.float32, g, prefill=prefill)
    q = torch.randn(2, 4, T, 16, generator=g)
    s = scores(2, 2, 20, g)
    args = (*st.attention_args(q)[:9], *s, st.slot_fill, torch.tensor([[3, 3], [0, 1]]))
    torch.library.opcheck(OP, args, dict(scale=0.25, past_only=not prefill, softcap=0.0, l_win=4))
