"""Tiny random-weight configs of every supported family (2-3 layers, GQA, head_dim 16): no downloads."""
import torch

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, head_dim=16, tie_word_embeddings=False)


def _cfg(family):
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(num_hidden_layers=2, **COMMON)
    if family == "mistral":
        return tf.MistralConfig(num_hidden_layers=2, sliding_window=None, **COMMON)
    if family == "qwen2":
        return tf.Qwen2Config(num_hidden_layers=2, **COMMON)
    if family == "qwen3":
        return tf.Qwen3Config(num_hidden_layers=2, **COMMON)
    if family == "phi3":
        c = dict(COMMON)
        c.pop("head_dim")
        return tf.Phi3Config(num_hidden_layers=2, sliding_window=None, pad_token_id=0, **c)
    if family == "gemma3":
        return tf.Gemma3TextConfig(num_hidden_layers=3, sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   query_pre_attn_scalar=16, **COMMON)
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")


def tiny_model(family, attn="sdpa", dtype=torch.float32, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _cfg(family)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).eval()
    return model
