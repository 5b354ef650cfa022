"""Needle retrieval: a passphrase hidden at several depths of Paul Graham essays.

The haystack is the first n tokens of the essays; the needle sentence goes in at the sentence end
nearest to depth * n tokens (depth 0: the start, 1: the end). The question follows the context, in
the model's chat template when it has one. The prompt is prefilled and compressed to the budget,
B = round(budget * (prompt tokens + answer_tokens)), then the answer is decoded greedily (at most
`answer_tokens`, stopping at EOS). Exact match: the passphrase appears in the answer as a whole word
(case-insensitive; "The passphrase is 'amber-falcon-42'." counts, "amber-falcon-4" does not).

Mode "context" (`kvrewrite eval --mode context`): the prompt is cut after the haystack, where kvrewrite.pipeline
cuts it (split_prompt); the haystack alone is compressed (rw.prefill_context: B = round(budget * context tokens)),
then the question (the rest of the prompt: the question and the template's tail) and the answer run on the
compressed cache (kvrewrite/context_cache.py), as kvpress evaluates. The two parts are tokenized apart (the cut is a text boundary, so the ids may differ from
the whole prompt's by a merge at the cut); the prompt of that mode is their concatenation.
"""
from __future__ import annotations

import re

import torch

from kvrewrite.eval.grid import Context

NEEDLE = "The secret passphrase for the archive is 'amber-falcon-42'."
QUESTION = "What is the secret passphrase for the archive? Answer with the passphrase only."
ANSWER = "amber-falcon-42"
_MATCH = re.compile(r"(?<![\w-])" + re.escape(ANSWER) + r"(?![\w-])", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def exact_match(answer: str) -> bool:
    return _MATCH.search(answer) is not None


def haystack(tokenizer, text: str, length: int, depth: float) -> tuple[str, float]:
    """(context text of about `length` tokens with the needle in it, the needle's actual depth in [0, 1])."""
    ids = tokenizer(text[: 8 * length + 256], add_special_tokens=False)["input_ids"]
    if len(ids) < length:
        raise ValueError(f"needle: the essays have fewer than {length} tokens")
    body = tokenizer.decode(ids[:length])
    cut = len(tokenizer.decode(ids[: round(depth * length)]))
    ends = [m.end() for m in _SENTENCE_END.finditer(body)]
    if ends and 0 < depth < 1:
        cut = min(ends, key=lambda e: abs(e - cut))  # the sentence end nearest to the depth
    before, after = body[:cut].rstrip(), body[cut:].lstrip()
    context = " ".join(part for part in (before, NEEDLE, after) if part)
    return context, len(before) / max(len(body), 1)


def build_prompt(tokenizer, context: str) -> torch.Tensor:
    """Prompt ids [1, n]: the context and the question, in the chat template if the tokenizer has one."""
    content = f"{context}\n\n{QUESTION}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(f"{content}\nAnswer:", add_special_tokens=True)["input_ids"]
    return torch.tensor([ids])


def split_prompt(tokenizer, context: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(context ids [1, n_c], question ids [1, n_q]): build_prompt's text cut where kvrewrite.pipeline cuts it
    (text_pipeline.PromptFormat.encode: the context and the blank line after it, then the question and the
    template's tail), each part tokenized alone (the special tokens of the start go with the context)."""
    from kvrewrite.text_pipeline import PromptFormat

    templated = bool(getattr(tokenizer, "chat_template", None))
    question = QUESTION if templated else f"{QUESTION}\nAnswer:"  # build_prompt's raw-text prompt
    ids, q = PromptFormat(tokenizer, templated).encode(question, context)
    return torch.tensor([ids]), torch.tensor([q])


def eos_ids(rw, tokenizer) -> set:
    eos = getattr(getattr(rw, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    return set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))


@torch.no_grad()
def greedy(rw, logits, max_new_tokens: int, eos: set) -> list:
    out = []
    for step in range(max_new_tokens):
        tok = int(logits[0].argmax())
        out.append(tok)
        if tok in eos or step == max_new_tokens - 1:
            break
        logits = rw.decode_step(torch.tensor([tok]))
    return out


class NeedleTask:
    name = "needle"
    text = "paul_graham"
    modes = ("whole", "context")  # EvalConfig.mode: the whole prompt compressed, or the haystack alone

    def settings(self, cfg) -> dict:
        return {"depths": list(cfg.depths), "answer_tokens": cfg.answer_tokens, "needle": NEEDLE,
                "question": QUESTION, "answer": ANSWER}

    def gamma(self, cfg) -> int:
        return cfg.answer_tokens

    def contexts(self, tokenizer, text, cfg) -> list:
        out = []
        for n in cfg.context_lengths:
            for depth in cfg.depths:
                context, actual = haystack(tokenizer, text, n, depth)
                data = {"actual_depth": round(actual, 4), "tokenizer": tokenizer}
                if cfg.mode == "context":
                    data["context_ids"], data["question_ids"] = split_prompt(tokenizer, context)
                    ids = torch.cat([data["context_ids"], data["question_ids"]], dim=1)
                else:
                    ids = build_prompt(tokenizer, context)
                out.append(Context(key=(self.text, n, depth), input_ids=ids, length=n, coords={"depth": depth},
                                   data=data))
        return out

    def reference(self, full_rw, ctx, start, cfg):
        return self.run(full_rw, ctx, start, None, cfg), None

    def run(self, rw, ctx, start, ref, cfg) -> dict:
        tok = ctx.data["tokenizer"]
        new = greedy(rw, start(rw, cfg.answer_tokens), cfg.answer_tokens, eos_ids(rw, tok))
        answer = tok.decode(new, skip_special_tokens=True).strip()
        return {"correct": int(exact_match(answer)), "answer": answer, "actual_depth": ctx.data["actual_depth"]}


TASK = NeedleTask()
