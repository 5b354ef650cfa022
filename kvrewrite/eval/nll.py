"""Continuation NLL after compression, on long Gutenberg text (Shakespeare).

A sample is a fixed target of `nll_tokens` tokens starting at a line of the corpus; its context is
the n tokens before it, so every context length scores the same target (a longer context can only
help). The context is prefilled and compressed to the budget, B = round(budget * (n + nll_tokens))
slots per KV head, then the target is fed one teacher-forced decode step at a time with the
compressed cache (re-compression every g = 32 steps included). Metric: mean NLL in nats/token;
`nll_delta` is the method's NLL minus the full cache's on the same sample (> 0: worse).
"""
from __future__ import annotations

import torch

from kvrewrite.eval.grid import Context
from kvrewrite.quality import teacher_forced_nll


def text_sample(tokenizer, text: str, length: int, sample: int, samples: int, target_tokens: int):
    """(context [1, length], target [1, target_tokens]) token ids of sample `sample` of `samples`.

    The target starts at the first line break after the fraction (sample + 1) / (samples + 1) of the
    text; the context is the `length` tokens before it. Deterministic for a tokenizer and text.
    """
    at = text.find("\n", int(len(text) * (sample + 1) / (samples + 1)))
    at = at + 1 if at >= 0 else len(text) // 2
    chars = 8 * length + 256
    while True:
        before = tokenizer(text[max(0, at - chars) : at], add_special_tokens=False)["input_ids"]
        if len(before) > length or at - chars <= 0:
            break
        chars *= 2
    after_chars = 8 * target_tokens + 256
    while True:
        after = tokenizer(text[at : at + after_chars], add_special_tokens=False)["input_ids"]
        if len(after) >= target_tokens or at + after_chars >= len(text):
            break
        after_chars *= 2
    if len(before) < length or len(after) < target_tokens:
        raise ValueError(f"nll: the text has too few tokens for a context of {length} and a target of {target_tokens}")
    # the first tokens of `before` may be a cut word: it is longer than `length`, so they are dropped
    return torch.tensor([before[-length:]]), torch.tensor([after[:target_tokens]])


class NLLTask:
    name = "nll"
    text = "shakespeare"

    def settings(self, cfg) -> dict:
        return {"nll_tokens": cfg.nll_tokens, "samples": cfg.samples}

    def gamma(self, cfg) -> int:
        return cfg.nll_tokens

    def contexts(self, tokenizer, text, cfg) -> list:
        out = []
        target_tokens = max(cfg.nll_tokens, cfg.fidelity_steps)  # fidelity decodes the same target
        for n in cfg.context_lengths:
            for s in range(cfg.samples):
                ctx, target = text_sample(tokenizer, text, n, s, cfg.samples, target_tokens)
                out.append(Context(key=(self.text, n, s), input_ids=ctx, length=n, coords={"sample": s},
                                   data={"target": target}))
        return out

    def reference(self, full_rw, ctx, start, cfg):
        metrics = self.run(full_rw, ctx, start, None, cfg)
        return metrics, metrics

    def run(self, rw, ctx, start, ref, cfg) -> dict:
        target = ctx.data["target"][:, : cfg.nll_tokens]
        nll = teacher_forced_nll(rw, start(rw, cfg.nll_tokens), target, what="nll")
        out = {"nll": nll}
        if ref is not None:
            out["nll_delta"] = nll - ref["nll"]
        return out


TASK = NLLTask()
