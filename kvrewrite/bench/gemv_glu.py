"""A gated MLP's down projection on the GPU: kvrewrite::gemv_glu (act, product and GEMV in one kernel) vs the
unfused act(gate) * up (eager ATen: an act kernel and a mul kernel) then kvrewrite::gemv, and vs kvrewrite::gemv
alone on a ready input (what the fused kernel could reach: the prologue for free).

Shape: Llama-3.1-8B's down projection, 14336 -> 4096, bf16, with silu (Llama) and gelu tanh (Gemma's act); gate and
up are slices of one [1, 1, 2 x 14336] row, as passes/fuse_projections.py leaves them. Every output is checked
against the fp32 reference within kernels/gemv_glu.py error_bound; the run stops if one is off. Also a few launch
variants of the fused kernel (weight rows per program: the prologue is recomputed by every program, so more rows
per program amortize it) and, for scale, the unfused sequence with the act * up compiled by Inductor (one kernel,
as in rw.compile's decode graphs).

Timing: one CUDA graph over N input sets whose weights rotate through >= 256 MiB (more than 4x the L2), replayed
by kvrewrite/bench/cuda_graphs.replay_us (a 1 ms device sleep before each replay, median), per call; the median of
3 such measurements. GB/s counts the weight bytes.

Run:  python -m kvrewrite.bench.gemv_glu --out gemv_glu.json
"""
import argparse
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._library.triton import set_wrap_triton_enabled

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import ROTATE_BYTES, start_run
from kvrewrite.bench.cuda_graphs import replay_us, warm_up
from kvrewrite.kernels import gemv_glu as G

N, K = 4096, 14336  # Llama-3.1-8B's down projection
ACTS = ("silu", "gelu_tanh")
VARIANTS = (dict(block_n=1), dict(block_n=2), dict(block_n=4), dict(block_n=16), dict(block_n=4, num_warps=4))


def _make_sets(dtype=torch.bfloat16):
    n = max(1, min(16, math.ceil(ROTATE_BYTES / (N * K * 2))))
    sets = []
    for _ in range(n):
        gu = torch.randn(1, 1, 2 * K, device="cuda", dtype=dtype) * 2
        sets.append((gu[..., :K], gu[..., K:], torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5))
    return sets


def per_call_us(fn, sets, repeats: int = 3) -> float:
    """Microseconds per fn(*s), the calls over every set captured in one CUDA graph (median of `repeats`)."""
    outs = []

    def call():
        outs.clear()
        outs.extend(fn(*s) for s in sets)  # kept alive while the graph replays

    warm_up(call, times=2)
    return statistics.median(replay_us(call, lambda: None) for _ in range(repeats)) / len(sets)


def check(out, a, b, w, act) -> float:
    """Largest error over kernels/gemv_glu.py's error_bound (<= 1 passes)."""
    ref = F.linear(G.reference_input(a, b, act), w.float())
    return ((out.float() - ref).abs() / G.error_bound(a, b, w, ref, act)).max().item()


def _launcher(act, **tuning):
    def fn(a, b, w):
        with set_wrap_triton_enabled(False):  # the kernel itself, as the op's eager call launches it
            return G._launch(a, b, w, None, act, **tuning)
    return fn


def run(act: str, copy: float) -> tuple:
    sets = _make_sets()
    nbytes = N * K * 2
    glu = lambda a, b, w: torch.ops.kvrewrite.gemv_glu(a, b, w, None, act)  # noqa: E731
    unfused = lambda a, b, w: torch.ops.kvrewrite.gemv(G.activation(a, act) * b, w)  # noqa: E731
    ready = [(G.activation(a, act) * b, w) for a, b, w in sets]
    err = check(glu(*sets[0]), *sets[0], act)
    err_unfused = check(unfused(*sets[0]), *sets[0], act)
    res = dict(glu_us=per_call_us(glu, sets), unfused_us=per_call_us(unfused, sets),
               gemv_only_us=per_call_us(lambda x, w: torch.ops.kvrewrite.gemv(x, w), ready),
               error_over_bound=err, unfused_error_over_bound=err_unfused,
               launch=G.launch_config(N, K), copy_gbps=copy)
    res.update(glu_frac_of_copy=nbytes / res["glu_us"] / 1e3 / copy, unfused_over_glu=res["unfused_us"] / res["glu_us"],
               glu_over_gemv_only=res["glu_us"] / res["gemv_only_us"])
    res["variants"] = []
    for t in VARIANTS:
        fn = _launcher(act, **t)
        e = check(fn(*sets[0]), *sets[0], act)
        res["variants"].append(dict(tuning=t, us=per_call_us(fn, sets), error_over_bound=e))
    del ready
    return res, sets


def compiled_act_mul(act: str, sets) -> dict:
    """The unfused sequence with act * up compiled by Inductor (one elementwise kernel), for scale."""
    mul = torch.compile(lambda a, b: G.activation(a, act) * b, dynamic=False)
    fn = lambda a, b, w: torch.ops.kvrewrite.gemv(mul(a, b), w)  # noqa: E731
    return dict(inductor_act_mul_then_gemv_us=per_call_us(fn, sets))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gemv_glu.json", help="JSON list of {config, result, env}")
    args = parser.parse_args()
    env, copy = start_run()
    rows = []
    for act in ACTS:
        res, sets = run(act, copy)
        config = dict(name="down", N=N, K=K, dtype="bf16", act=act)
        rows.append(dict(config=config, result=res, env=env))
        print(f"down {N}x{K} bf16 {act:9s}: gemv_glu {res['glu_us']:6.1f} us ({res['glu_frac_of_copy']:.3f} of copy) | "
              f"act*mul+gemv {res['unfused_us']:6.1f} us | gemv alone {res['gemv_only_us']:6.1f} us | "
              f"unfused/glu {res['unfused_over_glu']:.3f} | error/bound {res['error_over_bound']:.2f}", flush=True)
        for v in res["variants"]:
            print(f"    gemv_glu {v['tuning']}: {v['us']:6.1f} us, error/bound {v['error_over_bound']:.2f}", flush=True)
        bad = [e for e in (res["error_over_bound"], res["unfused_error_over_bound"],
                           *(v["error_over_bound"] for v in res["variants"])) if e > 1]
        Path(args.out).write_text(json.dumps(rows, indent=1))
        if bad:
            raise SystemExit(f"kvrewrite::gemv_glu is wrong ({act}): error {max(bad):.2f}x the bound")
        res.update(compiled_act_mul(act, sets))
        print(f"    inductor act*mul + gemv: {res['inductor_act_mul_then_gemv_us']:6.1f} us", flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
