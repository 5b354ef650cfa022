"""`kvrewrite bench`: end-to-end decode and prefill speed and memory, kvrewrite vs HF transformers, one run.

Setup: a Llama-3.1-8B-shaped model with random bf16 weights built on the GPU (speed does not depend on the
weights; `--model tiny-llama` is a 2-layer model for CPU tests). Rows are systems x contexts x batch sizes:
  hf-eager, hf-compiled   HF forward per step over a transformers StaticCache (max_cache_len = n + new tokens),
                          SDPA, full cache; eager, or torch.compile(mode="reduce-overhead", fullgraph=True)
  <method>                every kvrewrite method named (full, streamingllm, chelsea, later ones by name),
                          at --budget for the compressing ones; "<method>:key=value:..." passes method options
                          (e.g. clusterkv:offload=cpu), the row keeps that name.
Every row holds one context n; "max" in --batches is the largest batch that fits at that context for that
system (computed from the measured free memory and the row's bytes per sequence; see `max_batch`).

Decisions (what exactly is timed):
- Decode: after warm-up, `--intervals` x g steps (g = the method's interval: 32, ClusterKV's 320) are timed with CUDA events around every step; the
  reported ms/token is the mean over whole intervals (so every periodic re-compression of the compressing
  methods is inside it), median over `--reps` repetitions; the median plain step and the mean compressing
  step are reported apart. Each step feeds back the argmax token of its own logits (greedy decoding).
- kvrewrite decode runs, by default (`--kv-compile graph`), its two rewritten decode graphs (with and without
  the compression ops) eagerly, each captured once in a torch.cuda.CUDAGraph after eager warm-up: no
  Inductor compile, so one export per batch size serves every method and context in seconds. The step
  choice comes from the runtime's host-side schedule (`rw.schedule.due`), as in `rw.decode_step`.
  `--kv-compile inductor` instead runs `rw.compile(fullgraph=True, mode="reduce-overhead")` (Inductor
  fusion + CUDA graphs, the kvrewrite ops kept whole; about a minute of compile per shape at the 8B shape on an
  H200, 46-68 s): the README's fastest path.
- State before decode: at batch 1 (at every batch with `--batch-prefill`), the real chunked prefill of n random
  tokens a row (timed, compression included) leaves the state. At batch > 1 the state is otherwise filled
  synthetically (speed does not depend on values): each layer holds exactly the slots the method has after a real
  prefill (min(n, B) with B = round(budget * (n + new)); n for full), random keys/values, bias 0, increasing slot
  positions; the host schedule mirrors it, so re-compression happens every g steps as in a real run. ClusterGen,
  whose sketch a real prefill builds fold by fold, gets the prompt's chunks of random keys replayed through its
  compression op instead (REPLAY_CHUNKS; before stop 62 its synthetic state had an empty sketch).
- HF rows: the StaticCache is filled with random keys/values (HF reads all max_cache_len slots every step
  whatever they hold; the mask hides the unwritten ones).
- Prefill (batch 1; every batch with `--batch-prefill`): kvrewrite's real chunked prefill of the batch
  (`--prefill-chunk`, compression inside; eager graphs, or under `--kv-compile inductor` the compiled step, as
  after a user's rw.compile; one warm-up prefill of 3 chunks before, which also compiles and records the CUDA
  graph: `prefill_warmup_s`) vs dense HF prefill of the same batch: one forward of B x n tokens, SDPA (causal,
  DynamicCache), logits of the last position only; one warm-up forward of 2048 tokens a row before. Wall clock
  with synchronisation, one run each. A dense prefill that does not fit is recorded in the row
  (`dense_prefill_error`), not run again for that batch and context.
- Memory: peak = torch.cuda.max_memory_allocated over the row (weights included); KV bytes = the cache as
  allocated (kvrewrite: every state tensor at its static capacity; HF: the StaticCache). The export of the
  model's graphs is setup: its time is reported (`capture_s`) and not counted; its scratch StaticCache
  (prefill_chunk tokens per row) is freed right after capture, since the rewrite removes it from the graphs.
- Roofline floor of a row: (weight bytes read per step + KV bytes read per step) / copy bandwidth, where the
  copy bandwidth is measured in the same run (1 GiB device-to-device copy, bytes read + written); weights
  read = every parameter but the input embedding (only B rows of it are read); KV read = keys + values of
  the slots in use (kvrewrite: the mean fill over the timed steps, plus 12 bytes of bias/position per used
  slot; full and HF: the n + step tokens in the cache; ClusterKV: what its step reads, clusterkv_read_bytes;
  EMS: entries and table, ems_read_bytes; its synthetic fill builds a table at its cap, ems_table; ClusterGen:
  the exact slots and the sketch, clustergen_read_bytes).
  ratio = measured ms / floor ms.
- `--isolate` runs every row in a fresh process (bench/e2e_isolated.py): no row inherits another's GPU memory, and
  "max" batches are found by trying (15% fewer after an out-of-memory error, up to 3 tries).
- `--tp N` (kvrewrite rows only; every rank a process of `torchrun --nproc-per-node N -m kvrewrite.cli bench ...`,
  one GPU each, cuda:LOCAL_RANK): the rows apply with tp=N (docs/tensor-parallel.md), every rank times its own steps
  and rank 0 logs and writes the JSON. Per rank: weights read = the replicated weights + 1/N of q/k/v/o and
  gate/up/down, KV read = its Hkv/N heads, so the floor is one rank's; the prompt and the first decode token are
  rank 0's (broadcast). Every rank builds only its share of the model (build_rank_model), so no dense prefill
  baseline is run (prefill_vs_dense is a tp=1 number). `--device cpu` with gloo is the dry run
  (tests/test_tensor_parallel.py). `--tp-all-reduce` is apply's tp_all_reduce (auto, one_shot, collective); each
  row records the one that ran (tp_all_reduce).
- Rows run in order and the JSON is rewritten after each one, so a run cut by a timeout keeps what it has;
  `--time-budget` skips the rows not started once that many seconds have passed. A row that fails (out of
  memory, say) is recorded with its error and the run goes on.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import torch

from kvrewrite.host import greedy_tokens
from kvrewrite.kernels._fallbacks import clear_reference_fallbacks, reference_fallbacks

HF_SYSTEMS = ("hf-eager", "hf-compiled")
MODELS = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    # Llama-3-70B: weights 141 GB in bf16, so it runs only split over ranks (--tp 2 on two H200s)
    "llama-3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny-llama": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False),
}
GRIDS = {  # --grid presets; explicit flags override them
    "full": dict(contexts=[16384, 32768, 65536], batches=["1", "16", "max"]),
    "quick": dict(contexts=[32768], batches=["1"]),
}


def warmup_steps(kv_compile: str, interval: int = 32) -> int:
    """Bound of the kvrewrite decode warm-up (KVDecoder.warm_up): two compressing steps (every g = interval steps),
    three under Inductor."""
    return (3 if kv_compile == "inductor" else 2) * interval + 2


def split_system(system: str) -> tuple[str, dict]:
    """'clusterkv:offload=cpu:iters=10' -> ('clusterkv', {'offload': 'cpu', 'iters': 10}): a method name and its
    options (values: int, else float, else the string)."""
    name, *opts = system.split(":")
    out = {}
    for o in opts:
        key, eq, text = o.partition("=")
        if not eq or not key:
            raise ValueError(f"bench: system {system!r}: method options are key=value, got {o!r}")
        for kind in (int, float, str):
            try:
                out[key] = kind(text)
                break
            except ValueError:
                continue
    return name, out


def make_system_method(system: str, budget):
    """The Method of a kvrewrite system name (options included), at `budget` unless it is full."""
    from kvrewrite.methods import make_method

    name, opts = split_system(system)
    return make_method(name, None if name == "full" else budget, **opts)


def method_interval(system: str, budget) -> int:
    """g of a system: the method's interval (its compression or clustering period); 32 for the HF rows."""
    if system in HF_SYSTEMS:
        return 32
    return make_system_method(system, budget).interval


def parse_budget(text: str):
    """--budget: an int (slots per KV head, e.g. 1024) or a fraction in (0, 1] of n + new tokens."""
    v = float(text)
    return int(v) if "." not in text and "e" not in text.lower() and v == int(v) else v


def _literal(text: str, value: str, examples: str):
    """The Python literal `value` of the option `text` (NAME=VALUE), or the argparse error naming it."""
    import ast

    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be a Python literal ({examples})") from None


def inductor_option(text: str) -> tuple:
    """--inductor-option NAME=VALUE: an Inductor config name and its value (a Python literal: True, 8, 'x')."""
    import torch._inductor.config as inductor_config

    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    if not _has_config(inductor_config, name):
        raise argparse.ArgumentTypeError(f"{name!r} is not an Inductor config (torch._inductor.config)")
    return name, _literal(text, value, "True, 8, 'name'")


def kernel_option(text: str) -> tuple:
    """--kernel-option MODULE.NAME=VALUE: a launch constant of a kernel module (kvrewrite/kernels/MODULE.py, an
    UPPER_CASE int, float or bool, e.g. gemv_rms_norm.BLOCK_N=2) and its value, for A/B rows."""
    name, sep, value = text.partition("=")
    name = name.strip()
    module, _, attr = name.rpartition(".")
    if not sep or not module or not attr:
        raise argparse.ArgumentTypeError(f"expected MODULE.NAME=VALUE, got {text!r}")
    try:
        mod = importlib.import_module(f"kvrewrite.kernels.{module}")
    except ImportError:
        raise argparse.ArgumentTypeError(f"{module!r} is not a module of kvrewrite/kernels") from None
    current = getattr(mod, attr, None)
    if not attr.isupper() or not isinstance(current, (int, float)):
        raise argparse.ArgumentTypeError(f"{name!r} is not a launch constant (an UPPER_CASE int, float or bool "
                                         f"of kvrewrite/kernels/{module}.py)")
    parsed = _literal(text, value, "True, 8, 0.5")
    if type(parsed) is not type(current):
        raise argparse.ArgumentTypeError(f"{name} holds a {type(current).__name__} ({current!r}); got {parsed!r}")
    return name, parsed


def apply_kernel_options(options: dict) -> None:
    """Set each kernel module's launch constant (kernel_option); kernels read them when a graph is traced. With any
    option set, torch.compile's caches are off for this process: their keys hold the traced graph, which names the
    op, not the constants its kernel was traced with, so a cached step compiled under other constants would be
    reused (seen: an A/B pair on a warm cache timed the same) and this row's step would be stored for others."""
    if options:
        import torch.compiler.config

        torch.compiler.config.force_disable_caches = True
    for name, value in options.items():
        module, _, attr = name.rpartition(".")
        setattr(importlib.import_module(f"kvrewrite.kernels.{module}"), attr, value)


def _has_config(cfg, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(cfg, part):
            return False
        cfg = getattr(cfg, part)
    return True


@dataclasses.dataclass
class BenchConfig:
    model: str = "llama-3.1-8b"
    systems: tuple = ("hf-eager", "hf-compiled", "full", "streamingllm", "chelsea")
    contexts: tuple = (16384, 32768, 65536)
    batches: tuple = ("1", "16")  # ints, or "max"
    budget: float | int = 0.2  # fraction in (0, 1], or an int: slots per KV head
    new_tokens: int | None = None  # None: the fewest that cover every system's warm-up and timed steps (>= 320)
    prefill_chunk: int = 1024
    intervals: int = 2
    reps: int = 3
    kv_compile: str = "graph"
    hf_compiled_contexts: tuple | None = None  # contexts where hf-compiled runs (compiles per shape); None: all
    max_batch_cap: int = 128
    time_budget: float = math.inf
    prefill: bool = True
    batch_prefill: bool = False  # batch > 1 too: the real prefill of the batch, timed against HF's dense one
    fuse_projections: bool = False  # kvrewrite rows: kvrewrite.apply(..., fuse_projections=True)
    gemv: bool = False  # kvrewrite rows: kvrewrite.apply(..., gemv=True)
    inductor_options: dict = dataclasses.field(default_factory=dict)  # kvrewrite rows under "inductor": rw.compile(options=)
    kernel_options: dict = dataclasses.field(default_factory=dict)  # "module.NAME": value (kernel_option), set at start
    out: str = "e2e.json"
    device: str = "cuda"
    tp: int = 1  # tensor-parallel ranks of the kvrewrite rows (launched under torchrun; module docstring)
    tp_all_reduce: str = "auto"  # tp > 1: kvrewrite.apply(..., tp_all_reduce=)

    def validate(self) -> None:
        from kvrewrite.methods import METHODS

        if self.model not in MODELS:
            raise ValueError(f"bench: unknown model {self.model!r}; known: {', '.join(MODELS)}")
        bad = [s for s in self.systems if s not in HF_SYSTEMS and split_system(s)[0] not in METHODS]
        if bad:
            raise ValueError(f"bench: unknown system(s) {bad}; known: {', '.join(HF_SYSTEMS + tuple(sorted(METHODS)))}")
        if not self.systems:
            raise ValueError("bench: no system to run")
        for n in self.contexts:
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"bench: contexts must be ints >= 1, got {n!r}")
        for b in self.batches:
            if b != "max" and not (str(b).isdigit() and int(b) >= 1):
                raise ValueError(f"bench: batches must be ints >= 1 or 'max', got {b!r}")
        if isinstance(self.budget, bool) or not (isinstance(self.budget, int) and self.budget >= 1
                                                 or isinstance(self.budget, float) and 0 < self.budget <= 1):
            raise ValueError(f"bench: budget must be a fraction in (0, 1] or an int >= 1 (slots), got {self.budget!r}")
        if self.kv_compile not in ("graph", "inductor", "eager"):
            raise ValueError(f"bench: kv_compile must be graph, inductor or eager, got {self.kv_compile!r}")
        if self.inductor_options and self.kv_compile != "inductor":
            raise ValueError(f"bench: --inductor-option {self.inductor_options} needs --kv-compile inductor")
        if self.intervals < 1 or self.reps < 1:
            raise ValueError("bench: intervals and reps must be >= 1")
        needs = {s: warmup_steps(self.kv_compile, method_interval(s, self.budget))
                 + self.intervals * method_interval(s, self.budget) * self.reps for s in self.systems}
        if self.new_tokens is None:
            self.new_tokens = max(320, *needs.values())
        for s, need in needs.items():
            g = method_interval(s, self.budget)
            if self.new_tokens < need:
                raise ValueError(f"bench: new_tokens={self.new_tokens} is too few for {s}'s warm-up + {self.reps} reps "
                                 f"x {self.intervals} intervals of {g} steps; give at least {need}")
        if self.batch_prefill and not self.prefill:
            raise ValueError("bench: --batch-prefill times the prefill of a batch; it cannot go with --no-prefill")
        if self.prefill_chunk < 2:
            raise ValueError(f"bench: prefill_chunk must be >= 2, got {self.prefill_chunk}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"bench: tp must be an int >= 1, got {self.tp!r}")
        from kvrewrite.tensor_parallel import TP_ALL_REDUCES

        if self.tp_all_reduce not in TP_ALL_REDUCES or (self.tp == 1 and self.tp_all_reduce != "auto"):
            raise ValueError(f"bench: --tp-all-reduce must be one of {', '.join(TP_ALL_REDUCES)}, and other than "
                             f"auto only with --tp > 1; got {self.tp_all_reduce!r} with --tp {self.tp}")
        hf = [s for s in self.systems if s in HF_SYSTEMS]
        if self.tp > 1 and hf:
            raise ValueError(f"bench: --tp {self.tp} runs kvrewrite rows only; {hf} run HF's model on one device: "
                             f"take them from a tp=1 run")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("bench: CUDA is not available (use --device cpu with --model tiny-llama for a dry run)")


# -- environment, model, bandwidth ----------------------------------------------------------------------------

def env_info(device: str) -> dict:
    import transformers

    from kvrewrite.bench.attention import git_sha

    info = dict(torch=torch.__version__, transformers=transformers.__version__, git_sha=git_sha(), device=device)
    if device == "cuda":
        import triton

        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__, sms=props.multi_processor_count,
                    gpu_mem_gib=props.total_memory / 2**30)
    else:
        info.update(gpu="cpu (no GPU)")
    return info


def model_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def build_model(name: str, device: str, dtype: torch.dtype | None = None):
    """Random-weight Llama of the named shape, bf16 on CUDA (fp32 on CPU) unless `dtype`, SDPA attention, eval mode
    ("meta": the shapes only, for planning)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = dtype or model_dtype(device)
    cfg = LlamaConfig(**MODELS[name])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.generation_config.eos_token_id = None
    return model.eval().requires_grad_(False)


@torch.no_grad()
def build_rank_model(name: str, tp: int, rank: int, device: str, dtype: torch.dtype | None = None):
    """The rank's share of the named random-weight model, built without the whole model ever existing on the device:
    the model on the meta device, sharded (tensor_parallel.rank_model), materialised on `device`, its weights drawn
    (normal(0, 0.02), norms 1: HF's Llama init) from a generator seeded by the parameter's name, so every rank holds
    the same replicated weights, and its rotary buffers rebuilt."""
    import zlib

    from kvrewrite.tensor_parallel import rank_model

    dtype = dtype or model_dtype(device)
    shard = rank_model(build_model(name, "meta", dtype), tp, rank, f"bench {name}")
    shard.to_empty(device=device)
    gen = torch.Generator(device=device)
    for pname, p in shard.named_parameters():
        if pname.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            gen.manual_seed(zlib.crc32(pname.encode()))
            p.normal_(0.0, 0.02, generator=gen)
    for mname, mod in list(shard.named_modules()):
        if hasattr(mod, "inv_freq"):  # non-persistent buffers computed at init: what to_empty left is garbage
            with torch.device(device):
                shard.set_submodule(mname, type(mod)(config=mod.config))
    return shard


def split_weight_bytes(model, tp: int) -> int:
    """Bytes of the weights tensor parallelism over tp ranks splits: q/k/v/o and gate/up/down of every decoder layer,
    and the lm_head where tensor_parallel splits it (splits_lm_head) and it is not the input embedding
    (weight_bytes_read leaves a tied one out)."""
    from kvrewrite.tensor_parallel import splits_lm_head

    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    split = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.split(".")[-2] in names)
    lm, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if splits_lm_head(lm, tp) and lm.weight is not emb.weight:
        split += sum(p.numel() * p.element_size() for p in lm.parameters())
    return split


def start_ranks(cfg: BenchConfig) -> int:
    """tp > 1: the rank's GPU (cuda:LOCAL_RANK) made current and the process group started; returns the rank."""
    import os

    from kvrewrite.tensor_parallel import init_distributed

    device = torch.device("cpu")
    if cfg.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return init_distributed(cfg.tp, device)[0]


def same_on_ranks(t: torch.Tensor, tp: int) -> torch.Tensor:
    """`t` as rank 0 drew it, on every rank (tp > 1): the ranks must feed the same tokens."""
    if tp > 1:
        import torch.distributed as dist

        dist.broadcast(t, 0)
    return t


def weight_bytes_read(model) -> int:
    """Bytes of the parameters a decode step reads: all but the input embedding (B rows of it only)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)


def copy_gbps_rounds(device: str, rounds: int = 3) -> list:
    """Device-to-device copy bandwidth, (bytes read + bytes written) / time: in each of `rounds` rounds the median of
    20 copies between two fresh buffers (other pages each round), after at least 0.3 s of copies (clocks up)."""
    n = (1 << 29) if device == "cuda" else (1 << 24)  # 1 GiB bf16 on the GPU, 32 MiB on the CPU
    out = []
    for r in range(rounds):
        src = torch.randn(n, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t0 = time.perf_counter()
        while r == 0 and time.perf_counter() - t0 < 0.3:
            dst.copy_(src)
            if device == "cuda":
                torch.cuda.synchronize()
        times = []
        for i in range(25):
            t = Timer(device)
            dst.copy_(src)
            if i >= 5:
                times.append(t.stop())
        out.append(2 * n * 2 / statistics.median(times) / 1e6)
        del src, dst
    return out


def copy_gbps(device: str) -> float:
    """The floor's bandwidth: the best round of copy_gbps_rounds. One process's median has moved by up to 5% between
    processes of one device call on an H200 (4005-4202 GB/s, docs/bench.md "Stop 38 runs"); a low one flatters every
    ratio to the floor, so the floor takes the best of three rounds."""
    return max(copy_gbps_rounds(device))


class Timer:
    """ms between construction and stop(): CUDA events on the GPU (no sync until stop), perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b)
        return (time.perf_counter() - self.t0) * 1e3


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# -- decode loops ---------------------------------------------------------------------------------------------

def _time_steps(device, steps: int, run_step) -> list:
    """Per-step ms of `steps` calls of run_step(i) -> bool (compressing step?), events between steps."""
    if device == "cuda":
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        evs[0].record()
        kinds = []
        for i in range(steps):
            kinds.append(run_step(i))
            evs[i + 1].record()
        evs[-1].synchronize()
        return [(evs[i].elapsed_time(evs[i + 1]), kinds[i]) for i in range(steps)]
    out = []
    for i in range(steps):
        t0 = time.perf_counter()
        k = run_step(i)
        out.append(((time.perf_counter() - t0) * 1e3, k))
    return out


def _summarise(per_rep: list, interval: int) -> dict:
    """per_rep: [[(ms, compressing), ...], ...] -> ms/token (mean over whole intervals, median over reps)."""
    means = [sum(ms for ms, _ in rep) / len(rep) for rep in per_rep]
    plain = [ms for rep in per_rep for ms, c in rep if not c]
    comp = [ms for rep in per_rep for ms, c in rep if c]
    return dict(ms_per_step=statistics.median(means), ms_per_step_reps=means,
                ms_plain_step_median=statistics.median(plain) if plain else math.nan,
                ms_compress_step_mean=statistics.mean(comp) if comp else math.nan,
                compress_steps_per_rep=sum(c for _, c in per_rep[0]), steps_per_rep=len(per_rep[0]))


def compile_rw(rw, options: dict | None = None) -> None:
    """rw.compile(fullgraph=True, mode="reduce-overhead"), or with Inductor `options` (config names, e.g.
    combo_kernels) the same CUDA graphs spelled as an option: torch.compile takes a mode or options, not both."""
    if options:
        rw.compile(fullgraph=True, options={"triton.cudagraphs": True, **options})
    else:
        rw.compile(fullgraph=True, mode="reduce-overhead")


class KVDecoder:
    """Greedy decode steps of a KVRewrittenModel from its current state, with static input buffers.

    mode "graph": both decode variants are captured in CUDA graphs (one memory pool) after eager warm-up;
    "inductor": rw.compile(fullgraph=True, mode="reduce-overhead"); "eager": the FX graphs as they are.
    """

    def __init__(self, rw, mode: str):
        self.rw, self.mode = rw, mode
        dev = rw.l0_fill.device
        B = rw.batch_size
        self.device = dev.type
        self.tok = same_on_ranks(torch.randint(1, rw.vocab_size, (B, 1), device=dev), rw.tp)
        self.pos = rw._next_position.reshape(B, 1).clone()
        self.cpos = rw._next_cache_position.reshape(1).clone()
        self.valid = torch.ones(B, 1, dtype=torch.bool, device=dev)
        self.graphs = {}
        self.compresses = any(thr < 2**62 for _, thr in rw.schedule.budgets)
        if mode == "inductor" and rw._compiled_call_impl is None:  # kv_row compiles before a timed prefill
            compile_rw(rw)

    def _body(self, compress: bool) -> None:
        if self.mode == "inductor":
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.rw(self.tok, self.pos, self.cpos, self.valid, compress)
        self.tok.copy_(greedy_tokens(logits[:, -1]).unsqueeze(-1))
        self.pos.add_(1)
        self.cpos.add_(1)

    def step(self, _i=None) -> bool:
        compress = self.rw.schedule.due(1)
        g = self.graphs.get(compress)
        if g is not None:
            g.replay()
        else:
            self._body(compress)
        self.rw.schedule.step([1] * self.rw.batch_size, 1, compress)
        return compress

    def warm_up(self, max_steps: int) -> int:
        """Eager steps until every variant (the compressing one only if the method compresses) ran: once, then
        they are captured ("graph"); three times under Inductor, whose CUDA-graph trees run a graph eagerly once,
        record it on the next call and replay it from the third (else the recording, ~10x a step, lands in the
        timed steps)."""
        runs = {False: 0, True: 0}
        need = 3 if self.mode == "inductor" else 1
        variants = (False, True) if self.compresses else (False,)
        steps = 0
        while steps < max_steps and (any(runs[v] < need for v in variants) or steps < 3):
            runs[self.step()] += 1
            steps += 1
        if any(runs[v] < need for v in variants):
            raise RuntimeError(f"decode warm-up: {runs[True]} compressing and {runs[False]} plain steps within "
                               f"{max_steps} steps; need {need} of each")
        seen = {v for v in runs if runs[v]}
        if self.mode == "graph" and self.device == "cuda":
            torch.cuda.synchronize()
            pool = None
            for compress in sorted(seen):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._body(compress)
                pool = g.pool()
                self.graphs[compress] = g
            torch.cuda.synchronize()
        return steps

    def mean_fill(self) -> float:
        return statistics.mean(f for fills in self.rw.schedule.fill for f in fills) if self.rw.schedule.fill else 0.0


# Methods whose state after a prompt is built by every chunk's compression, not by its slot count alone: ClusterGen's
# sketch (the clusters, δ, the samples) comes from one fold per prefill chunk. A fill of the kept slots alone would
# leave its sketch empty and δ uncalibrated, so that the first decode fold calibrates on g keys and the later ones open
# clusters: decode work a real prompt's state does not have. Their synthetic fill replays the chunks instead.
REPLAY_CHUNKS = ("clustergen",)


def synthetic_fill(rw, n: int, new_tokens: int) -> None:
    """State as a real prefill of n tokens leaves it (see the module docstring), without running one: every layer
    holds the slots the host schedule says a prefill leaves (its compression rule applied once to n tokens), with
    random keys and values, then the prefill graph's compression ops run on it (they act where due: ClusterKV
    clusters the prompt; the others' rows are already at their target). A method of REPLAY_CHUNKS instead gets the
    prompt's chunks one by one, each followed by the compression ops (replay_chunks)."""
    from kvrewrite.eval.prefill import compression_nodes

    B = rw.batch_size
    rw.reset(n, new_tokens, prompt_slots=n)
    g = torch.Generator(device=rw.l0_fill.device).manual_seed(1)
    if rw.method.name in REPLAY_CHUNKS:
        replay_chunks(rw, n, g)
    else:
        rw.schedule.step([n] * B, n, compress=True)
        for info, fills in zip(rw.layers, rw.schedule.fill):
            f = fills[0]
            st = rw.layer_state(info.index)
            pos = torch.linspace(0, n - 1, f, device=st["slot_pos"].device).round().long() if f < n else \
                torch.arange(n, device=st["slot_pos"].device)
            fill_random(st, 0, f, pos, g)
        if rw.method.name == "ems":
            for info in rw.layers:
                if not info.window:
                    ems_table(rw.layer_state(info.index), rw.method, n)
        run_compression(rw, compression_nodes(rw.prefill_graph))
    rw._next_position = torch.full((B,), n, dtype=torch.long, device=rw.l0_fill.device)
    rw._next_cache_position = torch.tensor([n], device=rw.l0_fill.device)


def replay_chunks(rw, n: int, g) -> None:
    """The prompt's n tokens in the runtime's prefill chunks (n a multiple of the chunk, as the runtime pads it), each
    appended to every layer with random keys and values at positions in order, then the prefill graph's compression
    ops (due as in a real prefill) and the host schedule's step: the state the real prefill's compression builds, but
    for the values. Sliding-window layers are refused (their eviction runs in the attention's path, not here)."""
    from kvrewrite.eval.prefill import compression_nodes

    T = rw.prefill_chunk
    windowed = [info.index for info in rw.layers if info.window]
    if windowed or n % T:
        raise ValueError(f"synthetic_fill: {rw.method.name}'s state is replayed chunk by chunk, which needs no "
                         f"sliding-window layers (layers {windowed} have one) and a context that is a multiple of the "
                         f"prefill chunk ({n} tokens, chunks of {T}); time a real prefill instead (drop --no-prefill)")
    B = rw.batch_size
    nodes = compression_nodes(rw.prefill_graph)
    for c0 in range(0, n, T):
        for info, fills in zip(rw.layers, rw.schedule.fill):
            st = rw.layer_state(info.index)
            fill_random(st, fills[0], fills[0] + T, torch.arange(c0, c0 + T, device=st["slot_pos"].device), g)
        run_compression(rw, nodes)
        rw.schedule.step([T] * B, T, compress=True)


def fill_random(st: dict, lo: int, hi: int, pos, g) -> None:
    """Slots [lo, hi) of a layer's state as appended tokens: random keys then values (g), bias 0, positions pos;
    fill = hi."""
    st["keys"][:, :, lo:hi].normal_(generator=g)
    st["values"][:, :, lo:hi].normal_(generator=g)
    st["bias"][:, :, lo:hi] = 0.0
    st["slot_pos"][:, :, lo:hi] = pos
    st["fill"].fill_(hi)


def run_compression(rw, nodes) -> None:
    """Call the prefill graph's compression ops (`nodes`) on the layers' state, each where due on the device."""
    for node in nodes:
        st = rw.layer_state(node.meta["kvrewrite"]["layer"])
        node.target(*(st[a.name.split("_", 1)[1]] for a in node.args), **node.kwargs)


def ems_table(st: dict, m, n: int) -> None:
    """EMS's token table for a synthetic fill: the f entries (window + centres) stand for min(gamma * f, n, R) tokens,
    as a compressed 32k prompt's table at its cap (the attention's worst case; the floor counts the same slots): the
    window entries one slot each, the centres the rest in even shares; token positions spread over [0, n) in slot
    order, so slot_order is the identity and an entry's slot_pos is its last member's position. A valid table
    (tests/methods/test_ems.py's check_table), key scales 1, scores 0."""
    f = int(st["fill"].reshape(-1)[0])
    R = st["lut"].shape[-1]
    S = min(R, n, math.floor(m.gamma * f) if math.isfinite(m.gamma) else R)
    w = min(m.window, f)
    dev = st["lut"].device
    count = torch.ones(f, dtype=torch.long, device=dev)
    centres = f - w
    if centres and S > f:
        extra = S - f
        count[:centres] += extra // centres
        count[: extra % centres] += 1
    S = int(count.sum())
    start = torch.cumsum(count, 0) - count
    lut = torch.repeat_interleave(torch.arange(f, device=dev), count)
    token_pos = torch.linspace(0, n - 1, S, device=dev).round().long()
    st["entry_start"][..., :f] = start.to(torch.int32)
    st["lut"][..., :S] = lut.to(torch.int32)
    st["key_scale"][..., :S] = 1.0
    st["token_pos"][..., :S] = token_pos.to(torch.int32)
    st["slot_order"][..., :S] = torch.arange(S, device=dev, dtype=torch.int32)
    st["slot_pos"][..., :f] = token_pos[start + count - 1]
    st["slot_fill"].fill_(S)
    if st["raw_keys"].shape[2]:
        st["raw_keys"][..., :f, :].normal_()


def ems_read_bytes(rw, B: int) -> float:
    """Bytes an EMS decode step must read, all layers, from the state after the timed steps: per KV head of a
    compressed layer its entries (K, V, 4-byte bias, 4-byte entry_start) and its live slots (lut and key_scale, 8
    bytes each: contract docs/contracts/ems.md §8); sliding-window layers as every method (K, V and 12 bytes)."""
    total = 0.0
    for info in rw.layers:
        st = rw.layer_state(info.index)
        fill = float(st["fill"].float().mean())
        if info.window:
            total += B * info.num_kv_heads * min(fill, info.window) * (2 * info.head_dim * st["keys"].element_size()
                                                                        + 12)
            continue
        slots = float(st["slot_fill"].float().mean())
        total += B * info.num_kv_heads * (fill * (2 * info.head_dim * st["keys"].element_size() + 8) + 8 * slots)
    return total


def clustergen_read_bytes(rw, B: int) -> float:
    """Bytes a ClusterGen decode step must read, all layers, from the state after the timed steps
    (kvrewrite/kernels/sketch_attention.py: decode reads keys, bias and role of every used slot and the values of
    the slots that enter the numerator): per KV head of a compressed layer its exact slots (fill: K, V, 4-byte
    bias, 1-byte role) and its sketch of S slots (K, bias and role for all; V for the s value samples only;
    S and s from budget[0], the fold's own formula); sliding-window layers as every method (K, V and 12 bytes)."""
    from kvrewrite.methods.clustergen import sketch_sizes

    m = rw.method
    total = 0.0
    for info in rw.layers:
        st = rw.layer_state(info.index)
        row = info.head_dim * st["keys"].element_size()  # one K or one V vector
        fill = float(st["fill"].float().mean())
        if info.window:
            total += B * info.num_kv_heads * min(fill, info.window) * (2 * row + 12)
            continue
        S, s, _ = sketch_sizes(int(st["budget"][0]), m.n_sink, m.window, m.t, m.value_share)
        total += B * info.num_kv_heads * (fill * (2 * row + 5) + S * (row + 5) + s * row)
    return total


def clusterkv_read_bytes(rw, B: int) -> float:
    """Bytes a ClusterKV decode step must read, all layers (its roofline floor's KV part), from the state after the
    timed steps: a dense layer's used slots as for the other methods (K, V, 4-byte bias; slot_pos is not read by a
    decode step); a clustered layer per KV head: the centroids in use (D values each) with their size and start,
    and per selection list (one per KV head, or per query head with select_per="query_head": each is a separate
    gather, counted G times) the selected tokens (min(B - sinks, clustered), the sinks, and the window at its mean
    over a clustering period, (m + 1) / 2) as K, V, bias and a 4-byte member id, plus the index written and read
    (4 + 4 bytes per entry)."""
    m = rw.method
    total = 0.0
    for info in rw.layers:
        st = rw.layer_state(info.index)
        kv = 2 * info.head_dim * st["keys"].element_size() + 4
        fill = float(st["fill"].float().mean())
        if info.window or not m.compressed(info):
            total += B * info.num_kv_heads * min(fill, info.window or fill) * kv
            continue
        target = int(st["budget"][0])
        clustered = float(st["cluster_size"].sum(-1).float().mean())
        n_clusters = float(st["n_clusters"].float().mean())
        lists = info.num_heads if m.select_per == "query_head" else info.num_kv_heads
        tokens = min(target - m.n_sink, clustered) + m.n_sink + (m.interval + 1) / 2
        S = target + m.interval
        total += B * info.num_kv_heads * n_clusters * (info.head_dim * st["centroids"].element_size() + 8)
        total += B * lists * (tokens * (kv + 4) + 8 * S)
    return total


def hf_cache(model, B: int, length: int):
    from transformers import StaticCache

    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=length)
    cache.early_initialization(B, cfg.num_key_value_heads, cfg.head_dim, model.dtype, model.device)
    g = torch.Generator(device=model.device).manual_seed(2)
    for layer in cache.layers:
        layer.keys.normal_(generator=g)
        layer.values.normal_(generator=g)
        if model.device.type == "cuda":
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)
    return cache


def hf_decode(model, cache, B: int, n: int, compiled: bool, cfg: BenchConfig) -> dict:
    """HF forward per step over the StaticCache, eager or torch.compile(mode="reduce-overhead")."""
    dev = model.device

    def step(tok, pos, cpos):
        out = model(input_ids=tok, position_ids=pos, cache_position=cpos, past_key_values=cache, use_cache=True)
        return greedy_tokens(out.logits[:, -1]).unsqueeze(-1)

    fn = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compiled else step
    state = dict(tok=torch.randint(1, model.config.vocab_size, (B, 1), device=dev),
                 pos=torch.full((B, 1), n, dtype=torch.long, device=dev), cpos=torch.tensor([n], device=dev))

    def one(_i=None):
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        tok = fn(state["tok"], state["pos"], state["cpos"])
        state["tok"] = tok.clone()
        state["pos"] = state["pos"] + 1
        state["cpos"] = state["cpos"] + 1
        return False

    t0 = time.perf_counter()
    for i in range(3):
        one()
    _sync(dev.type)
    warm_s = time.perf_counter() - t0
    steps = cfg.intervals * 32
    reps = [_time_steps(dev.type, steps, one) for _ in range(cfg.reps)]
    res = _summarise(reps, 32)
    res.update(warmup_s=warm_s, kv_tokens_read_per_row=n + 3 + steps * cfg.reps / 2)
    return res


# -- prefill --------------------------------------------------------------------------------------------------

class DensePrefillFailed(RuntimeError):
    """HF's dense prefill of a (context, batch) failed; the message is its error's error_text."""


def error_text(e: BaseException) -> str:
    """What a row records of an error: its type and the first 300 characters of its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def hf_prefill_s(model, n: int, B: int = 1) -> float:
    """Wall-clock seconds of HF's dense prefill of a [B, n] batch of random tokens (module docstring)."""
    dev = model.device
    ids = torch.randint(1, model.config.vocab_size, (B, n), device=dev)
    with torch.no_grad():
        model(input_ids=ids[:, :min(n, 2048)], use_cache=True, logits_to_keep=1)  # warm-up
        _sync(dev.type)
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        _sync(dev.type)
    return time.perf_counter() - t0


# -- rows -----------------------------------------------------------------------------------------------------

class Bench:
    """The rows of one configuration. planner=True builds the model on the meta device and measures nothing: what
    the --isolate driver (bench/e2e_isolated.py) needs to plan rows and size "max" batches in a process that leaves
    the GPU to the rows' own processes."""

    def __init__(self, cfg: BenchConfig, planner: bool = False):
        self.cfg = cfg
        self.dev = cfg.device
        apply_kernel_options(cfg.kernel_options)
        self.tp, self.rank, self.owns_group = cfg.tp, 0, False
        if cfg.tp > 1 and not planner:
            import torch.distributed as dist

            self.owns_group = not dist.is_initialized()  # started here: ended by run_bench (else the launch hangs)
            self.rank = start_ranks(cfg)
        # tp > 1: the whole model on the meta device (shapes, for the bytes) and the rank's share built alone
        tp_split = cfg.tp > 1 and not planner
        self.model = build_model(cfg.model, "meta" if planner or tp_split else self.dev, model_dtype(self.dev))
        self.shard = build_rank_model(cfg.model, cfg.tp, self.rank, self.dev) if tp_split else None
        self.mcfg = self.model.config
        # one rank's share (tp > 1): the split weights count 1/tp, the rest whole (replicated)
        split = split_weight_bytes(self.model, self.tp)
        self.weights_read = weight_bytes_read(self.model) - split + split // self.tp
        self.weights_total = sum(p.numel() * p.element_size() for p in self.model.parameters()) - split + \
            split // self.tp
        self.copy_rounds = None if planner else copy_gbps_rounds(self.dev)
        self.copy_gbps = None if planner else max(self.copy_rounds)  # the floor's bandwidth (copy_gbps says why)
        self.env = env_info(self.dev)
        if self.tp > 1:
            self.env.update(tp=self.tp, rank=self.rank)
        self.captures = {}  # batch size -> (Captured, capture seconds)
        self.dense_prefill = {}  # (n, B) -> seconds, or the text of the error the dense prefill raised
        self.rows = []

    # bytes -------------------------------------------------------------------------------------------------
    def kv_token_bytes(self) -> int:
        """Bytes of one token in HF's dense cache, all layers: K and V."""
        c = self.mcfg
        return 2 * c.num_hidden_layers * c.num_key_value_heads // self.tp * c.head_dim * self.model.dtype.itemsize

    def slot_bytes(self) -> int:
        """Bytes of one kvrewrite slot in one layer, all KV heads (the rank's): K and V, fp32 bias, int64 position."""
        c = self.mcfg
        return c.num_key_value_heads // self.tp * (2 * c.head_dim * self.model.dtype.itemsize + 12)

    def floor_ms(self, kv_read: float) -> float:
        return (self.weights_read + kv_read) / self.copy_gbps / 1e6

    def per_row_bytes(self, system: str, n: int) -> int:
        """Bytes one more sequence costs: its cache as allocated (+ logits and a margin for activations)."""
        L = n + self.cfg.new_tokens
        act = 4 * self.mcfg.vocab_size * 4 + 64 * self.mcfg.hidden_size * 2 * 8
        if system in HF_SYSTEMS:
            return L * self.kv_token_bytes() + act
        from kvrewrite.capture import layer_infos

        m = make_system_method(system, self.cfg.budget)
        infos = [dataclasses.replace(i, num_heads=i.num_heads // self.tp, num_kv_heads=i.num_kv_heads // self.tp)
                 for i in layer_infos(self.model)]
        if hasattr(m, "bind"):
            m.bind(infos)
        cap = m.capacity(infos[0], L, self.cfg.prefill_chunk)
        return self.mcfg.num_hidden_layers * (cap * self.slot_bytes() + self.method_state_bytes(m, infos[0], cap, L)) \
            + act

    def method_state_bytes(self, m, info, cap: int, L: int) -> int:
        """Bytes of the method's own state (Method.state_fields) of one layer and one row: scores, EMS's table and
        pre-RoPE keys, ClusterKV's centroids, ..."""
        from kvrewrite.state import full_length

        full = full_length(L, self.cfg.prefill_chunk)
        total = 0
        for spec in m.state_fields(info).values():
            size = math.prod(spec.size(1, info.num_kv_heads, cap, info.head_dim, full))
            total += size * (spec.dtype or self.model.dtype).itemsize
        return total

    def max_batch(self, system: str, n: int) -> int:
        """Largest batch whose cache fits next to the weights, with 6% of the card + 3 GiB kept free
        (allocator fragmentation, CUDA graph pools, HF compile's workspaces)."""
        total = torch.cuda.get_device_properties(0).total_memory if self.dev == "cuda" else 8 * 2**30
        free = 0.94 * total - self.weights_total - 3 * 2**30
        return max(1, min(self.cfg.max_batch_cap, int(free // self.per_row_bytes(system, n))))

    # kvrewrite -----------------------------------------------------------------------------------------------
    def captured(self, B: int):
        if B not in self.captures:
            from kvrewrite.capture import capture

            self.captures.clear()
            gc.collect()
            t0 = time.perf_counter()
            if self.tp > 1:
                from kvrewrite.tensor_parallel import capture_rank

                cap = capture_rank(self.shard, self.tp, batch_size=B, prefill_chunk=self.cfg.prefill_chunk)
            else:
                cap = capture(self.model, batch_size=B, prefill_chunk=self.cfg.prefill_chunk)
            for g in cap.graphs.values():  # the scratch StaticCache: the rewrite drops it from every graph
                for name in cap.cache_buffers:
                    if hasattr(g, name):
                        b = getattr(g, name)
                        setattr(g, name, torch.empty(0, dtype=b.dtype, device=b.device))
            _sync(self.dev)
            self.captures[B] = (cap, time.perf_counter() - t0)
        return self.captures[B]

    def kv_row(self, method: str, n: int, B: int) -> dict:
        import kvrewrite

        cfg = self.cfg
        cap, cap_s = self.captured(B)
        name, opts = split_system(method)
        if name != "full":
            opts["budget"] = cfg.budget
        t0 = time.perf_counter()
        model = self.shard if self.tp > 1 else self.model
        rw = kvrewrite.apply(model, name, max_length=n + cfg.new_tokens, captured=cap,
                             fuse_projections=cfg.fuse_projections, gemv=cfg.gemv, tp=self.tp,
                             tp_all_reduce=cfg.tp_all_reduce, **opts)
        apply_s = time.perf_counter() - t0
        mem = rw.cache_bytes()
        res = dict(capture_s=cap_s, apply_s=apply_s, kv_bytes=mem["kvrewrite"], kv_host_bytes=mem["host"],
                   prefill_chunk=cfg.prefill_chunk, kv_compile=cfg.kv_compile, fuse_projections=cfg.fuse_projections,
                   gemv=cfg.gemv, tp_all_reduce=rw.tp_all_reduce)
        if self.times_prefill(B):
            ids = same_on_ranks(torch.randint(1, self.mcfg.vocab_size, (B, n), device=self.dev), self.tp)
            warm = ids[:, :3 * cfg.prefill_chunk] if n >= 3 * cfg.prefill_chunk else ids
            if cfg.kv_compile == "inductor":  # the prefill chunks run compiled too, as after a user's rw.compile
                compile_rw(rw, cfg.inductor_options)
            t0 = time.perf_counter()
            try:  # warm-up (Triton; under Inductor the compile and the CUDA-graph record): 3 chunks that compress
                rw.prefill(warm, max_new_tokens=cfg.new_tokens)
            except ValueError:  # a short prompt leaves the method too few slots: warm up on the real one
                rw.prefill(ids, max_new_tokens=cfg.new_tokens)
            _sync(self.dev)
            res["prefill_warmup_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            rw.prefill(ids, max_new_tokens=cfg.new_tokens)
            _sync(self.dev)
            res["prefill_s"] = time.perf_counter() - t0
            res["state"] = "real prefill"
        else:
            synthetic_fill(rw, n, cfg.new_tokens)
            res["state"] = "synthetic fill"
        fill_after_prefill = statistics.mean(f for fills in rw.schedule.fill for f in fills)
        if cfg.kv_compile == "inductor" and rw._compiled_call_impl is None:
            compile_rw(rw, cfg.inductor_options)
        dec = KVDecoder(rw, cfg.kv_compile)
        t0 = time.perf_counter()
        res["warmup_steps"] = dec.warm_up(warmup_steps(cfg.kv_compile, rw.method.interval))
        _sync(self.dev)
        res["warmup_s"] = time.perf_counter() - t0
        interval = rw.method.interval
        steps = cfg.intervals * interval
        fills = []
        reps = []
        for _ in range(cfg.reps):
            fills.append(dec.mean_fill())
            reps.append(_time_steps(self.dev, steps, dec.step))
        fills.append(dec.mean_fill())
        res.update(_summarise(reps, interval))
        res["fill_after_prefill"] = fill_after_prefill
        res["mean_fill"] = statistics.mean(fills)
        if rw.method.name == "clusterkv":  # read over PCIe with offload="cpu" (the floor assumes device memory)
            res["kv_read_bytes"] = clusterkv_read_bytes(rw, B)
        elif rw.method.name == "ems":
            res["kv_read_bytes"] = ems_read_bytes(rw, B)
        elif rw.method.name == "clustergen":
            res["kv_read_bytes"] = clustergen_read_bytes(rw, B)
        else:
            res["kv_read_bytes"] = res["mean_fill"] * self.mcfg.num_hidden_layers * self.slot_bytes() * B
        del dec, rw
        return res

    # hf ------------------------------------------------------------------------------------------------------
    def hf_row(self, system: str, n: int, B: int) -> dict:
        res = dict(state="random StaticCache")
        if self.times_prefill(B) and system == "hf-eager":
            try:
                res["prefill_s"] = self.dense_prefill_s(n, B)
            except DensePrefillFailed as e:  # recorded; the decode row still runs
                res["prefill_error"] = str(e)
            if self.dev == "cuda" and "prefill_s" in res:
                res["prefill_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            self.free()  # the row's peak is the decode's: weights + StaticCache + step workspace
        cache = hf_cache(self.model, B, n + self.cfg.new_tokens)
        res["kv_bytes"] = sum(t.numel() * t.element_size() for layer in self.cache_layers(cache) for t in layer)
        res.update(hf_decode(self.model, cache, B, n, system == "hf-compiled", self.cfg))
        res["kv_read_bytes"] = res.pop("kv_tokens_read_per_row") * self.kv_token_bytes() * B
        del cache
        return res

    @staticmethod
    def cache_layers(cache):
        return [(layer.keys, layer.values) for layer in cache.layers]

    def times_prefill(self, B: int) -> bool:
        """Whether rows of batch B time a real prefill (module docstring)."""
        return self.cfg.prefill and (B == 1 or self.cfg.batch_prefill)

    def dense_prefill_s(self, n: int, B: int = 1) -> float:
        """HF's dense prefill of [B, n], measured once per (n, B). An error it raised (out of memory, say) is kept as
        text, not as the exception, whose traceback would hold the failed forward's tensors, and raised as
        DensePrefillFailed for that (n, B) instead of a second try."""
        if (n, B) not in self.dense_prefill:
            try:
                self.dense_prefill[(n, B)] = hf_prefill_s(self.model, n, B)
            except Exception as e:  # noqa: BLE001  (its text goes into the rows)
                self.dense_prefill[(n, B)] = error_text(e)
            self.free()
        got = self.dense_prefill[(n, B)]
        if isinstance(got, str):
            raise DensePrefillFailed(got)
        return got

    # driver --------------------------------------------------------------------------------------------------
    def plan(self) -> list:
        """(system, n, batch spec) in run order: batch 1 first (every context), then larger batches."""
        out = []
        order = sorted(self.cfg.batches, key=lambda b: (b == "max", int(b) if b != "max" else 0))
        for b in order:  # hf-compiled (minutes of compile per shape) after the other rows of its batch
            for compiled in (False, True):
                for n in self.cfg.contexts:
                    for s in self.cfg.systems:
                        if (s == "hf-compiled") != compiled or (compiled and self.cfg.hf_compiled_contexts is not None
                                                                 and n not in self.cfg.hf_compiled_contexts):
                            continue
                        out.append((s, n, b))
        return out

    def run(self, log=print) -> list:
        t_start = time.perf_counter()
        done = set()
        for system, n, bspec in self.plan():
            B = self.max_batch(system, n) if bspec == "max" else int(bspec)
            if (system, n, B) in done:
                continue
            done.add((system, n, B))
            if time.perf_counter() - t_start > self.cfg.time_budget:
                row = self.row_head(system, n, B, bspec)
                row["skipped"] = f"time budget of {self.cfg.time_budget:.0f} s spent"
                self.add(row, log)
                continue
            self.add(self.measure(system, n, B, bspec, log), log)
        return self.rows

    def row_head(self, system: str, n: int, B: int, bspec: str) -> dict:
        full = split_system(system)[0] in ("full",) + HF_SYSTEMS
        return dict(system=system, context=n, batch=B, batch_spec=bspec, budget=None if full else self.cfg.budget,
                    model=self.cfg.model, new_tokens=self.cfg.new_tokens, tp=self.tp)

    def measure(self, system: str, n: int, B: int, bspec: str, log=print) -> dict:
        """One row: its timings, memory and floor, or the reason it was skipped or failed (recorded in the row:
        the grid goes on)."""
        row = self.row_head(system, n, B, bspec)
        self.free()
        need = self.weights_total + B * self.per_row_bytes(system, n)
        if self.dev == "cuda" and need > torch.cuda.get_device_properties(0).total_memory:
            row["skipped"] = f"does not fit: weights + {B} x cache = {need / 2**30:.1f} GiB > the card"
            return row
        t0 = time.perf_counter()
        clear_reference_fallbacks()
        try:
            res = self.hf_row(system, n, B) if system in HF_SYSTEMS else self.kv_row(system, n, B)
        except Exception as e:  # noqa: BLE001  (recorded in the row; the grid goes on)
            row["error"] = error_text(e)
            log(traceback.format_exc(limit=4))
            return row
        row.update(res)
        fallbacks = reference_fallbacks()  # ops that ran their reference (kernels/_fallbacks.py)
        if fallbacks:
            row["reference_fallbacks"] = fallbacks
        if self.dev == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if self.times_prefill(B) and "prefill_s" in row and system not in HF_SYSTEMS and self.tp == 1:
            try:
                row["dense_prefill_s"] = self.dense_prefill_s(n, B)
                row["prefill_vs_dense"] = row["prefill_s"] / row["dense_prefill_s"]
            except DensePrefillFailed as e:  # recorded; the row's own numbers stand
                row["dense_prefill_error"] = str(e)
        row["ms_per_token"] = row["ms_per_step"]
        row["tok_per_s"] = 1e3 * B / row["ms_per_step"]
        row["floor_ms"] = self.floor_ms(row["kv_read_bytes"])
        row["ratio_to_floor"] = row["ms_per_step"] / row["floor_ms"]
        row["copy_gbps"], row["copy_gbps_rounds"] = self.copy_gbps, self.copy_rounds
        row["row_s"] = time.perf_counter() - t0
        return row

    def free(self):
        gc.collect()
        if self.dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def add(self, row: dict, log) -> None:
        self.rows.append(row)
        log(format_row(row))
        self.write()

    def write(self) -> None:
        if self.rank != 0:  # tp > 1: rank 0 writes
            return
        doc = dict(env=self.env, copy_gbps=self.copy_gbps, copy_gbps_rounds=self.copy_rounds,
                   weight_bytes_read=self.weights_read,
                   weight_bytes=self.weights_total, config=dataclasses.asdict(self.cfg), rows=self.rows)
        path = Path(self.cfg.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(path)


ROW_KEYS = ("system", "context", "batch", "batch_spec", "model", "new_tokens")
RESULT_KEYS = ("ms_per_token", "tok_per_s", "kv_bytes", "kv_read_bytes", "floor_ms", "ratio_to_floor",
               "ms_plain_step_median", "ms_compress_step_mean", "state")


def format_row(r: dict) -> str:
    head = f"{r['system']:<14} n={r['context']:<6} B={r['batch']:<3}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    pre = f" prefill {r['prefill_s']:.2f}s" if "prefill_s" in r else ""
    if "prefill_vs_dense" in r:
        pre += f" ({r['prefill_vs_dense']:.2f}x dense)"
    peak = f" peak {r['peak_gib']:.1f}GiB" if "peak_gib" in r else ""
    host = f" ({r['kv_host_bytes'] / 2**30:.2f} on host)" if r.get("kv_host_bytes") else ""
    setup = " ".join(f"{k}={r[k]:.1f}" for k in ("capture_s", "apply_s", "warmup_s", "row_s") if k in r)
    slow = ""
    if r.get("reference_fallbacks"):
        slow = f"\n    SLOW PATH: ran the PyTorch reference of {', '.join(sorted(r['reference_fallbacks']))} (JSON)"
    return (f"{head} {r['ms_per_token']:8.2f} ms/tok {r['tok_per_s']:9.1f} tok/s | floor {r['floor_ms']:.2f} ms "
            f"x{r['ratio_to_floor']:.2f} | KV {r['kv_bytes'] / 2**30:.2f}GiB{host}{peak}{pre} | plain "
            f"{r['ms_plain_step_median']:.2f} compress {r['ms_compress_step_mean']:.2f} | {setup}{slow}")


def run_bench(cfg: BenchConfig, log=print) -> dict:
    """Every row; returns the JSON document written (tp > 1: {} on the ranks other than 0, which log nothing)."""
    cfg.validate()
    bench = Bench(cfg)
    try:
        return _run_rows(bench, cfg, log)
    finally:
        if bench.owns_group:
            import torch.distributed as dist

            _free_cuda_graphs(bench.dev)
            dist.destroy_process_group()


def _free_cuda_graphs(dev: str) -> None:
    """Drop the run's CUDA graphs before the group ends: ncclCommDestroy hangs while a graph that captured NCCL
    kernels is alive (pytorch/pytorch#115388; seen here with --tp-all-reduce collective under Inductor, whose CUDA
    graph trees outlive the rows)."""
    import gc

    if dev == "cuda":
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        torch.cuda.synchronize()
        reset_cudagraph_trees()
        gc.collect()
        torch.cuda.synchronize()


def _run_rows(bench: Bench, cfg: BenchConfig, log) -> dict:
    if bench.rank != 0:
        with torch.no_grad():
            bench.run(lambda _s: None)
        return {}
    log(f"{bench.env.get('gpu')} | torch {bench.env['torch']} | transformers {bench.env['transformers']} | "
        f"triton {bench.env.get('triton', '-')} | git {bench.env['git_sha'][:12]} | copy {bench.copy_gbps:.0f} GB/s | "
        f"weights read/step {bench.weights_read / 1e9:.2f} GB")
    bench.write()
    with torch.no_grad():
        bench.run(log)
    return json.loads(Path(cfg.out).read_text())


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvrewrite.cli import _csv
    from kvrewrite.tensor_parallel import TP_ALL_REDUCES

    p.add_argument("--grid", choices=sorted(GRIDS), help="preset: full (16k/32k/64k x batch 1, 16, max) or quick "
                   "(32k, batch 1); explicit flags override it")
    p.add_argument("--model", default="llama-3.1-8b", help=f"model shape with random weights: {', '.join(MODELS)}")
    p.add_argument("--systems", type=_csv(str), help="hf-eager, hf-compiled and/or kvrewrite method names, "
                   "options after colons (clusterkv:offload=cpu); default: the two HF baselines and every method")
    p.add_argument("--contexts", type=_csv(int), help="context lengths n (default 16384,32768,65536)")
    p.add_argument("--batches", type=_csv(str), help="batch sizes; 'max' = the largest that fits per system and "
                   "context (default 1,16)")
    p.add_argument("--budget", type=parse_budget, default=0.2, help="budget of the compressing methods: a fraction "
                   "in (0, 1] of n + new tokens, or an int, slots per KV head (default 0.2)")
    p.add_argument("--new-tokens", type=int, default=None, help="max_new_tokens the state is sized for (default: the "
                   "fewest that cover every system's warm-up and timed steps, at least 320)")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="kvrewrite prefill chunk (default 1024)")
    p.add_argument("--intervals", type=int, default=2, help="timed intervals of g steps per rep, g the method's "
                   "interval: 32, ClusterKV's 320 (default 2)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument("--kv-compile", default="graph", choices=("graph", "inductor", "eager"),
                   help="kvrewrite decode: CUDA graphs of the eager graphs (default), rw.compile(reduce-overhead), "
                   "or eager")
    p.add_argument("--hf-compiled-contexts", type=_csv(int), help="contexts where hf-compiled runs (default all)")
    p.add_argument("--max-batch-cap", type=int, default=128, help="upper bound of 'max' batches (default 128)")
    p.add_argument("--time-budget", type=float, default=math.inf, help="skip rows not started after this many s")
    p.add_argument("--no-prefill", dest="prefill", action="store_false", help="no prefill timing (synthetic state)")
    p.add_argument("--batch-prefill", action="store_true", help="at batch > 1 too: the real chunked prefill of the "
                   "batch (not the synthetic state), timed against HF's dense prefill of the same batch")
    p.add_argument("--isolate", action="store_true", help="every row in a fresh process, so no row inherits another's "
                   "GPU memory; 'max' batches shrink by 15%% after an out-of-memory error, up to 3 tries "
                   "(bench/e2e_isolated.py)")
    p.add_argument("--fuse-projections", action="store_true", help="kvrewrite rows: one matmul for q/k/v and one for "
                   "gate/up (kvrewrite.apply(fuse_projections=True); rebinds the model's weights as views, same values)")
    p.add_argument("--gemv", action="store_true", help="kvrewrite rows: the decode graphs' matrix-vector products "
                   "through kvrewrite's Triton GEMV (kvrewrite.apply(gemv=True))")
    p.add_argument("--inductor-option", dest="inductor_options", action="append", type=inductor_option, default=[],
                   metavar="NAME=VALUE", help="with --kv-compile inductor: an Inductor config for the kvrewrite rows "
                   "(repeatable; e.g. combo_kernels=True); rw.compile(options=...) with CUDA graphs")
    p.add_argument("--kernel-option", dest="kernel_options", action="append", type=kernel_option, default=[],
                   metavar="MODULE.NAME=VALUE", help="a kernel module's launch constant for every kvrewrite row "
                   "(repeatable; e.g. gemv_rms_norm.BLOCK_N=2), recorded in the JSON's config")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the code paths")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the kvrewrite rows: launch with "
                   "`torchrun --nproc-per-node N -m kvrewrite.cli bench --tp N ...` (docs/tensor-parallel.md)")
    p.add_argument("--tp-all-reduce", default="auto", choices=TP_ALL_REDUCES,
                   help="with --tp > 1: how the ranks' partial sums are added (kvrewrite.apply's tp_all_reduce)")
    p.add_argument("--out", default="out/bench/e2e.json", help="JSON file, rewritten after every row")
    p.add_argument("--plot", default=None, help="image file for the plots (default: the JSON's name, .png)")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the library does")


def config_from_args(args) -> BenchConfig:
    from kvrewrite.methods import METHODS

    preset = GRIDS.get(args.grid or "", {})
    systems = args.systems or list(HF_SYSTEMS) + [m for m in METHODS]
    return BenchConfig(
        model=args.model, systems=tuple(systems), contexts=tuple(args.contexts or preset.get("contexts", (16384, 32768, 65536))),
        batches=tuple(args.batches or preset.get("batches", ("1", "16"))), budget=args.budget,
        new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk, intervals=args.intervals, reps=args.reps,
        kv_compile=args.kv_compile, hf_compiled_contexts=tuple(args.hf_compiled_contexts) if args.hf_compiled_contexts
        else None, max_batch_cap=args.max_batch_cap, time_budget=args.time_budget, prefill=args.prefill,
        batch_prefill=args.batch_prefill,
        fuse_projections=args.fuse_projections, gemv=args.gemv, inductor_options=dict(args.inductor_options),
        kernel_options=dict(args.kernel_options), out=args.out, device=args.device, tp=args.tp,
        tp_all_reduce=args.tp_all_reduce)


def cmd_bench(args) -> int:
    cfg = config_from_args(args)
    cfg.validate()
    if args.isolate and cfg.tp > 1:
        raise ValueError("bench: --isolate runs rows in processes of its own, --tp in the ranks torchrun started: "
                         "use one of them")
    if args.isolate:
        from kvrewrite.bench.e2e_isolated import run_isolated

        doc = run_isolated(cfg, log=lambda s: print(s, flush=True))
    else:
        doc = run_bench(cfg, log=lambda s: print(s, flush=True))
    if not doc:  # tp > 1, a rank other than 0
        return 0
    from kvrewrite.bench.plot_e2e import plot_e2e

    out = args.plot or str(Path(cfg.out).with_suffix(".png"))
    try:
        plot_e2e(doc, out)
        print(f"wrote {cfg.out} and {out}", flush=True)
    except ImportError as e:
        print(f"wrote {cfg.out} (no plot: {e})", flush=True)
    return 0
