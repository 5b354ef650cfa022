"""clustergen_fold's Triton kernels on the CPU, through Triton's interpreter, against the op's reference
(kvrewrite/kernels/clustergen_fold.py, itself checked against the float64 naive models in test_clustergen_fold.py);
and the Triton mix32 bit for bit against the Python one.

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_clustergen_fold_triton.py`
(with Triton installed; skipped otherwise). fp32 only (the 3.6 interpreter's 16-bit arithmetic is not the GPU's).
Keys and values are small integers, so every fp32 distance, norm and prefix sum is exact in any summation order:
every discrete decision (calibration centres, leaders, joins, forced keys, samples, packing) must match exactly.
Small knobs (4-cluster distance blocks, 8-key resolve blocks, 4-leader tiles, 8-point calibration chunks) make tiny
shapes cross every block boundary.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kvrewrite.kernels._clustergen_fold_kernels import triton_clustergen_fold  # noqa: E402
from kvrewrite.kernels._hash import mix32_triton  # noqa: E402
from kvrewrite.kernels.clustergen_fold import reference_clustergen_fold  # noqa: E402
from kvrewrite.kernels.kmeans_cluster import mix32  # noqa: E402

DIRECT = dict(dist_dot=False, resolve_events=False, joiner_index=False)  # the fold's forms before stop 62's defaults
SMALL = dict(DIRECT, dist_bm=4, dist_fo=16, res_b=8, res_bl=4, cal_ch=8)  # every block boundary crossed at these sizes
FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "budget", "role", "rep", "count", "n_clusters", "mu", "delta",
          "n_seen", "n_forced")


@triton.jit
def _mix_kernel(X, Y, n, BS: tl.constexpr):
    i = tl.arange(0, BS)
    m = i < n
    tl.store(Y + i, mix32_triton(tl.load(X + i, mask=m).to(tl.uint32)).to(tl.int64), mask=m)


def test_mix32_triton_equals_mix32():
    g = torch.Generator().manual_seed(0)
    xs = torch.cat([torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF]),
                    torch.randint(0, 2**32, (58,), generator=g)])
    y = torch.zeros_like(xs)
    _mix_kernel[(1,)](xs, y, len(xs), BS=64)
    assert y.tolist() == [mix32(int(x)) for x in xs]


def new_state(B, H, C, D, Mmax, Bt):
    z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt)  # noqa: E731
    return dict(keys=z(B, H, C, D, dt=torch.float32), values=z(B, H, C, D, dt=torch.float32),
                bias=torch.full((B, H, C), float("-inf")), slot_pos=z(B, H, C), fill=z(B, H),
                budget=torch.tensor([Bt, 0]), role=z(B, H, C, dt=torch.int8), rep=z(B, H, Mmax, D, dt=torch.float32),
                count=z(B, H, Mmax, dt=torch.int32), n_clusters=z(B, H), mu=torch.zeros(B, H),
                delta=torch.full((B, H), -1.0), n_seen=z(B, H), n_forced=z(B, H))


def append(st, b, h, k, v, pos, pad=False):
    f = int(st["fill"][b, h])
    st["keys"][b, h, f], st["values"][b, h, f], st["slot_pos"][b, h, f] = k, v, pos
    st["bias"][b, h, f] = float("-inf") if pad else 0.0
    st["fill"][b, h] = f + 1


def tokens(n, D, g, groups):
    """Integer keys (around `groups` integer centres, or uniform) and integer values (every 7th zero)."""
    if groups:
        c = torch.randint(-12, 13, (groups, D), generator=g).float()
        k = c[torch.randint(0, groups, (n,), generator=g)] + torch.randint(-1, 2, (n, D), generator=g).float()
    else:
        k = torch.randint(-3, 4, (n, D), generator=g).float()
    v = torch.randint(-2, 3, (n, D), generator=g).float()
    v[::7] = 0
    return k, v


def same(a, b):
    """Equal element for element, NaN (the padding keys) equal to NaN."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all()
                                                              if a.is_floating_point() else torch.equal(a, b))


def check(got, want, orig, threshold):
    due = orig["fill"] >= threshold
    assert torch.equal(got["budget"], orig["budget"])
    for f in FIELDS[:5] + FIELDS[6:]:
        assert same(got[f][~due], orig[f][~due]), f"{f} changed in a row not due"
    for f in FIELDS:
        if f in ("bias", "mu", "delta"):
            continue
        assert same(got[f], want[f]), f"{f}: got {got[f][due]}, want {want[f][due]}"
    assert torch.equal(torch.isinf(got["bias"]), torch.isinf(want["bias"])), "bias -inf pattern"
    fin = ~torch.isinf(want["bias"])
    torch.testing.assert_close(got["bias"][fin], want["bias"][fin], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["mu"], want["mu"], atol=0, rtol=0)  # exact: integer norms
    torch.testing.assert_close(got["delta"], want["delta"], atol=0, rtol=1e-6)


def fold_both(st, kw, threshold, **knobs):
    st["budget"][1] = threshold
    orig = {f: x.clone() for f, x in st.items()}
    got = {f: x.clone() for f, x in st.items()}
    triton_clustergen_fold(*(got[f] for f in FIELDS), **kw, **{**SMALL, **knobs})
    reference_clustergen_fold(*(st[f] for f in FIELDS), **kw)
    check(got, st, orig, threshold)


CASES = {  # name: (n_sink, window, t, value_share, cluster_target, Bt, groups, prompt lengths per row, g)
    "groups": (2, 3, 2, 0.5, 0.5, 70, 5, [36, 30, 33, 12], 3),   # row 3 below the threshold at the first fold
    "uniform-overflow": (1, 2, 3, 0.4, 0.9, 34, 0, [40, 37, 20, 39], 2),
    "no-sink-no-window": (0, 0, 1, 0.3, 0.5, 30, 3, [30, 27, 29, 28], 1),
    "many-clusters": (1, 2, 1, 0.3, 0.9, 80, 0, [96, 90, 93, 75], 3),  # ~50 open: 16-cluster blocks cross, ties
}


DOT = dict(dist_dot=True, dist_bf=16, dist_bm=16, dist_fo=32, res_b=16, res_bl=16)  # the dot form's smallest tiles
DEFAULTS = dict(dist_dot=None, resolve_events=None, joiner_index=None, dist_bf=16, dist_bm=16, dist_fo=32, res_b=16,
                res_bl=16)  # the module's forms (None: DIST_DOT, RESOLVE_EVENTS, JOINER_INDEX) at the smallest tiles


@pytest.mark.parametrize("knobs", [{}, dict(cal_ch=2, cal_warps=4, dist_bf=4, dist_warps=2), dict(resolve_events=True),
                                   DOT, dict(joiner_index=True), dict(joiner_index=True, resolve_events=True, res_b=4),
                                   DEFAULTS, dict(DEFAULTS, sk_bs=8, sk_warps=2), dict(DEFAULTS, sk_split=False)],
                         ids=["small", "smaller", "events", "dot", "index", "index-events", "defaults",
                              "defaults-reservoir-8", "defaults-reservoir-loop"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_prefill_then_decode_folds(name, knobs):
    """Prompt folds then decode folds, every output against the reference; the launch knobs change no decision (the
    calibration's chunks: each lane keeps its first farthest point, the lanes' first wins; the distance tiles: each
    key's first nearest cluster), nor do the resolve's steps per opening (RESOLVE_EVENTS), the reservoirs' joiner
    index (JOINER_INDEX), slots per program and form (SK_SPLIT), or the distances' dot form (DIST_DOT: exact here, the keys are small
    integers)."""
    n_sink, window, t, vs, ct, Bt, groups, lens, g = CASES[name]
    kw = dict(n_sink=n_sink, window=window, t=t, value_share=vs, cluster_target=ct, seed=7, layer=3)
    gen = torch.Generator().manual_seed(len(name))
    B, H, D = 2, 2, 5
    S = Bt - n_sink - window
    C = max(lens) + 2 + S
    Mmax = (S - round(vs * S)) // t + 2
    st = new_state(B, H, C, D, Mmax, Bt)
    keys, vals = tokens(max(lens) + 8 * g, D, gen, groups)
    for r, (b, h) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        if b == 1:  # left padding of batch row 1
            append(st, b, h, float("nan"), 0.0, 0, pad=True)
            append(st, b, h, float("nan"), 0.0, 0, pad=True)
        for n in range(lens[r]):
            append(st, b, h, keys[(n + 5 * r) % len(keys)], vals[(n + 5 * r) % len(keys)], n)
    fold_both(st, kw, 30, **knobs)
    assert int(st["n_clusters"].max()) >= 2
    for step in range(2):
        for b in range(B):
            for h in range(H):
                for n in range(g):
                    i = max(lens) + step * g + n
                    append(st, b, h, keys[i] + 40 * (step == 0), vals[i], i)  # far keys, folded next step
        fold_both(st, kw, n_sink + window + g, **knobs)
    if name == "uniform-overflow":
        assert int(st["n_forced"].max()) > 0


# 7 keys (2-D, padded to D 5) whose greedy 3-center radius depends on the tie rule (found by brute force over small
# integer sets): in the second pass keys 2 and 6 tie as the farthest; the first gives r^2 = 9, the last 10. Same
# parity, so at 2 points a chunk they share a lane (chunks 1 and 3); at 8 they sit in two lanes of one chunk.
TIE_KEYS = [(4, 3), (4, 0), (0, -1), (-4, -3), (-3, -2), (-1, 0), (2, -1)]


@pytest.mark.parametrize("knobs", [dict(cal_ch=8), dict(cal_ch=2)], ids=["lanes", "chunks"])
def test_calibration_takes_the_first_farthest_point(knobs):
    """δ from the greedy k-center with ties to the first farthest point, as the reference: across lanes of a chunk
    (8 points a chunk: the tied points in two lanes) and across chunks of one lane (2 points a chunk)."""
    kw = dict(n_sink=0, window=0, t=1, value_share=0.5, cluster_target=0.5, seed=7, layer=3)  # M_target 3
    B, H, D, Bt = 1, 1, 5, 12
    st = new_state(B, H, len(TIE_KEYS) + 2 + Bt, D, 8, Bt)
    for n, (x, y) in enumerate(TIE_KEYS):
        append(st, 0, 0, torch.tensor([x, y, 0, 0, 0.0]), torch.ones(D), n)
    fold_both(st, kw, 0, **knobs)
    assert float(st["delta"]) == pytest.approx(3 * 1.001)  # r = 3: the first farthest point's radius (last: sqrt 10)


@pytest.mark.parametrize("knobs", [dict(dist_bm=16), DOT], ids=["direct", "dot"])
def test_nearest_cluster_ties_go_to_the_lower_index_across_blocks(knobs):
    """25 open clusters, 16 a distance block: representatives 3 and 20 (two blocks) equal, the one folded key nearest
    to both: it joins cluster 3, as the reference's first argmin (the dot form's running minimum over the blocks keeps
    the first)."""
    kw = dict(n_sink=0, window=0, t=1, value_share=0.3, cluster_target=0.5, seed=7, layer=3)  # M 56
    B, H, D, Bt = 1, 1, 5, 80
    st = new_state(B, H, 1 + 2 + Bt, D, 58, Bt)
    reps = torch.stack([torch.tensor([float(i), 2.0 * (i % 3), 0, 0, 0]) * 3 for i in range(25)])
    reps[20] = reps[3]
    st["rep"][0, 0, :25] = reps
    st["count"][0, 0, :25] = 1
    st["n_clusters"][0, 0] = 25
    st["n_seen"][0, 0] = 25
    st["delta"][0, 0] = 2.0
    append(st, 0, 0, reps[3] + torch.tensor([1.0, 0, 0, 0, 0]), torch.ones(D), 0)
    fold_both(st, kw, 0, **knobs)
    assert int(st["count"][0, 0, 3]) == 2 and int(st["count"][0, 0, 20]) == 1


def test_head_offset_matches_reference():
    """A tensor-parallel rank's fold (head_offset: the layer's index of its first head): the reservoirs hash the
    same heads as the reference."""
    kw = dict(n_sink=1, window=2, t=2, value_share=0.5, cluster_target=0.5, seed=7, layer=3, head_offset=5)
    gen = torch.Generator().manual_seed(1)
    B, H, D, Bt, L = 1, 3, 4, 20, 24
    S = Bt - 3
    st = new_state(B, H, L + S, D, (S - round(0.5 * S)) // 2 + 1, Bt)
    keys, vals = tokens(L, D, gen, 3)
    for h in range(H):
        for n in range(L):
            append(st, 0, h, keys[(n + 5 * h) % L], vals[(n + 5 * h) % L], n)
    fold_both(st, kw, 0)
