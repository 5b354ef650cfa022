"""Cost of a method's compression on the GPU against the dense model it serves, measured in one run.

--method chelsea (default) or any method whose compression op keeps min(valid, B) slots (kvmerger, h2o, snapkv):
the description below says Chelsea; for another method read its compression op, which gets its state fields
(those the op's schema names, e.g. KVMerger's score, degree and deficit) and its defaults at budget 0.2. Method
state not written by the appends (an accumulated `score`) is filled with uniform random values after each append,
outside the timed events, so the heavy-hitter selections see distinct scores as in a real run.

Model: a Llama-3.1-8B-shaped LlamaForCausalLM (32 layers, hidden 4096, Hq 32, Hkv 8, D 128, vocab 128256,
llama3 RoPE) with random bf16 weights, built directly on the GPU. Compression: ChelseaMethod(budget=0.2)
with its defaults (chunk 256, g = 32, r schedule), the runtime's default prefill chunk (256), and
max_length = prompt + max_new_tokens, so each layer holds the capacity `Method.capacity` gives it.

(a) Prefill. Baseline: one HF forward of the whole prompt (SDPA, use_cache=True, logits_to_keep=1),
CUDA-event timed, median of 3 after a warm-up. Compression: the exact sequence of kvrewrite::chelsea_compress
calls the runtime's prefill graph issues for that prompt: for every chunk of 256 tokens and every layer,
kvrewrite::cache_append of the chunk's keys and values (random bf16), then the compression op (it is in
the graph after every layer's attention; it returns at once on the device for rows below the threshold,
and compresses fill B + 256 -> B on the others, B = round(0.2 (n + max_new_tokens))). The host-side
schedule of the runtime (HostSchedule) mirrors the fills and is checked against the device's at the end.
Each layer's compression call is one CUDA graph (captured once, replayed at every chunk); CUDA events
around each replay time it, summed over all calls; a GPU sleep at the start of each chunk lets the host
queue the chunk's work ahead, so the events time GPU work, not launch gaps. The appends are not counted.
Ratio: total compression time / dense prefill time (target <= 5%).

(b) Decode. After that prefill, every layer gets g = 32 single-token appends (fill B -> B + g), the state
is snapshotted, and the decode-time call (B + g -> B, all layers) is timed the same way, restoring the
snapshot before each repetition (median of 10). Amortised cost per token = that / g. Baseline: one
decode step of the same HF model at the same context, StaticCache of prompt + 1 slots (SDPA reads the
whole cache: no mask, flash backend), eager kernels replayed as one CUDA graph (no Inductor fusion;
torch.compile would be somewhat faster, which would raise our ratio by the same factor). Ratio:
amortised compression per token / decode step (target <= 5%), for B = 1 and 8.

HF's decode step is a slow baseline at 32k (SDPA's flash kernel does not split the 32k keys over the SMs
at one query), so a second, conservative one is reported: the bytes a dense decode step must read (every
weight once, plus the dense K/V of the context) divided by the measured copy bandwidth (1 GiB device copy,
read + written bytes: a bound no real step beats). Likewise for the prefill the floor of a firing call is
reported: the bytes it must touch (read the row's keys for the similarities, read and write its keys and
values to compact the row) over the copy bandwidth.

Profile: torch.profiler over eager calls of the two call types, device time per kernel, to show which
kernel dominates.

cache_append: the Triton op against Inductor's compile of the reference scatter (torch.compile, default
mode) and against the reference scatter itself (eager ops, the op's CUDA path before), all replayed as CUDA graphs of one call per layer state (32 states, so the L2 does not hold
them), at T = 1 (decode) and T = 256 (a prefill chunk), B = 1 and 8; median per call.

(c) The prefill compression (B=1) again with larger prefill chunks (--other-chunks, default 1024, 2048,
4096), with a kernel profile of a firing call at each.

Run:  python -m kvrewrite.bench.compression --out compression.json [--plot compression.png] [--no-append]
      python -m kvrewrite.bench.compression --only-append --out cache_append.json
"""
import argparse
import json
import math
import statistics
import types

import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import env_info
from kvrewrite.bench.cuda_graphs import capture, warm_up
from kvrewrite.methods.chelsea import ChelseaMethod
from kvrewrite.runtime import HostSchedule
from kvrewrite.state import allocate_layer_state, reset_layer_state

LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                   rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=8192))
FIELDS = ("keys", "values", "bias", "slot_pos", "fill")  # the base state a compression call mutates
SLEEP_CYCLES = 8_000_000  # ~4 ms of GPU sleep per chunk: the host queues the chunk's 32 layers meanwhile


def build_model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**dict(LLAMA_31_8B, num_hidden_layers=layers))
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def _events_ms(fn, reps: int, warmup: int = 1) -> list:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


@torch.no_grad()
def dense_prefill_ms(model, n: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")
    times = _events_ms(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), reps=3)
    torch.cuda.empty_cache()
    return dict(ms=statistics.median(times), all_ms=times)


@torch.no_grad()
def dense_decode_ms(model, B: int, ctx: int) -> dict:
    """One HF decode step at cache position ctx over a StaticCache of ctx + 1 slots, as a CUDA graph."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ctx + 1)
    tok = torch.randint(0, model.config.vocab_size, (B, 1), device="cuda")
    pos = torch.full((B, 1), ctx, device="cuda")
    cp = torch.tensor([ctx], device="cuda")

    def step():
        return model(input_ids=tok, position_ids=pos, cache_position=cp, past_key_values=cache, use_cache=True,
                     logits_to_keep=1).logits

    warm_up(step, times=3)
    eager = statistics.median(_events_ms(step, reps=5))
    try:
        graph = capture(step)
        ms = statistics.median(_events_ms(graph.replay, reps=20, warmup=3))
        how = "HF eager kernels (SDPA, StaticCache) replayed as one CUDA graph"
        del graph
    except Exception as e:  # capture refused (a host sync inside HF's forward): time the eager step
        ms, how = eager, f"HF eager (CUDA graph capture failed: {str(e).splitlines()[0][:100]})"
    del cache
    torch.cuda.empty_cache()
    return dict(ms=ms, eager_ms=eager, how=how, context=ctx, batch=B)


class LayerStates:
    """The slot state of every layer, sized and budgeted as the runtime does for one generation."""

    def __init__(self, B, n_prompt, max_new_tokens, prefill_chunk, layers, Hq, Hkv, D, method=None):
        self.method = method if method is not None else ChelseaMethod(budget=0.2)
        self.infos = [types.SimpleNamespace(index=i, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, window=0)
                      for i in range(layers)]
        if hasattr(self.method, "bind"):
            self.method.bind(self.infos)
        max_length = n_prompt + max_new_tokens
        self.capacity = self.method.capacity(self.infos[0], max_length, prefill_chunk)
        self.target, self.threshold = self.method.targets(self.infos[0], n_prompt, max_new_tokens)
        self.method.check_generation(n_prompt, max_new_tokens)
        self.op, self.kwargs = self.method.compression_call(self.infos[0])
        self.extra = self.method.state_fields(self.infos[0])
        names = {a.name for a in self.op._schema.arguments}
        self.op_fields = tuple(k for k in self.extra if k in names)  # the method state the op takes, in order
        self.mutated = FIELDS + self.op_fields
        self.states = [allocate_layer_state(B, Hkv, self.capacity, D, torch.bfloat16, "cuda", extra=self.extra)
                       for _ in self.infos]
        for s in self.states:
            reset_layer_state(s, self.target, self.threshold, extra=self.extra)
        self.schedule = HostSchedule([(self.target, self.threshold)] * layers, B)
        self.B, self.Hkv, self.D, self.chunk = B, Hkv, D, prefill_chunk

    def call(self, s):
        self.op(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], s["budget"],
                *(s[f] for f in self.op_fields), **self.kwargs)

    def compress(self, i):
        self.call(self.states[i])

    def append(self, i, k, v, cp, valid):
        s = self.states[i]
        torch.ops.kvrewrite.cache_append(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k, v, cp, valid)
        if "score" in s:  # an accumulated attention score: distinct values, as the observation op would leave
            s["score"].uniform_()

    def graphs(self):
        """One CUDA graph per layer of its compression call (a shared memory pool); compiled first on a scratch
        state of the same shape, so capture launches nothing."""
        scratch = allocate_layer_state(self.B, self.Hkv, self.capacity, self.D, torch.bfloat16, "cuda",
                                       extra=self.extra)
        reset_layer_state(scratch, self.target, self.threshold, extra=self.extra)
        scratch["fill"].fill_(self.threshold)
        scratch["bias"].zero_()
        scratch["keys"].normal_()
        scratch["values"].normal_()
        warm_up(lambda: self.call(scratch))
        del scratch
        pool = torch.cuda.graph_pool_handle()
        return [capture(lambda i=i: self.compress(i), pool=pool) for i in range(len(self.states))]


def _token_pool(B, Hkv, T, D, n=4):
    return [(torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16),
             torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]


@torch.no_grad()
def prefill_compression(ls: LayerStates, n: int, graphs) -> dict:
    """The runtime's prefill sequence (append, then the compression op, per layer per chunk); each
    compression call timed by CUDA events around its graph replay."""
    B, L = ls.B, len(ls.states)
    chunks = math.ceil(n / ls.chunk)
    pool = _token_pool(B, ls.Hkv, ls.chunk, ls.D)
    valid = torch.ones(B, ls.chunk, dtype=torch.bool, device="cuda")
    cps = torch.arange(chunks * ls.chunk, device="cuda").view(chunks, ls.chunk)
    fill_log = torch.zeros(chunks, L, 2, dtype=torch.int64, device="cuda")
    events = []
    for c in range(chunks):
        torch.cuda._sleep(SLEEP_CYCLES)
        for i in range(L):
            k, v = pool[(c + i) % len(pool)]
            ls.append(i, k, v, cps[c], valid)
            fill_log[c, i, 0].copy_(ls.states[i]["fill"][0, 0])
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[i].replay()
            b.record()
            events.append((c, i, a, b))
            fill_log[c, i, 1].copy_(ls.states[i]["fill"][0, 0])
        ls.schedule.step([ls.chunk] * B, ls.chunk, compress=True)
    torch.cuda.synchronize()
    log = fill_log.cpu()
    fired, idle = [], []
    for c, i, a, b in events:
        ms = a.elapsed_time(b)
        (fired if log[c, i, 1] < log[c, i, 0] else idle).append(ms)
    fills = torch.stack([s["fill"] for s in ls.states])
    mirror = torch.tensor(ls.schedule.fill, device="cuda")  # [layers, B]
    assert (fills == mirror[:, :, None]).all(), "device fills differ from the runtime's host schedule"
    kinds = sorted({(int(x), int(y)) for x, y in log.view(-1, 2).tolist() if y < x})
    return dict(chunks=chunks, calls=len(events), calls_fired=len(fired), calls_idle=len(idle),
                total_ms=sum(fired) + sum(idle), fired_ms=sum(fired), idle_ms=sum(idle),
                per_fired_call_us=1e3 * statistics.median(fired) if fired else math.nan,
                per_idle_call_us=1e3 * statistics.median(idle) if idle else math.nan,
                fill_transitions=[f"{x}->{y}" for x, y in kinds][:8], final_fill=int(fills.max()))


@torch.no_grad()
def decode_compression(ls: LayerStates, graphs, g: int, reps: int = 10) -> dict:
    """Fill every layer B -> B + g with single-token appends, then time the decode-time call on all layers."""
    B, L = ls.B, len(ls.states)
    pool = _token_pool(B, ls.Hkv, 1, ls.D, n=g)
    valid = torch.ones(B, 1, dtype=torch.bool, device="cuda")
    start = int(ls.states[0]["fill"].max())
    for t in range(g):
        for i in range(L):
            ls.append(i, *pool[t], torch.tensor([10**6 + t], device="cuda"), valid)
    fill_before = int(torch.stack([s["fill"] for s in ls.states]).min())
    snap = [{f: s[f].clone() for f in ls.mutated} for s in ls.states]
    totals = []
    for _ in range(reps + 1):
        for s, sn in zip(ls.states, snap):
            for f, t in sn.items():
                s[f].copy_(t)
        torch.cuda._sleep(SLEEP_CYCLES)
        ev = []
        for i in range(L):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[i].replay()
            b.record()
            ev.append((a, b))
        torch.cuda.synchronize()
        totals.append(sum(a.elapsed_time(b) for a, b in ev))
    fill_after = int(torch.stack([s["fill"] for s in ls.states]).max())
    totals = totals[1:]  # the first repetition warms up
    all_layers = statistics.median(totals)
    return dict(fill_start=start, fill_before=fill_before, fill_after=fill_after, g=g, all_layers_ms=all_layers,
                per_layer_us=1e3 * all_layers / L, amortised_ms_per_token=all_layers / g, reps_ms=totals,
                _snapshot=snap)


@torch.no_grad()
def prefill_call_profile(ls: LayerStates) -> dict:
    """kernel_profile of a prefill-time firing call: layer 0 after the prefill (fill B) gets one more chunk
    (B + 256 -> B); the state is put back afterwards."""
    s0 = ls.states[0]
    before = {f: s0[f].clone() for f in ls.mutated}
    k = torch.randn(ls.B, ls.Hkv, ls.chunk, ls.D, device="cuda", dtype=torch.bfloat16)
    ls.append(0, k, k, torch.arange(ls.chunk, device="cuda") + 10**6, torch.ones(ls.B, ls.chunk, dtype=torch.bool,
                                                                                  device="cuda"))
    snap = {f: s0[f].clone() for f in ls.mutated}
    prof = kernel_profile(ls, snap)
    for f, t in before.items():
        s0[f].copy_(t)
    return prof


@torch.no_grad()
def kernel_profile(ls: LayerStates, snap0: dict, reps: int = 5) -> dict:
    """Device time per kernel of layer 0's compression call, eager, from the state snap0 each time."""
    from torch.profiler import ProfilerActivity, profile

    s0 = ls.states[0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for f, t in snap0.items():
                s0[f].copy_(t)
            ls.compress(0)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0 and "copy" not in e.key.lower() and "memcpy" not in e.key.lower():
            rows[e.key] = dict(us_per_call=us / reps, launches_per_call=e.count / reps)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["us_per_call"]))


def decode_floor_ms(model, B: int, ctx: int, copy_gbps: float) -> dict:
    """Bytes a dense decode step must read (weights + K/V of ctx tokens) / copy bandwidth."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 2 * c.num_hidden_layers * B * c.num_key_value_heads * ctx * (c.hidden_size // c.num_attention_heads) * 2
    return dict(ms=(weights + kv) / copy_gbps / 1e6, weight_bytes=weights, kv_bytes=kv, copy_gbps=copy_gbps)


def firing_call_floor_us(ls: LayerStates, L: int, copy_gbps: float) -> float:
    """A firing call reads the keys of its L slots (similarities) and reads and writes keys and values
    (compaction): 5 passes over L * D * 2 bytes per row, at the copy bandwidth."""
    row = L * ls.D * 2
    return 5 * row * ls.B * ls.Hkv / copy_gbps / 1e3


@torch.no_grad()
def append_bench(B: int, T: int, layers: int = 32, Hkv: int = 8, D: int = 128, C: int = 6943, code_out=None) -> dict:
    """cache_append: Triton op vs Inductor's compile of the reference scatter vs the eager scatter, CUDA-graph
    replays. code_out: write Inductor's code there."""
    from torch._inductor.utils import run_and_get_code

    from kvrewrite.kernels.cache_append import reference_cache_append

    states = [allocate_layer_state(B, Hkv, C, D, torch.bfloat16, "cuda") for _ in range(layers)]
    k = torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # as the models hand it
    cp = torch.arange(T, device="cuda")
    valid = torch.ones(B, T, dtype=torch.bool, device="cuda")
    inductor = torch.compile(reference_cache_append, fullgraph=True)
    variants = {"triton": torch.ops.kvrewrite.cache_append, "inductor_scatter": inductor,
                "eager_scatter": reference_cache_append}  # the op's CUDA path before the Triton kernel
    s0 = states[0]
    _, code = run_and_get_code(inductor, s0["keys"], s0["values"], s0["bias"], s0["slot_pos"], s0["fill"], k, k, cp,
                               valid)
    out = dict(inductor_kernels=sum(c.count("@triton.jit") for c in code))
    if code_out:
        with open(code_out, "w") as f:
            f.write("\n\n".join(code))
    for name, fn in variants.items():
        def all_layers():
            for s in states:
                fn(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k, k, cp, valid)

        warm_up(all_layers, times=3)
        graph = capture(all_layers)
        times = []
        per_reset = max(1, (C - 4 * T) // T)
        for r in range(60):
            if r % per_reset == 0:
                for s in states:
                    s["fill"].zero_()
            times.extend(_events_ms(graph.replay, reps=1, warmup=0))
        out[f"{name}_us"] = 1e3 * statistics.median(times[5:]) / layers
        del graph
    out["inductor_over_triton"] = out["inductor_scatter_us"] / out["triton_us"]
    out["eager_scatter_over_triton"] = out["eager_scatter_us"] / out["triton_us"]
    return dict(B=B, T=T, **out)


def plot(result: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colors = [], [], []
    pre = result["prefill"]
    labels += [f"prefill B=1\nchunk {result['config']['prefill_chunk']}",
               "prefill B=1\nbandwidth floor\nof the same calls"]
    values += [100 * pre["ratio"], 100 * pre["floor_ratio"]]
    colors += ["tab:blue", "tab:gray"]
    for ch, d in result.get("prefill_other_chunks", {}).items():
        labels.append(f"prefill B=1\nchunk {ch}")
        values.append(100 * d["ratio"])
        colors.append("tab:cyan")
    for B, d in result["decode"].items():
        if "ratio" in d:
            labels += [f"decode B={B}\nvs HF step", f"decode B={B}\nvs step floor"]
            values += [100 * d["ratio"], 100 * d["ratio_vs_floor"]]
            colors += ["tab:green", "tab:olive"]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.bar(labels, values, color=colors)
    ax.axhline(5, color="tab:red", ls="--", label="target 5%")
    for x, v in enumerate(values):
        ax.text(x, v, f"{v:.1f}%", ha="center", va="bottom")
    env = result["env"]
    ax.set_ylabel("compression time, % of the baseline")
    ax.tick_params(axis="x", labelsize=7)
    cfg = result["config"]
    ax.set_title(f"{cfg.get('method', 'chelsea')} compression cost, Llama-3.1-8B shape, {cfg['n_prompt']} tokens\n"
                 f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="compression.json")
    parser.add_argument("--plot", default=None, help="also draw the ratios to this PNG")
    parser.add_argument("--n", type=int, default=32768, help="prompt tokens")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="Γ of the budget B = 0.2 (n + Γ)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--method", default="chelsea", help="the method whose compression op is timed, at budget 0.2 "
                        "and its defaults (default: chelsea)")
    parser.add_argument("--batches", default="1,8", help="batch sizes of the decode comparison")
    parser.add_argument("--only-append", action="store_true", help="only the cache_append comparison")
    parser.add_argument("--no-append", action="store_true", help="skip the cache_append comparison")
    parser.add_argument("--other-chunks", default="1024,2048,4096",
                        help="also time the prefill compression (B=1) with these prefill chunks ('' for none)")
    args = parser.parse_args()
    env = env_info()
    import transformers

    env["transformers"] = transformers.__version__
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}", flush=True)
    if args.only_append:
        rows = [append_bench(B, T, code_out=f"{args.out}.inductor_B{B}_T{T}.py" if B == 1 else None)
                for B in (1, 8) for T in (1, 256)]
        for row in rows:
            print(row, flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, cache_append=rows), f, indent=1)
        return
    from kvrewrite.methods import make_method

    def make(name):
        return make_method(name, budget=0.2)

    make(args.method)  # a bad name fails before the model is built
    model = build_model(args.layers)
    Hq, Hkv, D = 32, 8, 128
    chunk = 256  # kvrewrite.apply's default prefill_chunk
    result = dict(env=env, config=dict(model="Llama-3.1-8B shape, random bf16", layers=args.layers, n_prompt=args.n,
                                       max_new_tokens=args.max_new_tokens, budget=0.2, prefill_chunk=chunk,
                                       method=args.method),
                  decode={}, prefill_other_chunks={})

    def save():  # after every stage: a run cut short still leaves what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    from kvrewrite.bench.attention import copy_gbps

    copy = copy_gbps()
    result["copy_gbps"] = copy
    dense = dense_prefill_ms(model, args.n)
    print(f"copy {copy:.0f} GB/s; dense prefill {args.n} tokens: {dense['ms']:.1f} ms", flush=True)
    for B in [int(b) for b in args.batches.split(",")]:
        ls = LayerStates(B, args.n, args.max_new_tokens, chunk, args.layers, Hq, Hkv, D, make(args.method))
        result["config"].update(capacity=ls.capacity, target=ls.target, threshold=ls.threshold,
                                options=dict(ls.kwargs))
        graphs = ls.graphs()
        pre = prefill_compression(ls, args.n, graphs)
        if B == 1:
            pre.update(dense_prefill_ms=dense["ms"], dense_all_ms=dense["all_ms"], ratio=pre["total_ms"] / dense["ms"])
            result["prefill"] = pre
        print(f"B={B} prefill compression: {pre['calls_fired']} firing calls ({pre['per_fired_call_us']:.0f} us each), "
              f"{pre['calls_idle']} idle ({pre['per_idle_call_us']:.1f} us), total {pre['total_ms']:.1f} ms"
              + (f" = {100 * pre['ratio']:.2f}% of the dense prefill" if B == 1 else ""), flush=True)
        pre["profile_fired_call_layer0"] = prefill_call_profile(ls)
        floor_us = firing_call_floor_us(ls, ls.target + chunk, copy)
        pre.update(floor_per_fired_call_us=floor_us, floor_total_ms=pre["calls_fired"] * floor_us / 1e3)
        if B == 1:
            pre["floor_ratio"] = pre["floor_total_ms"] / dense["ms"]
        dec = decode_compression(ls, graphs, g=ls.method.interval)
        snap = dec.pop("_snapshot")
        dec["prefill_compression"] = pre if B != 1 else "see prefill"
        dec["profile_decode_call_layer0"] = kernel_profile(ls, snap[0])
        del graphs, snap, ls
        torch.cuda.empty_cache()
        try:
            step = dense_decode_ms(model, B, args.n)
            floor = decode_floor_ms(model, B, args.n, copy)
            dec.update(decode_step=step, ratio=dec["amortised_ms_per_token"] / step["ms"], decode_floor=floor,
                       ratio_vs_floor=dec["amortised_ms_per_token"] / floor["ms"])
            print(f"B={B} decode: compression {dec['all_layers_ms']:.3f} ms per call ({dec['fill_before']} -> "
                  f"{dec['fill_after']}), {1e3 * dec['amortised_ms_per_token']:.1f} us per token; decode step "
                  f"{step['ms']:.2f} ms ({step['how']}) -> {100 * dec['ratio']:.2f}%; vs the bandwidth floor "
                  f"{floor['ms']:.2f} ms -> {100 * dec['ratio_vs_floor']:.2f}%", flush=True)
        except torch.cuda.OutOfMemoryError as e:
            dec["decode_step"] = f"out of memory: {str(e).splitlines()[0][:100]}"
            torch.cuda.empty_cache()
        result["decode"][str(B)] = dec
        save()
    for ch in [int(c) for c in args.other_chunks.split(",") if c]:
        ls = LayerStates(1, args.n, args.max_new_tokens, ch, args.layers, Hq, Hkv, D, make(args.method))
        pre = prefill_compression(ls, args.n, ls.graphs())
        pre.update(capacity=ls.capacity, ratio=pre["total_ms"] / dense["ms"])
        pre["profile_fired_call_layer0"] = prefill_call_profile(ls)
        result["prefill_other_chunks"][str(ch)] = pre
        print(f"prefill chunk {ch}: {pre['calls_fired']} firing calls ({pre['per_fired_call_us']:.0f} us each), total "
              f"{pre['total_ms']:.1f} ms = {100 * pre['ratio']:.2f}% of the dense prefill", flush=True)
        del ls
        torch.cuda.empty_cache()
        save()
    if args.no_append:
        save()
        if args.plot:
            plot(result, args.plot)
        return
    result["cache_append"] = []
    for B in (1, 8):
        for T in (1, chunk):
            row = append_bench(B, T)
            result["cache_append"].append(row)
            print(f"cache_append B={B} T={T}: triton {row['triton_us']:.2f} us, inductor scatter "
                  f"{row['inductor_scatter_us']:.2f} us, eager scatter {row['eager_scatter_us']:.2f} us per call",
                  flush=True)
    save()
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
