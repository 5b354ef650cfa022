"""ClusterGen (both methods) on a GPU inside the rewritten model, every family of tests/families.py: the ops' CUDA
path (the Triton kernels of sketch_attention, clustergen_fold and kcenter_compress) gives the CPU
run's logits and decisions (batch 2 with left padding, folds every 3 tokens), eagerly and with the decode steps
replayed from CUDA graphs (rw.compile(mode="reduce-overhead")); the fold and the attention read nothing back."""
import pytest
import torch

import kvrewrite
from tests.families import FAMILIES, tiny_model
from tests.methods.tiny_runs import CHUNK, prompt, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 9
OPTS = {"clustergen": dict(budget=16, n_sink=2, window=4, t=2, interval=3),
        "clustergen-kcenter": dict(budget=10, interval=3)}
DECISIONS = {"clustergen": ("fill", "n_clusters", "count", "n_seen", "n_forced", "role", "slot_pos"),
             "clustergen-kcenter": ("fill", "slot_pos")}


def _apply(model, method):
    return kvrewrite.apply(model, method, max_length=48, batch_size=2, prefill_chunk=CHUNK, **OPTS[method])


@pytest.mark.parametrize("method", list(OPTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_matches_the_cpu_run(family, method):
    model = tiny_model(family)
    ids, mask = prompt()
    cpu = _apply(model, method)
    want, fed = run(cpu, ids, mask, STEPS)
    gpu = _apply(model.cuda(), method)
    got, _ = run(gpu, ids.cuda(), mask.cuda(), STEPS, fed.cuda())
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    for info in cpu.layers:
        a, b = cpu.layer_state(info.index), gpu.layer_state(info.index)
        for f in DECISIONS[method] if not info.window else ("fill",):
            assert torch.equal(b[f].cpu(), a[f]), f"{family} layer {info.index}: {f}"
    if method == "clustergen":
        last = cpu.layer_state(cpu.layers[-1].index)
        assert int(last["n_seen"].min()) > 0, "nothing was folded: the test is too weak"


@pytest.mark.parametrize("method", list(OPTS))
def test_cuda_graphs_replay_the_eager_steps(method):
    model = tiny_model("llama").cuda()
    ids, mask = prompt()
    want, fed = run(_apply(model, method), ids.cuda(), mask.cuda(), STEPS)
    rw = _apply(model, method)
    rw.compile(mode="reduce-overhead")
    got = [rw.prefill(ids.cuda(), mask.cuda(), max_new_tokens=STEPS + 1).clone()]  # CUDA-graph outputs are reused
    for i in range(STEPS):
        got.append(rw.decode_step(fed[:, i]).clone())
    torch.testing.assert_close(torch.stack(got, 1), want, atol=1e-4, rtol=1e-4)


def test_fold_and_attention_read_nothing_back():
    """The compression and attention ops of a decode step under torch.cuda.set_sync_debug_mode("error"), on a state
    with a due row (the fold's every path runs: calibration is done, leaders and reservoirs are drawn)."""
    rw = _apply(tiny_model("llama").cuda(), "clustergen")
    ids, mask = prompt()
    run(rw, ids.cuda(), mask.cuda(), 2)
    st = {k: v.clone() for k, v in rw.layer_state(0).items()}
    st["fill"][0, 0] = st["budget"][1]  # row (0, 0) due: its last exact tokens fold
    kw = rw.method.compression_call(rw.layers[0])[1]
    fields = [st[f] for f in ("role", "rep", "count", "n_clusters", "mu", "delta", "n_seen", "n_forced")]
    q = torch.randn(2, 4, 1, st["keys"].shape[-1], device="cuda")
    cpos = torch.tensor([40], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.ops.kvrewrite.clustergen_fold(st["keys"], st["values"], st["bias"], st["slot_pos"], st["fill"],
                                            st["budget"], *fields, **kw)
        torch.ops.kvrewrite.sketch_attention(q, st["keys"], st["values"], st["bias"], st["slot_pos"], cpos, st["role"],
                                             scale=0.25, past_only=True, softcap=0.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(st["n_seen"][0, 0]) > int(rw.layer_state(0)["n_seen"][0, 0]), "the due row did not fold"
