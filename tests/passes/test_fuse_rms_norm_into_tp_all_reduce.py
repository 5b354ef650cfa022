"""fuse_rms_norm_into_tp_all_reduce on hand-built graphs (no process group: the graph is checked, and the op's CPU path
run in a one-rank gloo group; the 2-GPU run is tests/test_tensor_parallel.py): a one-shot sum read by residual-free
gemv_rms_norm nodes of one norm becomes tp_all_reduce_rms_norm + plain gemvs on its normed output, the sum's other
readers read its h; the collective mode, tp=1, prefill graphs, a gemv_rms_norm with a residual and two different norms
leave the graph alone."""
import operator

import pytest
import torch
from torch import fx, nn

import kvrewrite.kernels.tp_all_reduce_rms_norm  # noqa: F401  (registers the op)
from kvrewrite.context import RewriteContext
from kvrewrite.kernels.gemv_rms_norm import reference_rms_norm
from kvrewrite.passes.fuse_rms_norm_into_tp_all_reduce import fuse_rms_norm_into_tp_all_reduce

kv = torch.ops.kvrewrite
K = 8


def _graph(norms=("norm", "norm"), residual_in_gemv=False) -> fx.GraphModule:
    """h = tp_all_reduce(x, "g7", r); y_i = gemv_rms_norm(h, None, <norm_i>.weight, 1e-6, w_i, None, False, True)[0];
    out = (y_0, y_1, h + 1) (h read by the next residual too)."""
    root = nn.Module()
    root.model = nn.Module()
    for name in set(norms):
        setattr(root.model, name, nn.Module())
        getattr(root.model, name).weight = nn.Parameter(torch.ones(K))
    root.model.w0, root.model.w1 = nn.Parameter(torch.zeros(3, K)), nn.Parameter(torch.zeros(5, K))
    g = fx.Graph()
    x, r = g.placeholder("x"), g.placeholder("r")
    h = g.call_function(kv.tp_all_reduce.default, (x, "g7", r))
    h.meta["val"] = torch.zeros(1, 1, K)
    ys = []
    for i, name in enumerate(norms):
        res = r if residual_in_gemv and i == 0 else None
        op = g.call_function(kv.gemv_rms_norm.default, (h, res, g.get_attr(f"model.{name}.weight"), 1e-6,
                                                        g.get_attr(f"model.w{i}"), None, False, True))
        ys.append(g.call_function(operator.getitem, (op, 0)))
    g.output((*ys, g.call_function(torch.ops.aten.add.Tensor, (h, 1))))
    return fx.GraphModule(root, g)


def _ctx(tp=2, mode="one_shot", gemv=True, kind="decode"):
    ctx = RewriteContext("toy", None, [], tp=tp, tp_group="g7", tp_all_reduce=mode, gemv=gemv)
    ctx.graph_kind = kind
    return ctx


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def test_the_norm_goes_into_the_sum_and_the_gemvs_read_its_output():
    gm = fuse_rms_norm_into_tp_all_reduce(_graph(), _ctx())
    gm.graph.lint()
    assert _targets(gm) == [kv.tp_all_reduce_rms_norm.default, kv.gemv.default, kv.gemv.default, torch.ops.aten.add.Tensor]
    op = next(n for n in gm.graph.nodes if n.target is kv.tp_all_reduce_rms_norm.default)
    names = [(a.target if a.op == "get_attr" else a.name) if isinstance(a, fx.Node) else a for a in op.args]
    assert names == ["x", "g7", "r", "model.norm.weight", 1e-6, False]
    h, n = sorted(op.users, key=lambda u: u.args[1])
    gemvs = [u for u in gm.graph.nodes if u.target is kv.gemv.default]
    assert all(g.args[0] is n and g.args[3] is True for g in gemvs)  # n in, constant_weight kept
    assert [g.args[1].target for g in gemvs] == ["model.w0", "model.w1"]
    add = next(u for u in gm.graph.nodes if u.target is torch.ops.aten.add.Tensor)
    assert add.args[0] is h and tuple(op.meta["val"][0].shape) == (1, 1, K)


@pytest.mark.parametrize("case", ["collective", "tp1", "no-gemv", "prefill", "residual", "two norms", "switched off"])
def test_what_does_not_match_stays(case, monkeypatch):
    monkeypatch.setattr(kvrewrite.kernels.tp_all_reduce_rms_norm, "IN_GRAPHS", case != "switched off")
    ctx = {"collective": _ctx(mode="collective"), "tp1": _ctx(tp=1), "no-gemv": _ctx(gemv=False),
           "prefill": _ctx(kind="prefill")}.get(case, _ctx())
    graph = _graph(norms=("norm", "other")) if case == "two norms" else _graph(residual_in_gemv=case == "residual")
    before = _targets(graph)
    assert _targets(fuse_rms_norm_into_tp_all_reduce(graph, ctx)) == before


@pytest.mark.parametrize("unit_offset", [False, True])
def test_the_cpu_path_is_the_sum_then_hf_norm(unit_offset):
    """One rank of gloo: the sum is x itself, + residual; n is reference_rms_norm of it, bit for bit."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(3)
        x, r, nw = (torch.randn(1, 1, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
        nw = nw.view(64)
        group = dist.group.WORLD.group_name
        h, n = kv.tp_all_reduce_rms_norm(x, group, r, nw, 1e-6, unit_offset)
        assert torch.equal(h, x + r)
        assert torch.equal(n, reference_rms_norm(x + r, nw, 1e-6, unit_offset))
        with pytest.raises(ValueError, match=r"x must be one row of the norm weight's 64 elements, got x of shape"):
            kv.tp_all_reduce_rms_norm(torch.zeros(2, 64, dtype=torch.bfloat16), group, None, nw, 1e-6)
    finally:
        if owned:
            dist.destroy_process_group()
