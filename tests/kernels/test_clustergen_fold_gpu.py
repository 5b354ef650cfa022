"""clustergen_fold's Triton kernels compiled on CUDA against the op's reference run on the CPU (the reference is
checked against the float64 naive models in test_clustergen_fold.py): a prefill fold (δ calibration, every key a
leader candidate), a second prefill chunk (many clusters open before the fold: the parallel distance launch), then
decode folds of g tokens (one batch of far keys: new clusters, then overflow); bf16 / fp16 / fp32, D 64 / 128,
Hkv 8 / 2 / 4, batch 1 / 3, odd budgets and capacities, ragged fills, left padding (bias -inf, NaN keys), rows not
due. Keys and values are small integers (exact in every dtype; every fp32 distance, norm and prefix sum is exact in
any summation order), so every discrete decision must match exactly; biases within 1e-5 (log of the same fp32
quotient, one ulp apart at most). Also: a CUDA graph capture replayed on new state, the op's CUDA dispatch, the
Triton mix32.
"""
import functools

import pytest
import torch

from kvrewrite.kernels import _clustergen_fold_kernels as kk
from kvrewrite.kernels import clustergen_fold as op_mod
from kvrewrite.kernels._hash import mix32_triton
from kvrewrite.kernels.clustergen_fold import reference_clustergen_fold
from kvrewrite.kernels.kmeans_cluster import mix32

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(kk.triton is None, reason="needs Triton"),
]

FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "budget", "role", "rep", "count", "n_clusters", "mu", "delta",
          "n_seen", "n_forced")
ROW_FIELDS = FIELDS[:5] + FIELDS[6:]


def new_state(B, H, C, D, Mmax, Bt, dtype):
    z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt)  # noqa: E731
    return dict(keys=z(B, H, C, D, dt=dtype), values=z(B, H, C, D, dt=dtype),
                bias=torch.full((B, H, C), float("-inf")), slot_pos=z(B, H, C), fill=z(B, H),
                budget=torch.tensor([Bt, 0]), role=z(B, H, C, dt=torch.int8), rep=z(B, H, Mmax, D, dt=dtype),
                count=z(B, H, Mmax, dt=torch.int32), n_clusters=z(B, H), mu=torch.zeros(B, H),
                delta=torch.full((B, H), -1.0), n_seen=z(B, H), n_forced=z(B, H))


class Stream:
    """Per-row integer token streams: keys around a few integer centres (+ {-1, 0, 1} noise), values in [-2, 2]
    (every 9th zero)."""

    def __init__(self, B, H, D, groups, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.c = torch.randint(-12, 13, (B, H, groups, D), generator=self.g).float()
        self.D, self.n = D, 0

    def next(self, b, h, far=0):
        """far > 0: 40 far (on 4 dims, distinct for distinct far) from every centre: opens a cluster or is forced."""
        k = self.c[b, h, torch.randint(0, self.c.shape[2], (1,), generator=self.g)][0]
        k = k + torch.randint(-1, 2, (self.D,), generator=self.g).float()
        k[:4] += 40.0 * far
        v = torch.randint(-2, 3, (self.D,), generator=self.g).float() * (self.n % 9 != 0)
        self.n += 1
        return k, v


def append(st, b, h, k, v, pos, pad=False):
    f = int(st["fill"][b, h])
    st["keys"][b, h, f], st["values"][b, h, f], st["slot_pos"][b, h, f] = k, v, pos
    st["bias"][b, h, f] = float("-inf") if pad else 0.0
    st["fill"][b, h] = f + 1


def same(a, b):
    """Equal element for element, NaN (the padding keys) equal to NaN."""
    if a.is_floating_point():
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def check(got, want, orig, threshold, where):
    due = orig["fill"] >= threshold
    assert torch.equal(got["budget"], orig["budget"])
    for f in ROW_FIELDS:
        assert same(got[f][~due], orig[f][~due]), f"{where}: {f} changed in a row not due"
        if f not in ("bias", "mu", "delta"):
            assert same(got[f], want[f]), f"{where}: {f} differs in rows {(got[f] != want[f]).nonzero()[:4].tolist()}"
    assert torch.equal(torch.isinf(got["bias"]), torch.isinf(want["bias"])), f"{where}: bias -inf pattern"
    fin = ~torch.isinf(want["bias"])
    torch.testing.assert_close(got["bias"][fin], want["bias"][fin], atol=1e-5, rtol=1e-5, msg=where)
    torch.testing.assert_close(got["mu"], want["mu"], atol=0, rtol=0, msg=where)  # integer norms: exact
    torch.testing.assert_close(got["delta"], want["delta"], atol=0, rtol=1e-6, msg=where)


def fold_both(st, kw, threshold, where, launch=None):
    """Fold a copy on CUDA (the kernels, or `launch`) and st itself with the CPU reference; compare."""
    st["budget"][1] = threshold
    orig = {f: x.clone() for f, x in st.items()}
    dev = {f: x.cuda() for f, x in st.items()}
    (launch or kk.triton_clustergen_fold)(*(dev[f] for f in FIELDS), **kw)
    reference_clustergen_fold(*(st[f] for f in FIELDS), **kw)
    check({f: x.cpu() for f, x in dev.items()}, st, orig, threshold, where)


CASES = {  # name: dtype, B, H, D, n_sink, window, t, Bt, g, groups, prompt lengths (ragged), pads per batch row
    "bf16-B1-H8-D128": (torch.bfloat16, 1, 8, 128, 4, 32, 8, 401, 32, 40, [620, 700, 560, 95, 650, 601, 690, 640], [0]),
    "fp16-B3-H2-D64": (torch.float16, 3, 2, 64, 2, 7, 2, 301, 5, 90, [400, 333, 390, 12, 371, 399], [0, 3, 7]),
    "fp32-B3-H4-D128": (torch.float32, 3, 4, 128, 1, 3, 4, 263, 3, 60, [300, 290, 310, 280, 305, 299, 8, 295, 301,
                                                                       288, 296, 303], [5, 0, 2]),
}


DIRECT = dict(dist_dot=False, resolve_events=False, joiner_index=False, res_b=32)  # the forms before stop 62
FORMS = {"default": {}, "direct": DIRECT, "events": dict(DIRECT, resolve_events=True),
         "index": dict(DIRECT, joiner_index=True), "dot": dict(DIRECT, dist_dot=True),
         "reservoir-128": dict(sk_bs=128, sk_warps=8), "reservoir-loop": dict(sk_split=False)}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_prefill_chunks_then_decode(name, form):
    """Every launch form (the module's defaults: DIST_DOT, RESOLVE_EVENTS and JOINER_INDEX; the direct form without
    them; each of the three alone over it; the reservoirs in 128-slot programs; DIST_DOT exact here: integer keys)."""
    dtype, B, H, D, n_sink, window, t, Bt, g, groups, lens, pads = CASES[name]
    launch = functools.partial(kk.triton_clustergen_fold, **FORMS[form])
    kw = dict(n_sink=n_sink, window=window, t=t, value_share=0.5, cluster_target=0.9, seed=11, layer=5)
    S = Bt - n_sink - window
    chunk2 = 150
    C = max(lens) + max(pads) + S + chunk2 + n_sink + window
    Mmax = -(-(C // 2) // t) + 1
    st = new_state(B, H, C, D, Mmax, Bt, dtype)
    src = Stream(B, H, D, groups, seed=len(name))
    for r in range(B * H):
        b, h = divmod(r, H)
        for _ in range(pads[b]):
            append(st, b, h, float("nan"), 0.0, 0, pad=True)
        for n in range(lens[r]):
            append(st, b, h, *src.next(b, h), n)
    fold_both(st, kw, 200, f"{name} prefill", launch)  # the short row is not due
    assert int((st["delta"] > 0).sum()) == B * H - 1
    for r in range(B * H):  # a second chunk: many clusters open before the fold
        b, h = divmod(r, H)
        for n in range(chunk2):
            append(st, b, h, *src.next(b, h), 1000 + n)
    fold_both(st, kw, 100, f"{name} chunk 2", launch)
    if name.startswith("fp16"):
        assert int(st["n_clusters"].max()) > 64  # several distance blocks
    for step in range(3):
        for r in range(B * H):
            b, h = divmod(r, H)
            for n in range(g):
                append(st, b, h, *src.next(b, h, far=(n + 1) * (step < 2)), 2000 + step * g + n)
        fold_both(st, kw, n_sink + window + g, f"{name} decode {step}", launch)
    assert int(st["n_forced"].max()) > 0


def test_cuda_graph_replays_on_new_state():
    dtype, B, H, D, n_sink, window, t, Bt, g, groups, lens, pads = CASES["fp16-B3-H2-D64"]
    kw = dict(n_sink=n_sink, window=window, t=t, value_share=0.5, cluster_target=0.5, seed=3, layer=0)
    C, Mmax = 900, 230

    def state(seed):
        st = new_state(B, H, C, D, Mmax, Bt, dtype)
        src = Stream(B, H, D, groups, seed)
        for r in range(B * H):
            b, h = divmod(r, H)
            for n in range(lens[r] + seed):
                append(st, b, h, *src.next(b, h), n)
        st["budget"][1] = 100
        return st

    static = {f: x.cuda() for f, x in state(0).items()}
    kk.triton_clustergen_fold(*(static[f] for f in FIELDS), **kw)  # compile outside the capture
    torch.cuda.synchronize()
    fresh = state(1)
    want = {f: x.clone() for f, x in fresh.items()}
    reference_clustergen_fold(*(want[f] for f in FIELDS), **kw)
    for f in FIELDS:
        static[f].copy_(state(0)[f])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kk.triton_clustergen_fold(*(static[f] for f in FIELDS), **kw)
    for f in FIELDS:
        static[f].copy_(fresh[f])
    graph.replay()
    torch.cuda.synchronize()
    check({f: x.cpu() for f, x in static.items()}, want, fresh, 100, "graph replay")


def test_op_cuda_dispatch_runs_the_kernels(monkeypatch):
    """torch.ops.kvrewrite.clustergen_fold on CUDA with KERNELS_CHECKED_ON_GPU set: the kernels' result (a call
    through the op, compared with the reference), head_offset passed through to the kernels' hash."""
    monkeypatch.setattr(op_mod, "KERNELS_CHECKED_ON_GPU", True)
    assert op_mod._cuda_impl() is kk.triton_clustergen_fold
    dtype, B, H, D, n_sink, window, t, Bt, g, groups, lens, pads = CASES["fp16-B3-H2-D64"]
    kw = dict(n_sink=n_sink, window=window, t=t, value_share=0.5, cluster_target=0.5, seed=1, layer=2,
              head_offset=6)
    st = new_state(B, H, 800, D, 210, Bt, dtype)
    src = Stream(B, H, D, groups, 5)
    for r in range(B * H):
        b, h = divmod(r, H)
        for n in range(lens[r]):
            append(st, b, h, *src.next(b, h), n)
    fold_both(st, kw, 100, "op", launch=lambda *a, **k: torch.ops.kvrewrite.clustergen_fold(*a, **k))


if kk.triton is not None:
    tl = kk.tl

    @kk.triton.jit
    def _mix_kernel(X, Y, n, BS: tl.constexpr):
        i = tl.arange(0, BS)
        m = i < n
        tl.store(Y + i, mix32_triton(tl.load(X + i, mask=m).to(tl.uint32)).to(tl.int64), mask=m)


def test_mix32_triton_equals_mix32():
    g = torch.Generator().manual_seed(1)
    xs = torch.cat([torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1]), torch.randint(0, 2**32, (4091,), generator=g)])
    y = torch.zeros_like(xs).cuda()
    _mix_kernel[(1,)](xs.cuda(), y, len(xs), BS=4096)
    assert y.cpu().tolist() == [mix32(int(x)) for x in xs]


@pytest.mark.parametrize("case,form", [("prefill_later", "default"), ("prefill_later", "direct"),
                                       ("prefill_first", "default")])
def test_replays_of_a_batch_fold_give_one_state(case, form):
    """A later prefill chunk's fold at the bench's batch-8 32k layout (random bf16 keys, 407 clusters open, 2048 folded
    keys a row), replayed from one state 40 times in a CUDA graph: one state every time, and every freed slot
    [n_kept, old fill) at bias -inf. Before stop 59's barriers in the pack launch, 1-5 replays of 40 left 512 freed
    slots of one row at bias 0 (a warp read the row's fill after another had written n_kept) on an H200. Also with
    the direct form (no DIST_DOT, RESOLVE_EVENTS, JOINER_INDEX), and the first chunk's fold (its δ calibration)."""
    from kvrewrite.bench import clustergen_fold as cf

    s0 = cf.states(8)[0][case]
    old_fill = s0["fill"].clone()
    s = {f: x.clone() for f, x in s0.items()}
    cf.fold(s, **FORMS[form])
    torch.cuda.synchronize()
    for f in cf.FIELDS:
        s[f].copy_(s0[f])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cf.fold(s, **FORMS[form])
    first = None
    for i in range(40):
        for f in cf.FIELDS:
            s[f].copy_(s0[f])
        graph.replay()
        torch.cuda.synchronize()
        if first is None:
            first = {f: s[f].clone() for f in cf.FIELDS}
            slot = torch.arange(s["bias"].shape[-1], device="cuda")
            freed = (slot >= s["fill"][..., None]) & (slot < old_fill[..., None])
            assert freed.any() and (s["bias"][freed] == float("-inf")).all(), "a freed slot kept its bias"
            continue
        differ = [f for f in cf.FIELDS if not torch.equal(s[f], first[f])]
        assert not differ, f"replay {i}: {differ} differ from the first replay's"
