"""normalize_eager_attention: HF eager attention (matmul-softmax-matmul) becomes one SDPA node.

Every family is captured once (module-scoped fixture) through `kvrewrite.apply(model, "full")`, with the
pass wrapped in place in PASSES so the graph right after it can be checked; the same run then checks
the end-to-end numerics against HF's eager model.
"""
import logging

import pytest
import torch

import kvrewrite
import kvrewrite.passes as passes
from kvrewrite.capture import _to_plain_graph_module, layer_of
from kvrewrite.context import RewriteContext
from kvrewrite.passes.normalize_eager_attention import SOFTCAP_META, normalize_eager_attention
from kvrewrite.passes.utils import trace_to_source
from tests.families import tiny_model

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
# op -> change in count per layer (Phi-3's residual dropouts stay: only attention's goes)
OP_DELTAS = {SDPA: +1, aten.softmax.int: -1, aten.dropout.default: -1, aten.matmul.default: -2}
# fp32 tiny models: the rewritten path only changes the order of fp32 sums.
TOL = dict(atol=1e-5, rtol=1e-5)
B, CHUNK, MAX_LENGTH = 2, 16, 128
N_PROMPT, N_PAD, N_NEW = 20, 7, 6  # 20-token prompt (2 prefill chunks), row 1 left-padded by 7


def _op_counts(gm) -> dict:
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return {op: targets.count(op) for op in OP_DELTAS}


def _summary(gm, ctx, counts_before) -> dict:
    """What the graph looks like right after normalize_eager_attention."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return {
        "kind": ctx.graph_kind,
        "count": ctx.counters["normalize_eager_attention"],
        "op_counts": (counts_before, _op_counts(gm)),
        "sdpa": [
            {
                "layer": layer_of(n),
                "q": tuple(n.args[0].meta["val"].shape),
                "out": tuple(n.meta["val"].shape),
                "dtype": n.meta["val"].dtype,
                "sources": [trace_to_source(a) for a in n.args[1:3]],
                "kwargs": dict(n.kwargs),
            }
            for n in calls
            if n.target == SDPA
        ],
    }


@pytest.fixture(scope="module")
def eager_run(family):
    """(model, rewritten model, [summary of the prefill and decode graphs after this pass])."""
    model = tiny_model(family, attn="eager")
    assert normalize_eager_attention in passes.PASSES
    after = []

    def spy(gm, ctx):
        counts_before = _op_counts(gm)
        gm = normalize_eager_attention(gm, ctx)
        after.append((_summary(gm, ctx, counts_before), ctx.cache_buffers))
        return gm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(passes, "PASSES", [spy if p is normalize_eager_attention else p for p in passes.PASSES])
        rw = kvrewrite.apply(model, "full", batch_size=B, prefill_chunk=CHUNK, max_length=MAX_LENGTH)
    return model, rw, after


def test_rewrites_every_layer(eager_run):
    model, rw, after = eager_run
    layers = rw.layers
    assert [s["kind"] for s, _ in after] == ["prefill", "decode", "decode"]  # decode: plain + with compression
    for s, cache in after:
        T = CHUNK if s["kind"] == "prefill" else 1
        assert s["count"] == len(layers), s
        before, now = s["op_counts"]
        assert now[aten.softmax.int] == 0, f"{s['kind']}: {now[aten.softmax.int]} softmax left"
        deltas = {op: now[op] - before[op] for op in OP_DELTAS}
        assert deltas == {op: d * len(layers) for op, d in OP_DELTAS.items()}, f"{s['kind']}: {before} -> {now}"
        assert sorted(a["layer"] for a in s["sdpa"]) == list(range(len(layers)))
        for a in s["sdpa"]:
            info = layers[a["layer"]]
            # the eager output [B, Hq, T, D] (before HF's transpose(1, 2)), in the model dtype
            assert a["q"] == a["out"] == (B, info.num_heads, T, info.head_dim)
            assert a["dtype"] == model.dtype
            assert [n.op for n in a["sources"]] == ["get_attr", "get_attr"] and all(
                n.target in cache for n in a["sources"]), a["sources"]
            assert a["kwargs"]["scale"] == pytest.approx(model.model.layers[a["layer"]].self_attn.scaling)
            assert a["kwargs"]["attn_mask"] is not None


def _prompt(vocab_size):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab_size, (B, N_PROMPT), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :N_PAD], mask[1, :N_PAD] = 0, 0
    return ids, mask


def test_full_matches_hf_eager(eager_run):
    model, rw, _ = eager_run
    ids, mask = _prompt(model.config.get_text_config().vocab_size)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ours = rw.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, eos_token_id=[])
    new = slice(N_PROMPT, None)
    assert torch.equal(ours, hf.sequences), f"ours {ours[:, new].tolist()} vs HF {hf.sequences[:, new].tolist()}"

    # step logits, fed HF's tokens
    logits = rw.prefill(ids, mask, max_new_tokens=N_NEW)
    for step, ref in enumerate(hf.logits):
        diff = (logits - ref).abs().max().item()
        torch.testing.assert_close(logits, ref, **TOL, msg=f"step {step}: max abs diff {diff:.3g}")
        if step + 1 < len(hf.logits):
            logits = rw.decode_step(hf.sequences[:, N_PROMPT + step])


# -- a hand-made eager attention: HF's own eager_attention_forward around given q, k, v ------------------
class _EagerAttention(torch.nn.Module):
    """q [B, Hq, T, D], k/v [B, Hkv, S, D]; returns [B, T, Hq, D] like HF (and the weights, if asked)."""

    num_key_value_groups = 2

    def __init__(self, return_weights=False, softcap=None):
        super().__init__()
        self.return_weights, self.softcap = return_weights, softcap
        self.head_dim = 16

    def forward(self, q, k, v, mask=None):
        if self.softcap is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward

            out, weights = eager_attention_forward(self, q, k, v, mask, scaling=0.3)
        else:  # Gemma-2/3 attn_logit_softcapping
            from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

            out, weights = eager_attention_forward(self, q, k, v, mask, scaling=0.3, softcap=self.softcap)
        return (out, weights) if self.return_weights else out


def _toy_inputs(with_mask=True):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 7, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g)
    mask = torch.zeros(2, 1, 5, 7)
    mask[1, ..., :3] = torch.finfo(torch.float32).min  # row 1 left-padded
    mask[..., 4:] += torch.triu(torch.full((5, 3), torch.finfo(torch.float32).min), 1)  # causal tail
    return (q, k, v, mask) if with_mask else (q, k, v)


def _export(mod, args):
    """Captured the way kvrewrite.capture does it (its dtype assertions would count as escapes)."""
    return _to_plain_graph_module(torch.export.export(mod.eval(), args, strict=False).module())


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
def test_toy_attention_is_rewritten_exactly(with_mask):
    mod, args = _EagerAttention(), _toy_inputs(with_mask)
    gm = _export(mod, args)
    ctx = RewriteContext("toy", None, [])
    gm = normalize_eager_attention(gm, ctx)
    assert ctx.counters["normalize_eager_attention"] == 1
    targets = _targets(gm)
    assert {op: targets.count(op) for op in OP_DELTAS} == {op: max(d, 0) for op, d in OP_DELTAS.items()}
    sdpa = next(n for n in gm.graph.nodes if n.target == SDPA)
    assert ("attn_mask" in sdpa.kwargs) == with_mask and sdpa.kwargs["scale"] == 0.3
    expected = mod(*args)
    torch.testing.assert_close(gm(*args), expected, **TOL)


def test_softcapped_attention_keeps_its_cap():
    """Gemma-2's cap * tanh(s / cap) becomes SDPA carrying the cap in meta (the end-to-end numerics are the
    Gemma-2/3 soft-cap cases of tests/test_full_matches_hf.py)."""
    mod, args = _EagerAttention(softcap=5.0), _toy_inputs()
    gm = _export(mod, args)
    ctx = RewriteContext("toy", None, [])
    gm = normalize_eager_attention(gm, ctx)
    assert ctx.counters["normalize_eager_attention"] == 1
    sdpa = next(n for n in gm.graph.nodes if n.target == SDPA)
    assert sdpa.meta[SOFTCAP_META] == 5.0 and sdpa.kwargs["scale"] == 0.3
    assert torch.ops.aten.tanh.default not in _targets(gm)


class _TanhScores(_EagerAttention):
    """tanh(scores) without the cap's division and multiplication: not a soft cap, left alone."""

    def forward(self, q, k, v, mask=None):
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        w = torch.softmax(torch.tanh(torch.matmul(q, k.transpose(2, 3)) * 0.3) + mask, dim=-1)
        return torch.matmul(w, v)


@pytest.mark.parametrize("mod", [_EagerAttention(return_weights=True), _TanhScores()],
                         ids=["weights_returned", "tanh_not_a_cap"])
def test_toy_attention_is_left_alone(mod, caplog):
    args = _toy_inputs()
    gm = _export(mod, args)
    before = gm.code
    ctx = RewriteContext("toy", None, [])
    with caplog.at_level(logging.DEBUG, logger="kvrewrite.passes.normalize_eager_attention"):
        gm = normalize_eager_attention(gm, ctx)
    assert ctx.counters["normalize_eager_attention"] == 0
    assert gm.code == before and SDPA not in _targets(gm)
    reason = "escapes" if mod.return_weights else "tanh"
    assert any("skipped" in r.getMessage() and reason in r.getMessage() for r in caplog.records), caplog.text
