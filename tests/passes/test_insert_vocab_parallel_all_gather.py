"""insert_vocab_parallel_all_gather on a hand-built graph (no process group: the graph is checked, not run; the
2-process runs are tests/test_tensor_parallel.py): the split lm_head's logits go through kvrewrite::tp_all_gather
before anything reads them, with the whole vocabulary's val; tp=1 and a whole lm_head leave the graph alone; a weight
read by something else than a linear, or read by none, is refused by name."""
import pytest
import torch
from torch import fx, nn

from kvrewrite.context import RewriteContext
from kvrewrite.errors import RewriteError
from kvrewrite.passes.insert_vocab_parallel_all_gather import insert_vocab_parallel_all_gather

aten = torch.ops.aten
GATHER = torch.ops.kvrewrite.tp_all_gather.default


def _graph(reader=aten.linear.default) -> fx.GraphModule:
    """logits = tanh(linear(x, lm_head.weight)) (a soft-capping after the lm_head), vals on every node."""
    root = nn.Module()
    root.model = nn.Module()
    root.model.lm_head = nn.Linear(6, 5, bias=False)  # the rank's 5 rows of a vocabulary of 10
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.zeros(1, 3, 6)
    w = g.get_attr("model.lm_head.weight")
    logits = g.call_function(reader, (x, w) if reader is aten.linear.default else (w,))
    logits.meta["val"] = torch.zeros(1, 3, 5)
    g.output(g.call_function(aten.tanh.default, (logits,)))
    return fx.GraphModule(root, g)


def _ctx(tp=2, vocab="lm_head.weight"):
    return RewriteContext("toy", None, [], tp=tp, tp_group="g7", tp_vocab_parallel=vocab)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_the_logits_are_gathered_before_they_are_read():
    gm = insert_vocab_parallel_all_gather(_graph(), _ctx())
    assert _targets(gm) == [aten.linear.default, GATHER, aten.tanh.default]
    gather = next(n for n in gm.graph.nodes if n.target == GATHER)
    assert gather.args[1:] == ("g7", 2) and tuple(gather.meta["val"].shape) == (1, 3, 10)
    assert next(n for n in gm.graph.nodes if n.target == aten.tanh.default).args[0] is gather


@pytest.mark.parametrize("ctx", [_ctx(tp=1), _ctx(vocab="")], ids=["tp1", "whole lm_head"])
def test_nothing_to_gather_leaves_the_graph_alone(ctx):
    assert _targets(insert_vocab_parallel_all_gather(_graph(), ctx)) == [aten.linear.default, aten.tanh.default]


def test_a_weight_read_otherwise_or_not_at_all_is_refused():
    with pytest.raises(RewriteError, match=r"vocab-parallel weight model.lm_head.weight is read by something else"):
        insert_vocab_parallel_all_gather(_graph(reader=aten.t.default), _ctx())
    with pytest.raises(RewriteError, match=r"no aten.linear reads the vocab-parallel weight model.out.weight"):
        insert_vocab_parallel_all_gather(_graph(), _ctx(vocab="out.weight"))
