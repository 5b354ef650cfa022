"""`rw.generate`'s Hugging Face side: the arguments merged as `model.generate` merges them, the refusal of what a
kvrewrite generation cannot honour, HF's own logits processors and stopping criteria, and the token loop of HF's
`_sample` (greedy or multinomial sampling, pad after EOS, streamer, scores) over the rewritten model's decode steps.

transformers builds its processors in private GenerationMixin methods (`_prepare_generation_config`,
`_prepare_special_tokens`, `_prepare_generated_length`, `_validate_generated_length`, `_get_logits_processor`,
`_get_stopping_criteria`). We call those very methods on a small GenerationMixin view of the rewritten model (its
HF config and generation config) instead of rebuilding their lists: every processor HF ships, in HF's order, with
the installed version's own details (5.23's repetition penalty skips the left padding, 5.17's does not), so the
tokens equal `model.generate`'s on either version. Their keyword arguments are matched by name against the
installed signature; one we cannot provide is a clear error naming the transformers version, never a guess.
"""
import copy
import dataclasses
import inspect

import torch
import transformers
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import EosTokenCriteria, GenerateDecoderOnlyOutput, GenerationMode, MaxLengthCriteria

from kvrewrite.host import check_count, check_prompt, greedy_tokens

# generate() arguments of HF's that are not GenerationConfig fields and that rw.generate honours
SUPPORTED_ARGS = ("tokenizer", "prefix_allowed_tokens_fn")
# ... and those it refuses, by name: what the argument needs that a kvrewrite generation cannot do
REFUSED_ARGS = {
    "assistant_model": "assisted (speculative) generation is not supported: it verifies drafted tokens and rolls "
                       "the cache back, which a compressed cache cannot; generate without it",
    "assistant_tokenizer": "assisted (speculative) generation is not supported; generate without it",
    "negative_prompt_ids": "classifier-free guidance is not supported: it runs a second, unconditional forward "
                           "per step",
    "negative_prompt_attention_mask": "classifier-free guidance is not supported: it runs a second, unconditional "
                                      "forward per step",
    "synced_gpus": "synced_gpus (DeepSpeed ZeRO-3 / FSDP) is not supported: kvrewrite generates on one device",
    "custom_generate": "custom_generate is not supported: rw.generate runs its own decode loop over the rewritten "
                       "graphs",
    "inputs_embeds": "inputs_embeds is not supported: the rewritten graphs take token ids; pass input_ids",
    "past_key_values": "past_key_values is not supported: kvrewrite generates from its own compressed cache "
                       "(kvrewrite.apply sizes it)",
    "use_model_defaults": "use_model_defaults is not supported: the model's generation_config is always the base, "
                          "as in transformers 5",
}
# GenerationConfig fields that configure HF's own cache or compilation: refused when the caller sets them (a model's
# generation_config.json may carry them, e.g. Gemma's cache_implementation="hybrid"; those are ignored, as HF
# drops its own cache for a user-given one)
CACHE_FIELDS = {
    "cache_implementation": "kvrewrite generates from its own compressed cache, sized by kvrewrite.apply(max_length=, "
                            "prefill_chunk=); HF's cache options do not apply",
    "cache_config": "kvrewrite generates from its own compressed cache; HF's cache options do not apply",
    "max_cache_len": "kvrewrite's cache is sized by kvrewrite.apply(max_length=...)",
    "prefill_chunk_size": "the prefill chunk is fixed at capture: kvrewrite.apply(prefill_chunk=...)",
    "compile_config": "rw.generate does not compile: compile the rewritten model once with rw.compile(...)",
    "continuous_batching_config": "continuous batching is not supported",
}


def _refusals(gc) -> list:
    """(field=value, why) for every setting of the merged config that a kvrewrite generation cannot honour."""
    out = []

    def refuse(name, why):
        out.append((f"{name}={getattr(gc, name)!r}", why))

    if (gc.num_beams or 1) > 1:
        refuse("num_beams", "beam search is not supported: a kvrewrite cache holds one compressed sequence per batch "
                            "row and cannot fork or reorder beams; use num_beams=1 (greedy, or do_sample=True)")
    if (gc.num_beam_groups or 1) > 1:
        refuse("num_beam_groups", "group beam search is not supported (beam search is not); use num_beam_groups=1")
    if gc.penalty_alpha is not None and gc.penalty_alpha > 0:
        refuse("penalty_alpha", "contrastive search is not supported: it re-scores candidates with their hidden "
                                "states; leave penalty_alpha unset")
    for name in ("constraints", "force_words_ids"):
        if getattr(gc, name) is not None:
            refuse(name, "constrained beam search is not supported (beam search is not); steer tokens with "
                         "bad_words_ids, sequence_bias or a logits_processor instead")
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if getattr(gc, name) is not None:
            refuse(name, "assisted (speculative) generation is not supported: it rolls the cache back")
    if getattr(gc, "use_mtp", None):
        refuse("use_mtp", "multi-token-prediction drafting is not supported: it rolls the cache back")
    if gc.dola_layers is not None:
        refuse("dola_layers", "DoLa decoding is not supported: it reads early layers' hidden states, which the "
                              "rewritten graphs do not output")
    if gc.guidance_scale is not None and gc.guidance_scale != 1:
        refuse("guidance_scale", "classifier-free guidance is not supported: it runs a second, unconditional "
                                 "forward per step")
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(gc, name):
            refuse(name, "the rewritten graphs output only logits (output_scores / output_logits are supported)")
    if gc.use_cache is False:
        refuse("use_cache", "kvrewrite always decodes from its (compressed) cache")
    if gc.token_healing:
        refuse("token_healing", "token healing re-generates the prompt's tail; not supported")
    return out


class _HFView(GenerationMixin):
    """What GenerationMixin's preparation methods read from a model: its HF config and generation config."""

    def __init__(self, config, generation_config):
        self.config, self.generation_config = config, generation_config


def _view(owner) -> _HFView:
    config = getattr(owner, "config", None)
    if config is None:  # an exported model: no HF config, only what the processors read (watermarking's vocab)
        config = transformers.PretrainedConfig(vocab_size=getattr(owner, "vocab_size", None))
    gen = getattr(owner, "generation_config", None)
    return _HFView(config, gen if isinstance(gen, GenerationConfig) else GenerationConfig())


def _call_hf(name: str, view, **kwargs):
    """GenerationMixin.<name>(view, ...) with the keyword arguments its installed signature takes."""
    fn = getattr(GenerationMixin, name, None)
    if fn is None:
        raise RuntimeError(f"transformers {transformers.__version__}: GenerationMixin.{name} does not exist; "
                           f"rw.generate builds HF's processors with it (tested on transformers 5.17 and 5.23)")
    params = inspect.signature(fn).parameters
    missing = [p for p, spec in params.items() if p != "self" and p not in kwargs and spec.default is spec.empty
               and spec.kind in (spec.POSITIONAL_OR_KEYWORD, spec.KEYWORD_ONLY)]
    if missing:
        raise RuntimeError(f"transformers {transformers.__version__}: GenerationMixin.{name} needs {missing}, which "
                           f"rw.generate does not provide (tested on transformers 5.17 and 5.23)")
    if any(spec.kind is spec.VAR_KEYWORD for spec in params.values()):
        return fn(view, **kwargs)
    return fn(view, **{k: v for k, v in kwargs.items() if k in params})


def _user_keys(generation_config, kwargs) -> set:
    """The GenerationConfig fields the caller set (kwargs, or a generation_config's non-default ones)."""
    keys = set(kwargs)
    if generation_config is not None:
        keys |= set(generation_config.to_diff_dict())
    return keys


@dataclasses.dataclass
class GenerationPlan:
    """One generate call, checked and prepared before any state is touched: the merged GenerationConfig, the
    (expanded) prompt, the new-token count, and HF's processors and stopping criteria for a history of n tokens."""

    tag: str
    view: _HFView
    base: GenerationConfig  # merged, special tokens prepared, lengths not yet resolved
    config: GenerationConfig  # base with max_length / min_length resolved for `n_history` tokens
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    max_new_tokens: int
    has_default_min_length: bool
    extra: dict  # logits_processor, stopping_criteria, prefix_allowed_tokens_fn, tokenizer
    device: torch.device
    n_history: int = 0
    processors: LogitsProcessorList = None
    criteria: StoppingCriteriaList = None

    @classmethod
    def build(cls, owner, input_ids, attention_mask, generation_config, kwargs: dict, logits_processor,
              stopping_criteria, device) -> "GenerationPlan":
        tag = owner.model_tag
        check_prompt(input_ids, attention_mask, tag)
        kwargs = dict(kwargs)
        named = [f"{k} ({why})" for k, why in REFUSED_ARGS.items()
                 if k in kwargs and kwargs[k] is not None and not (k == "synced_gpus" and kwargs[k] is False)]
        if named:
            raise ValueError(f"{tag}: rw.generate cannot honour: " + "; ".join(named))
        for k in ("synced_gpus",):
            kwargs.pop(k, None)
        if generation_config is not None and not isinstance(generation_config, GenerationConfig):
            raise ValueError(f"{tag}: generation_config must be a transformers.GenerationConfig, got "
                             f"{type(generation_config).__name__}; pass the settings as keyword arguments instead")
        for name, minimum in (("max_new_tokens", 1), ("max_length", 1)):
            if kwargs.get(name) is not None:
                check_count(tag, name, kwargs[name], minimum)
        extra = {"logits_processor": logits_processor, "stopping_criteria": stopping_criteria,
                 **{k: kwargs.pop(k, None) for k in SUPPORTED_ARGS}}
        view = _view(owner)
        user = _user_keys(generation_config, kwargs)
        has_default_max_length = (kwargs.get("max_length") is None and (generation_config is None or
                                  generation_config.max_length is None) and view.generation_config.max_length is None)
        has_default_min_length = (kwargs.get("min_length") is None and (generation_config is None or
                                  generation_config.min_length is None) and view.generation_config.min_length is None)
        gc, model_kwargs = _call_hf("_prepare_generation_config", view, generation_config=generation_config, **kwargs)
        model_kwargs = {k: v for k, v in model_kwargs.items()
                        if not (k in ("output_attentions", "output_hidden_states") and v)}  # refused by name below
        if model_kwargs:
            raise ValueError(f"{tag}: rw.generate got unknown or unsupported argument(s) {sorted(model_kwargs)}: not "
                             f"GenerationConfig fields, and the rewritten model takes no other model inputs than "
                             f"input_ids and attention_mask (check for typos)")
        bad = _refusals(gc) + [(f"{k}={getattr(gc, k)!r}", why) for k, why in CACHE_FIELDS.items()
                               if k in user and getattr(gc, k, None) is not None]
        mode = gc.get_generation_mode()
        if not bad and mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            bad.append((f"generation mode {getattr(mode, 'value', mode)!r}", "only greedy search and sampling are "
                                                                             "supported"))
        if bad:
            raise ValueError(f"{tag}: rw.generate cannot honour: " + "; ".join(f"{s} ({why})" for s, why in bad))
        if isinstance(gc.eos_token_id, (list, tuple)) and len(gc.eos_token_id) == 0:
            gc.eos_token_id = None  # eos_token_id=[]: no EOS (HF would take the pad id from eos[0] and fail)
        k = gc.num_return_sequences or 1
        B = input_ids.shape[0]
        if k > 1 and B * k != owner.batch_size:
            raise ValueError(f"{tag}: num_return_sequences={k} repeats each of the {B} prompts {k} times: "
                             f"{B * k} rows, but the model was {owner.BATCH_FIXED_BY} for batch size "
                             f"{owner.batch_size}; pass {owner.batch_size // k if owner.batch_size % k == 0 else 'a'} "
                             f"prompt(s) or apply() with batch_size={B * k}")
        input_ids = input_ids.to(device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(device)
        if k > 1:  # HF's _expand_inputs_for_generation
            input_ids = input_ids.repeat_interleave(k, dim=0)
            attention_mask = None if attention_mask is None else attention_mask.repeat_interleave(k, dim=0)
        _call_hf("_prepare_special_tokens", view, generation_config=gc,
                 kwargs_has_attention_mask=attention_mask is not None, device=device, batch_size=input_ids.shape[0])
        base = copy.deepcopy(gc)
        n = input_ids.shape[1]
        gc = cls._lengths(view, base, n, has_default_max_length, has_default_min_length)
        plan = cls(tag, view, base, gc, input_ids, attention_mask, gc.max_length - n, has_default_min_length, extra,
                   device)
        plan.bind(input_ids, gc)
        return plan

    @staticmethod
    def _lengths(view, base, n: int, has_default_max_length: bool, has_default_min_length: bool):
        """A copy of `base` with max_length / min_length resolved for a history of n tokens (HF's rules: max_length
        counts the prompt, max_new_tokens wins, the default is 20 new tokens)."""
        gc = copy.deepcopy(base)
        gc = _call_hf("_prepare_generated_length", view, generation_config=gc,
                      has_default_max_length=has_default_max_length, has_default_min_length=has_default_min_length,
                      model_input_name="input_ids", input_ids_length=n, inputs_tensor=None)
        _call_hf("_validate_generated_length", view, generation_config=gc, input_ids_length=n,
                 has_default_max_length=has_default_max_length)
        return gc

    def bind(self, history: torch.Tensor, gc: GenerationConfig | None = None) -> None:
        """Build HF's processors and criteria for `history` [B, n] (the ids they see before the first new token);
        a history longer or shorter than the prompt (a compressed context) keeps max_new_tokens."""
        n = history.shape[1]
        if gc is None:
            base = copy.deepcopy(self.base)
            base.max_new_tokens = self.max_new_tokens
            gc = self._lengths(self.view, base, n, True, self.has_default_min_length)
        mask = self.attention_mask
        if mask is not None and mask.shape[1] != n:  # history = what came before the prompt (all real) + prompt
            mask = torch.nn.functional.pad(mask, (n - mask.shape[1], 0), value=1)
        model_kwargs = {"attention_mask": mask if mask is not None and not bool(mask.bool().all()) else None}
        x = self.extra
        self.processors = _call_hf(
            "_get_logits_processor", self.view, generation_config=gc, input_ids_seq_length=n,
            encoder_input_ids=history, prefix_allowed_tokens_fn=x["prefix_allowed_tokens_fn"],
            logits_processor=x["logits_processor"] if x["logits_processor"] is not None else LogitsProcessorList(),
            device=self.device, model_kwargs=model_kwargs, negative_prompt_ids=None,
            negative_prompt_attention_mask=None)
        self.criteria = _call_hf(
            "_get_stopping_criteria", self.view, generation_config=gc,
            stopping_criteria=x["stopping_criteria"] if x["stopping_criteria"] is not None else StoppingCriteriaList(),
            tokenizer=x["tokenizer"])
        if any(hasattr(c, "eos_token_id") for c in self.criteria) and gc._pad_token_tensor is None:
            raise ValueError(f"{self.tag}: a stopping criterion stops rows at EOS but there is no pad_token_id to "
                             f"fill the finished rows with; pass pad_token_id=...")
        self.config, self.n_history = gc, n

    def output(self, sequences, scores, logits):
        """HF's return value: the sequences, or a GenerateDecoderOnlyOutput if return_dict_in_generate."""
        gc = self.config
        if not gc.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=tuple(scores) if gc.output_scores else None,
                                         logits=tuple(logits) if gc.output_logits else None)


def decode_loop(plan: GenerationPlan, logits, history, decode_step, *, streamer=None, generator=None,
                progress=False, same_sample=None):
    """HF's `_sample` loop from the first logits [B, V] on: process, pick (argmax, or softmax + torch.multinomial
    on `generator` or the global RNG), pad finished rows, stream, stop; `decode_step(tokens [B]) -> logits [B, V]`.
    Returns (new tokens [B, steps], scores, logits) (the two lists when return_dict_in_generate asked for them).

    Greedy with no processor, no scores and only HF's max-length / EOS criteria (the default) takes argmax with
    greedy_tokens on the raw logits (the same token: a float32 copy changes no order) and tests EOS itself
    (EosTokenCriteria's isin); with no EOS it never reads the device until the end. `same_sample(tokens) ->
    tokens`, if given, replaces each sampled draw (tensor parallelism: rank 0's draw on every rank)."""
    from tqdm.auto import tqdm

    gc, processors, criteria = plan.config, plan.processors, plan.criteria
    B, n = history.shape
    device = logits.device
    want_scores = gc.return_dict_in_generate and gc.output_scores
    want_logits = gc.return_dict_in_generate and gc.output_logits
    scores, raw = [], []
    limit = plan.max_new_tokens
    for c in criteria:  # a MaxLengthCriteria stops once the history + new tokens reach its max_length (HF's loop
        if type(c) is MaxLengthCriteria:  # makes one step before it asks)
            limit = min(limit, max(1, c.max_length - n))
    eos_criteria = [c for c in criteria if hasattr(c, "eos_token_id")]
    has_eos = bool(eos_criteria)
    pad = gc._pad_token_tensor.to(device) if has_eos else None
    fast = (not gc.do_sample and len(processors) == 0 and not want_scores and not want_logits
            and all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in criteria))
    eos = torch.cat([c.eos_token_id.to(device).flatten() for c in eos_criteria]) if fast and has_eos else None
    check = has_eos or not fast  # with no EOS the fast path's rows never finish before the last step
    buf = torch.empty(B, n + max(limit, 0), dtype=torch.long, device=device)
    buf[:, :n] = history
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    steps = 0
    for step in tqdm(range(limit), desc="decode", unit="tok", disable=not progress):
        if fast:
            tok = greedy_tokens(logits)
        else:
            x = logits.to(dtype=torch.float32, copy=True)
            s = processors(buf[:, : n + step], x)
            if want_scores:
                scores.append(s)
            if want_logits:
                raw.append(x)
            if gc.do_sample:
                tok = torch.multinomial(torch.softmax(s, dim=-1), num_samples=1, generator=generator).squeeze(1)
                if same_sample is not None:
                    tok = same_sample(tok)
            else:
                tok = greedy_tokens(s)  # torch.argmax's token, in fewer passes over a long row
        if has_eos:
            tok = torch.where(unfinished, tok, pad)  # HF's tok * unfinished + pad * (1 - unfinished), one kernel
        buf.select(1, n + step).copy_(tok)
        steps = step + 1
        if streamer is not None:
            streamer.put(tok.cpu())
        if fast:
            if has_eos:  # EosTokenCriteria: a row whose last token is an EOS is done
                unfinished &= torch.isin(tok, eos, invert=True)
        else:
            unfinished &= ~criteria(buf[:, : n + steps], tuple(scores) if want_scores else None)
        if step == limit - 1 or (check and not bool(unfinished.any())):
            break
        logits = decode_step(tok)
    if streamer is not None:
        streamer.end()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the timings cover the work, not its launch
    return buf[:, n: n + steps], scores, raw
