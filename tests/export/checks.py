"""Checks every method's export tests make: the functional graph handed to torch-tensorrt computes what the in-place
graph computes (kvrewrite.export.functional), and the exported-model loader generates what rw.generate does."""
import torch

from kvrewrite.export import tensorrt_export as te
from kvrewrite.export.common import graph_of


def left_padded_prompts(n: int) -> tuple:
    """The export tests' prompts: 2 rows of n random ids (seed 2), the second left-padded by 5."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, n), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def check_functional_equals_in_place(rw, name, args, state) -> tuple:
    """Run graph `name` functionally on `state` (a list of clones of rw's state tensors), then in place on the same
    list: the functional graph leaves its inputs alone and returns exactly the logits and the state the in-place
    graph writes. Returns (the state before, the state after)."""
    saved = [t.clone() for t in state]
    logits, *new_state = te.trt_graph(rw, name)(*args, *state)
    assert all(torch.equal(a, b) for a, b in zip(state, saved)), "the functional graph wrote its inputs"
    ref = graph_of(rw, name)(*args, *state)  # in place
    assert torch.equal(logits, ref)
    assert all(torch.equal(a, b) for a, b in zip(new_state, state))
    return saved, new_state


def check_decode_compress_when_due(rw, ids, mask, new_tokens: int) -> None:
    """After a prefill of (ids, mask), the decode step with compression with every row due (each layer's threshold,
    budget[1], pulled down to its smallest fill + 1): functional == in place, and the compression ran (every fill
    shrank below fill + 1)."""
    logits = rw.prefill(ids, mask, max_new_tokens=new_tokens)
    args = [logits.argmax(-1)[:, None], rw._next_position[:, None], rw._next_cache_position,
            torch.ones(ids.shape[0], 1, dtype=torch.bool)]
    state = [t.clone() for t in rw.state_tensors()]
    starts = [sum(len(rw.layer_fields(j)) for j in range(k)) for k in range(len(rw.layers))]
    for s0 in starts:  # fields 4 and 5 of a layer: fill and budget
        state[s0 + 5][1] = int(state[s0 + 4].min()) + 1
    saved, after = check_functional_equals_in_place(rw, "decode_compress", args, state)
    fills = [(saved[s0 + 4], after[s0 + 4]) for s0 in starts]
    assert all(bool((a < b + 1).all()) for b, a in fills), "no compression ran"


def check_loader_generates_like_rw(m, rw, ids, mask, new_tokens: int) -> int:
    """m (kvrewrite.export.loader.load of rw's export) generates exactly rw.generate's tokens and ends in the same
    state; returns how many decode steps with compression m ran (the caller asks for enough of them)."""
    calls = []
    step = m.steps["decode_compress"]
    m.steps["decode_compress"] = lambda *a: calls.append(1) or step(*a)
    ref = rw.generate(ids, mask, max_new_tokens=new_tokens)
    out = m.generate(ids, mask, max_new_tokens=new_tokens)
    n = ids.shape[1]
    assert torch.equal(out, ref), f"loader\n{out[:, n:]}\n!= rw.generate\n{ref[:, n:]}"
    assert all(torch.equal(a, b) for a, b in zip(m.state, rw.state_tensors())), "final state differs"
    return len(calls)


def aoti_step_when_due(rw, tmp_path, ids, mask, new_tokens: int) -> tuple:
    """rw's decode step with compression compiled alone by AOTInductor, run where the host schedule's next
    compression is due (after a prefill of (ids, mask), decoding until then): the package computes the eager graph's
    logits and state (tests/export/test_aoti.py `_step_matches_eager`). Returns (state names, the state before the
    step, the eager step's state)."""
    import kvrewrite.export
    from kvrewrite.export import loader
    from tests.export.test_aoti import _step_matches_eager

    path = kvrewrite.export.aoti(rw, tmp_path, graphs=("decode_compress",))
    step = loader.load(path).steps["decode_compress"]
    logits = rw.prefill(ids, mask, max_new_tokens=new_tokens)
    while not rw.schedule.due(1):
        logits = rw.decode_step(logits.argmax(-1))
    args = [logits.argmax(-1)[:, None], rw._next_position[:, None], rw._next_cache_position,
            torch.ones(ids.shape[0], 1, dtype=torch.bool)]
    before = [t.clone() for t in rw.state_tensors()]
    names, eager = _step_matches_eager(rw, step, args)
    return names, before, eager
