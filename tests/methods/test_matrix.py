"""Every entry of tests/methods_matrix.py runs end to end on a tiny llama: apply, prefill a left-padded
batch of 2, 8 greedy tokens; logits stay finite, every layer's fill stays within its static capacity,
and the compressing methods really compress (fewer slots than tokens seen; ClusterKV keeps every token and
attends to a selection of them)."""
import pytest
import torch

import kvrewrite
from tests.families import tiny_model
from tests.methods_matrix import METHODS_MATRIX, budget_fraction

N_PROMPT, MAX_NEW = 26, 8  # 26: the prompt is left-padded to 4 chunks of 8




@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_matrix_is_ordered_and_covers_every_method():
    assert {e["name"] for e in METHODS_MATRIX} == set(kvrewrite.METHODS)
    assert METHODS_MATRIX[0]["name"] == "full"
    budgets = [budget_fraction(e) for e in METHODS_MATRIX]
    assert budgets == sorted(budgets, reverse=True)  # mild to aggressive


@pytest.mark.parametrize("entry", METHODS_MATRIX, ids=[f"{e['name']}-{e['kwargs'].get('budget', 1.0)}" for e in METHODS_MATRIX])
def test_method_generates(llama, captured, entry):
    assert (captured.batch_size, captured.prefill_chunk) == (2, 8)  # tests/methods/conftest.py's capture
    rw = kvrewrite.apply(llama, entry["name"], max_length=64, captured=captured, **entry["kwargs"])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (2, N_PROMPT), generator=g)
    mask = torch.ones(2, N_PROMPT, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    logits = rw.prefill(ids, mask, max_new_tokens=MAX_NEW)
    out = []
    for step in range(MAX_NEW):
        assert logits.shape == (2, 128) and torch.isfinite(logits).all(), step
        for info, cap in zip(rw.layers, rw.capacities):
            st = rw.layer_state(info.index)
            assert (st["fill"] <= cap).all() and (st["fill"] <= st["keys"].shape[2]).all()
        out.append(logits.argmax(-1))
        if step < MAX_NEW - 1:
            logits = rw.decode_step(out[-1])
    seen = N_PROMPT + MAX_NEW - 1
    fill = torch.stack([rw.layer_state(i.index)["fill"] for i in rw.layers])
    if entry["name"] in ("full", "clusterkv"):
        assert (fill == 32 + MAX_NEW - 1).all()  # 26 tokens left-padded to 4 chunks of 8, nothing dropped
    else:
        assert int(fill.max()) < seen
    # generate() gives the same greedy tokens
    gen = rw.generate(ids, mask, max_new_tokens=MAX_NEW)
    assert gen.shape == (2, N_PROMPT + MAX_NEW)
    assert torch.equal(gen[:, N_PROMPT:], torch.stack(out, 1))
