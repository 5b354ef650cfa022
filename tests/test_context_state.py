"""Compress once, ask many (kvrewrite/context_cache.py): a question batch on one compressed context equals the
questions asked one by one, `full` on a context equals `full` on the whole prompt, the state is never changed by
a generation, save/load is bit-exact, and a state is refused by a rewrite it does not fit, naming why.

Generation here is prefill-free: `_start_from_context` then greedy `decode_step`s (what generate(context=...)
runs), so these tests do not depend on generate's sampling options.
"""
import pytest
import torch

import kvrewrite
from kvrewrite.capture import capture
from kvrewrite.context_cache import ContextState
from kvrewrite.host import greedy_tokens
from tests.families import tiny_model
from tests.methods_matrix import METHODS_MATRIX

MAX_LENGTH, CHUNK, NEW = 96, 8, 6
# every method once, with the matrix's first (mildest) settings: they fit a 37-token context
SETTINGS = {}
for _e in METHODS_MATRIX:
    SETTINGS.setdefault(_e["name"], _e["kwargs"])
METHODS = [m for m in SETTINGS if m != "full"]
# a row's logits from a batch-3 graph vs a batch-1 graph: same math, another blocking (fp32 noise)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def captured(model):
    return {b: capture(model, batch_size=b, prefill_chunk=CHUNK) for b in (1, 3)}


def rewrite(model, captured, method, batch=1, **overrides):
    kwargs = {**SETTINGS[method], **overrides}
    max_length = kwargs.pop("max_length", MAX_LENGTH)
    return kvrewrite.apply(model, method, captured=captured[batch], max_length=max_length, **kwargs)


@pytest.fixture(scope="module")
def texts():
    g = torch.Generator().manual_seed(0)
    context = torch.randint(1, 128, (1, 37), generator=g)
    lengths = (11, 5, 14)  # left-padded to 14 in a batch (2 chunks of 8)
    questions = [torch.randint(1, 128, (n,), generator=g) for n in lengths]
    ids = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.zeros(3, 14, dtype=torch.long)
    for b, q in enumerate(questions):
        ids[b, 14 - len(q):], mask[b, 14 - len(q):] = q, 1
    return context, ids, mask


def ask(rw, state, ids, mask=None, new=NEW):
    """Greedy continuation of `state`: (tokens [B, new], logits [B, new, V])."""
    logits, history = rw._start_from_context(ids, mask, new, state)
    assert torch.equal(history[:, state.length:], ids)
    toks, out = [], []
    for step in range(new):
        out.append(logits)
        toks.append(greedy_tokens(logits))
        if step < new - 1:
            logits = rw.decode_step(toks[-1])
    return torch.stack(toks, 1), torch.stack(out, 1)


def snapshot(state: ContextState):
    return [{k: v.clone() for k, v in t.items()} for t in state.tensors], repr(state.schedule), \
        state.next_position.clone()


def same_state(a, b) -> bool:
    (ta, sa, pa), (tb, sb, pb) = a, b
    return sa == sb and torch.equal(pa, pb) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)
        for x, y in zip(ta, tb))


@pytest.mark.parametrize("method", METHODS)
def test_question_batch_equals_one_by_one(model, captured, texts, method):
    """Three questions of different lengths on one compressed context (a batch-1 state broadcast into a batch-3
    rewrite) give the tokens and logits of each question asked alone (same left padding) on a batch-1 rewrite;
    the state is bit for bit what it was."""
    context, ids, mask = texts
    rw1 = rewrite(model, captured, method)
    rw3 = rewrite(model, captured, method, batch=3)
    state = rw1.prefill_context(context)
    before = snapshot(state)
    toks, logits = ask(rw3, state, ids, mask)
    for b in range(3):
        t1, l1 = ask(rw1, state, ids[b:b + 1], mask[b:b + 1])
        assert torch.equal(toks[b:b + 1], t1), f"{method}: question {b}: {toks[b].tolist()} vs {t1[0].tolist()}"
        err = (logits[b:b + 1] - l1).abs().max().item()
        assert err < ATOL, f"{method}: question {b}: logits differ by {err}"
    assert same_state(before, snapshot(state)), f"{method}: generate changed the context state"


def test_full_with_context_equals_whole_prompt(model, captured, texts):
    """`full` on a compressed (here: kept whole) context + a question = `full` prefilled with context + question."""
    context, ids, _ = texts
    rw = rewrite(model, captured, "full")
    state = rw.prefill_context(context)
    q = ids[:1]  # 14 tokens, no padding
    toks, logits = ask(rw, state, q)
    whole = rw.prefill(torch.cat([context, q], 1), max_new_tokens=NEW)
    ref = [whole]
    for step in range(NEW - 1):
        ref.append(rw.decode_step(greedy_tokens(ref[-1])))
    ref = torch.stack(ref, 1)
    assert torch.equal(toks, greedy_tokens(ref))
    err = (logits - ref).abs().max().item()
    assert err < 1e-5, f"full: context mode vs whole prompt: logits differ by {err}"


def test_broadcast_equals_replicated_run(model, captured, texts):
    """A batch-1 rewrite's state in a batch-3 rewrite = the batch-3 rewrite's own (replicated) state."""
    context, ids, mask = texts
    rw1 = rewrite(model, captured, "h2o")
    rw3 = rewrite(model, captured, "h2o", batch=3)
    s1, s3 = rw1.prefill_context(context), rw3.prefill_context(context)
    assert s3.rows == 1 and s3.facts == s1.facts  # the replicated run keeps one row
    for a, b in zip(s1.tensors, s3.tensors):
        for k in a:
            assert torch.allclose(a[k].float(), b[k].float(), atol=ATOL, equal_nan=True), k
    (t1, l1), (t3, l3) = ask(rw3, s1, ids, mask), ask(rw3, s3, ids, mask)
    assert torch.equal(t1, t3)
    assert (l1 - l3).abs().max().item() < ATOL


def test_one_context_per_row(model, captured, texts):
    """A [3, n] context batch (left-padded) keeps 3 rows; row b continues context b as it would alone (an int
    budget: a fraction would be of the batch's longest context, as for any batched prompt)."""
    context, ids, mask = texts
    rw1 = rewrite(model, captured, "streamingllm", budget=18)
    rw3 = rewrite(model, captured, "streamingllm", batch=3, budget=18)
    ctx = torch.cat([context, context.roll(5, 1), context.flip(1)])
    cmask = torch.ones_like(ctx)
    cmask[1, :4] = 0
    state = rw3.prefill_context(ctx, cmask)
    assert state.rows == 3
    toks, logits = ask(rw3, state, ids, mask)
    for b in range(3):
        t1, l1 = ask(rw1, rw1.prefill_context(ctx[b:b + 1], cmask[b:b + 1]), ids[b:b + 1], mask[b:b + 1])
        assert torch.equal(toks[b:b + 1], t1)
        assert (logits[b:b + 1] - l1).abs().max().item() < ATOL


def test_save_load_round_trip_is_bit_exact(model, captured, texts, tmp_path):
    context, ids, mask = texts
    rw = rewrite(model, captured, "kvmerger")
    state = rw.prefill_context(context)
    state.save(tmp_path / "ctx.pt")
    loaded = rw.load_context(tmp_path / "ctx.pt")
    assert same_state(snapshot(state), snapshot(loaded))
    assert loaded.facts == state.facts and torch.equal(loaded.input_ids, state.input_ids)
    assert loaded.next_cache_position == state.next_cache_position
    (t0, l0), (t1, l1) = ask(rw, state, ids[:1]), ask(rw, loaded, ids[:1])
    assert torch.equal(t0, t1) and torch.equal(l0, l1)
    plain = ContextState.load(tmp_path / "ctx.pt", map_location="cpu")  # without a rewrite: no check
    assert same_state(snapshot(state), snapshot(plain))


@pytest.mark.parametrize("other, fragment", [
    (dict(method="h2o"), "method: the state's 'streamingllm', this rewrite's 'h2o'"),
    (dict(budget=0.4), "method option budget: the state's 0.5, this rewrite's 0.4"),
    (dict(n_sink=3), "method option n_sink"),
    (dict(max_length=80), "max_length: the state's 96, this rewrite's 80"),
    (dict(seed=1), "weights"),
], ids=["method", "budget", "option", "max_length", "weights"])
def test_mismatch_refused_by_name(model, captured, texts, tmp_path, other, fragment):
    context, ids, _ = texts
    state = rewrite(model, captured, "streamingllm").prefill_context(context)
    state.save(tmp_path / "ctx.pt")
    other = dict(other)
    method = other.pop("method", "streamingllm")
    if "seed" in other:
        twin = tiny_model("llama", seed=other.pop("seed"))
        rw = kvrewrite.apply(twin, "streamingllm", max_length=MAX_LENGTH, prefill_chunk=CHUNK,
                             **SETTINGS["streamingllm"])
    else:
        rw = rewrite(model, captured, method, **other)
    with pytest.raises(ValueError, match="made by another rewrite") as e:
        rw.load_context(tmp_path / "ctx.pt")
    assert fragment in str(e.value)
    with pytest.raises(ValueError, match="made by another rewrite"):
        rw._start_from_context(ids[:1], None, 2, state)


@pytest.mark.parametrize("fact, value, fragment", [
    ("dtype", "torch.bfloat16", "dtype: the state's torch.bfloat16"),
    ("layers", [], "layer layout"),
    ("prefill_chunk", 16, "prefill_chunk: the state's 16, this rewrite's 8"),
])
def test_recorded_facts_are_checked(model, captured, texts, tmp_path, fact, value, fragment):
    """The facts a tiny test cannot vary cheaply (dtype, layer layout, chunk): an edited state is refused by name."""
    rw = rewrite(model, captured, "streamingllm")
    state = rw.prefill_context(texts[0])
    state.facts = {**state.facts, fact: value}
    state.save(tmp_path / "ctx.pt")
    with pytest.raises(ValueError, match="made by another rewrite") as e:
        rw.load_context(tmp_path / "ctx.pt")
    assert fragment in str(e.value)


def test_what_does_not_fit_is_refused_with_sizes(model, captured, texts):
    context, ids, _ = texts
    rw = rewrite(model, captured, "full")
    state = rw.prefill_context(context)
    with pytest.raises(ValueError, match=r"context of 37 tokens \+ question of 14 \+ max_new_tokens=46 exceeds "
                                         r"max_length=96"):
        rw._start_from_context(ids[:1], None, 46, state)
    # 37 + 9 + 50 = 96 fits max_length, but not the slots: 40 (the context padded) + 16 (the question) + 50 > 103
    with pytest.raises(ValueError, match=r"layer 0 holds 103 slots; after the context \(40 slots at most\) and a "
                                         r"question of 9 tokens \(padded to 16\), answer token 48 of "
                                         r"max_new_tokens=50 would need 104"):
        rw._start_from_context(ids[:1, -9:], None, 50, state)
    rw3 = rewrite(model, captured, "full", batch=3)
    with pytest.raises(ValueError, match=r"prefill_context takes one context \[1, n\] or one per row \[3, n\]"):
        rw3.prefill_context(context.expand(2, -1))
    with pytest.raises(ValueError, match="context must be a kvrewrite.ContextState"):
        rw._start_from_context(ids[:1], None, 2, {"not": "a state"})


@pytest.mark.parametrize("method", [m for m in METHODS if m != "clusterkv"])
def test_chunk_aligned_context_continues_like_the_whole_prompt(model, captured, texts, method):
    """With an int budget and a context and question of whole chunks, the context mode runs exactly the steps of
    the whole prompt (same chunks, positions and thresholds): same tokens, logits within fp32 noise. (ClusterKV
    clusters at the end of the prompt, which the context mode moves to the end of the context.)"""
    context, ids, _ = texts
    rw = rewrite(model, captured, method, budget=16)
    ctx, q = context[:, :32], ids[:1, -8:]
    toks, logits = ask(rw, rw.prefill_context(ctx), q)
    ref = [rw.prefill(torch.cat([ctx, q], 1), max_new_tokens=NEW)]
    for step in range(NEW - 1):
        ref.append(rw.decode_step(greedy_tokens(ref[-1])))
    ref = torch.stack(ref, 1)
    assert torch.equal(toks, greedy_tokens(ref))
    err = (logits - ref).abs().max().item()
    assert err < 1e-5, f"{method}: context mode vs whole prompt: logits differ by {err}"
