"""kvrewrite/inductor_fallback_log.py: Inductor's fallback and lowering-error messages never print an IR node's __str__
(torch 2.11 printed 2^layers lines there and held the 8B tp=2 compile), inside rw.compile's calls only."""
import pytest
import torch

from kvrewrite.inductor_fallback_log import bounded_operator_str, shallow_operator_str
from kvrewrite.runtime import _OpaqueOpsCall

exc = pytest.importorskip("torch._inductor.exc")


class _DeepNode:
    """Stands for an IR node deep in a graph: its __str__ would print its inputs' (here: fails the test)."""

    def __init__(self, name="buf7"):
        self.name = name

    def get_name(self):
        return self.name

    def get_size(self):
        return [1, 1, 4096]

    def get_dtype(self):
        return torch.bfloat16

    def __str__(self):
        raise AssertionError("an IR node's __str__ was called")

    __repr__ = __str__


class _Unnamed(_DeepNode):
    def get_name(self):
        raise NotImplementedError  # a view: no name of its own


def test_the_message_names_the_target_and_each_argument_without_its_ir():
    text = bounded_operator_str("kvrewrite.tp_all_gather.default", [_DeepNode(), "group0", 2],
                                {"residual": _Unnamed(), "sizes": list(range(20))})
    assert "target: kvrewrite.tp_all_gather.default" in text
    assert "args[0]: _DeepNode(name=buf7, size=[1, 1, 4096], dtype=torch.bfloat16)" in text
    assert "args[1]: 'group0'" in text and "args[2]: 2" in text
    assert "'residual': _Unnamed(size=[1, 1, 4096], dtype=torch.bfloat16)" in text
    assert "'sizes': [0, 1, 2, 3, 4, 5, 6, 7, ...]" in text
    nested = bounded_operator_str("t", [[[_DeepNode()]], (_DeepNode("buf9"),)], {})
    assert "args[0]: [list]" in nested and "args[1]: (_DeepNode(name=buf9" in nested


def test_inductor_uses_it_inside_the_block_and_gets_its_own_back_after():
    original = exc.OperatorIssue.__dict__["operator_str"]
    with pytest.raises(ValueError, match="inside"):
        with shallow_operator_str():
            # graph.py calls error.operator_str on the subclasses; a lowering error formats its message at once
            assert exc.MissingOperatorWithoutDecomp.operator_str is bounded_operator_str
            err = exc.LoweringException(RuntimeError("no kernel"), "kvrewrite.op.default", [_DeepNode()], {})
            assert "RuntimeError: no kernel" in str(err) and "_DeepNode(name=buf7" in str(err)
            raise ValueError("inside")
    assert exc.OperatorIssue.__dict__["operator_str"] is original
    with pytest.raises(AssertionError, match="__str__ was called"):  # outside: Inductor's own, which prints the IR
        exc.OperatorIssue.operator_str("t", [_DeepNode()], {})


def test_rw_compiles_call_runs_under_it():
    seen = []
    _OpaqueOpsCall(lambda x: seen.append(exc.OperatorIssue.operator_str) or x)(torch.ones(1, 1))
    assert seen == [bounded_operator_str]
    assert exc.OperatorIssue.operator_str is not bounded_operator_str
