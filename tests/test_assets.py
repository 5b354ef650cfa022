"""Tests for kvrewrite.assets: cache location, name checks, and (real_model) real downloads."""

from pathlib import Path

import pytest
import torch

from kvrewrite import assets


def test_cache_dir_prefers_kvrewrite_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path / "kv"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "kv"
    assert (tmp_path / "kv").is_dir()


def test_cache_dir_falls_back_to_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("KVREWRITE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "xdg" / "kvrewrite"
    assert assets.cache_dir().is_dir()


def test_cache_dir_falls_back_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv("KVREWRITE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert assets.cache_dir() == tmp_path / ".cache" / "kvrewrite"
    assert assets.cache_dir().is_dir()


def test_registry_entries_are_consistent():
    for name, spec in assets.MODELS.items():
        assert spec.name == name and spec.requirements and spec.context_length > 0
        assert all("==" in req for req in spec.requirements), "pin exact versions"
    for name, spec in assets.TEXTS.items():
        assert spec.name == name and "==" in spec.requirement


def test_unknown_model_lists_known_names(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no-such-model") as err:
        assets.load_model("no-such-model")
    for name in assets.MODELS:
        assert name in str(err.value)


def test_unknown_text_lists_known_names():
    with pytest.raises(ValueError, match="no_such_text") as err:
        assets.load_text("no_such_text")
    for name in assets.TEXTS:
        assert name in str(err.value)


@pytest.mark.real_model
def test_smollm2_answers_paris():
    model, tokenizer = assets.load_model("smollm2-135m")
    assert not model.training and model.dtype == torch.float32
    assert tokenizer.eos_token == "<|im_end|>"
    assert Path(assets.cache_dir(), "models", "smollm2-135m", "hf", "config.json").is_file()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.real_model
def test_paul_graham_text():
    text = assets.load_text("paul_graham")
    assert len(text) > 100_000
    assert "What hard liquor, cigarettes, heroin, and crack have in common" in text
    assert assets.load_text("paul_graham") == text  # served from the cache, unchanged
