"""torch.export target: .pt2 programs + metadata; the loader (no capture machinery) reproduces
rw.generate token for token, greedy and sampled, for chelsea (compression in prefill and on the
decode steps the host schedule picks) and for sliding-window layers (gemma3, streamingllm)."""
import functools
import json
import math
import re

import pytest
import torch

import kvrewrite
import kvrewrite.export
from kvrewrite.export import loader
from kvrewrite.export.common import META_FILE, read_metadata
from tests.export.checks import check_loader_generates_like_rw, left_padded_prompts
from tests.families import tiny_model

PROMPT, NEW = 24, 12
CHELSEA = dict(budget=0.5, n_sink=2, n_recent=4, chunk=8, interval=4)  # compresses in prefill and at decode steps


_inputs = functools.partial(left_padded_prompts, PROMPT)


def _model(family):
    m = tiny_model(family)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def chelsea(tmp_path_factory):
    rw = kvrewrite.apply(_model("llama"), "chelsea", max_length=40, batch_size=2, prefill_chunk=16, **CHELSEA)
    return rw, kvrewrite.export.torch_export(rw, tmp_path_factory.mktemp("pt2"))


def test_files_and_metadata(chelsea):
    rw, path = chelsea
    assert sorted(p.name for p in path.iterdir()) == ["decode.pt2", "decode_compress.pt2", META_FILE, "prefill.pt2"]
    meta = json.loads((path / META_FILE).read_text())
    assert meta["target"] == "torch_export" and meta["capacities"] == rw.capacities
    assert meta["method"] == {"name": "chelsea", "options": {"budget": 0.5, "interval": 4, "n_sink": 2, "n_recent": 4,
                                                            "chunk": 8, "r_init": 0.35, "r_alpha": 0.1, "r_steps": 2,
                                                            "r_min": 0.1, "outlier_heads": {}}}
    assert meta["versions"]["torch"] == torch.__version__
    graph = torch.export.load(path / "decode_compress.pt2").graph
    ops = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert {"kvrewrite.cache_append.default", "kvrewrite.clustered_attention.default",
            "kvrewrite.chelsea_compress.default"} <= ops


@torch.no_grad()
def test_loader_reproduces_generate(chelsea):
    rw, path = chelsea
    m = loader.load(path)
    ids, mask = _inputs()
    ref = rw.generate(ids, mask, max_new_tokens=NEW)
    fills = [int(f) for f in rw.l0_fill.flatten()]
    out = m.generate(ids, mask, max_new_tokens=NEW)
    assert torch.equal(out, ref), f"loader\n{out[:, PROMPT:]}\n!= rw.generate\n{ref[:, PROMPT:]}"
    assert [int(f) for f in m.state[4].flatten()] == fills  # layer 0's fill: the same compressions ran
    assert all(torch.equal(a, b) for a, b in zip(m.state, rw.state_tensors())), "final state differs"
    kw = dict(max_new_tokens=NEW, do_sample=True, top_k=20, temperature=0.8)
    s_ref = rw.generate(ids, mask, generator=torch.Generator().manual_seed(5), **kw)
    s_out = m.generate(ids, mask, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(s_out, s_ref)


@torch.no_grad()
def test_sliding_window_layers(tmp_path):
    rw = kvrewrite.apply(_model("gemma3"), "streamingllm", max_length=40, batch_size=2, prefill_chunk=16, budget=0.5,
                         n_sink=2, interval=4)
    m = loader.load(kvrewrite.export.torch_export(rw, tmp_path))
    ids, mask = _inputs()
    assert torch.equal(m.generate(ids, mask, max_new_tokens=NEW), rw.generate(ids, mask, max_new_tokens=NEW))


def test_loader_checks_like_the_runtime(chelsea):
    _, path = chelsea
    m = loader.load(path)
    ids, mask = _inputs()
    with pytest.raises(ValueError, match="exceeds max_length=40"):
        m.generate(ids, mask, max_new_tokens=20)
    with pytest.raises(ValueError, match="right padding"):
        m.generate(ids, mask.flip(1), max_new_tokens=4)


@torch.no_grad()
def test_batch_size_mismatch_is_refused_before_the_state_is_touched(chelsea):
    """As in the runtime (tests/test_errors.py): a wrong batch size raises, naming the model, the exported
    batch size and the one given, before the state of the generation in progress is reset."""
    _, path = chelsea
    m = loader.load(path)
    ids, mask = _inputs()
    logits = m.prefill(ids, mask, max_new_tokens=NEW)
    state = [t.clone() for t in m.state]
    schedule, fill = m.schedule, [list(f) for f in m.schedule.fill]
    pos, cpos = m._next_position.clone(), m._next_cache_position.clone()
    msg = rf"^{re.escape(m.model_tag)}: exported for batch size 2, got input of batch 1$"
    with pytest.raises(ValueError, match=msg):
        m.generate(ids[:1], mask[:1], max_new_tokens=NEW)
    with pytest.raises(ValueError, match=msg):
        m.prefill(ids[:1], mask[:1], max_new_tokens=NEW)
    with pytest.raises(ValueError, match=msg):
        m.decode_step(logits[:1].argmax(-1))
    assert all(torch.equal(a, b) for a, b in zip(m.state, state)), "the state was modified"
    assert m.schedule is schedule and m.schedule.fill == fill
    assert torch.equal(m._next_position, pos) and torch.equal(m._next_cache_position, cpos)
    assert m.decode_step(logits.argmax(-1)).shape == logits.shape


def test_bad_paths_and_graph_names(tmp_path, chelsea):
    rw, _ = chelsea
    with pytest.raises(FileNotFoundError, match="no kvrewrite export metadata"):
        read_metadata(tmp_path)
    with pytest.raises(ValueError, match="unknown graph"):
        kvrewrite.export.torch_export(rw, tmp_path, graphs=("prefil",))
    path = kvrewrite.export.torch_export(rw, tmp_path / "d", graphs=("decode",))
    with pytest.raises(ValueError, match="graph 'prefill' was not exported"):
        loader.load(path).generate(*_inputs(), max_new_tokens=2)


@torch.no_grad()
def test_method_state_travels_with_the_export(tmp_path):
    """H2O's own state (a score per slot, the pending queries, the slots' temporal order) is recorded in the
    metadata, allocated by the loader after each layer's base fields, and updated by the exported observation and
    compression ops exactly as in the runtime."""
    rw = kvrewrite.apply(_model("llama"), "h2o", max_length=40, batch_size=2, prefill_chunk=16, budget=12, interval=4)
    path = kvrewrite.export.torch_export(rw, tmp_path)
    meta = read_metadata(path)
    C = rw.capacities[0]
    assert meta["method_state"] == [{"score": {"shape": [2, 2, C], "dtype": "float32", "reset": 0.0},
                                     "pending_q": {"shape": [2, 2, 7, 2, 16], "dtype": "float32", "reset": 0.0},
                                     "pending_lse": {"shape": [2, 2, 7, 2], "dtype": "float32", "reset": math.inf},
                                     "order": {"shape": [2, 2, C], "dtype": "int32", "reset": 0}}] * 2
    m = loader.load(path)
    assert [tuple(t.shape) for t in m.state] == [tuple(t.shape) for t in rw.state_tensors()]
    ids, mask = _inputs()
    assert torch.equal(m.generate(ids, mask, max_new_tokens=NEW), rw.generate(ids, mask, max_new_tokens=NEW))
    assert all(torch.equal(a, b) for a, b in zip(m.state, rw.state_tensors())), "final state (scores too) differs"
    assert float(m.layer_state(1)["score"].max()) > 0


# clusterkv: layer 1 selects 10 of its ~24-36 slots per step (2 sinks + 8 by cluster, per query head), the prompt is
# clustered after its last chunk and every 4 decode steps the new slots (a window clustering), 4 k-means iterations
CLUSTERKV = dict(budget=10, n_sink=2, interval=4, tokens_per_cluster=4, window_clusters=2, iters=4, dense_layers=1)


@torch.no_grad()
def test_clusterkv_exports_and_generates(tmp_path):
    """ClusterKV's index state (centroids ... cluster_end) travels in the metadata; the programs carry its three ops
    (kvrewrite::indexed_attention itself, not its CPU path, so a program runs on either device); the loader
    reproduces rw.generate token for token and leaves the very same state, with selection dropping tokens and
    window clusterings run during the generation."""
    rw = kvrewrite.apply(_model("llama"), "clusterkv", max_length=40, batch_size=2, prefill_chunk=16, **CLUSTERKV)
    path = kvrewrite.export.torch_export(rw, tmp_path)
    meta = read_metadata(path)
    C = rw.capacities[1]
    K = rw.method.max_clusters(C)
    assert meta["method_state"][0] == {}  # the dense layer owns no index
    assert meta["method_state"][1] == {
        "centroids": {"shape": [2, 2, K, 16], "dtype": "float32", "reset": 0.0},
        "cluster_size": {"shape": [2, 2, K], "dtype": "int32", "reset": 0},
        "cluster_start": {"shape": [2, 2, K], "dtype": "int32", "reset": 0},
        "members": {"shape": [2, 2, C], "dtype": "int32", "reset": -1},
        "n_clusters": {"shape": [2, 2], "dtype": "int32", "reset": 0},
        "cluster_end": {"shape": [2, 2], "dtype": "int64", "reset": 0}}
    graph = torch.export.load(path / "decode_compress.pt2").graph
    ops = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert {"kvrewrite.kmeans_cluster.default", "kvrewrite.select_clusters.default",
            "kvrewrite.indexed_attention.default"} <= ops, ops
    assert not {"kvrewrite.indexed_attention_cpu.default", "kvrewrite.select_clusters_cpu.default"} & ops
    m = loader.load(path)
    ids, mask = _inputs()
    ref = rw.generate(ids, mask, max_new_tokens=NEW)
    out = m.generate(ids, mask, max_new_tokens=NEW)
    assert torch.equal(out, ref), f"loader\n{out[:, PROMPT:]}\n!= rw.generate\n{ref[:, PROMPT:]}"
    assert all(torch.equal(a, b) for a, b in zip(m.state, rw.state_tensors())), "final state differs"
    s = m.layer_state(1)
    prompt_slots = 32  # 24 tokens left-padded to two chunks of 16
    assert bool((s["cluster_end"] >= prompt_slots + 2 * CLUSTERKV["interval"]).all()), "no window clustering ran"
    clustered = s["cluster_size"].sum(-1)
    assert bool((clustered > CLUSTERKV["budget"] - CLUSTERKV["n_sink"]).all()), "the selection dropped nothing"


# kvmerger: B = 8 of the 24-token prompt's slots (merged after its chunks), a re-merge every 2 decode steps; the
# default reading and budget mode (each head holds exactly B), and the adaptive ones (heads hold fewer: the deficit
# keeps the device due when the loader's host schedule says so)
KVMERGER = {"chain-exact": dict(budget=8, interval=2),
            "anchor-epsilon": dict(budget=8, interval=2, reading="anchor", budget_mode="epsilon", epsilon=0.0,
                                   n_sink=1, sigma_mode="distance", values="bias")}


@torch.no_grad()
@pytest.mark.parametrize("case", list(KVMERGER))
def test_kvmerger_exports_and_generates(tmp_path, case):
    """KVMerger's degree (reset 1) and deficit (reset 0) travel in the metadata after H2O's score; the loader
    allocates them at their reset values, reproduces rw.generate token for token over 12 tokens with a re-merge
    every 2 steps (counted: the decode_compress program runs), and leaves the very same state."""
    rw = kvrewrite.apply(_model("llama"), "kvmerger", max_length=40, batch_size=2, prefill_chunk=16, **KVMERGER[case])
    path = kvrewrite.export.torch_export(rw, tmp_path)
    meta = read_metadata(path)
    C = rw.capacities[0]
    assert list(meta["method_state"][0]) == ["score", "pending_q", "pending_lse", "degree", "deficit"]
    assert meta["method_state"][0]["degree"] == {"shape": [2, 2, C], "dtype": "int32", "reset": 1}
    assert meta["method_state"][0]["deficit"] == {"shape": [2, 2], "dtype": "int64", "reset": 0}
    graph = torch.export.load(path / "decode_compress.pt2").graph
    assert "kvrewrite.kvmerger_compress.default" in {str(n.target) for n in graph.nodes if n.op == "call_function"}
    m = loader.load(path)
    assert all(bool((m.layer_state(i)["degree"] == 1).all()) for i in range(2)), "degree not allocated at its reset"
    ids, mask = _inputs()
    calls = check_loader_generates_like_rw(m, rw, ids, mask, NEW)
    assert calls >= 4, f"only {calls} re-merges ran"
    s = m.layer_state(1)
    kept = torch.arange(C) < s["fill"][..., None]
    real = torch.tensor([PROMPT, PROMPT - 5])[:, None] + NEW - 1  # every token the state has seen, per batch row
    assert torch.equal((s["degree"] * kept).sum(-1), real.expand(2, 2)), "the degrees do not count every token"
    if case == "anchor-epsilon":
        assert int(s["deficit"].max()) > 0, "every head kept B slots: the deficit path is not exercised"


@torch.no_grad()
def test_ems_exports_and_generates(tmp_path):
    """EMS's slot table (its per-slot fields sized by gamma and the full length L, recorded as concrete shapes) and its
    three ops travel in the .pt2 programs: the loader reproduces rw.generate token for token with a compression every
    4 decode steps (merges into the table: more slots than entries), and leaves the very same state."""
    rw = kvrewrite.apply(_model("llama"), "ems", max_length=40, batch_size=2, prefill_chunk=16, budget=12, window=4,
                         kernel=3, interval=4)
    path = kvrewrite.export.torch_export(rw, tmp_path)
    graph = torch.export.load(path / "decode_compress.pt2").graph
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert {f"kvrewrite.{op}.default" for op in ("ems_append", "ems_attention", "ems_compress")} <= targets
    m = loader.load(path)
    assert all(bool((m.layer_state(i)["lut"] == -1).all()) for i in range(2)), "lut not allocated at its reset"
    ids, mask = _inputs()
    ref = rw.generate(ids, mask, max_new_tokens=NEW)
    out = m.generate(ids, mask, max_new_tokens=NEW)
    assert torch.equal(out, ref), f"loader\n{out[:, PROMPT:]}\n!= rw.generate\n{ref[:, PROMPT:]}"
    assert all(torch.equal(a, b) for a, b in zip(m.state, rw.state_tensors())), "final state differs"
    s = m.layer_state(1)
    assert bool((s["slot_fill"] > s["fill"]).any()), "nothing merged into the table"
