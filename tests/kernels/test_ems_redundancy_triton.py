"""ems_redundancy's Triton kernel on the CPU, through Triton's interpreter (fp32: the 3.6 interpreter's 16-bit tl.dot
is wrong), against the reference and the float64 naive model (tests/kernels/ems_naive.py); 16-entry blocks so a few
dozen entries cross block boundaries.

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_ems_redundancy_triton.py`
(with Triton installed; skipped otherwise).
"""
import itertools
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels.ems_redundancy import reference_ems_redundancy, triton_ems_redundancy  # noqa: E402
from tests.kernels import ems_naive as N  # noqa: E402
from tests.kernels.test_ems_partition import run as partition  # noqa: E402
from tests.kernels.test_ems_redundancy import row_state  # noqa: E402
from tests.kernels.test_ems_score import merged_rows  # noqa: E402

SMALL = dict(block_t=16, block_n=16, splits=2)
WALKS = ((False, None), (True, False), (True, True))  # (centre_list, centre_rows): the entry walk, the list's two forms


def kernel(s, cls, tau, due=None, **knobs):
    due = torch.ones(s["fill"].shape, dtype=torch.bool) if due is None else due
    return triton_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau, **{**SMALL, **knobs})


@pytest.mark.parametrize("splits, recip, listed, by_rows", [(1, False, False, None), (3, False, False, None),
                                                         (3, True, False, None), (1, True, True, False),
                                                         (3, True, True, False), (1, True, True, True),
                                                         (3, True, True, True)],
                         ids=["1", "3", "3-recip", "1-list", "3-list", "1-list-rows", "3-list-rows"])
@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("tau", [0.0, 0.2, 1.0])
def test_matches_reference_and_naive(pos, tau, splits, recip, listed, by_rows):
    """dest equals the reference's and the float64 naive model's; recip: RECIP_NORMS' form (the TBM entry's norms
    applied after its walk), the same dest on these rows (no two R within a few ulps); listed: CENTRE_LIST's walk
    of the listed centres, as [TBM, centres] or (by_rows: LIST_CENTRE_ROWS) as [centres, TBM]."""
    rows = merged_rows(seed=2)
    g = torch.Generator().manual_seed(9)
    nz = lambda x: x + 0.1 * torch.randn(x.shape, generator=g, dtype=x.dtype)  # noqa: E731
    for rb in rows:
        for r in rb:
            for i in range(1, len(r), 2):
                r[i].key, r[i].raw, r[i].value = nz(r[i - 1].key * 1.5), nz(r[i - 1].raw * 0.5), nz(r[i - 1].value * 2)
    s = N.to_state(rows, 37, 48, pos=pos)
    cls = partition(s, 8, gamma=2.0)
    due = torch.tensor([[True, True], [False, True]])
    got = kernel(s, cls, tau, due, splits=splits, recip_norms=recip, centre_list=listed, centre_rows=by_rows)
    assert torch.equal(got, reference_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, tau))
    for b, h in itertools.product(range(2), range(2)):
        if not due[b, h]:
            assert (got[b, h] == -1).all()
            continue
        want = N.redundancy(rows[b][h], cls[b, h, :len(rows[b][h])].tolist(), tau, pos)
        assert got[b, h, :len(want)].tolist() == want
    assert ((got >= 0) & (cls == 3)).any() == (tau < 1)


def test_two_tiers_split_the_rows_by_their_count():
    """The default launch (no block_t / num_warps): rows with at least big_tbm TBM entries take the 128-row, 8-warp
    launch, the others the 32-row one; each launch skips the other's rows, and dest is the reference's."""
    rows = merged_rows(seed=4)
    s = N.to_state(rows, 37, 48, pos="without")
    cls = partition(s, 8, gamma=2.0)
    for h in range(cls.shape[1]):  # batch 0's rows keep 2 TBM entries (the others evicted): unequal counts
        cls[0, h, (cls[0, h] == 3).nonzero()[2:, 0]] = 4
    due = torch.ones(s["fill"].shape, dtype=torch.bool)
    nt = (cls == 3).sum(-1).flatten().sort().values
    cut = int(nt[len(nt) // 2])
    assert nt[0] > 0 and nt[0] < cut <= nt[-1], nt
    want = reference_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, 0.2)
    for big_tbm, (listed, rows) in itertools.product((cut, 0, 10**6), WALKS):  # split; every row big; every row small
        got = triton_ems_redundancy(s["keys"], s["values"], s["raw_keys"], cls, due, 0.2, block_n=16, splits=2,
                                    big_tbm=big_tbm, centre_list=listed, centre_rows=rows)
        assert torch.equal(got, want), (big_tbm, listed, rows)
    assert ((want >= 0) & (cls == 3)).any()


def test_programs_walk_every_tbm_block():
    """The main launch's P programs per (row, split) walk blocks p, p + P, ... up to the row's TBM count (a device
    value): one program for every block, a P that does not divide the blocks, and more programs than blocks give the
    reference's dest (rows of 50, 17 and 0 TBM entries: 4, 2 and no blocks of 16)."""
    g = torch.Generator().manual_seed(3)
    keys, values, raw = (torch.randn(1, 3, 61, 16, generator=g) for _ in range(3))
    cls = torch.full((1, 3, 61), 4, dtype=torch.int32)
    cls[..., :10] = 2
    cls[0, 0, 10:60], cls[0, 1, 10:27] = 3, 3
    due = torch.ones(1, 3, dtype=torch.bool)
    want = reference_ems_redundancy(keys, values, raw, cls, due, 0.1)
    for programs, (listed, rows) in itertools.product((1, 3, 64), WALKS):  # blocks past entry 15 hold no centre
        got = triton_ems_redundancy(keys, values, raw, cls, due, 0.1, **SMALL, programs=programs, centre_list=listed,
                                    centre_rows=rows)
        assert torch.equal(got, want), (programs, listed, rows)
    assert (want[0, 0, 42:60] >= 0).any() and (want[0, 1, 10:27] >= 0).any()  # merges in row 0's blocks 2-3 too


@pytest.mark.parametrize("recip, listed, rows", [(False, False, False), (True, False, False), (True, True, False),
                                                 (True, True, True)], ids=["divide", "recip", "list", "list-rows"])
def test_edge_rules(recip, listed, rows, monkeypatch):
    """Clamped negative cosines, >= tau at equality, ties to the lowest centre (identical vectors), zero norms; in
    both forms of R (RECIP_NORMS: the TBM entry's norms applied after its walk) and CENTRE_LIST's walk (both
    layouts: LIST_CENTRE_ROWS)."""
    import kvrewrite.kernels.ems_redundancy as er

    monkeypatch.setattr(er, "RECIP_NORMS", recip)
    monkeypatch.setattr(er, "CENTRE_LIST", listed)
    monkeypatch.setattr(er, "LIST_CENTRE_ROWS", rows)
    e = [([1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0]), ([-1.0, 0, 0, 0], [-1.0, 0, 0, 0], [0, -1.0, 0, 0])]
    s, cls = row_state(e, [2, 3])
    assert kernel(s, cls, 0.01)[0, 0].tolist() == [0, -1] and kernel(s, cls, 0.0)[0, 0].tolist() == [0, 0]
    e = [([1.0, 0, 0, 0], [1.0, 0, 0, 0], [1.0, 0, 0, 0]), ([2.0, 0, 0, 0], [3.0, 0, 0, 0], [1.0, 1.0, 1.0, 1.0])]
    s, cls = row_state(e, [2, 3])
    assert kernel(s, cls, 0.5)[0, 0].tolist() == [0, 0] and kernel(s, cls, 0.50001)[0, 0].tolist() == [0, -1]
    k = [1.0, 2.0, 3.0, 4.0]
    s, cls = row_state([(k, k, k)] * 40, [3, 2] + [2, 3] * 19)  # identical: the tie crosses centre blocks
    for splits in (1, 2):  # one split: the tie crosses blocks in the walk; two: in the splits' combine
        d = kernel(s, cls, 0.5, splits=splits)[0, 0].tolist()
        assert d == [1, 1] + [2 + 2 * i if j == 0 else 1 for i in range(19) for j in range(2)]
    e = [([1.0, 0, 0, 0], [1.0, 0, 0, 0], [1.0, 0, 0, 0]), ([0, 0, 0, 0], [0, 0, 0, 0], [1.0, 0, 0, 0])]
    s, cls = row_state(e, [2, 3])
    assert kernel(s, cls, 0.01)[0, 0].tolist() == [0, -1] and kernel(s, cls, 0.0)[0, 0].tolist() == [0, 0]
    e = [([1.0, 0, 0, 0], [0, 0, 1.0, 1.0], [1.0, 2.0, 0, 0]), ([0, 1.0, 0, 0], [0, 0, 1.0, 1.0], [1.0, 2.0, 0, 0])]
    s, cls = row_state(e, [2, 3], pos="without")
    assert kernel(s, cls, 0.9)[0, 0].tolist() == [0, 0]
    s, cls = row_state(e, [2, 3], pos="with")
    assert kernel(s, cls, 0.9)[0, 0].tolist() == [0, -1]


def test_centre_list_walks_only_listed_centres():
    """CENTRE_LIST: centres scattered among other classes, a list that is no multiple of the block and splits
    that leave a split empty give the reference's dest; its norms launch writes 1 / |x| of each listed centre (0 for
    a zero vector) and nothing past the row's count; centre_list with R divided per score is refused."""
    import kvrewrite.kernels.ems_redundancy as er

    g = torch.Generator().manual_seed(5)
    keys, values, raw = (torch.randn(2, 2, 83, 8, generator=g) for _ in range(3))
    cls = torch.randint(0, 5, (2, 2, 83), generator=g, dtype=torch.int32)
    cls[1, 1] = torch.where(cls[1, 1] == 2, 4, cls[1, 1])  # a row without a centre
    cls[1, 1, :3] = 3
    raw[0, 0, (cls[0, 0] == 2).nonzero()[0, 0]] = 0.0  # zero centres: a key, a value
    values[0, 1, (cls[0, 1] == 2).nonzero()[1, 0]] = 0.0
    due = torch.tensor([[True, True], [False, True]])
    wants = {}
    for tau in (0.0, 0.3):
        want = wants[tau] = reference_ems_redundancy(keys, values, raw, cls, due, tau)
        for (splits, bn), rows in itertools.product(((1, 16), (4, 16), (7, 4)), (False, True)):
            got = triton_ems_redundancy(keys, values, raw, cls, due, tau, block_t=16, block_n=bn, splits=splits,
                                        centre_list=True, centre_rows=rows)
            assert torch.equal(got, want), (tau, splits, bn, rows)
    assert (wants[0.0][1, 1, :3] == -1).all() and (wants[0.0][0, 0][cls[0, 0] == 3] >= 0).all()
    assert ((wants[0.3] >= 0) & (cls == 3)).any()
    rows, C = 4, 83
    clist = torch.full((rows, C), -5, dtype=torch.int32)
    nc = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    clist[0, :3] = torch.tensor([4, 0, 82])
    clist[2, :2] = torch.tensor([7, 8])
    clist[3, 0] = 9
    nt = torch.tensor([5, 5, 5, 0], dtype=torch.int32)  # row 3 holds under nt_lo TBM entries: not written
    a, v = raw.reshape(rows * C, 8).clone(), values.reshape(rows * C, 8).clone()
    a[4] = 0.0
    v[2 * C + 8] = 0.0
    inv = torch.full((2, rows, C), -3.0)
    er._centre_norms_kernel[(3, rows)](a, v, clist, nc, nt, inv[0], inv[1], C, 8, 1, BC=2, BLOCK_D=16)
    for row, k in ((0, 0), (0, 1), (0, 2), (2, 0), (2, 1)):
        e = row * C + int(clist[row, k])
        for x, i in ((a, 0), (v, 1)):
            n = x[e].norm()
            assert torch.allclose(inv[i, row, k], 1 / n if n > 0 else torch.tensor(0.0), rtol=1e-6), (row, k, i)
    written = torch.zeros(rows, C, dtype=torch.bool)
    written[0, :3] = written[2, :2] = True
    assert (inv[:, ~written] == -3.0).all()
    with pytest.raises(ValueError, match="recip_norms=False"):
        triton_ems_redundancy(keys, values, raw, cls, due, 0.3, centre_list=True, recip_norms=False)
    with pytest.raises(ValueError, match="centre_rows=True"):
        triton_ems_redundancy(keys, values, raw, cls, due, 0.3, centre_list=False, centre_rows=True)
