"""KVRewrittenModel.generate: sampling, EOS, padding errors, memory report."""
import re

import pytest
import torch

import kvrewrite
from tests.families import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def rw_full(llama):
    return kvrewrite.apply(llama, "full", batch_size=2, prefill_chunk=16, max_length=96)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (2, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def test_sampling_is_seeded_and_matches_hf_distribution_support(rw_full):
    ids, mask = _batch()
    a = rw_full.generate(ids, mask, max_new_tokens=8, do_sample=True, top_k=5, eos_token_id=[],
                         generator=torch.Generator().manual_seed(0))
    b = rw_full.generate(ids, mask, max_new_tokens=8, do_sample=True, top_k=5, eos_token_id=[],
                         generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b), "same generator seed must give the same sample"
    # top_k=1 sampling is greedy
    greedy = rw_full.generate(ids, mask, max_new_tokens=8, eos_token_id=[])
    k1 = rw_full.generate(ids, mask, max_new_tokens=8, do_sample=True, top_k=1, eos_token_id=[],
                          generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy, k1)
    # every sampled token is among the 5 most likely of its step (checked by re-scoring with the greedy path)
    c = rw_full.generate(ids, mask, max_new_tokens=1, do_sample=True, top_k=5, eos_token_id=[],
                         generator=torch.Generator().manual_seed(5))
    logits = rw_full.prefill(ids, mask, max_new_tokens=1)
    top5 = logits.topk(5, dim=-1).indices
    assert all(int(c[r, -1]) in top5[r].tolist() for r in range(2))


def test_eos_stops_and_pads(rw_full):
    ids, mask = _batch()
    greedy = rw_full.generate(ids, mask, max_new_tokens=6, eos_token_id=[])
    eos = int(greedy[0, ids.shape[1] + 1])  # row 0's second generated token
    out = rw_full.generate(ids, mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    row0 = out[0, ids.shape[1]:]
    assert int(row0[1]) == eos and (row0[2:] == 0).all(), f"row 0 must stop at EOS and pad: {row0.tolist()}"
    if eos not in greedy[1, ids.shape[1]:].tolist():
        assert torch.equal(out[1], greedy[1, : out.shape[1]]), "row 1 never hits EOS and must be unaffected"


def test_progress_bars_and_timings(rw_full, capsys):
    ids, mask = _batch()  # 21 tokens: 2 prefill chunks of 16
    out = rw_full.generate(ids, mask, max_new_tokens=3, eos_token_id=[], progress=True)
    err = capsys.readouterr().err
    assert re.search(r"prefill: 100%.* 2/2 ", err) and "decode" in err, err
    assert out.shape == (2, 21 + 3)
    t = rw_full.last_timings
    assert sorted(t) == ["decode_s", "new_tokens", "prefill_s"] and t["new_tokens"] == 3
    assert t["prefill_s"] > 0 and t["decode_s"] > 0
    rw_full.generate(ids, mask, max_new_tokens=3, eos_token_id=[])
    assert capsys.readouterr().err == "", "no bars without progress=True"


def test_right_padding_is_refused(rw_full):
    ids, mask = _batch()
    mask = mask.flip(1)
    with pytest.raises(ValueError, match="right padding"):
        rw_full.generate(ids, mask, max_new_tokens=2)


def test_cache_bytes_reports_state_against_dense(llama):
    rw = kvrewrite.apply(llama, "chelsea", budget=0.25, batch_size=1, prefill_chunk=16, max_length=512,
                         n_sink=2, n_recent=4, chunk=8, interval=8)
    mem = rw.cache_bytes()
    layers, kv, d = 2, 2, 16
    dense = 2 * layers * kv * 512 * d * 4  # keys + values, fp32, max_length tokens
    assert mem["dense"] == dense
    cap = rw.capacities[0]
    assert cap == 128 + 8 - 1 + 16  # ceil(0.25 * 512) + g - 1 + prefill_chunk
    per_slot = 2 * d * 4 + 4 + 8  # keys + values + fp32 bias + int64 slot_pos
    expected = layers * kv * (cap * per_slot + 8) + layers * 2 * 8  # + fill [B, Hkv] + budget [2]
    assert mem["kvrewrite"] == expected
    assert mem["ratio"] == pytest.approx(expected / dense)
    assert mem["ratio"] < 0.35


@pytest.mark.parametrize("method,opts", [
    ("chelsea", dict(budget=0.75, n_sink=2, n_recent=4, chunk=8, interval=4, outlier_heads={2: [0]})),
    ("streamingllm", dict(budget=0.3, interval=3)),
])
def test_host_schedule_mirrors_device_fill(method, opts):
    """The runtime decides on the host when to run the decode variant with compression ops; its
    mirror must equal the device fill of every compressible row after every step, padding included."""
    model = tiny_model("gemma3")  # sliding-window layers have their own thresholds
    rw = kvrewrite.apply(model, method, batch_size=2, prefill_chunk=16, max_length=96, **opts)
    ids, mask = _batch()
    ids, mask = torch.cat([ids, ids[:, :12]], 1), torch.cat([mask, torch.ones_like(mask[:, :12])], 1)
    logits = rw.prefill(ids, mask, max_new_tokens=30)
    compress_steps = 0
    for step in range(31):
        outliers = rw.method.outlier_heads if method == "chelsea" else {}
        for info, host in zip(rw.layers, rw.schedule.fill):
            fill = rw.layer_state(info.index)["fill"]
            heads = [h for h in range(info.num_kv_heads) if h not in outliers.get(info.index, [])]
            assert fill[:, heads].tolist() == [[f] * len(heads) for f in host], f"layer {info.index}, step {step}"
        if step == 30:
            break
        compress_steps += rw.schedule.due(1)
        logits = rw.decode_step(logits.argmax(-1))
    assert 0 < compress_steps < 30, "decode steps must run both graph variants"


def test_decode_variants_differ_only_by_compression_ops(llama):
    rw = kvrewrite.apply(llama, "chelsea", budget=0.5, batch_size=1, prefill_chunk=16, max_length=96,
                         n_sink=2, n_recent=4, chunk=8, interval=4)

    def targets(gm):
        return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]

    plain, full = targets(rw.decode_graph), targets(rw.decode_compress_graph)
    assert "kvrewrite.chelsea_compress.default" not in plain
    assert full.count("kvrewrite.chelsea_compress.default") == 2
    assert [t for t in full if t != "kvrewrite.chelsea_compress.default"] == plain
    assert targets(rw.prefill_graph).count("kvrewrite.chelsea_compress.default") == 2


@pytest.mark.parametrize("V", [128256, 151936, 997, 12])  # Llama-3's and Qwen2's vocabularies, a prime, a tiny one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_is_argmax(V, dtype):
    """The two-reduction argmax of greedy decoding picks argmax's token, ties (the lowest index) and NaN included."""
    from kvrewrite.host import greedy_tokens

    x = torch.randn(4, V, generator=torch.Generator().manual_seed(V)).to(dtype)
    x[1] = 0.0  # one tie over the whole row
    x[2, V // 3] = x[2, V // 2] = 9.0  # a tie across chunks
    x[3, V - 1] = x[3, V // 2] = float("nan")
    got = greedy_tokens(x)
    assert torch.equal(got, x.argmax(dim=-1)) and got[1] == 0 and got[2] == V // 3 and got[3] == V // 2
