"""find_pre_rope_key over the family matrix: the key it finds is HF's pre-RoPE key_states, exactly.

HF's key_states are read by wrapping the modeling module's apply_rotary_pos_emb(q, k, cos, sin) (every family
here calls it with the whole [B, Hkv, T, D] key, partial rotary included), with the layer taken from a
pre-hook on the attention module. The graph's key comes from running the captured prefill graph (after
normalize_eager_attention and locate_attention_sites, where replace_kv_cache_update calls the finder) with an
fx.Interpreter on the same tokens.
"""

import pytest
import torch
from torch import fx

import kvrewrite  # noqa: F401  (registers the kvrewrite:: ops)
from kvrewrite.capture import capture
from kvrewrite.context import RewriteContext
from kvrewrite.errors import RewriteError
from kvrewrite.methods import make_method
from kvrewrite.passes.locate_attention_sites import locate_attention_sites
from kvrewrite.passes.normalize_eager_attention import normalize_eager_attention
from kvrewrite.passes.pre_rope import find_pre_rope_key, pre_rope_key
from tests.families import tiny_model
from tests.passes.hf_pre_rope import hf_pre_rope_keys

T = 8
# half-split RoPE (llama), fused qkv (phi3), qk-norm (qwen3; gemma3 with sliding layers too), partial rotary
# (gpt_neox), interleaved (cohere), NoPE layers (smollm3), absolute positions (gpt2)
CASES = ("llama", "phi3", "qwen3", "gemma3", "gpt_neox", "cohere", "smollm3-nope-layers", "gpt2")


def _graph_values(gm, ids, nodes) -> dict:
    """{node: value} of `nodes` when the captured prefill graph runs on ids (positions 0..T-1)."""
    want, out = set(nodes), {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            if n in want:
                out[n] = r.detach().clone()
            return r

    pos = torch.arange(T)[None]
    with torch.no_grad():
        Recorder(gm).run(ids, pos, torch.arange(T))
    return out


@pytest.mark.parametrize("case", CASES)
def test_found_key_is_hf_pre_rope_key(case):
    model = tiny_model(case)
    c = capture(model, batch_size=1, prefill_chunk=T)
    ctx = RewriteContext(c.model_tag, make_method("full"), c.layers, graph_kind="prefill",
                         cache_buffers=c.cache_buffers)
    gm = locate_attention_sites(normalize_eager_attention(c.graphs["prefill"], ctx), ctx)
    found = {}
    for layer, site in sorted(ctx.sites.items()):
        k_post = site.key_update.args[3]
        found[layer] = (pre_rope_key(gm, k_post, ctx.where(layer, k_post)), k_post)
    gm.graph.lint()
    gm.recompile()
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (1, T))
    hf = hf_pre_rope_keys(model, ids)
    values = _graph_values(gm, ids, [n for pair in found.values() for n in pair])
    roped = [layer for layer in found if layer in hf]
    if case == "gpt2":
        assert not roped
    elif case == "smollm3-nope-layers":
        assert 0 < len(roped) < len(found)  # both kinds of layer are checked
    else:
        assert roped == sorted(found)
    for layer, (k_pre, k_post) in found.items():
        if layer not in hf:  # no rotation: the key is the cache's key itself
            assert k_pre is k_post and find_pre_rope_key(gm, k_post) == (k_post, [])
            continue
        want, got, post = hf[layer], values[k_pre], values[k_post]
        assert got.shape == post.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{case} layer {layer}")
        assert not torch.allclose(post[:, :, 1:], want[:, :, 1:], atol=1e-3)  # RoPE moved the keys: not vacuous


def test_unresolvable_rotation_names_the_layer():
    """A rotation whose key-side inputs have no common source of the key's shape (two separate projections)."""
    g = fx.Graph()
    ids, pos = g.placeholder("input_ids"), g.placeholder("position_ids")

    def call(target, *args, val):
        n = g.call_function(target, args)
        n.meta["val"] = val
        n.meta["nn_module_stack"] = {"attn": ("model.layers.3.self_attn", object)}
        return n

    x = torch.randn(1, 8, 16)
    emb = call(torch.ops.aten.relu.default, ids, val=x)
    other = call(torch.ops.aten.sigmoid.default, ids, val=x)
    a = call(torch.ops.aten.view.default, emb, [1, 8, 1, 16], val=x.view(1, 8, 1, 16))
    b = call(torch.ops.aten.view.default, other, [1, 8, 1, 16], val=x.view(1, 8, 1, 16))
    cos = call(torch.ops.aten.cos.default, pos, val=x.view(1, 8, 1, 16))
    sin = call(torch.ops.aten.sin.default, pos, val=x.view(1, 8, 1, 16))
    r = call(torch.ops.aten.add.Tensor, call(torch.ops.aten.mul.Tensor, a, cos, val=a.meta["val"]),
             call(torch.ops.aten.mul.Tensor, b, sin, val=a.meta["val"]), val=a.meta["val"])
    k_post = call(torch.ops.aten.transpose.int, r, 1, 2, val=x.view(1, 1, 8, 16))
    g.output(k_post)
    gm = fx.GraphModule(torch.nn.Module(), g)
    names = f"layer 3: cannot find the pre-RoPE key of '{k_post.name}'.*inputs '{a.name}', '{b.name}'"
    with pytest.raises(RewriteError, match=names):
        find_pre_rope_key(gm, k_post)
