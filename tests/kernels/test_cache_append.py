"""kvrewrite::cache_append: each row writes its T new tokens at its own fill and nothing else moves."""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.state import allocate_layer_state

OP = torch.ops.kvrewrite.cache_append.default
POISON_POS = -12345


def poisoned_state(B, Hkv, C, D, dtype, fill):
    """A state whose every slot holds recognisable garbage, with per-row fills (rows may differ)."""
    s = allocate_layer_state(B, Hkv, C, D, dtype, "cpu")
    s["keys"].fill_(7.0)
    s["values"].fill_(-7.0)
    s["bias"].fill_(3.25)  # neither 0 nor -inf: an untouched slot is recognisable
    s["slot_pos"].fill_(POISON_POS)
    s["fill"].copy_(torch.as_tensor(fill))
    return s


def call(s, k_new, v_new, cache_position, token_valid):
    OP(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k_new, v_new, cache_position, token_valid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 5])
def test_writes_at_each_rows_fill(T, dtype):
    B, Hkv, C, D = 3, 2, 17, 16
    fill = torch.tensor([[0, 3], [7, 7], [12 - T, 1]])  # rows differ (outlier heads keep their own fill)
    s = poisoned_state(B, Hkv, C, D, dtype, fill)
    before = {k: v.clone() for k, v in s.items()}
    g = torch.Generator().manual_seed(T)
    k_new = torch.randn(B, Hkv, T, D, generator=g)
    v_new = torch.randn(B, Hkv, T, D, generator=g)
    cache_position = torch.arange(40, 40 + T)
    token_valid = torch.ones(B, T, dtype=torch.bool)
    token_valid[1, 0] = False  # batch row 1: first token is a left pad
    if T > 1:
        token_valid[2, : T - 2] = False
    call(s, k_new, v_new, cache_position, token_valid)

    assert torch.equal(s["fill"], fill + T)
    for b in range(B):
        for h in range(Hkv):
            f = int(fill[b, h])
            new = slice(f, f + T)
            # the new tokens, in order, in the state's dtype (values converted, not reinterpreted)
            assert torch.equal(s["keys"][b, h, new], k_new[b, h].to(dtype))
            assert torch.equal(s["values"][b, h, new], v_new[b, h].to(dtype))
            assert torch.equal(s["slot_pos"][b, h, new], cache_position)
            exp_bias = torch.where(token_valid[b], 0.0, -math.inf)
            assert torch.equal(s["bias"][b, h, new], exp_bias)
            # every other slot is bit-for-bit what it was
            other = torch.ones(C, dtype=torch.bool)
            other[new] = False
            for f_name in ("keys", "values", "bias", "slot_pos"):
                assert torch.equal(s[f_name][b, h][other], before[f_name][b, h][other]), f_name
    assert torch.equal(s["budget"], before["budget"])


def test_fill_grows_over_calls():
    """Successive appends (a prefill chunk, then decode steps) lay tokens out contiguously."""
    B, Hkv, C, D = 2, 1, 12, 8
    s = poisoned_state(B, Hkv, C, D, torch.float32, torch.zeros(B, Hkv, dtype=torch.long))
    toks = torch.randn(B, Hkv, 7, D)
    call(s, toks[:, :, :4], -toks[:, :, :4], torch.arange(4), torch.ones(B, 4, dtype=torch.bool))
    for t in range(4, 7):
        call(s, toks[:, :, t : t + 1], -toks[:, :, t : t + 1], torch.tensor([t]), torch.ones(B, 1, dtype=torch.bool))
        assert (s["fill"] == t + 1).all()
    assert torch.equal(s["keys"][:, :, :7], toks)
    assert torch.equal(s["values"][:, :, :7], -toks)
    assert torch.equal(s["slot_pos"][:, :, :7], torch.arange(7).expand(B, Hkv, 7))
    assert (s["bias"][:, :, :7] == 0).all()
    assert (s["slot_pos"][:, :, 7:] == POISON_POS).all() and (s["bias"][:, :, 7:] == 3.25).all()


def test_fill_up_to_capacity():
    """fill + T == C exactly (the runtime's guarantee) writes the last slots and nothing out of range."""
    s = poisoned_state(1, 2, 6, 4, torch.float32, torch.tensor([[3, 5]]))
    k = torch.randn(1, 2, 1, 4)
    call(s, k, k, torch.tensor([9]), torch.ones(1, 1, dtype=torch.bool))
    assert torch.equal(s["fill"], torch.tensor([[4, 6]]))
    assert torch.equal(s["keys"][0, 0, 3], k[0, 0, 0]) and torch.equal(s["keys"][0, 1, 5], k[0, 1, 0])
    assert (s["keys"][0, 0, 4:] == 7).all()


def test_opcheck():
    s = poisoned_state(2, 3, 9, 8, torch.bfloat16, torch.tensor([[0, 2, 4], [1, 1, 1]]))
    k = torch.randn(2, 3, 3, 8, dtype=torch.bfloat16)
    valid = torch.tensor([[False, True, True], [True, True, True]])
    torch.library.opcheck(
        OP, (s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k, -k, torch.arange(3, 6), valid)
    )


def test_past_capacity_raises_and_writes_nothing_outside_the_state():
    """fill + T > C (the runtime refuses it first): the reference raises IndexError and writes nothing past C.
    Every field is a view into a larger poisoned buffer (room for T slots after each row), so a write past a
    row's C slots would land in the poison; values, bias, slot_pos and fill are untouched, keys at most in
    the slots [fill, C) (module docstring, "Capacity")."""
    B, Hkv, C, D, T = 2, 2, 6, 4, 3
    bufs = poisoned_state(B, Hkv, C + T, D, torch.float32, 0)
    fill_buf = torch.full((B, Hkv + 1), -5, dtype=torch.long)  # one poisoned column after the fill
    s = {k: v[:, :, :C] for k, v in bufs.items() if k in ("keys", "values", "bias", "slot_pos")}
    s["fill"] = fill_buf[:, :Hkv]
    s["fill"].copy_(torch.tensor([[C - T, C - 1], [C, 0]]))  # one row fits, two pass C, one is full
    before = {k: v.clone() for k, v in bufs.items()}
    fill0, fill_buf0 = s["fill"].clone(), fill_buf.clone()
    k = torch.randn(B, Hkv, T, D)
    with pytest.raises(IndexError, match="out of bounds"):
        call(s, k, k, torch.arange(T), torch.ones(B, T, dtype=torch.bool))
    for f_name in ("values", "bias", "slot_pos"):
        assert torch.equal(bufs[f_name], before[f_name]), f_name
    assert torch.equal(bufs["keys"][:, :, C:], before["keys"][:, :, C:]), "a key was written past C"
    for b in range(B):
        for h in range(Hkv):
            assert torch.equal(bufs["keys"][b, h, : int(fill0[b, h])], before["keys"][b, h, : int(fill0[b, h])])
    assert torch.equal(fill_buf, fill_buf0), "fill must not advance"
