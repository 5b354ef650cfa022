"""Every pass on every family: counters, op sets, golden graph diffs, and the sliding-window cases.

Each family is captured once per module; the passes then run cumulatively on that graph (they
mutate it in place), with a snapshot between passes, so pass i is checked on the output of 0..i-1,
as in kvrewrite.apply. The `full` method runs on a copy taken before the `chelsea` chain starts.
End-to-end numerics live in the method tests.

Regenerate the goldens (then review them like code):
    KVREWRITE_UPDATE_GOLDEN=1 python -m pytest tests/passes
and, with an older transformers whose HF graphs differ, the per-version variants beside them:
    KVREWRITE_UPDATE_GOLDEN=1 KVREWRITE_GOLDEN_VARIANT=1 python -m pytest tests/passes
"""
import copy
import difflib
import os
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the kvrewrite:: ops)
from kvrewrite.capture import capture
from kvrewrite.context import RewriteContext
from kvrewrite.methods import make_method
from kvrewrite.passes import PASSES, run_passes
from kvrewrite.passes.graph_diff import graph_diff, op_counts, snapshot
from kvrewrite.passes.utils import clean_up, deferred_recompile
from kvrewrite.state import STATE_FIELDS
from tests.families import FAMILIES, golden_cases, tiny_model

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
UPDATE = os.environ.get("KVREWRITE_UPDATE_GOLDEN") == "1"
_TF_VERSION = tuple(int(x) for x in __import__("transformers").__version__.split(".")[:2])
KINDS = ("prefill", "decode")
PASS_NAMES = [p.__name__ for p in PASSES]
PREFILL_CHUNK = 8
# Small enough that the compression op is inserted and its arguments are readable in the goldens.
METHODS = {"chelsea": dict(budget=0.5, n_sink=2, n_recent=4, chunk=8, interval=4), "full": {}}

SDPA = "aten.scaled_dot_product_attention.default"
INDEX_COPY = "aten.index_copy_.default"
CACHE_APPEND = "kvrewrite.cache_append.default"
ATTENTION = "kvrewrite.clustered_attention.default"
CHELSEA = "kvrewrite.chelsea_compress.default"
EVICT = "kvrewrite.evict_to_budget.default"
LINEAR = "aten.linear.default"
GEMV = "kvrewrite.gemv.default"
GEMV_RMS_NORM = "kvrewrite.gemv_rms_norm.default"
GLU = "kvrewrite.gemv_glu.default"
OBSERVED = "kvrewrite.observed_attention.default"
ACCUMULATE = "kvrewrite.accumulate_attention.default"


@dataclass
class Run:
    """One family / graph kind / method, after every pass; steps[pass] is what that pass left."""

    captured: object
    ctx: RewriteContext
    gm: torch.fx.GraphModule
    steps: dict = field(default_factory=dict)  # pass name -> Step

    @property
    def n_layers(self):
        return len(self.ctx.layers)

    @property
    def windowed(self):
        return [l.index for l in self.ctx.layers if l.window]


@dataclass
class Step:
    diff: str
    counter: int
    ops: object  # Counter of targets after the pass
    get_attrs: set
    placeholders: list
    bool_masks: list  # names of 4-D bool tensors (HF attention masks) still in the graph


class Runs:
    """Captures each family once and runs each (family, kind, method) chain once, on demand."""

    def __init__(self):
        self._graphs, self._captured, self._runs = {}, {}, {}

    def get(self, family, kind, method="chelsea") -> Run:
        key = (family, kind, method)
        if key not in self._runs:
            if family not in self._captured:
                c = capture(tiny_model(family), batch_size=1, prefill_chunk=PREFILL_CHUNK)
                self._captured[family] = c
                for m in METHODS:  # copies first: the chains below mutate the graphs
                    for k in KINDS:
                        self._graphs[(family, k, m)] = c.graphs[k] if m == "chelsea" else copy.deepcopy(c.graphs[k])
            self._runs[key] = self._run(self._captured[family], self._graphs.pop(key), kind, method)
        return self._runs[key]

    @staticmethod
    def _run(c, gm, kind, method) -> Run:
        m = make_method(method, **METHODS[method])
        if hasattr(m, "bind"):
            m.bind(c.layers)
        ctx = RewriteContext(c.model_tag, m, c.layers, graph_kind=kind, cache_buffers=c.cache_buffers,
                             fuse_projections=True, fused_weights=c.fused_weights, gemv=True)  # opt-in passes run too
        run = Run(c, ctx, gm)
        for p in PASSES:
            before = snapshot(gm)
            gm = p(gm, ctx)
            gm.graph.lint()
            ops = op_counts(gm)
            run.steps[p.__name__] = Step(
                diff=graph_diff(before, gm, f"{ctx.model_tag} / {kind} / {p.__name__} / {method}"),
                counter=ctx.counters.get(p.__name__, 0),
                ops=ops,
                get_attrs={n.target for n in gm.graph.nodes if n.op == "get_attr"},
                placeholders=[n.name for n in gm.graph.nodes if n.op == "placeholder"],
                bool_masks=[n.name for n in gm.graph.nodes if _is_bool_4d(n.meta.get("val"))],
            )
        run.gm = gm
        return run


def _is_bool_4d(v):
    return isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.dim() == 4


@pytest.fixture(scope="module")
def runs():
    return Runs()


def _kv_buffers(run):
    return {b for b in run.captured.cache_buffers if b.endswith(("_keys", "_values"))}


def _expected(run, name):
    """(counter, {op: exact count}, ops that must be gone) after pass `name`."""
    n, full = run.n_layers, run.n_layers - len(run.windowed)
    method = run.ctx.method.name
    if name == "normalize_eager_attention":  # SDPA models: nothing to normalize
        return 0, {SDPA: n, INDEX_COPY: 2 * n}, {ATTENTION}
    if name == "locate_attention_sites":
        return n, {SDPA: n, INDEX_COPY: 2 * n}, {CACHE_APPEND}
    if name == "replace_kv_cache_update":
        return n, {SDPA: n, CACHE_APPEND: n, INDEX_COPY: 0}, set()
    if name == "replace_sdpa_with_clustered_attention":
        return n, {ATTENTION: n, CACHE_APPEND: n}, {SDPA, INDEX_COPY}
    if name == "insert_cache_compression":
        n_chelsea = full if method == "chelsea" else 0
        return n_chelsea + len(run.windowed), {CHELSEA: n_chelsea, EVICT: len(run.windowed), ATTENTION: n}, set()
    if name == "remove_dead_cache_buffers":
        gone = {INDEX_COPY, "aten.copy_.default", "aten.add_.Tensor"}  # HF's cache writes and bookkeeping
        return len(run.captured.cache_buffers), {ATTENTION: n, CACHE_APPEND: n}, gone
    if name == "fuse_attention_observation":  # chelsea and full observe nothing (h2o/snapkv: test_fuse_attention_observation)
        return 0, {ATTENTION: n, CACHE_APPEND: n}, {OBSERVED, ACCUMULATE}
    if name == "fuse_projections":  # q/k/v and gate/up fused (Phi-3 ships them fused): o, down and lm_head stay
        groups = 0 if "phi3" in run.ctx.model_tag.lower() else 2 * n
        return groups, {LINEAR: 4 * n + 1, ATTENTION: n, CACHE_APPEND: n}, set()
    if name == "replace_linear_with_gemv":  # decode graphs (batch 1): every projection and the lm_head
        if run.ctx.graph_kind == "prefill":
            return 0, {LINEAR: 4 * n + 1, GEMV: 0}, set()
        return 4 * n + 1, {GEMV: 4 * n + 1, ATTENTION: n, CACHE_APPEND: n}, {LINEAR}
    if name == "fuse_rms_norm_into_gemv":  # decode graphs: the norms before qkv and gate_up (each layer), the lm_head
        if run.ctx.graph_kind == "prefill":
            return 0, {LINEAR: 4 * n + 1, GEMV_RMS_NORM: 0}, set()
        return 2 * n + 1, {GEMV_RMS_NORM: 2 * n + 1, GEMV: 2 * n, ATTENTION: n, CACHE_APPEND: n}, {LINEAR}
    if name == "fuse_glu_into_gemv":  # decode graphs: every family's gated MLP, its down projection a gemv_glu
        if run.ctx.graph_kind == "prefill":
            return 0, {GLU: 0, LINEAR: 4 * n + 1}, set()
        left = {GLU: n, GEMV: n, GEMV_RMS_NORM: 2 * n + 1, "aten.silu.default": 0, "aten.gelu.default": 0}
        return n, left, {LINEAR}
    raise AssertionError(f"no expectations for pass {name!r}: add them to _expected")


@pytest.mark.parametrize("name", PASS_NAMES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", list(METHODS))
def test_pass_contract(runs, family, kind, method, name):
    """(a) the pass's counter, (b) expected and unexpected ops after it."""
    run = runs.get(family, kind, method)
    step = run.steps[name]
    counter, expected, unexpected = _expected(run, name)
    assert step.counter == counter, f"{family}/{kind}/{method}: ctx.counters[{name!r}] = {step.counter}, expected {counter}"
    got = {op: step.ops[op] for op in expected}
    assert got == expected, f"{family}/{kind}/{method} after {name}: op counts {got}, expected {expected}"
    left = {op: step.ops[op] for op in unexpected if step.ops[op]}
    assert not left, f"{family}/{kind}/{method} after {name}: unexpected ops left {left}"

    done = PASS_NAMES[: PASS_NAMES.index(name) + 1]
    if "replace_kv_cache_update" in done:
        state = ["token_valid"] + [f"l{i}_{f}" for i in range(run.n_layers) for f in STATE_FIELDS]
        assert step.placeholders[-len(state):] == state, f"state inputs: {step.placeholders}"
    if "replace_sdpa_with_clustered_attention" in done:
        assert not step.get_attrs & _kv_buffers(run), f"dense KV cache still read: {step.get_attrs & _kv_buffers(run)}"
        assert not step.bool_masks, f"HF attention masks left alive: {step.bool_masks}"
    if name == "remove_dead_cache_buffers":
        assert not step.get_attrs & set(run.captured.cache_buffers)
        assert not [b for b in run.captured.cache_buffers if hasattr(run.gm, b)], "cache buffers still on the module"


@pytest.mark.parametrize("name", PASS_NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_golden_diff(runs, family, kind, name):
    """(c) what the pass changed, as text, against tests/golden/<family>/<kind>/<pass>.txt."""
    _check_golden(runs, family, kind, name)


@pytest.mark.parametrize("name", PASS_NAMES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", golden_cases())
def test_golden_diff_matrix_family(runs, case, kind, name):
    """(c) for every other family of the matrix (tests/families.py: one case per model type)."""
    _check_golden(runs, case, kind, name)


def _golden_path(base: Path) -> Path:
    """The golden for the installed transformers: the variant `<pass>.transformers-<major.minor>.txt` of the lowest
    version at or above it (a variant holds what its version and the older ones down to the next variant write),
    else the base, which the newest transformers writes."""
    variants = sorted((tuple(int(x) for x in p.name.split(".transformers-")[1][:-len(".txt")].split(".")), p)
                      for p in base.parent.glob(f"{base.stem}.transformers-*.txt"))
    return next((p for v, p in variants if v >= _TF_VERSION), base)


def _check_golden(runs, family, kind, name):
    """Against golden/<family>/<kind>/<pass>.txt, or the transformers-<major.minor> variant that covers the installed
    version where HF's graph differs (_golden_path; e.g. dead mask arithmetic of Gemma-2 and GPT-J on 5.17, GPT-J's
    scale as a division up to 5.23): an update with KVREWRITE_GOLDEN_VARIANT=1 writes the installed version's
    variant only where the diff differs from the base golden, which the newest transformers writes."""
    got = runs.get(family, kind).steps[name].diff
    base = GOLDEN / family / kind / f"{name}.txt"
    variant = base.with_name(f"{name}.transformers-{'.'.join(map(str, _TF_VERSION))}.txt")
    path = _golden_path(base)
    if UPDATE:
        base.parent.mkdir(parents=True, exist_ok=True)
        if os.environ.get("KVREWRITE_GOLDEN_VARIANT") == "1" and base.exists() and base.read_text() != got:
            variant.write_text(got)
        else:
            base.write_text(got)
        return
    if not path.exists():
        pytest.fail(f"missing golden {path}; generate it with: KVREWRITE_UPDATE_GOLDEN=1 python -m pytest tests/passes")
    want = path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), f"golden/{family}/{kind}/{name}.txt", "now"))
        pytest.fail(f"graph diff of {name} changed for {family}/{kind}:\n{diff}\n"
                    f"if the change is intended: KVREWRITE_UPDATE_GOLDEN=1 python -m pytest tests/passes, then review the goldens")


def _by_layer(gm, target):
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == target]
    return {n.meta["kvrewrite"]["layer"]: n for n in nodes}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", list(METHODS))
def test_sliding_window_layers_stay_exact(runs, kind, method):
    """(e) Gemma-3: sliding layers get evict_to_budget(n_sink=0) and window=8, never the method's op."""
    run = runs.get("gemma3", kind, method)
    assert run.windowed == [0, 1]
    attn = _by_layer(run.gm, "kvrewrite.clustered_attention.default")
    assert {l: n.args[7] for l, n in attn.items()} == {0: 8, 1: 8, 2: 0}
    # past_only (no slot after the query: the kernel skips the positions) in decode graphs, full-attention layers only
    assert {l: n.kwargs.get("past_only", False) for l, n in attn.items()} == {0: False, 1: False, 2: kind == "decode"}
    evict = _by_layer(run.gm, "kvrewrite.evict_to_budget.default")
    assert sorted(evict) == [0, 1] and all(n.kwargs == {"n_sink": 0} for n in evict.values())
    chelsea = _by_layer(run.gm, "kvrewrite.chelsea_compress.default")
    assert sorted(chelsea) == ([2] if method == "chelsea" else [])
    if method == "chelsea":
        assert chelsea[2].kwargs["n_sink"] == 2 and chelsea[2].kwargs["chunk"] == 8
    # on its layer's state, at the end of the graph in layer order (after every attention: see the pass's "Where")
    ops = {**evict, **chelsea}
    tail = list(run.gm.graph.nodes)[-1 - len(ops):-1]
    assert tail == [ops[layer] for layer in sorted(ops)], f"compression ops are not the graph's last nodes: {tail}"
    for layer, node in ops.items():
        assert [a.name for a in node.args] == [f"l{layer}_{f}" for f in STATE_FIELDS]


def test_full_method_inserts_nothing_on_full_attention(runs):
    """(e) `full` on a model without sliding layers: insert_cache_compression changes nothing."""
    step = runs.get("llama", "decode", "full").steps["insert_cache_compression"]
    assert step.counter == 0 and step.diff.rstrip().endswith("[no change]")


def test_run_passes_dumps_graphs(tmp_path):
    """run_passes(dump_dir=...) writes the graph text before and after every pass."""
    c = capture(tiny_model("llama"), batch_size=1, prefill_chunk=PREFILL_CHUNK)
    ctx = RewriteContext(c.model_tag, make_method("full"), c.layers, graph_kind="decode", cache_buffers=c.cache_buffers)
    gm = run_passes(c.graphs["decode"], ctx, dump_dir=tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    want = sorted(f"decode_{i:02d}_{when}_{p.__name__}.txt" for i, p in enumerate(PASSES) for when in ("before", "after"))
    assert files == want
    first = (tmp_path / f"decode_00_before_{PASSES[0].__name__}.txt").read_text()
    last = (tmp_path / f"decode_{len(PASSES) - 1:02d}_after_{PASSES[-1].__name__}.txt").read_text()
    assert "scaled_dot_product_attention" in first and "hf_cache_0_keys" in first
    assert "clustered_attention" in last and "hf_cache_" not in last
    assert last == str(gm.graph)


def _relu_to_sigmoid(gm, ctx):
    """A stand-in pass that edits the graph and ends with clean_up, as every pass does."""
    for node in gm.graph.nodes:
        if node.target is torch.relu:
            node.target = torch.sigmoid
    return clean_up(gm)


def test_run_passes_generates_the_code_once_after_the_last_pass():
    """Inside run_passes, clean_up leaves the lint and the recompile to run_passes (utils.deferred_recompile), which
    recompiles after the last pass: the module returned runs the rewritten graph. A pass called alone recompiles."""
    x = torch.tensor([-1.0, 2.0])
    gm = torch.fx.symbolic_trace(lambda t: torch.relu(t) + 1)
    with deferred_recompile():
        _relu_to_sigmoid(gm, None)
        assert "relu" in gm.code and torch.equal(gm(x), torch.relu(x) + 1)  # the code as it was
    gm = torch.fx.symbolic_trace(lambda t: torch.relu(t) + 1)
    ctx = types.SimpleNamespace(graph_kind="decode", where=lambda: "test")
    out = run_passes(gm, ctx, passes=[_relu_to_sigmoid, _relu_to_sigmoid])
    assert "sigmoid" in out.code and torch.equal(out(x), torch.sigmoid(x) + 1)
    alone = _relu_to_sigmoid(torch.fx.symbolic_trace(lambda t: torch.relu(t) + 1), None)
    assert "sigmoid" in alone.code and torch.equal(alone(x), torch.sigmoid(x) + 1)


def test_graph_diff_format():
    """graph_diff itself: removed / added / rewired / changed nodes, normalized names and floats."""

    def f(x):
        return torch.relu(x * 0.1234567) + 1

    gm = torch.fx.symbolic_trace(f)
    for n in gm.graph.nodes:
        n.meta["kvrewrite"] = {"layer": 0 if n.op == "call_function" else 1}
    before = snapshot(gm)
    mul, relu, _ = [n for n in gm.graph.nodes if n.op == "call_function"]
    mul.args = (mul.args[0], 2.0)
    with gm.graph.inserting_after(relu):
        sig = gm.graph.call_function(torch.sigmoid, (mul,))
    sig.meta["kvrewrite"] = {"layer": 0}
    relu.replace_all_uses_with(sig)
    gm.graph.erase_node(relu)
    assert graph_diff(before, gm, "toy").splitlines()[2:] == [
        "[op counts]    relu    -1",
        "               sigmoid +1",
        "[removed]      layer0  relu = relu(mul)",
        "[added]        layer0  sigmoid = sigmoid(mul)",
        "[rewired]      layer0  uses of relu -> sigmoid",
        "[changed]      layer0  mul = mul(x, 0.123457)",
        "                       -> mul = mul(x, 2)",
    ]
    assert graph_diff(before, before, "same").endswith("[no change]\n")


def test_golden_variant_lookup(tmp_path, monkeypatch):
    """A transformers-<v> variant covers v and the versions down to the next older variant; newer ones read the
    base."""
    import tests.passes.test_passes as me

    base = tmp_path / "p.txt"
    for name in ("p.txt", "p.transformers-5.17.txt", "p.transformers-5.23.txt", "q.transformers-5.9.txt"):
        (tmp_path / name).write_text(name)
    for version, want in (((5, 9), "p.transformers-5.17.txt"), ((5, 17), "p.transformers-5.17.txt"),
                          ((5, 20), "p.transformers-5.23.txt"), ((5, 23), "p.transformers-5.23.txt"),
                          ((5, 24), "p.txt"), ((6, 0), "p.txt")):
        monkeypatch.setattr(me, "_TF_VERSION", version)
        assert me._golden_path(base).name == want, version
