"""Inductor's message for an op it falls back on, without printing the op's inputs' whole IR.

Why: Inductor lowers an op that has no lowering of its own (every `kvrewrite::` op under rw.compile, which keeps them
whole) through an implicit fallback, and the first time it meets each such op it logs "Creating implicit fallback
for:" with `OperatorIssue.operator_str(target, args, kwargs)`. torch 2.11 builds that string eagerly, whatever the log
level, and an IR node's `__str__` prints its inputs' `__str__` in turn: through a decode graph's chain of layers, where
each layer's sum-and-norm op has two outputs that both feed the next layer, that is 2^layers lines. An op met for the
first time only at the end of the graph (kvrewrite::tp_all_gather after the vocab-parallel lm_head) then held the
Llama-3.1-8B compile at tp=2 for minutes (stop 45: cut at 165-250 s where it takes ~35 s; the stack in stop 46:
graph.py call_function -> exc.operator_str -> ir.py __str__, recursing). torch 2.13 formats the message lazily, but a
LoweringException still formats it eagerly. vLLM met the same with its all-reduce op.

`shallow_operator_str()` puts a bounded `operator_str` in place for the duration of a compile: the target, then each
argument as its type, name, size and dtype (lists and tuples to a few entries), never an IR node's `__str__`. Only
the text of Inductor's log line and of its lowering errors changes; what Inductor does does not.
"""
from __future__ import annotations

import functools

import torch

_MAX_ITEMS = 8  # entries of a list or tuple argument shown before "..."


def _arg_text(arg, depth: int = 0) -> str:
    """One argument, bounded: primitives by value, containers to _MAX_ITEMS entries (one level deep), anything with
    get_size (Inductor's IR nodes) as type(name, size, dtype), other objects by type name."""
    if arg is None or isinstance(arg, (bool, int, float, str, torch.dtype, torch.device)):
        text = repr(arg)
        return text if len(text) <= 80 else text[:77] + "..."
    if isinstance(arg, (list, tuple)) and depth == 0:
        items = [_arg_text(a, depth + 1) for a in arg[:_MAX_ITEMS]]
        more = ", ..." if len(arg) > _MAX_ITEMS else ""
        return ("[%s%s]" if isinstance(arg, list) else "(%s%s)") % (", ".join(items), more)
    if hasattr(arg, "get_size"):
        fields = []
        for label, getter in (("name", "get_name"), ("size", "get_size"), ("dtype", "get_dtype")):
            try:
                fields.append(f"{label}={getattr(arg, getter)()}")
            except Exception:  # a node without a name (a view), or without a layout yet: left out
                pass
        return f"{type(arg).__name__}({', '.join(fields)})"
    return type(arg).__name__


def bounded_operator_str(target, args, kwargs) -> str:
    """What OperatorIssue.operator_str says (the target, each argument, the kwargs), each argument bounded."""
    lines = [f"target: {target}"] + [f"args[{i}]: {_arg_text(a)}" for i, a in enumerate(args)]
    if kwargs:
        lines.append("kwargs: {%s}" % ", ".join(f"{k!r}: {_arg_text(v)}" for k, v in kwargs.items()))
    return "\n".join("  " + line for line in lines)


@functools.lru_cache(maxsize=None)
def _operator_issue():
    """torch._inductor.exc.OperatorIssue where it defines operator_str, else None; looked up once, since rw.compile's
    calls enter shallow_operator_str on every step."""
    try:
        from torch._inductor.exc import OperatorIssue
    except ImportError:  # a torch without Inductor: nothing formats these messages
        return None
    return OperatorIssue if "operator_str" in OperatorIssue.__dict__ else None


_BOUNDED = staticmethod(bounded_operator_str)


class shallow_operator_str:
    """Context manager: bounded_operator_str as Inductor's OperatorIssue.operator_str inside the block, the original
    restored after; a no-op where torch has no such class. A class, not a generator: it is entered on every decode
    step of a compiled model (runtime._OpaqueOpsCall), ~0.6 us against ~5 for contextlib's form with the lookup."""

    __slots__ = ("_old",)

    def __enter__(self):
        issue = _operator_issue()
        self._old = None if issue is None else issue.__dict__["operator_str"]
        if issue is not None:
            issue.operator_str = _BOUNDED
        return self

    def __exit__(self, *exc_info):
        if self._old is not None:
            _operator_issue().operator_str = self._old
        return False
