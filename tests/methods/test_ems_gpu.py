"""EMS on a GPU inside the rewritten model: the ops' CUDA path (today their references: the Triton kernels are still
to come, docs/methods.md) gives the CPU run's logits and state (batch 2 with left padding, compressions every 3
tokens with merges into the table; both key variants), eagerly and with the decode steps replayed from CUDA graphs
(rw.compile(mode="reduce-overhead"): no host read inside the ops)."""
import pytest
import torch

import kvrewrite
from tests.families import tiny_model
from tests.methods.tiny_runs import CHUNK, prompt, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OPTS = dict(budget=10, interval=3, window=4, kernel=3, max_length=48, batch_size=2, prefill_chunk=CHUNK)
STEPS = 12
TAU = {"without": 0.6, "with": 0.0}  # post-RoPE keys of the tiny model reach no centre at 0.6: merge every TBM there


@pytest.fixture(scope="module")
def reference():
    model = tiny_model("llama")
    out = {}
    for pos in ("without", "with"):
        rw = kvrewrite.apply(model, "ems", pos=pos, tau=TAU[pos], **OPTS)
        ids, mask = prompt()
        logits, fed = run(rw, ids, mask, STEPS)
        out[pos] = logits, fed, {f: t.clone() for f, t in rw.layer_state(0).items()}
    return out


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("pos", ["without", "with"])
def test_cuda_matches_the_cpu_run(reference, pos, compiled):
    want, fed, want_state = reference[pos]
    rw = kvrewrite.apply(tiny_model("llama").cuda(), "ems", pos=pos, tau=TAU[pos], **OPTS)
    if compiled:
        rw.compile(mode="reduce-overhead")
    ids, mask = prompt()
    fed = fed.cuda()
    got = [rw.prefill(ids.cuda(), mask.cuda(), max_new_tokens=STEPS + 1).clone()]  # CUDA-graph outputs are reused
    for i in range(STEPS):
        got.append(rw.decode_step(fed[:, i]).clone())
    torch.testing.assert_close(torch.stack(got, 1).cpu(), want, atol=1e-4, rtol=1e-4)
    st = rw.layer_state(0)
    assert bool((want_state["slot_fill"] > want_state["fill"]).any()), "nothing merged: the test is too weak"
    for f in ("fill", "slot_fill", "lut", "entry_start", "token_pos", "slot_order", "slot_pos"):
        assert torch.equal(st[f].cpu(), want_state[f]), f
    for f in ("keys", "values", "key_scale", "s_glo"):
        torch.testing.assert_close(st[f].cpu(), want_state[f], atol=1e-4, rtol=1e-4, msg=f)
