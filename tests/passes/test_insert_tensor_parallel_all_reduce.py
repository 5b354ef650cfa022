"""insert_tensor_parallel_all_reduce on a hand-built graph (no process group: the graph is checked, not run; the
2-process runs are tests/test_tensor_parallel.py): each row-parallel linear's partial sum goes through the group's
functional all-reduce, or through kvrewrite::tp_all_reduce with tp_all_reduce="one_shot", the bias after the sum;
tp=1 leaves the graph alone; a weight read by something else than a linear, or read by none, is refused by name."""
import pytest
import torch
from torch import fx, nn

from kvrewrite.context import RewriteContext
from kvrewrite.errors import RewriteError
from kvrewrite.passes.insert_tensor_parallel_all_reduce import insert_tensor_parallel_all_reduce

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _graph(bias: bool, reader=aten.linear.default) -> fx.GraphModule:
    root = nn.Module()
    root.model = nn.Module()
    root.model.o = nn.Linear(6, 4, bias=bias)
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("model.o.weight")
    args = (x, w, g.get_attr("model.o.bias")) if bias else (x, w)
    g.output(g.call_function(reader, args if reader is aten.linear.default else (w,)))
    return fx.GraphModule(root, g)


def _ctx(tp=2, mode="collective", row_parallel=("o.weight",)):
    return RewriteContext("toy", None, [], tp=tp, tp_group="g7", tp_row_parallel=row_parallel, tp_all_reduce=mode)


def _calls(gm):
    return [(n.target, n.args) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("mode", ["collective", "one_shot"])
def test_the_sum_follows_each_row_parallel_linear(mode, bias):
    gm = insert_tensor_parallel_all_reduce(_graph(bias), _ctx(mode=mode))
    calls = _calls(gm)
    targets = [t for t, _ in calls]
    summed = ([c10d.all_reduce.default, c10d.wait_tensor.default] if mode == "collective"
              else [torch.ops.kvrewrite.tp_all_reduce.default])
    assert targets == [aten.linear.default, *summed] + ([aten.add.Tensor] if bias else [])
    assert len(calls[0][1]) == 2  # the partial product has no bias: it is added once, after the sum
    assert "g7" in calls[1][1]  # the group's name
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert out.target == targets[-1]


def test_tp1_leaves_the_graph_alone():
    gm = _graph(True)
    before = _calls(gm)
    assert _calls(insert_tensor_parallel_all_reduce(gm, _ctx(tp=1))) == before


def test_a_weight_read_otherwise_or_not_at_all_is_refused():
    with pytest.raises(RewriteError, match=r"row-parallel weight model.o.weight is read by something else"):
        insert_tensor_parallel_all_reduce(_graph(False, reader=aten.t.default), _ctx())
    with pytest.raises(RewriteError, match=r"no aten.linear reads the row-parallel weights \['model.down.weight'\]"):
        insert_tensor_parallel_all_reduce(_graph(False), _ctx(row_parallel=("o.weight", "down.weight")))


def _residual_graph(first: bool, residual_shape=(2, 4), bias=False) -> fx.GraphModule:
    """out = add(r, linear(x, w)) (or add(linear, r)), every node with its val, r placed after the linear."""
    root = nn.Module()
    root.model = nn.Module()
    root.model.o = nn.Linear(6, 4, bias=bias)
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.zeros(2, 6)
    args = (x, g.get_attr("model.o.weight")) + ((g.get_attr("model.o.bias"),) if bias else ())
    h = g.call_function(aten.linear.default, args)
    h.meta["val"] = torch.zeros(2, 4)
    r = g.placeholder("r")
    r.meta["val"] = torch.zeros(residual_shape)
    add = g.call_function(aten.add.Tensor, (h, r) if first else (r, h))
    add.meta["val"] = torch.zeros(2, 4)
    g.output(add)
    return fx.GraphModule(root, g)


@pytest.mark.parametrize("first", [True, False], ids=["add(h, r)", "add(r, h)"])
def test_the_one_shot_sum_takes_the_residual_add(first):
    """one_shot: linear -> add(., r) becomes tp_all_reduce(linear, group, r), inserted after r, with the linear's
    val; the collective keeps the add, and so do a biased linear and a residual of another shape."""
    gm = insert_tensor_parallel_all_reduce(_residual_graph(first), _ctx(mode="one_shot"))
    calls = _calls(gm)
    assert [t for t, _ in calls] == [aten.linear.default, torch.ops.kvrewrite.tp_all_reduce.default]
    op = next(n for n in gm.graph.nodes if n.target == torch.ops.kvrewrite.tp_all_reduce.default)
    assert op.args[1] == "g7" and op.args[2].name == "r"
    assert tuple(op.meta["val"].shape) == (2, 4) and tuple(op.args[0].meta["val"].shape) == (2, 4)
    gm.graph.lint()  # r is defined before the op that reads it
    kept = insert_tensor_parallel_all_reduce(_residual_graph(first), _ctx(mode="collective"))
    assert aten.add.Tensor in [t for t, _ in _calls(kept)]
    for graph in (_residual_graph(first, bias=True), _residual_graph(first, residual_shape=(4,))):
        gm = insert_tensor_parallel_all_reduce(graph, _ctx(mode="one_shot"))
        op = next(n for n in gm.graph.nodes if n.target == torch.ops.kvrewrite.tp_all_reduce.default)
        assert len(op.args) == 2 and aten.add.Tensor in [t for t, _ in _calls(gm)]
