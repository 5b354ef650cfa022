"""kcenter_compress's Triton kernels compiled on CUDA against the op's reference (run on CUDA too), at sizes where the
select launch's programs of a row exchange words (1 to 16 programs per row, rows walked in groups), every key dtype,
D 64 and 128, odd C, ragged fills, left padding and holes, rows not due; a CUDA graph replayed on new state and a new
budget; no host sync.

Exactness: with small integer keys every distance is exact in fp32 (both sides), so the kernels' decisions, ties
included, and the whole state must equal the reference bit for bit. With Gaussian keys the two sides sum D squares in
different orders (ulp-level differences): the centres must be the reference's, or differ first at a near tie (the two
candidates' float64 distances within REL_TIE), and every choice must be a farthest point in float64 within REL_TIE.
"""
import math

import pytest
import torch

from kvrewrite.kernels import _kcenter_kernels as kk
from kvrewrite.kernels.kcenter import greedy_kcenter
from kvrewrite.kernels.kcenter_compress import kept_slots, reference_kcenter_compress

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(kk.triton is None, reason="needs Triton"),
]

FIELDS = ("keys", "values", "bias", "slot_pos", "fill")
REL_TIE = 2e-5  # fp32 sums of <= 128 squares in two orders differ by < ~1e-5 relative


def make_state(B, H, C, D, dtype, seed, fills, pads=None, holes=0, integer=True):
    """Rows (b, h) hold fills[b][h] slots; pads[b] leading padding slots (bias -inf) and `holes` random holes per row;
    bias log(1..3) on valid slots (it must become 0), garbage past the fill."""
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randint(-8, 9, (B, H, C, D), generator=g).float() if integer
            else torch.randn(B, H, C, D, generator=g) * 2)
    s = dict(keys=keys.to(dtype), values=torch.randn(B, H, C, D, generator=g).to(dtype),
             bias=torch.randint(1, 4, (B, H, C), generator=g).float().log(),
             slot_pos=(1000 + torch.arange(C)).repeat(B, H, 1), fill=torch.as_tensor(fills, dtype=torch.int64))
    for b in range(B):
        for h in range(H):
            f = int(s["fill"][b, h])
            s["bias"][b, h, f:] = -math.inf
            if pads is not None:
                s["bias"][b, h, :pads[b]] = -math.inf
            for j in torch.randint(0, max(f, 1), (holes,), generator=g).tolist():
                s["bias"][b, h, j] = -math.inf
    return {k: v.cuda() for k, v in s.items()}


def run_kernel(s, budget, recent_ratio, **knobs):
    got = {f: t.clone() for f, t in s.items()}
    rows, C = s["keys"].shape[0] * s["keys"].shape[1], s["keys"].shape[2]
    order = torch.full((rows, C), -1, dtype=torch.int32, device="cuda")
    rounds = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    kk.triton_kcenter_compress(*(got[f] for f in FIELDS), budget, recent_ratio=recent_ratio, order=order,
                               rounds=rounds, **knobs)
    torch.cuda.synchronize()
    return got, order, rounds


def run_reference(s, budget, recent_ratio):
    want = {f: t.clone() for f, t in s.items()}
    reference_kcenter_compress(*(want[f] for f in FIELDS), budget, recent_ratio)
    return want


def assert_equal(got, want, s, budget):
    due = s["fill"] >= budget[1]
    for f in FIELDS:
        assert torch.equal(got[f][~due], s[f][~due]), f"{f} changed in a row not due"
        assert torch.equal(got[f], want[f]), f"{f} differs from the reference"


SHAPES = {  # (B, Hkv, C, D, fills, pads, holes, budget)
    "llama_like": (1, 8, 1031, 128, [[1031, 990, 1000, 700, 1020, 1031, 950, 1011]], None, 0, [384, 900]),
    "batch3_gqa": (3, 2, 777, 64, [[777, 600], [700, 777], [500, 760]], [0, 37, 5], 6, [256, 650]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("knobs", [{}, dict(programs=1, lookahead=1), dict(programs=3, lookahead=2),
                                   dict(programs=8, lookahead=15), dict(programs=5, lookahead=3, resident=False),
                                   dict(select_warps=8)],
                         ids=["default", "p1t1", "p3t2", "p8t15", "p5t3_reread", "w8"])
def test_integer_keys_equal_the_reference(dtype, shape, knobs):
    B, H, C, D, fills, pads, holes, budget = SHAPES[shape]
    seed = list(SHAPES).index(shape) * 10 + dtype.itemsize
    s = make_state(B, H, C, D, dtype, seed=seed, fills=fills, pads=pads, holes=holes)
    budget = torch.tensor(budget, device="cuda")
    got, _, rounds = run_kernel(s, budget, 0.5, **knobs)
    assert_equal(got, run_reference(s, budget, 0.5), s, budget)
    assert int(rounds.max()) >= 1, "no row selected: the test is too weak"


@pytest.mark.parametrize("recent_ratio", [0.0, 0.3, 1.0])
def test_recent_ratio_extremes(recent_ratio):
    B, H, C, D, fills, pads, holes, budget = SHAPES["batch3_gqa"]
    s = make_state(B, H, C, D, torch.bfloat16, seed=5, fills=fills, pads=pads, holes=holes)
    budget = torch.tensor(budget, device="cuda")
    got, _, _ = run_kernel(s, budget, recent_ratio)
    assert_equal(got, run_reference(s, budget, recent_ratio), s, budget)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gaussian_keys_choose_farthest_points(dtype):
    """Gaussian keys (ulp-level differences in the distances): the centres are the reference's up to a near tie and
    each is a farthest point in float64 within REL_TIE; where the centres agree the state equals the reference."""
    B, H, C, D, fills, pads, holes, budget = SHAPES["llama_like"]
    s = make_state(B, H, C, D, dtype, seed=21, fills=fills, pads=pads, holes=holes, integer=False)
    budget = torch.tensor(budget, device="cuda")
    got, order, _ = run_kernel(s, budget, 0.5)
    want = run_reference(s, budget, 0.5)
    R = B * H
    ell = math.floor(0.5 * int(budget[0]))
    k = int(budget[0]) - ell
    same_rows = []
    for r in range(R):
        b, h = divmod(r, H)
        valid = ((torch.arange(C, device="cuda") < s["fill"][b, h]) & (s["bias"][b, h] > -math.inf)).nonzero()[:, 0]
        if s["fill"][b, h] < budget[1] or len(valid) <= int(budget[0]):
            continue
        cand = valid[:len(valid) - ell]
        x = s["keys"][b, h, cand].double()
        ref, _ = greedy_kcenter(s["keys"][b, h, cand][None], torch.ones(1, len(cand), dtype=torch.bool,
                                                                              device="cuda"), k)
        slot_of = {int(c): i for i, c in enumerate(cand.tolist())}
        mine = [slot_of[int(c)] for c in order[r, :k].tolist()]
        d2 = torch.full((len(cand),), math.inf, dtype=torch.float64, device="cuda")
        taken = torch.zeros(len(cand), dtype=torch.bool, device="cuda")
        first_diff = next((i for i in range(k) if mine[i] != int(ref[0, i])), None)
        for i, c in enumerate(mine):
            far = torch.where(taken, -1.0, d2).max()
            assert d2[c] >= far * (1 - REL_TIE) and (i > 0 or c == 0), f"row {r} step {i}: not a farthest point"
            if i == first_diff:
                a, o = d2[c], d2[int(ref[0, i])]
                assert abs(a - o) <= REL_TIE * max(a, o), f"row {r} step {i}: differs from the reference off a tie"
            taken[c] = True
            d2 = torch.minimum(d2, ((x - x[c]) ** 2).sum(-1))
        if first_diff is None:
            same_rows.append(r)
    assert same_rows, "every row hit a near tie: the comparison with the reference is empty"
    for r in same_rows:
        b, h = divmod(r, H)
        for f in FIELDS:
            assert torch.equal(got[f][b, h], want[f][b, h]), f"row {r}: {f}"


def test_cuda_graph_replay_and_no_host_sync():
    """Captured once at one budget; replayed on new states at other budgets: the reference at those budgets. The
    eager call runs under torch.cuda.set_sync_debug_mode("error")."""
    B, H, C, D, fills, pads, holes, _ = SHAPES["batch3_gqa"]
    budget = torch.tensor([256, 650], device="cuda")
    static = make_state(B, H, C, D, torch.bfloat16, seed=31, fills=fills, pads=pads, holes=holes)
    warm = {f: t.clone() for f, t in static.items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kk.triton_kcenter_compress(*(warm[f] for f in FIELDS), budget, recent_ratio=0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kk.triton_kcenter_compress(*(warm[f] for f in FIELDS), budget, recent_ratio=0.5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kk.triton_kcenter_compress(*(static[f] for f in FIELDS), budget, recent_ratio=0.5)
    for seed, new_budget in ((32, [300, 650]), (33, [128, 700])):
        fresh = make_state(B, H, C, D, torch.bfloat16, seed=seed, fills=fills, pads=pads, holes=holes)
        for f in FIELDS:
            static[f].copy_(fresh[f])
        budget.copy_(torch.tensor(new_budget))
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(static, run_reference(fresh, budget, 0.5), fresh, budget)


def test_op_cuda_path_equals_the_cpu_reference():
    """The registered op on CUDA (the Triton kernels once KERNELS_CHECKED_ON_GPU) = the op on the CPU."""
    B, H, C, D, fills, pads, holes, budget = SHAPES["batch3_gqa"]
    s = make_state(B, H, C, D, torch.bfloat16, seed=41, fills=fills, pads=pads, holes=holes)
    cpu = {f: t.cpu().clone() for f, t in s.items()}
    torch.ops.kvrewrite.kcenter_compress(*(s[f] for f in FIELDS), torch.tensor(budget, device="cuda"),
                                         recent_ratio=0.5)
    torch.ops.kvrewrite.kcenter_compress(*(cpu[f] for f in FIELDS), torch.tensor(budget), recent_ratio=0.5)
    for f in FIELDS:
        assert torch.equal(s[f].cpu(), cpu[f]), f


def test_kept_count_is_the_budget():
    """Sanity of the shapes above: due rows with more valid slots than B keep exactly B (kept_slots agrees)."""
    B, H, C, D, fills, pads, holes, budget = SHAPES["llama_like"]
    s = make_state(B, H, C, D, torch.bfloat16, seed=51, fills=fills, pads=pads, holes=holes)
    budget = torch.tensor(budget, device="cuda")
    got, _, _ = run_kernel(s, budget, 0.5)
    kept, due = kept_slots(s["keys"], s["bias"], s["fill"], budget, 0.5)
    assert torch.equal(got["fill"].reshape(-1)[due], kept.sum(-1)[due])
    assert (got["fill"].reshape(-1)[due] == int(budget[0])).all()
