"""Prefill-chunk attention on the GPU: kvrewrite::clustered_attention at T > 1 vs SDPA on the same dense data.

Each case is the call one layer makes per chunk of a chunked prefill (Llama-3.1-8B layout: Hq 32, Hkv 8,
D 128, bf16): T queries over n_past slots of the compressed past (bias = log degree, positions spread
over the past) followed by the T fresh slots of the chunk (causal among themselves) and a few empty slots.
The chelsea cases are a 32k prompt at budget 0.2 (n_past = round(0.2 * (32768 + 320)) slots), chunk 256,
1024 and 2048; the full case is the middle of a 32k prompt with kvrewrite's `full` (16k of 33k slots used), the
clusterkv case the same with ClusterKV's 2048-query chunk (it keeps every token, so its prefill attends densely).

Baseline: SDPA (cuDNN and flash backends, enable_gqa) over the same queries and the n_past + T used keys,
without causality (every query sees every key): the same q·k work plus the masked half of the fresh block,
so a slightly generous baseline. TFLOP/s counts 4 * B * Hq * T * D * (n_past + (T + 1) / 2) for both.
Timing: triton.testing.do_bench, median. Every variant's output is checked against the fp32 reference
(max abs error reported; the run fails above 0.03 in bf16).

Run:   python -m kvrewrite.bench.attention_prefill --out prefill.json [--sweep] [--batch 8]
--sweep also times launch variants (the slot-loop kernel's default; the prefill kernel's block sizes, warps and
stages) and lists the fastest. --batch B runs each case for B sequences (the same layout in every row; the batch-8
prefill of issue 21 is `--batch 8 --cases "chelsea 32k chunk 2048"`); the error is checked on the first row (the
reference's [Hq, T, C] logits of every row would not fit). --ab times the default launch, the slot-loop kernel and the
prefill kernels on grids the slot loop splits, interleaved, twice each (clustered_attention.PREFILL_KERNEL and
PREFILL_SPLIT_GRIDS). --sketch also times kvrewrite::sketch_attention (ClusterGen) over the same slots with roles
0/1/2 drawn over the past (the fresh block exact): its decode kernel's slot loop against its prefill kernel
(sketch_attention.PREFILL_KERNEL), with and without FULL_TILES, then over ClusterGen's layout (a few exact slots, then
sketch slots of roles 1 and 2) the prefill kernel, each checked against the op's reference on row 0.
--ordered times the ordered prefill kernel's route (_ordered_prefill_kernels.py: rows whose slots hold their tokens in
position order, the clusterkv and full cases here; the chelsea cases' rows all go to the general kernel, so there it
times the route's cost): the default (the route, with TMA where it serves), the general kernel alone (ordered=False),
and the route's pointer loads (what a traced prefill takes) with their tiles and with 4 warps and 2 stages,
interleaved, twice. --graph times every launch inside a CUDA graph (GRAPH_CALLS calls a replay), without the host
work an eager launch adds (which a small batch's multi-launch op shows: the ordered route at batch 1).
"""
import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import _bench_ms, env_info
from kvrewrite.kernels import clustered_attention as ca

HQ, HKV, D = 32, 8, 128
CHELSEA_32K = round(0.2 * (32768 + 320))
CASES = {  # name: (T, n_past, C, first query position)
    "chelsea 32k chunk 256": (256, CHELSEA_32K, CHELSEA_32K + 256 + 64, 20000),
    "chelsea 32k chunk 1024": (1024, CHELSEA_32K, CHELSEA_32K + 1024 + 64, 20000),
    "chelsea 32k chunk 2048": (2048, CHELSEA_32K, CHELSEA_32K + 2048 + 64, 20000),
    "full 32k chunk 1024 (16k used)": (1024, 16384, 32768 + 1024 + 320, 16384),
    "clusterkv 32k chunk 2048 (16k used)": (2048, 16384, 32768 + 2048 + 320, 16384),
}
MAX_ERR_BF16 = 0.03
SKETCH_EXACT = 36  # --sketch's ClusterGen layout: the exact slots (sinks and window) before the sketch slots
# --graph: time GRAPH_CALLS calls captured in one CUDA graph (the median of GRAPH_REPLAYS replays, the first two
# dropped), not eager launches: an op of several launches at a small batch times its host work eagerly (stop 60:
# the ordered route at batch 1, 0.92-1.00 ms eagerly against 0.652 in a graph)
GRAPH = False
GRAPH_CALLS, GRAPH_REPLAYS = 5, 12


def _ms(f) -> float:
    """Milliseconds of one call of f: triton.testing.do_bench's median, or with GRAPH one call's share of a CUDA
    graph replay."""
    if not GRAPH:
        return _bench_ms(f)
    import statistics

    from kvrewrite.bench.cuda_graphs import capture, timed_replays_us, warm_up

    warm_up(f, 2)
    graph = capture(lambda: [f() for _ in range(GRAPH_CALLS)])
    return statistics.median(timed_replays_us(graph, GRAPH_REPLAYS, per=GRAPH_CALLS)[2:]) / 1e3


def make_inputs(T, n_past, C, start, seed=0, device="cuda", batch=1):
    g = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16
    q = torch.randn(batch, HQ, T, D, device=device, dtype=bf, generator=g)
    k = torch.randn(batch, HKV, C, D, device=device, dtype=bf, generator=g)
    v = torch.randn(batch, HKV, C, D, device=device, dtype=bf, generator=g)
    bias = torch.full((batch, HKV, C), float("-inf"), device=device)
    bias[..., :n_past] = torch.rand(batch, HKV, n_past, device=device, generator=g) * 3
    bias[..., n_past:n_past + T] = 0
    pos = torch.zeros(batch, HKV, C, dtype=torch.long, device=device)
    pos[..., :n_past] = torch.linspace(0, start - 1, n_past, device=device).round().long()
    pos[..., n_past:n_past + T] = torch.arange(start, start + T, device=device)
    return q, k, v, bias, pos, torch.arange(start, start + T, device=device)


def sdpa_ms(q, k, v, n_used) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    kd, vd = k[:, :, :n_used], v[:, :, :n_used]
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def f():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kd, vd, enable_gqa=True, scale=D ** -0.5)
        try:
            f()
            out[name] = _ms(f)
        except RuntimeError as e:  # the backend refuses the shape or is not built in
            out[name] = None
            out[f"{name}_error"] = str(e)[:200]
    return out


def variants() -> list:
    """The slot-loop kernel's default launch (prefill_kernel False), then the prefill kernel's tiles, warps and
    stages (kernels/_prefill_attention_kernels.py)."""
    grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
    return [dict(prefill_kernel=False)] + [dict(block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in grid]


def _timed(f, ref, flops, tuning) -> dict:
    """One launch variant's row: its median ms, TFLOP/s and largest error on row 0 against ref."""
    err = (f()[:1].float() - ref).abs().max().item()
    ms = _ms(f)
    return dict(tuning=tuning, ms=ms, tflops=flops / ms / 1e9, err=err)


def sketch_rows(args, n_past, scale, flops) -> list:
    """sketch_attention's launches over the case's slots with roles 0/1/2 drawn over the past: the decode kernel's
    slot loop, the prefill kernel with and without FULL_TILES (ms, TFLOP/s, the largest error against the op's
    reference on row 0); then, over ClusterGen's layout (the past's first SKETCH_EXACT slots exact, the rest sketch
    slots, roles 1 and 2), the prefill kernel."""
    from kvrewrite.kernels import sketch_attention as sa

    q, k, v, bias, pos, cp = args
    g = torch.Generator(device=q.device).manual_seed(1)
    role = torch.zeros(bias.shape, dtype=torch.int8, device=q.device)
    role[..., :n_past] = torch.randint(0, 3, (*bias.shape[:2], n_past), device=q.device, generator=g).to(torch.int8)
    layout = torch.zeros_like(role)
    exact = min(SKETCH_EXACT, n_past)
    layout[..., exact:n_past] = torch.randint(1, 3, (*bias.shape[:2], n_past - exact), device=q.device,
                                              generator=g).to(torch.int8)
    drawn = (dict(prefill_kernel=False), dict(prefill_kernel=True, full_tiles=True),
             dict(prefill_kernel=True, full_tiles=False))
    clustergen = (dict(prefill_kernel=True),)
    row0 = [x[:1] for x in (q, k, v, bias, pos)]
    rows = []
    for name, roles, tunings in (("drawn", role, drawn), ("clustergen", layout, clustergen)):
        ref = sa.reference_sketch_attention(*(x.float() for x in row0[:3]), *row0[3:], cp, roles[:1], scale)
        rows += [dict(_timed(lambda: sa._launch(q, k, v, bias, pos, cp, roles, scale, **tuning), ref, flops, tuning),
                      layout=name) for tuning in tunings]
    return rows


def run_case(name, sweep: bool, batch: int = 1, ab: bool = False, sketch: bool = False,
             ordered: bool = False) -> dict:
    T, n_past, C, start = CASES[name]
    args = make_inputs(T, n_past, C, start, batch=batch)
    scale = D ** -0.5
    ref = ca.reference_clustered_attention(*(a[:1] for a in args[:5]), args[5], scale, 0).float()  # row 0
    flops = 4.0 * batch * HQ * T * D * (n_past + (T + 1) / 2)
    res = dict(case=name, batch=batch, T=T, n_past=n_past, C=C, gflop=flops / 1e9,
               sdpa_ms=sdpa_ms(*args[:3], n_past + T))

    def timed(**tuning):
        return _timed(lambda: ca.triton_clustered_attention(*args, scale, 0, False, **tuning), ref, flops, tuning)

    res["kvrewrite"] = timed()
    if ab:  # the launches, interleaved: A B C A B C (a first case of a process has timed slow before)
        res["ab"] = [dict(timed(**t), round=r) for r in range(2)
                     for t in ({}, dict(prefill_kernel=False), dict(prefill_split_grids=True))]
    if ordered:  # A B C A B C
        res["ordered"] = [dict(timed(**t), round=r) for r in range(2)
                          for t in ({}, dict(ordered=False), dict(ordered=dict(tma=False)),
                                    dict(ordered=dict(tma=False, num_warps=4, num_stages=2)))]
    if sweep:
        res["sweep"] = []
        for tuning in variants():
            try:
                res["sweep"].append(timed(**tuning))
            except Exception as e:  # noqa: BLE001  (a variant that does not compile, e.g. out of shared memory)
                res["sweep"].append(dict(tuning=tuning, error=repr(e)[:200]))
    if sketch:
        res["sketch"] = sketch_rows(args, n_past, scale, flops)
    base = min(ms for ms in res["sdpa_ms"].values() if isinstance(ms, float))
    res["sdpa_over_kvrewrite"] = base / res["kvrewrite"]["ms"]
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="attention_prefill.json")
    p.add_argument("--sweep", action="store_true", help="also time launch variants")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--batch", type=int, default=1, help="sequences per call (the same layout in every row)")
    p.add_argument("--ab", action="store_true",
                   help="also time the default launch, the slot-loop kernel (prefill_kernel=False) and the prefill "
                        "kernels on split grids (prefill_split_grids=True), interleaved, twice")
    p.add_argument("--sketch", action="store_true",
                   help="also time sketch_attention (ClusterGen) over the same slots: its decode kernel's slot loop "
                        "against its prefill kernel, with and without FULL_TILES")
    p.add_argument("--ordered", action="store_true",
                   help="also time the general kernel alone and the ordered route's pointer loads against the "
                        "default (the route, TMA where it serves), interleaved, twice")
    p.add_argument("--graph", action="store_true",
                   help=f"time {GRAPH_CALLS} calls captured in a CUDA graph (no host time) instead of eager launches")
    args = p.parse_args(argv)
    global GRAPH
    GRAPH = args.graph
    rows = []
    doc = dict(env=env_info(), rows=rows, graph=args.graph)
    bad = []
    for name in args.cases.split(","):
        r = run_case(name, args.sweep, args.batch, args.ab, args.sketch, args.ordered)
        rows.append(r)
        kv = r["kvrewrite"]
        sd = r["sdpa_ms"]
        print(f"{name:32s} kvrewrite {kv['ms']:7.3f} ms {kv['tflops']:6.1f} TFLOP/s err {kv['err']:.1e} | "
              f"cudnn {sd.get('cudnn') or math.nan:7.3f} ms flash {sd.get('flash') or math.nan:7.3f} ms | "
              f"SDPA/kvrewrite {r['sdpa_over_kvrewrite']:.2f}", flush=True)
        for v in r.get("ab", []):
            print(f"    A/B round {v['round']}: {v['ms']:7.3f} ms {v['tflops']:6.1f} TFLOP/s  "
                  f"{v['tuning'] or 'default'}", flush=True)
        for v in r.get("ordered", []):
            print(f"    ordered round {v['round']}: {v['ms']:7.3f} ms {v['tflops']:6.1f} TFLOP/s err {v['err']:.1e}  "
                  f"{v['tuning'] or 'default'}", flush=True)
        for v in r.get("sketch", []):
            print(f"    sketch ({v['layout']} roles) {v['ms']:7.3f} ms {v['tflops']:6.1f} TFLOP/s err {v['err']:.1e}  "
                  f"{v['tuning']}", flush=True)
        for v in sorted((v for v in r.get("sweep", []) if "ms" in v), key=lambda v: v["ms"])[:5]:
            print(f"    {v['ms']:7.3f} ms {v['tflops']:6.1f} TFLOP/s err {v['err']:.1e}  {v['tuning']}", flush=True)
        bad += [(name, v) for v in [kv, *r.get("ab", []), *r.get("ordered", []), *r.get("sweep", []),
                                    *r.get("sketch", [])]
                if v.get("err", 0) > MAX_ERR_BF16]
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    if bad:
        raise SystemExit(f"outputs off the fp32 reference by more than {MAX_ERR_BF16}: {bad[:3]}")


if __name__ == "__main__":
    main()
