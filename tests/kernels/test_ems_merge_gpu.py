"""ems_merge's Triton kernels compiled on CUDA against the reference (same GPU) and the float64 naive model
(tests/kernels/ems_naive.py): random states with ragged fills, multi-slot (merged) entries, padding, rows not due,
gamma in {1, 4, inf} (and 1.25: the cap drops), tau in {0, 0.6, 1}, pos with/without, fp32/fp16/bf16, D 64/128,
three successive merges with ||a_j keys[lut_j]|| == n_j; outputs the op writes are poisoned before the launch
where the contract leaves them unspecified (staging is internal, so only the freed slots' reset is checked).

make_state builds the random states (also used by test_ems_redundancy_gpu.py and test_ems_compress_gpu.py).
"""
import itertools
import math

import pytest
import torch

from kvrewrite.kernels import _ems_merge_kernels as mk
from kvrewrite.kernels.ems_merge import reference_ems_merge
from kvrewrite.kernels.ems_partition import reference_ems_partition
from kvrewrite.kernels.ems_redundancy import reference_ems_redundancy
from kvrewrite.kernels.ems_score import reference_ems_score
from tests.kernels import ems_naive as N

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(mk.triton is None, reason="needs Triton"),
]

STATE = N.STATE_FIELDS
EXACT = ("bias", "slot_pos", "fill", "entry_start", "lut", "token_pos", "slot_order", "s_glo", "s_loc_past",
         "s_loc_cur", "slot_fill")


def make_state(B, H, C, R, D, fills, slots, dtype=torch.float32, pos="without", pads=None, l_win=4, dup=0.3,
               noise=0.2, seed=0, device="cuda"):
    """A random EMS state (docs/contracts/ems.md §3): row (b, h) holds fills[b][h] entries (pads[b] leading padding
    entries, bias -inf, one slot each), slots[b][h] slots in all; the last l_win entries and padding one slot each,
    the others 1 + a multinomial share of the rest (multi-slot entries carry key_scale != 1); head positions
    increase with the entry, member positions are the other distinct positions; a `dup` share of the entries are
    noisy copies (relative noise `noise`) of an earlier entry's key, raw key and value (so merges happen)."""
    g = torch.Generator().manual_seed(seed)
    s = {"keys": torch.zeros(B, H, C, D), "values": torch.zeros(B, H, C, D),
         "raw_keys": torch.zeros(B, H, C if pos == "without" else 0, D),
         "bias": torch.full((B, H, C), -math.inf), "slot_pos": torch.zeros(B, H, C, dtype=torch.int64),
         "fill": torch.zeros(B, H, dtype=torch.int64), "budget": torch.zeros(2, dtype=torch.int64),
         "entry_start": torch.zeros(B, H, C, dtype=torch.int32), "lut": torch.full((B, H, R), -1, dtype=torch.int32),
         "key_scale": torch.ones(B, H, R), "token_pos": torch.zeros(B, H, R, dtype=torch.int32),
         "slot_order": torch.full((B, H, R), -1, dtype=torch.int32), "s_glo": torch.zeros(B, H, R),
         "s_loc_past": torch.zeros(B, H, R), "s_loc_cur": torch.zeros(B, H, R),
         "slot_fill": torch.zeros(B, H, dtype=torch.int64)}
    for b, h in itertools.product(range(B), range(H)):
        f, S = fills[b][h], slots[b][h]
        p = pads[b] if pads else 0
        assert f <= C and S <= R and S >= f
        cnt = torch.ones(f, dtype=torch.long)
        n_old = max(f - l_win, p) - p  # entries that may hold several slots
        if n_old > 0 and S > f:
            cnt[p:p + n_old] += torch.bincount(torch.randint(0, n_old, (S - f,), generator=g), minlength=n_old)
        else:
            assert S == f
        start = torch.cumsum(cnt, 0) - cnt
        e_of = torch.repeat_interleave(torch.arange(f), cnt)
        tp = torch.randperm(4 * S, generator=g)[:S].int()
        heads = start
        tp[heads] = torch.sort(tp[heads]).values
        x = torch.randn(3, f, D, generator=g)
        copy = torch.rand(f, generator=g) < dup
        copy[0] = False
        src = (torch.rand(f, generator=g) * torch.arange(f)).long()  # an earlier entry
        x[:, copy] = x[:, src[copy]] * (1 + noise * torch.randn(3, int(copy.sum()), D, generator=g))
        s["keys"][b, h, :f], s["values"][b, h, :f] = x[0], x[2]
        if pos == "without":
            s["raw_keys"][b, h, :f] = x[1]
        s["bias"][b, h, p:f] = 0.0
        s["fill"][b, h], s["slot_fill"][b, h] = f, S
        s["entry_start"][b, h, :f] = start.int()
        s["lut"][b, h, :S] = e_of.int()
        s["token_pos"][b, h, :S] = tp
        s["slot_pos"][b, h, :f] = torch.zeros(f, dtype=torch.long).scatter_reduce(0, e_of, tp.long(), "amax")
        s["slot_order"][b, h, :S] = torch.argsort(tp).int()
        multi = (cnt > 1)[e_of]
        s["key_scale"][b, h, :S] = torch.where(multi, 0.5 + 1.5 * torch.rand(S, generator=g), 1.0)
        live = (e_of >= p).float()
        sc = torch.rand(3, S, generator=g) * torch.tensor([4.0, 1.0, 1.0])[:, None] * live
        s["s_glo"][b, h, :S], s["s_loc_past"][b, h, :S], s["s_loc_cur"][b, h, :S] = sc
    for f in ("keys", "values", "raw_keys"):
        s[f] = s[f].to(dtype)
    return {f: t.to(device) for f, t in s.items()}


def stages(s, bt, thr, l_win, pool, gamma, tau, due=None):
    """The references of 6.6-6.8 on s (so a merge test sees exactly the reference's inputs)."""
    s["budget"] = torch.tensor([bt, thr], device=s["keys"].device)
    due = s["fill"] >= s["budget"][1] if due is None else due
    g, gp = reference_ems_score(s["bias"], s["fill"], s["lut"], s["slot_order"], s["s_glo"], s["s_loc_past"],
                                s["s_loc_cur"], s["slot_fill"], due, l_win, pool)
    cls = reference_ems_partition(s["bias"], s["fill"], s["entry_start"], gp, due, s["budget"], l_win, gamma)
    dest = reference_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau)
    return g, gp, cls, dest, due


def norms_of(s):
    """n_j = key_scale_j * ||keys[lut_j]|| (fp64) by token position, per row."""
    out = {}
    B, H = s["fill"].shape
    for b, h in itertools.product(range(B), range(H)):
        sf = int(s["slot_fill"][b, h])
        lut = s["lut"][b, h, :sf].long()
        n = s["key_scale"][b, h, :sf].double() * s["keys"][b, h].double().norm(dim=-1)[lut]
        out[b, h] = dict(zip(s["token_pos"][b, h, :sf].tolist(), n.tolist()))
    return out


def merge_both(s, bt, thr, l_win, pool, gamma, tau, due=None):
    g, gp, cls, dest, due = stages(s, bt, thr, l_win, pool, gamma, tau, due)
    ref = {f: t.clone() for f, t in s.items()}
    old = {f: t.clone() for f, t in s.items()}
    reference_ems_merge(*(ref[f] for f in STATE), g, gp, cls, dest, due, gamma)
    mk.triton_ems_merge(*(s[f] for f in STATE), g, gp, cls, dest, due, gamma)
    return ref, old, cls, dest, due


def compare(s, ref, old, rtol):
    """Discrete fields and scores exactly; key_scale to rtol too (it is n_j over the norm of the stored new key,
    whose 16-bit rounding may differ by an ulp from the reference's fp64 one; ||a_j keys[lut_j]|| == n_j is checked
    on each state apart); keys/values/raw_keys of the kept entries to rtol (1e-6 in
    fp32; one rounding of the 16-bit dtypes), freed entries' rows as they were (never read); rows not due bit for
    bit (they are in EXACT and in old)."""
    for f in EXACT:
        assert torch.equal(s[f], ref[f]), f
    torch.testing.assert_close(s["key_scale"], ref["key_scale"], rtol=rtol, atol=rtol)
    kept = torch.arange(s["keys"].shape[2], device=s["keys"].device) < s["fill"][..., None]
    for f in ("keys", "values", "raw_keys"):
        if s[f].shape[2]:
            torch.testing.assert_close(s[f][kept].double(), ref[f][kept].double(), rtol=rtol, atol=rtol, msg=f)
            assert torch.equal(s[f][~kept], old[f][~kept]), f


RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("gamma,tau", [(4.0, 0.6), (1.0, 0.6), (math.inf, 0.0), (1.25, 0.6), (4.0, 1.0), (4.0, 0.0)])
def test_matches_reference_three_rounds(dtype, pos, gamma, tau):
    B, H, C, R, D = 2, 3, 517, 1201, 128 if dtype != torch.float16 else 64
    fills = [[517, 480, 300], [505, 511, 400]]  # 300 and 400: below the threshold (not due)
    slots = [[1180, 1000, 700], [900, 1201, 1100]]
    s = make_state(B, H, C, R, D, fills, slots, dtype=dtype, pos=pos, pads=[0, 17], seed=3)
    bt, thr = 220, 450
    merged = False
    for rnd in range(3):
        norms = norms_of(s)
        ref, old, cls, dest, due = merge_both(s, bt, thr, 4, 7, gamma, tau)
        compare(s, ref, old, RTOL[dtype])
        merged |= bool(((cls == 3) & (dest >= 0)).any())
        after = norms_of(s)
        for b, h in itertools.product(range(B), range(H)):  # ||a_j keys[lut_j]|| == n_j, every dtype
            for p, n in after[b, h].items():
                assert n == pytest.approx(norms[b, h][p], rel=2e-6)
        # grow every row by fresh single-slot entries so that the due rows are due again
        for b, h in itertools.product(range(B), range(H)):
            f, sf = int(s["fill"][b, h]), int(s["slot_fill"][b, h])
            n = min(C - f, R - sf, thr + 30 - f) if due[b, h] else 0
            if n <= 0:
                continue
            t0 = int(s["token_pos"][b, h].max()) + 1
            for name in ("keys", "values", "raw_keys"):
                if s[name].shape[2]:
                    s[name][b, h, f:f + n] = torch.randn(n, D, device="cuda").to(dtype)
            s["bias"][b, h, f:f + n] = 0.0
            s["entry_start"][b, h, f:f + n] = torch.arange(sf, sf + n, device="cuda", dtype=torch.int32)
            s["lut"][b, h, sf:sf + n] = torch.arange(f, f + n, device="cuda", dtype=torch.int32)
            s["token_pos"][b, h, sf:sf + n] = torch.arange(t0, t0 + n, device="cuda", dtype=torch.int32)
            s["slot_pos"][b, h, f:f + n] = torch.arange(t0, t0 + n, device="cuda")
            s["slot_order"][b, h, sf:sf + n] = torch.arange(sf, sf + n, device="cuda", dtype=torch.int32)
            for name in ("s_glo", "s_loc_past", "s_loc_cur"):
                s[name][b, h, :sf + n] = torch.rand(sf + n, device="cuda")
            s["fill"][b, h] += n
            s["slot_fill"][b, h] += n
    assert merged == (tau < 1 and gamma > 1)


@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("gamma,tau", [(4.0, 0.6), (1.5, 0.0), (math.inf, 0.2), (1.0, 0.2), (4.0, 1.0)])
def test_matches_naive_model(pos, gamma, tau):
    """Small naive-model rows (float64 Python lists) on the GPU, three rounds with appends."""
    from tests.kernels.test_ems_merge import grow, naive_step, rescore
    bt, l_win = 7, 2
    rows = N.random_rows(2, 2, 14, 8, pads=(0, 3), seed=1, dup=0.3)
    s = N.to_state(rows, 27, 45, pos=pos)
    for rnd in range(3):
        sc = {f: t.cuda() for f, t in s.items()}
        ref, old, cls, dest, due = merge_both(sc, bt, bt + 1, l_win, 3, gamma, tau)
        compare(sc, ref, old, 1e-6)
        s = {f: t.cpu() for f, t in sc.items()}
        rows = naive_step(rows, bt, l_win, 3, gamma, tau, pos)
        N.check_invariants(s, l_win=l_win, r_max=N.counts(bt, l_win, gamma)[2], bt=bt)
        N.assert_rows_close(N.from_state(s), rows, rtol=1e-5)
        grow(s, rows, 6, seed=10 + rnd, pos0=100 + 10 * rnd)
        rescore(s, rows, seed=20 + rnd)


def test_cuda_graph_capture():
    """The launches capture in a CUDA graph (no host read) and replay on a new state."""
    s = make_state(1, 2, 300, 700, 64, [[300, 290]], [[650, 600]], seed=5)
    g, gp, cls, dest, due = stages(s, 150, 280, 4, 7, 4.0, 0.6)
    work = {f: t.clone() for f, t in s.items()}
    mk.triton_ems_merge(*(work[f] for f in STATE), g, gp, cls, dest, due, 4.0)  # compile outside the capture
    for f in STATE:
        work[f].copy_(s[f])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mk.triton_ems_merge(*(work[f] for f in STATE), g, gp, cls, dest, due, 4.0)
    for f in STATE:
        work[f].copy_(s[f])
    graph.replay()
    ref = {f: t.clone() for f, t in s.items()}
    reference_ems_merge(*(ref[f] for f in STATE), g, gp, cls, dest, due, 4.0)
    compare(work, ref, s, 1e-6)


@pytest.mark.parametrize("gamma", [1.25, 80.0], ids=["cap-drops-most", "cap-drops-some"])
def test_slot_table_past_max_slots(gamma):
    """R = 36900 > MAX_SLOTS (a 32k prompt at batch 8 with chunks of 2048 has R = 36836): the kernels take it, the
    cap's bisection chunked (_kth_largest_chunked), and match the reference (which the op ran here before stop 41,
    30x slower)."""
    B, H, C, R, D = 1, 2, 600, 36900, 64
    assert R > mk.MAX_SLOTS
    s = make_state(B, H, C, R, D, [[560, 590]], [[36000, 36900]], dtype=torch.bfloat16, seed=5)
    assert mk.supports(s["keys"], s["lut"])
    ref, old, cls, dest, due = merge_both(s, 400, 450, 4, 7, gamma, 0.6)
    assert due.all() and bool(((cls == 3) & (dest >= 0)).any())
    compare(s, ref, old, RTOL[torch.bfloat16])
    assert (s["slot_fill"] < 36000).all()  # the cap dropped slots
