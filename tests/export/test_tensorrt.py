"""TensorRT target, up to the torch-tensorrt call (TensorRT cannot be installed here): the functional
graph handed over computes what the in-place graph does, holds only ATen ops and the kvrewrite ops that
have plugins, and each plugin description (output shapes from the op's fake) is what the op returns.
The compile test runs only where torch_tensorrt and CUDA exist (never so far; docs/deploy.md)."""
import importlib.util

import pytest
import torch

import kvrewrite
import kvrewrite.export
from kvrewrite.export import tensorrt_export as te
from kvrewrite.export.common import example_inputs, graph_of
from tests.export.checks import check_functional_equals_in_place
from tests.families import tiny_model

HAS_TRT = importlib.util.find_spec("torch_tensorrt") is not None


@pytest.fixture(scope="module")
def rw():
    # gemma3: sliding-window layers (evict_to_budget) and a full layer with chelsea and an outlier head
    m = tiny_model("gemma3")
    m.generation_config.eos_token_id = None
    return kvrewrite.apply(m, "chelsea", max_length=40, batch_size=2, prefill_chunk=16, budget=0.8, n_sink=2,
                           n_recent=4, chunk=8, interval=4, outlier_heads={2: [1]})


@pytest.fixture(scope="module")
def prepared(rw):
    return te.prepare(rw)


@pytest.fixture(scope="module")
def rw_snapkv():
    # gemma3 with snapkv: the score ops (and the method's score state) on the full layer, evict_to_budget on the others
    m = tiny_model("gemma3")
    m.generation_config.eos_token_id = None
    return kvrewrite.apply(m, "snapkv", max_length=40, batch_size=2, prefill_chunk=16, budget=0.8, window=4, kernel=3,
                           interval=4)


@pytest.fixture(scope="module")
def rw_kvmerger():
    # llama with kvmerger: the score observation and kvmerger_compress (degree and deficit state) on both layers;
    # options off their defaults (the export leaves default-valued trailing arguments out of the node)
    m = tiny_model("llama")
    m.generation_config.eos_token_id = None
    return kvrewrite.apply(m, "kvmerger", max_length=40, batch_size=2, prefill_chunk=16, budget=8, interval=2,
                           n_sink=1, epsilon=0.5, sigma_mode="distance", values="bias", budget_mode="epsilon")


SCORE_OPS = {"kvrewrite_export::evict_by_score", "kvrewrite_export::accumulate_attention"}
CLUSTERKV_OPS = {"kvrewrite_export::kmeans_cluster", "kvrewrite_export::select_clusters",
                 "kvrewrite_export::indexed_attention"}
KVMERGER_OPS = {"kvrewrite_export::kvmerger_compress"}
CLUSTERGEN_OPS = {"kvrewrite_export::sketch_attention", "kvrewrite_export::clustergen_fold",
                  "kvrewrite_export::kcenter_compress"}  # tests/export/test_clustergen_export.py
EMS_OPS = {"kvrewrite_export::ems_append", "kvrewrite_export::ems_attention",
           "kvrewrite_export::ems_compress"}  # tests/export/test_ems_export.py


def test_op_set_is_aten_plus_plugin_ops(prepared):
    every = set(te.PLUGIN_OPS) - SCORE_OPS - CLUSTERKV_OPS - KVMERGER_OPS - CLUSTERGEN_OPS - EMS_OPS
    assert te.check_op_set(prepared["prefill"][0]) == sorted(every)
    assert te.check_op_set(prepared["decode_compress"][0]) == sorted(every)
    assert te.check_op_set(prepared["decode"][0]) == ["kvrewrite_export::cache_append",
                                                      "kvrewrite_export::clustered_attention"]
    for ep, _ in prepared.values():
        for node in ep.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                assert node.target.namespace in ("aten", "kvrewrite_export"), node.target


def test_plugin_descriptions(prepared):
    _, descs = prepared["prefill"]
    assert sorted(descs) == sorted(set(te.PLUGIN_OPS) - SCORE_OPS - CLUSTERKV_OPS - KVMERGER_OPS - CLUSTERGEN_OPS -
                        EMS_OPS)
    for op, d in descs.items():
        if op.endswith("clustered_attention"):
            assert d["outputs"] == d["inputs"][:1]  # [B, Hq, T, D] of q
        else:  # the five state tensors come back with their own shapes
            assert d["outputs"] == d["inputs"][:5]
        assert all(not isinstance(e, int) or e > 0 for shape in d["outputs"] for e in shape)


def test_score_ops_plugin_descriptions(rw_snapkv):
    """SnapKV's graphs: accumulate_attention in every graph (it returns the score), evict_by_score in the
    compressing ones (the five state tensors, the score and the order come back with their own shapes)."""
    prepared = te.prepare(rw_snapkv)
    base = ["kvrewrite_export::cache_append", "kvrewrite_export::clustered_attention"]
    assert te.check_op_set(prepared["decode"][0]) == sorted([*base, "kvrewrite_export::accumulate_attention"])
    no_chelsea = set(te.PLUGIN_OPS) - {"kvrewrite_export::chelsea_compress"} - CLUSTERKV_OPS - KVMERGER_OPS - \
        CLUSTERGEN_OPS - EMS_OPS
    assert te.check_op_set(prepared["prefill"][0]) == sorted(no_chelsea)
    descs = prepared["decode_compress"][1]
    ins = descs["kvrewrite_export::evict_by_score"]["inputs"]
    assert descs["kvrewrite_export::evict_by_score"]["outputs"] == ins[:5] + ins[6:8]
    ins = descs["kvrewrite_export::accumulate_attention"]["inputs"]
    assert descs["kvrewrite_export::accumulate_attention"]["outputs"] == [ins[5]]


def test_attention_plugin_gets_past_only_in_decode(prepared):
    """past_only (a bool, a plugin attribute) reaches the plugin op: True on the full-attention layer (2) of
    decode graphs, absent (False) in prefill and on the sliding-window layers."""
    for name, (ep, _) in prepared.items():
        attn = [n for n in ep.graph.nodes if n.target == torch.ops.kvrewrite_export.clustered_attention.default]
        got = [te._example_values(n)[8] if len(te._example_values(n)) > 8 else False for n in attn]
        assert got == [False, False, name != "prefill"], f"{name}: past_only {got}"


def test_plugin_description_refuses_what_a_plugin_cannot_take():
    t = torch.zeros(1, 2, 4, 8)
    args = [t, t, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(2, dtype=torch.long), 1, 1, 2, 0.3, 0.1, 2, 0.1, []]
    with pytest.raises(ValueError, match="outlier_heads=\\[\\].*cannot be a plugin attribute"):
        te.plugin_description("kvrewrite::chelsea_compress", args)


def test_check_op_set_names_foreign_ops(rw):
    ep = torch.export.export(graph_of(rw, "decode"), example_inputs(rw, "decode"), strict=False)  # in-place ops
    with pytest.raises(ValueError, match="kvrewrite::cache_append.*neither ATen ops nor kvrewrite ops with a TensorRT"):
        te.check_op_set(ep)


@torch.no_grad()
@pytest.mark.parametrize("name", ["prefill", "decode_compress"])
@pytest.mark.parametrize("which", ["rw", "rw_snapkv", "rw_kvmerger"])
def test_functional_graph_computes_the_in_place_graph(request, which, name):
    rw = request.getfixturevalue(which)
    ids = torch.randint(3, 128, (2, 24))
    rw.prefill(ids, max_new_tokens=8)  # a state with compressed rows, near the thresholds
    args = list(example_inputs(rw, name))
    args[0] = torch.randint(3, 128, args[0].shape)
    args[1] = args[1] + 24
    args[2] = args[2] + 24
    state = [t.clone() for t in rw.state_tensors()]
    starts = [0]  # where each layer's fields begin in the state list (the method's own fields follow the base six)
    for k in range(len(rw.layers)):
        starts.append(starts[-1] + len(rw.layer_fields(k)))
    for i in range(len(rw.layers)):  # every layer due at this step: compression runs in both graphs
        fill, budget = state[starts[i] + 4], state[starts[i] + 5]
        budget.copy_(torch.tensor([int(fill.min()) - 4, int(fill.min()) + args[0].shape[1]]))
    before = [state[starts[i] + 4].clone() for i in range(len(rw.layers))]
    _, new_state = check_functional_equals_in_place(rw, name, args[:4], state)
    after = [new_state[starts[i] + 4] for i in range(len(rw.layers))]
    assert all(bool((a < b + args[0].shape[1]).any()) for a, b in zip(after, before)), "no compression ran"


def test_kvmerger_op_set_and_plugin_descriptions(rw_kvmerger):
    """KVMerger's graphs: accumulate_attention in every graph (the fused observation split back), kvmerger_compress
    where the graph compresses, returning the five state tensors, the score, the degree and the deficit with their
    own shapes; its options reach the plugin as int, float and str attributes."""
    prepared = te.prepare(rw_kvmerger)
    base = ["kvrewrite_export::accumulate_attention", "kvrewrite_export::cache_append",
            "kvrewrite_export::clustered_attention"]
    assert te.check_op_set(prepared["decode"][0]) == base
    for name in ("prefill", "decode_compress"):
        assert te.check_op_set(prepared[name][0]) == sorted([*base, "kvrewrite_export::kvmerger_compress"])
    descs = prepared["decode_compress"][1]
    ins = descs["kvrewrite_export::kvmerger_compress"]["inputs"]
    assert descs["kvrewrite_export::kvmerger_compress"]["outputs"] == ins[:5] + ins[6:9]
    node = next(n for n in prepared["decode_compress"][0].graph.nodes
                if n.target == torch.ops.kvrewrite_export.kvmerger_compress.default)
    assert te._example_values(node)[9:] == [0.34, 0.24, 1, 0.5, 5.0, "distance", "bias", "chain", "epsilon"]


def test_functional_entries_return_what_the_ops_write():
    """Every FUNCTIONAL entry lists exactly the arguments its in-place op writes (the schema's Tensor(a!)), and its
    functional op returns one tensor per written argument (after the in-place op's own returns: RETURNS)."""
    from kvrewrite.export.functional import FUNCTIONAL, RETURNS, written_args

    for op, (fn, positions) in FUNCTIONAL.items():
        names = [op._schema.arguments[i].name for i in positions]
        assert names == written_args(op), op
        assert len(op._schema.returns) == RETURNS.get(op, 0), op
        assert len(fn._schema.returns) == RETURNS.get(op, 0) + len(positions), fn


def test_functionalize_refuses_a_writing_op_without_a_functional_twin(rw_kvmerger, monkeypatch):
    """A kvrewrite op that writes its inputs and has no FUNCTIONAL entry (here kvmerger_compress with its entry
    removed, as before it had one) is refused, by name, instead of its writes being dropped from the export."""
    from kvrewrite.export import functional

    graph = graph_of(rw_kvmerger, "decode_compress")
    functional.functionalize(graph, n_inputs=4)  # with the entry: fine
    monkeypatch.delitem(functional.FUNCTIONAL, torch.ops.kvrewrite.kvmerger_compress.default)
    with pytest.raises(ValueError, match=r"kvrewrite::kvmerger_compress \(node '.*'\) writes its inputs \['keys', "
                                         r"'values', 'bias', 'slot_pos', 'fill', 'score', 'degree', 'deficit'\] and "
                                         r"has no functional twin: add a kvrewrite_export::kvmerger_compress"):
        functional.functionalize(graph, n_inputs=4)
    with pytest.raises(ValueError, match="kvrewrite::kvmerger_compress .* has no functional twin"):
        te.prepare(rw_kvmerger, graphs=("prefill",))


CLUSTERKV = dict(budget=10, n_sink=2, interval=4, tokens_per_cluster=4, window_clusters=2, iters=4, dense_layers=1)


@pytest.fixture(scope="module")
def rw_clusterkv():
    # llama with clusterkv: layer 0 dense, layer 1 clustered (one slot list per KV head: the index is [B, Hkv, S])
    m = tiny_model("llama")
    m.generation_config.eos_token_id = None
    return kvrewrite.apply(m, "clusterkv", max_length=40, batch_size=2, prefill_chunk=16, select_per="kv_head",
                           **CLUSTERKV)


def test_clusterkv_op_set_and_plugin_descriptions(rw_clusterkv):
    """ClusterKV's graphs: kmeans_cluster where the graph compresses (its six index fields come back with their own
    shapes), select_clusters and indexed_attention in the decode graphs (the index [B, Hkv, n_sink + max_selected +
    window] int32, the attention q's shape), every triton_op as its opaque kvrewrite_export op."""
    prepared = te.prepare(rw_clusterkv)
    base = {"kvrewrite_export::cache_append", "kvrewrite_export::clustered_attention"}
    select = {"kvrewrite_export::select_clusters", "kvrewrite_export::indexed_attention"}
    assert te.check_op_set(prepared["prefill"][0]) == sorted(base | {"kvrewrite_export::kmeans_cluster"})
    assert te.check_op_set(prepared["decode"][0]) == sorted(base | select)
    assert te.check_op_set(prepared["decode_compress"][0]) == sorted(base | CLUSTERKV_OPS)
    descs = prepared["decode_compress"][1]
    ins = descs["kvrewrite_export::kmeans_cluster"]["inputs"]
    assert descs["kvrewrite_export::kmeans_cluster"]["outputs"] == ins[6:12]
    ins = descs["kvrewrite_export::select_clusters"]["inputs"]
    (out,) = descs["kvrewrite_export::select_clusters"]["outputs"]
    assert out == [ins[0][0], ins[3][1], 2 + 8 + 4]  # [B, Hkv (centroids), n_sink + (budget - n_sink) + interval]
    ins = descs["kvrewrite_export::indexed_attention"]["inputs"]
    assert descs["kvrewrite_export::indexed_attention"]["outputs"] == [ins[0]]
    node = next(n for n in prepared["decode"][0].graph.nodes
                if n.target == torch.ops.kvrewrite_export.select_clusters.default)
    assert te._example_values(node)[9:] == [2, 8, 4, False]  # n_sink, max_selected, window, per_query_head


@torch.no_grad()
@pytest.mark.parametrize("name", ["prefill", "decode_compress"])
def test_clusterkv_functional_graph_computes_the_in_place_graph(rw_clusterkv, name):
    """The prefill graph on a fresh state (its chunk ends where the prompt's clustering is due) and the decode step
    with compression where a window clustering is due (3 decode steps after the prompt, interval 4): the functional
    graph returns exactly the state the in-place graph writes, and the clustering ran."""
    rw = rw_clusterkv
    if name == "prefill":
        rw.reset(16, 8, prompt_slots=16)  # a fresh state, the prompt's clustering due at the end of this chunk
    else:
        logits = rw.prefill(torch.randint(3, 128, (2, 24)), max_new_tokens=8)
        for _ in range(3):
            logits = rw.decode_step(logits.argmax(-1))
    args = list(example_inputs(rw, name))
    args[0] = torch.randint(3, 128, args[0].shape)
    args[1:3] = [args[1] + 27, args[2] + 32 + 3] if name != "prefill" else args[1:3]
    saved, new_state = check_functional_equals_in_place(rw, name, args[:4], [t.clone() for t in rw.state_tensors()])
    k = rw.layer_fields(0).__len__() + rw.layer_fields(1).index("n_clusters")  # layer 1's n_clusters
    assert bool((new_state[k] > saved[k]).all()), f"no clustering ran: n_clusters {saved[k]} -> {new_state[k]}"


@pytest.mark.skipif(HAS_TRT, reason="torch_tensorrt is installed")
def test_missing_tensorrt_is_a_clear_error(rw, tmp_path):
    with pytest.raises(ImportError, match="needs torch_tensorrt .* tensorrt.plugin"):
        kvrewrite.export.tensorrt(rw, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRT or not torch.cuda.is_available(), reason="needs torch_tensorrt and CUDA")
@torch.no_grad()
def test_tensorrt_engine_generates_like_the_runtime(tmp_path):
    from kvrewrite.export import loader

    m = tiny_model("llama").cuda()
    m.generation_config.eos_token_id = None
    rw = kvrewrite.apply(m, "chelsea", max_length=40, batch_size=2, prefill_chunk=16, budget=0.5, n_sink=2,
                         n_recent=4, chunk=8, interval=4)
    path = kvrewrite.export.tensorrt(rw, tmp_path)
    ids = torch.randint(3, 128, (2, 24), device="cuda")
    assert torch.equal(loader.load(path).generate(ids, max_new_tokens=8), rw.generate(ids, max_new_tokens=8))
