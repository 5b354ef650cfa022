"""kvrewrite::evict_by_score: the state read through `order` against the rule of packing the kept slots in temporal
order (tests/kernels/evict_by_score_naive.py, row by row), and the compaction writing only the holes."""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels.evict_by_score import reference_evict_by_score
from tests.kernels.evict_by_score_naive import (PER_SLOT, check_view, expected_row, packed_evict, packed_reference,
                                                same, temporal)
from tests.kernels.test_evict_to_budget import filled_state

OP = torch.ops.kvrewrite.evict_by_score.default
FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "score", "order")


def state_args(s) -> tuple:
    """The op's state arguments: keys, values, bias, slot_pos, fill, budget, score, order."""
    return (*(s[f] for f in FIELDS[:5]), s["budget"], s["score"], s["order"])


def shuffle(s, seed) -> None:
    """Lay each row's ranks [0, fill) out in random slots, in place: the temporal view (`temporal`) is unchanged."""
    g = torch.Generator().manual_seed(seed)
    B, H, C = s["order"].shape
    for b in range(B):
        for h in range(H):
            n = min(int(s["fill"][b, h]), C)
            slot = torch.arange(C) + s["order"][b, h].long()
            new = torch.arange(C)
            new[:n] = torch.randperm(n, generator=g)
            for f in PER_SLOT:
                s[f][b, h, new[:n]] = s[f][b, h, slot[:n]].clone()
            s["order"][b, h] = (new - torch.arange(C)).int()


def scored_state(B, H, C, D, fills, target, threshold, pads=None, seed=0, ties=False, dtype=torch.float32,
                 shuffled=False):
    """filled_state plus a score per slot (0 past the fill and on padding, as accumulate_attention leaves it) and
    `order`: the identity (zeros), or with `shuffled` each row's slots in use laid out in random order."""
    s = filled_state(B, H, C, D, fills, target, threshold, dtype=dtype, pads=pads, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    score = torch.randint(0, 4, (B, H, C), generator=g).float() if ties else torch.rand(B, H, C, generator=g)
    s["score"] = score.masked_fill(s["bias"] == -math.inf, 0.0)
    s["order"] = torch.zeros(B, H, C, dtype=torch.int32)
    if shuffled:
        shuffle(s, seed + 2)
    return s


def call(s, n_recent, recent_ratio=0.0, pool=1, reset_score=False):
    OP(*state_args(s), n_recent, recent_ratio, pool, reset_score)


def check(before, after, settings):
    """`after` (the op on `before`) against packed_evict on `before`'s temporal view; rows not due untouched."""
    want = temporal(before)
    packed_evict(want, *settings)
    check_view(after, want)
    due = before["fill"] >= before["budget"][1]
    for f in FIELDS:
        assert same(after[f][~due], before[f][~due]), f"{f} changed on a row not due"


CASES = [  # B, H, C, D, fills, target, threshold, pads
    (1, 1, 12, 4, [[12]], 6, 10, None),
    (2, 3, 24, 8, [[24, 20, 9], [22, 24, 18]], 7, 18, [0, 3]),
    (3, 2, 40, 16, [[40, 31], [35, 40], [12, 38]], 16, 30, [5, 0, 2]),
    (2, 2, 16, 4, [[16, 16], [16, 16]], 12, 16, [9, 0]),  # row 0: 7 valid <= target, only the padding goes
]
SETTINGS = [  # n_recent, recent_ratio, pool, reset_score: snapkv-like, h2o-like, mixed, everything recent
    (3, 0.0, 7, True), (0, 0.5, 1, False), (2, 0.25, 3, False), (20, 0.0, 1, True), (0, 0.0, 5, False),
]


@pytest.mark.parametrize("B,H,C,D,fills,target,threshold,pads", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda v: str(v))
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("shuffled", [False, True], ids=["in_order", "shuffled"])
def test_view_matches_the_packed_rule(B, H, C, D, fills, target, threshold, pads, settings, ties, shuffled):
    s = scored_state(B, H, C, D, fills, target, threshold, pads=pads, seed=C + target, ties=ties, shuffled=shuffled)
    before = {f: t.clone() for f, t in s.items()}
    call(s, *settings)
    check(before, s, settings)


def append(states, T, seed) -> None:
    """T decode-like steps on each state of `states` (any layouts): a token at each row's fill (cache_append's
    slot, whose rank is the fill too), the same keys, values and next position in every state, and the same random
    score added to every valid rank (through each state's order)."""
    g = torch.Generator().manual_seed(seed)
    B, H, C, D = states[0]["keys"].shape
    for _ in range(T):
        add = torch.randint(0, 3, (B, H, C), generator=g).float() / 4  # coarse: ties keep coming
        k, v = torch.randn(2, B, H, D, generator=g).to(states[0]["keys"].dtype)
        for st in states:
            slot = torch.arange(C) + st["order"].long()
            valid = st["bias"].gather(2, slot) > -math.inf
            st["score"].scatter_add_(2, slot, add.masked_fill(~valid, 0.0))
            for b in range(B):
                for h in range(H):
                    j = int(st["fill"][b, h])
                    st["keys"][b, h, j], st["values"][b, h, j] = k[b, h], v[b, h]
                    st["bias"][b, h, j], st["slot_pos"][b, h, j] = 0.0, int(st["slot_pos"][b, h].max()) + 1
            st["fill"] += 1


@pytest.mark.parametrize("settings", [(2, 0.0, 3, True), (0, 0.5, 1, False)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_calls_in_a_row_with_appends(settings, dtype):
    """Four compressions with tokens appended in between: the layout drifts from temporal (holes filled from the
    end), the view stays the packed rule's, bit for bit, and `order` stays a permutation of each row's slots."""
    s = scored_state(2, 2, 30, 8, [[24, 20], [24, 22]], 10, 20, pads=[0, 3], seed=5, ties=True, dtype=dtype)
    want = temporal(s)
    for step in range(4):
        call(s, *settings)
        packed_evict(want, *settings)
        check_view(s, want)
        append([s, want], 12, seed=step)
    assert not bool((s["order"] == 0).all())  # the layout is no longer temporal


@pytest.mark.parametrize("scores", ["special", "mostly_minus_inf"])
@pytest.mark.parametrize("settings", [(0, 0.5, 1, False), (2, 0.0, 3, True), (1, 0.25, 7, False)],
                         ids=lambda v: str(v))
def test_view_matches_the_old_reference_on_special_scores(scores, settings):
    """NaN, +-inf and -0.0 scores, and rows with fewer older scores above -inf than the older slots kept (a -inf
    threshold, where the stable sort counts the row's padding ranks too): beyond the row rule, against the op's
    tensor code from before `order` (packed_reference), bit for bit, over calls in a row with appends."""
    s = scored_state(2, 2, 40, 8, [[40, 38], [36, 40]], 16, 36, pads=[0, 3], seed=9, shuffled=True,
                     dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(10)
    if scores == "special":
        values = torch.tensor([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, -math.nan, 2.5])
        s["score"] = values[torch.randint(0, len(values), (2, 2, 40), generator=g)]
    else:
        s["score"] = s["score"].masked_fill(torch.rand(2, 2, 40, generator=g) < 0.85, -math.inf)
        s["score"][1, 0] = -math.inf  # whatever the pooling: a -inf threshold, behind 3 padding ranks
    s["bias"][0, 0, 7] = -math.inf  # a padding slot among the older ones
    want = temporal(s)
    short = False
    for step in range(3):
        due = s["fill"] >= s["budget"][1]
        call(s, *settings)
        packed_reference(*(want[f] for f in FIELDS[:5]), want["budget"], want["score"], *settings)
        check_view(s, want)
        short |= bool((due & (s["fill"] < s["budget"][0])).any())
        append([s, want], 12, seed=step)
    assert short or scores == "special", "no row kept fewer than B: the -inf threshold case is not reached"


def holes_and_movers(before, b, h, settings) -> tuple[list, list]:
    """(holes, movers) of a due row, from the rule: the slots below the kept count K not kept, and the kept slots
    at or past K, each in slot order (the j-th mover fills the j-th hole)."""
    kept = expected_row(temporal(before), b, h, int(before["budget"][0]), *settings[:3])
    slot = torch.arange(before["order"].shape[-1]) + before["order"][b, h].long()
    kept_slots = {int(slot[r]) for r in kept}
    K = len(kept)
    return [j for j in range(K) if j not in kept_slots], sorted(j for j in kept_slots if j >= K)


def test_only_the_holes_are_written():
    """The point of `order`: keys and values change only in the holes, each receiving its mover's; every other
    slot (kept in place, freed, or a mover's source) keeps its keys and values bit for bit, and the moves are at
    most the slots evicted."""
    settings = (2, 0.25, 3, False)
    s = scored_state(2, 3, 40, 8, [[40, 36, 30], [33, 40, 38]], 24, 33, pads=[0, 4], seed=21, shuffled=True)
    before = {f: t.clone() for f, t in s.items()}
    call(s, *settings)
    moved = 0
    for b in range(2):
        for h in range(3):
            if int(before["fill"][b, h]) < 33:
                continue
            holes, movers = holes_and_movers(before, b, h, settings)
            assert len(holes) == len(movers) <= int(before["fill"][b, h]) - int(s["fill"][b, h])
            moved += len(holes)
            src = torch.arange(40)
            src[holes] = torch.tensor(movers, dtype=torch.long)
            for f in ("keys", "values"):
                assert same(s[f][b, h], before[f][b, h, src]), (f, b, h, holes, movers)
    assert moved > 0


def test_budget_exact_per_head_and_window_kept():
    """Every due row ends with exactly B slots (more valid ones than B), its R most recent valid slots among them."""
    s = scored_state(2, 4, 48, 8, [[48] * 4, [40, 41, 42, 43]], 20, 40, pads=[0, 6], seed=11, shuffled=True)
    before = temporal(s)
    call(s, 5, 0.0, 7, True)
    after = temporal(s)
    assert torch.equal(s["fill"], torch.full((2, 4), 20))
    for b in range(2):
        for h in range(4):
            n = int(before["fill"][b, h])
            assert torch.equal(after["slot_pos"][b, h, 15:20], before["slot_pos"][b, h, n - 5:n])


def test_zeroed_order_is_the_identity():
    """A freshly allocated or reset state (order all 0) is in temporal order: the op's result read through order
    equals the rule's on the raw state."""
    s = scored_state(2, 2, 20, 8, [[20, 14], [18, 20]], 8, 14, pads=[2, 0], seed=3, dtype=torch.bfloat16)
    assert bool((s["order"] == 0).all())
    before = {f: t.clone() for f, t in s.items()}
    call(s, 2, 0.0, 3, False)
    want = {f: t.clone() for f, t in before.items()}
    packed_evict(want, 2, 0.0, 3, False)
    check_view(s, want)


def test_no_host_reads():
    """The op reads nothing on the host (CUDA graphs can capture it, no step syncs): it runs on fake tensors, where
    any .item() / nonzero / int(tensor) would raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    s = scored_state(2, 2, 16, 4, [[16, 12], [16, 16]], 6, 12, pads=[0, 2])
    with FakeTensorMode() as mode:
        fake = {f: mode.from_tensor(t) for f, t in s.items()}
        reference_evict_by_score(*state_args(fake), 2, 0.5, 3, True)


def test_bad_arguments_are_named():
    s = scored_state(1, 1, 8, 4, [[8]], 4, 6)
    with pytest.raises(ValueError, match="pool must be an odd int >= 1"):
        call(s, 1, 0.0, 4)
    with pytest.raises(ValueError, match="recent_ratio in \\[0, 1\\]"):
        call(s, 1, 1.5)
    s["order"] = s["order"].long()
    with pytest.raises(ValueError, match="order must be int32"):
        call(s, 1)
    s["order"] = s["order"].int()
    s["score"] = s["score"].double()
    with pytest.raises(ValueError, match="score must be fp32"):
        call(s, 1)


def test_opcheck():
    s = scored_state(2, 2, 16, 8, [[12, 5], [16, 9]], 6, 9, pads=[0, 2], shuffled=True)
    torch.library.opcheck(OP, (*state_args(s), 2, 0.25, 3, True))
