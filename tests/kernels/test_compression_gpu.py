"""kvrewrite::evict_to_budget and kvrewrite::chelsea_compress on CUDA: the Triton kernels (no host sync)
against the CPU reference, bit for bit in their decisions.

Why the inputs are "exact": a cosine computed in fp32 by two implementations with different summation
orders differs in the last bits, and a near-tie (two edges within ~1e-7) may then rank the other way.
So the keys of the exactness tests are integer vectors with |entries| <= 255 and sum of squares 2**20
(2**18 for D < 64; random signed permutations of a few such vectors): x / |x| = x / 1024 is exact, every
product is exact and every partial sum is an integer multiple of 2**-20 below 1, so every similarity is the same fp32
number on any device and in any order (in fp32, bf16 and fp16 storage alike). Ties are then real ties,
broken the same way on both sides (argmax: first B; ranking: earlier edge, the reference under
`pinned_ties()`, since torch.topk's tie order is unspecified). Multi-round cases use runs of
identical exact keys: a star of identical keys averages back to the exact key, so later rounds stay
exact too. On Gaussian keys (test_gaussian_keys) decisions may differ at near-ties: that test checks
the invariants on every row and agreement on most rows.

Every check draws fresh random states: slots past the fill hold garbage (finite bias included), which
both sides must ignore; rows below the threshold and outlier heads must come back bit for bit.
Skipped without CUDA or Triton. On a GPU machine: `python -m pytest -m gpu -q tests/kernels/test_compression_gpu.py`.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import chelsea_compress as cc
from kvrewrite.kernels.chelsea_compress import pinned_ties
from kvrewrite.state import allocate_layer_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(cc.triton is None, reason="needs Triton"),
]

EVICT = torch.ops.kvrewrite.evict_to_budget.default
CHELSEA = torch.ops.kvrewrite.chelsea_compress.default
FIELDS = ("keys", "values", "bias", "slot_pos", "fill")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCHED = dict(r_init=0.35, r_alpha=0.1, r_steps=2, r_min=0.1)  # Chelsea's Llama-3 schedule + our floor

# Keys and values after compression, CUDA vs CPU reference, per state dtype. Both compute every merge in
# fp32 in the same order (n_b x_b, then the members in ranking order, then / n; no FMA contraction), so
# equal inputs give equal fp32 results and the results are usually identical; the table leaves room for
# one rounding difference before the cast to the state's dtype: ~1 ulp of fp32 (1.2e-7 relative), or one
# ulp of the storage dtype after the cast (fp16 2**-10, bf16 2**-7 relative, at |x| <= ~4). A wrong merge
# (a different member, a missing degree weight) moves a value by O(0.1).
TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.float16: dict(atol=4e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=8e-3),
}
BIAS_TOL = dict(atol=1e-6, rtol=1e-6)  # log n: GPU and CPU logf may differ by an ulp; degrees must be equal


# -- exact keys ------------------------------------------------------------------------------------------
BOUND = 255


def _norm_sq(D):
    """Sum of squares of the exact keys: 4**k, reachable with |entries| <= BOUND (2**18 for D < 64)."""
    return 2**20 if D >= 64 else 2**18


def _four_squares(r):
    """a >= b >= c >= d >= 0 with a^2 + b^2 + c^2 + d^2 == r, all <= BOUND, or None."""
    for a in range(min(BOUND, math.isqrt(r)), -1, -1):
        r1 = r - a * a
        if r1 > 3 * a * a:
            break
        for b in range(min(a, math.isqrt(r1)), -1, -1):
            r2 = r1 - b * b
            if r2 > 2 * b * b:
                break
            for c in range(min(b, math.isqrt(r2)), -1, -1):
                d2 = r2 - c * c
                if d2 > c * c:
                    break
                d = math.isqrt(d2)
                if d * d == d2:
                    return [a, b, c, d]
    return None


def exact_keys(n, D, gen, n_base=6):
    """[n, D] float keys: random signed permutations of n_base integer vectors of sum of squares 4**k."""
    norm_sq = _norm_sq(D)
    sigma = math.sqrt((norm_sq - 2 * BOUND**2) / (D - 4))
    base = []
    for _ in range(10000):
        x = (torch.randn(D - 4, generator=gen) * sigma).round().clamp(-BOUND, BOUND).long()
        r = norm_sq - int((x * x).sum())
        four = _four_squares(r) if 0 <= r <= 4 * BOUND**2 else None
        if four is not None:
            base.append(torch.cat([x, torch.tensor(four)]))
            if len(base) == n_base:
                break
    base = torch.stack(base)
    assert len(base) == n_base and ((base * base).sum(1) == norm_sq).all()
    perm = torch.rand(n, D, generator=gen).argsort(dim=1)
    sign = torch.randint(0, 2, (n, D), generator=gen) * 2 - 1
    return (base[torch.randint(0, n_base, (n,), generator=gen)].gather(1, perm) * sign).float()


def grouped_keys(n, D, gen, max_run=6):
    """[n, D]: runs of 1..max_run identical exact keys (a new exact key per run)."""
    sizes = []
    while sum(sizes) < n:
        sizes.append(int(torch.randint(1, max_run + 1, (1,), generator=gen)))
    k = exact_keys(len(sizes), D, gen)
    return torch.repeat_interleave(k, torch.tensor(sizes), dim=0)[:n]


def make_state(B, H, C, D, dtype, fills, target, threshold, pads=None, keys="exact", seed=0):
    """A CPU state whose row (b, h) holds fills[b][h] slots, the first pads[b] of them padding (bias -inf),
    positions increasing with gaps, degrees 1..4 (bias log n); past the fill: garbage, finite bias too."""
    g = torch.Generator().manual_seed(seed)
    s = allocate_layer_state(B, H, C, D, dtype, "cpu")
    make = {"exact": exact_keys, "grouped": grouped_keys, "gauss": lambda n, D, gen: torch.randn(n, D, generator=gen)}
    s["keys"].copy_(make[keys](B * H * C, D, g).view(B, H, C, D).to(dtype))
    s["values"].copy_(torch.randn(B, H, C, D, generator=g).to(dtype))
    s["bias"].copy_(torch.randint(1, 5, (B, H, C), generator=g).float().log())
    s["slot_pos"].copy_(torch.randint(1, 4, (B, H, C), generator=g).cumsum(-1) + 100)
    s["fill"].copy_(torch.as_tensor(fills))
    for b in range(B):
        if pads is not None:
            s["bias"][b, :, : pads[b]] = -math.inf
    s["budget"].copy_(torch.tensor([target, threshold]))
    return s


def fills_grid(B, H, C, target, threshold, gen):
    """Per row: at / below / above the threshold, and full (fill == C) in turn, shuffled."""
    choices = [threshold, threshold - 1, min(C, threshold + 1 + int(torch.randint(0, max(1, C - threshold), (1,),
                                                                                   generator=gen))), C]
    rows = [choices[i % 4] for i in range(B * H)]
    order = torch.randperm(B * H, generator=gen).tolist()
    return torch.tensor([rows[i] for i in order]).view(B, H).clamp(0, C)


# -- comparison ------------------------------------------------------------------------------------------
def _due_rows(before, skip_heads=()):
    due = before["fill"] >= before["budget"][1]
    for h in skip_heads:
        due[:, h] = False
    return due


def compare(got, want, before, dtype, what, skip_heads=(), rows=None):
    """got (CUDA result, on the CPU) vs want (CPU reference). Returns the rows whose decisions differ when
    `rows` is "collect" (Gaussian keys), else asserts every row."""
    due = _due_rows(before, skip_heads)
    bad = []
    B, H = due.shape
    for b in range(B):
        for h in range(H):
            tag = f"{what}: row b{b} h{h}"
            if not due[b, h]:
                for f in FIELDS:
                    assert torch.equal(got[f][b, h], before[f][b, h]), f"{tag} is not due, but its {f} changed"
                continue
            n = int(want["fill"][b, h])
            same = (int(got["fill"][b, h]) == n and torch.equal(got["slot_pos"][b, h, :n], want["slot_pos"][b, h, :n])
                    and torch.equal(got["bias"][b, h].isinf(), want["bias"][b, h].isinf())
                    and torch.equal(got["bias"][b, h, :n].exp().round(), want["bias"][b, h, :n].exp().round()))
            if not same and rows == "collect":
                bad.append((b, h))
                continue
            assert int(got["fill"][b, h]) == n, f"{tag}: fill {int(got['fill'][b, h])}, reference {n}"
            gp, wp = got["slot_pos"][b, h, :n], want["slot_pos"][b, h, :n]
            assert torch.equal(gp, wp), f"{tag}: kept positions differ at {(gp != wp).nonzero().flatten()[:8].tolist()}"
            assert torch.equal(got["bias"][b, h].isinf(), want["bias"][b, h].isinf()), f"{tag}: empty slots differ"
            gd, wd = got["bias"][b, h, :n].exp().round(), want["bias"][b, h, :n].exp().round()
            assert torch.equal(gd, wd), f"{tag}: degrees differ at {(gd != wd).nonzero().flatten()[:8].tolist()}"
            torch.testing.assert_close(got["bias"][b, h, :n], want["bias"][b, h, :n], **BIAS_TOL, msg=f"{tag}: bias")
            for f in ("keys", "values"):
                x, y = got[f][b, h, :n].float(), want[f][b, h, :n].float()
                diff = (x - y).abs().max().item() if n else 0.0
                torch.testing.assert_close(x, y, **TOL[dtype], msg=f"{tag}: {f} max |diff| {diff:.3g}")
    return bad


def reference(op_args, s):
    """The op on a CPU copy of state s (the reference), exact ranking ties pinned to the earlier edge as
    the kernel breaks them (torch.topk's order is unspecified; identical keys tie exactly)."""
    cpu = {k: v.clone() for k, v in s.items()}
    op, extra = op_args
    with pinned_ties():
        op(cpu["keys"], cpu["values"], cpu["bias"], cpu["slot_pos"], cpu["fill"], cpu["budget"], *extra)
    return cpu


def run_both(op_args, s):
    """The op on a CUDA copy and on a CPU copy of state s; returns (cuda result on CPU, CPU result)."""
    gpu = {k: v.cuda() for k, v in s.items()}
    op, extra = op_args
    op(gpu["keys"], gpu["values"], gpu["bias"], gpu["slot_pos"], gpu["fill"], gpu["budget"], *extra)
    return {k: v.cpu() for k, v in gpu.items()}, reference(op_args, s)


def chelsea_args(n_sink, n_recent, chunk, outliers=(), sched=SCHED):
    return CHELSEA, (n_sink, n_recent, chunk, sched["r_init"], sched["r_alpha"], sched["r_steps"], sched["r_min"],
                     list(outliers))


# -- evict_to_budget ---------------------------------------------------------------------------------------
# (B, Hkv, C, D, dtype, n_sink, target, threshold)
EVICT_CASES = [
    (1, 1, 37, 64, "fp32", 4, 20, 30),
    (3, 2, 37, 128, "bf16", 0, 12, 13),
    (1, 8, 300, 128, "fp16", 4, 200, 232),
    (3, 8, 300, 64, "bf16", 16, 100, 300),
    (3, 2, 1000, 128, "fp32", 2, 700, 732),
    (1, 2, 1000, 64, "fp16", 300, 250, 600),  # n_sink > target: the first target slots
]


@pytest.mark.parametrize("case", EVICT_CASES, ids=lambda c: f"B{c[0]}-Hkv{c[1]}-C{c[2]}-D{c[3]}-{c[4]}-sink{c[5]}")
def test_evict_matches_reference(case):
    B, H, C, D, dt, n_sink, target, threshold = case
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        fills = fills_grid(B, H, C, target, threshold, g)
        pads = torch.randint(0, C // 8 + 1, (B,), generator=g).tolist()
        s = make_state(B, H, C, D, DTYPES[dt], fills, target, threshold, pads=pads, seed=seed)
        got, want = run_both((EVICT, (n_sink,)), s)
        compare(got, want, s, DTYPES[dt], f"evict {case} seed {seed}")
        # eviction copies slots: keys and values are bit-identical, not just close
        for b in range(B):
            for h in range(H):
                n = int(want["fill"][b, h])
                assert torch.equal(got["keys"][b, h, :n], want["keys"][b, h, :n])


# -- chelsea_compress --------------------------------------------------------------------------------------
# (B, Hkv, C, D, dtype, chunk, n_sink, n_recent, kind): "decode" = target + g = threshold with g small (one
# round per row at the threshold, more on fuller rows), "prefill" = a small target far below the fill
# (several rounds, grouped keys so later rounds stay exact).
CHELSEA_CASES = [
    (1, 1, 37, 64, "fp32", 8, 2, 3, "decode"),
    (3, 2, 37, 128, "fp16", 8, 2, 3, "prefill"),
    (3, 2, 300, 128, "bf16", 256, 16, 64, "decode"),
    (1, 8, 300, 64, "fp16", 64, 4, 8, "decode"),
    (1, 2, 300, 64, "fp32", 64, 4, 8, "prefill"),
    (3, 8, 1000, 128, "bf16", 256, 16, 64, "prefill"),
    (1, 8, 1000, 128, "bf16", 256, 16, 64, "decode"),
    (3, 1, 1000, 64, "fp16", 256, 16, 64, "prefill"),
    (1, 2, 1000, 128, "fp32", 256, 16, 64, "decode"),
]


def _chelsea_id(case):
    B, H, C, D, dt, chunk, _, _, kind = case
    return f"B{B}-Hkv{H}-C{C}-D{D}-{dt}-chunk{chunk}-{kind}"


def _chelsea_budget(kind, C, P, gen):
    if kind == "decode":
        g = int(torch.randint(4, 33, (1,), generator=gen))
        target = max(P + 2, C - g - int(torch.randint(0, C // 4 + 1, (1,), generator=gen)))
        return target, target + g
    target = P + 2 + int(torch.randint(0, max(1, C // 3), (1,), generator=gen))
    return target, target + int(torch.randint(1, max(2, (C - target) // 2), (1,), generator=gen))


@pytest.mark.parametrize("case", CHELSEA_CASES, ids=_chelsea_id)
def test_chelsea_matches_reference(case):
    B, H, C, D, dt, chunk, n_sink, n_recent, kind = case
    for seed in range(3):
        g = torch.Generator().manual_seed(1000 + seed)
        target, threshold = _chelsea_budget(kind, C, n_sink + n_recent, g)
        fills = fills_grid(B, H, C, target, threshold, g)
        pads = torch.randint(0, C // 10 + 1, (B,), generator=g).tolist()
        outliers = [H - 1] if H > 1 and seed == 1 else []
        s = make_state(B, H, C, D, DTYPES[dt], fills, target, threshold, pads=pads, seed=seed,
                       keys="grouped" if kind == "prefill" else "exact")
        got, want = run_both(chelsea_args(n_sink, n_recent, chunk, outliers), s)
        compare(got, want, s, DTYPES[dt], f"chelsea {case} seed {seed} target {target} threshold {threshold}",
                skip_heads=outliers)


# Round 0 runs in parallel over (row, chunk) and writes out of place: many chunks per row, B > 1, ragged
# fills (rows below the threshold and outlier heads must come back untouched), and "one_round" budgets
# whose first round lands on the target after removing up to 0.3 M slots (a prefill chunk's call).
PARALLEL_CASES = [
    (2, 4, 2000, 128, "bf16", 64, 16, 64, "decode"),
    (2, 4, 2000, 128, "bf16", 64, 16, 64, "one_round"),
    (1, 8, 1500, 64, "fp16", 256, 16, 64, "one_round"),
    (3, 2, 700, 128, "fp32", 32, 4, 8, "one_round"),
    (2, 2, 600, 128, "bf16", 16, 2, 3, "one_round"),
]


@pytest.mark.parametrize("case", PARALLEL_CASES, ids=_chelsea_id)
def test_parallel_round0_many_chunks(case):
    B, H, C, D, dt, chunk, n_sink, n_recent, kind = case
    for seed in range(2):
        g = torch.Generator().manual_seed(3000 + seed)
        if kind == "one_round":
            target = C - int(0.3 * (C - n_sink - n_recent)) + int(torch.randint(0, 8, (1,), generator=g))
            threshold = min(C, target + int(torch.randint(1, chunk + 1, (1,), generator=g)))
        else:
            target, threshold = _chelsea_budget(kind, C, n_sink + n_recent, g)
        fills = fills_grid(B, H, C, target, threshold, g)
        outliers = [H - 1] if seed == 1 else []
        s = make_state(B, H, C, D, DTYPES[dt], fills, target, threshold, pads=[0, 7, 0][:B], seed=seed, keys="exact")
        got, want = run_both(chelsea_args(n_sink, n_recent, chunk, outliers), s)
        compare(got, want, s, DTYPES[dt], f"parallel {case} seed {seed} target {target} threshold {threshold}",
                skip_heads=outliers)


def test_gaussian_keys():
    """Generic keys: a similarity near-tie may rank differently on the two sides (see the module
    docstring), so every due row must keep the invariants and most rows must match the reference."""
    rows = same = 0
    for seed, (B, H, C, D, dt, chunk, kind) in enumerate([(3, 8, 1000, 128, "bf16", 256, "decode"),
                                                          (3, 8, 1000, 128, "bf16", 256, "prefill"),
                                                          (1, 2, 1000, 128, "fp32", 256, "prefill"),
                                                          (1, 8, 300, 64, "fp16", 64, "decode")]):
        n_sink, n_recent = (16, 64) if chunk == 256 else (4, 8)
        g = torch.Generator().manual_seed(2000 + seed)
        target, threshold = _chelsea_budget(kind, C, n_sink + n_recent, g)
        fills = fills_grid(B, H, C, target, threshold, g)
        s = make_state(B, H, C, D, DTYPES[dt], fills, target, threshold, pads=[3] * B, seed=seed, keys="gauss")
        got, want = run_both(chelsea_args(n_sink, n_recent, chunk), s)
        bad = compare(got, want, s, DTYPES[dt], f"gauss {kind} {dt}", rows="collect")
        due = _due_rows(s)
        for b, h in due.nonzero().tolist():
            n = int(want["fill"][b, h])
            tokens = int(torch.isfinite(s["bias"][b, h, : int(s["fill"][b, h])]).sum())
            assert int(got["fill"][b, h]) == n
            assert int(got["bias"][b, h, :n].exp().round().sum()) == int(s["bias"][b, h, 3:int(s["fill"][b, h])]
                                                                       .exp().round().sum()), (b, h, tokens)
            for f in ("keys", "values", "slot_pos"):  # sinks and recent slots are never merged
                assert torch.equal(got[f][b, h, :n_sink], want[f][b, h, :n_sink])
                assert torch.equal(got[f][b, h, n - n_recent:n], want[f][b, h, n - n_recent:n])
        rows += int(due.sum())
        same += int(due.sum()) - len(bad)
    print(f"gaussian keys: {same}/{rows} due rows identical to the reference")
    assert same >= 0.8 * rows, f"only {same} of {rows} rows match the reference"


def _random_into(static, s):
    for k, v in s.items():
        static[k].copy_(v)


@pytest.mark.parametrize("which", ["evict", "chelsea"])
def test_cuda_graph_capture_and_replay(which):
    """The op is captured in a CUDA graph (it never syncs with the host) and every replay on a new state
    copied into the captured tensors matches the reference: decode-like and multi-round calls alike."""
    B, H, C, D, dt = 3, 2, 300, 128, torch.bfloat16
    if which == "evict":
        op_args = (EVICT, (4,))
    else:
        op_args = chelsea_args(16, 64, 256, outliers=[1])

    def state(seed):
        g = torch.Generator().manual_seed(seed)
        target, threshold = _chelsea_budget("prefill" if seed % 2 else "decode", C, 80, g)
        fills = fills_grid(B, H, C, target, threshold, g)
        return make_state(B, H, C, D, dt, fills, target, threshold, pads=[0, 5, 0], seed=seed, keys="grouped")

    static = {k: v.cuda() for k, v in state(0).items()}
    op, extra = op_args
    call = lambda: op(static["keys"], static["values"], static["bias"], static["slot_pos"], static["fill"],
                      static["budget"], *extra)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in range(1, 5):
        s = state(seed)
        _random_into(static, s)
        graph.replay()
        torch.cuda.synchronize()
        got = {k: v.cpu() for k, v in static.items()}
        want = reference(op_args, s)
        compare(got, want, s, dt, f"{which} graph replay {seed}", skip_heads=extra[-1] if which == "chelsea" else ())


def test_no_host_sync():
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronising call inside the ops."""
    s = {k: v.cuda() for k, v in make_state(2, 2, 300, 64, torch.float16, [[300, 200], [250, 299]], 180, 250,
                                            keys="grouped").items()}
    args = (s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], s["budget"])
    EVICT(*[a.clone() for a in args], 4)  # compile first (compilation may sync)
    CHELSEA(*[a.clone() for a in args], *chelsea_args(4, 8, 64, outliers=[1])[1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        EVICT(*[a.clone() for a in args], 4)
        CHELSEA(*args, *chelsea_args(4, 8, 64, outliers=[1])[1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(s["fill"][0, 0].cpu()) == 180


def test_opcheck_cuda():
    s = {k: v.cuda() for k, v in make_state(2, 2, 64, 64, torch.bfloat16, [[50, 12], [64, 40]], 30, 40,
                                            pads=[0, 3]).items()}
    args = (s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], s["budget"])
    torch.library.opcheck(EVICT, (*args, 2))
    torch.library.opcheck(CHELSEA, (*args, *chelsea_args(2, 3, 8, outliers=[1])[1]))


def test_scratch_bound_is_tight_enough():
    """scratch_slots: the longest row a non-final first round leaves, checked against every fill."""
    for C, n_sink, n_recent, r_init, r_min in [(1000, 16, 64, 0.35, 0.1), (300, 4, 8, 0.5, 0.5), (37, 2, 3, 0.2, 0.1)]:
        cw = cc.scratch_slots(C, n_sink, n_recent, r_init, r_min)
        r0 = max(r_init, r_min)
        for L in range(n_sink + n_recent + 2, C + 1):
            left = L - max(1, int(r0 * (L - n_sink - n_recent) + 1e-9))
            assert left <= cw, (C, L, left, cw)


def test_tiny_llama_generate_cuda_matches_cpu():
    """End to end: a tiny llama (2 layers x 2 KV heads, D = 16), a left-padded batch, chelsea with an
    outlier head, prefill in chunks and decode-time compressions: CUDA (Triton ops) and CPU (reference
    ops) generate the same tokens, and the final states hold the same slots."""
    from tests.families import tiny_model

    kw = dict(budget=0.5, max_length=96, batch_size=2, prefill_chunk=8, n_sink=2, n_recent=4, chunk=8, interval=4,
              outlier_heads={0: [1]})
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out = {}
    for dev in ("cpu", "cuda"):
        model = tiny_model("llama").to(dev)
        rw = kvrewrite.apply(model, "chelsea", **kw)
        with pinned_ties():
            toks = rw.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=24, eos_token_id=[])
        out[dev] = (toks.cpu(), [{k: v.cpu() for k, v in rw.layer_state(i).items()} for i in range(2)])
    assert torch.equal(out["cpu"][0], out["cuda"][0]), "generated tokens differ"
    for i in range(2):
        a, b = out["cpu"][1][i], out["cuda"][1][i]
        assert torch.equal(a["fill"], b["fill"]), f"layer {i}: fill"
        for bb, h in ((x, y) for x in range(2) for y in range(2)):
            n = int(a["fill"][bb, h])
            assert torch.equal(a["slot_pos"][bb, h, :n], b["slot_pos"][bb, h, :n]), f"layer {i} row {bb} {h}"
            torch.testing.assert_close(a["keys"][bb, h, :n], b["keys"][bb, h, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", [CHELSEA_CASES[1], CHELSEA_CASES[2], CHELSEA_CASES[5]], ids=_chelsea_id)
def test_single_program_path_matches_reference(case):
    """parallel_round0=False: every round in the one-program-per-row kernel (the cross-check path)."""
    B, H, C, D, dt, chunk, n_sink, n_recent, kind = case
    g = torch.Generator().manual_seed(77)
    target, threshold = _chelsea_budget(kind, C, n_sink + n_recent, g)
    s = make_state(B, H, C, D, DTYPES[dt], fills_grid(B, H, C, target, threshold, g), target, threshold, pads=[4] * B,
                   seed=77, keys="grouped" if kind == "prefill" else "exact")
    gpu = {k: v.cuda() for k, v in s.items()}
    extra = chelsea_args(n_sink, n_recent, chunk)[1]
    cc.triton_chelsea_compress(*[gpu[k] for k in ("keys", "values", "bias", "slot_pos", "fill", "budget")], *extra,
                               parallel_round0=False)
    compare({k: v.cpu() for k, v in gpu.items()}, reference(chelsea_args(n_sink, n_recent, chunk), s), s, DTYPES[dt],
            f"single-program {case}")
