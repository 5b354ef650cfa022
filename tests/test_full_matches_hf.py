"""The `full` method reproduces Hugging Face's own logits, for every family and variant of the matrix
(tests/families.py: FAMILIES and MATRIX; tiny random models, fp32), or is refused at apply by name.

Setting (the hard cases of the runtime): batch 2 with left padding (row 1 has 7 pad tokens), a
40-token prompt with prefill_chunk=16 (3 chunks, the first padded with 8 chunk-padding tokens),
then 20 greedy decode steps. The reference is a plain HF forward with a DynamicCache, the 2-D
attention_mask and mask-derived position ids (what HF's generate does). Windows are 8 tokens and RoPE
switch points 32 (tests/families.py), so the prompt and the decode run past all of them.
"""
import pytest
import torch
from transformers import DynamicCache

import kvrewrite
from kvrewrite.errors import RewriteError
from tests.families import FAMILIES, MATRIX, matrix_case, matrix_model, tiny_model

# fp32 end to end: both sides compute the same math in a different order (fp32 attention with a
# degree bias of 0 vs SDPA), so differences are rounding only. 1e-5 absolute on logits of O(1).
ATOL = 1e-5
PROMPT, PAD_ROW1, CHUNK, NEW, MAX_LENGTH = 40, 7, 16, 20, 64
CASES = FAMILIES + MATRIX
MATCHING = tuple(c for c in CASES if c in FAMILIES or matrix_case(c)[2] is None)
REFUSED = tuple(c for c in CASES if c not in MATCHING)


def _inputs(prompt=PROMPT):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, prompt), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :PAD_ROW1] = 0
    ids[1, :PAD_ROW1] = 0  # pad id; never attended
    return ids, mask


def _model(case):
    model = tiny_model(case) if case in FAMILIES else matrix_model(case)[0]
    # No EOS: every step of both generations is a real token (random weights hit EOS early otherwise).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=MATCHING)
def built(request):
    model = _model(request.param)
    rw = kvrewrite.apply(model, "full", max_length=MAX_LENGTH, batch_size=2, prefill_chunk=CHUNK)
    return request.param, model, rw


def _maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


@torch.no_grad()
def test_full_logits_match_hf_every_step(built):
    """Every valid prompt position of every prefill chunk, then 20 decode steps, fed the same tokens."""
    family, model, rw = built
    ids, mask = _inputs()
    n = ids.shape[1]

    # HF reference: one prefill forward over the whole prompt.
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cache = DynamicCache(config=model.config)
    hf = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True).logits

    # kvrewrite: the chunk steps driven through rw(...), as rw.prefill does (left-pad to 3 chunks).
    n_pad = -(-n // CHUNK) * CHUNK
    p = n_pad - n
    rw.reset(int(mask.sum(1).max()), NEW)
    rids = torch.nn.functional.pad(ids, (p, 0))
    valid = torch.nn.functional.pad(mask.bool(), (p, 0), value=False)
    rpos = (valid.long().cumsum(1) - 1).clamp_min(0)
    cpos = torch.arange(-p, n)
    chunks = [rw(rids[:, c:c + CHUNK], rpos[:, c:c + CHUNK], cpos[c:c + CHUNK], valid[:, c:c + CHUNK])
              for c in range(0, n_pad, CHUNK)]
    ours = torch.cat(chunks, dim=1)[:, p:]
    assert ours.shape == hf.shape
    real = mask.bool()
    worst = [("prefill", _maxdiff(ours[real], hf[real]))]

    tok = hf[:, -1].argmax(-1)
    mask_now, next_pos = mask, pos[:, -1] + 1
    for step in range(NEW):
        mask_now = torch.cat([mask_now, torch.ones_like(mask_now[:, :1])], dim=1)
        hf_step = model(input_ids=tok[:, None], attention_mask=mask_now, position_ids=next_pos[:, None],
                        past_key_values=cache, use_cache=True).logits[:, -1]
        valid = torch.ones(2, 1, dtype=torch.bool)
        our_step = rw(tok[:, None], next_pos[:, None], torch.tensor([n + step]), valid)[:, -1]
        worst.append((f"decode {step}", _maxdiff(our_step, hf_step)))
        tok, next_pos = hf_step.argmax(-1), next_pos + 1

    where, diff = max(worst, key=lambda w: w[1])
    assert diff <= ATOL, f"{family}: full vs HF: max abs diff {diff:.3g} > {ATOL} (worst at {where}); all: {worst}"
    print(f"{family}: max abs diff {diff:.3g} ({where})")


@torch.no_grad()
def test_full_generate_matches_hf_generate(built):
    family, model, rw = built
    ids, mask = _inputs()
    ours = rw.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert ours.shape == theirs.shape == (2, PROMPT + NEW)
    diverge = (ours != theirs).any(0).nonzero()
    assert not len(diverge), (
        f"{family}: rw.generate diverges from HF generate at position {int(diverge[0])}:\n{ours[:, PROMPT:]}\n"
        f"vs\n{theirs[:, PROMPT:]}"
    )


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_variant_is_refused_by_name(case):
    """A variant the passes cannot reproduce is refused at apply, naming the model type and the feature."""
    model, fragments = matrix_model(case)
    with pytest.raises((RewriteError, ValueError)) as e:
        kvrewrite.apply(model, "full", max_length=MAX_LENGTH, batch_size=2, prefill_chunk=CHUNK)
    missing = [f for f in fragments if f not in str(e.value)]
    assert not missing, f"{case}: the refusal does not name {missing}: {e.value}"


@pytest.mark.parametrize("case", ["llama-rope-dynamic", "phi3-longrope"])
@torch.no_grad()
def test_seq_len_dependent_rope_is_exact_below_its_switch(case):
    """Dynamic and LongRoPE frequencies are fixed below their switch point (32 here): with max_length at the
    switch (apply's default then), full matches HF's generate; one token more is refused."""
    model = _model(case)
    rw = kvrewrite.apply(model, "full", batch_size=2, prefill_chunk=CHUNK)
    assert rw.max_length == 32
    ids, mask = _inputs(prompt=20)
    ours = rw.generate(ids, attention_mask=mask, max_new_tokens=12)
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="max_length=33"):
        kvrewrite.apply(model, "full", max_length=33, batch_size=2, prefill_chunk=CHUNK)
