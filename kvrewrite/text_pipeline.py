"""kvrewrite.pipeline (kvrewrite/text_pipeline.py): text in, answers out, on a compressed KV cache.

    pipe = kvrewrite.pipeline("smollm2-135m", method="chelsea", budget=0.2)
    pipe("What is 2 + 2?")                                   # one prompt -> one answer
    pipe(["Who wrote it?", "When?"], context=long_document)  # the document compressed ONCE, then every question

What it does, in HF's terms:
- The prompt is the chat template applied to one user message, rendered and tokenized as transformers'
  text-generation pipeline does (`apply_chat_template(..., add_generation_prompt=True)`, then the tokens without
  adding special tokens again); a tokenizer without a chat template gets the raw text (special tokens added).
- With a context, the user message is `context + "\\n\\n" + question`. Its rendering is split where the question
  starts: the part before (the template's head and the context) is tokenized once and compressed once
  (`rw.prefill_context`); the part from the question on (the question and the template's tail) is tokenized per
  question and run on a copy of the compressed context (`rw.generate(..., context=state)`). Tokenizing the two
  parts separately can differ from tokenizing the whole rendering at the boundary, by a token or two: SmolLM2's
  tokenizer ends the context's blank line as one token where the whole rendering has two newline tokens;
  Qwen2.5's gives the same ids either way. Other compression libraries split the same way.
- Sizes: apply's `max_length` must hold the context, the longest question and max_new_tokens, plus
  prefill_chunk - 1: the context and the question are each left-padded to whole prefill chunks, and a method that
  keeps every slot (`full`) keeps both paddings (docs/context.md, "Sizes"); a call that does not fit is refused
  with the sizes.
- Questions run in batches of the rewrite's batch size (left-padded); a short last batch is filled with copies of
  its last question, whose answers are dropped. With batch_size > 1 the context is compressed on every row of the
  batch (the graphs are static in the batch): B times the work of a batch-1 rewrite, whose state a batch-B rewrite
  would take as it is (docs/context.md, "Batches"); the pipeline keeps one rewrite.
"""
from __future__ import annotations

import os
import time

import torch

MARKER = "\ue000"  # a private-use character: where the question starts in the rendered template


class PromptFormat:
    """How a pipeline turns text into token ids (module docstring): the tokenizer, and whether its chat template
    renders the prompt."""

    def __init__(self, tokenizer, chat_template: bool):
        self.tokenizer, self.chat_template = tokenizer, chat_template

    def render(self, user_text: str) -> str:
        """The prompt text for one user message: the chat template with the generation prompt, or the text."""
        if not self.chat_template:
            return user_text
        return self.tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                                  add_generation_prompt=True)

    def _ids(self, text: str, first: bool) -> list:
        """Token ids of `text`; special tokens (BOS) only for the first part of a raw (untemplated) prompt: a
        rendered template carries its own."""
        return self.tokenizer(text, add_special_tokens=first and not self.chat_template)["input_ids"]

    def encode(self, question: str, context: str | None = None) -> tuple:
        """(context ids or None, question ids): the two token lists the rewrite runs (module docstring)."""
        if context is None:
            return None, self._ids(self.render(question), first=True)
        rendered = self.render(f"{context}\n\n{MARKER}")
        if rendered.count(MARKER) != 1:
            raise ValueError(f"kvrewrite.pipeline: the chat template of {type(self.tokenizer).__name__} does not keep "
                             "the user message verbatim, so the context cannot be split from the question; pass "
                             "chat_template=False, or compress the context yourself with rw.prefill_context")
        head, tail = rendered.split(MARKER)
        return self._ids(head, first=True), self._ids(question + tail, first=False)


class TextPipeline:
    """Answers from text; see the module docstring. Built by `kvrewrite.pipeline`.

    Attributes: `rw` (the KVRewrittenModel), `model`, `tokenizer`, `format` (a PromptFormat), `last_context` (the
    compressed context of the last call that had one), `last_timings` (seconds of the last call: context_s, the
    context's compression; prefill_s and decode_s summed over the question batches; new_tokens, the most any
    batch generated, summed over batches).
    """

    def __init__(self, model, tokenizer, rw, chat_template: bool):
        self.model, self.tokenizer, self.rw = model, tokenizer, rw
        self.format = PromptFormat(tokenizer, chat_template)
        self.last_context = self.last_timings = None

    def encode(self, question: str, context: str | None = None) -> tuple:
        return self.format.encode(question, context)

    def _batch(self, rows: list) -> tuple:
        """Left-padded [B, n] ids and attention mask of the token lists `rows`."""
        n = max(len(r) for r in rows)
        pad = self.pad_token_id
        ids = torch.tensor([[pad] * (n - len(r)) + list(r) for r in rows])
        mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows])
        return ids, mask

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        if tok.pad_token_id is not None:
            return tok.pad_token_id
        eos = tok.eos_token_id if tok.eos_token_id is not None else self.rw.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        return 0 if eos is None else eos

    # -- answers --------------------------------------------------------------------------------------
    def __call__(self, questions, context: str | None = None, *, max_new_tokens: int = 64, progress: bool = False,
                 **generate_kwargs):
        """Answer `questions` (a string or a list of strings), each alone or about `context` (compressed once).
        Returns a string for a string, a list for a list. `generate_kwargs` are rw.generate's (HF's: do_sample,
        temperature, top_p, eos_token_id, ...)."""
        single = isinstance(questions, str)
        qs = [questions] if single else list(questions)
        if not qs or not all(isinstance(q, str) for q in qs):
            raise ValueError(f"kvrewrite.pipeline: questions must be a string or a non-empty list of strings, got "
                             f"{questions!r:.80}")
        if context is not None and not isinstance(context, str):
            raise ValueError(f"kvrewrite.pipeline: context must be a string or None, got {type(context).__name__}")
        encoded = [self.encode(q, context) for q in qs]
        state, timings = None, {"context_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0}
        if context is not None:
            t0 = time.perf_counter()
            state = self.last_context = self.rw.prefill_context(torch.tensor([encoded[0][0]]), progress=progress)
            timings["context_s"] = time.perf_counter() - t0
        generate_kwargs.setdefault("pad_token_id", self.pad_token_id)
        B = self.rw.batch_size
        answers = []
        for start in range(0, len(qs), B):
            rows = [q_ids for _, q_ids in encoded[start:start + B]]
            real = len(rows)
            rows += [rows[-1]] * (B - real)  # fill a short last batch; those answers are dropped
            ids, mask = self._batch(rows)
            out = self.rw.generate(ids, attention_mask=mask, context=state, max_new_tokens=max_new_tokens,
                                   progress=progress, **generate_kwargs)
            sequences = out.sequences if hasattr(out, "sequences") else out
            new = sequences[:real, ids.shape[1]:]
            answers += [self.tokenizer.decode(row, skip_special_tokens=True).strip() for row in new.tolist()]
            for key in ("prefill_s", "decode_s", "new_tokens"):
                timings[key] += self.rw.last_timings[key]
        self.last_timings = timings
        return answers[0] if single else answers


def pipeline(model, method: str = "chelsea", budget=None, *, tokenizer=None, dtype: torch.dtype = torch.float32,
             device=None, chat_template: bool | None = None, **apply_kwargs) -> TextPipeline:
    """A TextPipeline: `model` (a Hugging Face causal LM, with `tokenizer`; or a registry name, local HF folder or
    hub id, loaded with its tokenizer by kvrewrite.assets.load_model in `dtype`) rewritten with `method` and
    `budget` by kvrewrite.apply (`apply_kwargs`: max_length, batch_size, prefill_chunk, the method's options, ...).

    device: where to move a model loaded by name (default: where it loads, the CPU). chat_template: None (default)
    uses the tokenizer's chat template when it has one, as HF's pipeline does; True requires one; False sends the
    raw text."""
    import kvrewrite
    from kvrewrite.assets import load_model

    if isinstance(model, (str, os.PathLike)):
        if tokenizer is not None:
            raise ValueError("kvrewrite.pipeline: a model given by name brings its own tokenizer; pass tokenizer= "
                             "only with a model object")
        model, tokenizer = load_model(model, dtype=dtype)
        if device is not None:
            model = model.to(device)
    elif tokenizer is None:
        raise ValueError(f"kvrewrite.pipeline: a {type(model).__name__} object needs its tokenizer: pass tokenizer= "
                         "(or give the model by name or folder, and its tokenizer is loaded with it)")
    elif device is not None:
        raise ValueError("kvrewrite.pipeline: device= moves a model loaded by name; move your model object yourself")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise ValueError(f"kvrewrite.pipeline: chat_template=True but {type(tokenizer).__name__} has no chat "
                         "template; pass chat_template=False (raw text) or set tokenizer.chat_template")
    use_template = has_template if chat_template is None else bool(chat_template)
    rw = kvrewrite.apply(model, method, budget, **apply_kwargs)
    return TextPipeline(model, tokenizer, rw, use_template)
