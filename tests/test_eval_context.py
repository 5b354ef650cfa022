"""`kvrewrite eval --mode context`: the needle haystack compressed alone, the question and answer on that cache.

A tiny random model with the character tokenizer of tests/test_eval.py, through the CLI: the mode's file sits next
to the whole-prompt mode's, records its mode, and the report shows both.
"""
import json

import pytest

from kvrewrite.cli import main
from kvrewrite.eval import EvalConfig
from kvrewrite.eval import grid as grid_mod
from kvrewrite.eval.needle import build_prompt, split_prompt
from tests.families import tiny_model
from tests.test_eval import CharTokenizer, synthetic_text


@pytest.fixture
def tiny_cli(monkeypatch, tmp_path):
    monkeypatch.setattr(grid_mod, "check_model", lambda name: None)
    monkeypatch.setattr(grid_mod, "load_model", lambda name: (tiny_model("llama"), CharTokenizer()))
    monkeypatch.setattr(grid_mod, "load_text", synthetic_text)
    out = tmp_path / "out"

    def run(*argv):
        return main(["eval", "--model", "tiny", "--methods", "streamingllm,h2o", "--budgets", "0.5",
                     "--context-lengths", "96", "--depths", "0.5", "--answer-tokens", "5", "--prefill-chunk", "16",
                     "--out", str(out), "--docs", str(tmp_path / "results.md"), "--no-progress", *argv])
    return run, out, tmp_path / "results.md"


def test_context_mode_end_to_end(tiny_cli):
    run, out, page = tiny_cli
    assert run("--task", "needle") == 0
    assert run("--mode", "context") == 0  # needle is the mode's default task
    whole = json.loads((out / "tiny" / "needle.json").read_text())
    ctx = json.loads((out / "tiny" / "needle-context.json").read_text())
    assert ctx["settings"]["mode"] == "context" and whole["settings"]["mode"] == "whole"
    assert ctx["settings"]["prefill"] == "context alone, own, chunks of 16"
    runs = {r["method"]: r for r in ctx["runs"]}
    assert set(runs) == {"full", "streamingllm", "h2o"}
    assert all(r["status"] == "ok" and r["prefill"] == "context" for r in runs.values()), ctx["runs"]
    # full keeps everything: the context mode answers what the whole prompt does (same ids, char tokenizer)
    full_whole = next(r for r in whole["runs"] if r["method"] == "full")
    assert runs["full"]["metrics"]["answer"] == full_whole["metrics"]["answer"]
    assert runs["full"]["prompt_tokens"] == full_whole["prompt_tokens"]
    # the compressed methods hold at most B + g - 1 slots after the question's chunk (B = 0.5 x the context's
    # tokens, g = 32), well under the prompt
    n_ctx = ctx["contexts"][0]["prompt_tokens"] - len(split_prompt(CharTokenizer(), "x")[1][0])
    for m in ("streamingllm", "h2o"):
        assert runs[m]["kv_slots"] <= round(0.5 * n_ctx) + 31 < runs["full"]["kv_slots"], (m, runs[m]["kv_slots"])
    text = page.read_text()
    assert "### needle\n" in text and "### needle-context\n" in text and "**Context mode**" in text
    assert "mode context;" in text


def test_split_prompt_is_the_prompt_cut_at_the_context():
    tok = CharTokenizer()
    c, q = split_prompt(tok, "some haystack. The secret is here.")
    whole = build_prompt(tok, "some haystack. The secret is here.")
    assert c.shape[1] == len("some haystack. The secret is here.\n\n")  # the blank line goes with the context
    assert whole[0].tolist() == c[0].tolist() + q[0].tolist()


def test_context_mode_is_for_the_needle_task_only():
    with pytest.raises(ValueError, match=r"mode 'context' is for the task\(s\) needle; nll, fidelity run on the "
                                         r"whole prompt"):
        EvalConfig(mode="context", tasks=("nll", "needle", "fidelity")).validate()
    with pytest.raises(ValueError, match="mode must be one of whole, context, got 'question'"):
        EvalConfig(mode="question", tasks=("needle",)).validate()
