"""fuse_attention_observation: H2O's and SnapKV's statistics fused into the attention of every full-attention layer.

On a tiny llama and a tiny Gemma-3 (sliding-window layers, which neither attend with statistics nor fuse): each
graph holds one observed_attention per full-attention layer and no accumulate_attention left; functionalize
(the ONNX/TensorRT road) splits it back; and the fused graph computes exactly what the split one does."""
import copy

import pytest
import torch

import kvrewrite
from kvrewrite.capture import capture
from kvrewrite.export.functional import unfuse_observed_attention
from tests.families import tiny_model

FUSED = torch.ops.kvrewrite.observed_attention.default
ATTENTION = torch.ops.kvrewrite.clustered_attention.default
OBSERVE = torch.ops.kvrewrite.accumulate_attention.default
METHODS = {"h2o": dict(budget=12, interval=4), "snapkv": dict(budget=12, window=4, interval=4)}


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


@pytest.fixture(scope="module")
def captured():
    models = {f: tiny_model(f) for f in ("llama", "gemma3")}
    return {f: (m, capture(m, batch_size=1, prefill_chunk=8)) for f, m in models.items()}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("method", list(METHODS))
def test_every_full_layer_fused(captured, family, method):
    rw = kvrewrite.apply(captured[family][0], method, captured=captured[family][1], max_length=64, prefill_chunk=8, **METHODS[method])
    full = sum(1 for layer in rw.layers if not layer.window)
    for gm in (rw.prefill_graph, rw.decode_graph, rw.decode_compress_graph):
        assert _count(gm, FUSED) == full and _count(gm, OBSERVE) == 0
        assert _count(gm, ATTENTION) == len(rw.layers) - full
        roles = [n.meta["kvrewrite"]["role"] for n in gm.graph.nodes if n.target == FUSED]
        assert roles == ["observed_attention"] * full
        # the module's code is regenerated: it runs the fused op, not the pair the graph held before
        assert gm.code.count("kvrewrite.observed_attention.default(") == full and "accumulate_attention" not in gm.code


def test_split_back_computes_the_same(captured):
    """A prefill chunk and a decode step of the fused graphs against unfuse_observed_attention's copies, from the
    same state: identical logits and state (the CPU op is the two ops in turn), and the copies hold the pair."""
    rw = kvrewrite.apply(captured["llama"][0], "h2o", captured=captured["llama"][1], max_length=64, prefill_chunk=8, **METHODS["h2o"])
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    rw.prefill(ids, torch.ones_like(ids), max_new_tokens=4)
    for gm, T in ((rw.prefill_graph, 8), (rw.decode_compress_graph, 1)):
        split = unfuse_observed_attention(copy.deepcopy(gm))
        assert _count(split, FUSED) == 0 and _count(split, OBSERVE) == _count(split, ATTENTION) == len(rw.layers)
        inputs = (torch.randint(3, 100, (1, T)), torch.arange(8, 8 + T)[None], torch.arange(8, 8 + T),
                  torch.ones(1, T, dtype=torch.bool))
        states = [[t.clone() for t in rw.state_tensors()] for _ in range(2)]
        out = [g(*inputs, *s) for g, s in ((gm, states[0]), (split, states[1]))]
        assert torch.equal(out[0], out[1])
        assert all(torch.equal(a, b) for a, b in zip(*states))
