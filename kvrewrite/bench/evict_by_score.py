"""kvrewrite::evict_by_score on the GPU: the Triton kernels against the tensor code they replace (the reference).

One compressing call of one layer, the way H2O and SnapKV decode runs it (every g = 32 steps, every layer):
Llama-3.1-8B layout (Hkv 8, D 128, bf16), capacity C, every row at the threshold (fill = target + 32, so 32 slots
go per row), random distinct scores (the evicted slots fall anywhere among the older ones), the state's `order` the
identity (a fresh layout; the op's cost does not depend on it beyond the gathers of the select pass). The kept
slots past the target fill the evicted ones' places: at most 32 keys and values move per row. Settings: h2o
(n_recent 0, recent_ratio 0.5, pool 1) and snapkv (n_recent 32, pool 7, reset_score). --batch B times batch B
(C 8600, target 6554) instead of the default configs.

Timing (as kvrewrite.bench.attention): N calls inside one CUDA graph, over N states rotated so that the state
data per replay is >= 4x the L2, median replay time / N. Each call first restores the state's metadata (bias,
slot_pos, score, order, fill: what the op decides from; the keys and values move the same whatever they hold), and
the same graph of the restores alone is timed and subtracted. The result is checked bit for bit against the tensor
code before timing. Also: device time per kernel (torch.profiler over eager calls: select, move), and with
--sweep the Triton path under a few tuning knobs (triton_evict_by_score's keyword arguments).
GB/s: the keys and values of the slots that can move (the evicted count a row), read and written once, over the
Triton time.

Run:  python -m kvrewrite.bench.evict_by_score --out evict_by_score.json [--sweep] [--batch 40]
"""
import argparse
import json
import math
from dataclasses import asdict, dataclass, field

import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import DTYPES, ROTATE_BYTES, _bench_ms, start_run
from kvrewrite.bench.cuda_graphs import capture, warm_up
from kvrewrite.kernels import evict_by_score as ebs
from kvrewrite.state import allocate_layer_state

FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "score", "order")
METADATA = ("bias", "slot_pos", "score", "order", "fill")
SETTINGS = {"h2o": (0, 0.5, 1, False), "snapkv": (32, 0.0, 7, True)}
SWEEP = [  # triton_evict_by_score's tuning knobs (the defaults first)
    {}, dict(select_warps=8), dict(select_warps=32), dict(select_chunk=2048), dict(select_chunk=8192),
    dict(move_slots=32), dict(move_slots=64), dict(move_slots=256), dict(move_columns=128), dict(move_warps=2),
    dict(move_warps=8),
]


@dataclass(frozen=True)
class Config:
    B: int
    C: int
    target: int
    method: str
    interval: int = 32
    Hkv: int = 8
    D: int = 128
    dtype: str = "bf16"

    @property
    def state_bytes(self) -> int:
        return 2 * self.B * self.Hkv * self.C * self.D * DTYPES[self.dtype].itemsize

    @property
    def moved_bytes(self) -> int:
        """Keys and values of the slots that can move, read and written once: at most the `interval` evicted ones a
        row (each kept slot past the target fills an evicted one's place)."""
        return 2 * 2 * self.B * self.Hkv * min(self.interval, self.target) * self.D * DTYPES[self.dtype].itemsize


@dataclass
class Result:
    triton_us: float = math.nan  # CUDA-graph time per call, restores subtracted
    tensor_us: float = math.nan  # the reference (tensor code) on CUDA, same timing
    restore_us: float = math.nan  # the subtracted metadata restores, per call
    speedup: float = math.nan
    triton_gbps: float = math.nan  # moved_bytes / triton_us
    kernels_us: dict = field(default_factory=dict)  # device time per kernel, eager calls
    sweep_us: list = field(default_factory=list)  # [(knobs, triton_us)] with --sweep


def get_configs(batches: list[int] | None = None) -> list[Config]:
    """The default layouts, or with `batches` batch B at C 8600, target 6554 for each B."""
    shapes = [(B, 8600, 6554) for B in batches] if batches else [(1, 8600, 6554), (8, 8600, 6554), (1, 32768, 26214)]
    return [Config(B, C, target, method) for B, C, target in shapes for method in SETTINGS]


def make_state(cfg: Config, seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    fill = cfg.target + cfg.interval
    s = allocate_layer_state(cfg.B, cfg.Hkv, cfg.C, cfg.D, DTYPES[cfg.dtype], "cuda")
    s["keys"].normal_(generator=g)
    s["values"].normal_(generator=g)
    s["bias"][..., :fill] = 0.0
    s["slot_pos"].copy_(torch.arange(cfg.C, device="cuda"))
    s["fill"].fill_(fill)
    s["budget"].copy_(torch.tensor([cfg.target, fill]))
    s["score"] = torch.rand(cfg.B, cfg.Hkv, cfg.C, device="cuda", generator=g).masked_fill(s["bias"] == -math.inf, 0)
    s["order"] = torch.zeros(cfg.B, cfg.Hkv, cfg.C, dtype=torch.int32, device="cuda")
    return s


def _call(s, settings, knobs=None):
    args = (*(s[f] for f in FIELDS[:5]), s["budget"], s["score"], s["order"], *settings)
    if knobs is None:
        ebs.reference_evict_by_score(*args)
    else:
        ebs.triton_evict_by_score(*args, **knobs)


def _restore(s, saved):
    for f in METADATA:
        s[f].copy_(saved[f])


def _bits(t):
    """t's bits, for exact comparison (NaN == NaN)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


def _graph_us(fn, sets) -> float:
    """Per-call time of fn(state, saved) over the sets, N calls captured in one CUDA graph."""
    warm_up(lambda: [fn(*x) for x in sets])
    graph = capture(lambda: [fn(*x) for x in sets])
    ms = _bench_ms(graph.replay)
    del graph
    return ms * 1e3 / len(sets)


def _kernels_us(sets, settings, reps=20) -> dict:
    """Device time per call of each Triton kernel (torch.profiler over eager calls)."""
    from torch.profiler import ProfilerActivity, profile

    s, saved = sets[0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            _restore(s, saved)
            _call(s, settings, {})
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if "_evict_" in e.key:
            total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            out[e.key] = total / reps
    return out


def run(cfg: Config, sweep: bool = False) -> dict:
    settings = SETTINGS[cfg.method]
    n = max(2, min(16, math.ceil(ROTATE_BYTES / cfg.state_bytes)))
    sets = []
    for i in range(n):
        s = make_state(cfg, seed=i)
        sets.append((s, {f: s[f].clone() for f in METADATA}))
    # correctness smoke: the Triton path leaves the tensor code's state, bit for bit
    s, saved = sets[0]
    want = {f: t.clone() for f, t in s.items()}
    _call(want, settings)
    _call(s, settings, {})
    bad = [f for f in FIELDS if not torch.equal(_bits(s[f]), _bits(want[f]))]
    assert not bad, f"{cfg}: the Triton path differs from the tensor code in {bad}"
    _restore(s, saved)
    del want

    def timed(knobs):
        return lambda st, sv: (_restore(st, sv), _call(st, settings, knobs))

    res = Result()
    res.restore_us = _graph_us(_restore, sets)
    res.triton_us = _graph_us(timed({}), sets) - res.restore_us
    res.tensor_us = _graph_us(timed(None), sets) - res.restore_us
    res.speedup = res.tensor_us / res.triton_us
    res.triton_gbps = cfg.moved_bytes / res.triton_us / 1e3
    res.kernels_us = _kernels_us(sets, settings)
    if sweep:
        res.sweep_us = [(knobs, _graph_us(timed(knobs), sets) - res.restore_us) for knobs in SWEEP]
    del sets
    torch.cuda.empty_cache()
    kernels = " ".join(f"{k.replace('_evict_', '').replace('_kernel', '')} {v:.1f}" for k, v in res.kernels_us.items())
    print(f"B={cfg.B} C={cfg.C:<6} {cfg.method:<7} triton {res.triton_us:7.1f} us ({res.triton_gbps:5.0f} GB/s; "
          f"{kernels}) | tensor code {res.tensor_us:7.1f} us | x{res.speedup:.1f}", flush=True)
    for knobs, us in res.sweep_us:
        print(f"    {knobs or 'defaults'}: {us:.1f} us", flush=True)
    return dict(config=asdict(cfg), result=asdict(res))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="evict_by_score.json")
    parser.add_argument("--sweep", action="store_true", help="also time the Triton path under the SWEEP knobs")
    parser.add_argument("--batch", type=int, nargs="+", help="time these batch sizes (C 8600, target 6554) instead "
                                                             "of the default configs, e.g. --batch 40")
    args = parser.parse_args()
    env, copy = start_run()
    rows = [run(cfg, args.sweep) for cfg in get_configs(args.batch)]
    with open(args.out, "w") as f:
        json.dump(dict(env=env, copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
