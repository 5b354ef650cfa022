"""Clear errors for unsupported models, bad settings, impossible generations and runtime misuse (STYLE.md 2.6).

Settings errors are raised before capture (cheap); the generation errors use one capture of a tiny
llama shared by the module (each method is then a cheap apply over it). A misused runtime call raises
before it touches any state: the generation in progress goes on as if the call had not been made.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

import kvrewrite
from kvrewrite.errors import RewriteError
from tests.families import _cfg, tiny_model

CHUNK = 8


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def captured(llama):
    """One capture (batch 2, chunks of CHUNK) that every generation test of the module applies a method to."""
    from kvrewrite.capture import capture

    return capture(llama, batch_size=2, prefill_chunk=CHUNK)


def _prompt(batch, n, pad_rows=()):
    ids = torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for r in pad_rows:
        mask[r, :3] = 0
    return ids, mask


# -- unsupported models ------------------------------------------------------------------------------
def test_not_a_hf_model():
    with pytest.raises(ValueError, match=r"expected a Hugging Face causal LM, got Linear"):
        kvrewrite.apply(torch.nn.Linear(4, 4), "full")  # no max_length: must not read model.config first


def test_hf_base_model_without_lm_head():
    from transformers import LlamaModel

    with pytest.raises(ValueError, match=r"expected a Hugging Face causal LM, got LlamaModel"):
        kvrewrite.apply(LlamaModel(_cfg("llama")).eval(), "full", max_length=32, prefill_chunk=CHUNK)


def _sigmoid_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A softmax-free attention (sigmoid attention): nothing the passes can turn into SDPA."""
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    w = torch.sigmoid(query @ k.transpose(-1, -2) * scaling)
    if attention_mask is not None:
        w = w * (attention_mask > -1).to(w.dtype)
    return (w @ v).transpose(1, 2).contiguous(), None


def _sdpa_on_normalized_keys(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA over keys transformed after the cache read (L2-normalised): not a plain cache read."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, F.normalize(key, dim=-1), value, attention_mask,
                                  scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register("kvrewrite_test_sigmoid", _sigmoid_attention)
AttentionInterface.register("kvrewrite_test_normalized_keys", _sdpa_on_normalized_keys)


def test_attention_statistics_under_a_logit_soft_cap_are_refused():
    """H2O/SnapKV/KVMerger observe the softmax; Gemma-2's capped logits would make their scores wrong: refused by
    name."""
    model = tiny_model("gemma2-softcap-alternating")
    for method in ("h2o", "kvmerger"):
        with pytest.raises(RewriteError, match=rf"gemma2-3l .*layer 1: .*method '{method}' observes the attention "
                                               r"probabilities, but this layer caps its logits \(softcap=5\.0\)"):
            kvrewrite.apply(model, method, max_length=32, prefill_chunk=CHUNK)


def test_attention_without_sdpa_is_refused():
    model = tiny_model("llama", attn="kvrewrite_test_sigmoid")
    with pytest.raises(RewriteError) as e:
        kvrewrite.apply(model, "full", max_length=32, prefill_chunk=CHUNK)
    msg = str(e.value)
    assert "llama-2l" in msg and "found no attention site" in msg, msg
    assert "aten.matmul" in msg and "unsupported attention implementation" in msg, msg  # targets seen + hint


def test_sdpa_not_reading_the_cache_names_layer_and_node():
    model = tiny_model("llama", attn="kvrewrite_test_normalized_keys")
    with pytest.raises(RewriteError, match=r"llama-2l \(prefill graph\): layer 0: node 'scaled_dot_product_attention"
                                           r"[^']*' \(aten\.scaled_dot_product_attention\.default\): expected the key "
                                           r"to be read from a static cache buffer, "
                                           r"found 'div' \(call_function aten\.div\.Tensor\)"):
        kvrewrite.apply(model, "full", max_length=32, prefill_chunk=CHUNK)


# -- bad settings (raised before capture) ----------------------------------------------------------
@pytest.mark.parametrize("budget", [0, -0.1, 1.5, -3, "0.5", [16]],
                         ids=["zero", "negative", "above_one", "negative_int", "str", "list"])
@pytest.mark.parametrize("method,cls", [("chelsea", "ChelseaMethod"), ("streamingllm", "StreamingLLMMethod"),
                                        ("h2o", "H2OMethod"), ("snapkv", "SnapKVMethod"),
                                        ("kvmerger", "KVMergerMethod"), ("ems", "EMSMethod"),
                                        ("clustergen", "ClusterGenMethod"),
                                        ("clustergen-kcenter", "ClusterGenKCenterMethod")])
def test_budget_neither_fraction_nor_slots(llama, method, cls, budget):
    msg = (rf"{cls}\.budget must be a float in \(0, 1\] \(a fraction of n \+ max_new_tokens\) or an int >= 1 "
           rf"\(slots per KV head\), got {re.escape(repr(budget))}")
    with pytest.raises(ValueError, match=msg):
        kvrewrite.apply(llama, method, budget=budget)


def test_whole_float_budget_points_to_the_int(llama):
    with pytest.raises(ValueError, match=r"got 64\.0; for 64 slots pass the int 64"):
        kvrewrite.apply(llama, "h2o", budget=64.0)


BAD_SETTINGS = [
    (dict(method="full", budget=0.5), r"FullMethod keeps every token: budget must be 1\.0 \(the default\), got 0\.5"),
    (dict(method="full", budget=1), r"FullMethod keeps every token: budget must be 1\.0 .*got 1 \(an int counts slots"),
    (dict(method="chelsea", interval=0), r"ChelseaMethod\.interval must be an int >= 1, got 0"),
    (dict(method="chelsea", n_sink=-1), r"ChelseaMethod\.n_sink must be an int >= 0, got -1"),
    (dict(method="chelsea", n_recent=2.5), r"ChelseaMethod\.n_recent must be an int >= 0, got 2\.5"),
    (dict(method="chelsea", chunk=1), r"ChelseaMethod\.chunk must be an int >= 2, got 1"),
    (dict(method="chelsea", r_init=0.6), r"ChelseaMethod\.r_init must be in \(0, 0\.5\], got 0\.6"),
    (dict(method="chelsea", r_min=0), r"ChelseaMethod\.r_min must be in \(0, 0\.5\]"),
    (dict(method="streamingllm", n_sink=-2), r"StreamingLLMMethod\.n_sink must be an int >= 0, got -2"),
    # bool is an int subclass: True must not pass as budget 1.0, interval 1 or one sink token
    (dict(method="chelsea", budget=True), r"ChelseaMethod\.budget must be a number, not a bool, got True"),
    (dict(method="full", budget=True), r"FullMethod\.budget must be a number, not a bool, got True"),
    (dict(method="chelsea", interval=True), r"ChelseaMethod\.interval must be an int, not a bool, got True"),
    (dict(method="chelsea", n_sink=False), r"ChelseaMethod\.n_sink must be an int, not a bool, got False"),
    (dict(method="chelsea", r_alpha=True), r"ChelseaMethod\.r_alpha must be a number, not a bool, got True"),
    (dict(method="streamingllm", n_sink=True), r"StreamingLLMMethod\.n_sink must be an int, not a bool, got True"),
    (dict(method="kvmerger", hh_ratio=0.7), r"KVMergerMethod: recent_ratio \+ hh_ratio must be <= 1 .*0\.34 \+ "
                                            r"0\.7"),
    (dict(method="kvmerger", epsilon=1.5), r"KVMergerMethod\.epsilon must be a cosine threshold in \[-1, 1\), "
                                           r"got 1\.5"),
    (dict(method="kvmerger", reading="tree"), r"KVMergerMethod\.reading must be one of \('chain', 'anchor'\), "
                                              r"got 'tree'"),
    (dict(method="kvmerger", n_sink=True), r"KVMergerMethod\.n_sink must be an int, not a bool, got True"),
    (dict(method="chelsea", nonsense=1), r"bad option for method 'chelsea'.*nonsense"),
    (dict(method="full", batch_size=0), r"batch_size must be an int >= 1, got 0"),
    (dict(method="full", prefill_chunk=1), r"prefill_chunk must be an int >= 2, got 1"),
    (dict(method="full", max_length=0), r"max_length must be an int >= 1, got 0"),
]


@pytest.mark.parametrize("kwargs,match", BAD_SETTINGS,
                         ids=["-".join(f"{k}={v}" for k, v in kw.items()) for kw, _ in BAD_SETTINGS])
def test_bad_settings_name_the_field(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvrewrite.apply(llama, **kwargs)


def test_method_instance_and_options_are_exclusive(llama):
    from kvrewrite.methods import ChelseaMethod

    with pytest.raises(ValueError, match=r"give budget/method options in the Method instance, not both"):
        kvrewrite.apply(llama, ChelseaMethod(budget=0.3), budget=0.5)


def test_unknown_method_lists_the_known_ones(llama):
    with pytest.raises(ValueError, match=r"unknown method 'pyramidkv'; known methods: chelsea, clustergen, "
                                         r"clustergen-kcenter, clusterkv, ems, full, h2o, kvmerger, snapkv, "
                                         r"streamingllm"):
        kvrewrite.apply(llama, "pyramidkv")


def test_outlier_head_outside_the_model(llama):
    with pytest.raises(ValueError, match=r"ChelseaMethod\.outlier_heads: layer 0 has no KV heads \[5\]"):
        kvrewrite.apply(llama, "chelsea", outlier_heads={0: [5]}, max_length=32, prefill_chunk=CHUNK)


# -- generations that cannot run ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_rw(llama, captured):
    return kvrewrite.apply(llama, "full", max_length=32, captured=captured)


def test_prompt_beyond_capacity_mentions_max_length(full_rw):
    ids, mask = _prompt(2, 37)
    with pytest.raises(ValueError, match=r"prompt of 37 tokens \(padded to 40\) \+ max_new_tokens=4 exceeds the "
                                         r"capacity of layer 0 \(39 slots, max_length=32\); "
                                         r"apply\(\) with a larger max_length"):
        full_rw.generate(ids, attention_mask=mask, max_new_tokens=4)


def test_prompt_plus_new_tokens_beyond_max_length(llama, captured):
    rw = kvrewrite.apply(llama, "streamingllm", budget=0.5, n_sink=2, max_length=32, captured=captured)
    ids, mask = _prompt(2, 28)
    with pytest.raises(ValueError, match=r"prompt of 28 tokens \+ max_new_tokens=8 exceeds max_length=32; "
                                         r"apply\(\) with a larger max_length"):
        rw.generate(ids, attention_mask=mask, max_new_tokens=8)
    # StreamingLLM's own limit: B = round(0.5 * (4 + 1)) = 2 slots cannot hold 2 sinks and a recent window.
    ids, mask = _prompt(2, 4)
    with pytest.raises(ValueError, match=r"streamingllm: budget 0\.5 x \(n=4 \+ max_new_tokens=1\) = 2 slots cannot "
                                         r"hold the 2 sink tokens"):
        rw.generate(ids, attention_mask=mask, max_new_tokens=1)


def test_batch_size_mismatch_is_refused_before_the_state_is_touched(full_rw):
    """A wrong batch size (generate, prefill or decode_step) raises before the state is reset: the
    generation in progress (state, host schedule, positions) survives and goes on."""
    ids, mask = _prompt(2, 10, pad_rows=(1,))
    logits = full_rw.prefill(ids, mask, max_new_tokens=4)
    state = [t.clone() for t in full_rw.state_tensors()]
    schedule, fill = full_rw.schedule, [list(f) for f in full_rw.schedule.fill]
    pos, cpos = full_rw._next_position.clone(), full_rw._next_cache_position.clone()
    bad, bad_mask = _prompt(3, 10)
    msg = r"^llama-2l: captured for batch size 2, got input of batch 3$"
    with pytest.raises(ValueError, match=msg):
        full_rw.generate(bad, attention_mask=bad_mask, max_new_tokens=2)
    with pytest.raises(ValueError, match=msg):
        full_rw.prefill(bad, bad_mask, max_new_tokens=2)
    with pytest.raises(ValueError, match=msg):
        full_rw.decode_step(torch.zeros(3, dtype=torch.long))
    assert all(torch.equal(a, b) for a, b in zip(full_rw.state_tensors(), state)), "the state was modified"
    assert full_rw.schedule is schedule and full_rw.schedule.fill == fill
    assert torch.equal(full_rw._next_position, pos) and torch.equal(full_rw._next_cache_position, cpos)
    assert full_rw.decode_step(logits.argmax(-1)).shape == logits.shape


def test_step_length_must_be_one_or_a_chunk(full_rw):
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"a step takes 1 or prefill_chunk=8 tokens, got 5"):
        full_rw(ids, ids, torch.arange(5), torch.ones(2, 5, dtype=torch.bool))


def test_right_padding_is_refused(full_rw):
    ids, mask = _prompt(2, 10)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match=r"right padding is not supported; left-pad the batch"):
        full_rw.generate(ids, attention_mask=mask, max_new_tokens=2)


def test_chelsea_budget_too_small_for_sinks_and_recent(llama, captured):
    rw = kvrewrite.apply(llama, "chelsea", budget=0.2, max_length=64, captured=captured)
    ids, mask = _prompt(2, 20, pad_rows=(1,))
    # B = round(0.2 * (20 + 10)) = 6 slots; the paper's defaults protect 16 sinks + 64 recent.
    with pytest.raises(ValueError, match=r"chelsea: budget 0\.2 x \(n=20 \+ max_new_tokens=10\) = 6 slots cannot hold "
                                         r"the 16 sink \+ 64 recent tokens plus a compressible middle"):
        rw.generate(ids, attention_mask=mask, max_new_tokens=10)


# -- runtime misuse: refused before any state is touched (nothing is lost) ---------------------------
NEW = 3  # max_new_tokens of the generation in progress


@pytest.fixture(scope="module")
def loaded(full_rw):
    """full_rw's step graphs behind kvrewrite.export.loader.ExportedModel, with its own state: the loader's
    host side (HostGeneration) is what is tested, so nothing is exported."""
    from kvrewrite.export.common import GRAPHS, graph_of, metadata
    from kvrewrite.export.loader import ExportedModel

    def step(graph):
        return lambda ids, pos, cpos, valid, state: graph(ids, pos, cpos, valid, *state)

    return ExportedModel(metadata(full_rw, "torch_export", {}), {n: step(graph_of(full_rw, n)) for n in GRAPHS})


@pytest.fixture(scope="module")
def reference(full_rw):
    """An uninterrupted greedy generation: the prompt, and the logits of its prefill and NEW decode steps
    (with one thread, as the tests run: the same summation order, so the same bits)."""
    ids, mask = _prompt(2, 10, pad_rows=(1,))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits = [full_rw.prefill(ids, mask, max_new_tokens=NEW)]
        for _ in range(NEW):
            logits.append(full_rw.decode_step(logits[-1].argmax(-1)))
    finally:
        torch.set_num_threads(threads)
    return ids, mask, logits


@pytest.fixture(params=["rw", "loader"])
def model(request, full_rw, loaded):
    return full_rw if request.param == "rw" else loaded


def _frozen(m) -> dict:
    """What a refused call must leave as it was: state, host schedule, positions and decode steps."""
    return {"state": [t.clone() for info in m.layers for t in m.layer_state(info.index).values()],
            "positions": [m._next_position.clone(), m._next_cache_position.clone()],
            "host": ([list(f) for f in m.schedule.fill], m._decode_steps, m._decode_limit)}


def _assert_unchanged(m, before: dict) -> None:
    after = _frozen(m)
    assert all(torch.equal(a, b) for a, b in zip(after["state"], before["state"])), "the state was modified"
    assert all(torch.equal(a, b) for a, b in zip(after["positions"], before["positions"])), "the positions moved"
    assert after["host"] == before["host"], "the host schedule or the decode step count moved"


def _generates_the_reference(m, reference) -> None:
    ids, mask, logits = reference
    tokens = torch.stack([l.argmax(-1) for l in logits], dim=1)
    assert torch.equal(m.generate(ids, mask, max_new_tokens=NEW + 1, eos_token_id=[]), torch.cat([ids, tokens], 1))


MISUSE = {  # call(m, ids, mask, next_tokens) on a generation in progress, what the ValueError says
    "1d-input_ids": (lambda m, ids, mask, tok: m.generate(ids[0], max_new_tokens=2),
                     r"llama-2l: input_ids must be \[B, n\] \(a batch of prompts\), got shape \(10,\); "
                     r"for one prompt pass input_ids\[None\]"),
    "1d-input_ids-prefill": (lambda m, ids, mask, tok: m.prefill(ids[0], max_new_tokens=2),
                             r"input_ids must be \[B, n\] .*input_ids\[None\]"),
    "empty-prompt": (lambda m, ids, mask, tok: m.generate(ids[:, :0], max_new_tokens=2),
                     r"input_ids has no tokens \(shape \(2, 0\)\)"),
    "float-input_ids": (lambda m, ids, mask, tok: m.generate(ids.float(), max_new_tokens=2),
                        r"input_ids must hold integer token ids, got dtype torch\.float32"),
    "mask-shape": (lambda m, ids, mask, tok: m.generate(ids, mask[:, 1:], max_new_tokens=2),
                   r"attention_mask must be \[B, n\] = \(2, 10\) like input_ids, got \(2, 9\)"),
    "all-zero-mask-row": (lambda m, ids, mask, tok: m.generate(ids, mask * torch.tensor([[1], [0]]), max_new_tokens=2),
                          r"llama-2l: row 1 of attention_mask has no real token \(all zeros\)"),
    "float-max_new_tokens": (lambda m, ids, mask, tok: m.generate(ids, mask, max_new_tokens=2.5),
                             r"llama-2l: max_new_tokens must be an int >= 1, got 2\.5"),
    "bool-max_new_tokens": (lambda m, ids, mask, tok: m.generate(ids, mask, max_new_tokens=True),
                            r"max_new_tokens must be an int >= 1, got True"),
    "zero-max_new_tokens": (lambda m, ids, mask, tok: m.generate(ids, mask, max_new_tokens=0),
                            r"max_new_tokens must be an int >= 1, got 0"),
    "float-max_new_tokens-prefill": (lambda m, ids, mask, tok: m.prefill(ids, mask, max_new_tokens=2.5),
                                     r"max_new_tokens must be an int >= 0, got 2\.5"),
    "2d-tokens": (lambda m, ids, mask, tok: m.decode_step(tok[:, None]),
                  r"llama-2l: decode_step: tokens must be \[B\] \(one token id per row\), got \(2, 1\); "
                  r"pass tokens\[:, 0\]"),
}


@pytest.mark.parametrize("case", MISUSE)
def test_misuse_is_refused_and_nothing_is_lost(model, reference, case):
    """Mid-generation, a misused call raises a ValueError saying what is wrong; the generation then goes on
    exactly as the uninterrupted one, and a new one generates the same tokens (rw and loaded model alike)."""
    call, match = MISUSE[case]
    ids, mask, logits = reference
    model.prefill(ids, mask, max_new_tokens=NEW)
    torch.testing.assert_close(model.decode_step(logits[0].argmax(-1)), logits[1], rtol=0, atol=0)
    before = _frozen(model)
    with pytest.raises(ValueError, match=match):
        call(model, ids, mask, logits[1].argmax(-1))
    _assert_unchanged(model, before)
    for k in range(2, NEW + 1):
        torch.testing.assert_close(model.decode_step(logits[k - 1].argmax(-1)), logits[k], rtol=0, atol=0)
    _generates_the_reference(model, reference)


def test_decode_step_past_max_new_tokens(model, reference):
    """prefill(max_new_tokens=N) sizes the generation for N decode steps: step N + 1 is refused before it runs
    (full: it would run on past the declared length and, further on, index past the state)."""
    ids, mask, logits = reference
    model.prefill(ids, mask, max_new_tokens=NEW)
    for k in range(1, NEW + 1):
        model.decode_step(logits[k - 1].argmax(-1))
    before = _frozen(model)
    with pytest.raises(ValueError, match=rf"^llama-2l: decode_step: this generation was prefilled for max_new_tokens="
                                         rf"{NEW}; step {NEW + 1} would go past the prompt \+ {NEW} tokens its state "
                                         rf"was sized for \(max_length=32\); call prefill\(\.\.\., "
                                         rf"max_new_tokens={NEW + 1} or more\)$"):
        model.decode_step(logits[NEW].argmax(-1))
    _assert_unchanged(model, before)
    _generates_the_reference(model, reference)


@pytest.mark.parametrize("target", ["rw", "loader"])
def test_decode_step_before_prefill(llama, captured, full_rw, loaded, reference, target):
    from kvrewrite.export.common import metadata
    from kvrewrite.export.loader import ExportedModel

    if target == "rw":
        fresh = kvrewrite.apply(llama, "full", max_length=32, captured=captured)
    else:
        fresh = ExportedModel(metadata(full_rw, "torch_export", {}), loaded.steps)
    with pytest.raises(ValueError, match=r"^llama-2l: decode_step: no generation in progress; "
                                         r"call prefill \(or generate\) first$"):
        fresh.decode_step(torch.zeros(2, dtype=torch.long))
    _generates_the_reference(fresh, reference)


def test_decode_step_past_the_capacity_of_a_layer(loaded, reference):
    """The host mirror of the fills is checked too: a step that would write past a layer's capacity is refused
    before it is launched (reachable only through a state filled by hand; the step count refuses first)."""
    ids, mask, logits = reference
    loaded.prefill(ids, mask, max_new_tokens=NEW)
    cap = loaded.capacities[1]
    loaded.schedule.fill[1] = [cap - 1, cap]  # as if row 1 of layer 1 were full
    with pytest.raises(ValueError, match=rf"^llama-2l: decode_step: layer 1 holds {cap} slots and a row already uses "
                                         rf"{cap}; step 1 would write past its capacity"):
        loaded.decode_step(logits[0].argmax(-1))
    _generates_the_reference(loaded, reference)


def test_chelsea_decode_step_past_max_length(llama, captured):
    """A compressing method never runs out of slots, but step N + 1 would run past max_length (and the budget
    set for n + N tokens): refused like the full method's, and the next generation is unaffected."""
    rw = kvrewrite.apply(llama, "chelsea", budget=0.5, n_sink=1, n_recent=2, chunk=4, interval=2, max_length=32,
                         captured=captured)
    ids, mask = _prompt(2, 32 - NEW, pad_rows=(1,))  # prompt + NEW == max_length
    expected = rw.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])
    logits = rw.prefill(ids, mask, max_new_tokens=NEW)
    for _ in range(NEW):
        logits = rw.decode_step(logits.argmax(-1))
    with pytest.raises(ValueError, match=rf"prefilled for max_new_tokens={NEW}; step {NEW + 1} would go past .*"
                                         rf"\(max_length=32\)"):
        rw.decode_step(logits.argmax(-1))
    assert torch.equal(rw.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[]), expected)
