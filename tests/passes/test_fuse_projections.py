"""fuse_projections: q/k/v and gate/up become one matmul each, the function is unchanged, no weight is
stored twice, the fused tensors are made once per capture, and the graphs still export."""
import pytest
import torch

import kvrewrite
import kvrewrite.export
from kvrewrite.capture import capture
from kvrewrite.export import loader
from tests.families import FAMILIES, tiny_model

LINEAR = torch.ops.aten.linear.default
CHELSEA = dict(budget=0.5, n_sink=2, n_recent=4, chunk=8, interval=4)  # compresses in prefill and at decode steps
# linear nodes per decoder layer before -> after (Phi-3 ships qkv_proj and gate_up_proj fused already)
PER_LAYER = {"phi3": (4, 4)}


def _ids(seed=0, n=40, batch=2):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _linears(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR)


def _apply(model, fuse, **kw):
    return kvrewrite.apply(model, "chelsea", max_length=64, batch_size=2, prefill_chunk=16, fuse_projections=fuse,
                           **CHELSEA, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_same_tokens_and_logits_fewer_matmuls(family):
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    ids = _ids()
    hf_before = model(ids).logits
    cap = capture(model, batch_size=2, prefill_chunk=16)  # one capture, rewritten with and without the fusion
    plain = _apply(model, False, captured=cap)
    fused = _apply(model, True, captured=cap)
    assert torch.equal(model(ids).logits, hf_before)  # the model's own forward over the rebound weights
    before, after = PER_LAYER.get(family, (7, 4))
    layers = len(plain.layers)
    for name in ("prefill_graph", "decode_graph", "decode_compress_graph"):
        assert _linears(getattr(plain, name)) == before * layers + 1, name  # + lm_head
        assert _linears(getattr(fused, name)) == after * layers + 1, name
    torch.testing.assert_close(fused.prefill(ids, max_new_tokens=8), plain.prefill(ids, max_new_tokens=8),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.generate(ids, max_new_tokens=8), plain.generate(ids, max_new_tokens=8))


def test_qwen2_biases_are_fused():
    model = tiny_model("qwen2")
    rw = _apply(model, True)
    attn = model.model.layers[0].self_attn
    fused_w = rw.decode_graph.kvrewrite_fused_0_weight
    fused_b = rw.decode_graph.kvrewrite_fused_0_bias
    n = attn.q_proj.weight.shape[0] + attn.k_proj.weight.shape[0] + attn.v_proj.weight.shape[0]
    assert fused_w.shape == (n, attn.q_proj.weight.shape[1]) and fused_b.shape == (n,)
    assert attn.v_proj.bias.untyped_storage().data_ptr() == fused_b.untyped_storage().data_ptr()


def test_no_weight_is_stored_twice_and_one_capture_fuses_once():
    model = tiny_model("llama")
    cap = capture(model, batch_size=2, prefill_chunk=16)
    a = _apply(model, True, captured=cap)
    b = _apply(model, True, captured=cap)
    mlp = model.model.layers[1].mlp
    fused = a.decode_graph.kvrewrite_fused_3_weight  # layer 1: q/k/v is group 2, gate/up group 3
    assert fused.shape[0] == mlp.gate_proj.weight.shape[0] + mlp.up_proj.weight.shape[0]
    for p in (mlp.gate_proj.weight, mlp.up_proj.weight):
        assert p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert p.is_contiguous()
    for rw in (a, b):  # every graph of every apply on the capture holds the same tensors
        for name in ("prefill_graph", "decode_graph", "decode_compress_graph"):
            assert getattr(rw, name).kvrewrite_fused_3_weight is fused
    assert len(cap.fused_weights) == 2 * len(a.layers)
    total = sum(p.numel() for p in model.parameters())
    assert sum(t.numel() for t in {id(t): t for t in model.parameters()}.values()) == total  # no new parameters


def test_off_by_default_leaves_the_model_alone():
    model = tiny_model("llama")
    q = model.model.layers[0].self_attn.q_proj.weight
    ptr = q.untyped_storage().data_ptr()
    rw = kvrewrite.apply(model, "chelsea", max_length=64, batch_size=2, prefill_chunk=16, **CHELSEA)
    assert q.untyped_storage().data_ptr() == ptr
    assert not any(k.startswith("kvrewrite_fused_") for k, _ in rw.decode_graph.named_buffers())
    with pytest.raises(ValueError, match="fuse_projections must be True or False"):
        kvrewrite.apply(model, "chelsea", fuse_projections="yes", **CHELSEA)


@torch.no_grad()
def test_fused_graphs_export_and_reproduce_generate(tmp_path):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    rw = _apply(model, True)
    path = kvrewrite.export.torch_export(rw, tmp_path)
    ids = _ids(seed=3, n=24)
    assert torch.equal(loader.load(path).generate(ids, max_new_tokens=6), rw.generate(ids, max_new_tokens=6))
