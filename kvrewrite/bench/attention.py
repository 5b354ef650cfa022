"""Decode attention on the GPU: kvrewrite::clustered_attention (Triton) vs torch SDPA vs copy bandwidth.

Llama-3.1-8B layout (Hq 32, Hkv 8, D 128, bf16), one query per sequence (T = 1), B = 1 and 8, C = 4k..128k
slots, every slot in use (bias 0, all visible): the dense data SDPA gets, so both compute the same function
(their outputs are compared) and SDPA's time is a floor for an attention that also reads the bias.

The op is called as a rewritten decode graph calls it: past_only=True (no slot after the query, window 0),
so the kernel does not read slot_pos. The same run also times past_only=False (positions read and
tested), what a prefill chunk's attention or an op without the promise pays (triton_all_pos_us).

Timing (triton.testing.do_bench, median): each variant runs N times inside one CUDA graph, over N input
sets rotated so that the data read per replay is >= 4x the L2 (a single small set would be timed from the
L2), and the replay time is divided by N. Launch overhead is thus left out, as in a CUDA-graphed decode
step; the eager op call (Python dispatch and launch included, one input set) is reported apart.

Bytes the op must move, each once: K + V (2 * B * Hkv * C * D * 2) + bias (4 * B * Hkv * C) + slot_pos
(8 * B * Hkv * C, only without past_only) + q and the output (2 * B * Hq * T * D * 2); GB/s = that / time.
Copy bandwidth: a 1 GiB device-to-device copy, counting bytes read plus written, the ceiling the target is
stated against.

SDPA: F.scaled_dot_product_attention(q, k, v, enable_gqa=True) (GQA without repeat_kv), under each backend
that accepts it (flash, efficient, cudnn) and under PyTorch's own choice; the fastest is the baseline.
It reads 0.8% fewer bytes than the op (no bias). SDPA given the bias as attn_mask ([B, Hq, 1, C], what
PyTorch needs to compute the op's function) is timed too (sdpa_bias_us; flash takes no mask).

Run:  python -m kvrewrite.bench.attention --out attention.json [--sweep sweep.json [--sweep-shapes B:C,...]
      [--sweep-heads HQ:HKV]]   (--sweep-heads 16:4: one rank's share of the 8B layout at tp=2)
Plot: python -m kvrewrite.bench.plot attention.json
"""
import argparse
import dataclasses
import json
import math
import os
import subprocess
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._library.triton import set_wrap_triton_enabled

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.cuda_graphs import capture, warm_up
from kvrewrite.kernels import clustered_attention as ca

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROTATE_BYTES = 256 << 20  # >= 4x the L2 of an H100 (50 MB) / H200 (60 MB)


@dataclass(frozen=True)
class Config:
    B: int
    C: int
    Hq: int = 32
    Hkv: int = 8
    D: int = 128
    T: int = 1
    dtype: str = "bf16"
    past_only: bool = True  # as decode graphs call the op: slot_pos is not read (window 0)

    @property
    def bytes_moved(self) -> int:
        return self.sdpa_bytes + self.B * self.Hkv * self.C * (4 + (0 if self.past_only else 8))  # + bias, positions

    @property
    def sdpa_bytes(self) -> int:
        """What SDPA must move: K, V, q and the output."""
        e = DTYPES[self.dtype].itemsize
        return 2 * self.B * self.Hkv * self.C * self.D * e + 2 * self.B * self.Hq * self.T * self.D * e


@dataclass(frozen=True)
class Result:
    bytes_moved: int
    copy_gbps: float
    sdpa_bytes: int = 0
    triton_us: float = math.nan  # CUDA-graph replay, per call (the config's past_only)
    triton_all_pos_us: float = math.nan  # the same with past_only=False (slot_pos read and tested), same run
    triton_eager_us: float = math.nan  # one eager op call, Python dispatch and launch included
    triton_gbps: float = math.nan
    frac_of_copy: float = math.nan  # triton_gbps / copy_gbps
    sdpa_us: float = math.nan  # the fastest SDPA backend, CUDA-graph replay, per call
    sdpa_backend: str = ""
    sdpa_us_by_backend: dict = dataclasses.field(default_factory=dict)
    sdpa_over_triton: float = math.nan  # > 1: the Triton op is faster
    max_abs_diff_vs_sdpa: float = math.nan
    # SDPA given the op's bias as attn_mask (the same function as the op; [B, Hq, 1, C] in q's dtype, one row
    # per query head as SDPA takes it): what computing biased attention with PyTorch costs; fastest backend
    sdpa_bias_us: float = math.nan
    sdpa_bias_backend: str = ""
    sdpa_bias_over_triton: float = math.nan
    launch: dict = dataclasses.field(default_factory=dict)  # block sizes, splits, warps, stages the op chose
    skipped: str = ""


def get_configs() -> list[Config]:
    return [Config(B=B, C=C) for B in (1, 8) for C in (4096, 8192, 16384, 32768, 65536, 131072)]


def git_sha() -> str:
    """$KVREWRITE_GIT_SHA (set where the tree is a copy without .git), else `git rev-parse HEAD`, else "unknown"."""
    sha = os.environ.get("KVREWRITE_GIT_SHA")
    if sha is None:
        try:
            git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
            sha = git.stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            sha = "unknown"
    return sha


def env_info() -> dict:
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, git_sha=git_sha(),
                sms=torch.cuda.get_device_properties(0).multi_processor_count)


def start_run() -> tuple:
    """(env_info(), copy_gbps()) of this run, after printing them as the run's first line."""
    env, copy = env_info(), copy_gbps()
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, git {env['git_sha'][:12]}; "
          f"copy {copy:.0f} GB/s (read + write)", flush=True)
    return env, copy


def _bench_ms(fn, quick=False) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median")


def copy_gbps() -> float:
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _make_sets(cfg: Config):
    """Input sets for the op and SDPA (q, k, v, bias, slot_pos, cache_position): all slots in use and visible."""
    dtype = DTYPES[cfg.dtype]
    n = max(1, min(16, math.ceil(ROTATE_BYTES / cfg.bytes_moved)))
    sets = []
    for _ in range(n):
        q = torch.randn(cfg.B, cfg.Hq, cfg.T, cfg.D, device="cuda", dtype=dtype)
        k = torch.randn(cfg.B, cfg.Hkv, cfg.C, cfg.D, device="cuda", dtype=dtype)
        v = torch.randn(cfg.B, cfg.Hkv, cfg.C, cfg.D, device="cuda", dtype=dtype)
        bias = torch.zeros(cfg.B, cfg.Hkv, cfg.C, device="cuda")
        pos = torch.arange(cfg.C, device="cuda").expand(cfg.B, cfg.Hkv, cfg.C).contiguous()
        cp = torch.arange(cfg.C - cfg.T, cfg.C, device="cuda")
        sets.append((q, k, v, bias, pos, cp))
    return sets


def _graph_us(fn, sets, quick=False, kernels: dict | None = None) -> float:
    """Per-call time of fn over the rotated input sets, captured in one CUDA graph. `kernels` (a dict): filled with
    each kernel's own device time per call (kernel_means), from a profile of one replay of the same calls captured
    without PDL: with it a kernel starts before the one before it ends and waits, so its span would hold that wait
    (stop 40's first sweep read 21.7 us for the attention kernel of a 15.3 us call)."""
    outs = []
    warm_up(lambda: [fn(*s) for s in sets])
    graph = capture(lambda: outs.extend(fn(*s) for s in sets))  # outs keeps the outputs alive while replaying
    ms = _bench_ms(graph.replay, quick)
    del graph
    if kernels is not None:
        from torch.profiler import ProfilerActivity, profile

        from kvrewrite.bench.profile_decode import kernel_events
        from kvrewrite.kernels import _pdl

        was = _pdl.enabled()
        _pdl.set_enabled(False)
        try:
            graph = capture(lambda: outs.extend(fn(*s) for s in sets))
        finally:
            _pdl.set_enabled(was)
        graph.replay()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            graph.replay()
            torch.cuda.synchronize()
        kernels.update(kernel_means(kernel_events(p), len(sets)))
        del graph
    del outs
    return ms * 1e3 / len(sets)


def kernel_means(events, calls: int) -> dict:
    """{kernel name: device us per call} from (start, end, name) events of `calls` calls: a kernel's own time, where
    the graph's per-call time also holds the gaps and overlaps between kernels."""
    out = {}
    for start, end, name in events:
        out[name] = out.get(name, 0.0) + (end - start) / calls
    return out


def direct(launch):
    """`launch` (an op's launcher) with its kernels launched themselves, not through wrap_triton's tracing wrapper,
    as the op's eager kernel launches them."""
    def call(*args):
        with set_wrap_triton_enabled(False):
            return launch(*args)

    return call


def _op(scale, past_only, **tuning):
    """The op, or with tuning overrides its launcher called directly (as the op's eager kernel does)."""
    if tuning:
        return direct(lambda q, k, v, bias, pos, cp: ca._launch(q, k, v, bias, pos, cp, scale, 0, past_only, **tuning))
    return lambda q, k, v, bias, pos, cp: torch.ops.kvrewrite.clustered_attention(q, k, v, bias, pos, cp, scale, 0,
                                                                                  past_only=past_only)


def _sdpa(backend, masked=False):
    """SDPA on (q, k, v, ...) sets, or with masked=True on (q, k, v, mask) sets (the mask as attn_mask)."""
    from torch.nn.attention import sdpa_kernel

    def call(q, k, v, *rest):
        mask = rest[0] if masked else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def fn(*args):
        if backend is None:
            return call(*args)
        with sdpa_kernel(backend):
            return call(*args)

    return fn


def _sdpa_by_backend(backends, sets, masked=False) -> tuple[dict, dict]:
    """SDPA under each (name, backend) on the sets: {name: CUDA-graph us, or why the backend refused the
    input (GQA, head dim, mask, GPU)} and {name: its output on sets[0]} for the backends that ran."""
    times, outs = {}, {}
    for name, backend in backends:
        fn = _sdpa(backend, masked)
        try:
            out = fn(*sets[0])
            times[name] = _graph_us(fn, sets)
            outs[name] = out
        except RuntimeError as e:
            times[name] = f"unsupported: {str(e).splitlines()[0][:80]}"
    return times, outs


def _sdpa_with_bias_us(sets, ours) -> dict:
    """SDPA with the sets' bias as an additive attn_mask, per backend that accepts it (flash does not).
    The masks are built before timing; every output must match the op's (the same function)."""
    from torch.nn.attention import SDPBackend

    G = sets[0][0].shape[1] // sets[0][1].shape[1]
    masked = [(q, k, v, bias.repeat_interleave(G, dim=1)[:, :, None, :].to(q.dtype)) for q, k, v, bias, *_ in sets]
    times, outs = _sdpa_by_backend([("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                    ("cudnn", SDPBackend.CUDNN_ATTENTION), ("default", None)], masked, masked=True)
    if not outs:
        raise RuntimeError("no SDPA backend accepted the bias as attn_mask")
    for name, out in outs.items():
        torch.testing.assert_close(out.float(), ours.float(), atol=2e-2, rtol=2e-2,
                                   msg=f"SDPA {name} with the bias as mask differs from the op")
    return {name: times[name] for name in outs}


def _fits(cfg: Config) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return 2.5 * cfg.bytes_moved < free  # the set, SDPA's workspace, the split partials, headroom


def run(cfg: Config, copy: float) -> Result:
    if not _fits(cfg):
        return Result(cfg.bytes_moved, copy, skipped="does not fit in GPU memory")
    from torch.nn.attention import SDPBackend

    sets = _make_sets(cfg)
    scale = cfg.D**-0.5
    op = _op(scale, cfg.past_only)
    ours = op(*sets[0])
    triton_us = _graph_us(op, sets)
    all_pos_us = triton_us if not cfg.past_only else _graph_us(_op(scale, False), sets)
    eager_us = _bench_ms(lambda: op(*sets[0])) * 1e3
    sdpa_us, outs = _sdpa_by_backend([("flash", SDPBackend.FLASH_ATTENTION),
                                      ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                      ("cudnn", SDPBackend.CUDNN_ATTENTION), ("default", None)], sets)
    ref = next(iter(outs.values()), None)  # the first backend that ran
    diff = math.nan if ref is None else (ours.float() - ref.float()).abs().max().item()
    timed = {k: v for k, v in sdpa_us.items() if isinstance(v, float)}
    best = min(timed, key=timed.get)
    bias_us = _sdpa_with_bias_us(sets, ours)
    gbps = cfg.bytes_moved / triton_us / 1e3
    G = cfg.Hq // cfg.Hkv
    launch = ca._launch_config(cfg.B, cfg.Hkv, G, cfg.T, cfg.C, cfg.D, ca._num_sms(torch.device("cuda")),
                               DTYPES[cfg.dtype].itemsize)
    del sets
    torch.cuda.empty_cache()
    return Result(cfg.bytes_moved, copy, sdpa_bytes=cfg.sdpa_bytes, triton_us=triton_us,
                  triton_all_pos_us=all_pos_us, triton_eager_us=eager_us, triton_gbps=gbps,
                  frac_of_copy=gbps / copy, sdpa_us=timed[best], sdpa_backend=best, sdpa_us_by_backend=sdpa_us,
                  sdpa_over_triton=timed[best] / triton_us, max_abs_diff_vs_sdpa=diff, launch=launch,
                  sdpa_bias_us=min(bias_us.values()), sdpa_bias_backend=min(bias_us, key=bias_us.get),
                  sdpa_bias_over_triton=min(bias_us.values()) / triton_us)


def sweep(configs, copy: float) -> list[dict]:
    """Launch variants of the Triton op (tile, warps, stages, splits, skip_unseen, past_only),
    CUDA-graph timed, each with its kernels' own device times (kernels_us: the attention kernel apart from its
    combine and from the gaps between them, which the per-call time holds).
    Stage 1 crosses tile / warps / stages on the first config; stage 2 varies the split count and the
    predicated loads around the best of stage 1 on every config (the op's split count, one less and one
    more, and multiples of it)."""
    records = []

    def time_variant(cfg, sets, past_only=None, **tuning):
        cfg = cfg if past_only is None else dataclasses.replace(cfg, past_only=past_only)  # its bytes too
        kernels = {}
        try:
            us = _graph_us(_op(cfg.D**-0.5, cfg.past_only, **tuning), sets, quick=True, kernels=kernels)
        except Exception as e:  # e.g. out of shared memory for a large tile with many stages
            us = math.nan
            tuning = dict(tuning, error=str(e).splitlines()[0][:80])
        tuning = dict(tuning, past_only=cfg.past_only)
        rec = dict(config=dataclasses.asdict(cfg), tuning=tuning, us=us, gbps=cfg.bytes_moved / us / 1e3,
                   frac_of_copy=cfg.bytes_moved / us / 1e3 / copy, kernels_us=kernels)
        records.append(rec)
        own = ", ".join(f"{name.replace('_clustered_attention_', '')} {t:.1f}" for name, t in kernels.items())
        print(f"sweep B{cfg.B} C{cfg.C} {tuning}: {us:.1f} us, {rec['frac_of_copy']:.2f} of copy"
              f"{f' (kernels: {own} us)' if own else ''}", flush=True)
        return us

    first = configs[0]
    sets = _make_sets(first)
    stage1 = {}
    for block_n in (64, 128):  # a first sweep over (32, 64, 128) x (2, 4, 8) x (2, 3, 4) left these
        for num_warps in (2, 4):
            for num_stages in (2, 3):
                t = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                stage1[tuple(t.items())] = time_variant(first, sets, **t)
    best = dict(min((k for k in stage1 if not math.isnan(stage1[k])), key=stage1.get))
    del sets
    sms = ca._num_sms(torch.device("cuda"))
    for cfg in configs:
        sets = _make_sets(cfg)
        G = cfg.Hq // cfg.Hkv
        default = ca._launch_config(cfg.B, cfg.Hkv, G, cfg.T, cfg.C, cfg.D, sms, DTYPES[cfg.dtype].itemsize,
                                    block_n=best["block_n"])["num_splits"]
        for splits in sorted({max(1, default // 4), max(1, default // 2), max(1, default - 1), default,
                              default + 1, 2 * default, 4 * default, 8 * default}):
            time_variant(cfg, sets, **best, num_splits=splits)
        time_variant(cfg, sets, **best, skip_unseen=False)
        time_variant(cfg, sets, **best, past_only=not cfg.past_only)  # what reading slot_pos costs
        time_variant(cfg, sets)  # the op's own choice
        del sets
        torch.cuda.empty_cache()
    return records


SWEEP_SHAPES = ((8, 32768), (1, 32768), (1, 4096), (8, 131072), (8, 4096), (2, 65536), (4, 16384), (16, 16384))


def _shapes(text: str) -> list[tuple[int, int]]:
    """--sweep-shapes: 'B:C,B:C' -> [(B, C), ...], each >= 1."""
    try:
        pairs = [tuple(int(v) for v in part.split(":")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B:C pairs of ints, e.g. 1:6554,8:32768; got {text!r}") from None
    if any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected B:C pairs of ints >= 1, e.g. 1:6554; got {text!r}")
    return pairs


def _heads(text: str) -> tuple[int, int]:
    """--sweep-heads: 'HQ:HKV' -> (HQ, HKV), HKV >= 1 dividing HQ."""
    try:
        hq, hkv = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HQ:HKV, two ints, e.g. 16:4; got {text!r}") from None
    if hkv < 1 or hq < hkv or hq % hkv:
        raise argparse.ArgumentTypeError(f"expected HQ:HKV with HKV >= 1 dividing HQ, e.g. 16:4; got {text!r}")
    return hq, hkv


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention.json", help="JSON list of {config, result, env}")
    parser.add_argument("--sweep", default=None, help="also time launch variants, written to this JSON file")
    parser.add_argument("--sweep-shapes", default=None, type=_shapes, metavar="B:C,...",
                        help="the sweep's (batch, slots) pairs, e.g. 1:6554 (default: eight from 1:4096 to 8:131072)")
    parser.add_argument("--sweep-heads", default=(32, 8), type=_heads, metavar="HQ:HKV",
                        help="the sweep's query and KV heads (default 32:8, Llama-3.1-8B; 16:4 is one rank's share at "
                             "tp=2)")
    parser.add_argument("--no-table", action="store_true", help="the sweep only (no per-size table)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="For dense input")  # SDPA's efficient backend refusing GQA
    env, copy = start_run()
    rows = []
    for cfg in [] if args.no_table else get_configs():
        res = run(cfg, copy)
        rows.append(dict(config=dataclasses.asdict(cfg), result=dataclasses.asdict(res), env=env))
        if res.skipped:
            print(f"B={cfg.B:<2} C={cfg.C:<7} skipped: {res.skipped}", flush=True)
            continue
        print(f"B={cfg.B:<2} C={cfg.C:<7} triton {res.triton_us:8.1f} us (past_only={cfg.past_only}; "
              f"past_only=False {res.triton_all_pos_us:8.1f}, eager {res.triton_eager_us:7.1f}) "
              f"{res.triton_gbps:6.0f} GB/s = {res.frac_of_copy:.2f} of copy | SDPA {res.sdpa_backend} "
              f"{res.sdpa_us:8.1f} us, SDPA/triton {res.sdpa_over_triton:.3f} | SDPA+bias {res.sdpa_bias_backend} "
              f"{res.sdpa_bias_us:8.1f} us, /triton {res.sdpa_bias_over_triton:.2f} | splits {res.launch['num_splits']} "
              f"| max diff {res.max_abs_diff_vs_sdpa:.2g}", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    if args.sweep:
        hq, hkv = args.sweep_heads
        sweep_configs = [Config(B=b, C=c, Hq=hq, Hkv=hkv) for b, c in args.sweep_shapes or SWEEP_SHAPES]
        records = sweep(sweep_configs, copy)
        with open(args.sweep, "w") as f:
            json.dump([dict(r, env=env, copy_gbps=copy) for r in records], f, indent=1)


if __name__ == "__main__":
    main()
