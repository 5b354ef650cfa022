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


def tiny_tokenizer(chat_template=None):
    """A word-level tokenizer over the tiny vocabulary (t0 ... t127, split on whitespace), built offline; with
    `chat_template` (a Jinja string) set as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(COMMON["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok)
    if chat_template is not None:
        out.chat_template = chat_template
    return out


def tiny_model(family, attn="sdpa", dtype=torch.float32, seed=0):
    """A tiny model of FAMILIES (with `attn`) or of a MATRIX case (with the case's own attention)."""
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        return matrix_model(family, dtype, seed)[0]
    torch.manual_seed(seed)
    cfg = _cfg(family)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).eval()
    return model


# ---------------------------------------------------------------------------------------------------
# The model-family matrix (tests/test_full_matches_hf.py, golden diffs in tests/passes/test_passes.py,
# the README's "Supported models"): every family the README names, with the variants its real
# checkpoints use (sliding window on every layer / alternating / none; every RoPE type transformers
# ships; soft-capping; MHA / GQA / MQA). Each case either matches HF (`refuse` None) or must be refused
# at apply with an error containing every fragment of `refuse`. Windows are 8 and RoPE switch points 32,
# so the matrix prompt (40 tokens + 20 decode steps) crosses all of them.
# ---------------------------------------------------------------------------------------------------
WINDOW, ROPE_SWITCH = 8, 32
_MHA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            max_position_embeddings=512, tie_word_embeddings=False)
_GQA = dict(_MHA, num_key_value_heads=2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _matrix():
    import transformers as tf

    H = dict(_GQA, head_dim=16)
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ROPE_SWITCH)
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=ROPE_SWITCH)
    longrope = dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8)
    cases = {
        # name: (config, attention implementation, refusal fragments or None)
        "llama-gqa": (lambda: tf.LlamaConfig(num_hidden_layers=2, **H), "sdpa", None),
        "llama-mha-eager": (lambda: tf.LlamaConfig(num_hidden_layers=2, **dict(H, num_key_value_heads=4)), "eager", None),
        "llama-mqa": (lambda: tf.LlamaConfig(num_hidden_layers=2, **dict(H, num_key_value_heads=1)), "sdpa", None),
        "llama-rope-linear": (lambda: tf.LlamaConfig(num_hidden_layers=2, rope_scaling=dict(rope_type="linear", factor=2.0), **H), "sdpa", None),
        "llama-rope-yarn": (lambda: tf.LlamaConfig(num_hidden_layers=2, rope_scaling=yarn, **H), "sdpa", None),
        "llama-rope-llama3": (lambda: tf.LlamaConfig(num_hidden_layers=2, rope_scaling=llama3, **H), "sdpa", None),
        "llama-rope-dynamic": (lambda: tf.LlamaConfig(num_hidden_layers=2, rope_scaling=dict(rope_type="dynamic", factor=2.0),
                                                      **dict(H, max_position_embeddings=ROPE_SWITCH)), "sdpa",
                               ("llama", "dynamic (NTK) RoPE", "max_length")),
        "mistral-window-every-layer": (lambda: tf.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **H), "sdpa", None),
        "mistral-no-window": (lambda: tf.MistralConfig(num_hidden_layers=2, sliding_window=None, **H), "sdpa", None),
        "mixtral-window": (lambda: tf.MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                                    sliding_window=WINDOW, **H), "sdpa", None),
        "qwen2-window-upper-layers": (lambda: tf.Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                                                             max_window_layers=1, **H), "sdpa", None),
        "qwen3": (lambda: tf.Qwen3Config(num_hidden_layers=2, **H), "sdpa", None),
        "qwen2_moe": (lambda: tf.Qwen2MoeConfig(num_hidden_layers=2, shared_expert_intermediate_size=32, **_MOE, **_GQA), "sdpa", None),
        "qwen3_moe": (lambda: tf.Qwen3MoeConfig(num_hidden_layers=2, **_MOE, **H), "sdpa", None),
        "phi3-window-every-layer": (lambda: tf.Phi3Config(num_hidden_layers=2, sliding_window=WINDOW, pad_token_id=0, **_GQA), "sdpa", None),
        "phi3-longrope": (lambda: tf.Phi3Config(num_hidden_layers=2, pad_token_id=0, rope_scaling=longrope,
                                                original_max_position_embeddings=ROPE_SWITCH, **_GQA), "sdpa",
                          ("phi3", "LongRoPE", f"original_max_position_embeddings={ROPE_SWITCH}")),
        "phi-2": (lambda: tf.PhiConfig(num_hidden_layers=2, **_MHA), "sdpa", None),
        "starcoder2-window": (lambda: tf.Starcoder2Config(num_hidden_layers=2, sliding_window=WINDOW, **_GQA), "sdpa", None),
        "gemma": (lambda: tf.GemmaConfig(num_hidden_layers=2, **H), "sdpa", None),
        "gemma2-softcap-alternating": (lambda: tf.Gemma2Config(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                                               attn_logit_softcapping=5.0, **H), "eager", None),
        "gemma3-softcap-eager": (lambda: tf.Gemma3TextConfig(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                                             attn_logit_softcapping=5.0, **H), "eager", None),
        "olmo": (lambda: tf.OlmoConfig(num_hidden_layers=2, **_GQA), "sdpa", None),
        "olmo2": (lambda: tf.Olmo2Config(num_hidden_layers=2, **_GQA), "sdpa", None),
        "granite": (lambda: tf.GraniteConfig(num_hidden_layers=2, **_GQA), "sdpa", None),
        "stablelm": (lambda: tf.StableLmConfig(num_hidden_layers=2, **_GQA), "sdpa", None),
        "cohere": (lambda: tf.CohereConfig(num_hidden_layers=2, **_GQA), "sdpa", None),
        "gpt_neox": (lambda: tf.GPTNeoXConfig(num_hidden_layers=2, **_MHA), "sdpa", None),
        "glm4": (lambda: tf.Glm4Config(num_hidden_layers=2, pad_token_id=0, **H), "sdpa", None),
        "smollm3-nope-layers": (lambda: tf.SmolLM3Config(num_hidden_layers=4, pad_token_id=0, **_GQA), "sdpa", None),
        "falcon-mqa": (lambda: tf.FalconConfig(num_hidden_layers=2, vocab_size=128, hidden_size=64, num_attention_heads=4,
                                               multi_query=True, new_decoder_architecture=False, alibi=False), "sdpa", None),
        "falcon-alibi": (lambda: tf.FalconConfig(num_hidden_layers=2, vocab_size=128, hidden_size=64, num_attention_heads=4,
                                                 alibi=True), "sdpa", ("falcon", "ALiBi")),
        "bloom-alibi": (lambda: tf.BloomConfig(n_layer=2, vocab_size=128, hidden_size=64, n_head=4), "eager", ("bloom", "ALiBi")),
        "mpt-alibi": (lambda: tf.MptConfig(n_layers=2, vocab_size=128, d_model=64, n_heads=4), "eager", ("mpt", "ALiBi")),
        "gpt2": (lambda: tf.GPT2Config(n_layer=2, vocab_size=128, n_embd=64, n_head=4, n_positions=512), "sdpa", None),
        "gptj-eager": (lambda: tf.GPTJConfig(n_layer=2, vocab_size=128, n_embd=64, n_head=4, n_positions=512, rotary_dim=8),
                       "eager", None),
        "llama4-chunked": (lambda: tf.Llama4TextConfig(num_hidden_layers=4, intermediate_size_mlp=96, num_local_experts=2,
                                                       attention_chunk_size=WINDOW, **H), "sdpa",
                           ("llama4_text", "layer 0", "chunked_attention")),
    }
    return cases


MATRIX = tuple(_matrix())


def matrix_case(case):
    """(config maker, attention implementation, refusal fragments or None: must match HF)."""
    return _matrix()[case]


def matrix_model(case, dtype=torch.float32, seed=0):
    """The tiny random model of a matrix case, and its refusal fragments (None: must match HF)."""
    from transformers import AutoModelForCausalLM

    make, attn, refuse = matrix_case(case)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make(), attn_implementation=attn, dtype=dtype).eval()
    return model, refuse


def golden_cases() -> tuple:
    """One matching matrix case per model type not in FAMILIES: the families with golden graph diffs of their own."""
    import transformers as tf

    seen, out = {t: None for t in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")}, []
    for case in MATRIX:
        make, _, refuse = matrix_case(case)
        mt = make().model_type
        if refuse is None and mt not in seen:
            seen[mt] = case
            out.append(case)
    return tuple(out)
