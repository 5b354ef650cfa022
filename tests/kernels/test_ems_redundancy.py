"""kvrewrite::ems_redundancy against the float64 naive model (tests/kernels/ems_naive.py) and the properties of
docs/contracts/ems.md §6.8 / §9."""
import itertools

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from tests.kernels import ems_naive as N
from tests.kernels.test_ems_partition import run as partition
from tests.kernels.test_ems_score import merged_rows

OP = torch.ops.kvrewrite.ems_redundancy.default


def run(s, cls, tau, due=None):
    due = torch.ones(s["fill"].shape, dtype=torch.bool) if due is None else due
    return OP(s["keys"], s["values"], s["raw_keys"], cls, due, tau=tau)


def row_state(entries, cls, pos="without"):
    """One row of single-token entries from (post key, pre key, value) lists; cls as a [1, 1, C] int32 tensor."""
    rows = [[[N.single(torch.tensor(k), torch.tensor(r), torch.tensor(v), i)
              for i, (k, r, v) in enumerate(entries)]]]
    return N.to_state(rows, len(entries), len(entries), pos=pos), torch.tensor([[cls]], dtype=torch.int32)


@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("tau", [0.0, 0.05, 0.2, 1.0])
def test_matches_naive_model(pos, tau):
    rows = merged_rows(seed=2)
    g = torch.Generator().manual_seed(9)
    nz = lambda x: x + 0.1 * torch.randn(x.shape, generator=g, dtype=x.dtype)  # noqa: E731  (no exact ties)
    for rb in rows:  # redundant pairs: every other entry is a scaled noisy copy of the one before
        for r in rb:
            for i in range(1, len(r), 2):
                r[i].key, r[i].raw, r[i].value = nz(r[i - 1].key * 1.5), nz(r[i - 1].raw * 0.5), nz(r[i - 1].value * 2)
    s = N.to_state(rows, 32, 48, pos=pos)
    cls = partition(s, 8, gamma=2.0)
    dest = run(s, cls, tau)
    merges = 0
    for b, h in itertools.product(range(2), range(2)):
        want = N.redundancy(rows[b][h], cls[b, h, :len(rows[b][h])].tolist(), tau, pos)
        assert dest[b, h, :len(want)].tolist() == want
        assert (dest[b, h, len(want):] == -1).all()
        merges += sum(1 for i, d in enumerate(want) if d >= 0 and d != i)
    assert (merges > 0) == (tau < 1)


def test_negative_cosines_never_merge():
    """cos_k = cos_v = -1: the product is 1 but clamped to 0, so only tau = 0 merges it."""
    e = [([1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0]), ([-1.0, 0, 0, 0], [-1.0, 0, 0, 0], [0, -1.0, 0, 0])]
    s, cls = row_state(e, [2, 3])
    assert run(s, cls, 0.01)[0, 0].tolist() == [0, -1]
    assert run(s, cls, 0.0)[0, 0].tolist() == [0, 0]


def test_threshold_at_equality():
    """R = 1 * 0.5 exactly in fp32: tau = 0.5 merges (>=), the next float does not."""
    e = [([1.0, 0, 0, 0], [1.0, 0, 0, 0], [1.0, 0, 0, 0]), ([2.0, 0, 0, 0], [3.0, 0, 0, 0], [1.0, 1.0, 1.0, 1.0])]
    s, cls = row_state(e, [2, 3])
    assert run(s, cls, 0.5)[0, 0].tolist() == [0, 0]
    assert run(s, cls, 0.50001)[0, 0].tolist() == [0, -1]


def test_tau_one_and_zero():
    """Identical entries: tau = 1 sends them to the zero class; tau = 0 merges every TBM."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3, 4, generator=g).tolist()
    e = [tuple(base)] * 3 + [tuple(torch.randn(3, 4, generator=g).tolist()) for _ in range(3)]
    s, cls = row_state(e, [2, 3, 3, 3, 3, 1])
    assert run(s, cls, 1.0)[0, 0].tolist() == [0, -1, -1, -1, -1, 5]
    d = run(s, cls, 0.0)[0, 0].tolist()
    assert d[:3] == [0, 0, 0] and d[3:5] == [0, 0] and d[5] == 5


def test_ties_go_to_the_lowest_centre():
    k = [1.0, 2.0, 3.0, 4.0]
    e = [(k, k, k)] * 4
    s, cls = row_state(e, [3, 2, 2, 3])
    assert run(s, cls, 0.5)[0, 0].tolist() == [1, 1, 2, 1]


def test_without_uses_raw_keys_with_uses_keys():
    """Identical pre-RoPE keys and values but orthogonal post-RoPE keys: merged only in "without"."""
    e = [([1.0, 0, 0, 0], [0, 0, 1.0, 1.0], [1.0, 2.0, 0, 0]), ([0, 1.0, 0, 0], [0, 0, 1.0, 1.0], [1.0, 2.0, 0, 0])]
    s, cls = row_state(e, [2, 3], pos="without")
    assert run(s, cls, 0.9)[0, 0].tolist() == [0, 0]
    s, cls = row_state(e, [2, 3], pos="with")
    assert s["raw_keys"].shape[2] == 0
    assert run(s, cls, 0.9)[0, 0].tolist() == [0, -1]


def test_zero_norm_gives_cosine_zero():
    e = [([1.0, 0, 0, 0], [1.0, 0, 0, 0], [1.0, 0, 0, 0]), ([0, 0, 0, 0], [0, 0, 0, 0], [1.0, 0, 0, 0])]
    s, cls = row_state(e, [2, 3])
    assert run(s, cls, 0.01)[0, 0].tolist() == [0, -1]
    assert run(s, cls, 0.0)[0, 0].tolist() == [0, 0]


def test_rows_not_due_and_classes():
    s = N.to_state(merged_rows(seed=4), 32, 48)
    cls = partition(s, 8, gamma=1.5)
    due = torch.tensor([[True, False], [False, True]])
    d = run(s, cls, 0.0, due=due)
    assert (d[~due] == -1).all()
    ar = torch.arange(32).expand(2, 2, 32)
    kept = (cls == 1) | (cls == 2)
    assert torch.equal(d[due][kept[due]], ar[due][kept[due]])
    dead = (cls == 0) | (cls == 4)
    assert (d[due][dead[due]] == -1).all()


def test_errors():
    s = N.to_state(N.random_rows(1, 1, 4, 4), 8, 8)
    cls = torch.zeros(1, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="tau must be in"):
        run(s, cls, 1.5)
    with pytest.raises(ValueError, match="cls must be torch.int32"):
        run(s, cls.long(), 0.5)


def test_opcheck():
    s = N.to_state(merged_rows(seed=5), 32, 48)
    cls = partition(s, 8)
    torch.library.opcheck(OP, (s["keys"], s["values"], s["raw_keys"], cls, torch.tensor([[True, False], [True, True]])),
                          dict(tau=0.1))


def test_blocks_of_tbm_rows_agree(monkeypatch):
    """The reference walks the TBM rows in blocks (bounded temporaries): a block size that splits the row gives the
    same dest."""
    from kvrewrite.kernels import ems_redundancy as mod
    s = N.to_state(merged_rows(seed=6), 32, 48)
    cls = partition(s, 8, gamma=3.0)
    want = run(s, cls, 0.05)
    monkeypatch.setattr(mod, "BLOCK", 5)
    assert torch.equal(run(s, cls, 0.05), want) and (want[cls == 3] >= 0).any()
