"""kvrewrite.verify, `kvrewrite check` and apply's verification of model types outside the tested matrix.

Tiny random models (tests/families.py), prefill chunks of 16 so the synthetic prompt stays short: each test
takes a few seconds on the CPU. A broken rewrite is made by editing the layer facts capture returns (a
sliding layer's window set to 0: that layer then attends to the whole prefix), and must be reported at
that layer, not before it.
"""
import dataclasses
import importlib
import logging

import pytest
import torch
import transformers as tf

import kvrewrite
from kvrewrite.capture import SUPPORTED_MODELS
from kvrewrite.cli import main as cli_main
from kvrewrite.errors import RewriteError
from tests.families import COMMON, FAMILIES, MATRIX, _cfg, matrix_case, matrix_model, tiny_model

from kvrewrite import verification as verify_module
CHUNK = 16
UNTESTED = "helium"  # a model type outside the matrix that captures and matches HF on the CPU


def _untested_model(seed=0):
    torch.manual_seed(seed)
    cfg = tf.HeliumConfig(num_hidden_layers=2, **COMMON)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _break_window(monkeypatch, layer: int):
    """Make verify's capture report window 0 (full attention) for `layer`: the rewrite then ignores its window."""
    real = verify_module.capture

    def broken(*args, **kwargs):
        captured = real(*args, **kwargs)
        captured.layers[layer] = dataclasses.replace(captured.layers[layer], window=0)
        return captured

    monkeypatch.setattr(verify_module, "capture", broken)


def test_supported_models_is_the_matrix():
    """SUPPORTED_MODELS (what apply trusts without verifying) is exactly the model types the matrix checks."""
    matching = {_cfg(f).model_type for f in FAMILIES}
    matching |= {matrix_case(c)[0]().model_type for c in MATRIX if matrix_case(c)[2] is None}
    assert set(SUPPORTED_MODELS) == matching
    assert UNTESTED not in SUPPORTED_MODELS


@pytest.mark.parametrize("case, copy", [("llama", True), ("gemma3", False), ("gpt2", False)])
def test_verify_passes_with_one_entry_per_layer(case, copy):
    """llama: the default reduced copy; gemma3: sliding + full layers, real model; gpt2: layers at transformer.h.<i>."""
    model = tiny_model(case) if case in FAMILIES else matrix_model(case)[0]
    report = kvrewrite.verify(model, copy=copy, prefill_chunk=CHUNK)
    assert report.ok, str(report)
    assert [d.index for d in report.layers] == list(range(model.config.num_hidden_layers))
    assert report.tokens_equal and report.first_mismatch is None
    assert (report.copy is not None) == copy
    if case == "gemma3":
        assert report.windows_crossed == (8,) and [d.window for d in report.layers] == [8, 8, 0]
        assert report.prompt_tokens - 7 + report.new_tokens > 8 + 32  # the padded row runs past an eviction too
    assert "PASS" in str(report) and "logits" in str(report)


def test_broken_window_is_reported_at_its_layer(monkeypatch):
    """Gemma-3 layers 0, 1 slide (window 8), layer 2 is full; layer 1 rewritten without its window."""
    _break_window(monkeypatch, 1)
    report = kvrewrite.verify(tiny_model("gemma3"), copy=False, prefill_chunk=CHUNK)
    assert not report.ok
    assert report.first_mismatch == 1, str(report)
    assert report.layers[0].ok and report.layers[0].max_diff < 1e-5
    assert report.layers[1].max_diff > 100 * report.layers[1].bound  # far out, not a rounding call
    assert "FAIL: first mismatching layer 1" in str(report)


def test_reduced_copy_rule():
    """Gemma-3's 5:1 sliding/full pattern keeps 6 layers; a Llama-3.1-8B shape keeps 2 layers, head_dim and the
    4 query heads per KV head, with 2 KV heads; nothing of the original is allocated (meta device)."""
    with torch.device("meta"):
        gemma = tf.AutoModelForCausalLM.from_config(tf.Gemma3TextConfig(
            num_hidden_layers=26, hidden_size=1152, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
            intermediate_size=6912, vocab_size=262144, sliding_window=512))
        llama = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
            num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=14336, vocab_size=128256, bos_token_id=128000, eos_token_id=128001))
    copy, note, _ = verify_module.reduced_copy(gemma)
    c = copy.config
    assert c.num_hidden_layers == 6 and c.layer_types == gemma.config.layer_types[:6], note
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window) == (4, 1, 256, 512)
    copy, note, facts = verify_module.reduced_copy(llama)
    c = copy.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2, 8, 2, 128), note
    assert (c.hidden_size, c.vocab_size, c.eos_token_id) == (1024, 512, None)
    assert c.rope_parameters == llama.config.rope_parameters and facts[0] == (8, 2, 128, None)


def test_cli_check_exit_codes(tmp_path, monkeypatch, capsys):
    """0 on a saved tiny model, 1 when the rewrite is broken, 2 on a folder that is not a model."""
    tiny_model("gemma3").save_pretrained(tmp_path / "gemma3")
    args = ["check", str(tmp_path / "gemma3"), "--prefill-chunk", str(CHUNK), "--no-progress"]
    assert cli_main(args) == 0
    assert "PASS" in capsys.readouterr().out
    _break_window(monkeypatch, 0)
    assert cli_main(args) == 1
    assert "FAIL: first mismatching layer 0" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert cli_main(["check", str(tmp_path / "empty")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_apply_verifies_an_untested_type(monkeypatch, caplog):
    """An untested type is verified (INFO on a pass), verify=False logs that it is untrusted, a tested type is
    not verified at all (apply costs what it did), and a mismatch is a RewriteError holding the report."""
    monkeypatch.setattr(verify_module, "_auto_reports", {})
    with caplog.at_level(logging.INFO, logger="kvrewrite.verification"):
        kvrewrite.apply(_untested_model(), "full", max_length=64, batch_size=2, prefill_chunk=CHUNK)
    assert f"model type '{UNTESTED}' verified on a reduced copy" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvrewrite.verification"):
        kvrewrite.apply(_untested_model(), "full", max_length=64, batch_size=2, prefill_chunk=CHUNK, verify=False)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "untrusted" in caplog.text

    def no_verify(*args, **kwargs):
        raise AssertionError("a tested model type was verified")

    monkeypatch.setattr(verify_module, "verify", no_verify)
    kvrewrite.apply(tiny_model("llama"), "full", max_length=64, batch_size=2, prefill_chunk=CHUNK)
    with pytest.raises(ValueError, match="verify must be"):
        kvrewrite.apply(tiny_model("llama"), "full", verify="always")


def test_apply_refuses_an_untested_type_that_mismatches(monkeypatch):
    """A window HF's helium does not have (layer 1 given window 8 by a broken capture): apply raises with the table."""
    monkeypatch.setattr(verify_module, "_auto_reports", {})
    real = verify_module.capture

    def windowed(*args, **kwargs):
        captured = real(*args, **kwargs)
        captured.layers[1] = dataclasses.replace(captured.layers[1], window=8)
        return captured

    monkeypatch.setattr(verify_module, "capture", windowed)
    monkeypatch.setattr(importlib.import_module("kvrewrite.capture"), "capture", windowed)
    with pytest.raises(RewriteError, match=f"'{UNTESTED}' does not match HF") as e:
        kvrewrite.apply(_untested_model(), "full", max_length=64, batch_size=2, prefill_chunk=CHUNK)
    assert "FAIL: first mismatching layer 1" in str(e.value)
