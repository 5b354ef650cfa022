"""kvrewrite::select_clusters on the GPU: ClusterKV's per-step cluster selection, Llama-3.1-8B decode.

One call of one layer as the method's decode step makes it: B 1, Hq 32, Hkv 8, D 128, bf16 q and centroids,
n_sink 16, max_selected 1008 (budget[0] = 1024), window 320 (a random 0..320 of it in use). Contexts: 32k (410
clusters in use of K = 820) and 128k (1640 of 3280), the notes' 80 tokens per cluster on average (sizes skewed:
80 * 3 * u^2, u uniform, some 0). Both per_query_head settings (index [1, 32, 1344] or [1, 8, 1344]).

Timing (as kvrewrite.bench.attention): N calls inside one CUDA graph, over N states rotated so that the state data
per replay is >= 4x the L2 (a decode step meets each layer's centroids cold), median replay time (do_bench) / N;
`hot_us` times N calls on one state (from the L2). Also tuning variants (register tiers off, warps, score blocks), a
state sized for 128k used at 32k, and for scale the attention the selection serves: kvrewrite::clustered_attention
(past_only, as decode graphs call it) over the whole context (dense_us) and over S = 1344 slots (attend_s_us: a
floor for attention over the selected slots). The index is checked against the reference before timing (exact:
the inputs are dyadic, every fp32 dot product is exact, so the CPU reference's ranking is the kernel's).

Run:  python -m kvrewrite.bench.select_clusters --out select_clusters.json
"""
import argparse
import json
import math
from dataclasses import asdict, dataclass, field

import torch
from torch._library.triton import set_wrap_triton_enabled

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import ROTATE_BYTES, _bench_ms, start_run
from kvrewrite.bench.cuda_graphs import capture, warm_up
from kvrewrite.kernels import select_clusters as sc

ARGS = ("fill", "budget", "centroids", "cluster_size", "cluster_start", "members", "n_clusters", "cluster_end")
VARIANTS = {  # launch overrides timed besides the default (triton_select_clusters' tuning keywords)
    "tiers_off": dict(tiers=False), "w4": dict(num_warps=4), "w16": dict(num_warps=16), "bk32": dict(block_k=32),
    "bk128": dict(block_k=128), "two_launch": dict(fused=False), "w2": dict(num_warps=2), "pdl": dict(pdl=True),
}


@dataclass(frozen=True)
class Config:
    context: int  # tokens
    per_query_head: bool
    K: int  # cluster capacity
    used: int  # clusters in use
    B: int = 1
    Hq: int = 32
    Hkv: int = 8
    D: int = 128
    n_sink: int = 16
    max_selected: int = 1008
    window: int = 320
    dtype: str = "bf16"


@dataclass
class Result:
    us: float = math.nan  # the op, CUDA graph over rotated states, per call
    hot_us: float = math.nan  # the op on one state (L2-resident), per call
    variants_us: dict = field(default_factory=dict)  # {variant: us} (VARIANTS, rotated states)
    launch: dict = field(default_factory=dict)  # what the op chose (_launch_config)
    dense_us: float = math.nan  # clustered_attention over the whole context (C = context slots)
    attend_s_us: float = math.nan  # clustered_attention over S slots
    state_bytes: int = 0  # the used centroids, sizes, starts and members one call may read


def get_configs() -> list[Config]:
    """32k and 128k, each state sized for its context (K = 2 x the clusters in use), and a state sized for 128k at a
    32k context (the register tiers: the cost follows the clusters in use)."""
    return [Config(ctx, pqh, K, used) for ctx, K, used in ((32768, 820, 410), (131072, 3280, 1640))
            for pqh in (True, False)] + [Config(32768, True, 3280, 410)]


def dyadic(shape, gen, dtype, device):
    """k / 64, |k| <= 64: exact in bf16/fp16, and every fp32 dot product over D <= 128 (group sums of <= 8) exact."""
    return (torch.randint(-64, 65, shape, generator=gen).float() / 64).to(device=device, dtype=dtype)


def make_state(B, Hkv, K, used, D, *, n_sink, window, budget, dtype, device, seed, mean_size=80, pad=3, C=None):
    """A ClusterKV layer state after the prompt's (and some windows') clustering, per row: `pad` padding slots, the
    sinks, `used` clusters (an int, or [B][Hkv] ints) of skewed sizes (80 * 3 * u^2 on average mean_size, the small
    ones 0) over random members, then 0..window unclustered slots; ids >= used have NaN centroids (never read).
    Queries are not part of it (make_q). C: the slots (members' length), by default what the largest row needs."""
    g = torch.Generator().manual_seed(seed)
    used = [[used] * Hkv] * B if isinstance(used, int) else used
    sizes = [[(3 * mean_size * torch.rand(used[b][h], generator=g) ** 2).long() for h in range(Hkv)] for b in range(B)]
    need = pad + n_sink + max(int(s.sum()) for r in sizes for s in r) + window + 1
    if C is None:
        C = need
    elif C < need:
        raise ValueError(f"make_state: C = {C} slots, the state needs {need}")
    st = dict(
        centroids=dyadic((B, Hkv, K, D), g, torch.float32, "cpu"),
        cluster_size=torch.zeros(B, Hkv, K, dtype=torch.int32),
        cluster_start=torch.zeros(B, Hkv, K, dtype=torch.int32),
        members=torch.full((B, Hkv, C), -1, dtype=torch.int32),
        n_clusters=torch.zeros(B, Hkv, dtype=torch.int32),
        cluster_end=torch.zeros(B, Hkv, dtype=torch.int64),
        fill=torch.zeros(B, Hkv, dtype=torch.int64),
        budget=torch.tensor([budget, 0]),
    )
    for b in range(B):
        for h in range(Hkv):
            size, n = sizes[b][h], used[b][h]
            L = int(size.sum())
            first = pad + n_sink
            label = torch.repeat_interleave(torch.arange(n), size)[torch.randperm(L, generator=g)]  # slot -> cluster
            order = torch.sort(label, stable=True).indices  # by cluster, within one in slot order
            st["members"][b, h, :n_sink] = torch.arange(pad, first, dtype=torch.int32)
            st["members"][b, h, n_sink:n_sink + L] = (first + order).int()
            st["cluster_size"][b, h, :n] = size.int()
            st["cluster_start"][b, h, :n] = (n_sink + torch.cumsum(size, 0) - size).int()
            st["n_clusters"][b, h] = n
            st["centroids"][b, h, n:] = math.nan
            st["cluster_end"][b, h] = first + L
            st["fill"][b, h] = first + L + int(torch.randint(0, window + 1, (), generator=g))
    st["centroids"] = st["centroids"].to(dtype)
    return {k: v.to(device) for k, v in st.items()}


def make_q(B, Hq, D, dtype, device, seed):
    """[B, Hq, 1, D] dyadic, a transposed view of [B, 1, Hq, D] as the models hand it over."""
    return dyadic((B, 1, Hq, D), torch.Generator().manual_seed(seed), torch.float32, device).to(dtype).transpose(1, 2)


def _call(cfg: Config, tuning=None):
    kw = dict(n_sink=cfg.n_sink, max_selected=cfg.max_selected, window=cfg.window, per_query_head=cfg.per_query_head)
    if not tuning:
        return lambda q, st: torch.ops.kvrewrite.select_clusters(q, *(st[a] for a in ARGS), **kw)

    def launch(q, st):
        with set_wrap_triton_enabled(False):  # launch the kernels themselves, not the tracing wrapper
            return sc.triton_select_clusters(q, *(st[a] for a in ARGS), **kw, **tuning)

    return launch


def _graph_us(fn, sets) -> float:
    """Per-call time of fn over the sets, captured in one CUDA graph (do_bench median of replays)."""
    outs = []
    warm_up(lambda: [fn(*s) for s in sets])
    graph = capture(lambda: outs.extend(fn(*s) for s in sets))
    ms = _bench_ms(graph.replay)
    del graph, outs
    return ms * 1e3 / len(sets)


_ATTENTION_US = {}  # (C, B, Hq, Hkv, D, dtype) -> us: the same attention serves both per_query_head rows


def _attention_us(cfg: Config, C: int) -> float:
    """clustered_attention (past_only, window 0) over C slots, rotated sets."""
    key = (C, cfg.B, cfg.Hq, cfg.Hkv, cfg.D, cfg.dtype)
    if key not in _ATTENTION_US:
        _ATTENTION_US[key] = _time_attention(cfg, C)
    return _ATTENTION_US[key]


def _time_attention(cfg: Config, C: int) -> float:
    dt = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[cfg.dtype])
    per = 2 * cfg.B * cfg.Hkv * C * cfg.D * 2
    sets = []
    for _ in range(max(2, min(16, math.ceil(ROTATE_BYTES / per)))):
        k = torch.randn(cfg.B, cfg.Hkv, C, cfg.D, device="cuda", dtype=dt)
        sets.append((torch.randn(cfg.B, cfg.Hq, 1, cfg.D, device="cuda", dtype=dt), k, torch.randn_like(k),
                     torch.zeros(cfg.B, cfg.Hkv, C, device="cuda"),
                     torch.arange(C, device="cuda").expand(cfg.B, cfg.Hkv, C).contiguous(),
                     torch.tensor([C], device="cuda")))
    fn = lambda q, k, v, b, p, cp: torch.ops.kvrewrite.clustered_attention(q, k, v, b, p, cp, cfg.D**-0.5, 0,  # noqa
                                                                            past_only=True)
    us = _graph_us(fn, sets)
    del sets
    torch.cuda.empty_cache()
    return us


def run(cfg: Config) -> dict:
    dt = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[cfg.dtype])
    budget = cfg.n_sink + cfg.max_selected
    st0 = make_state(cfg.B, cfg.Hkv, cfg.K, cfg.used, cfg.D, n_sink=cfg.n_sink, window=cfg.window, budget=budget,
                     dtype=dt, device="cuda", seed=0)
    res = Result()
    res.state_bytes = sum(st0[a].numel() * st0[a].element_size() for a in ARGS if a != "centroids") \
        + cfg.B * cfg.Hkv * cfg.used * cfg.D * st0["centroids"].element_size()
    n = max(2, min(16, math.ceil(ROTATE_BYTES / res.state_bytes)))
    sets = [(make_q(cfg.B, cfg.Hq, cfg.D, dt, "cuda", i), st0 if i == 0 else
             make_state(cfg.B, cfg.Hkv, cfg.K, cfg.used, cfg.D, n_sink=cfg.n_sink, window=cfg.window, budget=budget,
                        dtype=dt, device="cuda", seed=i)) for i in range(n)]
    # correctness: the index equals the CPU reference's (exact inputs), every launch form
    q, st = sets[0]
    want = sc.reference_select_clusters(q.cpu(), *(st[a].cpu() for a in ARGS), n_sink=cfg.n_sink,
                                        max_selected=cfg.max_selected, window=cfg.window,
                                        per_query_head=cfg.per_query_head)
    for name, tuning in [("op", None), *VARIANTS.items()]:
        got = _call(cfg, tuning)(q, st)
        assert torch.equal(got.cpu(), want), f"{cfg}: {name} differs from the reference"
    res.launch = sc._launch_config(cfg.K, cfg.D, cfg.n_sink, cfg.max_selected, cfg.window)
    res.us = _graph_us(_call(cfg), sets)
    res.hot_us = _graph_us(_call(cfg), [sets[0]] * n)
    res.variants_us = {name: _graph_us(_call(cfg, tuning), sets) for name, tuning in VARIANTS.items()}
    del sets, st0, q, st
    torch.cuda.empty_cache()
    res.dense_us = _attention_us(cfg, cfg.context)
    res.attend_s_us = _attention_us(cfg, cfg.n_sink + cfg.max_selected + cfg.window)
    variants = " ".join(f"{k} {v:.2f}" for k, v in res.variants_us.items())
    print(f"{cfg.context // 1024}k per_query_head={cfg.per_query_head!s:<5} K={cfg.K} used={cfg.used}: "
          f"{res.us:.2f} us (hot {res.hot_us:.2f}; {variants}) | attention dense {res.dense_us:.1f} us, "
          f"over S slots {res.attend_s_us:.1f} us", flush=True)
    return dict(config=asdict(cfg), result=asdict(res))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="select_clusters.json")
    args = parser.parse_args()
    env, copy = start_run()
    rows = [run(cfg) for cfg in get_configs()]
    with open(args.out, "w") as f:
        json.dump(dict(env=env, copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
