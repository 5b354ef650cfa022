"""Tuning of kvmerger_compress's Triton knobs on the GPU: every combination, timed as CUDA graph replays.

State: Llama-3.1-8B layout (8 KV heads, D = 128, bf16), random keys with 300 planted runs of 12 near-identical
keys per row (so sets of several members form), distinct random scores, degrees 1..3. Cases: a decode-time call
(fill 6688 -> 6656, the 32k / budget 0.2 state, C = 6975), prefill calls after a chunk of 2048 and of 4096 tokens,
and the decode call at batch 8. Each combination: one CUDA graph of the call, 12 replays from the same state (a GPU
sleep before each so the host is ahead), median of the last 10, in microseconds; plus a per-kernel profile of the
default knobs. The defaults in kvrewrite/kernels/_kvmerger_kernels.py come from these runs
(docs/bench/kvmerger_knobs_h100_merge.json by this module; kvmerger_knobs_h100_warps.json by its first form, the
same cases and timing with keys sw<select_warps>_c<chunk>: a rerun here stopped after its first case).

Run:  python -m kvrewrite.bench.kvmerger_knobs --knobs merge --out kvmerger_knobs_merge.json
      python -m kvrewrite.bench.kvmerger_knobs --knobs warps --out kvmerger_knobs_warps.json
"""
import argparse
import itertools
import json

import torch

from kvrewrite.bench.attention import env_info
from kvrewrite.bench.cuda_graphs import replay_us
from kvrewrite.kernels import _kvmerger_kernels as kk

FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "score", "degree")
CASES = {"decode_B1": (1, 6975, 6688, 6656), "prefill2048_B1": (1, 8735, 6656 + 2048, 6656),
         "prefill4096_B1": (1, 10783, 6656 + 4096, 6656), "decode_B8": (8, 6975, 6688, 6656)}
GRIDS = {"merge": dict(chunk=(1024, 4096), merge_slots=(8, 16, 32), merge_warps=(1, 2, 4)),
         "warps": dict(select_warps=(4, 8, 16, 32), chunk=(2048, 4096, 8192))}


def make_state(B, C, fill, H=8, D=128, runs=300, run_len=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, C, D, generator=g)
    for b, h, _ in itertools.product(range(B), range(H), range(runs)):
        s = int(torch.randint(0, C - run_len, (1,), generator=g))
        keys[b, h, s:s + run_len] = torch.randn(D, generator=g) + 0.05 * torch.randn(run_len, D, generator=g)
    degree = torch.randint(1, 4, (B, H, C), generator=g, dtype=torch.int32)
    state = dict(keys=keys.bfloat16(), values=torch.randn(B, H, C, D, generator=g).bfloat16(),
                 bias=degree.float().log(), slot_pos=torch.arange(C).expand(B, H, C).contiguous(),
                 fill=torch.full((B, H), fill, dtype=torch.int64), score=torch.rand(B, H, C, generator=g) * 10,
                 degree=degree)
    return {k: v.cuda() for k, v in state.items()}


def time_call(s0, budget, knobs) -> float:
    s = {f: t.clone() for f, t in s0.items()}

    def call():
        kk.triton_kvmerger_compress(*(s[f] for f in FIELDS[:5]), budget, s["score"], s["degree"],
                                    recent_ratio=0.34, hh_ratio=0.24, **knobs)

    call()
    torch.cuda.synchronize()

    def reset():
        for f in FIELDS:
            s[f].copy_(s0[f])

    us = replay_us(call, reset)
    assert int(s["fill"].max()) == int(budget[0]), "the call did not compress to the budget"
    return us


def kernel_profile(s0, budget) -> dict:
    from torch.profiler import ProfilerActivity, profile

    s = {f: t.clone() for f, t in s0.items()}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            for f in FIELDS:
                s[f].copy_(s0[f])
            kk.triton_kvmerger_compress(*(s[f] for f in FIELDS[:5]), budget, s["score"], s["degree"],
                                        recent_ratio=0.34, hh_ratio=0.24)
        torch.cuda.synchronize()
    return {e.key.replace("_kvm_", "").replace("_kernel", ""): round(e.self_device_time_total / 5, 1)
            for e in prof.key_averages() if "_kvm_" in e.key}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--knobs", choices=sorted(GRIDS), default="merge")
    p.add_argument("--out", default="kvmerger_knobs.json")
    args = p.parse_args()
    grid = GRIDS[args.knobs]
    result = dict(env=env_info(), grid={k: list(v) for k, v in grid.items()})
    for name, (B, C, fill, target) in CASES.items():
        s0 = make_state(B, C, fill)
        budget = torch.tensor([target, target + 32], device="cuda")
        res = {}
        for values in itertools.product(*grid.values()):
            knobs = dict(zip(grid, values))
            res["_".join(f"{k}{v}" for k, v in knobs.items())] = time_call(s0, budget, knobs)
        best = min(res, key=res.get)
        prof = kernel_profile(s0, budget)
        print(f"{name}: best {best} {res[best]:.1f} us; default-knob kernels (us): {prof}", flush=True)
        result[name] = dict(us=res, best=best, profile_default=prof)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
