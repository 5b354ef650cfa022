"""`kvrewrite bench` (kvrewrite/bench/e2e.py): argument errors, method names joining by name, and one tiny
CPU run through every code path (HF eager baseline, a kvrewrite method with real prefill and with the
synthetic state) whose JSON is checked field by field. Speed is not tested here (docs/bench.md)."""
import argparse
import json

import pytest
import torch

from kvrewrite.bench import e2e
from kvrewrite.cli import main
from kvrewrite.methods import METHODS

TINY = ["--model", "tiny-llama", "--device", "cpu", "--reps", "1", "--intervals", "1", "--new-tokens", "98"]


@pytest.fixture(scope="module")
def tiny_llama():
    """(model, capture): the tiny llama captured once (batch 2, prefill chunks of 32) for the tests that rewrite it
    (a capture is most of an apply's time)."""
    from kvrewrite.capture import capture
    from tests.families import tiny_model

    model = tiny_model("llama")
    return model, capture(model, batch_size=2, prefill_chunk=32)


def _err(capsys, argv):
    assert main(["bench", *argv]) == 2
    return capsys.readouterr().err


def test_unknown_method_is_named(capsys):
    err = _err(capsys, [*TINY, "--systems", "full,nosuchmethod"])
    assert "nosuchmethod" in err and "chelsea" in err and "hf-compiled" in err


@pytest.mark.parametrize("argv, needle", [
    (["--contexts", "0"], "contexts"),
    (["--batches", "two"], "batches"),
    (["--budget", "1.5"], "budget"),
    (["--model", "llama-9000"], "llama-9000"),
    (["--new-tokens", "40"], "new_tokens"),
    (["--inductor-option", "combo_kernels=True"], "needs --kv-compile inductor"),
])
def test_bad_arguments(capsys, argv, needle):
    assert needle in _err(capsys, [*TINY, *argv])


def test_cuda_required_without_cpu_flag(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert "CUDA" in _err(capsys, ["--model", "tiny-llama"])


def test_every_registered_method_joins_by_name(monkeypatch):
    """Systems default to the HF baselines plus every name in METHODS, so a new method runs without edits."""
    from kvrewrite.methods import METHODS

    monkeypatch.setitem(METHODS, "newmethod", METHODS["streamingllm"])
    args = _parse([*TINY])
    assert set(e2e.config_from_args(args).systems) == {"hf-eager", "hf-compiled", *METHODS}


def _parse(argv):
    import argparse

    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    return p.parse_args(argv)


def test_tiny_cpu_run_writes_the_json(tmp_path):
    out = tmp_path / "e2e.json"
    argv = [*TINY, "--systems", "hf-eager,streamingllm", "--contexts", "256", "--batches", "1,2",
            "--prefill-chunk", "64", "--budget", "0.5", "--out", str(out), "--plot", str(tmp_path / "e2e.png")]
    assert main(["bench", *argv]) == 0
    doc = json.loads(out.read_text())
    assert doc["env"]["torch"] == torch.__version__ and doc["copy_gbps"] > 0 and doc["weight_bytes_read"] > 0
    assert len(doc["copy_gbps_rounds"]) == 3 and doc["copy_gbps"] == max(doc["copy_gbps_rounds"])  # the best round
    rows = {(r["system"], r["batch"]): r for r in doc["rows"]}
    assert set(rows) == {("hf-eager", 1), ("hf-eager", 2), ("streamingllm", 1), ("streamingllm", 2)}
    for (system, B), r in rows.items():
        assert "error" not in r, r.get("error")
        assert r["context"] == 256 and r["steps_per_rep"] == 32
        assert r["ms_per_token"] > 0 and r["tok_per_s"] == pytest.approx(1e3 * B / r["ms_per_token"])
        assert r["floor_ms"] > 0 and r["ratio_to_floor"] == pytest.approx(r["ms_per_token"] / r["floor_ms"])
        assert r["kv_bytes"] > 0 and r["kv_read_bytes"] > 0
    # streamingllm at budget 0.5 of n + new = 354 tokens keeps 177 slots; one interval holds one eviction
    sl = rows[("streamingllm", 1)]
    assert sl["state"] == "real prefill" and sl["prefill_s"] > 0 and sl["dense_prefill_s"] > 0
    assert sl["fill_after_prefill"] == 177 and sl["compress_steps_per_rep"] == 1
    assert rows[("streamingllm", 2)]["state"] == "synthetic fill"
    assert rows[("streamingllm", 2)]["fill_after_prefill"] == 177
    assert rows[("hf-eager", 1)]["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * (256 + 98)  # layers x K,V x Hkv x D x fp32 x L
    assert (tmp_path / "e2e.png").stat().st_size > 0
    from kvrewrite.bench.plot_e2e import markdown_table

    table = markdown_table(doc).splitlines()
    assert len(table) == 2 + len(doc["rows"]) and all(line.count("|") == table[0].count("|") for line in table)


def test_batch_prefill_times_the_batch_against_the_dense_prefill_of_the_same_batch(tmp_path, monkeypatch):
    """--batch-prefill: the batch-2 rows prefill for real (no synthetic state) and compare with HF's dense prefill of a
    [2, n] batch, measured once per (n, B); a dense prefill that fails is recorded in the row, which keeps its own
    numbers. Refused with --no-prefill."""
    shapes = []
    real = e2e.hf_prefill_s

    def spy(model, n, B=1):
        shapes.append((n, B))
        return real(model, n, B)

    monkeypatch.setattr(e2e, "hf_prefill_s", spy)
    out = tmp_path / "e2e.json"
    argv = [*TINY, "--systems", "streamingllm", "--contexts", "200", "--batches", "2", "--prefill-chunk", "64",
            "--budget", "0.5", "--batch-prefill", "--out", str(out), "--plot", str(tmp_path / "e2e.png")]
    assert main(["bench", *argv]) == 0
    row, = json.loads(out.read_text())["rows"]
    assert row["state"] == "real prefill" and row["prefill_s"] > 0 and row["dense_prefill_s"] > 0
    assert row["prefill_vs_dense"] == pytest.approx(row["prefill_s"] / row["dense_prefill_s"])
    assert shapes == [(200, 2)]
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    cfg = e2e.config_from_args(parser.parse_args([*argv, "--systems", "hf-eager"]))
    cfg.validate()
    bench = e2e.Bench(cfg)
    tries = []

    def out_of_memory(*args):
        tries.append(args[1:])
        raise MemoryError("out of memory (simulated)")

    monkeypatch.setattr(e2e, "hf_prefill_s", out_of_memory)
    row = bench.measure("hf-eager", 200, 2, "2")
    assert row["prefill_error"] == "MemoryError: out of memory (simulated)" and row["ms_per_token"] > 0
    assert bench.dense_prefill[(200, 2)] == row["prefill_error"]  # kept as text, not as the exception
    with pytest.raises(e2e.DensePrefillFailed, match="simulated"):
        bench.dense_prefill_s(200, 2)
    assert tries == [(200, 2)]  # not tried again
    with pytest.raises(ValueError, match="--batch-prefill .* cannot go with --no-prefill"):
        e2e.config_from_args(parser.parse_args([*argv, "--no-prefill"])).validate()


def test_synthetic_fill_matches_a_real_prefill(tiny_llama):
    """The synthetic state has the slot occupancy, schedule and positions a real prefill leaves."""
    import kvrewrite

    model, captured = tiny_llama
    kw = dict(budget=0.5, max_length=300, n_sink=2, n_recent=4, chunk=8)
    real, fake = (kvrewrite.apply(model, "chelsea", captured=captured, **kw) for _ in range(2))
    real.prefill(torch.randint(1, 128, (2, 256)), max_new_tokens=40)
    e2e.synthetic_fill(fake, 256, 40)
    assert real.schedule.fill == fake.schedule.fill and real.schedule.budgets == fake.schedule.budgets
    for i in range(2):
        assert torch.equal(real.layer_state(i)["fill"], fake.layer_state(i)["fill"])
    assert torch.equal(real._next_position, fake._next_position)
    assert torch.equal(real._next_cache_position, fake._next_cache_position)


def test_synthetic_fill_replays_clustergen_prefill_chunk_by_chunk(tiny_llama):
    """ClusterGen's synthetic state is built as a real prefill builds it, a fold a chunk (REPLAY_CHUNKS): the
    schedule, fills and exact slots' positions of a real prefill, every token but the exact ones folded (n_seen), δ
    calibrated and clusters open in every row (a fill of the kept slots alone left the sketch empty); a context that
    is not a multiple of the prefill chunk is refused by name."""
    import kvrewrite

    model, captured = tiny_llama
    kw = dict(budget=0.5, max_length=300, captured=captured, window=4, n_sink=2, t=2, interval=4)
    real, fake = (kvrewrite.apply(model, "clustergen", **kw) for _ in range(2))
    real.prefill(torch.randint(1, 128, (2, 256)), max_new_tokens=40)
    e2e.synthetic_fill(fake, 256, 40)
    assert real.schedule.fill == fake.schedule.fill and real.schedule.threshold == fake.schedule.threshold
    for i in range(2):
        r, f = real.layer_state(i), fake.layer_state(i)
        assert torch.equal(r["fill"], f["fill"]) and torch.equal(r["n_seen"], f["n_seen"])
        kept = int(f["fill"].max())
        assert kept == 6 and torch.equal(r["slot_pos"][..., :kept], f["slot_pos"][..., :kept])
        assert (f["delta"] > 0).all() and (f["n_clusters"] > 0).all() and (f["role"] == 1).any(-1).all()
    assert torch.equal(real._next_position, fake._next_position)
    with pytest.raises(ValueError, match="multiple of the prefill chunk"):
        e2e.synthetic_fill(fake, 250, 40)


# method: {field: why the synthetic state may leave it as reset where a real prefill sets it}
SYNTHETIC_LEAVES = {
    "h2o": {"score": "accumulated attention: zeros tie, and a compression still moves the slots over the target",
            "order": "the identity: the synthetic slots are in temporal order"},
    "snapkv": {"order": "the identity: the synthetic slots are in temporal order"},
    "kvmerger": {"score": "as h2o's", "degree": "no merge yet: random keys' merges come at decode as after a prefill"},
    "ems": {"key_scale": "the Global-Local statistics: zeros rank the entries by ties, the same work",
            "s_glo": "as key_scale", "s_loc_past": "as key_scale"},
}


@pytest.mark.parametrize("method", [m for m in METHODS if m != "full"])
def test_synthetic_fill_sets_what_a_real_prefill_sets(tiny_llama, method):
    """Every method's own state fields that a real prefill changes from the reset state, the synthetic fill changes
    too, but those SYNTHETIC_LEAVES names with its reason (ClusterGen's sketch was such a field until its fill
    replayed the folds: an empty sketch made its decode rows time another state)."""
    import kvrewrite

    model, captured = tiny_llama
    kw = dict(budget=0.5, max_length=300, captured=captured,
              **{"clustergen": dict(window=4, n_sink=2, t=2, interval=4),
                 "ems": dict(window=4, kernel=3, interval=4)}.get(method, {}))
    real, fake = (kvrewrite.apply(model, method, **kw) for _ in range(2))
    real.prefill(torch.randint(1, 128, (2, 256)), max_new_tokens=40)
    fake.reset(256, 40, prompt_slots=256)
    reset = [{k: v.clone() for k, v in fake.layer_state(i).items()} for i in range(2)]
    e2e.synthetic_fill(fake, 256, 40)
    left = {k for i in range(2) for k, v in real.layer_state(i).items()
            if not torch.equal(v, reset[i][k]) and torch.equal(fake.layer_state(i)[k], reset[i][k])}
    assert left == set(SYNTHETIC_LEAVES.get(method, {})), f"{method}: set by a real prefill only: {sorted(left)}"


def test_attention_bench_bytes_model():
    """kvrewrite.bench.attention counts what the op reads: decode graphs pass past_only=True, so no positions
    (4 B of bias per slot over SDPA's bytes), and 12 B (bias + int64 position) without it."""
    import dataclasses

    from kvrewrite.bench.attention import Config

    c = Config(B=8, C=1024)
    slots = 8 * 8 * 1024
    assert c.past_only
    assert c.sdpa_bytes == 2 * slots * 128 * 2 + 2 * 8 * 32 * 1 * 128 * 2  # K, V; q and the output
    assert c.bytes_moved - c.sdpa_bytes == 4 * slots
    assert dataclasses.replace(c, past_only=False).bytes_moved - c.sdpa_bytes == 12 * slots


def test_attention_sweep_heads_are_checked():
    """--sweep-heads HQ:HKV (one rank's heads at tp=2: 16:4): two ints, HKV >= 1 dividing HQ; anything else is an
    argparse error naming the expected form."""
    import argparse

    from kvrewrite.bench.attention import _heads

    assert _heads("16:4") == (16, 4) and _heads("32:8") == (32, 8)
    for bad, words in (("16", "HQ:HKV, two ints"), ("16:x", "HQ:HKV, two ints"), ("16:5", "dividing HQ"),
                       ("4:8", "dividing HQ"), ("8:0", "dividing HQ")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            _heads(bad)


def test_fuse_projections_flag_reaches_the_config():
    assert e2e.config_from_args(_parse([*TINY, "--fuse-projections"])).fuse_projections is True
    assert e2e.config_from_args(_parse([*TINY])).fuse_projections is False


def test_inductor_warm_up_waits_for_three_compressing_steps():
    # CUDA-graph trees record a graph on its second call: the timed steps must start after its third
    def decoder(mode, first_compress):
        dec = e2e.KVDecoder.__new__(e2e.KVDecoder)
        dec.mode, dec.device, dec.compresses, dec.graphs, dec.calls = mode, "cpu", True, {}, []
        dec.step = lambda: dec.calls.append(len(dec.calls) % 32 == first_compress) or dec.calls[-1]
        return dec

    for first in (0, 31):
        dec = decoder("inductor", first)
        steps = dec.warm_up(e2e.warmup_steps("inductor"))
        assert sum(dec.calls) == 3 and dec.calls[-1] and steps == first + 65
        dec = decoder("graph", first)
        dec.warm_up(e2e.warmup_steps("graph"))
        assert sum(dec.calls) == 1
    with pytest.raises(RuntimeError, match="need 3 of each"):
        decoder("inductor", 31).warm_up(e2e.warmup_steps("graph"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_profile_decode_refuses_to_run_without_a_gpu():
    from kvrewrite.bench import profile_decode

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        profile_decode.main(["--context", "1024"])


def test_layer_trace_rows_cost_what_each_kernel_adds_to_the_step():
    """trace_rows: a PDL kernel that starts early costs the time from the latest end to its own (the trace of a
    layer's attention, its combine and the o-projection); one that ends inside another costs 0; the costs add up to
    the stretch's span."""
    from kvrewrite.bench.profile_decode import trace_rows

    stretch = [(100.0, 101.5, "rope"), (101.7, 104.0, "append"), (102.5, 116.5, "attention"),
               (104.5, 119.7, "combine"), (106.0, 128.6, "o_proj"), (110.0, 111.0, "early_exit")]
    rows = trace_rows(stretch)
    assert [r[4] for r in rows] == [n for _, _, n in stretch]
    assert [r[0] for r in rows] == pytest.approx([0.0, 1.7, 2.5, 4.5, 6.0, 10.0])
    assert [r[1] for r in rows] == pytest.approx([1.5, 2.3, 14.0, 15.2, 22.6, 1.0])
    assert [r[2] for r in rows] == pytest.approx([0.0, 0.2, -1.5, -12.0, -13.7, -18.6])
    assert [r[3] for r in rows] == pytest.approx([1.5, 2.5, 12.5, 3.2, 8.9, 0.0])
    assert sum(r[3] for r in rows) == pytest.approx(28.6)  # the span: 128.6 - 100.0
    assert trace_rows([]) == []


@pytest.mark.parametrize("argv, needle", [(["--batch", "0"], "--batch must be >= 1"),
                                          (["--batch", "4", "--gemv"], "--gemv is batch 1 only")])
def test_profile_decode_refuses_bad_batches(capsys, argv, needle):
    from kvrewrite.bench import profile_decode

    with pytest.raises(SystemExit):
        profile_decode.main(argv)
    assert needle in capsys.readouterr().err


def test_observed_attention_bench_parses_configs_and_names_bad_ones(capsys):
    from kvrewrite.bench import observed_attention

    assert observed_attention.parse_configs("1x6656, 40x6656") == [(1, 6656), (40, 6656)]
    for bad in ("40", "0x6656", "4xC", "1x6656,"):
        with pytest.raises(ValueError, match="is not BxC"):
            observed_attention.parse_configs(bad)
    with pytest.raises(SystemExit):
        observed_attention.main(["--configs", "40by6656"])
    assert "'40by6656' is not BxC" in capsys.readouterr().err


@pytest.mark.parametrize("option, needle", [("no_such_config=1", "no_such_config"), ("combo_kernels", "NAME=VALUE"),
                                            ("combo_kernels=yes", "Python literal")])
def test_bad_inductor_options_are_named(capsys, option, needle):
    with pytest.raises(SystemExit):
        main(["bench", *TINY, "--kv-compile", "inductor", "--inductor-option", option])
    assert needle in capsys.readouterr().err


def test_inductor_options_reach_the_config():
    cfg = e2e.config_from_args(_parse([*TINY, "--kv-compile", "inductor", "--inductor-option", "combo_kernels=True",
                                       "--inductor-option", "triton.max_tiles=3"]))
    assert cfg.inductor_options == {"combo_kernels": True, "triton.max_tiles": 3}


def test_gemv_flag_reaches_the_config():
    assert e2e.config_from_args(_parse([*TINY, "--gemv"])).gemv is True
    assert e2e.config_from_args(_parse([*TINY])).gemv is False


def test_gemv_bench_plot_draws_from_json_rows(tmp_path):
    from kvrewrite.bench import gemv

    env = dict(gpu="test GPU", torch="t", triton="x", git_sha="0" * 40)
    rows = [dict(config=dict(name=c.name, N=c.N, K=c.K), env=env,
                 result=dict(cublas_frac_of_copy=0.8, gemv_frac_of_copy=0.9)) for c in gemv.get_configs()]
    gemv.plot(rows, tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 0
    assert [c.name for c in gemv.get_configs()][-1] == "lm_head"


def test_kernel_option_sets_a_launch_constant_and_refuses_the_rest(monkeypatch):
    from kvrewrite.kernels import gemv_rms_norm

    args = _parse([*TINY, "--kernel-option", "gemv_rms_norm.BLOCK_N=2", "--kernel-option", "gemv_rms_norm.PRELOAD=True"])
    cfg = e2e.config_from_args(args)
    assert cfg.kernel_options == {"gemv_rms_norm.BLOCK_N": 2, "gemv_rms_norm.PRELOAD": True}
    monkeypatch.setattr(gemv_rms_norm, "BLOCK_N", gemv_rms_norm.BLOCK_N)  # restored after the test
    monkeypatch.setattr(gemv_rms_norm, "PRELOAD", gemv_rms_norm.PRELOAD)
    import torch.compiler.config

    # the config's own patch, not monkeypatch: pytest >= 9.2 undoes a module attribute it did not find in the module's
    # __dict__ by deleting it, and a deleted torch config entry is hidden for the rest of the process (every later
    # torch.compile in this worker then fails)
    with torch.compiler.config.patch(force_disable_caches=False):
        e2e.apply_kernel_options({})
        assert torch.compiler.config.force_disable_caches is False
        e2e.apply_kernel_options(cfg.kernel_options)
        assert gemv_rms_norm.BLOCK_N == 2 and gemv_rms_norm.PRELOAD is True
        assert torch.compiler.config.force_disable_caches is True  # no compiled step shared with other constants
    for bad, why in [("gemv_rms_norm.BLOCK_N=x", "Python literal"), ("nope.X=1", "not a module"),
                     ("gemv_rms_norm.launch_config=1", "not a launch constant"), ("BLOCK_N=1", "MODULE.NAME=VALUE"),
                     ("gemv_rms_norm.BLOCK_N=True", "holds a int")]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            e2e.kernel_option(bad)


def test_bench_rows_parallel_refuses_more_rows_than_gpus(tmp_path):
    """scripts/bench_rows_parallel.sh gives each row a GPU of its own: more rows than GPUs are refused before any
    bench starts (this CPU has none)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts/bench_rows_parallel.sh"
    n_gpu = torch.cuda.device_count()
    rows = [f"r{i}::--device cpu" for i in range(n_gpu + 1)]
    out = subprocess.run(["bash", str(script), str(tmp_path / "out"), *rows], capture_output=True, text=True)
    assert out.returncode == 2 and f"{n_gpu + 1} rows for {n_gpu} GPUs" in out.stderr, out
    assert not (tmp_path / "out" / "rows.json").exists()


def test_gemv_sweep_grid_parses_and_refuses_unknown_knobs():
    from kvrewrite.bench import gemv

    assert gemv.parse_grid("block_n=1,2;num_stages=3") == {"block_n": [1, 2], "num_stages": [3]}
    assert set(gemv.parse_grid(gemv.DEFAULT_GRID)) == {"block_n", "block_k", "num_warps", "num_stages", "evict_first"}
    with pytest.raises(SystemExit, match="unknown knob 'warps'"):
        gemv.parse_grid("warps=4")
    with pytest.raises(SystemExit, match="block_k takes comma-separated integers"):
        gemv.parse_grid("block_k=big")


def test_attention_plot_draws_the_committed_h100_run(tmp_path):
    """The committed decode-attention JSON redraws (the dotted "at SDPA's GB/s" line needs sdpa_bytes and
    bytes_moved in every row), and its bytes make that line sit below 1 by the bias: 4 of 516 bytes per slot."""
    from pathlib import Path

    from kvrewrite.bench import plot

    rows = json.loads((Path(__file__).parents[1] / "docs/bench/attention_h100.json").read_text())
    plot.plot_attention(rows, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0
    for r in rows:
        assert r["result"]["sdpa_bytes"] / r["result"]["bytes_moved"] == pytest.approx(512 / 516, rel=1e-3)


def test_ems_synthetic_table_is_valid_and_decodes(tiny_llama):
    """EMS's synthetic fill builds a valid token table at its cap (min(gamma * B, n) slots), which the decode steps and the
    decode-time compression accept; ems_read_bytes counts entries and slots."""
    import kvrewrite
    from tests.methods.test_ems import check_table

    model, captured = tiny_llama
    rw = kvrewrite.apply(model, "ems", budget=0.25, max_length=300, captured=captured, window=4, kernel=3, interval=4)
    e2e.synthetic_fill(rw, 256, 40)
    st = rw.layer_state(0)
    B = int(st["budget"][0])
    assert st["fill"].unique().tolist() == [B] and st["slot_fill"].unique().tolist() == [min(4 * B, 256)]
    check_table(st)
    dec = e2e.KVDecoder(rw, "eager")
    for _ in range(9):
        dec.step()
    for info in rw.layers:
        check_table(rw.layer_state(info.index))
    want = sum(2 * i.num_kv_heads * (float(rw.layer_state(i.index)["fill"].float().mean()) * (2 * i.head_dim * 4 + 8)
                        + 8 * float(rw.layer_state(i.index)["slot_fill"].float().mean())) for i in rw.layers)
    assert e2e.ems_read_bytes(rw, 2) == pytest.approx(want)


def test_clustergen_read_bytes_counts_exact_slots_and_sketch(tiny_llama):
    """clustergen_read_bytes: per KV head the exact slots (K, V, bias, role) and the sketch (K, bias, role for its S
    slots, V for its value samples): checked against the roles the fold wrote, after a synthetic fill and decode
    steps that fold again."""
    import kvrewrite

    model, captured = tiny_llama
    rw = kvrewrite.apply(model, "clustergen", budget=0.5, max_length=300, captured=captured, window=4, n_sink=2, t=2,
                         interval=4)
    e2e.synthetic_fill(rw, 256, 40)
    dec = e2e.KVDecoder(rw, "eager")
    for _ in range(9):
        dec.step()
    want = 0.0
    for i in rw.layers:
        st = rw.layer_state(i.index)
        row = i.head_dim * 4  # fp32 model
        C = st["keys"].shape[2]
        S = C - int((st["role"][0, 0] == 1).nonzero()[0])  # the sketch starts with cluster 0's key samples
        assert (st["role"][..., :C - S] == 0).all() and (st["role"][..., C - S:] == 1).any(-1).all()
        n_value = (st["role"] == 2).sum(-1).float().mean()
        want += 2 * i.num_kv_heads * (float(st["fill"].float().mean()) * (2 * row + 5) + S * (row + 5)
                                      + float(n_value) * row)
    assert e2e.clustergen_read_bytes(rw, 2) == pytest.approx(want)


def test_isolated_rows_run_in_their_own_process_and_max_batches_shrink_after_an_oom(tmp_path):
    """--isolate: a row measured by a child process comes back whole; a "max" row that runs out of memory is tried
    again with 15% fewer rows (at most 3 tries, recorded), a fixed batch is not retried, any other error is kept."""
    from kvrewrite.bench import e2e_isolated as iso

    cfg = e2e.BenchConfig(model="tiny-llama", systems=("streamingllm",), contexts=(128,), batches=("1", "max"),
                          max_batch_cap=3, reps=1, intervals=1, kv_compile="eager", device="cpu",
                          out=str(tmp_path / "a.json"))
    cfg.validate()
    planner = e2e.Bench(cfg, planner=True)
    assert planner.model.device.type == "meta" and planner.copy_gbps is None
    row = iso.row_in_process(cfg, planner, "streamingllm", 128, 1, "1")  # a real child process
    assert row["tok_per_s"] > 0 and row["copy_gbps"] > 0 and "error" not in row

    seen = []

    def fake(cfg, planner, system, n, B, bspec, log):
        seen.append((bspec, B))
        if B > 1 or bspec == "1":
            return dict(planner.row_head(system, n, B, bspec),
                        error="OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        return dict(row, batch=B, batch_spec=bspec, copy_gbps=7.0)  # the real row's timings

    doc = iso.run_isolated(cfg, log=lambda s: None, run_row=fake)
    assert seen == [("1", 1), ("max", 3), ("max", 2), ("max", 1)]
    rows = {r["batch_spec"]: r for r in doc["rows"]}
    assert "error" in rows["1"] and "max_batch_tries" not in rows["1"]
    assert rows["max"]["max_batch_tries"] == [3, 2, 1] and rows["max"]["batch"] == 1 and doc["copy_gbps"] == 7.0
    assert not iso.out_of_memory({"error": "RuntimeError: shapes do not match"})


def test_plot_tp(tmp_path):
    """plot_tp draws tp=1 and tp=2 JSONs side by side: one bar per row label, repeated runs of a label as a range;
    rows that did not run are left out."""
    pytest.importorskip("matplotlib")
    from kvrewrite.bench import plot_tp

    def doc(tp, ms):
        row = dict(system="chelsea", model="llama-3.1-8b", batch=1, context=32768, budget=0.2, kv_compile="graph",
                   ms_per_token=ms,
                   floor_ms=2.0, tok_per_s=1e3 / ms)
        return dict(env=dict(gpu="G", torch="t", **({"tp": tp} if tp > 1 else {})),
                    rows=[row, dict(system="full", model="llama-3.1-8b", batch=4, error="OutOfMemoryError")])

    paths = []
    for name, tp, ms in (("a", 1, 4.0), ("b", 2, 3.0), ("c", 2, 3.2)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc(tp, ms)))
    rows, env = plot_tp._rows(paths)
    labels = [r["label"] for r in rows]
    assert env == dict(gpu="G", torch="t")  # the first JSON's (the title's)
    assert labels == ["8b chelsea\nB=1 tp=1\nCUDA graphs"] + ["8b chelsea\nB=1 tp=2\nCUDA graphs"] * 2
    assert plot_tp.main([*map(str, paths), "--out", str(tmp_path / "tp.png")]) == 0
    assert (tmp_path / "tp.png").stat().st_size > 0


def test_column_stats_sweep_variants_and_flops():
    """bench.column_stats: the default launch first, then the override grid; q·k flops of every (query, slot)."""
    from kvrewrite.bench.column_stats import FOCUS, VARIANTS, qk_tflops, variants

    full, quick = variants(), variants(quick=True)
    assert full[0] == {} and quick[0] == {}
    assert quick[1:] == FOCUS and full[-len(FOCUS):] == FOCUS and len(full) == 1 + 32 + 2 + len(FOCUS)
    assert all(set(v) == set(VARIANTS) for v in full[1:33])
    assert [v["num_stages"] for v in full[33:35]] == [3, 3] and all(v["block_m"] == 64 for v in full[33:35])
    assert qk_tflops(8, 32, 2048, 8704, 128, 1e6) == pytest.approx(2 * 8 * 32 * 2048 * 8704 * 128 / 1e12)


def test_attention_sweep_kernel_means():
    """bench.attention.kernel_means: each kernel's device time per call, summed over its launches."""
    from kvrewrite.bench.attention import kernel_means

    events = [(0.0, 10.0, "fwd"), (9.0, 12.0, "combine"), (20.0, 31.0, "fwd"), (30.0, 34.0, "combine")]
    assert kernel_means(events, 2) == {"fwd": 10.5, "combine": 3.5}
    assert kernel_means([], 3) == {}


def test_attention_prefill_inputs_repeat_the_layout_per_batch_row():
    """bench.attention_prefill --batch: every row holds the case's layout (n_past past slots, T causal fresh ones,
    empty slots after them), the queries at the fresh slots' positions."""
    from kvrewrite.bench.attention_prefill import HKV, HQ, make_inputs

    q, k, v, bias, pos, cp = make_inputs(5, 7, 16, 30, device="cpu", batch=3)
    assert q.shape == (3, HQ, 5, 128) and k.shape == v.shape == (3, HKV, 16, 128)
    assert torch.isfinite(bias[..., :12]).all() and (bias[..., 12:] == float("-inf")).all()
    assert (bias[..., 7:12] == 0).all() and torch.equal(cp, torch.arange(30, 35))
    assert torch.equal(pos[..., 7:12], cp.expand(3, HKV, 5)) and (pos[..., :7] < 30).all()


def test_ems_prefill_state_is_a_valid_table_and_the_dense_check_measures_it():
    """bench.ems_prefill: the synthetic late chunk is a valid EMS table (slots grouped by entry in order, the window
    and the chunk one slot each, gamma * Bt old slots), the reference attention on it passes the bench's dense check,
    and every launch variant names real overrides."""
    import inspect

    from kvrewrite.bench import ems_prefill as ep
    from kvrewrite.kernels import _ems_fold_kernels, ems_redundancy
    from kvrewrite.kernels import expanded_attention as xa

    gen = torch.Generator().manual_seed(0)
    args, Bt = ep.prefill_state(1, 1600, 64, gen, dev="cpu")
    q, keys, values, bias, slot_pos, cpos, entry_start, lut, key_scale, slot_fill = args
    C, fill = keys.shape[2], int(slot_fill[0, 0])
    assert C == Bt + 64 and fill == ep.GAMMA * Bt + 64 and lut.shape[2] >= fill
    used = lut[0, 0, :fill].long()
    assert (used.diff() >= 0).all() and used[0] == 0 and used[-1] == C - 1 and (lut[0, 0, fill:] == -1).all()
    assert torch.equal(entry_start[0, 0].long(), torch.searchsorted(used, torch.arange(C)))
    size = torch.bincount(used, minlength=C)
    assert (size[Bt - ep.WINDOW:] == 1).all() and torch.equal(slot_pos[0, 0, Bt:], cpos)
    assert (key_scale[0, 0, :fill][size[used] == 1] == 1).all()
    out, _ = xa.reference_expanded_attention(*args, ep.D**-0.5)
    assert ep.dense_check(args, out, ep.D**-0.5) < 1e-2
    assert ep.dense_check(args, torch.zeros_like(out), ep.D**-0.5) > 1e-2
    knobs = set(inspect.signature(xa._launch_config).parameters) | {"prefill_kernel", "gathered", "full_tiles"}
    assert all(set(t) <= knobs for t in ep.EXPANDED.values())
    assert all(set(names) <= set({"expanded": ep.EXPANDED, "fold": ep.FOLD, "redundancy": ep.REDUNDANCY}[kind])
               for kind, names in ep.QUICK.items())
    assert all(set(t) <= set(inspect.signature(_ems_fold_kernels._stats_launch).parameters) for t in ep.FOLD.values())
    red = set(inspect.signature(ems_redundancy.triton_ems_redundancy).parameters)
    assert all(set(t) <= red for t in ep.REDUNDANCY.values())


def test_dense_prefill_probe_takes_only_cases_whose_slots_are_in_position_order():
    """bench.dense_prefill_probe masks by slot index, so it refuses a case whose slot i does not hold position i (the
    chelsea cases: a compressed past) before it touches a GPU; its variants cover the three load forms."""
    from kvrewrite.bench import dense_prefill_probe as probe

    with pytest.raises(SystemExit, match="position order"):
        probe.run(1, "chelsea 32k chunk 2048")
    assert {v[4] for v in probe.VARIANTS} == {0, 1, 2}
    assert all(probe.CASES[c][1] == probe.CASES[c][3] for c in ("clusterkv 32k chunk 2048 (16k used)",
                                                                "full 32k chunk 1024 (16k used)"))
