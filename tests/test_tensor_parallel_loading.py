"""tensor_parallel_loading.load_rank_model: the rank's share read from a safetensors checkpoint equals rank_model's
share of the whole model (every parameter and buffer bit for bit, ties kept: a split tied lm_head views the
embedding's rows; the same partial sums and logit slice of a forward),
for llama with q/k/v/o and gate/up/down biases (one file), qwen3 (per-head q/k norms; a sharded checkpoint with its
index) and gemma3 (a tied output embedding, an embedding scale and two RoPE tables, all computed at construction);
in another dtype on request; and its refusals, by name. No process group: a rank's share is built alone."""
import json

import pytest
import torch

from kvrewrite.tensor_parallel import rank_model
from kvrewrite.tensor_parallel_loading import load_rank_model
from tests.families import COMMON

TP = 2


def _model(family):
    import transformers as tf

    torch.manual_seed(0)
    cfg = {"llama": lambda: tf.LlamaConfig(num_hidden_layers=2, attention_bias=True, mlp_bias=True, **COMMON),
           "qwen3": lambda: tf.Qwen3Config(num_hidden_layers=2, **COMMON),
           "gemma3": lambda: tf.Gemma3TextConfig(num_hidden_layers=2, sliding_window=8, query_pre_attn_scalar=16,
                                                 layer_types=["sliding_attention", "full_attention"],
                                                 **{**COMMON, "tie_word_embeddings": True})}[family]()
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:  # HF's zeros and ones would hide a mix-up
                p.normal_(0, 0.1)
    return model


def _saved(model, tmp_path, shards=False):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder, max_shard_size="20KB" if shards else "5GB")
    return folder


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_the_loaded_share_is_rank_models(family, tmp_path, monkeypatch):
    from kvrewrite.kernels import tp_all_gather

    monkeypatch.setattr(tp_all_gather, "VOCAB_PARALLEL", True)  # the default; a test that left it off must not leak here
    model = _model(family)
    folder = _saved(model, tmp_path, shards=family == "qwen3")
    assert (folder / "model.safetensors.index.json").is_file() == (family == "qwen3")
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    for rank in range(TP):
        ref, got = rank_model(model, TP, rank, "ref"), load_rank_model(folder, TP, rank)
        assert got.kvrewrite_shard == ref.kvrewrite_shard
        want = dict(ref.state_dict())
        have = dict(got.state_dict())
        assert sorted(have) == sorted(want)
        bad = [k for k in want if have[k].dtype != want[k].dtype or not torch.equal(have[k], want[k])]
        assert not bad, bad
        assert all(p.is_contiguous() for p in got.parameters())
        V = model.config.vocab_size  # the lm_head split by vocabulary rows, the embedding whole
        assert got.kvrewrite_shard.vocab_parallel == "lm_head.weight" and got.lm_head.weight.shape[0] == V // TP
        assert got.model.embed_tokens.weight.shape[0] == V
        if family == "gemma3":  # still tied: the rank's rows of the embedding, no copy
            emb = got.model.embed_tokens.weight
            assert got.kvrewrite_shard.tied_output == "model.embed_tokens.weight"
            assert got.lm_head.weight.data_ptr() == emb[rank * V // TP:].data_ptr()
        with torch.no_grad():
            assert torch.equal(got(ids).logits, ref(ids).logits)  # the rank's partial sums, buffers included


def test_another_dtype(tmp_path):
    model = _model("llama")
    got = load_rank_model(_saved(model, tmp_path), TP, 1, dtype=torch.bfloat16)
    ref = rank_model(model, TP, 1, "ref").to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in got.parameters())
    assert all(torch.equal(got.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_refusals(tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_rank_model(tmp_path, TP, 0)
    model = _model("llama")
    folder = _saved(model, tmp_path)
    with pytest.raises(ValueError, match="tp=3 does not divide num_key_value_heads=2"):
        load_rank_model(folder, 3, 0)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\) for tp=2, got 2"):
        load_rank_model(folder, TP, 2)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json and no \\*.safetensors file"):
        load_rank_model(folder, TP, 0)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
              folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"no tensor for 1 parameters of the model \(first: "
                                       r"\['model.layers.1.mlp.up_proj.weight'\]\)"):
        load_rank_model(folder, TP, 0)
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"the checkpoint's model.norm.weight has shape \(65,\) where the rank's "
                                         r"model takes \(64,\)"):
        load_rank_model(folder, TP, 0)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama"  # the folder stayed a llama checkpoint throughout
