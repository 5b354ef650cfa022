"""ONNX export: each kvrewrite function against its PyTorch op (onnxruntime, fresh random inputs), then
whole models (full, streamingllm, chelsea, snapkv, clusterkv, kvmerger; sliding-window layers): onnx.checker,
custom-domain nodes with their functions, logits and state after prefill, and greedy generation against the PyTorch runtime.

Tolerances: cache_append and evict_to_budget are scatters/gathers, so their outputs must be equal;
chelsea_compress follows the reference's arithmetic step by step and must be equal too.
clustered_attention computes in fp32 like the reference (MatMul in place of einsum: summation order
only): atol 2e-6 on outputs of magnitude <= 1. Whole models: logits atol 1e-4 (fp32, 2-3 layers, a
few ulp per op through RMSNorm/MLP/attention), and the greedy tokens equal.
"""
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import kvrewrite  # noqa: E402
import kvrewrite.export  # noqa: E402
from kvrewrite.export import loader  # noqa: E402
from kvrewrite.kernels.cache_append import reference_cache_append  # noqa: E402
from kvrewrite.kernels.chelsea_compress import pinned_ties, reference_chelsea_compress  # noqa: E402
from kvrewrite.kernels.clustered_attention import reference_clustered_attention  # noqa: E402
from kvrewrite.kernels.evict_by_score import reference_evict_by_score  # noqa: E402
from kvrewrite.kernels.evict_to_budget import reference_evict_to_budget  # noqa: E402
from tests.families import tiny_model  # noqa: E402

MODEL_ATOL = 1e-4
STATE = ("keys", "values", "bias", "slot_pos", "fill")


def _info(name, t):
    from onnx import helper

    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(t.numpy().dtype), list(t.shape))


def _run_function(op: str, inputs: dict, out_like: list, **attrs):
    """Run the single node kvrewrite::<op> (its FunctionProto in the model) in onnxruntime; the outputs are
    declared with the dtypes and shapes of `out_like`."""
    from onnx import helper

    from kvrewrite.export.onnx_ops import DOMAIN, function_protos

    names = list(inputs)
    outs = [f"out{i}" for i in range(len(out_like))]
    node = helper.make_node(op, names, outs, domain=DOMAIN, **attrs)
    vi = [_info(n, v) for n, v in inputs.items()]
    graph = helper.make_graph([node], op, vi, [_info(o, t) for o, t in zip(outs, out_like)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                              functions=function_protos({op}),
                              ir_version=10)  # onnx 1.23 writes IR 14 by default; onnxruntime 1.30 reads up to 13
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [torch.from_numpy(o) for o in sess.run(None, {n: v.numpy() for n, v in inputs.items()})]


def _state(B, H, C, D, fill, g, pad_frac=0.2):
    """A layer state with `fill` [B, H] used slots, some of them padding (bias -inf), garbage past fill."""
    keys = torch.randn(B, H, C, D, generator=g)
    values = torch.randn(B, H, C, D, generator=g)
    bias = torch.randn(B, H, C, generator=g).abs().log1p()  # degrees >= 1
    bias[torch.rand(B, H, C, generator=g) < pad_frac] = float("-inf")
    slot_pos = torch.randint(0, 1000, (B, H, C), generator=g)
    return dict(keys=keys, values=values, bias=bias, slot_pos=slot_pos, fill=fill)


@pytest.mark.parametrize("B,Hq,Hkv,T,C,D,window", [(1, 2, 2, 1, 7, 16, 0), (2, 4, 2, 5, 19, 16, 0),
                                                   (2, 8, 2, 16, 33, 32, 6), (1, 4, 1, 3, 12, 8, 4)])
def test_clustered_attention_function(B, Hq, Hkv, T, C, D, window):
    g = torch.Generator().manual_seed(B * 100 + T * 10 + C)
    q = torch.randn(B, Hq, T, D, generator=g)
    keys, values = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    bias = torch.randn(B, Hkv, C, generator=g).abs().log1p()
    bias[torch.rand(B, Hkv, C, generator=g) < 0.3] = float("-inf")
    slot_pos = torch.randint(0, 40, (B, Hkv, C), generator=g)
    cpos = torch.arange(30, 30 + T) if T > 1 else torch.tensor([-1 if B == 1 and C == 7 else 35])  # -1: sees nothing
    scale = D ** -0.5
    ref = reference_clustered_attention(q, keys, values, bias, slot_pos, cpos, scale, window)
    (out,) = _run_function("clustered_attention", dict(q=q, keys=keys, values=values, bias=bias, slot_pos=slot_pos,
                                                       cache_position=cpos), [ref], scale=scale, window=window)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)


def test_clustered_attention_function_takes_past_only():
    """past_only=1 (what decode graphs carry) is a declared attribute: the function computes the same."""
    g = torch.Generator().manual_seed(9)
    B, Hq, Hkv, C, D = 2, 4, 2, 11, 16
    q = torch.randn(B, Hq, 1, D, generator=g)
    keys, values = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    bias = torch.zeros(B, Hkv, C)
    slot_pos = torch.randint(0, 20, (B, Hkv, C), generator=g)
    cpos = torch.tensor([20])
    ref = reference_clustered_attention(q, keys, values, bias, slot_pos, cpos, 0.25, 0, past_only=True)
    inputs = dict(q=q, keys=keys, values=values, bias=bias, slot_pos=slot_pos, cache_position=cpos)
    (out,) = _run_function("clustered_attention", inputs, [ref], scale=0.25, window=0, past_only=1)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("softcap,window", [(5.0, 0), (50.0, 6)], ids=["cap5", "cap50-w6"])
def test_clustered_attention_function_takes_softcap(softcap, window):
    """softcap (a float attribute, Gemma-2) caps the scaled scores before the bias and the mask, like the reference;
    softcap=0 gives the very same output as leaving the attribute out (the function's default: no cap)."""
    g = torch.Generator().manual_seed(int(softcap))
    B, Hq, Hkv, T, C, D = 2, 4, 2, 5, 19, 16
    q = softcap * torch.randn(B, Hq, T, D, generator=g)  # scale * q.k ~ softcap: the cap bends most scores
    keys, values = torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D, generator=g)
    bias = torch.randn(B, Hkv, C, generator=g).abs().log1p()
    bias[torch.rand(B, Hkv, C, generator=g) < 0.3] = float("-inf")
    slot_pos = torch.randint(0, 40, (B, Hkv, C), generator=g)
    cpos = torch.arange(30, 30 + T)
    inputs = dict(q=q, keys=keys, values=values, bias=bias, slot_pos=slot_pos, cache_position=cpos)
    ref = reference_clustered_attention(q, keys, values, bias, slot_pos, cpos, 0.25, window, softcap=softcap)
    (out,) = _run_function("clustered_attention", inputs, [ref], scale=0.25, window=window, softcap=softcap)
    # logits up to |softcap| in fp32: a few ulp of it per weight (<= ~4 * softcap * 2**-23 relative), |v| <= ~4
    torch.testing.assert_close(out, ref, atol=max(2e-6, 2e-6 * softcap), rtol=0)
    uncapped = reference_clustered_attention(q, keys, values, bias, slot_pos, cpos, 0.25, window)
    assert (uncapped - ref).abs().max() > 1e-1  # the cap matters here
    (zero,) = _run_function("clustered_attention", inputs, [ref], scale=0.25, window=window, softcap=0.0)
    (omitted,) = _run_function("clustered_attention", inputs, [ref], scale=0.25, window=window)
    assert torch.equal(zero, omitted)
    torch.testing.assert_close(omitted, uncapped, atol=2e-6, rtol=0)


@pytest.mark.parametrize("B,H,C,D,T", [(1, 1, 8, 4, 1), (2, 3, 20, 16, 5), (2, 2, 40, 8, 16)])
def test_cache_append_function(B, H, C, D, T):
    g = torch.Generator().manual_seed(C + T)
    fill = torch.randint(0, C - T + 1, (B, H), generator=g)
    st = _state(B, H, C, D, fill, g)
    k_new, v_new = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    cpos = torch.arange(-2, T - 2)
    valid = torch.rand(B, T, generator=g) > 0.3
    ref = {k: v.clone() for k, v in st.items()}
    reference_cache_append(*[ref[k] for k in STATE], k_new, v_new, cpos, valid)
    out = _run_function("cache_append", {**st, "k_new": k_new, "v_new": v_new, "cache_position": cpos,
                                         "token_valid": valid}, [ref[k] for k in STATE])
    for name, o in zip(STATE, out):
        assert torch.equal(o, ref[name]), f"cache_append: {name} differs"


@pytest.mark.parametrize("B,H,C,D,target,n_sink", [(1, 1, 10, 4, 4, 2), (2, 3, 24, 8, 7, 3), (2, 2, 30, 16, 12, 0),
                                                   (1, 2, 16, 8, 20, 4)])
def test_evict_to_budget_function(B, H, C, D, target, n_sink):
    g = torch.Generator().manual_seed(C * 7 + target)
    threshold = min(target + 4, C)
    fill = torch.randint(0, C + 1, (B, H), generator=g)
    fill[0, 0] = threshold  # at least one due row
    if B * H > 1:
        fill.view(-1)[-1] = max(threshold - 1, 0)  # and one that is not due
    st = _state(B, H, C, D, fill, g)
    budget = torch.tensor([target, threshold])
    ref = {k: v.clone() for k, v in st.items()}
    reference_evict_to_budget(*[ref[k] for k in STATE], budget, n_sink)
    assert int(ref["fill"][0, 0]) < threshold, "the due row was not compressed: the case tests nothing"
    out = _run_function("evict_to_budget", {**st, "budget": budget}, [ref[k] for k in STATE], n_sink=n_sink)
    for name, o in zip(STATE, out):
        assert torch.equal(o, ref[name]), f"evict_to_budget: {name} differs\n{o}\n{ref[name]}"


@pytest.mark.parametrize("B,H,C,D,target,n_recent,ratio,pool,reset", [
    (1, 1, 10, 4, 4, 2, 0.0, 3, True), (2, 3, 24, 8, 7, 0, 0.5, 1, False), (2, 2, 30, 16, 12, 4, 0.0, 7, True),
    (1, 2, 16, 8, 20, 1, 0.25, 5, False), (2, 2, 20, 4, 6, 9, 0.0, 3, False),
])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_evict_by_score_function(B, H, C, D, target, n_recent, ratio, pool, reset, ties):
    g = torch.Generator().manual_seed(C * 7 + target)
    threshold = min(target + 4, C)
    fill = torch.randint(0, C + 1, (B, H), generator=g)
    fill[0, 0] = threshold  # at least one due row
    if B * H > 1:
        fill.view(-1)[-1] = max(threshold - 1, 0)  # and one that is not due
    st = _state(B, H, C, D, fill, g)
    score = torch.randint(0, 3, (B, H, C), generator=g).float() if ties else torch.rand(B, H, C, generator=g)
    # a layout behind `order`: each row's ranks [0, fill) in random slots, delta 0 past the fill
    slot = torch.arange(C).repeat(B, H, 1)
    for b in range(B):
        for h in range(H):
            slot[b, h, :fill[b, h]] = torch.randperm(int(fill[b, h]), generator=g)
    order = (slot - torch.arange(C)).int()
    budget = torch.tensor([target, threshold])
    ref = {k: v.clone() for k, v in {**st, "score": score, "order": order}.items()}
    reference_evict_by_score(*[ref[k] for k in STATE], budget, ref["score"], ref["order"], n_recent, ratio, pool,
                             reset)
    assert int(ref["fill"][0, 0]) < threshold, "the due row was not compressed: the case tests nothing"
    written = (*STATE, "score", "order")
    out = _run_function("evict_by_score", {**st, "budget": budget, "score": score, "order": order,
                                           "ratio": torch.tensor([ratio], dtype=torch.float64)},
                        [ref[k] for k in written], n_recent=n_recent, pool=pool, reset_score=int(reset))
    for name, o in zip(written, out):
        assert torch.equal(o, ref[name]), f"evict_by_score: {name} differs\n{o}\n{ref[name]}"


@pytest.mark.parametrize("B,Hq,Hkv,T,C,window,mode,last", [
    (1, 2, 2, 1, 7, 0, "all", 0), (2, 4, 2, 5, 19, 0, "all", 0), (2, 4, 1, 6, 23, 4, "all", 0),
    (2, 4, 2, 5, 19, 0, "window", 3), (1, 6, 2, 1, 11, 0, "window", 3), (2, 2, 2, 4, 9, 0, "window", 10),
])
def test_accumulate_attention_function(B, Hq, Hkv, T, C, window, mode, last):
    from kvrewrite.kernels.accumulate_attention import reference_accumulate_attention

    g = torch.Generator().manual_seed(B * 100 + C + T)
    q = torch.randn(B, Hq, T, 16, generator=g)
    st = _state(B, Hkv, C, 16, torch.full((B, Hkv), C), g)
    st["slot_pos"] = torch.randint(0, 30, (B, Hkv, C), generator=g)
    cpos = torch.arange(25, 25 + T)
    score = torch.rand(B, Hkv, C, generator=g)
    ref = score.clone()
    reference_accumulate_attention(q, st["keys"], st["bias"], st["slot_pos"], cpos, ref, 0.25, window, mode, last)
    (out,) = _run_function("accumulate_attention", {"q": q, "keys": st["keys"], "bias": st["bias"],
                                                    "slot_pos": st["slot_pos"], "cache_position": cpos,
                                                    "score": score}, [ref], scale=0.25, window=window,
                           window_mode=int(mode == "window"), last=last)
    # fp32 softmax as exp(l - max) / sum in place of exp(l - lse), summed over <= 12 rows: rounding only
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("seed,B,H,C,D,target,g_,n_sink,n_recent,chunk,outliers", [
    (0, 1, 1, 24, 4, 10, 4, 2, 3, 4, []),
    (1, 2, 3, 40, 8, 12, 6, 2, 4, 8, [1]),      # an outlier head, rows of different lengths (padding)
    (2, 2, 2, 64, 16, 16, 8, 4, 8, 16, []),
    (3, 1, 4, 50, 8, 9, 3, 1, 2, 5, [0, 3]),   # odd chunk
    (4, 2, 2, 30, 8, 6, 2, 0, 0, 2, []),       # no sink/recent, chunk 2: many rounds
])
def test_chelsea_compress_function(seed, B, H, C, D, target, g_, n_sink, n_recent, chunk, outliers):
    g = torch.Generator().manual_seed(seed)
    threshold = target + g_
    fill = torch.randint(threshold, C + 1, (B, H), generator=g)
    if B * H > 1:
        fill.view(-1)[-1] = threshold - 1  # a row that is not due
    st = _state(B, H, C, D, fill, g, pad_frac=0.15)
    degrees = torch.randint(1, 4, (B, H, C), generator=g).float()  # merged slots: bias = log n, n an integer
    st["bias"] = torch.where(torch.isinf(st["bias"]), st["bias"], degrees.log())
    budget = torch.tensor([target, threshold])
    r = (0.35, 0.1, 2, 0.1)
    ref = {k: v.clone() for k, v in st.items()}
    with pinned_ties():  # exact ties are impossible here; pinned for the record (ONNX TopK: earlier edge first)
        reference_chelsea_compress(*[ref[k] for k in STATE], budget, n_sink, n_recent, chunk, *r, outliers)
    assert bool((ref["fill"] < fill).any()), "no row was compressed: the case tests nothing"
    rates = torch.tensor([r[0], r[1], r[3], 1e-9], dtype=torch.float64)
    out = _run_function("chelsea_compress", {**st, "budget": budget, "rates": rates}, [ref[k] for k in STATE],
                        n_sink=n_sink, n_recent=n_recent, chunk=chunk, r_steps=r[2],
                        outlier_mask=sum(1 << h for h in outliers))
    for name, o in zip(STATE, out):
        _assert_state_equal("chelsea_compress", name, o, ref[name])


def _assert_state_equal(op, name, got, want):
    """Integer fields and the layout (which slots are empty, -inf bias) must be identical. Float fields are
    bit-identical on onnxruntime 1.32 but computed with the runtime's own exp/log/mean kernels, which may
    round differently by an ulp on other versions (1.30 differs in the merged bias): 1e-6 there."""
    if not got.is_floating_point():
        assert torch.equal(got, want), f"{op}: {name} differs\n{got}\n{want}"
        return
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got[torch.isinf(got)], want[torch.isinf(want)]), \
        f"{op}: {name} has different empty (-inf) slots"
    finite = torch.isfinite(want)
    err = (got[finite] - want[finite]).abs().max() if finite.any() else torch.tensor(0.0)
    assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6), f"{op}: {name} differs by {err}"


def _inputs():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


CASES = {  # family, method, options: full-attention eviction (llama), sliding-window layers (gemma3), no compression
    "llama-streamingllm": ("llama", "streamingllm", dict(budget=0.5, n_sink=2, interval=4)),
    "gemma3-streamingllm": ("gemma3", "streamingllm", dict(budget=0.5, n_sink=2, interval=4)),
    "qwen3-full": ("qwen3", "full", {}),
    # chelsea with an outlier head next to sliding-window layers: compression in prefill and on decode steps
    "gemma3-chelsea": ("gemma3", "chelsea", dict(budget=0.8, n_sink=2, n_recent=4, chunk=8, interval=4,
                                                 outlier_heads={2: [1]})),
    # the score ops and the method's own state (l<i>_score inputs and outputs)
    "llama-snapkv": ("llama", "snapkv", dict(budget=0.5, window=4, kernel=3, interval=4)),
    # clusterkv: layer 1 selects (10 of ~24 slots; one slot list per KV head, the group's summed query), a window
    # clustering every 4 decode steps; k-means and selection state (l1_centroids ... l1_cluster_end) in and out
    "llama-clusterkv": ("llama", "clusterkv", dict(budget=10, n_sink=2, interval=4, tokens_per_cluster=4,
                                                   window_clusters=2, iters=4, dense_layers=1, select_per="kv_head")),
    # kvmerger: B = 8 of ~24-36 slots, a re-merge every 2 decode steps (the prompt merged after its chunks); the
    # score, degree and deficit state in and out; one sink, values as a log-degree bias
    "llama-kvmerger": ("llama", "kvmerger", dict(budget=8, interval=2, n_sink=1, values="bias")),
}


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    family, method, opts = CASES[request.param]
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    rw = kvrewrite.apply(model, method, max_length=40, batch_size=2, prefill_chunk=16, **opts)
    path = kvrewrite.export.onnx(rw, tmp_path_factory.mktemp(request.param))
    return rw, path


def test_models_check_and_carry_kvrewrite_functions(exported):
    rw, path = exported
    for name in ("prefill", "decode", "decode_compress"):
        model = onnx.load(str(path / f"{name}.onnx"))
        onnx.checker.check_model(model, full_check=True)
        nodes = {n.op_type for n in model.graph.node if n.domain == "kvrewrite"}
        assert {"cache_append", "clustered_attention"} <= nodes, f"{name}: kvrewrite nodes {nodes}"
        # the layers attending densely: all in prefill, in decode graphs those without a selection op (clusterkv)
        dense = [layer for layer in rw.layers if name == "prefill" or not rw.method.select_call(layer, rw.max_length)]
        attn = [n for n in model.graph.node if n.domain == "kvrewrite" and n.op_type == "clustered_attention"]
        past_only = [next((a.i for a in n.attribute if a.name == "past_only"), None) for n in attn]
        want = [int(name != "prefill" and layer.window == 0) for layer in dense]  # decode graphs, no window
        assert past_only == want, f"{name}: past_only attributes {past_only}, want {want}"
        functions = {f.name for f in model.functions if f.domain == "kvrewrite"}
        helpers = ({"mix32"} if "kmeans_cluster" in nodes else set()) | \
            ({"top_flags"} if "kvmerger_compress" in nodes else set())  # called by those functions
        assert functions == nodes | helpers, f"{name}: kvrewrite nodes {nodes} vs functions {functions}"
        if rw.method.name != "full" and name != "decode":
            assert {"streamingllm": "evict_to_budget", "chelsea": "chelsea_compress", "snapkv": "evict_by_score",
                    "clusterkv": "kmeans_cluster", "kvmerger": "kvmerger_compress"}[rw.method.name] in nodes
        if len(dense) < len(rw.layers):
            assert {"select_clusters", "indexed_attention"} <= nodes
        other = {n.domain for n in model.graph.node} - {"", "kvrewrite"}
        assert not other, f"{name}: nodes of other domains {other}"


def test_onnxruntime_steps_and_generation_match_pytorch(exported):
    rw, path = exported
    ids, mask = _inputs()
    m = loader.load(path)
    a, b = rw.prefill(ids, mask, max_new_tokens=12), m.prefill(ids, mask, max_new_tokens=12)
    torch.testing.assert_close(b, a, atol=MODEL_ATOL, rtol=0)
    for x, y in zip(rw.state_tensors(), m.state):
        torch.testing.assert_close(y, x, atol=MODEL_ATOL, rtol=0)  # fill, slot_pos exact; K/V through the model
    ref = rw.generate(ids, mask, max_new_tokens=12)
    out = m.generate(ids, mask, max_new_tokens=12)
    assert torch.equal(out, ref), f"onnxruntime generate\n{out[:, 24:]}\n!= runtime\n{ref[:, 24:]}"


def test_ops_without_a_function_are_named():
    from torch import fx

    from kvrewrite.export.onnx_export import unsupported_ops

    g = fx.Graph()
    q, k, b, p, c = (g.placeholder(n) for n in "qkbpc")
    g.output(g.call_function(torch.ops.kvrewrite.attention_column_stats.default, (q, k, b, p, c, None, 0.25, 0, 4)))
    assert unsupported_ops(fx.GraphModule(torch.nn.Module(), g)) == ["attention_column_stats"]
