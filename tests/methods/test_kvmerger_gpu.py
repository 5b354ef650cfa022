"""KVMerger on a GPU inside the rewritten model: the Triton kernels (the op's CUDA path) give the logits and the state
of the CPU reference (batch 2 with left padding, re-merges every 3 tokens, both value options), eagerly and with
the decode steps replayed from CUDA graphs (rw.compile(mode="reduce-overhead"): no host read inside the op)."""
import pytest
import torch

import kvrewrite
from kvrewrite.kernels import kvmerger_compress as op
from tests.families import tiny_model
from tests.methods.tiny_runs import CHUNK, prompt, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OPTS = dict(budget=12, interval=3, max_length=48, batch_size=2, prefill_chunk=CHUNK)
STEPS = 12  # four re-merges after the prompt's
FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "score", "degree", "deficit")


@pytest.fixture(scope="module")
def reference():
    """The CPU run: logits, the tokens fed, layer 0's state."""
    model = tiny_model("llama")
    out = {}
    for values in ("scale", "bias"):
        rw = kvrewrite.apply(model, "kvmerger", values=values, **OPTS)
        ids, mask = prompt()
        logits, fed = run(rw, ids, mask, STEPS)
        out[values] = logits, fed, {f: t.clone() for f, t in rw.layer_state(0).items()}
    return out


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("values", ["scale", "bias"])
def test_cuda_kernels_match_the_cpu_reference(reference, values, compiled):
    assert op._cuda_impl("chain", "exact", 64) is not None, "the CUDA path must be the Triton kernels here"
    want, fed, want_state = reference[values]
    rw = kvrewrite.apply(tiny_model("llama").cuda(), "kvmerger", values=values, **OPTS)
    if compiled:
        rw.compile(mode="reduce-overhead")
    ids, mask = prompt()
    fed = fed.cuda()
    got = [rw.prefill(ids.cuda(), mask.cuda(), max_new_tokens=STEPS + 1).clone()]  # CUDA-graph outputs are reused
    for i in range(STEPS):
        got.append(rw.decode_step(fed[:, i]).clone())
    got = torch.stack(got, 1)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    st = rw.layer_state(0)
    for f in ("fill", "slot_pos", "degree", "deficit"):
        assert torch.equal(st[f].cpu(), want_state[f]), f
    fin = ~torch.isinf(want_state["bias"])
    assert torch.equal(torch.isinf(st["bias"].cpu()), ~fin)
    for f in ("keys", "values"):
        live = fin[..., None].expand_as(want_state[f])
        torch.testing.assert_close(st[f].cpu()[live], want_state[f][live], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st["score"].cpu(), want_state["score"], atol=1e-5, rtol=1e-5)
