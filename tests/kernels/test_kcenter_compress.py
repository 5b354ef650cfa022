"""kvrewrite::kcenter_compress (contract docs/contracts/clustergen.md §3.3) against a naive model written here: per
row, the valid slots in order, the last ℓ = floor(recent_ratio·B) kept, and k = B - ℓ centres of the others by a
plain-Python greedy farthest-point loop in float64 (start: the first candidate; ties: the lowest index)."""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)

OP = torch.ops.kvrewrite.kcenter_compress.default
FIELDS = ("keys", "values", "bias", "slot_pos", "fill")


def naive_greedy(points, k):
    """Indices (into points, a list of float64 vectors) of greedy k-center: start at 0, then the farthest point from
    the chosen ones (strictly farther replaces: ties keep the lowest index)."""
    chosen = [0] if points and k > 0 else []
    while len(chosen) < min(k, len(points)):
        best, best_d = None, -1.0
        for i, x in enumerate(points):
            if i in chosen:
                continue
            d = min(float(((x - points[c]) ** 2).sum()) for c in chosen)
            if d > best_d:
                best, best_d = i, d
        chosen.append(best)
    return chosen


def naive_kept(keys, bias, fill, b, h, B, recent_ratio):
    """The slots row (b, h) keeps, in slot order."""
    valid = [j for j in range(int(fill[b, h])) if bias[b, h, j] > -math.inf]
    V = len(valid)
    if V <= B:
        return valid
    ell = math.floor(recent_ratio * B)
    cand = valid[:V - ell]
    centres = naive_greedy([keys[b, h, j].double() for j in cand], B - ell)
    return sorted([cand[i] for i in centres] + valid[V - ell:])


def make_state(B, Hkv, C, D, fills, target, threshold, dtype=torch.float32, pads=None, seed=0, integer=False):
    """Row (b, h) holds fills[b][h] slots (pads[b] leading padding slots, bias -inf), positions 100..; bias log of
    degrees (it must become 0 on the kept slots); slots past the fill hold garbage. integer: small integer keys
    (exact distances: ties are real ties)."""
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randint(-3, 4, (B, Hkv, C, D), generator=g).float() if integer
            else torch.randn(B, Hkv, C, D, generator=g)).to(dtype)
    s = dict(keys=keys, values=torch.randn(B, Hkv, C, D, generator=g).to(dtype),
             bias=torch.randint(1, 4, (B, Hkv, C), generator=g).float().log(),
             slot_pos=(100 + torch.arange(C)).repeat(B, Hkv, 1), fill=torch.as_tensor(fills, dtype=torch.int64),
             budget=torch.tensor([target, threshold]))
    for b in range(B):
        for h in range(Hkv):
            s["bias"][b, h, int(s["fill"][b, h]):] = -math.inf
            if pads is not None:
                s["bias"][b, h, :pads[b]] = -math.inf
    return s


def call(s, recent_ratio):
    OP(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], s["budget"], recent_ratio=recent_ratio)


def check(s, recent_ratio):
    """Run the op on s and compare every row to the naive model; returns the state before."""
    before = {k: v.clone() for k, v in s.items()}
    call(s, recent_ratio)
    target, threshold = (int(x) for x in before["budget"])
    B, H, C, _ = s["keys"].shape
    for b in range(B):
        for h in range(H):
            what = f"row ({b}, {h}) fill {int(before['fill'][b, h])} B {target} recent_ratio {recent_ratio}"
            if before["fill"][b, h] < threshold:  # not due: untouched bit for bit, garbage past the fill included
                for f in FIELDS:
                    assert torch.equal(s[f][b, h], before[f][b, h]), f"{what}: {f} changed"
                continue
            kept = naive_kept(before["keys"], before["bias"], before["fill"], b, h, target, recent_ratio)
            n = len(kept)
            assert int(s["fill"][b, h]) == n, what
            for f in ("keys", "values", "slot_pos"):
                assert torch.equal(s[f][b, h, :n], before[f][b, h, kept]), f"{what}: {f} of the kept slots"
                assert torch.equal(s[f][b, h, n:], before[f][b, h, n:]), f"{what}: {f} of the freed slots moved"
            assert (s["bias"][b, h, :n] == 0).all() and (s["bias"][b, h, n:] == -math.inf).all(), what
    return before


@pytest.mark.parametrize("recent_ratio", [0.5, 0.25, 0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_naive_greedy(dtype, recent_ratio):
    """Rows at, above and below the threshold, one with fewer valid slots than B (left padding), B = 7 (odd)."""
    fills = [[16, 13], [21, 9]]  # at, below, above (a prefill chunk overshoots), below
    s = make_state(2, 2, 24, 8, fills, 7, 16, dtype, pads=[0, 15], seed=1)
    check(s, recent_ratio)


def test_ties_go_to_the_lowest_index():
    """Integer keys in 2 dims with many exact ties (duplicates and equidistant points) over several seeds: the
    naive model's strict-greater scan keeps the lowest index, so every tie must break the same way."""
    for seed in range(6):
        s = make_state(1, 3, 20, 2, [[20, 18, 20]], 6, 18, seed=10 + seed, integer=True)
        s["keys"][0, 0, :5] = s["keys"][0, 0, 0]  # duplicates of the start point: distance 0
        check(s, 0.34)


def test_ties_explicit():
    """Points on a line 0, +2, -2, +1, -1 (the last one recent): from 0 the first tie (+2 at slot 1, -2 at slot 2)
    goes to slot 1; then -2 (distance 4) is farthest."""
    keys = torch.tensor([0.0, 2.0, -2.0, 1.0, -1.0, 5.0])[None, None, :, None].repeat(1, 1, 1, 4)
    s = make_state(1, 1, 6, 4, [[6]], 4, 6)
    s["keys"] = keys
    call(s, 0.25)  # B 4: ℓ = 1 (slot 5), k = 3 of slots 0..4: 0, then 1 (tie with 2), then 2
    assert int(s["fill"][0, 0]) == 4 and s["slot_pos"][0, 0, :4].tolist() == [100, 101, 102, 105]


def test_last_ell_exact_and_first_kept():
    """Whatever the keys, the last ℓ valid slots and the first valid one (the start point, the attention sink) are
    kept; fill = B."""
    s = make_state(2, 2, 40, 16, [[40, 33], [37, 40]], 12, 30, pads=[3, 0], seed=2)
    before = check(s, 0.5)
    for b in range(2):
        for h in range(2):
            valid = [j for j in range(int(before["fill"][b, h])) if before["bias"][b, h, j] > -math.inf]
            pos = s["slot_pos"][b, h, :12].tolist()
            assert int(s["fill"][b, h]) == 12
            assert pos[0] == 100 + valid[0] and pos[6:] == [100 + j for j in valid[-6:]]


def test_few_valid_slots_keep_all_and_drop_padding():
    """V <= B: every valid slot kept, packed in order, the left padding and the holes dropped, fill = V."""
    s = make_state(2, 1, 16, 4, [[12], [16]], 10, 12, pads=[4, 7], seed=3)
    s["bias"][1, 0, 9] = -math.inf  # a hole
    before = check(s, 0.5)
    assert s["fill"].tolist() == [[8], [8]]
    assert s["slot_pos"][1, 0, :8].tolist() == [100 + j for j in (7, 8, 10, 11, 12, 13, 14, 15)]
    assert torch.equal(s["keys"][0, 0, :8], before["keys"][0, 0, 4:12])


def test_nothing_due_changes_nothing():
    s = make_state(1, 2, 10, 4, [[5, 9]], 4, 10, seed=4)
    check(s, 0.5)


def test_errors():
    s = make_state(1, 1, 8, 4, [[8]], 4, 8)
    with pytest.raises(ValueError, match="recent_ratio must be in"):
        call(s, 1.5)
    with pytest.raises(ValueError, match="fill must be torch.int64"):
        OP(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"].int(), s["budget"], recent_ratio=0.5)


def test_opcheck():
    s = make_state(2, 2, 12, 4, [[12, 7], [10, 12]], 5, 10, pads=[0, 2], seed=5)
    torch.library.opcheck(OP, tuple(s[f] for f in FIELDS + ("budget",)), dict(recent_ratio=0.5))
