"""Shared by the H2O and SnapKV tests: see the state each evict_by_score call receives inside a real step."""
import contextlib

import torch

EVICT = torch.ops.kvrewrite.evict_by_score.default
STATE = ("keys", "values", "bias", "slot_pos", "fill", "budget", "score", "order")


class _Spy(torch.fx.Interpreter):
    def __init__(self, gm, seen):
        super().__init__(gm)
        self.seen = seen

    def run_node(self, n):
        if n.op == "call_function" and n.target is EVICT:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self.seen[n.meta["kvrewrite"]["layer"]] = ({f: a.clone() for f, a in zip(STATE, args)}, kwargs)
        return super().run_node(n)


class _Wrapped(torch.nn.Module):
    def __init__(self, gm, seen):
        super().__init__()
        self.gm, self.seen = gm, seen

    def forward(self, *args):
        return _Spy(self.gm, self.seen).run(*args)


@contextlib.contextmanager
def spy_compressions(rw, graph="decode_compress_graph"):
    """Inside, every run of rw's `graph` records {layer: (state before its evict_by_score, kwargs)} in the dict
    yielded (the last run's); the state in its layout (tests.kernels.evict_by_score_naive.temporal reads it in
    temporal order)."""
    seen = {}
    gm = getattr(rw, graph)
    setattr(rw, graph, _Wrapped(gm, seen))
    try:
        yield seen
    finally:
        setattr(rw, graph, gm)
