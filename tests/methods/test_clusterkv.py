"""ClusterKV (https://arxiv.org/abs/2412.03213) end to end on a tiny llama: the schedule of its clusterings, the
cluster index it builds, exact full attention when the budget covers everything, and invisible left padding.

The ops themselves are tested against naive float64 implementations in tests/kernels/test_kmeans_cluster.py,
test_select_clusters.py and test_indexed_attention.py; here the method wires them into the three step graphs.
"""
import math

import pytest
import torch

import kvrewrite
from kvrewrite.methods import make_method
from kvrewrite.methods.clusterkv import ClusterKVMethod
from tests.methods.tiny_runs import CHUNK, N_PROMPT, PAD_ROW1, prompt, run

SMALL = dict(n_sink=2, interval=4, tokens_per_cluster=4, window_clusters=2, iters=3, dense_layers=1)


@pytest.mark.parametrize("select_per", ["query_head", "kv_head"])
def test_budget_covering_every_token_is_full_attention(llama, captured, select_per):
    """B >= n + Γ selects every cluster: the attention over sinks + members + window is exactly the dense one, through
    the prefill clustering and two window clusterings (interval 4, 10 steps)."""
    ids, mask = prompt()
    full = kvrewrite.apply(llama, "full", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured)
    want, fed = run(full, ids, mask, 10)
    rw = kvrewrite.apply(llama, "clusterkv", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                         budget=48, select_per=select_per, **dict(SMALL, dense_layers=0))
    got, _ = run(rw, ids, mask, 10, fed)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert int(rw.l0_n_clusters.min()) > 0  # layer 0 did cluster (dense_layers=0)


def test_clusterings_happen_after_the_prompt_and_every_interval(llama, captured):
    """The prompt's clusters (ceil(L / 4) for the L real tokens past the 2 sinks of each row), then 2 more per 4
    decode tokens; the index is a permutation of the clustered slots; host schedule and device agree."""
    ids, mask = prompt()
    rw = kvrewrite.apply(llama, "clusterkv", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                         budget=10, **SMALL)
    assert rw.layer_state(0).keys() == {"keys", "values", "bias", "slot_pos", "fill", "budget"}  # dense layer 0
    st = rw.layer_state(1)
    rw.prefill(ids, mask, max_new_tokens=12)
    n_pad = 24
    for b, pad in ((0, 3), (1, 3 + PAD_ROW1)):
        L = n_pad - pad - 2
        assert (st["n_clusters"][b] == math.ceil(L / 4)).all()
        assert (st["cluster_end"][b] == n_pad).all()
        assert (st["members"][b, :, :2] == torch.tensor([pad, pad + 1])).all()  # the first 2 real tokens
        for h in range(2):
            got = st["members"][b, h, 2:2 + L].sort().values
            assert torch.equal(got, torch.arange(pad + 2, n_pad, dtype=torch.int32))
            assert int(st["cluster_size"][b, h].sum()) == L
    assert rw.schedule.threshold[1] == [n_pad + 4, n_pad + 4]
    counts, ends = [], []
    tok = torch.tensor([5, 6])
    for _ in range(9):
        rw.decode_step(tok)
        counts.append(st["n_clusters"][:, 0].tolist())
        ends.append(int(st["cluster_end"][0, 0]))
    c0 = [math.ceil((n_pad - 3 - 2) / 4), math.ceil((n_pad - 7 - 2) / 4)]
    assert counts[2] == c0 and counts[3] == [c + 2 for c in c0] and counts[7] == [c + 4 for c in c0]
    assert ends == [24, 24, 24, 28, 28, 28, 28, 32, 32]
    # the window's members follow the prompt's in the index
    L0 = int(st["cluster_size"][0, 0, :c0[0]].sum())
    assert sorted(st["members"][0, 0, 2 + L0:2 + L0 + 8].tolist()) == list(range(24, 32))


def test_left_padding_is_invisible(llama, captured):
    """A row's result does not depend on the other row or on its batch padding: the shorter prompt, left-padded
    in a batch, gives the logits it gives alone (same slots, same clustering: the initialisation hashes the
    point count, not positions)."""
    ids, mask = prompt()
    rw = kvrewrite.apply(llama, "clusterkv", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                         budget=8, **SMALL)
    got, fed = run(rw, ids, mask, 9)
    short = ids[1:, PAD_ROW1:].expand(2, -1)
    alone, _ = run(rw, short, torch.ones_like(short), 9, fed[1:].expand(2, -1))
    torch.testing.assert_close(got[1], alone[0], atol=1e-5, rtol=1e-5)


def test_graphs_select_before_attention_on_clustered_layers(llama, captured):
    rw = kvrewrite.apply(llama, "clusterkv", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                         budget=10, **SMALL)

    def ops(gm):
        return [str(n.target) for n in gm.graph.nodes if str(n.target).startswith("kvrewrite.")]

    for gm in (rw.decode_graph, rw.decode_compress_graph):
        o = ops(gm)
        assert o.count("kvrewrite.select_clusters.default") == 1 and o.count("kvrewrite.indexed_attention.default") == 1
        assert o.count("kvrewrite.clustered_attention.default") == 1  # dense layer 0
    assert ops(rw.decode_graph).count("kvrewrite.kmeans_cluster.default") == 0
    assert ops(rw.decode_compress_graph).count("kvrewrite.kmeans_cluster.default") == 1
    assert "kvrewrite.select_clusters.default" not in ops(rw.prefill_graph)
    assert ops(rw.prefill_graph).count("kvrewrite.kmeans_cluster.default") == 1


def test_cache_bytes_count_every_token_and_the_index(llama, captured):
    rw = kvrewrite.apply(llama, "clusterkv", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                         budget=10, **SMALL)
    full = kvrewrite.apply(llama, "full", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured)
    C, K = rw.capacities[1], rw.method.max_clusters(rw.capacities[1])
    assert rw.capacities == full.capacities  # nothing is evicted
    index = 2 * 2 * (K * 16 * 4 + 2 * K * 4 + C * 4 + 4 + 8)  # centroids (fp32 model), sizes, starts, members, ...
    assert rw.cache_bytes()["kvrewrite"] == full.cache_bytes()["kvrewrite"] + index


def test_targets_and_host_rule():
    m = ClusterKVMethod(budget=0.5, **SMALL)
    from kvrewrite.context import LayerInfo

    dense, clustered = LayerInfo(0, 4, 2, 16), LayerInfo(1, 4, 2, 16)
    assert m.targets(clustered, 30, 10, 32) == (20, 32)  # B = 0.5 x 40; due at the end of the prompt's 32 slots
    assert m.targets(dense, 30, 10, 32) == (2**62, 2**62)
    assert m.after_compression(36, 30, 20, 36) == (36, 30, 40)  # keeps every slot, due again 4 tokens later
    assert m.capacity(clustered, 40, 8) == 47 and m.state_fields(dense) == {}
    assert m.max_clusters(47) == math.ceil(47 / 4) + 2 * (47 // 4)


@pytest.mark.parametrize("kw,field", [
    (dict(budget=16), "budget"), (dict(select_per="group"), "select_per"), (dict(iters=0), "iters"),
    (dict(tokens_per_cluster=0), "tokens_per_cluster"), (dict(n_sink=True), "n_sink"), (dict(interval=0), "interval"),
])
def test_config_errors(kw, field):
    with pytest.raises(ValueError, match=field):
        make_method("clusterkv", **kw)


def test_budget_inside_the_sinks_is_refused_before_the_prefill(llama, captured):
    rw = kvrewrite.apply(llama, "clusterkv", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                         budget=0.05, **SMALL)
    ids, mask = prompt()
    with pytest.raises(ValueError, match="n_sink=2"):
        rw.prefill(ids, mask, max_new_tokens=4)


@pytest.mark.parametrize("method", ["full", "clusterkv"])
def test_live_slots_hold_their_positions_in_order(llama, captured, method):
    """What clustered_attention's ordered prefill kernel relies on for the methods that never move a slot (its routing
    checks it on the device, row by row: kernels/_ordered_prefill_kernels.py): after a left-padded chunked prefill
    (21 tokens rounded up to 3 chunks of 8: the 3 padding slots take positions -3..-1) and decode steps (ClusterKV's
    window clusterings among them), every live slot j of every row holds position j + delta, delta = -3, and every slot
    from the fill on is empty."""
    ids, mask = prompt()
    kw = dict(budget=10, **SMALL) if method == "clusterkv" else {}
    rw = kvrewrite.apply(llama, method, max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured, **kw)
    run(rw, ids, mask, 9)
    delta = N_PROMPT - 3 * CHUNK
    for layer in (0, 1):
        st = rw.layer_state(layer)
        live = st["bias"] > -math.inf
        index = torch.arange(st["slot_pos"].shape[-1]).expand_as(st["slot_pos"])
        assert live.any() and torch.equal(st["slot_pos"][live], index[live] + delta), (method, layer)
        assert not (live & (index >= st["fill"][..., None])).any(), (method, layer)
