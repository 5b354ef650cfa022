"""The whole kvrewrite::ems_compress on CUDA (the stages' CUDA paths, with ems_redundancy's and ems_merge's Triton
kernels switched on) against the CPU reference, and against the float64 naive model on small rows; three
successive compressions.

Run as a script (`python -m tests.kernels.test_ems_compress_gpu`) it prints the timings of ems_redundancy,
ems_merge and the whole ems_compress (kernels vs references, same GPU) on a Llama-3.1-8B-shaped 32k state at
budget 0.2 (C 6866, R 27464, Hkv 8, D 128, bf16), B = 1 and 8, for a prefill-chunk compression (fill = C) and a
decode-time one (interval 32: fill = Bt + 32).
"""
import itertools
import json
import math
import sys

import pytest
import torch

from kvrewrite.kernels import _ems_merge_kernels as mk
from kvrewrite.kernels import ems_merge, ems_redundancy
from kvrewrite.kernels.ems_compress import reference_ems_compress
from tests.kernels import ems_naive as N
from tests.kernels.test_ems_merge_gpu import EXACT, STATE, make_state

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(mk.triton is None, reason="needs Triton"),
]
OPTS = ("l_win", "pool", "gamma", "tau")


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setattr(ems_redundancy, "KERNELS_CHECKED_ON_GPU", True)
    monkeypatch.setattr(ems_merge, "KERNELS_CHECKED_ON_GPU", True)


def run_op(s, **opts):
    torch.ops.kvrewrite.ems_compress(*(s[f] for f in STATE), **opts)


def compare(got, want, rtol):
    got = {f: t.cpu() for f, t in got.items()}
    for f in EXACT:
        assert torch.equal(got[f], want[f]), f
    torch.testing.assert_close(got["key_scale"], want["key_scale"], rtol=1e-6, atol=1e-6)
    kept = torch.arange(got["keys"].shape[2]) < got["fill"][..., None]
    for f in ("keys", "values", "raw_keys"):
        if got[f].shape[2]:
            torch.testing.assert_close(got[f][kept].double(), want[f][kept].double(), rtol=rtol, atol=rtol, msg=f)


@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("gamma,tau", [(4.0, 0.6), (1.0, 0.6), (math.inf, 0.0), (1.25, 1.0), (4.0, 0.0)])
def test_whole_op_cuda_vs_cpu_reference(kernels_on, pos, gamma, tau):
    """fp32 state (the CPU reference's own dtype), 3 compressions of the due rows (rows not due stay)."""
    s = make_state(2, 2, 257, 700, 64, [[257, 240], [200, 250]], [[690, 600], [500, 700]], pos=pos, pads=[0, 9],
                   seed=11, noise=0.3, device="cpu")
    s["budget"] = torch.tensor([100, 230])
    opts = dict(l_win=4, pool=7, gamma=gamma, tau=tau)
    for rnd in range(3):
        gpu = {f: t.cuda() for f, t in s.items()}
        run_op(gpu, **opts)
        reference_ems_compress(*(s[f] for f in STATE), **opts)
        compare(gpu, s, 1e-6)
        N.check_invariants(s, l_win=4)
        for b, h in itertools.product(range(2), range(2)):  # new single-slot entries: due again
            f, sf = int(s["fill"][b, h]), int(s["slot_fill"][b, h])
            n = min(257 - f, 700 - sf, 150)
            t0 = int(s["token_pos"][b, h].max()) + 1
            for name in ("keys", "values", "raw_keys"):
                if s[name].shape[2]:
                    s[name][b, h, f:f + n] = torch.randn(n, 64)
            s["bias"][b, h, f:f + n] = 0.0
            s["entry_start"][b, h, f:f + n] = torch.arange(sf, sf + n, dtype=torch.int32)
            s["lut"][b, h, sf:sf + n] = torch.arange(f, f + n, dtype=torch.int32)
            s["token_pos"][b, h, sf:sf + n] = torch.arange(t0, t0 + n, dtype=torch.int32)
            s["slot_pos"][b, h, f:f + n] = torch.arange(t0, t0 + n)
            s["slot_order"][b, h, sf:sf + n] = torch.arange(sf, sf + n, dtype=torch.int32)
            s["s_loc_cur"][b, h, :sf + n] = torch.rand(sf + n)
            s["fill"][b, h] += n
            s["slot_fill"][b, h] += n


@pytest.mark.parametrize("pos", ["without", "with"])
def test_whole_op_matches_naive_model(kernels_on, pos):
    from tests.kernels.test_ems_merge import grow, rescore
    rows = N.random_rows(2, 2, 14, 8, pads=(0, 3), seed=1, dup=0.3)
    s = N.to_state(rows, 27, 45, pos=pos, budget=(7, 8))
    for rnd in range(3):
        gpu = {f: t.cuda() for f, t in s.items()}
        run_op(gpu, l_win=2, pool=3, gamma=2.0, tau=0.2)
        s = {f: t.cpu() for f, t in gpu.items()}
        rows = [[N.compress(r, 7, 2, 3, 2.0, 0.2, pos)[0] for r in rb] for rb in rows]
        N.check_invariants(s, l_win=2, r_max=N.counts(7, 2, 2.0)[2], bt=7)
        N.assert_rows_close(N.from_state(s), rows, rtol=1e-5)
        grow(s, rows, 6, seed=10 + rnd, pos0=100 + 10 * rnd)
        rescore(s, rows, seed=20 + rnd)


def test_whole_op_cuda_graph(kernels_on):
    s = make_state(1, 2, 300, 700, 64, [[300, 290]], [[650, 600]], seed=5)
    s["budget"] = torch.tensor([150, 280], device="cuda")
    opts = dict(l_win=4, pool=7, gamma=4.0, tau=0.6)
    work = {f: t.clone() for f, t in s.items()}
    run_op(work, **opts)
    for f in STATE:
        work[f].copy_(s[f])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_op(work, **opts)
    for f in STATE:
        work[f].copy_(s[f])
    graph.replay()
    cpu = {f: t.cpu() for f, t in s.items()}
    reference_ems_compress(*(cpu[f] for f in STATE), **opts)
    compare(work, cpu, 1e-6)


# -- timing (script) ---------------------------------------------------------------------------------
def _time(fn, restore, n=10):
    restore()
    fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(n):
        restore()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        total += a.elapsed_time(b)
    return 1000 * total / n


def bench():
    from kvrewrite.kernels.ems_merge import reference_ems_merge
    from kvrewrite.kernels.ems_partition import reference_ems_partition
    from kvrewrite.kernels.ems_score import reference_ems_score
    H, C, R, D, bt = 8, 6866, 27464, 128, 6579
    out = []
    for B, case in itertools.product((1, 8), ("prefill", "decode")):
        fill = C if case == "prefill" else bt + 32
        slots = min(R, 26316 + (fill - bt))
        s = make_state(B, H, C, R, D, [[fill] * H] * B, [[slots] * H] * B, dtype=torch.bfloat16, l_win=32,
                       noise=0.3, seed=1)
        s["budget"] = torch.tensor([bt, bt + 32], device="cuda")
        saved = {f: t.clone() for f, t in s.items()}

        def restore():
            for f in STATE:
                s[f].copy_(saved[f])
        due = s["fill"] >= s["budget"][1]
        g, gp = reference_ems_score(s["bias"], s["fill"], s["lut"], s["slot_order"], s["s_glo"], s["s_loc_past"],
                                    s["s_loc_cur"], s["slot_fill"], due, 32, 7)
        cls = reference_ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, s["budget"], 32, 4.0)
        rargs = (s["keys"], s["values"], s["raw_keys"], cls, due, 0.6)
        margs = lambda dest: (*(s[f] for f in STATE), g, gp, cls, dest, due, 4.0)  # noqa: E731
        dest = ems_redundancy.reference_ems_redundancy(*rargs)
        row = dict(B=B, case=case, fill=fill, slots=slots, tbm=int((cls == 3).sum()) // (B * H),
                   merging=int(((cls == 3) & (dest >= 0)).sum()) // (B * H))
        row["redundancy_ref_us"] = _time(lambda: ems_redundancy.reference_ems_redundancy(*rargs), restore)
        row["redundancy_triton_us"] = _time(lambda: ems_redundancy.triton_ems_redundancy(*rargs), restore)
        row["merge_ref_us"] = _time(lambda: reference_ems_merge(*margs(dest)), restore)
        row["merge_triton_us"] = _time(lambda: mk.triton_ems_merge(*margs(dest)), restore)
        opts = dict(l_win=32, pool=7, gamma=4.0, tau=0.6)
        row["compress_ref_us"] = _time(lambda: reference_ems_compress(*(s[f] for f in STATE), **opts), restore)
        ems_redundancy.KERNELS_CHECKED_ON_GPU = ems_merge.KERNELS_CHECKED_ON_GPU = True
        row["compress_cuda_path_us"] = _time(lambda: run_op(s, **opts), restore)
        ems_redundancy.KERNELS_CHECKED_ON_GPU = ems_merge.KERNELS_CHECKED_ON_GPU = False
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        from tests.kernels.test_ems_redundancy_gpu import KNOBS
        sweep = {}
        for kn in KNOBS[:5]:
            sweep["%d/%d/%d" % (kn["block_t"], kn["block_n"], kn["num_warps"])] = round(
                _time(lambda: ems_redundancy.triton_ems_redundancy(*rargs, **kn), restore), 1)
        print(case, B, "redundancy by block_t/block_n/warps (us):", sweep, flush=True)
        row["redundancy_sweep_us"] = sweep
        if B == 1:  # per-launch breakdown of the kernels (one call each)
            from torch.profiler import ProfilerActivity, profile
            restore()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                ems_redundancy.triton_ems_redundancy(*rargs)
                mk.triton_ems_merge(*margs(dest))
                torch.cuda.synchronize()
            ev = [(e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
            print(case, "kernels (us):", {k[:40]: round(t, 1) for k, t in sorted(ev, key=lambda x: -x[1])[:14]},
                  flush=True)
        out.append(row)
    return out


if __name__ == "__main__":
    res = bench()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(res, fh, indent=1)
