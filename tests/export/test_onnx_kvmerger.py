"""KVMerger's ONNX function (kvrewrite/export/onnx_kvmerger.py) against the op's reference, in onnxruntime, on random
states with planted runs of near-identical keys: both readings (chain; anchor, a Loop), both budget modes, every
sigma_mode and values_mode, sinks; odd capacities, ragged fills, rows not due (and one due only through its deficit),
batch 2 with left padding, fp32 and fp16; the fallback eviction; exact ties (integer keys and scores); the top_flags
helper with -inf keys.

Tolerances: rows not due are bit-identical (every field); in due rows every integer field (fill, deficit, degree,
slot_pos), the empty slots (-inf bias) and the scores (ScatterElements(add) in index_add_'s order) equal the
reference exactly. The merged keys and values go through the runtime's Exp and fp32 sums over D in another order:
within 1e-6 relative (fp32; fp16 outputs: one fp16 step, 1e-3 relative), the merged bias (log of the degree) 1e-6.
"""
import math

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from kvrewrite.kernels.kvmerger_compress import (BUDGET_MODES, READINGS, SIGMA_MODES, VALUES_MODES,  # noqa: E402
                                                 _top_flags, reference_kvmerger_compress)
from tests.export.test_onnx import _run_function  # noqa: E402
from tests.kernels.test_kvmerger_compress import DEFAULTS, FIELDS, MUTATED, clone, make_state  # noqa: E402

NEG = -math.inf


def _attrs(o):
    """The node's attributes for the op's options (string options as their index; the ratios are an input)."""
    return dict(n_sink=o["n_sink"], epsilon=o["epsilon"], sigma=o["sigma"],
                sigma_mode=SIGMA_MODES.index(o["sigma_mode"]), values_mode=VALUES_MODES.index(o["values_mode"]),
                reading=READINGS.index(o["reading"]), budget_mode=BUDGET_MODES.index(o["budget_mode"]))


def _compress(s, o):
    """(reference outputs, ONNX outputs) of one call on state s, as dicts of the mutated fields."""
    ref = clone(s)
    reference_kvmerger_compress(*(ref[f] for f in FIELDS), **o)
    inputs = {**{f: s[f] for f in FIELDS},
              "ratios": torch.tensor([o["recent_ratio"], o["hh_ratio"]], dtype=torch.float64)}
    out = _run_function("kvmerger_compress", inputs, [ref[f] for f in MUTATED], **_attrs(o))
    return {f: ref[f] for f in MUTATED}, dict(zip(MUTATED, out))


def _assert_matches(before, got, want, fp16=False):
    due = before["fill"] + before["deficit"] >= before["budget"][1]
    for f in MUTATED:
        assert got[f].dtype == want[f].dtype and got[f].shape == want[f].shape, f
        rows_not_due = ~due
        assert torch.equal(got[f][rows_not_due], before[f][rows_not_due]), f"{f}: a row not due was changed"
        if f in ("keys", "values", "bias"):
            assert torch.equal(torch.isinf(got[f]), torch.isinf(want[f])), f"{f}: other empty (-inf) slots"
            finite = torch.isfinite(want[f])
            tol = 1e-3 if fp16 and f != "bias" else 1e-6
            torch.testing.assert_close(got[f][finite], want[f][finite], rtol=tol, atol=tol, msg=f)
        else:  # fill, deficit, degree, slot_pos, and the scores: exact
            assert torch.equal(got[f], want[f]), f"{f} differs\n{got[f]}\n{want[f]}"


def _state(B, H, C, D, fills, target, threshold, pads, deficit, dtype, seed):
    s = make_state(B, H, C, D, fills, target, threshold, pads=pads, seed=seed)
    s["keys"], s["values"] = s["keys"].to(dtype), s["values"].to(dtype)
    s["deficit"] = torch.as_tensor(deficit).long()
    for f in ("keys", "values", "score"):  # garbage past the fill, which a due row must not read
        s[f][s["bias"] == NEG] += 100
    return s


# (B, H, C, D, fills, target, threshold, pads, deficit): every case holds due rows over the target, rows not due,
# and (but the smallest) a due row at most at the target (packed only)
SHAPES = {
    "odd-C": (1, 2, 9, 4, [[9, 5]], 4, 7, (), [[0, 0]]),
    "pair": (1, 2, 2, 4, [[2, 1]], 1, 2, (), [[0, 0]]),  # C = 2, B = 1: the one pair joins
    # batch 2, row 0 left-padded by 3; ragged fills; (0, 2) not due; (1, 2) due at the threshold; (1, 0) packs only
    "batch2-padded": (2, 3, 24, 8, [[24, 21, 12], [16, 24, 19]], 8, 16, (3,), [[0, 0, 0], [0, 0, 0]]),
    # odd C and D = 16, both rows left-padded; (0, 1) due only through its deficit (fill 18 + 2 = 20), with 9 valid
    # slots (packed only, its deficit becomes min(9 + 2, 11) - 9); (1, 1) not due despite its deficit
    "odd-C-deficit": (2, 2, 33, 16, [[33, 18], [27, 15]], 11, 20, (9, 6), [[0, 2], [1, 3]]),
}
MODES = [("chain", "exact"), ("chain", "epsilon"), ("anchor", "exact"), ("anchor", "epsilon")]
VARIANTS = [  # sigma_mode, values_mode, n_sink, epsilon, sigma
    ("fixed", "scale", 0, 0.75, 5.0), ("distance", "bias", 2, 0.0, 5.0), ("paper", "scale", 1, 0.5, 5.0),
    ("fixed", "bias", 0, -0.9, 0.4),  # nearly every pair above epsilon: "epsilon" and "anchor" keep fewer than Bt
]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("reading,budget_mode", MODES, ids=[f"{r}-{b}" for r, b in MODES])
@pytest.mark.parametrize("variant", VARIANTS, ids=[f"{v[0]}-{v[1]}-sink{v[2]}-eps{v[3]}" for v in VARIANTS])
def test_kvmerger_compress_function(shape, reading, budget_mode, variant):
    B, H, C, D, fills, target, threshold, pads, deficit = SHAPES[shape]
    sigma_mode, values_mode, n_sink, epsilon, sigma = variant
    o = dict(DEFAULTS, reading=reading, budget_mode=budget_mode, sigma_mode=sigma_mode, values_mode=values_mode,
             n_sink=n_sink, epsilon=epsilon, sigma=sigma)
    s = _state(B, H, C, D, fills, target, threshold, pads, deficit, torch.float32, seed=C + n_sink)
    want, got = _compress(s, o)
    _assert_matches(s, got, want)
    due = s["fill"] + s["deficit"] >= threshold
    assert bool((~due).any()), "every row is due: the case tests too little"
    if not (shape == "pair" and n_sink):  # (a sink takes the pair's only slot: the fallback evicts the other)
        assert bool((want["degree"] > s["degree"]).any()), "nothing merged: the case tests too little"
    if (reading == "anchor" or budget_mode == "epsilon") and epsilon < -0.5 and C > 20:
        assert bool((want["deficit"] > s["deficit"]).any()), "no deficit: the adaptive modes are not exercised"


@pytest.mark.parametrize("reading,budget_mode", MODES, ids=[f"{r}-{b}" for r, b in MODES])
@pytest.mark.parametrize("values_mode", VALUES_MODES)
def test_kvmerger_compress_function_fp16(reading, budget_mode, values_mode):
    B, H, C, D, fills, target, threshold, pads, deficit = SHAPES["batch2-padded"]
    o = dict(DEFAULTS, reading=reading, budget_mode=budget_mode, values_mode=values_mode, sigma_mode="distance",
             n_sink=1, epsilon=0.2)
    s = _state(B, H, C, D, fills, target, threshold, pads, deficit, torch.float16, seed=5)
    want, got = _compress(s, o)
    _assert_matches(s, got, want, fp16=True)
    assert bool((want["degree"] > s["degree"]).any())


@pytest.mark.parametrize("reading", READINGS)
def test_fallback_eviction(reading):
    """Heavy hitters on every other slot leave no two mergeable slots adjacent: too few joins, the set slots with
    the lowest summed score are evicted (ties: the earlier) until Bt remain; degrees are no longer conserved."""
    s = make_state(2, 2, 17, 4, [[17, 17], [17, 12]], 4, 12, seed=3)
    s["score"][..., 1:12:2] = 10.0  # exact ties among the heavy hitters: the earlier ones are protected
    s["score"][1, 0, 2:12:2] = 0.5  # exact ties among the evicted candidates too
    o = dict(DEFAULTS, recent_ratio=0.0, hh_ratio=0.5, reading=reading)
    want, got = _compress(s, o)
    _assert_matches(s, got, want)
    assert want["fill"].tolist() == [[4, 4], [4, 4]]
    valid = (s["bias"] > NEG) & (torch.arange(17) < s["fill"][..., None])
    kept = torch.arange(17) < want["fill"][..., None]
    assert bool(((want["degree"] * kept).sum(-1) < (s["degree"] * valid).sum(-1)).all()), "nothing was evicted"


@pytest.mark.parametrize("reading,budget_mode", MODES, ids=[f"{r}-{b}" for r, b in MODES])
def test_exact_ties(reading, budget_mode):
    """Integer keys from three prototypes (and a zero key: cos 0 with everything) and integer scores: equal cosines
    are computed exactly by both, so the tie rules are exercised: heavy hitters, pairs and pivots go to the earlier
    slot in both."""
    g = torch.Generator().manual_seed(17)
    B, H, C, D = 2, 2, 21, 4
    s = make_state(B, H, C, D, [[21, 21], [19, 21]], 7, 19, pads=(0, 2), seed=17)
    protos = torch.tensor([[1.0, 2, 0, -1], [1, 2, 1, -1], [0, -1, 2, 2], [0, 0, 0, 0]])
    s["keys"] = protos[torch.randint(0, 4, (B, H, C), generator=g)]
    s["score"] = torch.randint(0, 3, (B, H, C), generator=g).float()
    o = dict(DEFAULTS, reading=reading, budget_mode=budget_mode, epsilon=0.8, n_sink=1)
    want, got = _compress(s, o)
    _assert_matches(s, got, want)
    assert bool((want["degree"] > s["degree"]).any())


@pytest.mark.parametrize("reading", READINGS)
def test_anchor_reading_on_drifting_keys(reading):
    """Keys turning by 25 degrees a slot: every adjacent cosine (0.91) is above epsilon 0.8, a key two slots away
    (0.64) is not. "chain" joins every pair (one slot), "anchor" pairs each anchor with its left neighbour only
    (8 sets of 2): the Loop carries each row's anchor as the reference does."""
    C, D = 16, 4
    angle = torch.arange(C) * math.radians(25)
    keys = torch.zeros(1, 2, C, D)
    keys[..., 0], keys[..., 1] = angle.cos(), angle.sin()
    keys[0, 1] *= torch.linspace(1, 3, C)[:, None]  # norms differ: the cosines do not
    s = make_state(1, 2, C, D, [[C, C]], 14, C, degrees=False, seed=19)
    s["keys"] = keys
    o = dict(DEFAULTS, reading=reading, budget_mode="epsilon", epsilon=0.8, recent_ratio=0.0, hh_ratio=0.0)
    want, got = _compress(s, o)
    _assert_matches(s, got, want)
    assert want["fill"].tolist() == ([[1, 1]] if reading == "chain" else [[8, 8]])
    assert want["deficit"].tolist() == ([[13, 13]] if reading == "chain" else [[6, 6]])


def test_top_flags_helper():
    """kvrewrite::top_flags (run eagerly through onnxscript) = the reference's _top_flags, with exact ties, eligible
    entries at -inf (ranked after every finite eligible one, before no ineligible one) and counts past the row."""
    from kvrewrite.export.onnx_kvmerger import top_flags

    g = torch.Generator().manual_seed(3)
    key = torch.randint(0, 4, (2, 3, 11), generator=g).float()
    key[key == 0] = NEG
    eligible = torch.rand(2, 3, 11, generator=g) < 0.7
    count = torch.tensor([[0, 3, 5], [7, 11, 20]])
    want = _top_flags(key.view(6, 11), eligible.view(6, 11), count.view(6)).view(2, 3, 11)
    got = top_flags(key.numpy(), eligible.numpy(), count[..., None].numpy())
    assert torch.equal(torch.from_numpy(got), want)
