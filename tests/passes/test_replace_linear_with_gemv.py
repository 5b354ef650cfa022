"""replace_linear_with_gemv: decode graphs of batch 1 compute every projection and the lm_head with kvrewrite::gemv
(the gated MLP's down projection with kvrewrite::gemv_glu, passes/fuse_glu_into_gemv.py), nothing else changes
(same tokens on the CPU, where the ops are the aten ops), batch > 1 and prefill graphs are left alone, and the
graphs still export (ONNX and TensorRT get the plain linear back). The kernel's numerics on CUDA
are checked in tests/kernels/test_gemv_gpu.py."""
import pytest
import torch

import kvrewrite
import kvrewrite.export
from kvrewrite.export import loader
from tests.families import FAMILIES, tiny_model

GEMV = "kvrewrite.gemv.default"
GEMV_RMS_NORM = "kvrewrite.gemv_rms_norm.default"  # passes/fuse_rms_norm_into_gemv.py: the gemvs after an RMSNorm
GLU = "kvrewrite.gemv_glu.default"  # passes/fuse_glu_into_gemv.py: the gated MLP's down projection
LINEAR = "aten.linear.default"
CHELSEA = dict(budget=0.5, n_sink=2, n_recent=4, chunk=8, interval=4)  # compresses in prefill and at decode steps


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == target)


def _apply(model, gemv, batch_size=1, **kw):
    return kvrewrite.apply(model, "chelsea", max_length=64, batch_size=batch_size, prefill_chunk=16, gemv=gemv,
                           **CHELSEA, **kw)


def _capture(model):
    from kvrewrite.capture import capture

    return capture(model, batch_size=1, prefill_chunk=16)


def _ids(batch=1, seed=3):
    return torch.randint(3, 128, (batch, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_every_decode_linear_becomes_a_gemv_and_tokens_are_unchanged(family):
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    captured = _capture(model)  # one capture, rewritten with and without the pass
    plain, rw = _apply(model, False, captured=captured), _apply(model, True, captured=captured)
    for name in ("decode", "decode_compress"):
        n = _count(getattr(plain, f"{name}_graph"), LINEAR)
        assert n > 0
        gm = getattr(rw, f"{name}_graph")
        n_layers = len(rw.layers)  # every family's MLP is gated: its down projection is a gemv_glu
        got = (_count(gm, LINEAR), _count(gm, GEMV) + _count(gm, GEMV_RMS_NORM) + _count(gm, GLU), _count(gm, GLU))
        assert got == (0, n, n_layers), f"{family} {name}"
        assert _count(gm, GEMV_RMS_NORM) > 0, f"{family} {name}"
    assert _count(rw.prefill_graph, GEMV) == 0
    assert _count(rw.prefill_graph, LINEAR) == _count(plain.prefill_graph, LINEAR)
    ids = _ids()
    assert torch.equal(rw.generate(ids, max_new_tokens=8), plain.generate(ids, max_new_tokens=8))


def test_batch_above_one_and_default_leave_the_graphs_alone():
    model = tiny_model("llama")
    assert _count(_apply(model, True, batch_size=2).decode_graph, GEMV) == 0
    assert _count(_apply(model, False).decode_graph, GEMV) == 0


def test_flag_must_be_a_bool():
    with pytest.raises(ValueError, match=r"gemv must be True or False, got 'yes'"):
        _apply(tiny_model("llama"), "yes")


@torch.no_grad()
def test_fused_gemv_graphs_export_and_reproduce_generate(tmp_path):
    pytest.importorskip("onnxruntime")
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    rw = _apply(model, True, fuse_projections=True)
    assert _count(rw.decode_graph, GEMV_RMS_NORM) == 5  # exported as the aten add, RMSNorm and linear it fused
    assert _count(rw.decode_graph, GLU) == len(rw.layers)  # ONNX gets silu, mul and linear back (gemv_as_linear)
    ids = _ids()
    ref = rw.generate(ids, max_new_tokens=6)
    for target in ("torch_export", "aoti", "onnx"):
        path = getattr(kvrewrite.export, target)(rw, tmp_path / target)
        assert torch.equal(loader.load(path).generate(ids, max_new_tokens=6), ref), target


def test_tensorrt_graph_gets_the_plain_linear():
    from kvrewrite.export.tensorrt_export import check_op_set, export_graph

    rw = _apply(tiny_model("llama"), True)
    assert _count(rw.decode_graph, GEMV_RMS_NORM) > 0
    ep = export_graph(rw, "decode")
    check_op_set(ep)  # ATen ops and the plugin ops only
    assert not [n for n in ep.graph.nodes if "gemv" in str(n.target)]
    assert _count(rw.decode_graph, GLU) == len(rw.layers)  # and the gemv_glu nodes became silu, mul and linear


def _constant_weight_flags(gm) -> list:
    from kvrewrite.passes.utils import all_args

    return [all_args(n)[-1] for n in gm.graph.nodes if str(n.target) in (GEMV, GEMV_RMS_NORM, GLU)]


def test_model_weights_are_marked_constant_and_the_state_is_written():
    """Every GEMV of a decode graph reads a weight no node writes (constant_weight=True: its kernel may load the first
    tile before the PDL wait), and what the graph writes is its state (placeholders), which no GEMV reads."""
    from kvrewrite.passes.utils import written_sources

    rw = _apply(tiny_model("llama"), True, fuse_projections=True)
    for gm in (rw.decode_graph, rw.decode_compress_graph):
        flags = _constant_weight_flags(gm)
        assert flags and all(f is True for f in flags)
        written = {n.name for n in written_sources(gm)}
        assert {"l0_keys", "l0_values", "l1_keys", "l1_values"} <= written, written
        assert not [n for n in written if "weight" in n]


def test_a_weight_the_graph_writes_is_not_constant():
    """A linear whose weight some node of the graph writes in place gets constant_weight=False (every load waits)."""
    from torch import fx

    from kvrewrite.context import RewriteContext
    from kvrewrite.passes.replace_linear_with_gemv import replace_linear_with_gemv

    def rewritten(write: bool):
        root = torch.nn.Module()
        root.w = torch.nn.Parameter(torch.randn(3, 4), requires_grad=False)
        graph = fx.Graph()
        x, new = graph.placeholder("x"), graph.placeholder("new")
        x.meta["val"] = torch.empty(1, 1, 4)
        if write:  # through a view of its own get_attr node
            view = graph.call_function(torch.ops.aten.view.default, (graph.get_attr("w"), [3, 4]))
            graph.call_function(torch.ops.aten.copy_.default, (view, new))
        graph.output(graph.call_function(torch.ops.aten.linear.default, (x, graph.get_attr("w"))))
        gm = replace_linear_with_gemv(fx.GraphModule(root, graph), RewriteContext("t", None, [], gemv=True))
        return _constant_weight_flags(gm)

    assert rewritten(False) == [True]
    assert rewritten(True) == [False]
