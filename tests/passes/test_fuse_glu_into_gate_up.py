"""fuse_glu_into_gate_up: with kernels/gemv_rms_norm_glu.FUSE on, a gated MLP's act(gate) * up moves from the down
projection's prologue (kvrewrite::gemv_glu) into the gate/up projection's epilogue (kvrewrite::gemv_rms_norm_glu) and
nothing else changes: on the CPU, where both ops run the aten ops they replace, the logits and tokens equal those
without it bit for bit. Off (the default) it leaves every graph as it was; it leaves alone what does not match."""
import operator

import pytest
import torch

import kvrewrite
from kvrewrite.context import RewriteContext
from kvrewrite.kernels import gemv_rms_norm_glu as glu_op
from kvrewrite.passes import fuse_glu_into_gate_up
from tests.families import tiny_model

OPS = torch.ops.kvrewrite
NEW = "kvrewrite.gemv_rms_norm_glu.default"
GLU = "kvrewrite.gemv_glu.default"


def _targets(gm) -> list:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@torch.no_grad()
def test_logits_and_tokens_are_bit_identical_on_cpu(monkeypatch):
    from kvrewrite.capture import capture

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    captured = capture(model, batch_size=1, prefill_chunk=16)

    def run():
        rw = kvrewrite.apply(model, "snapkv", max_length=64, prefill_chunk=16, gemv=True, fuse_projections=True,
                             captured=captured, budget=0.5, window=4, interval=4)
        ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
        return rw, rw.generate(ids, max_new_tokens=6, return_dict_in_generate=True, output_logits=True)

    plain_rw, plain = run()
    assert NEW not in _targets(plain_rw.decode_graph)  # off by default
    monkeypatch.setattr(glu_op, "FUSE", True)
    rw, fused = run()
    targets = _targets(rw.decode_graph)
    assert targets.count(NEW) == len(rw.layers) and GLU not in targets
    assert NEW not in _targets(rw.prefill_graph)
    assert torch.equal(fused.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(fused.logits, plain.logits, strict=True))


I, K = 6, 8
W_GU, W_DOWN, NW = torch.randn(2 * I, K), torch.randn(K, I), torch.randn(K)


def _graph(tail):
    """make_fx of gemv_rms_norm -> getitem -> tail(y, h): the pass's input pattern and variations of it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(x, r):
        y, h = OPS.gemv_rms_norm(x, r, NW, 1e-6, W_GU, None, False, True)
        return tail(y, h)

    return make_fx(fn)(torch.randn(1, 1, K), torch.randn(1, 1, K))


def _run(gm, **ctx):
    c = RewriteContext("toy", None, [], **{"graph_kind": "decode", "gemv": True, **ctx})
    return fuse_glu_into_gate_up(gm, c), c.counters["fuse_glu_into_gate_up"]


@pytest.mark.parametrize("h_first", [False, True], ids=["h_read_after", "h_read_before"])
def test_rewrites_the_pattern_and_computes_the_same(h_first, monkeypatch):
    """Also where the residual h is read between the norm and the gemv_glu (the fused op takes the norm's place)."""
    monkeypatch.setattr(glu_op, "FUSE", True)

    def tail(y, h):
        if h_first:
            h2 = h * 2
            return OPS.gemv_glu(y[..., :I], y[..., I:], W_DOWN, None, "silu", True), h2
        return OPS.gemv_glu(y[..., :I], y[..., I:], W_DOWN, None, "silu", True), h * 2

    x, r = torch.randn(1, 1, K), torch.randn(1, 1, K)
    want = _graph(tail)(x, r)
    gm, n = _run(_graph(tail))
    assert n == 1 and NEW in _targets(gm) and GLU not in _targets(gm)
    assert "kvrewrite.gemv_rms_norm.default" not in _targets(gm)
    got = gm(x, r)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [len(n.users) for n in gm.graph.nodes if str(n.target) == NEW] == [2]
    assert sum(n.target is operator.getitem for n in gm.graph.nodes) == 2


def test_leaves_alone_what_does_not_match(monkeypatch):
    cases = {
        "the halves swapped": lambda y, h: OPS.gemv_glu(y[..., I:], y[..., :I], W_DOWN, None, "silu", True),
        "y read elsewhere": lambda y, h: (OPS.gemv_glu(y[..., :I], y[..., I:], W_DOWN, None, "silu", True), y.sum()),
        "a slice of another width": lambda y, h: OPS.gemv_glu(y[..., 1:I + 1], y[..., I:], W_DOWN, None, "silu", True),
    }
    monkeypatch.setattr(glu_op, "FUSE", True)
    for name, tail in cases.items():
        gm, n = _run(_graph(tail))
        assert n == 0 and NEW not in _targets(gm), name
    plain = lambda y, h: OPS.gemv_glu(y[..., :I], y[..., I:], W_DOWN, None, "silu", True)  # noqa: E731
    assert _run(_graph(plain), tp=2)[1] == 0
    assert _run(_graph(plain), graph_kind="prefill")[1] == 0
    assert _run(_graph(plain), gemv=False)[1] == 0
    monkeypatch.setattr(glu_op, "FUSE", False)
    assert _run(_graph(plain))[1] == 0


def test_gemv_as_linear_gives_the_aten_ops_back(monkeypatch):
    """The ONNX and TensorRT exports run export/functional.gemv_as_linear: the new op becomes the add, RMSNorm,
    linear, slices, act and mul it computes, with the same values."""
    from kvrewrite.capture import copy_graph_module
    from kvrewrite.export.functional import gemv_as_linear

    monkeypatch.setattr(glu_op, "FUSE", True)

    def tail(y, h):
        return OPS.gemv_glu(y[..., :I], y[..., I:], W_DOWN, None, "gelu_tanh", True), h * 2

    gm, n = _run(_graph(tail))
    x, r = torch.randn(1, 1, K), torch.randn(1, 1, K)
    want = gm(x, r)
    plain = gemv_as_linear(copy_graph_module(gm))
    assert n == 1 and not [t for t in _targets(plain) if t.startswith("kvrewrite.")]
    assert all(torch.equal(a, b) for a, b in zip(plain(x, r), want))


@torch.no_grad()
def test_the_fused_graphs_export_to_onnx_and_reproduce_generate(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    from kvrewrite.export import loader

    monkeypatch.setattr(glu_op, "FUSE", True)
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    rw = kvrewrite.apply(model, "chelsea", budget=0.5, max_length=64, prefill_chunk=16, gemv=True,
                         fuse_projections=True, n_sink=2, n_recent=4, chunk=8, interval=4)
    assert _targets(rw.decode_graph).count(NEW) == len(rw.layers)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    ref = rw.generate(ids, max_new_tokens=6)
    for target in ("torch_export", "onnx"):
        path = getattr(kvrewrite.export, target)(rw, tmp_path / target)
        assert torch.equal(loader.load(path).generate(ids, max_new_tokens=6), ref), target
