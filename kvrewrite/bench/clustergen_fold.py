"""Timing of kvrewrite::clustergen_fold on the GPU: the Triton kernels (kvrewrite/kernels/_clustergen_fold_kernels.py)
against the op's tensor reference on CUDA (the CUDA path before the kernels), microseconds per call.

Shape: Llama-3.1-8B, one layer (Hkv 8, D 128, bf16), 32k context at budget 0.2: B_t = 6554 slots, n_sink 4, window 32,
t 8, value_share 0.5, cluster_target 0.5, interval g 32, prefill chunk 2048: capacity C = B_t + g - 1 + 2048 = 8633,
M_max = 541 (S = 6518, s = 3259, M = 407, M_target = 204). Keys and values random normal (bf16). The state is built
by the kernels themselves: 16 prefill chunks of 2048 tokens, each followed by its fold (the first calibrates δ).
Cases, at batch 1 and 8:
- decode: the 32k state plus g = 32 new tokens (fill 68 -> 36, |F| = 32: the call a decode step pays every g tokens);
- prefill_first: the first chunk's fold (|F| = 2012: δ calibration over 2012 keys with 204 centres, every key
  resolved sequentially against the clusters it opens);
- prefill_later: a later chunk's fold (|F| = 2048, the M clusters open before it: the parallel distance launch).
Each timed call starts from the same state (copied in untimed), CUDA events around the call alone; the kernels eager
(launches included) and replayed from a CUDA graph; median of the reps. The reference (static loops: ~5 s a call,
whatever the case): one call per case at the first batch size, the decode case only at the others.

Run:  python -m kvrewrite.bench.clustergen_fold --out docs/bench/clustergen_fold_h100.json
--calib-sweep also times the δ calibration's launch variants (chunk size, warps) on the first chunk's fold;
--dist-sweep the distance launch's (tiles, keys per program, warps) on a later chunk's fold and a decode step's.
--reservoir-sweep the reservoir launch's knobs (slots per program, warps, form: RESERVOIR_VARIANTS) on the same two.
--form-sweep the launches' other forms (FORM_VARIANTS: the direct form, DIRECT, with no step per opening, no joiner
index and the distances on CUDA cores; each of the three defaults alone over it; the resolve's 128-key blocks) on every
case, each checked against the default's state (the fields that differ listed: the dot form rounds otherwise, so a
near-tie may go the other way on these random keys).
"""
import argparse
import json
import statistics

import torch

from kvrewrite.bench.attention import env_info
from kvrewrite.kernels import _clustergen_fold_kernels as kk
from kvrewrite.kernels.clustergen_fold import reference_clustergen_fold

FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "budget", "role", "rep", "count", "n_clusters", "mu", "delta",
          "n_seen", "n_forced")
H, D, CTX, BUDGET, N_SINK, WINDOW, T, G, CHUNK = 8, 128, 32768, 0.2, 4, 32, 8, 32, 2048
KW = dict(n_sink=N_SINK, window=WINDOW, t=T, value_share=0.5, cluster_target=0.5, seed=0, layer=0)
STEP_MS = 6.1  # a plain decode step at 32k, B = 1, 32 layers (the method's bandwidth-floor reference)


def empty(B, Bt, C, Mmax, H=H, D=D):
    """A reset state on the GPU (bf16 keys and values): B rows of H KV heads, capacity C, budget Bt, M_max clusters."""
    z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt, device="cuda")  # noqa: E731
    return dict(keys=z(B, H, C, D, dt=torch.bfloat16), values=z(B, H, C, D, dt=torch.bfloat16),
                bias=torch.full((B, H, C), float("-inf"), device="cuda"), slot_pos=z(B, H, C), fill=z(B, H),
                budget=torch.tensor([Bt, N_SINK + WINDOW + G], device="cuda"), role=z(B, H, C, dt=torch.int8),
                rep=z(B, H, Mmax, D, dt=torch.bfloat16), count=z(B, H, Mmax, dt=torch.int32), n_clusters=z(B, H),
                mu=torch.zeros(B, H, device="cuda"), delta=torch.full((B, H), -1.0, device="cuda"), n_seen=z(B, H),
                n_forced=z(B, H))


def append(st, n, pos0, g):
    """n new random tokens at every row's fill (the rows share one fill here)."""
    B = st["keys"].shape[0]
    f = int(st["fill"][0, 0])
    st["keys"][:, :, f:f + n] = torch.randn(B, H, n, D, generator=g, device="cuda").bfloat16()
    st["values"][:, :, f:f + n] = torch.randn(B, H, n, D, generator=g, device="cuda").bfloat16()
    st["slot_pos"][:, :, f:f + n] = torch.arange(pos0, pos0 + n, device="cuda")
    st["bias"][:, :, f:f + n] = 0.0
    st["fill"] += n


def fold(st, **knobs):
    kk.triton_clustergen_fold(*(st[f] for f in FIELDS), **KW, **knobs)


def states(B):
    """(decode, prefill_first, prefill_later) start states."""
    Bt = round(BUDGET * CTX)
    C = Bt + G - 1 + CHUNK
    Mmax = -(-(C // 2) // T) + 1
    g = torch.Generator(device="cuda").manual_seed(B)
    st = empty(B, Bt, C, Mmax)
    append(st, CHUNK, 0, g)
    first = {f: x.clone() for f, x in st.items()}
    later = None
    for c in range(CTX // CHUNK):
        if c:
            append(st, CHUNK, c * CHUNK, g)
        if c == CTX // CHUNK - 1:
            later = {f: x.clone() for f, x in st.items()}
        fold(st)
    append(st, G, CTX, g)
    return dict(decode=st, prefill_first=first, prefill_later=later), (Bt, C, Mmax)


def time_kernel(s0, reps, graph, **knobs):
    s = {f: x.clone() for f, x in s0.items()}
    if graph:
        fold(s, **knobs)  # compiled
        torch.cuda.synchronize()
        for f in FIELDS:
            s[f].copy_(s0[f])
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            fold(s, **knobs)
        call = gr.replay
    else:
        def call():
            fold(s, **knobs)
    out = []
    for _ in range(reps + 2):
        for f in FIELDS:
            s[f].copy_(s0[f])
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)  # the host runs ahead: launch overhead shows only where it is on the GPU
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out[2:]), s


def profile_launches(s0, **knobs):
    """{kernel name: us} of one eager call (torch.profiler, CUDA activity), after a warm call."""
    from torch.profiler import ProfilerActivity, profile

    s = {f: x.clone() for f, x in s0.items()}
    fold(s, **knobs)
    for f in FIELDS:
        s[f].copy_(s0[f])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fold(s, **knobs)
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total, 1) for e in prof.key_averages() if e.device_time_total > 0}


# (points per chunk, warps) of the δ calibration's launch; the first is the default (CAL_CH, CAL_WARPS)
CALIB_VARIANTS = [(kk.CAL_CH, kk.CAL_WARPS), (64, 8), (128, 8), (512, 8), (256, 16), (512, 16), (128, 4)]
# (keys per tile, clusters per block, keys per program, warps) of the distance launch (launch 3); the first is the
# default (DIST_BF, DIST_BM, DIST_FO, 4 warps)
DIST_VARIANTS = [(kk.DIST_BF, kk.DIST_BM, kk.DIST_FO, 4), (32, 32, 1024, 4), (8, 32, 1024, 4), (16, 64, 1024, 4),
                 (16, 16, 1024, 4), (16, 32, 512, 4), (16, 32, 256, 4), (32, 64, 1024, 8), (16, 32, 1024, 8),
                 (64, 32, 1024, 8)]


# the reservoir launch's (launch 5) knobs; the first is the default (SK_BS, SK_WARPS, SK_SPLIT)
RESERVOIR_VARIANTS = [{}, dict(sk_split=not kk.SK_SPLIT), dict(sk_bs=16), dict(sk_bs=64), dict(sk_bs=16, sk_warps=2),
                      dict(sk_bs=64, sk_warps=8), dict(sk_bs=128, sk_warps=8)]
# the fold before stop 62's defaults (DIST_DOT, RESOLVE_EVENTS and JOINER_INDEX on)
DIRECT = dict(dist_dot=False, resolve_events=False, joiner_index=False)
FORM_VARIANTS = [{}, DIRECT, dict(DIRECT, resolve_events=True), dict(DIRECT, joiner_index=True),
                 dict(DIRECT, dist_dot=True), dict(res_b=128), dict(dist_dot=False), dict(dist_bf=32)]


def knob_sweep(s0, want, variants: list, label: str) -> list:
    """One case's whole fold replayed from a CUDA graph with each launch-knob dict of variants, interleaved over two
    rounds; each variant's state checked against the default's (want) field for field: --calib-sweep (the first
    chunk's fold, its δ calibration the bulk), --dist-sweep and --reservoir-sweep (a later chunk's and a decode
    step's), --form-sweep (every case)."""
    out = []
    for r in range(2):
        for knobs in variants:
            try:
                us, got = time_kernel(s0, 10, graph=True, **knobs)
            except Exception as e:  # noqa: BLE001  (a launch that does not compile, e.g. out of registers)
                out.append(dict(knobs, round=r, error=repr(e)[:200]))
                continue
            differ = [f for f in FIELDS if not torch.equal(got[f], want[f])]
            out.append(dict(knobs, round=r, graph_us=us, same_state=not differ, fields_differ=differ))
            print(f"    {label} {knobs} round {r}: {us:9.1f} us, same state {not differ} {differ or ''}", flush=True)
    return out


def time_reference(s0):
    best = float("inf")
    for _ in range(1):
        s = {f: x.clone() for f, x in s0.items()}
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        reference_clustergen_fold(*(s[f] for f in FIELDS), **KW)
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3)
    return best, s


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="clustergen_fold.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also time the resolve launch's warps 1, 2, 4, 8")
    parser.add_argument("--calib-sweep", action="store_true",
                        help="also time the δ calibration's launches (CALIB_VARIANTS) on prefill_first at every "
                             "batch, each checked equal to the default's state")
    parser.add_argument("--form-sweep", action="store_true",
                        help="also time the launches' other forms (FORM_VARIANTS) on every case at every batch, each "
                             "checked against the default's state")
    parser.add_argument("--reservoir-sweep", action="store_true",
                        help="also time the reservoir launch's variants (RESERVOIR_VARIANTS) on prefill_later and "
                             "decode at every batch, each checked against the default's state")
    parser.add_argument("--dist-sweep", action="store_true",
                        help="also time the distance launch's variants (DIST_VARIANTS) on prefill_later and decode at "
                             "every batch, each checked against the default's state")
    args = parser.parse_args()
    env = env_info()
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}", flush=True)
    rows = []
    for B in args.batches:
        cases, (Bt, C, Mmax) = states(B)
        for name, s0 in cases.items():
            eager, got = time_kernel(s0, args.reps, graph=False)
            graph, _ = time_kernel(s0, args.reps, graph=True)
            row = dict(case=name, batch=B, budget=Bt, capacity=C, m_max=Mmax,
                       folded=int(s0["fill"][0, 0]) - N_SINK - WINDOW, kernel_us=eager, kernel_graph_us=graph,
                       n_clusters_after=int(got["n_clusters"].float().mean()),
                       n_forced_after=int(got["n_forced"].sum()))
            if not args.no_reference and (B == args.batches[0] or name == "decode"):
                ref, want = time_reference(s0)
                row["reference_us"] = ref
                row["speedup"] = ref / graph
                row["same_fill_and_clusters"] = bool(torch.equal(want["fill"], got["fill"])
                                                     and torch.equal(want["n_clusters"], got["n_clusters"]))
            if name == "decode":  # per generated token over 32 layers, amortised over the interval
                row["per_token_32_layers_us"] = graph * 32 / G
                row["fraction_of_6p1ms_step"] = graph * 32 / G / (STEP_MS * 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            row["launch_us"] = profile_launches(s0)
            print(name, "launches", row["launch_us"], flush=True)
            if args.calib_sweep and name == "prefill_first":
                row["calib_sweep"] = knob_sweep(s0, got, [dict(cal_ch=ch, cal_warps=w) for ch, w in CALIB_VARIANTS],
                                                "calib")
            if args.dist_sweep and name != "prefill_first":
                row["dist_sweep"] = knob_sweep(s0, got, [dict(dist_bf=bf, dist_bm=bm, dist_fo=fo, dist_warps=w)
                                                         for bf, bm, fo, w in DIST_VARIANTS], "dist")
            if args.reservoir_sweep and name != "prefill_first":
                row["reservoir_sweep"] = knob_sweep(s0, got, RESERVOIR_VARIANTS, "reservoir")
            if args.form_sweep:
                row["form_sweep"] = knob_sweep(s0, got, FORM_VARIANTS, "form")
                row["form_launch_us"] = profile_launches(s0, **DIRECT)
                print(name, "launches, the direct form", row["form_launch_us"], flush=True)
            if args.sweep and B == args.batches[0] and name != "prefill_later":  # the resolve launch's warps
                row["graph_us_by_resolve_warps"] = {w: time_kernel(s0, 5, graph=True, num_warps_seq=w)[0]
                                                    for w in (1, 2, 4, 8)}
                print(name, "graph us by resolve warps", row["graph_us_by_resolve_warps"], flush=True)
    print(f"\n{'case':<14}{'B':>3}{'|F|':>6}{'kernel us':>11}{'graph us':>10}{'reference us':>14}{'x':>8}")
    for r in rows:
        print(f"{r['case']:<14}{r['batch']:>3}{r['folded']:>6}{r['kernel_us']:>11.1f}{r['kernel_graph_us']:>10.1f}"
              f"{r.get('reference_us', float('nan')):>14.0f}{r.get('speedup', float('nan')):>8.0f}")
    with open(args.out, "w") as f:
        json.dump(dict(env=env, shape=dict(Hkv=H, D=D, dtype="bfloat16", ctx=CTX, budget=BUDGET, **KW, interval=G,
                                           chunk=CHUNK), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
