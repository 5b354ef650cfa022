"""kvrewrite::evict_by_score against a row-by-row Python implementation of its rule (the module docstring)."""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels.evict_by_score import reference_evict_by_score
from tests.kernels.test_evict_to_budget import filled_state

OP = torch.ops.kvrewrite.evict_by_score.default
FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "score")


def scored_state(B, H, C, D, fills, target, threshold, pads=None, seed=0, ties=False, dtype=torch.float32):
    """filled_state plus a score per slot (0 past the fill and on padding, as accumulate_attention leaves it)."""
    s = filled_state(B, H, C, D, fills, target, threshold, dtype=dtype, pads=pads, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    score = torch.randint(0, 4, (B, H, C), generator=g).float() if ties else torch.rand(B, H, C, generator=g)
    s["score"] = score.masked_fill(s["bias"] == -math.inf, 0.0)
    return s


def call(s, n_recent, recent_ratio=0.0, pool=1, reset_score=False):
    OP(*(s[f] for f in FIELDS[:5]), s["budget"], s["score"], n_recent, recent_ratio, pool, reset_score)


def expected_row(before, b, h, target, n_recent, recent_ratio, pool):
    """The slots a due row keeps, in order: plain Python over the row's valid slots."""
    n = int(before["fill"][b, h])
    valid = [j for j in range(n) if before["bias"][b, h, j] > -math.inf]
    L = len(valid)
    if L <= target:
        return valid
    R = min(n_recent + math.floor(recent_ratio * target), target)
    old = valid[:L - R]
    raw = [float(before["score"][b, h, j]) for j in old]
    half = pool // 2
    pooled = [max(raw[max(0, i - half):i + half + 1]) for i in range(len(old))]
    ranked = sorted(range(len(old)), key=lambda i: (-pooled[i], i))  # ties: the earlier slot
    heavy = sorted(old[i] for i in ranked[:target - R])
    return heavy + valid[L - R:]


def check(before, after, target, threshold, n_recent, recent_ratio, pool, reset_score):
    B, H = before["fill"].shape
    for b in range(B):
        for h in range(H):
            if int(before["fill"][b, h]) < threshold:  # untouched, bit for bit
                assert all(torch.equal(before[f][b, h], after[f][b, h]) for f in FIELDS), (b, h)
                continue
            kept = expected_row(before, b, h, target, n_recent, recent_ratio, pool)
            L = len(kept)
            assert int(after["fill"][b, h]) == L, (b, h)
            for f in ("keys", "values", "bias", "slot_pos"):
                assert torch.equal(after[f][b, h, :L], before[f][b, h, kept]), (f, b, h)
            score = torch.zeros(L) if reset_score else before["score"][b, h, kept]
            assert torch.equal(after["score"][b, h, :L], score), (b, h)
            assert bool((after["bias"][b, h, L:] == -math.inf).all()) and bool((after["score"][b, h, L:] == 0).all())


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
@pytest.mark.parametrize("n_recent,recent_ratio,pool,reset_score", SETTINGS, ids=lambda v: str(v))
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_matches_the_row_rule(B, H, C, D, fills, target, threshold, pads, n_recent, recent_ratio, pool, reset_score,
                              ties):
    s = scored_state(B, H, C, D, fills, target, threshold, pads=pads, seed=C + target, ties=ties)
    before = {f: t.clone() for f, t in s.items()}
    call(s, n_recent, recent_ratio, pool, reset_score)
    check(before, s, target, threshold, n_recent, recent_ratio, pool, reset_score)


def test_budget_exact_per_head_and_window_kept():
    """Every due row ends with exactly B slots (more valid ones than B), its R most recent valid slots among them."""
    s = scored_state(2, 4, 48, 8, [[48] * 4, [40, 41, 42, 43]], 20, 40, pads=[0, 6], seed=11)
    before = {f: t.clone() for f, t in s.items()}
    call(s, 5, 0.0, 7, True)
    assert torch.equal(s["fill"], torch.full((2, 4), 20))
    for b in range(2):
        for h in range(4):
            n = int(before["fill"][b, h])
            last5 = before["slot_pos"][b, h, n - 5:n]
            assert torch.equal(s["slot_pos"][b, h, 15:20], last5)


def test_bf16_state():
    s = scored_state(2, 2, 20, 8, [[20, 14], [18, 20]], 8, 14, pads=[2, 0], seed=3, dtype=torch.bfloat16)
    before = {f: t.clone() for f, t in s.items()}
    call(s, 2, 0.0, 3, False)
    check(before, s, 8, 14, 2, 0.0, 3, False)


def test_no_host_reads():
    """The op reads nothing on the host (CUDA graphs can capture it, no step syncs): it runs on fake tensors, where
    any .item() / nonzero / int(tensor) would raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    s = scored_state(2, 2, 16, 4, [[16, 12], [16, 16]], 6, 12, pads=[0, 2])
    with FakeTensorMode() as mode:
        fake = {f: mode.from_tensor(t) for f, t in s.items()}
        reference_evict_by_score(*(fake[f] for f in FIELDS[:5]), fake["budget"], fake["score"], 2, 0.5, 3, True)


def test_bad_arguments_are_named():
    s = scored_state(1, 1, 8, 4, [[8]], 4, 6)
    with pytest.raises(ValueError, match="pool must be an odd int >= 1"):
        call(s, 1, 0.0, 4)
    with pytest.raises(ValueError, match="recent_ratio in \\[0, 1\\]"):
        call(s, 1, 1.5)
    s["score"] = s["score"].double()
    with pytest.raises(ValueError, match="score must be fp32"):
        call(s, 1)


def test_opcheck():
    s = scored_state(2, 2, 16, 8, [[12, 5], [16, 9]], 6, 9, pads=[0, 2])
    torch.library.opcheck(OP, (*(s[f] for f in FIELDS[:5]), s["budget"], s["score"], 2, 0.25, 3, True))
