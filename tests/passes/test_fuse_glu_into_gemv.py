"""fuse_glu_into_gemv: the gated MLP's act(gate) * up folds into its down projection's gemv (kvrewrite::gemv_glu)
and nothing else changes: on the CPU, where the op runs the aten ops it replaces, the logits and tokens of a
decode with the pass equal those without it bit for bit. What it must leave alone (an act or product with other
users, inputs the op refuses) on small traced graphs. Counts per family: test_passes.py and
test_replace_linear_with_gemv.py."""
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import kvrewrite
import kvrewrite.passes
from kvrewrite.context import RewriteContext
from kvrewrite.passes import fuse_glu_into_gemv
from tests.families import tiny_model

GLU = "kvrewrite.gemv_glu.default"
GEMV = torch.ops.kvrewrite.gemv.default


def _targets(gm) -> list:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("family, fuse", [("llama", True), ("gemma3", False), ("phi3", False)])
@torch.no_grad()
def test_logits_and_tokens_are_bit_identical_on_cpu(family, fuse, monkeypatch):
    """llama: silu of the fused gate/up's slices; gemma3: gelu tanh of two gemvs; phi3: up * silu(gate) of a chunk."""
    from kvrewrite.capture import capture

    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    captured = capture(model, batch_size=1, prefill_chunk=16)

    def run():
        rw = kvrewrite.apply(model, "chelsea", max_length=64, prefill_chunk=16, gemv=True, fuse_projections=fuse,
                             captured=captured, budget=0.5, n_sink=2, n_recent=4, chunk=8, interval=4)
        ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
        return rw, rw.generate(ids, max_new_tokens=6, return_dict_in_generate=True, output_logits=True)

    rw, fused = run()
    assert _targets(rw.decode_graph).count(GLU) == len(rw.layers)
    products = [n.args[0] for n in rw.decode_graph.graph.nodes
                if n.target is GEMV and n.args[0].target is torch.ops.aten.mul.Tensor]  # RMSNorm's weight * x
    assert not {"aten.silu.default", "aten.gelu.default"} & {str(getattr(a, "target", "")) for p in products
                                                             for a in p.args}  # no act * up left on a gemv
    monkeypatch.setattr(kvrewrite.passes, "PASSES", [p for p in kvrewrite.passes.PASSES if p is not fuse_glu_into_gemv])
    plain_rw, plain = run()
    assert GLU not in _targets(plain_rw.decode_graph)
    assert torch.equal(fused.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(fused.logits, plain.logits, strict=True))


W = torch.randn(8, 16)


def _pass(fn, *args, gemv=True, kind="decode"):
    gm = make_fx(fn)(*args)  # W: a get_attr constant, as the weights are
    ctx = RewriteContext("toy", None, [], graph_kind=kind, gemv=gemv)
    gm = fuse_glu_into_gemv(gm, ctx)
    return _targets(gm), ctx.counters["fuse_glu_into_gemv"]


def test_fuses_either_operand_order_and_each_act():
    a, b = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    for fn, act in ((lambda a, b: GEMV(F.silu(a) * b, W), "silu"),
                    (lambda a, b: GEMV(b * F.gelu(a, approximate="tanh"), W), "gelu_tanh"),
                    (lambda a, b: GEMV(F.gelu(a) * b, W), "gelu")):
        targets, n = _pass(fn, a, b)
        assert n == 1 and GLU in targets and "aten.mul.Tensor" not in targets, act
        gm = make_fx(fn)(a, b)
        fuse_glu_into_gemv(gm, RewriteContext("toy", None, [], gemv=True))
        assert [n.args[4] for n in gm.graph.nodes if str(n.target) == GLU] == [act]
        assert torch.equal(gm(a, b), fn(a, b))  # the CPU path: the same aten ops


def test_leaves_alone_what_it_must_not_fuse():
    a, b = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    cases = {
        "act read twice": lambda a, b: (GEMV(F.silu(a) * b, W), F.silu(a).sum()),  # make_fx keeps two silu nodes
        "act with another user": lambda a, b: (lambda s: (GEMV(s * b, W), s + 1))(F.silu(a)),
        "product with another user": lambda a, b: (lambda p: (GEMV(p, W), p + 1))(F.silu(a) * b),
        "not an act": lambda a, b: GEMV(torch.tanh(a) * b, W),
        "gemv of a broadcast product": lambda a, b: GEMV(F.silu(a) * b[..., :1], W),
    }
    for name, fn in cases.items():
        targets, n = _pass(fn, a, b)
        want = 1 if name == "act read twice" else 0
        assert (n, targets.count(GLU)) == (want, want), name
    assert _pass(lambda a, b: GEMV(F.silu(a) * b, W), a, b, gemv=False)[1] == 0
    assert _pass(lambda a, b: GEMV(F.silu(a) * b, W), a, b, kind="prefill")[1] == 0
