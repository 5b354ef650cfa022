"""EMS's exports (method ems; docs/deploy.md, "EMS"):

- the functional twins kvrewrite_export::ems_append / ems_attention / ems_compress return exactly what the in-place ops
  write (and ems_attention's output), on random states with rows due and not, and leave their inputs alone;
- TensorRT (not installed: up to the torch-tensorrt call): op set, plugin descriptions, the functional graph computes
  the in-place graph with the compression due;
- .pt2 + the loader reproduce rw.generate token for token (final state identical), both key variants; AOTInductor:
  the decode step with a compression due, compiled alone, equals the eager graph;
- ONNX: the ems_append, ems_attention and ems_compress functions against the ops in onnxruntime, and the whole model
  against the PyTorch runtime (tokens identical).
"""
import functools
import math

import pytest
import torch

import kvrewrite
import kvrewrite.export
from kvrewrite.export import loader
from kvrewrite.export import tensorrt_export as te
from kvrewrite.export.common import graph_of
from tests.export.checks import (aoti_step_when_due, check_decode_compress_when_due, check_loader_generates_like_rw,
                                  left_padded_prompts)
from tests.families import tiny_model
from tests.kernels import ems_naive as N
from tests.kernels.expanded_naive import make_state as attention_state

PROMPT, NEW = 24, 12
OPS = torch.ops.kvrewrite
TWINS = torch.ops.kvrewrite_export
STATE = N.STATE_FIELDS  # keys .. slot_fill, budget included: ems_compress's arguments in order
APPENDED = ("entry_start", "raw_keys", "lut", "key_scale", "token_pos", "slot_order", "slot_fill")
STATS = ("s_glo", "s_loc_past", "s_loc_cur")
# B = 12 entries = a 4-token window + 8 centres, gamma 4 (up to 48 slots), a compression every 4 decode steps; tau 0.3
# (below the default 0.6: the tiny model's random keys and values rarely reach 0.6, and the merges must happen)
OPTIONS = dict(budget=12, window=4, kernel=3, interval=4, tau=0.3)


def _rw(pos="without"):
    m = tiny_model("llama")
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return kvrewrite.apply(m, "ems", max_length=40, batch_size=2, prefill_chunk=16, pos=pos, **OPTIONS)


_inputs = functools.partial(left_padded_prompts, PROMPT)


@pytest.fixture(scope="module")
def rw():
    return _rw()


def _compress_state(seed=1, pos="without", dtype=torch.float32, rounds=1):
    """A random EMS state (tests/kernels/ems_naive.py rows, planted redundant tokens) with merged entries after
    `rounds` compressions (B = 7, window 2, tau 0.2), then 6 appended tokens and fresh scores: batch row 1 left-padded
    by 3, rows (0, 0) and (1, 1) due (budget [7, 13] against fills 13/12), the others not."""
    from tests.kernels.test_ems_merge import grow, rescore

    rows = N.random_rows(2, 2, 12, 8, pads=(0, 3), seed=seed, dup=0.4)
    s = N.to_state(rows, 24, 64, dtype=dtype, pos=pos, budget=(7, 8))
    for rnd in range(rounds):
        OPS.ems_compress(*(s[f] for f in STATE), l_win=2, pool=3, gamma=3.0, tau=0.2)
        grow(s, rows, 6, seed=seed + 10 + rnd, pos0=100 + 10 * rnd)
        rescore(s, rows, seed=seed + 20 + rnd)
    for b, h in ((0, 1), (1, 0)):  # one below the threshold: the newest token (one entry, one slot) taken back
        f, j = int(s["fill"][b, h]) - 1, int(s["slot_fill"][b, h]) - 1
        assert int(s["entry_start"][b, h, f]) == j and int(s["slot_order"][b, h, j]) == j
        s["bias"][b, h, f], s["entry_start"][b, h, f] = -math.inf, 0
        for field, reset in (("lut", -1), ("key_scale", 1.0), ("token_pos", 0), ("slot_order", -1), ("s_glo", 0.0),
                             ("s_loc_past", 0.0), ("s_loc_cur", 0.0)):
            s[field][b, h, j] = reset
        s["fill"][b, h], s["slot_fill"][b, h] = f, j
    s["budget"] = torch.tensor([7, int(s["fill"].max())])
    N.check_invariants(s, l_win=2)
    return s


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# -- functional twins ----------------------------------------------------------------------------------------------
def test_ems_append_twin_equals_the_in_place_op():
    """A prefill chunk with left padding on batch row 1 appended after a compressed state (pos "without" and "with"):
    the twin returns the seven written fields bit for bit and leaves its inputs alone."""
    g = torch.Generator().manual_seed(0)
    for pos in ("without", "with"):
        s = _compress_state(pos=pos)
        T = 3
        k, kr, v = (torch.randn(2, 2, T, 8, generator=g) for _ in range(3))
        cp, valid = torch.arange(200, 200 + T), torch.tensor([[True] * T, [False, True, True]])
        OPS.cache_append(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k, v, cp, valid)
        saved = {f: t.clone() for f, t in s.items()}
        out = TWINS.ems_append(s["keys"], s["bias"], s["fill"], kr, cp, valid, *(s[f] for f in APPENDED))
        assert all(_same(s[f], saved[f]) for f in s), "the twin wrote its inputs"
        OPS.ems_append(s["keys"], s["bias"], s["fill"], kr, cp, valid, *(s[f] for f in APPENDED))
        assert len(out) == len(APPENDED)
        for f, t in zip(APPENDED, out):
            assert _same(t, s[f]), f"{pos}: {f}"
        assert not _same(s["lut"], saved["lut"])


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
def test_ems_attention_twin_equals_the_in_place_op(prefill):
    """The twin returns the op's output first, then the four statistics fields it writes (a decode step that rotates
    the local window on one row), bit for bit; its inputs stay as they were."""
    g = torch.Generator().manual_seed(3)
    T = 5 if prefill else 1
    st = attention_state(2, 2, 12, 24, 16, T, torch.float32, g, prefill=prefill, dead=True)
    q = torch.randn(2, 4, T, 16, generator=g)
    stats = [torch.rand(2, 2, 24, generator=g) for _ in STATS]
    win = torch.tensor([[3, 1], [0, 2]])
    opts = dict(scale=0.25, past_only=not prefill, softcap=0.0, l_win=4)
    saved = [t.clone() for t in (*stats, win)]
    out = TWINS.ems_attention(*st.attention_args(q)[:9], *stats, st.slot_fill, win, *opts.values())
    assert all(_same(a, b) for a, b in zip((*stats, win), saved)), "the twin wrote its inputs"
    want = OPS.ems_attention(*st.attention_args(q)[:9], *stats, st.slot_fill, win, **opts)
    assert len(out) == 5 and _same(out[0], want)
    for name, a, b in zip((*STATS, "win_count"), out[1:], (*stats, win)):
        assert _same(a, b), name
    assert prefill or int(win[0, 0]) == 0, "no rotation"


@pytest.mark.parametrize("pos", ["without", "with"])
def test_ems_compress_twin_equals_the_in_place_op(pos):
    """Rows due and not, merged entries, padding: the twin returns the fifteen written fields bit for bit and leaves
    its inputs alone."""
    s = _compress_state(pos=pos)
    saved = {f: t.clone() for f, t in s.items()}
    opts = dict(l_win=2, pool=3, gamma=3.0, tau=0.2)
    out = TWINS.ems_compress(*(s[f] for f in STATE), *opts.values())
    assert all(_same(s[f], saved[f]) for f in s), "the twin wrote its inputs"
    OPS.ems_compress(*(s[f] for f in STATE), **opts)
    written = [f for f in STATE if f != "budget"]
    assert len(out) == len(written)
    for f, t in zip(written, out):
        assert _same(t, s[f]), f
    assert s["fill"].tolist() == [[7, saved["fill"][0, 1]], [saved["fill"][1, 0], 7]], "the due rows did not compress"


def test_functionalize_returns_every_ems_write(rw):
    """The functional graphs call the three twins (no in-place EMS op left), and the attention's output feeds on."""
    from kvrewrite.export.functional import functionalize

    for name in ("prefill", "decode", "decode_compress"):
        gm = functionalize(graph_of(rw, name), n_inputs=4)
        targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert not {t for t in targets if t.startswith("kvrewrite.ems")}, targets
        want = {"ems_append", "ems_attention"} | ({"ems_compress"} if name != "decode" else set())
        assert {t.split(".")[1] for t in targets if t.startswith("kvrewrite_export.ems")} == want, targets


# -- TensorRT (descriptions only) -----------------------------------------------------------------------------------
def test_tensorrt_op_set_and_plugin_descriptions(rw):
    """The three twins in the op set with cache_append; each plugin description returns its written fields' shapes
    (ems_attention: q's shape first), and the options reach the plugins as int, float and bool attributes."""
    prepared = te.prepare(rw)
    base = ["kvrewrite_export::cache_append", "kvrewrite_export::ems_append", "kvrewrite_export::ems_attention"]
    assert te.check_op_set(prepared["decode"][0]) == sorted(base)
    for name in ("prefill", "decode_compress"):
        assert te.check_op_set(prepared[name][0]) == sorted([*base, "kvrewrite_export::ems_compress"])
    descs = prepared["decode_compress"][1]
    ins = descs["kvrewrite_export::ems_append"]["inputs"]
    assert descs["kvrewrite_export::ems_append"]["outputs"] == ins[6:13]
    ins = descs["kvrewrite_export::ems_attention"]["inputs"]
    assert descs["kvrewrite_export::ems_attention"]["outputs"] == [ins[0], *ins[9:12], ins[13]]
    ins = descs["kvrewrite_export::ems_compress"]["inputs"]
    assert descs["kvrewrite_export::ems_compress"]["outputs"] == ins[:5] + ins[6:16]
    nodes = {n.target.name(): n for n in prepared["decode_compress"][0].graph.nodes
             if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "kvrewrite_export"}
    assert te._example_values(nodes["kvrewrite_export::ems_attention"])[14:] == [0.25, True, 0.0, 4]
    assert te._example_values(nodes["kvrewrite_export::ems_compress"])[16:] == [4, 3, 4.0, 0.3]


@torch.no_grad()
def test_tensorrt_functional_graph_computes_the_in_place_graph(rw):
    """The decode step with compression on a state where it is due (thresholds pulled down to make every row due):
    the functional graph handed to torch-tensorrt returns exactly the state the in-place graph writes and its
    logits, and leaves its inputs alone."""
    ids, mask = _inputs()
    check_decode_compress_when_due(rw, ids, mask, NEW)


# -- torch.export (.pt2) + loader, AOTInductor ---------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("pos", ["without", "with"])
def test_pt2_exports_and_generates(tmp_path, pos):
    """The .pt2 programs carry the three EMS ops; the loader reproduces rw.generate token for token over 12 tokens
    with compressions (merges into the table) on the decode steps the host schedule picks, and leaves the very same
    state (the pos "with" state has no raw keys: [B, Hkv, 0, D])."""
    rw = _rw(pos)
    path = kvrewrite.export.torch_export(rw, tmp_path)
    targets = {str(n.target) for n in torch.export.load(path / "decode_compress.pt2").graph.nodes
               if n.op == "call_function"}
    assert {f"kvrewrite.{op}.default" for op in ("ems_append", "ems_attention", "ems_compress")} <= targets
    m = loader.load(path)
    assert m.layer_state(0)["raw_keys"].shape[2] == (0 if pos == "with" else m.layer_state(0)["keys"].shape[2])
    ids, mask = _inputs()
    calls = check_loader_generates_like_rw(m, rw, ids, mask, NEW)
    assert calls >= 2, f"only {calls} decode compressions ran"
    s = m.layer_state(1)
    assert bool((s["slot_fill"] > s["fill"]).any()), "nothing merged into the table"


@torch.no_grad()
def test_aoti_cpu_ems_step_matches_eager(tmp_path, rw):
    """EMS's decode step with compression compiled alone (one package), on the state where the host schedule's next
    compression is due: the package computes the eager graph's logits (1e-4) and the same state (integer fields equal,
    floats 1e-5): ems_append, ems_attention and ems_compress (keyword-only int and float options) through the proxy
    executor."""
    ids, mask = _inputs()
    names, _, eager = aoti_step_when_due(rw, tmp_path, ids, mask, NEW)
    fill, slot_fill = eager[names.index("l1_fill")], eager[names.index("l1_slot_fill")]
    assert bool((fill == OPTIONS["budget"]).all()), "the compression did not run"
    assert bool((slot_fill > fill).any()), "nothing merged"


# -- ONNX functions -------------------------------------------------------------------------------------------------
def _run_function(*args, **kw):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from tests.export.test_onnx import _run_function as run

    return run(*args, **kw)


def _check_state(got: dict, want: dict):
    """Integer fields (layout, lut, ranks, counts) exact; float fields within 1e-6 relative (fp32 norms and sums in
    another order could move the last bit; on onnxruntime 1.32 every one was bit-identical)."""
    for f, w in want.items():
        g = got[f]
        assert g.dtype == w.dtype and g.shape == w.shape, f
        if w.is_floating_point():
            torch.testing.assert_close(g, w, atol=0, rtol=1e-6, msg=f)
        else:
            assert torch.equal(g, w), f"{f}\n{g}\n!= {w}"


@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("T", [3, 1], ids=["chunk", "decode"])
def test_ems_append_function(pos, T):
    """A prefill chunk (batch row 1's first token padding) or a decode token appended after a compressed state: every
    written field bit-identical, raw_keys empty for pos "with"."""
    g = torch.Generator().manual_seed(T)
    s = _compress_state(pos=pos)
    k, kr, v = (torch.randn(2, 2, T, 8, generator=g) for _ in range(3))
    cp, valid = torch.arange(200, 200 + T), torch.ones(2, T, dtype=torch.bool)
    valid[1, 0] = T == 1
    OPS.cache_append(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k, v, cp, valid)
    want = {f: s[f].clone() for f in APPENDED}
    OPS.ems_append(s["keys"], s["bias"], s["fill"], kr, cp, valid, *(want[f] for f in APPENDED))
    inputs = dict(keys=s["keys"], bias=s["bias"], fill=s["fill"], k_pre=kr, cache_position=cp, token_valid=valid,
                  **{f: s[f] for f in APPENDED})
    got = _run_function("ems_append", inputs, [want[f] for f in APPENDED])
    for f, t in zip(APPENDED, got):
        assert _same(t, want[f]), f
    assert got[1].shape[2] == (0 if pos == "with" else 24)


NAMES = ("q", "keys", "values", "bias", "slot_pos", "cache_position", "entry_start", "lut", "key_scale")


# (B, Hq, Hkv, T, C, R, D, dtype, softcap, empty_row): GQA decode and prefill chunks, MQA, a soft cap, a batch row
# that sees nothing, fp16
ATTN_CASES = {
    "decode-G2": (2, 4, 2, 1, 12, 24, 16, torch.float32, 0.0, False),
    "chunk-G2": (2, 4, 2, 5, 12, 24, 16, torch.float32, 0.0, False),
    "chunk-MQA-empty": (2, 4, 1, 6, 13, 27, 8, torch.float32, 0.0, True),
    "decode-softcap": (2, 4, 2, 1, 12, 24, 16, torch.float32, 5.0, False),
    "chunk-fp16": (2, 4, 2, 4, 12, 24, 16, torch.float16, 0.0, False),
}


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_ems_attention_function(case):
    """Output and statistics against kvrewrite::ems_attention on random expanded states (merged entries with key
    scales, dead and free slots, padding): the output within 2e-6 absolute / 1e-5 relative (fp16: 1e-3) and the
    statistics within 2e-6 absolute (fp32 sums over the group in another order); win_count exact, a decode step
    rotating one row's local window."""
    B, Hq, Hkv, T, C, R, D, dtype, softcap, empty_row = ATTN_CASES[case]
    g = torch.Generator().manual_seed(C + T)
    st = attention_state(B, Hkv, C, R, D, T, dtype, g, prefill=T > 1, dead=True, empty_row=empty_row)
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    stats = [torch.rand(B, Hkv, R, generator=g) for _ in STATS]
    win = torch.tensor([[3] * Hkv, [1] * Hkv])
    opts = dict(scale=D ** -0.5, past_only=T == 1, softcap=softcap, l_win=4)
    want = [t.clone() for t in (*stats, win)]
    out = OPS.ems_attention(*st.attention_args(q)[:9], *want[:3], st.slot_fill, want[3], **opts)
    inputs = dict(zip(NAMES, st.attention_args(q)[:9]), s_glo=stats[0], s_loc_past=stats[1], s_loc_cur=stats[2],
                  slot_fill=st.slot_fill, win_count=win)
    got = _run_function("ems_attention", inputs, [out, *want], scale=opts["scale"], past_only=int(opts["past_only"]),
                        softcap=softcap, l_win=4)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    assert got[0].dtype == out.dtype and out.abs().max() > 0.1
    torch.testing.assert_close(got[0].float(), out.float(), **tol)
    for name, a, b in zip(STATS, got[1:4], want[:3]):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0, msg=name)
    assert torch.equal(got[4], want[3])
    if empty_row:
        assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))


def _compress_function(s, l_win=2, pool=3, gamma=3.0, tau=0.2):
    want = {f: t.clone() for f, t in s.items()}
    OPS.ems_compress(*(want[f] for f in STATE), l_win=l_win, pool=pool, gamma=gamma, tau=tau)
    written = [f for f in STATE if f != "budget"]
    inputs = {**{f: s[f] for f in STATE}, "gamma": torch.tensor([gamma], dtype=torch.float64)}
    got = _run_function("ems_compress", inputs, [want[f] for f in written], l_win=l_win, pool=pool, tau=tau,
                        merging=int(tau < 1))
    _check_state(dict(zip(written, got)), {f: want[f] for f in written})
    return want


# (pos, gamma, tau, pool, dtype, rounds): the defaults' shape, "with", the LUT cap (gamma 1.5), gamma inf (no cap, no
# level-1 eviction), gamma 1 (no TBM), tau 1 (every TBM to the zero class) and 0 (all merged), no pooling, fp16, a
# third round over groups that merged twice
COMPRESS_CASES = {
    "without": ("without", 3.0, 0.2, 3, torch.float32, 1),
    "with": ("with", 3.0, 0.2, 3, torch.float32, 1),
    "cap": ("without", 1.5, 0.0, 5, torch.float32, 2),
    "gamma-inf": ("without", math.inf, 0.2, 3, torch.float32, 1),
    "gamma-1": ("with", 1.0, 0.2, 3, torch.float32, 1),
    "tau-1": ("without", 3.0, 1.0, 3, torch.float32, 1),
    "tau-0-pool-1": ("without", 3.0, 0.0, 1, torch.float32, 1),
    "fp16": ("without", 3.0, 0.2, 3, torch.float16, 2),
}


@pytest.mark.parametrize("case", list(COMPRESS_CASES))
def test_ems_compress_function(case):
    """The whole compression against kvrewrite::ems_compress on random states with merged entries (rows due and not,
    left padding): layout, lut, key scales' entries, slot order and fills exact, floats 1e-6 relative."""
    pos, gamma, tau, pool, dtype, rounds = COMPRESS_CASES[case]
    s = _compress_state(seed=len(case), pos=pos, dtype=dtype, rounds=rounds)
    want = _compress_function(s, pool=pool, gamma=gamma, tau=tau)
    due = s["fill"] >= s["budget"][1]
    assert bool(due.any()) and not bool(due.all())
    assert torch.equal(want["fill"][due], torch.full((int(due.sum()),), 7))
    g, gp = OPS.ems_score(*(s[f] for f in ("bias", "fill", "lut", "slot_order", *STATS, "slot_fill")), due, l_win=2,
                          pool=pool)
    cls = OPS.ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, s["budget"], l_win=2, gamma=gamma)
    dest = OPS.ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau=tau)
    merging = bool(((cls == 3) & (dest >= 0)).any())
    assert merging == (tau < 1 and gamma > 1), "merges where none may happen, or none where they should"
    if case == "cap":  # R_max = 7 + floor(0.5 * 7) = 10 binds (without the cap these rows keep 15 and 17 slots)
        assert torch.equal(want["slot_fill"][due], torch.full((int(due.sum()),), 10))


def test_ems_compress_function_ties():
    """Exact ties: every slot with the same scores (pooled scores equal but at the edges: the partition's ties go to
    the earlier entry) and centres with identical keys and values (a TBM's best centre is the lowest of them)."""
    s = _compress_state(seed=5)
    for f, v in zip(STATS, (1.0, 0.25, 0.0)):
        s[f] = torch.where(s["lut"] >= 0, v, 0.0)
    for t in ("keys", "values", "raw_keys"):
        s[t][:, :, 1::3] = s[t][:, :, 0:-1:3][:, :, :s[t][:, :, 1::3].shape[2]]
    _compress_function(s, tau=0.0)


@pytest.mark.parametrize("stage", ["ems_score", "ems_partition", "ems_redundancy", "ems_merge"])
def test_ems_compress_stage_functions(stage):
    """Each stage's function (ems_compress's body calls them) against its registered op on the same inputs: exact
    (the merge's floats 1e-6 relative)."""
    s = _compress_state(seed=3)
    due = s["fill"] >= s["budget"][1]
    gamma = torch.tensor([3.0], dtype=torch.float64)
    g, gp = OPS.ems_score(*(s[f] for f in ("bias", "fill", "lut", "slot_order", *STATS, "slot_fill")), due, l_win=2,
                          pool=3)
    cls = OPS.ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, s["budget"], l_win=2, gamma=3.0)
    dest = OPS.ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau=0.2)
    if stage == "ems_score":
        inputs = {**{f: s[f] for f in ("bias", "fill", "lut", "slot_order", *STATS, "slot_fill")}, "due": due}
        got = _run_function(stage, inputs, [g, gp], l_win=2, pool=3)
        assert torch.equal(got[0], g) and torch.equal(got[1], gp)
    elif stage == "ems_partition":
        inputs = dict(bias=s["bias"], fill=s["fill"], entry_start=s["entry_start"], g_pooled=gp, due=due,
                      budget=s["budget"], gamma=gamma)
        (got,) = _run_function(stage, inputs, [cls], l_win=2)
        assert torch.equal(got, cls) and bool((cls == 3).any())
    elif stage == "ems_redundancy":
        inputs = dict(keys=s["keys"], values=s["values"], raw_keys=s["raw_keys"], cls=cls, due=due)
        (got,) = _run_function(stage, inputs, [dest], tau=0.2, merging=1)
        assert torch.equal(got, dest) and bool(((cls == 3) & (dest >= 0)).any())
    else:
        written = [f for f in STATE if f != "budget"]
        want = {f: t.clone() for f, t in s.items()}
        OPS.ems_merge(*(want[f] for f in STATE), g, gp, cls, dest, due, gamma=3.0)
        inputs = {**{f: s[f] for f in STATE}, "g": g, "g_pooled": gp, "cls": cls, "dest": dest, "due": due,
                  "gamma": gamma}
        got = _run_function(stage, inputs, [want[f] for f in written])
        _check_state(dict(zip(written, got)), {f: want[f] for f in written})


# -- ONNX: the whole model ------------------------------------------------------------------------------------------
@torch.no_grad()
def test_ems_onnx_model_matches_pytorch(tmp_path, rw):
    """EMS exports completely: its graphs hold the three EMS nodes with their functions (and the stages
    ems_compress's body calls); onnxruntime's prefill (a compression at the prompt's end) and greedy generation
    (compressions every 4 steps, merges into the table) match the PyTorch runtime: logits and state 1e-4, integer
    fields equal, tokens equal."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    path = kvrewrite.export.onnx(rw, tmp_path)
    stages = {"ems_score", "ems_partition", "ems_redundancy", "ems_merge", "ems_tbm_count", "ems_segment_sum"}
    for name in ("prefill", "decode", "decode_compress"):
        model = onnx.load(str(path / f"{name}.onnx"))
        nodes = {n.op_type for n in model.graph.node if n.domain == "kvrewrite"}
        want = {"cache_append", "ems_append", "ems_attention"} | ({"ems_compress"} if name != "decode" else set())
        assert nodes == want, nodes
        assert {f.name for f in model.functions} == nodes | (stages if name != "decode" else set())
    m = loader.load(path)
    ids, mask = _inputs()
    a, b = rw.prefill(ids, mask, max_new_tokens=NEW), m.prefill(ids, mask, max_new_tokens=NEW)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    for x, y in zip(rw.state_tensors(), m.state):
        torch.testing.assert_close(y, x, atol=1e-4, rtol=0)  # integer fields: exact (assert_close on ints)
    ref = rw.generate(ids, mask, max_new_tokens=NEW)
    out = m.generate(ids, mask, max_new_tokens=NEW)
    assert torch.equal(out, ref), f"onnxruntime generate\n{out[:, PROMPT:]}\n!= runtime\n{ref[:, PROMPT:]}"
    s = m.layer_state(1)
    assert bool((s["slot_fill"] > s["fill"]).any()), "nothing merged into the table"
