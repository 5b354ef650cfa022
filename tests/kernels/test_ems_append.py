"""kvrewrite::ems_append against the spec's per-token loop (ems_spec.md §6.1), written here slot by slot.

The state is an EMS row layout that has been through a merge (fill entries own more than fill slots), so the
appended entries' and slots' indices differ, as they do after every compression.
"""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)

OP = torch.ops.kvrewrite.ems_append.default
APPEND = torch.ops.kvrewrite.cache_append.default


def make_state(B=2, H=3, C=9, R=13, D=8, fill=(3, 1), extra=(2, 0), dtype=torch.float32, pos="without", seed=0):
    """Base state + EMS slot table. Row (b, h) holds fill[b] entries; entry 0 owns 1 + extra[b] slots, the others
    one each (a merged entry at the front, as after a compression). Unused slots hold the reset values."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, C, D, generator=g).to(dtype)
    values = torch.randn(B, H, C, D, generator=g).to(dtype)
    bias = torch.full((B, H, C), float("-inf"))
    slot_pos = torch.zeros(B, H, C, dtype=torch.int64)
    fill_t = torch.tensor(fill, dtype=torch.int64)[:, None].repeat(1, H)
    entry_start = torch.zeros(B, H, C, dtype=torch.int32)
    raw_keys = torch.randn(B, H, C if pos == "without" else 0, D, generator=g).to(dtype)
    lut = torch.full((B, H, R), -1, dtype=torch.int32)
    key_scale = torch.ones(B, H, R)
    token_pos = torch.zeros(B, H, R, dtype=torch.int32)
    slot_order = torch.full((B, H, R), -1, dtype=torch.int32)
    slot_fill = torch.zeros(B, H, dtype=torch.int64)
    for b in range(B):
        n = fill[b] + extra[b]
        bias[b, :, : fill[b]] = 0.0
        lut[b, :, :n] = torch.tensor([0] * (1 + extra[b]) + list(range(1, fill[b])), dtype=torch.int32)
        entry_start[b, :, : fill[b]] = torch.tensor([0] + list(range(1 + extra[b], n)), dtype=torch.int32)
        key_scale[b, :, 1 : 1 + extra[b]] = 0.5
        token_pos[b, :, :n] = torch.arange(n, dtype=torch.int32)
        slot_order[b, :, :n] = torch.arange(n, dtype=torch.int32)
        slot_fill[b] = n
        slot_pos[b, :, : fill[b]] = torch.arange(fill[b])
    return dict(keys=keys, values=values, bias=bias, slot_pos=slot_pos, fill=fill_t, entry_start=entry_start,
                raw_keys=raw_keys, lut=lut, key_scale=key_scale, token_pos=token_pos, slot_order=slot_order,
                slot_fill=slot_fill)


TABLE = ("entry_start", "raw_keys", "lut", "key_scale", "token_pos", "slot_order", "slot_fill")


def append(s, k_pre, cache_position, token_valid):
    """cache_append then ems_append, as the rewritten graph runs them."""
    B, H, T, D = k_pre.shape
    v_new = torch.randn(B, H, T, D).to(s["values"].dtype)
    APPEND(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k_pre.to(s["keys"].dtype), v_new,
           cache_position, token_valid)
    OP(s["keys"], s["bias"], s["fill"], k_pre, cache_position, token_valid, *(s[n] for n in TABLE))


def expected_after(s, k_pre, cache_position):
    """The spec's loop, per row and token: the table after appending T tokens to state s (fill not yet grown)."""
    want = {n: s[n].clone() for n in TABLE}
    B, H, T, _ = k_pre.shape
    for b in range(B):
        for h in range(H):
            for t in range(T):
                e = int(s["fill"][b, h]) + t
                j = int(s["slot_fill"][b, h]) + t
                want["lut"][b, h, j] = e
                want["key_scale"][b, h, j] = 1.0
                want["token_pos"][b, h, j] = int(cache_position[t])
                want["slot_order"][b, h, j] = j
                want["entry_start"][b, h, e] = j
                if want["raw_keys"].shape[2]:
                    want["raw_keys"][b, h, e] = k_pre[b, h, t].to(want["raw_keys"].dtype)
            want["slot_fill"][b, h] += T
    return want


def assert_table(s, want):
    for n in TABLE:
        torch.testing.assert_close(s[n], want[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_then_decode_matches_the_loop(pos, dtype):
    s = make_state(dtype=dtype, pos=pos)
    B, H, _, D = s["keys"].shape
    # a prefill chunk of 4 with row 1 left-padded by 2, then two decode steps
    steps = [(torch.arange(5, 9), torch.tensor([[True] * 4, [False, False, True, True]])),
             (torch.tensor([9]), torch.ones(B, 1, dtype=torch.bool)),
             (torch.tensor([10]), torch.ones(B, 1, dtype=torch.bool))]
    for cp, valid in steps:
        k_pre = torch.randn(B, H, cp.numel(), D)  # fp32: raw_keys holds it rounded to the model dtype
        want = expected_after(s, k_pre, cp)
        append(s, k_pre, cp, valid)
        assert_table(s, want)
    # padding tokens got slots like the others; their entries are masked by cache_append's bias -inf
    e_pad = torch.tensor([1, 2])  # row 1: fill was 1, the two padding tokens became entries 1 and 2
    assert (s["bias"][1, :, e_pad] == float("-inf")).all()
    assert (s["lut"][1, :, 1:3] == e_pad.to(torch.int32)).all()
    # slots past the fill still hold the reset values (the table's invariant)
    for b in range(B):
        n = int(s["slot_fill"][b, 0])
        assert (s["lut"][b, :, n:] == -1).all() and (s["slot_order"][b, :, n:] == -1).all()
        assert (s["key_scale"][b, :, n:] == 1).all() and (s["token_pos"][b, :, n:] == 0).all()


def test_raw_keys_untouched_outside_the_new_entries():
    s = make_state()
    before = s["raw_keys"].clone()
    k_pre = torch.randn(2, 3, 2, 8)
    append(s, k_pre, torch.tensor([7, 8]), torch.ones(2, 2, dtype=torch.bool))
    for b, f in enumerate((3, 1)):
        torch.testing.assert_close(s["raw_keys"][b, :, :f], before[b, :, :f], rtol=0, atol=0)
        torch.testing.assert_close(s["raw_keys"][b, :, f + 2 :], before[b, :, f + 2 :], rtol=0, atol=0)


def test_overflow_raises_and_keeps_slot_fill():
    s = make_state(R=6)  # row 0 holds 5 slots: 2 more do not fit
    before = {n: s[n].clone() for n in TABLE}
    with pytest.raises(IndexError):
        append(s, torch.randn(2, 3, 2, 8), torch.tensor([7, 8]), torch.ones(2, 2, dtype=torch.bool))
    for n in TABLE:  # only lut (written first, where the bounds check fails) may hold partial writes
        if n != "lut":
            torch.testing.assert_close(s[n], before[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("field, bad, words", [
    ("lut", lambda t: t.long(), "lut must be torch.int32"),
    ("key_scale", lambda t: t[..., :-1], "key_scale must be torch.float32 [2, 3, 13]"),
    ("raw_keys", lambda t: t[:, :, :4], "raw_keys must be [B, Hkv, C, D]"),
    ("slot_fill", lambda t: t.int(), "slot_fill must be torch.int64"),
    ("entry_start", lambda t: t.long(), "entry_start must be torch.int32"),
])
def test_bad_arguments_name_the_field(field, bad, words):
    s = make_state()
    s[field] = bad(s[field])
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        OP(s["keys"], s["bias"], s["fill"], torch.randn(2, 3, 1, 8), torch.tensor([7]),
           torch.ones(2, 1, dtype=torch.bool), *(s[n] for n in TABLE))


@pytest.mark.parametrize("pos", ["without", "with"])
def test_opcheck(pos):
    s = make_state(pos=pos)
    s["fill"] += 2  # as after cache_append of the two tokens
    args = (s["keys"], s["bias"], s["fill"], torch.randn(2, 3, 2, 8), torch.tensor([7, 8]),
            torch.ones(2, 2, dtype=torch.bool), *(s[n] for n in TABLE))
    torch.library.opcheck(OP, args)
