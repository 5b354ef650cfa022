"""fuse_rms_norm_into_gemv: with gemv=True, every RMSNorm that feeds decode GEMVs (the qkv / q, k, v, gate_up and
lm_head inputs) becomes part of a kvrewrite::gemv_rms_norm, with its residual add; no RMSNorm is left feeding a
gemv; the logits on the CPU (where the op runs the replaced aten ops) are bit for bit those without the pass, in
both HF spellings (Llama's, Gemma's), in bf16 (rounded between the ops). fp32 (where to(h, f32) is h itself, read by
the next residual add): counts and graph diffs on every family in tests/passes/test_passes.py, the same tokens in
tests/passes/test_replace_linear_with_gemv.py."""
import pytest
import torch

import kvrewrite
import kvrewrite.passes
from kvrewrite.passes import fuse_rms_norm_into_gemv
from tests.families import tiny_model

OP = "kvrewrite.gemv_rms_norm.default"
GEMV = "kvrewrite.gemv.default"


def _apply(model, fuse_projections=True):
    return kvrewrite.apply(model, "chelsea", budget=0.5, n_sink=2, n_recent=4, chunk=8, interval=4, max_length=64,
                           prefill_chunk=16, gemv=True, fuse_projections=fuse_projections)


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == target]


def _norm_feeds_a_gemv(gm) -> bool:
    """Whether a gemv is within 5 uses of an rsqrt (the longest RMSNorm spelling: rsqrt, mul, mul, type_as, alias)."""
    front = set(_nodes(gm, "aten.rsqrt.default"))
    for _ in range(5):
        front = {u for n in front for u in n.users}
        if any(str(n.target) == GEMV for n in front):
            return True
    return False


# n_ops: one per gemv after a norm; n_adds: the residual adds taken in (all but the first layer's input norm)
@pytest.mark.parametrize("family, dtype, fuse_projections, n_ops, n_adds", [
    ("llama", torch.bfloat16, True, 2 * 2 + 1, 4),   # qkv, gate_up per layer, the lm_head
    ("llama", torch.bfloat16, False, 5 * 2 + 1, 4),  # q, k, v, gate, up: one op each, one add per norm
    ("gemma3", torch.bfloat16, True, 2 * 3 + 1, 6),  # (1 + weight) spelling; q/k norms and post-norms stay
])
@torch.no_grad()
def test_norms_fused_and_logits_bit_identical(monkeypatch, family, dtype, fuse_projections, n_ops, n_adds):
    model = tiny_model(family, dtype=dtype)
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    fused = _apply(model, fuse_projections)
    with monkeypatch.context() as m:
        m.setattr(kvrewrite.passes, "PASSES", [p for p in kvrewrite.passes.PASSES if p is not fuse_rms_norm_into_gemv])
        plain = _apply(model, fuse_projections)
    for name in ("decode", "decode_compress"):
        gm, before = getattr(fused, f"{name}_graph"), getattr(plain, f"{name}_graph")
        ops = _nodes(gm, OP)
        assert len(ops) == n_ops, f"{name}: {len(ops)} ops"
        assert len(ops) + len(_nodes(gm, GEMV)) == len(_nodes(before, GEMV))
        assert _norm_feeds_a_gemv(before) and not _norm_feeds_a_gemv(gm)
        assert sum(n.args[1] is not None for n in ops) == n_adds, [n.args[:2] for n in ops]
        assert not [n for n in gm.graph.nodes if str(n.target) == "aten.add.Tensor" and n.users and
                    all(str(u.target) == OP for u in n.users)], "an add left to feed only the ops"
    assert not _nodes(fused.prefill_graph, OP)
    kw = dict(max_new_tokens=6, return_dict_in_generate=True, output_logits=True)
    a, b = fused.generate(ids, **kw), plain.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
