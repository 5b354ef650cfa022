"""ems_redundancy's Triton kernel compiled on CUDA against the reference (same GPU) and the float64 naive model:
random states (tests/kernels/test_ems_merge_gpu.make_state) with ragged fills, padding, rows not due, pos
with/without, tau in {0, 0.6, 1}, fp32/fp16/bf16, D 64/128, odd C, the output poisoned before the launch.

Exact equality of dest needs inputs without near-ties (docs/contracts/ems.md §11): the kernel's fp32 dot and norm
sums run in another order than the reference's matmuls, so the test computes R in float64 from the stored values
and turns every TBM entry whose best R is within GAP of its second best or of tau into an evicted one (cls 4)
before both run; exact ties between identical vectors are tested separately (they are bitwise ties in both).
"""
import pytest
import torch

from kvrewrite.kernels import ems_redundancy as mod
from kvrewrite.kernels.ems_partition import reference_ems_partition
from kvrewrite.kernels.ems_score import reference_ems_score
from tests.kernels import ems_naive as N
from tests.kernels.test_ems_merge_gpu import make_state

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(mod.triton is None, reason="needs Triton"),
]
GAP = 1e-4


def r64(s):
    """R [B, H, C, C] in float64 of the stored values (rows: TBM candidates d, columns: centres c)."""
    a = (s["raw_keys"] if s["raw_keys"].shape[2] else s["keys"]).double()
    v = s["values"].double()

    def cos(x):
        n = x.norm(dim=-1)
        den = n[..., :, None] * n[..., None, :]
        return torch.where(den > 0, (x @ x.transpose(-1, -2)) / torch.where(den > 0, den, 1.0), 0.0)
    return cos(a).clamp_min(0) * cos(v).clamp_min(0)


def without_near_ties(s, cls, tau):
    r = torch.where((cls == 2)[..., None, :], r64(s), -1.0)
    top = r.topk(2, dim=-1).values
    near = ((top[..., 0] - top[..., 1]).abs() < GAP) | ((top[..., 0] - tau).abs() < GAP)
    return torch.where((cls == 3) & near, 4, cls).to(torch.int32)


def classes(s, bt, thr, gamma=4.0):
    s["budget"] = torch.tensor([bt, thr], device="cuda")
    due = s["fill"] >= s["budget"][1]
    g, gp = reference_ems_score(s["bias"], s["fill"], s["lut"], s["slot_order"], s["s_glo"], s["s_loc_past"],
                                s["s_loc_cur"], s["slot_fill"], due, 4, 7)
    return reference_ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, s["budget"], 4, gamma), due


# RECIP_NORMS' two forms of R; CENTRE_LIST's walk of the listed centres (every row in the big tier)
FORMS = {"divide": dict(recip_norms=False), "recip": dict(recip_norms=True),
         "list": dict(recip_norms=True, centre_list=True, big_tbm=0, centre_rows=False),
         "list-rows": dict(recip_norms=True, centre_list=True, big_tbm=0, centre_rows=True)}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("tau", [0.0, 0.6, 1.0])
def test_matches_reference(dtype, pos, tau, form):
    D = 128 if dtype != torch.float16 else 64
    s = make_state(2, 3, 1031, 2100, D, [[1031, 900, 500], [1000, 1020, 700]], [[2000, 1800, 900], [1500, 2100, 1200]],
                   dtype=dtype, pos=pos, pads=[0, 33], seed=7, noise=0.3)
    cls, due = classes(s, 400, 800)
    cls = without_near_ties(s, cls, tau)
    want = mod.reference_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau)
    got = mod.triton_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau, **FORMS[form])
    assert torch.equal(got, want)
    assert (got[~due] == -1).all()
    n_merge = int(((cls == 3) & (got >= 0)).sum())
    assert (n_merge > 0) == (tau < 1) and int((cls == 3).sum()) > 500


KNOBS = [dict(block_t=32, block_n=64, num_warps=4), dict(block_t=64, block_n=64, num_warps=8),
         dict(block_t=32, block_n=32, num_warps=4), dict(block_t=16, block_n=64, num_warps=4),
         dict(block_t=64, block_n=32, num_warps=8), dict(block_t=32, block_n=64, num_warps=8, splits=5),
         dict(big_tbm=0), dict(big_tbm="median"),  # two tiers: every row in the big one; the rows split between them
         dict(programs=1), dict(block_t=16, programs=3),  # P programs per (row, split) walk the row's TBM blocks
         dict(recip_norms=False), dict(recip_norms=False, block_t=16, block_n=32, splits=5),  # RECIP_NORMS off
         dict(centre_list=True), dict(centre_list=True, big_tbm=0),  # CENTRE_LIST: the big tier, every row in it
         dict(centre_list=True, big_tbm="median"), dict(centre_list=True, block_t=64, num_warps=4, splits=5),
         dict(centre_list=True, big_tbm=0, block_n=128), dict(centre_list=True, big_tbm=0, block_n=32),
         dict(centre_list=True, big_tbm=0, list_stages=2), dict(centre_list=True, big_tbm=0, list_stages=4),
         dict(centre_list=True, big_tbm=0, programs=1, splits=1),
         # LIST_CENTRE_ROWS: R as [centres, TBM]
         dict(centre_list=True, big_tbm=0, centre_rows=True), dict(centre_list=True, big_tbm=0, centre_rows=False),
         dict(centre_list=True, big_tbm=0, centre_rows=True, block_n=128),
         dict(centre_list=True, big_tbm=0, centre_rows=True, block_n=32),
         dict(centre_list=True, big_tbm=0, centre_rows=True, block_t=64, num_warps=4, splits=5)]


@pytest.mark.parametrize("knobs", KNOBS)
def test_every_blocking_gives_the_same_dest(knobs):
    s = make_state(2, 2, 777, 1500, 128, [[777, 700], [760, 600]], [[1500, 1400], [1300, 1200]],
                   dtype=torch.bfloat16, seed=12, noise=0.3)
    cls, due = classes(s, 300, 650)
    cls = without_near_ties(s, cls, 0.6)
    if knobs.get("big_tbm") == "median":
        nt = ((cls == 3) & due[..., None]).sum(-1).flatten().sort().values
        nt = nt[nt > 0]  # rows with TBM entries (a row not due has none)
        knobs = dict(knobs, big_tbm=int(nt[len(nt) // 2]))
        assert nt[0] < knobs["big_tbm"] <= nt[-1], nt  # both tiers have rows to serve
    want = mod.reference_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, 0.6)
    got = mod.triton_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, 0.6, **knobs)
    assert torch.equal(got, want) and int(((cls == 3) & (got >= 0)).sum()) > 0


@pytest.mark.parametrize("form", FORMS)
def test_exact_ties_go_to_the_smallest_centre(form):
    """Identical centre vectors across centre blocks: every identical TBM copy goes to the first of them (both forms
    of R: RECIP_NORMS; CENTRE_LIST's walk)."""
    s = make_state(1, 2, 300, 600, 128, [[300, 300]], [[600, 600]], dtype=torch.bfloat16, seed=8)
    cls, due = classes(s, 120, 250)
    centres = (cls[0, 0] == 2).nonzero()[:, 0]
    tbm = (cls[0, 0] == 3).nonzero()[:, 0]
    copies = torch.cat([centres[5:8], centres[-3:], tbm[:20]])  # centres in different blocks, and 20 TBM
    for f in ("keys", "values", "raw_keys"):
        s[f][0, 0, copies] = s[f][0, 0, centres[5]].clone()
    for tau in (0.0, 0.6):
        got = mod.triton_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau, **FORMS[form])
        want = mod.reference_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau)
        assert (got[0, 0, tbm[:20]] == centres[5]).all()
        assert torch.equal(got[0, 0, tbm[:20]], want[0, 0, tbm[:20]])


@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("tau", [0.0, 0.2, 1.0])
def test_matches_naive_model(pos, tau):
    from tests.kernels.test_ems_partition import run as partition
    from tests.kernels.test_ems_score import merged_rows
    rows = merged_rows(seed=2)
    s = N.to_state(rows, 37, 48, pos=pos)
    cls = partition(s, 8, gamma=2.0)
    sc = {f: t.cuda() for f, t in s.items()}
    due = torch.ones(2, 2, dtype=torch.bool, device="cuda")
    got = mod.triton_ems_redundancy(sc["keys"], sc["values"], sc["raw_keys"], cls.cuda(), due, tau).cpu()
    for b in range(2):
        for h in range(2):
            want = N.redundancy(rows[b][h], cls[b, h, :len(rows[b][h])].tolist(), tau, pos)
            assert got[b, h, :len(want)].tolist() == want


@pytest.mark.parametrize("form", ["recip", "list", "list-rows"])
def test_cuda_graph_and_op_dispatch(form, monkeypatch):
    """The launch captures in a CUDA graph; with KERNELS_CHECKED_ON_GPU the op's CUDA path is the kernel."""
    s = make_state(1, 2, 300, 600, 64, [[300, 280]], [[600, 550]], seed=9)
    cls, due = classes(s, 120, 250)
    cls = without_near_ties(s, cls, 0.6)
    out = mod.triton_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, 0.6, **FORMS[form])
    out.fill_(-7)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out2 = mod.triton_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, 0.6, **FORMS[form])
    out2.fill_(-7)  # poisoned: the replay writes every entry
    graph.replay()
    want = mod.reference_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, 0.6)
    assert torch.equal(out2, want)
    monkeypatch.setattr(mod, "KERNELS_CHECKED_ON_GPU", True)
    calls = []
    monkeypatch.setattr(mod, "triton_ems_redundancy", lambda *a: calls.append(1) or want)
    torch.ops.kvrewrite.ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau=0.6)
    assert calls == [1]
