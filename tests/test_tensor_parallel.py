"""Tensor parallelism on the CPU (kvrewrite/tensor_parallel.py, docs/tensor-parallel.md): ONE spawned 2-process gloo
group runs every check inside the ranks (capture dominates the time, so each model is captured once per rank) and
writes what failed to a JSON file per rank; the test asserts that nothing did.

Inside the ranks (apply initialises the group itself from torchrun's environment variables, as under torchrun):
- llama with random q/k/v/o and gate/up/down biases (column- and row-parallel biases both): every method of
  tests/methods_matrix.py (its first settings per name) at tp=2 against tp=1 on rank 0: greedy tokens identical,
  logits within FULL_TOL for `full` and METHOD_TOL for the others (clustergen and clusterkv through their ops'
  head_offset: rank 1's head draws what tp=1's head 1 drew);
  `full` against HF's own generate too, with two all-reduces per layer in each graph, and with
  fuse_projections=True and gemv=True; the user's model unchanged (its logits bit for bit, its config);
- mistral (a window on every layer), qwen2 (q/k/v biases, windows on the upper layers), qwen3 (per-head q/k norms),
  gemma, granite (residual and attention multipliers), smollm3 (layers without RoPE), olmo (clip_qkv), gemma3
  (sliding-window layers, per-head norms), gemma2 (attention and final-logit soft caps, eager) and cohere (parallel
  attention and MLP, scaled logits): `full` at tp=2 against HF's forward over the generated tokens;
- every rank generates the same tokens, greedy and sampled (each rank seeded differently: rank 0's draws win);
- apply of the rank's own model (tensor_parallel.rank_model, what a rank that loads only its share passes) equals
  apply of the whole model; a share of another split, of another rank or left on the meta device is refused;
- `kvrewrite bench --tp 2`'s CPU dry run (full and chelsea rows, tiny-llama): rank 0 writes the rows, rank 1 nothing;
- refusals naming the numbers: indivisible KV heads (MQA), a family outside TP_MODELS (phi3's fused qkv_proj), a
  model HF already sharded, a world size other than tp, verify=True, exporting a tp=2 model to AOTInductor;
- torch_export of the tp=2 `full` model, one directory per rank, loaded on both ranks: the same tokens and logits;
- apply's tp_all_reduce: "auto" runs the group's all-reduce on the CPU ("one_shot" is refused there, by name) and
  gives the same logits as "collective".

The GPU test (2 GPUs, marked gpu) runs the same checks in a 2-process NCCL group, each rank on its own GPU: once
in fp32 with the CPU's tolerances (the Triton kernels on both sides), then every method again in bf16 against tp=1
in bf16 (BF16_TOL on the relative logits error; the ranks' partial outputs are summed in bf16). There "auto" takes
kvrewrite::tp_all_reduce's one-shot kernel, so every check runs through it; its logits equal "collective"'s bit for
bit, and the op itself equals NCCL's all-reduce bit for bit over dtypes and sizes and inside a CUDA graph
(_one_shot_op_checks).
"""
import copy
import json
import os
import re
import socket
import time

import pytest
import torch

WORLD = 2
PROMPT, NEW = 26, 8  # the sizes tests/methods_matrix.py's settings fit
CHUNK, MAX_LENGTH = 8, 64
FULL_TOL = 1e-5  # fp32: the sums over ranks reorder the o_proj/down_proj reductions, nothing else
METHOD_TOL = 1e-4  # the same arithmetic; a looser bound only because a method's choices follow the scores
BF16_TOL = 1e-2  # bf16: ||tp2 - tp1|| / ||tp1|| of the logits; tp=1 against the fp32 model is of the same order
DEADLINE_S = {"cpu": 300, "cuda": 480}  # a rank stuck in a collective is killed and the test fails (GPU: Triton JIT)

dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is needed for the 2-process group")


def _llama_with_biases():
    import transformers as tf

    from tests.families import COMMON

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=2, attention_bias=True, mlp_bias=True, **COMMON)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    return _random_biases(model)


def _random_biases(model):
    """HF initialises biases to zero: random ones make the bias handling observable."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    return model


def _tiny(make_cfg, attn="sdpa"):
    import transformers as tf

    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(make_cfg(tf), attn_implementation=attn, dtype=torch.float32).eval()


def _generate(model_or_rw, ids):
    out = model_or_rw.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
    return out.sequences, torch.stack(list(out.logits))


def _max_diff(a, b) -> float:
    return float((a - b).abs().max()) if a.shape == b.shape else float("inf")


def _rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm()) if a.shape == b.shape else float("inf")


class _Checks:
    def __init__(self, rank: int):
        self.rank, self.failures, self.seconds, self.diffs = rank, [], {}, {}

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(f"rank {self.rank}: {what}")

    def raises(self, exc, fragments, fn, what: str) -> None:
        try:
            fn()
        except exc as e:
            missing = [f for f in fragments if f not in str(e)]
            self.expect(not missing, f"{what}: the error misses {missing}: {e}")
            return
        except Exception as e:  # noqa: BLE001  (the wrong kind of error is a failure to report)
            self.failures.append(f"rank {self.rank}: {what}: raised {type(e).__name__}, not {exc.__name__}: {e}")
            return
        self.failures.append(f"rank {self.rank}: {what}: nothing was raised")

    def same_on_ranks(self, tokens, what: str) -> None:
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, tokens.tolist())
        self.expect(all(g == gathered[0] for g in gathered), f"{what}: the ranks generated different tokens {gathered}")


def _refusals(c: _Checks, kvrewrite) -> None:
    """The refusals decided before any process group is needed (no capture is made)."""
    from kvrewrite.errors import RewriteError

    mqa = _tiny(lambda tf: tf.LlamaConfig(num_hidden_layers=1, **dict(_common(), num_key_value_heads=1)))
    c.raises(ValueError, ["tp=2 does not divide num_key_value_heads=1 of llama"],
             lambda: kvrewrite.apply(mqa, "full", tp=2), "MQA llama")
    phi3 = _tiny(lambda tf: tf.Phi3Config(num_hidden_layers=1, pad_token_id=0,
                                          **{k: v for k, v in _common().items() if k != "head_dim"}))
    c.raises(RewriteError, ["tp=2", "phi3"], lambda: kvrewrite.apply(phi3, "full", tp=2), "phi3 (fused qkv_proj)")
    sharded = _tiny(lambda tf: tf.LlamaConfig(num_hidden_layers=1, **_common()))
    sharded._tp_size = 2  # what from_pretrained(..., tp_plan="auto") records
    c.raises(RewriteError, ["tp_plan", "tp=N"], lambda: kvrewrite.apply(sharded, "full", tp=2), "HF tp_plan model")
    plain = _tiny(lambda tf: tf.LlamaConfig(num_hidden_layers=1, **_common()))
    c.raises(ValueError, ["verify=True", "tp=2"], lambda: kvrewrite.apply(plain, "full", tp=2, verify=True),
             "verify=True")


def _common():
    from tests.families import COMMON

    return dict(COMMON)


def _bench_dry_run(rank: int, c: _Checks, out_dir: str, device: str = "cpu") -> None:
    from kvrewrite.bench.e2e import BenchConfig, run_bench

    out = os.path.join(out_dir, "e2e.json")
    cfg = BenchConfig(model="tiny-llama", systems=("full", "chelsea:interval=4:n_sink=4:n_recent=16"), contexts=(256,),
                      batches=("1",), budget=0.2, prefill_chunk=64, intervals=1, reps=1, device=device, tp=WORLD,
                      out=out)
    doc = run_bench(cfg)
    if rank != 0:
        c.expect(doc == {}, f"bench --tp: rank {rank} returned a document")
        return
    rows = doc.get("rows", [])
    c.expect(len(rows) == 2 and doc["env"].get("tp") == WORLD, f"bench --tp: rows {rows}, env {doc.get('env')}")
    for r in rows:
        ok = "error" not in r and r.get("tp") == WORLD and r.get("ms_per_token", 0) > 0 and r.get("kv_bytes", 0) > 0
        c.expect(ok, f"bench --tp: row {r}")


def _first_methods():
    """(name, kwargs) of every method of tests/methods_matrix.py (its first settings per name)."""
    from tests.methods_matrix import METHODS_MATRIX

    seen = {}
    for entry in METHODS_MATRIX:
        seen.setdefault(entry["name"], entry["kwargs"])
    return list(seen.items())


def _rank_model_checks(rank: int, c: _Checks, llama, ids, logits) -> None:
    """apply(tp=2) of the rank's own model (rank_model: what a rank that loads only its share passes) equals apply of
    the whole model, bit for bit; a share of another split, of another rank or still on the meta device is refused."""
    import kvrewrite
    from kvrewrite.tensor_parallel import rank_model

    own = rank_model(llama, WORLD, rank, "test")
    rw = kvrewrite.apply(own, "full", max_length=MAX_LENGTH, prefill_chunk=CHUNK, tp=WORLD)
    own_logits = _generate(rw, ids)[1]
    c.expect(torch.equal(own_logits, logits), f"apply of the rank's model: logits {_max_diff(own_logits, logits):.3g} "
                                              f"off the whole model's")
    c.raises(ValueError, ["rank 0's share of a tp=2 split", "tp=4"],
             lambda: kvrewrite.apply(rank_model(llama, WORLD, 0, "test"), "full", tp=4), "share of another split")
    c.raises(ValueError, [f"rank {1 - rank}'s share", f"this process is rank {rank}"],
             lambda: kvrewrite.apply(rank_model(llama, WORLD, 1 - rank, "test"), "full", tp=WORLD),
             "another rank's share")
    meta = rank_model(copy.deepcopy(llama).to("meta"), WORLD, rank, "test")
    c.raises(ValueError, ["meta device", "to_empty"], lambda: kvrewrite.apply(meta, "full", tp=WORLD),
             "a share on the meta device")


def _all_reduce_choice_checks(c: _Checks, kvrewrite, llama, shared, ids, tokens, logits, dev) -> None:
    """apply's tp_all_reduce: "collective" gives the same tokens and, at tp=2 (a + b in either order), the same
    logits bit for bit as "auto"; on the CPU "one_shot" is refused by name; on the GPUs the op itself (below)."""
    rw = kvrewrite.apply(llama, "full", captured=shared, max_length=MAX_LENGTH, tp=WORLD, tp_all_reduce="collective")
    c.expect(rw.tp_all_reduce == "collective", f"tp_all_reduce='collective' ran {rw.tp_all_reduce}")
    other_tokens, other_logits = _generate(rw, ids)
    c.diffs["llama full auto vs collective"] = _max_diff(logits, other_logits)
    c.expect(torch.equal(other_tokens, tokens) and torch.equal(other_logits, logits),
             f"llama full: tp_all_reduce 'auto' and 'collective' differ by {_max_diff(logits, other_logits):.3g}")
    if dev.type == "cpu":
        c.raises(ValueError, ["tp_all_reduce='one_shot'", "CUDA only", "'collective'"],
                 lambda: kvrewrite.apply(llama, "full", captured=shared, tp=WORLD, tp_all_reduce="one_shot"),
                 "one_shot on the CPU")
    else:
        _one_shot_op_checks(c, dev)


def _one_shot_op_checks(c: _Checks, dev) -> None:
    """kvrewrite::tp_all_reduce on the GPUs against the group's all-reduce, bit for bit (2 ranks), with each of its
    kernels (push, torch's one-shot): float32, bf16 and fp16 (the collective's dtype), sizes around the 16-byte rule,
    the push kernel's grid stride (more blocks than programs) and the one-shot cut, each rank its own values, three
    calls each (the push kernel's slots alternate), and with a residual (the sum, then + residual); then three
    chained calls in one CUDA graph (two with a residual), replayed with new inputs (the buffer is reused). And
    kvrewrite::tp_all_gather (padded rows summed where they fit the buffer) against the group's all-gather."""
    from kvrewrite.kernels.tp_all_reduce import ONE_SHOT_MAX_BYTES, one_shot_buffer

    from kvrewrite.kernels import tp_all_reduce as op

    group = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    gen = torch.Generator(device=dev).manual_seed(10 + dist.get_rank())
    for push in (True, False):  # the push kernel (default), torch's one-shot kernel
        op.PUSH = push
        kernel = "push" if push else "torch"
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            size = torch.tensor([], dtype=dtype).element_size()
            for numel in (1, 8, 4096, 3 * 4096 + 8, 64 * 1024 * 2 + 8, ONE_SHOT_MAX_BYTES // size,
                          ONE_SHOT_MAX_BYTES // size + 8):
                x = torch.randn(numel, generator=gen, device=dev).to(dtype)
                took = "one-shot" if one_shot_buffer(x, group) is not None else "collective"
                want = (dtype != torch.float16 and numel * size % 16 == 0 and numel * size <= ONE_SHOT_MAX_BYTES)
                c.expect((took == "one-shot") == want, f"tp_all_reduce {dtype} x {numel}: took the {took} path")
                ref = c10d.wait_tensor(c10d.all_reduce(x, "sum", group))
                for _ in range(3):  # the push kernel's slots alternate per call
                    got = torch.ops.kvrewrite.tp_all_reduce(x, group)
                    c.expect(torch.equal(got, ref), f"tp_all_reduce[{kernel}] {dtype} x {numel} ({took}): differs "
                                                    f"from the group's all-reduce by "
                                                    f"{_max_diff(got.float(), ref.float()):.3g}")
                r = torch.randn(numel, generator=gen, device=dev).to(dtype)  # the residual: the sum, then + r
                got = torch.ops.kvrewrite.tp_all_reduce(x, group, r)
                c.expect(torch.equal(got, ref + r), f"tp_all_reduce[{kernel}] {dtype} x {numel} + residual: differs "
                                                    f"by {_max_diff(got.float(), (ref + r).float()):.3g}")
    op.PUSH = True
    _norm_op_checks(c, dev, group, gen)
    _norm_in_graph_checks(c, dev)
    from kvrewrite.kernels.tp_all_gather import join_blocks

    world = dist.get_world_size()
    for shape in ((1, 1, 64128), (1, 3, 1000), (1, 4096, 4096)):  # 8B decode logits, a small chunk, one past the cut
        x = torch.randn(shape, generator=gen, device=dev).to(torch.bfloat16)
        ref = join_blocks(c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group)), world)
        got = torch.ops.kvrewrite.tp_all_gather(x, group, world)
        c.expect(torch.equal(got, ref), f"tp_all_gather {tuple(shape)}: differs from the group's all-gather")
    x = torch.empty(2, 4096, device=dev, dtype=torch.bfloat16)

    def chain():
        y = torch.ops.kvrewrite.tp_all_reduce(x, group)
        return torch.ops.kvrewrite.tp_all_reduce(torch.ops.kvrewrite.tp_all_reduce(y * 0.5, group, x) - x, group, y)

    _graph_replay_checks(c, chain, [x], gen, "tp_all_reduce")


def _graph_replay_checks(c: _Checks, chain, inputs, gen, what: str) -> None:
    """chain() (a tensor or a tuple of them) recorded in a CUDA graph: four replays, each after new normal values in
    `inputs`, every output bit for bit the eager chain's on the same inputs (the ops' buffers reused by the graph)."""
    from kvrewrite.bench.cuda_graphs import capture, warm_up

    def outputs():
        got = chain()
        return got if isinstance(got, tuple) else (got,)

    for t in inputs:
        t.normal_(generator=gen)
    warm_up(chain)
    outs = [torch.empty_like(t) for t in outputs()]
    graph = capture(lambda: [o.copy_(t) for o, t in zip(outs, outputs())])
    for replay in range(4):
        for t in inputs:
            t.normal_(generator=gen)
        expected = outputs()
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        d = max(_max_diff(o.float(), e.float()) for o, e in zip(outs, expected))
        c.expect(all(torch.equal(o, e) for o, e in zip(outs, expected)),
                 f"{what} in a CUDA graph, replay {replay}: differs by {d:.3g}")


def _norm_op_checks(c: _Checks, dev, group: str, gen) -> None:
    """kvrewrite::tp_all_reduce_rms_norm's one kernel against its two launches (FUSED False: the push kernel, then the
    split norm's kernel): h and n bit for bit (n within a few ulps past NORM_REGISTER_ELEMENTS, where the split norm
    sums its squares in another order), Llama's and Gemma's norm, with and without a residual, the 8B and 70B rows, a
    longer one and a partial tile, three calls each (the norm channel's slots alternate), interleaved with
    tp_all_reduce calls (the sum channel's own slots); n also against HF's norm in aten on h (within bf16 rounding);
    then the op in a CUDA graph."""
    from kvrewrite.kernels import tp_all_reduce_rms_norm as fused
    from kvrewrite.kernels.gemv import ROUNDING
    from kvrewrite.kernels.gemv_rms_norm import NORM_REGISTER_ELEMENTS, reference_rms_norm

    for dtype in (torch.float32, torch.bfloat16):
        for numel in (4096, 8192, 12288, 3000 + 8):  # 12288: past NORM_REGISTER_ELEMENTS
            nw = (1 + 0.1 * torch.randn(numel, generator=gen, device=dev)).to(dtype)
            for residual, unit_offset in ((False, False), (True, False), (True, True)):
                what = f"tp_all_reduce_rms_norm {dtype} x {numel}{' + residual' if residual else ''}" + \
                       (" (Gemma)" if unit_offset else "")
                for _ in range(3):
                    x, r = (torch.randn(1, 1, numel, generator=gen, device=dev).to(dtype) for _ in range(2))
                    r = r if residual else None
                    c.expect(fused.fused_buffer(x, group, r, nw) is not None, f"{what}: not the one-kernel path")
                    h, n = torch.ops.kvrewrite.tp_all_reduce_rms_norm(x, group, r, nw, 1e-5, unit_offset)
                    torch.ops.kvrewrite.tp_all_reduce(x, group)  # the sum channel between two norm calls
                    fused.FUSED = False
                    try:
                        h2, n2 = torch.ops.kvrewrite.tp_all_reduce_rms_norm(x, group, r, nw, 1e-5, unit_offset)
                    finally:
                        fused.FUSED = True
                    # past NORM_REGISTER_ELEMENTS the split norm loops over its tiles and sums the squares in
                    # another order: n then within a few of its dtype's ulps (1.4e-6 in float32 at 12288, stop 46)
                    n_tol = 0.0 if numel <= NORM_REGISTER_ELEMENTS else 4 * ROUNDING[dtype] * float(n2.abs().max())
                    c.expect(torch.equal(h, h2) and _max_diff(n.float(), n2.float()) <= n_tol,
                             f"{what}: one kernel differs from two launches by {_max_diff(h.float(), h2.float()):.3g} "
                             f"(h), {_max_diff(n.float(), n2.float()):.3g} (n; allowed {n_tol:.3g})")
                    ref = reference_rms_norm(h, nw, 1e-5, unit_offset)
                    d = _max_diff(n.float(), ref.float()) / max(float(ref.float().abs().max()), 1e-30)
                    c.expect(d <= (2 ** -7 if dtype == torch.bfloat16 else 1e-6), f"{what}: n vs HF's norm {d:.3g}")
    _norm_graph_checks(c, dev, group, gen)


def _norm_graph_checks(c: _Checks, dev, group: str, gen) -> None:
    """Three chained tp_all_reduce_rms_norm calls (the 8B row) recorded in a CUDA graph: every replay's h and n bit for
    bit the eager calls' on the same inputs (the slots carried on by the kernel's own call count)."""
    op = torch.ops.kvrewrite.tp_all_reduce_rms_norm
    x, r = (torch.empty(1, 1, 4096, device=dev, dtype=torch.bfloat16) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(4096, generator=gen, device=dev)).to(torch.bfloat16)

    def chain():
        h, n = op(x, group, r, nw, 1e-5, False)
        h, n = op(n * 0.5, group, h, nw, 1e-5, False)
        return op(n - x, group, h, nw, 1e-5, True)

    _graph_replay_checks(c, chain, [x, r], gen, "tp_all_reduce_rms_norm")


def _norm_in_graph_checks(c: _Checks, dev) -> None:
    """A Llama without biases (each sum then takes its residual add and its norm), full at tp=2 with fused projections
    and gemv: every sum of the decode graph is a tp_all_reduce_rms_norm, and the tokens and logits are those of the
    same model without gemv (fp32)."""
    import kvrewrite
    from kvrewrite.tensor_parallel import capture_rank
    from tests.families import tiny_model

    llama = tiny_model("llama").to(dev)
    llama.generation_config.eos_token_id = None
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(5)).to(dev)
    shared = capture_rank(llama, WORLD, batch_size=1, prefill_chunk=CHUNK)
    plain = kvrewrite.apply(llama, "full", captured=shared, max_length=MAX_LENGTH, tp=WORLD)
    fused = kvrewrite.apply(llama, "full", captured=shared, max_length=MAX_LENGTH, tp=WORLD, fuse_projections=True,
                            gemv=True)
    n = sum(node.target == torch.ops.kvrewrite.tp_all_reduce_rms_norm.default for node in fused.decode_graph.graph.nodes)
    layers = len(llama.model.layers)
    c.expect(n == 2 * layers, f"bias-free llama fused+gemv at tp=2: {n} sums with their norm, not {2 * layers}")
    tokens, logits = _generate(plain, ids)
    fused_tokens, fused_logits = _generate(fused, ids)
    d = c.diffs["bias-free llama full fuse_projections+gemv (sums with their norm)"] = _max_diff(fused_logits, logits)
    c.expect(torch.equal(fused_tokens, tokens) and d <= FULL_TOL, f"bias-free llama, sums with their norm: {d:.3g}")


def _bf16_checks(rank: int, c: _Checks, dev) -> None:
    """Every method in bf16 on the GPUs: tp=2 against tp=1 (rank 0) by the relative error of the logits over the
    steps both runs fed the same tokens (a near-tie may pick another token in bf16; after it the runs differ)."""
    import kvrewrite
    from kvrewrite.capture import capture
    from kvrewrite.tensor_parallel import TP_REFUSED_METHODS, capture_rank

    t0 = time.perf_counter()
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(2)).to(dev)
    llama = _llama_with_biases().to(dev, torch.bfloat16)
    shared = capture_rank(llama, WORLD, batch_size=1, prefill_chunk=CHUNK)
    reference = capture(llama, batch_size=1, prefill_chunk=CHUNK) if rank == 0 else None
    for name, kwargs in _first_methods():
        if name in TP_REFUSED_METHODS:
            continue
        tokens, logits = _generate(kvrewrite.apply(llama, name, captured=shared, max_length=MAX_LENGTH, tp=WORLD,
                                                   **kwargs), ids)
        c.same_on_ranks(tokens, f"bf16 llama {name}")
        if rank == 0:
            ref_tokens, ref_logits = _generate(kvrewrite.apply(llama, name, captured=reference,
                                                               max_length=MAX_LENGTH, **kwargs), ids)
            gen, ref_gen = tokens[0, PROMPT:], ref_tokens[0, PROMPT:]
            same = int((gen == ref_gen).int().cumprod(0).sum()) if gen.shape == ref_gen.shape else 0
            steps = min(same + 1, NEW)  # the step that picked the first different token had the same inputs
            d = c.diffs[f"bf16 llama {name}"] = _rel_err(logits[:steps].float(), ref_logits[:steps].float())
            c.diffs[f"bf16 llama {name}: same tokens"] = same
            c.expect(d <= BF16_TOL, f"bf16 llama {name}: tp=2 logits differ from tp=1 by {d:.3g} (relative) > "
                                    f"{BF16_TOL} over {steps} steps")
    c.seconds["bf16"] = time.perf_counter() - t0


def _export_checks(rank, c, kvrewrite, rw, ids, tokens, logits, out_dir) -> None:
    """torch_export per rank (rank<r> under one path), load on every rank: rw's tokens and logits; a rank's own
    directory alone and the other targets are refused by name."""
    import kvrewrite.export
    from kvrewrite.export.loader import load

    c.raises(NotImplementedError, ["tp=2", "torch_export"], lambda: kvrewrite.export.aoti(rw, "/nonexistent"),
             "AOTInductor export of a tp=2 model")
    path = os.path.join(out_dir, "export_full")
    written = kvrewrite.export.torch_export(rw, path)
    c.expect(str(written) == os.path.join(path, f"rank{rank}"), f"tp=2 export wrote {written}")
    program = torch.export.load(os.path.join(written, "decode.pt2"))
    ops = {"collective": torch.ops._c10d_functional.all_reduce.default,
           "one_shot": torch.ops.kvrewrite.tp_all_reduce.default}
    n = sum(node.target == ops[rw.tp_all_reduce] for node in program.graph.nodes)
    c.expect(n == 2 * 2, f"tp=2 export: {n} all-reduces in the decode program, not 2 per layer")
    dist.barrier()  # every rank's directory is complete before any rank loads
    exported = load(path)
    ex_tokens, ex_logits = _generate(exported, ids)
    d = c.diffs["llama full exported per rank"] = _max_diff(ex_logits, logits)
    c.expect(torch.equal(ex_tokens, tokens) and d <= FULL_TOL, f"tp=2 export: tokens {ex_tokens.tolist()} vs "
                                                                f"{tokens.tolist()}, logits {d:.3g}")
    c.raises(ValueError, ["one rank's share", "parent directory"], lambda: load(written), "loading one rank's share")


def _rank_checks(rank: int, c: _Checks, out_dir: str, dev=torch.device("cpu")) -> None:
    import kvrewrite
    from kvrewrite.capture import capture
    from kvrewrite.tensor_parallel import TP_REFUSED_METHODS, capture_rank
    from tests.methods_matrix import METHODS_MATRIX

    from kvrewrite.kernels import tp_all_gather

    tp_all_gather.VOCAB_PARALLEL = True  # the default, pinned: these checks are of the lm_head split by vocabulary
    t0 = time.perf_counter()
    _refusals(c, kvrewrite)
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(dev)

    # every capture first (no collective runs in a capture but the group's start): rank 0 also makes tp=1's
    llama = _llama_with_biases().to(dev)
    with torch.no_grad():
        hf_before = llama(ids).logits
    config_before = llama.config.to_json_string()
    shared = capture_rank(llama, WORLD, batch_size=1, prefill_chunk=CHUNK)  # starts the group: no collective before
    reference = capture(llama, batch_size=1, prefill_chunk=CHUNK) if rank == 0 else None
    c.seconds["captures"] = time.perf_counter() - t0

    mha = _tiny(lambda tf: tf.LlamaConfig(num_hidden_layers=1, **dict(_common(), num_key_value_heads=4))).to(dev)
    c.raises(ValueError, ["tp=4", "world size is 2"], lambda: kvrewrite.apply(mha, "full", tp=4), "world size")

    # every method on llama: tp=2 against tp=1 (rank 0 holds tp=1's run)
    t1 = time.perf_counter()
    seen = set()
    for name, kwargs in _first_methods():
        if name in TP_REFUSED_METHODS:
            continue
        seen.add(name)
        rw = kvrewrite.apply(llama, name, captured=shared, max_length=MAX_LENGTH, tp=WORLD, **kwargs)
        tokens, logits = _generate(rw, ids)
        c.same_on_ranks(tokens, f"llama {name}")
        if rank == 0:
            ref = kvrewrite.apply(llama, name, captured=reference, max_length=MAX_LENGTH, **kwargs)
            ref_tokens, ref_logits = _generate(ref, ids)
            c.expect(torch.equal(tokens, ref_tokens), f"llama {name}: tp=2 tokens {tokens.tolist()} != tp=1 "
                                                      f"{ref_tokens.tolist()}")
            d = c.diffs[f"llama {name}"] = _max_diff(logits, ref_logits)
            tol = FULL_TOL if name == "full" else METHOD_TOL
            c.expect(d <= tol, f"llama {name}: tp=2 logits differ from tp=1 by {d:.3g} > {tol}")
        if name == "full":
            expected = {"cpu": "collective", "cuda": "one_shot"}[dev.type]  # tp_all_reduce="auto"
            c.expect(rw.tp_all_reduce == expected, f"llama full: tp_all_reduce {rw.tp_all_reduce}, not {expected}")
            op = {"collective": torch.ops._c10d_functional.all_reduce.default,
                  "one_shot": torch.ops.kvrewrite.tp_all_reduce.default}[rw.tp_all_reduce]
            all_reduces = [sum(n.target == op for n in g.graph.nodes)
                           for g in (rw.prefill_graph, rw.decode_graph, rw.decode_compress_graph)]
            c.expect(all_reduces == [2 * 2] * 3, f"llama full: all-reduces per graph {all_reduces}, not 2 per layer")
            _all_reduce_choice_checks(c, kvrewrite, llama, shared, ids, tokens, logits, dev)
            fused = kvrewrite.apply(llama, name, captured=shared, max_length=MAX_LENGTH, tp=WORLD,
                                    fuse_projections=True, gemv=True)
            fused_tokens, fused_logits = _generate(fused, ids)
            n_norm = sum(n.target == torch.ops.kvrewrite.tp_all_reduce_rms_norm.default
                         for n in fused.decode_graph.graph.nodes)
            # a sum takes its residual add, and then its norm, where its linear has no bias (else the bias comes
            # after the sum); each sum feeds a norm (the last: the model's)
            unbiased = sum(getattr(m, name).bias is None for m in (lyr.self_attn for lyr in llama.model.layers)
                           for name in ("o_proj",)) + sum(lyr.mlp.down_proj.bias is None for lyr in llama.model.layers)
            want_norm = unbiased if rw.tp_all_reduce == "one_shot" else 0
            c.expect(n_norm == want_norm, f"llama full fused+gemv at tp=2: {n_norm} sums with their norm, not {want_norm}")
            d = c.diffs["llama full fuse_projections+gemv"] = _max_diff(fused_logits, logits)
            c.expect(torch.equal(fused_tokens, tokens) and d <= FULL_TOL, f"llama full fused+gemv at tp=2: {d:.3g}")
            _rank_model_checks(rank, c, llama, ids, logits)
            torch.manual_seed(100 + rank)  # each rank its own draws: rw.generate takes rank 0's
            sampled = rw.generate(ids, max_new_tokens=NEW, do_sample=True, temperature=2.0)
            c.same_on_ranks(sampled, "llama full, sampled with a different seed on each rank")
            hf_tokens, hf_logits = _generate(llama, ids)
            d = c.diffs["llama full vs HF"] = _max_diff(logits, hf_logits)
            c.expect(torch.equal(tokens, hf_tokens) and d <= FULL_TOL, f"llama full: tp=2 vs HF: logits {d:.3g}")
            _export_checks(rank, c, kvrewrite, rw, ids, tokens, logits, out_dir)
    c.expect({e["name"] for e in METHODS_MATRIX} - set(TP_REFUSED_METHODS) <= seen, "a method was not run")
    c.seconds["methods"] = time.perf_counter() - t1
    with torch.no_grad():
        c.expect(torch.equal(llama(ids).logits, hf_before), "apply(tp=2) changed the user's model's logits")
    c.expect(llama.config.to_json_string() == config_before, "apply(tp=2) changed the user's model's config")

    # the other families: full at tp=2 against HF, through apply's own capture
    others = {"mistral": _tiny(lambda tf: tf.MistralConfig(num_hidden_layers=2, sliding_window=8, **_common())),
              "qwen2": _random_biases(_tiny(lambda tf: tf.Qwen2Config(
                  num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1, **_common()))),
              "qwen3": _tiny(lambda tf: tf.Qwen3Config(num_hidden_layers=2, **_common())),
              "gemma": _tiny(lambda tf: tf.GemmaConfig(num_hidden_layers=2, **_common())),
              "granite": _tiny(lambda tf: tf.GraniteConfig(num_hidden_layers=2, residual_multiplier=0.5,
                                                           attention_multiplier=0.2, **_common())),
              "smollm3": _tiny(lambda tf: tf.SmolLM3Config(num_hidden_layers=4, pad_token_id=0, **_common())),
              "olmo": _tiny(lambda tf: tf.OlmoConfig(num_hidden_layers=2, clip_qkv=0.5, **_common())),
              "gemma3": _tiny(lambda tf: tf.Gemma3TextConfig(
                  num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention"], **_common())),
              # attention and final-logit soft caps, windows on alternate layers (eager: HF's soft cap path)
              "gemma2": _tiny(lambda tf: tf.Gemma2Config(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
                                                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                                         **_common()), attn="eager"),
              # the attention and the MLP in parallel off one norm, the logits scaled
              "cohere": _tiny(lambda tf: tf.CohereConfig(num_hidden_layers=2, logit_scale=0.5, **_common()))}
    for name, model in others.items():
        model = model.to(dev)
        rw = kvrewrite.apply(model, "full", max_length=MAX_LENGTH, prefill_chunk=CHUNK, tp=WORLD)
        tokens, logits = _generate(rw, ids)
        # HF's forward over the generated sequence (not HF's generate: with OLMo's clip_qkv, HF's generate differs
        # from its own forward by 1e-2 on the first token, at tp=1 too, while kvrewrite matches the forward)
        with torch.no_grad():
            hf_logits = model(tokens).logits[0, PROMPT - 1:-1].unsqueeze(1)
        d = c.diffs[f"{name} full vs HF"] = _max_diff(logits, hf_logits)
        greedy = torch.equal(tokens[0, PROMPT:], hf_logits[:, 0].argmax(-1))
        c.expect(greedy and d <= FULL_TOL, f"{name} full: tp=2 vs HF's forward: logits {d:.3g}, greedy {greedy}")
        c.same_on_ranks(tokens, f"{name} full")
    t2 = time.perf_counter()
    _bench_dry_run(rank, c, out_dir, dev.type)
    c.seconds["bench"] = time.perf_counter() - t2
    c.seconds["total"] = time.perf_counter() - t0


def _rank_main(rank: int, port: int, out_dir: str, device: str = "cpu") -> None:
    """One rank: torchrun's environment, then every check; what failed goes to <out_dir>/rank<r>.json. On "cuda"
    the rank runs on GPU `rank` (NCCL), then the bf16 checks."""
    import warnings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    c = _Checks(rank)
    dev = torch.device("cpu")
    if device == "cuda":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    try:
        _rank_checks(rank, c, out_dir, dev)
        if device == "cuda":
            _bf16_checks(rank, c, dev)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"failures": c.failures, "seconds": c.seconds, "diffs": c.diffs}, f, indent=1)
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(tmp_path, device: str) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_rank_main, args=(_free_port(), str(tmp_path), device), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S[device]
    while not ctx.join(timeout=5):  # raises (and ends the other rank) when a rank fails
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the 2-process group did not finish in {DEADLINE_S[device]} s")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    failures = [f for r in reports for f in r["failures"]]
    print(json.dumps(reports[0], indent=1))
    assert not failures, "\n".join(failures)


def test_a_refused_method_is_named():
    """check_tp_method's refusal (TP_REFUSED_METHODS is empty today: every method reproduces tp=1), on an entry
    added for the test."""
    import types

    from kvrewrite import tensor_parallel as tpm

    saved = dict(tpm.TP_REFUSED_METHODS)
    tpm.TP_REFUSED_METHODS["chelsea"] = "a reason"
    try:
        with pytest.raises(ValueError, match=r"method 'chelsea' is not supported with tp=2: a reason; use tp=1"):
            tpm.check_tp_method(types.SimpleNamespace(name="chelsea"), 2, None, "apply")
        tpm.check_tp_method(types.SimpleNamespace(name="full"), 2, None, "apply")  # not refused
    finally:
        tpm.TP_REFUSED_METHODS.clear()
        tpm.TP_REFUSED_METHODS.update(saved)


def test_a_tp_export_with_a_rank_missing_is_refused_before_any_group(tmp_path):
    """loader.load of a tp=2 export whose rank1 directory is missing names the missing rank, before it would start
    a process group (the group's checks run in the 2-process test)."""
    from kvrewrite.export.common import FORMAT, META_FILE
    from kvrewrite.export.loader import load

    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / META_FILE).write_text(json.dumps({"format": FORMAT, "device": "cpu",
                                                            "tp": {"size": 2, "rank": 0}}))
    with pytest.raises(FileNotFoundError, match=r"tp=2 export needs rank0\.\.rank1; \[1\] are missing"):
        load(tmp_path)
    assert not dist.is_initialized()


def test_tensor_parallel_matches_tp1(tmp_path):
    """Every check above, in one spawned 2-process gloo group (module docstring)."""
    _run_group(tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 GPUs and NCCL")
def test_tensor_parallel_gpu_nccl(tmp_path):
    """The same checks in a 2-process NCCL group on 2 GPUs, fp32, then every method in bf16 (module docstring)."""
    _run_group(tmp_path, "cuda")


@pytest.mark.parametrize("argv, needle", [
    (["--systems", "hf-eager,chelsea"], "--tp 2 runs kvrewrite rows only"),
    (["--systems", "chelsea", "--isolate"], "--isolate"),
], ids=["hf-rows", "isolate"])
def test_bench_tp_refusals(capsys, argv, needle):
    """`kvrewrite bench --tp 2` refuses what it cannot run (no process group is started)."""
    from kvrewrite.cli import main

    assert main(["bench", "--model", "tiny-llama", "--device", "cpu", "--tp", "2", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_tp_all_reduce_choice_is_checked(capsys, monkeypatch):
    """apply's tp_all_reduce, outside a group: a value not in TP_ALL_REDUCES and a choice other than "auto" at tp=1
    are refused by name (by `kvrewrite bench --tp-all-reduce` too); "collective", and "auto" on the CPU, run the
    group's all-reduce; a buffer that cannot be set up is an error naming the way out, never a silent switch."""
    from kvrewrite.cli import main
    from kvrewrite.kernels import tp_all_reduce as op
    from kvrewrite.tensor_parallel import prepare_all_reduce

    assert main(["bench", "--model", "tiny-llama", "--device", "cpu", "--systems", "chelsea", "--tp-all-reduce",
                 "one_shot"]) == 2
    assert "--tp-all-reduce must be one of auto, one_shot, collective, and other than auto only with --tp > 1" \
        in capsys.readouterr().err

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"apply: tp_all_reduce must be one of \('auto', 'one_shot', 'collective'\), "
                                         r"got 'nccl'"):
        prepare_all_reduce("nccl", 2, "0", cpu, "apply")
    with pytest.raises(ValueError, match=r"tp_all_reduce='one_shot' needs tp > 1"):
        prepare_all_reduce("one_shot", 1, "", cpu, "apply")
    assert prepare_all_reduce("auto", 1, "", cpu, "apply") == "collective"
    assert prepare_all_reduce("collective", 2, "0", cpu, "apply") == "collective"
    assert prepare_all_reduce("auto", 2, "0", cpu, "apply") == "collective"

    def no_peer_access(group, device):
        raise RuntimeError("no peer access")

    monkeypatch.setattr(op, "one_shot_unavailable", lambda device, group: None)
    monkeypatch.setattr(op, "prepare", no_peer_access)
    with pytest.raises(RuntimeError, match=r"apply: tp_all_reduce='auto': the symmetric-memory buffer of the one-shot "
                                           r"all-reduce could not be set up on cpu \(RuntimeError: no peer access\); "
                                           r"pass tp_all_reduce='collective'"):
        prepare_all_reduce("auto", 2, "0", cpu, "apply")


@pytest.mark.parametrize("argv, needle", [
    (["--variants", "nccl,ring"], "--variants: unknown ['ring']"),
    (["--sizes", "8192,100"], "every size must be a positive multiple of 16 bytes"),
    ([], "runs on GPUs under torchrun"),
], ids=["variant", "size", "no-torchrun"])
def test_all_reduce_bench_refusals(argv, needle, monkeypatch):
    """python -m kvrewrite.bench.all_reduce refuses, by name, what it cannot measure (nothing starts)."""
    from kvrewrite.bench.all_reduce import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match=re.escape(needle)):
        main(argv)
