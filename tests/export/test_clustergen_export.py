"""ClusterGen's exports (methods clustergen and clustergen-kcenter; docs/deploy.md, "ClusterGen"):

- the functional twins kvrewrite_export::clustergen_fold / kcenter_compress return exactly what the in-place ops write,
  on random states with rows due and not, and leave their inputs alone;
- ONNX: the sketch_attention and kcenter_compress functions against the references in onnxruntime (attention within
  2e-6 absolute / 1e-5 relative; 1e-4 relative with value weights of +80, as the kernel test; kcenter_compress
  exact); a whole clustergen-kcenter model matches PyTorch; a clustergen model is refused with a NotImplementedError
  naming clustergen_fold, the method and torch_export / aoti, and its decode graph alone steps like PyTorch;
- TensorRT (not installed: up to the torch-tensorrt call): op set, plugin descriptions, the functional graph computes
  the in-place graph with the compression due;
- .pt2 + the loader reproduce rw.generate token for token (final state identical) for both methods; AOTInductor: the
  clustergen decode step with a fold due, compiled alone, equals the eager graph.
"""
import functools
import itertools
import math

import numpy as np
import pytest
import torch

import kvrewrite
import kvrewrite.export
from kvrewrite.export import loader
from kvrewrite.export import tensorrt_export as te
from kvrewrite.export.common import graph_of, read_metadata
from kvrewrite.kernels.clustered_attention import reference_clustered_attention
from kvrewrite.kernels.kcenter_compress import reference_kcenter_compress
from kvrewrite.kernels.sketch_attention import reference_sketch_attention
from tests.export.checks import (aoti_step_when_due, check_decode_compress_when_due, check_loader_generates_like_rw,
                                  left_padded_prompts)
from tests.families import tiny_model
from tests.kernels import clustergen_naive as N
from tests.kernels.test_clustergen_fold import rows_of, tokens
from tests.kernels.test_kcenter_compress import make_state as kcenter_state
from tests.kernels.test_sketch_attention import make_inputs

PROMPT, NEW = 24, 12
KC = ("keys", "values", "bias", "slot_pos", "fill")
# clustergen: B = 14 = 2 sinks + 4 window + a sketch of 8 (4 value samples, 2 clusters of 2 key samples), a fold every
# 3 decode steps; clustergen-kcenter: B = 10 (6 recent + 4 centres: recent_ratio off its default, so the option
# reaches the exported nodes), a re-selection every 4 decode steps
METHODS = {"clustergen": dict(budget=14, n_sink=2, window=4, t=2, interval=3),
           "clustergen-kcenter": dict(budget=10, interval=4, recent_ratio=0.6)}


def _rw(method):
    m = tiny_model("llama")
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return kvrewrite.apply(m, method, max_length=40, batch_size=2, prefill_chunk=16, **METHODS[method])


_inputs = functools.partial(left_padded_prompts, PROMPT)


def _same(a, b):
    """Bit-identical, NaN where NaN (the naive states put NaN keys in padding slots: never read)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and \
        torch.equal(a.isnan(), b.isnan())


# -- functional twins ----------------------------------------------------------------------------------------------
def _fold_both(st, p):
    """(the in-place op's state, the twin's outputs as a dict) of one call on st; st itself must stay untouched."""
    saved = {f: t.clone() for f, t in st.items()}
    inplace = {f: t.clone() for f, t in st.items()}
    torch.ops.kvrewrite.clustergen_fold(*(inplace[f] for f in N.STATE), **p.kwargs())
    out = torch.ops.kvrewrite_export.clustergen_fold(*(st[f] for f in N.STATE), *p.kwargs().values())
    assert all(_same(st[f], saved[f]) for f in st), "the twin wrote its inputs"
    written = [f for f in N.STATE if f != "budget"]
    assert len(out) == len(written)
    return inplace, dict(zip(written, out))


def test_clustergen_fold_twin_equals_the_in_place_op():
    """A prompt fold where only the left-padded batch row is due, then a decode fold where only the rows that got g
    new tokens are due: the twin returns every field the in-place op writes, bit for bit, and the rows not due keep
    theirs."""
    p = N.Params(Bt=15, n_sink=1, window=2, t=2, seed=3, layer=1)
    rng = np.random.default_rng(0)
    L, D, g = 14, 4, 3
    keys, vals = tokens(L + g, D, rng, groups=3)
    rows = rows_of(p, 2, 2, keys[:L], vals[:L])
    st = N.to_state(rows, 3 + L + p.S, D, p.M + 1, threshold=L + 1, pads=(0, 3))  # row 1: fill L + 3, due
    inplace, twin = _fold_both(st, p)
    for f, t in twin.items():
        assert _same(t, inplace[f]), f"prompt fold: {f}"
    assert twin["n_seen"].tolist() == [[0, 0], [L - 3, L - 3]], "the fold did not run on (only) the due rows"
    st = inplace  # every row folded once, then g tokens for batch row 1 only: only it is due
    st["budget"][1] = 0
    torch.ops.kvrewrite.clustergen_fold(*(st[f] for f in N.STATE), **p.kwargs())
    for n, h in itertools.product(range(g), range(2)):
        N.append_state(st, 1, h, L + n, keys[L + n], vals[L + n])
    st["budget"][1] = p.n_sink + p.window + g
    before = st["n_seen"].clone()
    inplace, twin = _fold_both(st, p)
    for f, t in twin.items():
        assert _same(t, inplace[f]), f"decode fold: {f}"
    assert torch.equal(twin["n_seen"] - before, torch.tensor([[0, 0], [g, g]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kcenter_compress_twin_equals_the_in_place_op(dtype):
    # ragged fills, batch row 1 left-padded by 3; (0, 2) and (1, 0) below the threshold; (0, 1) due at <= B
    s = kcenter_state(2, 3, 21, 8, [[21, 12, 9], [11, 21, 20]], 8, 12, dtype=dtype, pads=[0, 3], seed=4)
    saved = {f: t.clone() for f, t in s.items()}
    out = torch.ops.kvrewrite_export.kcenter_compress(*(s[f] for f in (*KC, "budget")), 0.25)
    assert all(torch.equal(s[f], saved[f]) for f in s), "the twin wrote its inputs"
    torch.ops.kvrewrite.kcenter_compress(*(s[f] for f in (*KC, "budget")), recent_ratio=0.25)
    for f, t in zip(KC, out):
        assert t.dtype == s[f].dtype and torch.equal(t, s[f]), f
    assert s["fill"].tolist() == [[8, 8, 9], [11, 8, 8]]


# -- ONNX functions -------------------------------------------------------------------------------------------------
def _run_function(*args, **kw):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from tests.export.test_onnx import _run_function as run

    return run(*args, **kw)


def _sketch_function(q, keys, values, bias, slot_pos, cp, role, scale, past_only=False):
    ref = reference_sketch_attention(q, keys, values, bias, slot_pos, cp, role, scale, past_only)
    inputs = dict(q=q.contiguous(), keys=keys, values=values, bias=bias, slot_pos=slot_pos, cache_position=cp,
                  role=role)
    (out,) = _run_function("sketch_attention", inputs, [ref], scale=scale, past_only=int(past_only))
    assert out.dtype == ref.dtype and out.shape == ref.shape
    return out, ref


# (B, Hq, Hkv, T, C, D, dtype): decode with GQA, a causal prefill block, odd C, MHA, fp16 (compared in fp32 terms)
SKETCH_SHAPES = [(2, 4, 2, 1, 19, 16, torch.float32), (2, 4, 2, 5, 33, 16, torch.float32),
                 (1, 2, 2, 7, 13, 8, torch.float32), (2, 8, 2, 3, 24, 32, torch.float16)]


@pytest.mark.parametrize("B,Hq,Hkv,T,C,D,dtype", SKETCH_SHAPES)
def test_sketch_attention_function(B, Hq, Hkv, T, C, D, dtype):
    q, keys, values, bias, slot_pos, cp, role = make_inputs(B, Hq, Hkv, T, C, D, dtype, seed=C + T)
    out, ref = _sketch_function(q, keys, values, bias, slot_pos, cp, role, D ** -0.5)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_sketch_attention_function_edge_cases():
    """Every role 0 is clustered_attention; value weights of +80 over denominator weights of -20 do not underflow the
    denominator (two shifts); a query that sees no denominator slot gets 0; past_only=1 computes the same."""
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, C, D = 2, 4, 2, 24, 16
    q = torch.randn(B, Hq, 1, D, generator=g)
    keys, values = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    bias = torch.zeros(B, Hkv, C)
    slot_pos, cp = torch.arange(C).expand(B, Hkv, C).contiguous(), torch.tensor([C])
    zero = torch.zeros(B, Hkv, C, dtype=torch.int8)
    out, _ = _sketch_function(q, keys, values, bias, slot_pos, cp, zero, 0.25, past_only=True)
    torch.testing.assert_close(out, reference_clustered_attention(q, keys, values, bias, slot_pos, cp, 0.25, 0),
                               atol=2e-6, rtol=0)
    role = torch.tensor([1, 2] * (C // 2), dtype=torch.int8).expand(B, Hkv, C).contiguous()
    big = torch.where(role == 2, 80.0, -20.0)
    small_v = torch.where((role == 2)[..., None], values * math.exp(-60), values)
    out, ref = _sketch_function(q, keys, small_v, big, slot_pos, cp, role, 0.25)
    assert ref.abs().max() > 1e10 and torch.isfinite(out).all()
    # scores near +-100 in fp32 are a few ulp(100) apart between two summation orders: 1e-4 relative, as the kernel test
    torch.testing.assert_close(out, ref, atol=0, rtol=1e-4)
    only_values = torch.full_like(role, 2)
    only_values[0, 0, :3] = 1  # row (0, 0) sees three key samples, the others none
    out, ref = _sketch_function(q, keys, values, bias, slot_pos, cp, only_values, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0, :2].abs().max() > 0
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def _kcenter_function(s, recent_ratio):
    want = {f: t.clone() for f, t in s.items()}
    reference_kcenter_compress(*(want[f] for f in (*KC, "budget")), recent_ratio)
    inputs = {**{f: s[f] for f in (*KC, "budget")}, "ratio": torch.tensor([recent_ratio], dtype=torch.float64)}
    got = _run_function("kcenter_compress", inputs, [want[f] for f in KC])
    for f, t in zip(KC, got):
        assert t.dtype == want[f].dtype and torch.equal(t, want[f]), f"{f} differs\n{t}\n{want[f]}"
    return want


# (B, H, C, D, fills, target, threshold, pads): due rows over B, due rows at <= B (packed only), rows not due
KCENTER_CASES = {
    "ragged-padded": (2, 3, 21, 8, [[21, 12, 9], [11, 21, 20]], 8, 12, [0, 3]),
    "odd-C": (1, 2, 17, 16, [[17, 6]], 7, 10, None),
    "B1": (1, 2, 9, 4, [[9, 4]], 1, 5, None),  # B = 1: l = 0, one centre (the first valid slot)
}


@pytest.mark.parametrize("case", list(KCENTER_CASES))
@pytest.mark.parametrize("recent_ratio", [0.0, 0.5, 0.75])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kcenter_compress_function(case, recent_ratio, dtype):
    B, H, C, D, fills, target, threshold, pads = KCENTER_CASES[case]
    s = kcenter_state(B, H, C, D, fills, target, threshold, dtype=dtype, pads=pads, seed=C)
    want = _kcenter_function(s, recent_ratio)
    assert bool((want["fill"] < s["fill"]).any()), "nothing compressed: the case tests too little"
    assert bool((want["fill"] == s["fill"]).any()), "every row changed: no row left alone"


def test_kcenter_compress_function_ties():
    """Small integer keys: exact distances, real ties, which must go to the lowest slot as in the reference."""
    s = kcenter_state(2, 2, 24, 3, [[24, 20], [22, 24]], 9, 12, pads=[2, 0], seed=11, integer=True)
    _kcenter_function(s, 0.5)


# -- ONNX: whole models ---------------------------------------------------------------------------------------------
@torch.no_grad()
def test_clustergen_onnx_export_is_refused_but_its_decode_graph_runs(tmp_path):
    """The prefill and decode_compress graphs hold kvrewrite::clustergen_fold, which has no ONNX function: the export
    raises before writing, naming the op, the method, the graphs that would export, and the targets that run it. The
    decode graph alone exports (sketch_attention's function in a real graph): from the state after the prompt's fold,
    one onnxruntime step matches the PyTorch step (logits and state 1e-4, integer fields equal)."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    rw = _rw("clustergen")
    with pytest.raises(NotImplementedError, match=r"prefill graph of method 'clustergen' holds kvrewrite op\(s\) "
                                                  r"\['clustergen_fold'\].*graphs without them: \['decode'\]\. "
                                                  r"ClusterGen's fold .*kvrewrite.export.torch_export \(.pt2\) or "
                                                  r"kvrewrite.export.aoti \(AOTInductor\)"):
        kvrewrite.export.onnx(rw, tmp_path / "all")
    assert not (tmp_path / "all").exists() or not list((tmp_path / "all").iterdir()), "files were written"
    step = loader.load(kvrewrite.export.onnx(rw, tmp_path / "decode", graphs=("decode",))).steps["decode"]
    ids, mask = _inputs()
    logits = rw.prefill(ids, mask, max_new_tokens=NEW)
    assert int(rw.layer_state(1)["n_seen"].min()) > 0 and not rw.schedule.due(1)
    args = [logits.argmax(-1)[:, None], rw._next_position[:, None], rw._next_cache_position,
            torch.ones(2, 1, dtype=torch.bool)]
    state = [t.clone() for t in rw.state_tensors()]
    got = step(*args, state)
    want = graph_of(rw, "decode")(*args, *rw.state_tensors())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for a, b in zip(state, rw.state_tensors()):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@torch.no_grad()
def test_kcenter_onnx_model_matches_pytorch(tmp_path):
    """clustergen-kcenter exports completely: onnxruntime's prefill (k-center at the prompt's end) and greedy
    generation (re-selections every 4 steps) match the PyTorch runtime: logits and state 1e-4, tokens equal."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    rw = _rw("clustergen-kcenter")
    path = kvrewrite.export.onnx(rw, tmp_path)
    for name in ("prefill", "decode_compress"):
        model = onnx.load(str(path / f"{name}.onnx"))
        nodes = {n.op_type for n in model.graph.node if n.domain == "kvrewrite"}
        assert nodes == {"cache_append", "clustered_attention", "kcenter_compress"}, nodes
        assert {f.name for f in model.functions} == nodes
    m = loader.load(path)
    ids, mask = _inputs()
    a, b = rw.prefill(ids, mask, max_new_tokens=NEW), m.prefill(ids, mask, max_new_tokens=NEW)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    for x, y in zip(rw.state_tensors(), m.state):
        torch.testing.assert_close(y, x, atol=1e-4, rtol=0)
    ref = rw.generate(ids, mask, max_new_tokens=NEW)
    out = m.generate(ids, mask, max_new_tokens=NEW)
    assert torch.equal(out, ref), f"onnxruntime generate\n{out[:, PROMPT:]}\n!= runtime\n{ref[:, PROMPT:]}"


# -- TensorRT (descriptions only) -----------------------------------------------------------------------------------
CG_OPS = {"clustergen": "kvrewrite_export::clustergen_fold", "clustergen-kcenter": "kvrewrite_export::kcenter_compress"}


@pytest.mark.parametrize("method", list(METHODS))
def test_tensorrt_op_set_and_plugin_descriptions(method):
    """clustergen: the opaque kvrewrite_export::sketch_attention in every graph (q's shape back), clustergen_fold where
    the graph compresses (its thirteen written fields back with their own shapes; int and float attributes);
    clustergen-kcenter: clustered_attention and kcenter_compress (the five state tensors back)."""
    prepared = te.prepare(_rw(method))
    attn = "kvrewrite_export::sketch_attention" if method == "clustergen" else "kvrewrite_export::clustered_attention"
    base = ["kvrewrite_export::cache_append", attn]
    assert te.check_op_set(prepared["decode"][0]) == sorted(base)
    for name in ("prefill", "decode_compress"):
        assert te.check_op_set(prepared[name][0]) == sorted([*base, CG_OPS[method]])
    descs = prepared["decode_compress"][1]
    ins = descs[CG_OPS[method]]["inputs"]
    want = ins[:5] + ins[6:14] if method == "clustergen" else ins[:5]
    assert descs[CG_OPS[method]]["outputs"] == want
    assert descs[attn]["outputs"] == descs[attn]["inputs"][:1]  # [B, Hq, T, D] of q
    node = next(n for n in prepared["decode_compress"][0].graph.nodes
                if isinstance(n.target, torch._ops.OpOverload) and n.target.name() == CG_OPS[method])
    opts = te._example_values(node)[14 if method == "clustergen" else 6:]
    assert opts == ([2, 4, 2, 0.5, 0.5, 0, 0] if method == "clustergen" else [0.6]), opts  # layer 0's call


@torch.no_grad()
@pytest.mark.parametrize("method", list(METHODS))
def test_tensorrt_functional_graph_computes_the_in_place_graph(method):
    """The decode step with compression on a state where it is due (one step before the host schedule's next fold or
    re-selection, thresholds pulled down to make every row due): the functional graph handed to torch-tensorrt returns
    exactly the state the in-place graph writes, and leaves its inputs alone."""
    rw = _rw(method)
    ids, mask = _inputs()
    check_decode_compress_when_due(rw, ids, mask, NEW)


# -- torch.export (.pt2) + loader, AOTInductor ---------------------------------------------------------------------
OPS = {"clustergen": ("sketch_attention", "clustergen_fold"), "clustergen-kcenter": ("kcenter_compress",)}


@torch.no_grad()
@pytest.mark.parametrize("method", list(METHODS))
def test_pt2_exports_and_generates(tmp_path, method):
    """The .pt2 programs carry the method's ops (sketch_attention itself, not its CPU path); ClusterGen's eight sketch
    fields travel in the metadata; the loader reproduces rw.generate token for token over 12 tokens with folds (or
    re-selections) on the decode steps the host schedule picks, and leaves the very same state."""
    rw = _rw(method)
    path = kvrewrite.export.torch_export(rw, tmp_path)
    targets = {str(n.target) for n in torch.export.load(path / "decode_compress.pt2").graph.nodes
               if n.op == "call_function"}
    assert {f"kvrewrite.{op}.default" for op in OPS[method]} <= targets, targets
    assert "kvrewrite.sketch_attention_cpu.default" not in targets
    meta = read_metadata(path)
    if method == "clustergen":
        assert list(meta["method_state"][0]) == ["role", "rep", "count", "n_clusters", "mu", "delta", "n_seen",
                                                 "n_forced"]
        assert meta["method_state"][0]["delta"]["reset"] == -1.0
    m = loader.load(path)
    ids, mask = _inputs()
    calls = check_loader_generates_like_rw(m, rw, ids, mask, NEW)
    assert calls >= 2, f"only {calls} decode compressions ran"
    if method == "clustergen":
        s = m.layer_state(1)
        real = torch.tensor([PROMPT, PROMPT - 5])[:, None] + NEW - 1  # tokens each batch row's state has seen
        assert torch.equal(s["n_seen"] + s["fill"], real.expand(2, 2)), "folded + exact != every token seen"


@torch.no_grad()
def test_aoti_cpu_clustergen_step_matches_eager(tmp_path):
    """ClusterGen's decode step with compression compiled alone (one package, as ClusterKV's and KVMerger's), on the
    state one step before a fold: the package computes the eager graph's logits (1e-4) and the same state (integer
    fields equal, floats 1e-5): clustergen_fold (thirteen mutated fields, keyword-only int and float options) and
    sketch_attention through the proxy executor."""
    rw = _rw("clustergen")
    ids, mask = _inputs()
    names, before, eager = aoti_step_when_due(rw, tmp_path, ids, mask, NEW)
    k = names.index("l1_n_seen")
    assert bool((eager[k] > before[k]).all()), "the fold did not run"
