"""kvrewrite::expanded_attention against a dense float64 attention over materialised expanded keys
(tests/kernels/expanded_naive.py: k̂_j = key_scale_j * keys[lut_j], v̂_j = values[lut_j]), ems_spec.md §9."""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from tests.kernels.expanded_naive import make_state, naive_expanded

OP = torch.ops.kvrewrite.expanded_attention.default

# out and lse against float64 on the same (already rounded) inputs, the spec's §9 tolerances:
#   fp32: fp32 scores/softmax/accumulation over O(5) logits and |v| <= ~4: errors ~1e-6, bounded by 1e-5;
#   bf16: the fp32 result rounded once to bf16 (2**-8 relative), bounded by 2e-2.
# A real bug (a key scale dropped, a wrong GQA head, an off-by-one mask) moves outputs by >= 1e-2 at these sizes,
# and the bf16 cases share their states with fp32 ones that do catch it.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (B, Hq, Hkv, C, R, D, T, mode, options): mode "prefill" (T > 1, causal per entry) or "decode" (past_only)
CASES = {
    "decode-G1": (2, 2, 2, 8, 16, 16, 1, "decode", {}),
    "decode-G2": (2, 4, 2, 8, 16, 16, 1, "decode", {}),
    "decode-G4": (1, 8, 2, 10, 24, 16, 1, "decode", {}),
    "decode-MQA": (2, 4, 1, 9, 20, 16, 1, "decode", {}),
    "prefill-G2": (2, 4, 2, 12, 24, 16, 5, "prefill", {}),
    "prefill-MQA": (1, 3, 1, 12, 24, 8, 4, "prefill", {}),
    "odd-C7-R13": (3, 6, 3, 7, 13, 8, 3, "prefill", {}),
    "dead-slots": (2, 4, 2, 9, 20, 16, 3, "prefill", {"dead": True}),
    "nothing-visible": (2, 4, 2, 8, 16, 16, 3, "prefill", {"empty_row": True}),
    "decode-nothing-visible": (2, 2, 1, 8, 16, 16, 1, "decode", {"empty_row": True}),
}


def build(case, dtype, seed=0):
    B, Hq, Hkv, C, R, D, T, mode, opts = CASES[case]
    g = torch.Generator().manual_seed(seed)
    st = make_state(B, Hkv, C, R, D, T, dtype, g, prefill=mode == "prefill", **opts)
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    return st, q, D**-0.5, mode == "decode"


def check(out, lse, want_out, want_lse, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), want_out, **tol,
                               msg=lambda m: f"out: max |diff| {(out.double() - want_out).abs().max():.3g}; {m}")
    assert (torch.isinf(lse) == torch.isinf(want_lse)).all(), "lse: -inf at different queries"
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], **tol)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES)
def test_matches_dense_expanded_attention(case, dtype):
    st, q, scale, past_only = build(case, dtype)
    out, lse = OP(*st.attention_args(q), scale, past_only)
    assert out.dtype == dtype and out.is_contiguous() and lse.dtype == torch.float32
    want_out, want_lse, _ = naive_expanded(st, q, scale)
    check(out, lse, want_out, want_lse, dtype)


def test_merged_slots_count_with_their_own_scale():
    """The cases above are not vacuous: they hold merged entries whose slots have varied key scales, and dropping
    the scale (attending each entry once per slot with its stored key) moves the output by far more than TOL."""
    st, q, scale, past_only = build("prefill-G2", torch.float32)
    merged = (st.key_scale != 1).sum()
    assert merged >= 4
    out, _ = OP(*st.attention_args(q), scale, past_only)
    st.key_scale.fill_(1.0)
    unscaled, _ = OP(*st.attention_args(q), scale, past_only)
    assert (out - unscaled).abs().max() > 1e-2


def test_nothing_visible_gives_zero_and_minus_inf():
    st, q, scale, _ = build("nothing-visible", torch.float32)
    out, lse = OP(*st.attention_args(q), scale)
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()
    assert torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", ["decode-G2", "prefill-G2", "dead-slots"])
def test_softcap(case, dtype):
    st, q, scale, past_only = build(case, dtype, seed=1)
    q = (6 * q.float()).to(dtype)  # logits of O(20): the cap at 10 matters
    out, lse = OP(*st.attention_args(q), scale, past_only, 10.0)
    want_out, want_lse, _ = naive_expanded(st, q, scale, softcap=10.0)
    check(out, lse, want_out, want_lse, dtype)
    uncapped, _, _ = naive_expanded(st, q, scale)
    assert (uncapped - want_out).abs().max() > 1e-2  # the cap is exercised


def test_past_only_broken_promise_raises():
    st, q, scale, _ = build("decode-G2", torch.float32)
    st.cache_position = st.cache_position - 1  # the newest live entry now lies after the query
    with pytest.raises(ValueError, match="past_only=True"):
        OP(*st.attention_args(q), scale, True)
    OP(*st.attention_args(q), scale, False)  # without the promise the causal mask handles it


def test_past_only_changes_nothing():
    st, q, scale, _ = build("decode-MQA", torch.float32)
    a = OP(*st.attention_args(q), scale, True)
    b = OP(*st.attention_args(q), scale, False)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("field, bad, words", [
    ("lut", lambda t: t.long(), "lut must be torch.int32"),
    ("key_scale", lambda t: t[..., :-1], "key_scale must be torch.float32"),
    ("entry_start", lambda t: t.long(), "entry_start must be torch.int32"),
    ("slot_fill", lambda t: t[:, :1], "slot_fill must be torch.int64"),
    ("bias", lambda t: t.double(), "bias must be torch.float32"),
])
def test_bad_arguments_name_the_field(field, bad, words):
    st, q, scale, _ = build("decode-G2", torch.float32)
    setattr(st, field, bad(getattr(st, field)))
    with pytest.raises(ValueError, match=words):
        OP(*st.attention_args(q), scale)


def test_bad_softcap_raises():
    st, q, scale, _ = build("decode-G2", torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        OP(*st.attention_args(q), scale, False, -1.0)


@pytest.mark.parametrize("case, dtype, past_only, softcap", [
    ("prefill-G2", torch.float32, False, 0.0),
    ("decode-MQA", torch.bfloat16, True, 0.0),
    ("odd-C7-R13", torch.float32, False, 20.0),
])
def test_opcheck(case, dtype, past_only, softcap):
    st, q, scale, _ = build(case, dtype)
    torch.library.opcheck(OP, (*st.attention_args(q), scale), {"past_only": past_only, "softcap": softcap})


def test_large_batch_split_rule_is_opt_in(monkeypatch):
    """The full width's splits (NARROW off): expanded_attention.RESIDENT_PROGRAMS = 0 (the default) keeps one split
    where a decode grid overflows the SMs; set (e.g. by `kvrewrite bench --kernel-option
    expanded_attention.RESIDENT_PROGRAMS=2`) it takes clustered_attention's fewest-waves split count there, and
    nothing changes where the grid fits."""
    pytest.importorskip("triton")
    from kvrewrite.kernels import expanded_attention as xa
    from kvrewrite.kernels.clustered_attention import fewest_waves_splits

    def splits(B):
        return xa._launch_config(B, 8, 4, 1, 6656, 128, 132, 2, narrow=False)["num_splits"]

    assert xa.RESIDENT_PROGRAMS == 0
    before = {B: splits(B) for B in (1, 8, 33, 34, 40)}
    assert before[34] == before[40] == 1
    monkeypatch.setattr(xa, "RESIDENT_PROGRAMS", 2)
    assert {B: splits(B) for B in (1, 8, 33)} == {B: before[B] for B in (1, 8, 33)}
    assert splits(34) == fewest_waves_splits(34 * 8, 2 * 132) > 1 and splits(40) == fewest_waves_splits(320, 264)


def test_narrow_split_rule():
    """The narrow form's decode splits (NARROW, the default): NARROW_SPLITS asked up to batch 8 of 8 KV heads, then
    at most NARROW_PROGRAMS programs in all; grids of at most NARROW_FEW_ROWS rows ask NARROW_FEW_SPLITS of
    NARROW_FEW_BLOCK_J-slot chunks; whole tiles of >= 2 (64 asked at 6656 entries in 64-entry tiles: 52)."""
    pytest.importorskip("triton")
    from kvrewrite.kernels import expanded_attention as xa

    def cfg(B, C=6656, Hkv=8):
        return xa._launch_config(B, Hkv, 4, 1, C, 128, 132, 2)

    assert xa.NARROW and xa.NARROW_FEW_ROWS == 8 and all(cfg(B)["gm"] == 4 for B in (1, 8, 40))
    assert all(cfg(B)["block_j"] == xa.NARROW_BLOCK_J for B in (2, 8, 40)) and cfg(1)["block_j"] == 128
    assert cfg(8)["num_splits"] == cfg(2)["num_splits"] == 52  # 104 tiles: 2 a split
    assert cfg(1)["num_splits"] == cfg(2, Hkv=4)["num_splits"] == 35  # 8 rows, 48 asked: 3 tiles a split
    assert cfg(2, 26527)["num_splits"] == 60  # 415 tiles, 64 asked: 7 a split
    assert cfg(1, 26527)["num_splits"] == 47  # 48 asked: 9 a split
    assert cfg(40)["num_splits"] == 12 and cfg(64)["num_splits"] == 8  # 4096 // (B * 8)
    assert xa._launch_config(1, 8, 4, 1, 6656, 128, 132, 2, num_splits=5)["num_splits"] == 5  # the override wins
    with pytest.MonkeyPatch.context() as mp:  # the rule off: batch 1 takes the 64 / 64 default
        mp.setattr(xa, "NARROW_FEW_ROWS", 0)
        assert cfg(1)["num_splits"] == 52 and cfg(1)["block_j"] == xa.NARROW_BLOCK_J


def test_prefill_kernel_tiles():
    """The prefill kernel's tiles: 128 x 32 for 16-bit inputs with D <= 128 (the H200 sweep's fastest), otherwise
    clustered_attention's prefill config (64 x 64, halved for shared memory); overrides win either way."""
    pytest.importorskip("triton")
    from kvrewrite.kernels._expanded_prefill_kernels import expanded_prefill_config

    cfg = expanded_prefill_config(8, 8, 4, 2048, 8665, 128, 2)
    assert (cfg["block_m"], cfg["block_n"], cfg["num_warps"], cfg["num_stages"], cfg["m_blocks"]) == (128, 32, 4, 2,
                                                                                                      64)
    assert (expanded_prefill_config(1, 8, 4, 2048, 8665, 128, 4)["block_m"],
            expanded_prefill_config(1, 8, 4, 2048, 8665, 256, 4)["block_n"]) == (64, 32)
    assert expanded_prefill_config(1, 8, 4, 2048, 8665, 64, 2, block_m=64, block_n=64)["block_n"] == 64


def test_gather_slots_writes_each_slots_row():
    """_expanded_prefill_kernels.gather_slots (the gathered prefill form's input): slot j's key and value are
    keys/values[lut_j], bias' 0 exactly where j is live (j < slot_fill, lut_j >= 0, its entry's bias > -inf), and
    slot_pos' its entry's position: checked slot by slot, with freed slots, stale slots past the fill and padding."""
    from kvrewrite.kernels._expanded_prefill_kernels import gather_slots, gathered_bytes

    st, _, _, _ = build("dead-slots", torch.bfloat16)
    k, v, bias, pos = gather_slots(st.keys, st.values, st.bias, st.slot_pos, st.lut, st.slot_fill)
    B, Hkv, R = st.lut.shape
    n_live = 0
    for b in range(B):
        for h in range(Hkv):
            for j in range(R):
                e = int(st.lut[b, h, j])
                live = e >= 0 and j < int(st.slot_fill[b, h]) and st.bias[b, h, e] > -math.inf
                n_live += live
                assert bias[b, h, j] == (0.0 if live else -math.inf), (b, h, j)
                if e >= 0:
                    assert torch.equal(k[b, h, j], st.keys[b, h, e]) and torch.equal(v[b, h, j], st.values[b, h, e])
                    assert pos[b, h, j] == st.slot_pos[b, h, e]
    assert 0 < n_live < B * Hkv * R and k.dtype == torch.bfloat16 and bias.dtype == torch.float32
    assert gathered_bytes(B, Hkv, R, k.shape[-1], 2) == k.nbytes + v.nbytes + bias.nbytes + pos.nbytes


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_gather_slots_index_select_is_the_same_copy(layout):
    """GATHER_INDEX_SELECT's row copy (index_select over the [B * Hkv * C, D] rows) gives the advanced index's rows
    bit for bit; keys and values that are not contiguous (here: views of a wider buffer) take the advanced index."""
    from kvrewrite.kernels import _expanded_prefill_kernels as xp

    st, _, _, _ = build("dead-slots", torch.bfloat16)
    keys, values = st.keys, st.values
    if layout == "strided":
        keys = torch.cat([keys, torch.zeros_like(keys)], -1)[..., :keys.shape[-1]]
        values = torch.cat([values, torch.zeros_like(values)], 2)[:, :, :values.shape[2]]
        assert not keys.is_contiguous() and not values.is_contiguous()
    args = (keys, values, st.bias, st.slot_pos, st.lut, st.slot_fill)
    want = xp.gather_slots(*args, index_select=False)
    got = xp.gather_slots(*args, index_select=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[0].shape == (*st.lut.shape, keys.shape[-1]) and got[0].is_contiguous()
    calls = []
    real = torch.Tensor.index_select
    with pytest.MonkeyPatch.context() as mp:  # the row copy is the one that ran, for contiguous rows only
        mp.setattr(torch.Tensor, "index_select", lambda self, *a: calls.append(1) or real(self, *a))
        xp.gather_slots(*args, index_select=True)
    assert len(calls) == (2 if layout == "contiguous" else 0)


@pytest.mark.parametrize("T, Hq, override, form", [
    (512, 2, None, "gathered"), (511, 2, None, "walk"), (1, 32, None, "walk"), (17, 2, True, "gathered"),
    (600, 2, False, "walk")], ids=["chunk-512", "chunk-511", "decode-of-32-heads", "forced-on", "forced-off"])
def test_prefill_form_follows_the_query_count(T, Hq, override, form, monkeypatch):
    """launch_expanded_forward's prefill-sized blocks: the gathered form from PREFILL_GATHERED_MIN_QUERIES queries
    (the copy pays for itself only over many queries), the walk below it (a decode step of a wide group, a short last
    chunk), a launch's `gathered` override either way. The launchers are stubs: this is the rule, not the kernels.
    The launch's tile arithmetic needs Triton (not installed by the README's CPU install); the rule alone runs
    everywhere: test_gathered_rule_without_triton."""
    pytest.importorskip("triton")
    from kvrewrite.kernels import _expanded_prefill_kernels as xp
    from kvrewrite.kernels import expanded_attention as xa

    assert xa.PREFILL_GATHERED and xa.PREFILL_GATHERED_MIN_QUERIES == 512
    picked = []
    monkeypatch.setattr(xp, "launch_gathered_prefill", lambda *a, **k: picked.append("gathered") or (None, None))
    monkeypatch.setattr(xp, "launch_expanded_prefill", lambda *a, **k: picked.append("walk") or (None, None))
    C, R, D = 8, 16, 16  # shapes only: nothing is read
    kv = torch.zeros(1, 1, C, D)
    args = (torch.zeros(1, Hq, T, D), kv, kv, torch.zeros(1, 1, C), torch.zeros(1, 1, C, dtype=torch.int64),
            torch.arange(T), torch.zeros(1, 1, C, dtype=torch.int32), torch.zeros(1, 1, R, dtype=torch.int32),
            torch.ones(1, 1, R), torch.zeros(1, 1, dtype=torch.int64))
    tuning = {} if override is None else dict(gathered=override)
    xa.launch_expanded_forward(*args, 0.25, T == 1, 0.0, num_splits=1, **tuning)
    assert picked == [form]
    monkeypatch.setattr(xa, "PREFILL_GATHERED", False)
    assert not xa.uses_gathered(4096) and xa.uses_gathered(4096, True)


def test_full_tiles_override_reaches_the_gathered_prefill(monkeypatch):
    """A launch's full_tiles override (_prefill_attention_kernels.FULL_TILES) goes to the gathered form's prefill
    kernel; the walk has no such loop and refuses it (stub launchers: the routing only)."""
    pytest.importorskip("triton")
    from kvrewrite.kernels import _expanded_prefill_kernels as xp
    from kvrewrite.kernels import expanded_attention as xa

    got = []
    monkeypatch.setattr(xp, "launch_gathered_prefill", lambda *a, **k: got.append(k) or (None, None))
    monkeypatch.setattr(xp, "launch_expanded_prefill", lambda *a, **k: got.append(k) or (None, None))
    T, C, R, D = 600, 8, 16, 16
    kv = torch.zeros(1, 1, C, D)
    args = (torch.zeros(1, 2, T, D), kv, kv, torch.zeros(1, 1, C), torch.zeros(1, 1, C, dtype=torch.int64),
            torch.arange(T), torch.zeros(1, 1, C, dtype=torch.int32), torch.zeros(1, 1, R, dtype=torch.int32),
            torch.ones(1, 1, R), torch.zeros(1, 1, dtype=torch.int64))
    xa.launch_expanded_forward(*args, 0.25, False, 0.0, num_splits=1, full_tiles=True)
    xa.launch_expanded_forward(*args, 0.25, False, 0.0, num_splits=1)
    assert got[0]["full_tiles"] is True and got[1]["full_tiles"] is None
    with pytest.raises(ValueError, match="gathered=False"):
        xa.launch_expanded_forward(*args, 0.25, False, 0.0, num_splits=1, full_tiles=True, gathered=False)


def test_gathered_rule_without_triton(monkeypatch):
    """uses_gathered, the rule launch_expanded_forward follows: from PREFILL_GATHERED_MIN_QUERIES queries, overrides
    winning both ways, nothing while PREFILL_GATHERED is off (unless forced)."""
    from kvrewrite.kernels import expanded_attention as xa

    assert xa.PREFILL_GATHERED and xa.PREFILL_GATHERED_MIN_QUERIES == 512
    assert xa.uses_gathered(512) and not xa.uses_gathered(511) and not xa.uses_gathered(1)
    assert xa.uses_gathered(17, True) and not xa.uses_gathered(600, False)
    monkeypatch.setattr(xa, "PREFILL_GATHERED", False)
    assert not xa.uses_gathered(4096) and xa.uses_gathered(4096, True)
