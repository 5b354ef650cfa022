"""`rw.generate` speaks Hugging Face (kvrewrite/generation.py): for `full` its tokens, scores and logits equal
`model.generate`'s (greedy on every family; seeded sampling and HF's processors on llama and gemma3), streamers
see the returned text, every setting it cannot honour is refused by name before any state is touched, and a
compressed method (chelsea) takes the same arguments.

Tiny random models (tests/families.py), batch 2 with left padding (row 1: 3 pad tokens), a 12-token prompt in
chunks of 8, a few new tokens. Both sides compute in fp32 in a different order: scores agree to 1e-5, and a seeded
multinomial draws the same tokens.
"""
import functools
import threading

import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessor, MaxLengthCriteria,
                          StoppingCriteria, TextIteratorStreamer, TextStreamer)

import kvrewrite
from tests.families import FAMILIES, tiny_model, tiny_tokenizer

N, CHUNK, MAX_LENGTH, ATOL = 12, 8, 40, 1e-5


@functools.cache
def _built(family: str, batch: int = 2):
    """(model, rw full) per family and batch size, built once for the module (apply dominates the file's time)."""
    model = tiny_model(family)
    model.generation_config.pad_token_id = 0
    return model, kvrewrite.apply(model, "full", max_length=MAX_LENGTH, batch_size=batch, prefill_chunk=CHUNK)


def _prompt(batch=2):
    ids = torch.randint(3, 128, (batch, N), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :3] = 0
        ids[1, :3] = 0
    return ids, mask


def _both(model, rw, ids, mask, seed=7, **kw):
    """rw.generate and model.generate with the same arguments, each from the same global RNG seed."""
    kw = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, **kw)
    torch.manual_seed(seed)
    ours = rw.generate(ids, mask, **kw)
    torch.manual_seed(seed)
    theirs = model.generate(ids, attention_mask=mask, **kw)
    return ours, theirs


def _assert_same(ours, theirs):
    assert torch.equal(ours.sequences, theirs.sequences), f"{ours.sequences[:, N:]} vs {theirs.sequences[:, N:]}"
    for name in ("scores", "logits"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert len(a) == len(b) == ours.sequences.shape[1] - N
        for step, (x, y) in enumerate(zip(a, b)):
            assert x.dtype == y.dtype == torch.float32
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0, msg=lambda m: f"{name} of step {step}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_seeded_sampling_match_hf(family):
    """The model's own generation config (EOS 2 for most families, pad 0): tokens, scores and raw logits, greedy and
    sampled from the same seed (temperature, top-k, top-p)."""
    model, rw = _built(family)
    ids, mask = _prompt()
    _assert_same(*_both(model, rw, ids, mask, max_new_tokens=6))
    _assert_same(*_both(model, rw, ids, mask, seed=11, max_new_tokens=6, do_sample=True, temperature=1.5, top_k=40,
                        top_p=0.95))


class _BanBelow(LogitsProcessor):
    """A user processor: no token below `floor` (it reads input_ids too: bans repeating the last token)."""

    def __init__(self, floor):
        self.floor = floor

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, : self.floor] = -float("inf")
        return scores.scatter(1, input_ids[:, -1:], -float("inf"))


class _StopOn(StoppingCriteria):
    """A user criterion: a row is done once it generated `token` (no pad: HF pads only after an EOS criterion)."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _greedy_tokens(model, ids, mask, k):
    return model.generate(ids, attention_mask=mask, max_new_tokens=k, eos_token_id=None)[:, N:]


SAMPLING = {  # name: family, generate kwargs (a callable of the greedy tokens when they depend on them)
    "sample-temperature-top_k-top_p": ("llama", dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
                                                     max_new_tokens=6)),
    "sample-min_p-repetition_penalty": ("llama", dict(do_sample=True, min_p=0.05, repetition_penalty=1.3,
                                                      max_new_tokens=6)),
    "sample-gemma3-window": ("gemma3", dict(do_sample=True, temperature=1.3, top_p=0.8, max_new_tokens=10)),
    "generation_config": ("llama", dict(generation_config=GenerationConfig(do_sample=True, top_k=5, max_new_tokens=5,
                                                                          eos_token_id=[2, 3], pad_token_id=0))),
    "eos-list": ("llama", lambda g: dict(eos_token_id=[int(g[0, 1]), int(g[1, 2])], pad_token_id=0,
                                         max_new_tokens=6)),
    "max_length": ("llama", dict(max_length=N + 5, eos_token_id=None)),
    "min_new_tokens": ("llama", lambda g: dict(eos_token_id=int(g[0, 0]), min_new_tokens=3, max_new_tokens=5)),
    "processors": ("llama", dict(no_repeat_ngram_size=2, bad_words_ids=[[5], [7, 8]], suppress_tokens=[9],
                                 sequence_bias={(11,): 4.0}, max_new_tokens=6)),
    "prefix_allowed_tokens_fn": ("llama", dict(prefix_allowed_tokens_fn=lambda row, ids: list(range(20 + row, 60, 3)),
                                               max_new_tokens=5)),
    "custom-max-length-criterion": ("llama", dict(stopping_criteria=[MaxLengthCriteria(max_length=N + 3)],
                                                  eos_token_id=None, max_new_tokens=6)),
    "custom-processor-and-criterion": ("llama", lambda g: dict(logits_processor=[_BanBelow(20)],
                                                               stopping_criteria=[_StopOn(int(g[0, 2]))],
                                                               eos_token_id=None, max_new_tokens=6)),
}


@pytest.mark.parametrize("case", SAMPLING)
def test_settings_match_hf(case):
    family, kw = SAMPLING[case]
    model, rw = _built(family)
    ids, mask = _prompt()
    if callable(kw):
        kw = kw(_greedy_tokens(model, ids, mask, 6))
    _assert_same(*_both(model, rw, ids, mask, **kw))


def test_num_return_sequences_repeats_rows_like_hf():
    """num_return_sequences=2 on one prompt fills the batch of 2 (HF's row expansion); more rows are refused."""
    model, rw = _built("llama")
    ids, mask = _prompt(1)
    _assert_same(*_both(model, rw, ids, mask, do_sample=True, num_return_sequences=2, max_new_tokens=5))
    with pytest.raises(ValueError, match=r"num_return_sequences=2 .* 4 rows, but the model was captured for batch "
                                         r"size 2"):
        rw.generate(*_prompt(2), do_sample=True, num_return_sequences=2, max_new_tokens=2)


def test_plain_tensor_by_default_and_hf_length_defaults():
    """Without return_dict_in_generate: the sequences tensor; without a length: HF's 20 new tokens."""
    model, rw = _built("llama")
    ids, mask = _prompt()
    out = rw.generate(ids, mask, eos_token_id=[])
    assert isinstance(out, torch.Tensor) and out.shape == (2, N + 20)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, eos_token_id=None))


# -- streamers -----------------------------------------------------------------------------------------------
@functools.cache
def _single():
    """(model, full, chelsea) at batch 1, over one capture."""
    from kvrewrite.capture import capture

    model = tiny_model("llama")
    model.generation_config.pad_token_id = 0
    cap = capture(model, batch_size=1, prefill_chunk=CHUNK)
    full = kvrewrite.apply(model, "full", max_length=MAX_LENGTH, captured=cap)
    chelsea = kvrewrite.apply(model, "chelsea", budget=0.5, n_sink=1, n_recent=2, chunk=4, interval=2,
                              max_length=MAX_LENGTH, captured=cap)
    return model, full, chelsea


@pytest.mark.parametrize("skip_prompt", [False, True])
def test_text_streamer_prints_the_returned_text(skip_prompt, capsys):
    model, rw, _ = _single()
    tok = tiny_tokenizer()
    ids, _ = _prompt(1)
    out = rw.generate(ids, streamer=TextStreamer(tok, skip_prompt=skip_prompt), max_new_tokens=6, eos_token_id=[])
    shown = out[0, N:] if skip_prompt else out[0]
    assert capsys.readouterr().out == tok.decode(shown) + "\n"


@pytest.mark.parametrize("method", ["full", "chelsea"])
def test_text_iterator_streamer_yields_the_returned_text(method):
    model, full, chelsea = _single()
    rw = full if method == "full" else chelsea
    tok = tiny_tokenizer()
    ids, _ = _prompt(1)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=rw.generate(
        ids, streamer=streamer, do_sample=True, top_k=10, max_new_tokens=8, eos_token_id=[])))
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text == tok.decode(result["out"][0, N:]) and len(text.split()) == 8


# -- a compressed method -------------------------------------------------------------------------------------
def test_chelsea_takes_the_same_arguments():
    """chelsea (budget 0.5, re-compressing every 2 steps) with HF's processors: seeded sampling is reproducible,
    banned words never appear, stopping works, and the scores are the processed ones (-inf where banned)."""
    _, _, rw = _single()
    ids, _ = _prompt(1)
    kw = dict(do_sample=True, temperature=0.8, top_k=10, top_p=0.95, min_p=0.01, repetition_penalty=1.2,
              no_repeat_ngram_size=2, bad_words_ids=[[5]], eos_token_id=[], max_length=N + 10,
              return_dict_in_generate=True, output_scores=True, output_logits=True)
    a = rw.generate(ids, generator=torch.Generator().manual_seed(3), **kw)
    b = rw.generate(ids, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a.sequences, b.sequences) and a.sequences.shape == (1, N + 10)
    new = a.sequences[0, N:]
    assert 5 not in new.tolist()
    for step, (s, raw, t) in enumerate(zip(a.scores, a.logits, new)):
        assert s[0, 5] == -float("inf") and torch.isfinite(s[0, t]) and torch.isfinite(raw).all(), step
        assert int((s[0] > -float("inf")).sum()) <= 10, "top_k=10 keeps at most 10 tokens"
    greedy = rw.generate(ids, max_new_tokens=6, eos_token_id=[], return_dict_in_generate=True, output_scores=True)
    assert all(int(s.argmax()) == int(t) for s, t in zip(greedy.scores, greedy.sequences[0, N:]))
    stop = int(greedy.sequences[0, N + 1])
    stopped = rw.generate(ids, max_new_tokens=6, eos_token_id=stop)
    assert torch.equal(stopped, greedy.sequences[:, : N + 2]), "EOS ends the generation of the only row"


# -- refusals -----------------------------------------------------------------------------------------------
REFUSED = {  # kwargs: a fragment the error must contain (the argument's name, and for beams what is wrong)
    "num_beams": (dict(num_beams=2), r"num_beams=2 \(beam search is not supported"),
    "num_return_sequences": (dict(num_return_sequences=3, do_sample=True), r"num_return_sequences=3"),
    "assistant_model": (dict(assistant_model=torch.nn.Linear(1, 1)), r"assistant_model \(assisted"),
    "penalty_alpha": (dict(penalty_alpha=0.6, top_k=4), r"penalty_alpha=0\.6 \(contrastive search"),
    "force_words_ids": (dict(force_words_ids=[[5]]), r"force_words_ids"),
    "output_attentions": (dict(output_attentions=True), r"output_attentions=True"),
    "output_hidden_states": (dict(output_hidden_states=True), r"output_hidden_states=True"),
    "use_cache": (dict(use_cache=False), r"use_cache=False"),
    "guidance_scale": (dict(guidance_scale=2.0), r"guidance_scale=2\.0"),
    "dola_layers": (dict(dola_layers="low"), r"dola_layers='low'"),
    "prompt_lookup_num_tokens": (dict(prompt_lookup_num_tokens=3), r"prompt_lookup_num_tokens=3"),
    "token_healing": (dict(token_healing=True), r"token_healing=True"),
    "cache_implementation": (dict(cache_implementation="static"), r"cache_implementation='static'"),
    "negative_prompt_ids": (dict(negative_prompt_ids=torch.zeros(2, 1, dtype=torch.long)), r"negative_prompt_ids"),
    "inputs_embeds": (dict(inputs_embeds=torch.zeros(2, N, 64)), r"inputs_embeds"),
    "unknown": (dict(temprature=0.5), r"unknown or unsupported argument\(s\) \['temprature'\]"),
    "max_new_tokens": (dict(max_new_tokens=0), r"max_new_tokens must be an int >= 1, got 0"),
    "max_length": (dict(max_length=N), r"Input length of input_ids is 12, but `max_length` is set to 12"),
    "context": (dict(context=object()), r"context="),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_by_name_before_any_state_is_touched(case):
    kw, match = REFUSED[case]
    model, rw = _built("llama")
    ids, mask = _prompt()
    if case == "context" and hasattr(rw, "_start_from_context"):
        pytest.skip("compressed contexts are supported in this build")
    rw.prefill(ids, mask, max_new_tokens=4)
    before = [t.clone() for info in rw.layers for t in rw.layer_state(info.index).values()]
    steps, position = rw._decode_steps, rw._next_position.clone()
    with pytest.raises(ValueError, match=match):
        rw.generate(ids, mask, **kw)
    after = [t for info in rw.layers for t in rw.layer_state(info.index).values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "the state was modified"
    assert rw._decode_steps == steps and torch.equal(rw._next_position, position)
