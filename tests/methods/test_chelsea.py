"""Chelsea (https://arxiv.org/abs/2506.11418): the paper's properties and kvrewrite's decisions.

Numbered as in the brief / the ChelseaMethod docstring:
 (1) merging identical keys is exact            (7) global top-r edge ranking across chunks
 (2) degrees sum to the tokens seen             (8) degree-weighted merge = mean of ORIGINAL tokens
 (3) compressed rows hold exactly B slots       (9) temporal order kept, merged slot_pos = max
 (4) sinks and recent slots bit-for-bit         (10) outlier heads never compressed, R' formula
 (5) the r schedule and the landing on B        (11) config validation
 (6) alternating A/B per chunk, intra-chunk edges only, chunks rebuilt every round
csm_round is also checked against a slow float64 transcription of the paper's CSM written here.
"""
import math
from fractions import Fraction

import pytest
import torch

import kvrewrite
from kvrewrite.context import LayerInfo
from kvrewrite.kernels import chelsea_compress as cc
from kvrewrite.kernels.chelsea_compress import chelsea_rows, csm_round
from kvrewrite.methods.chelsea import ChelseaMethod
from kvrewrite.state import allocate_layer_state

COMPRESS = torch.ops.kvrewrite.chelsea_compress.default
ATTEND = torch.ops.kvrewrite.clustered_attention.default
SCHED = dict(r_init=0.35, r_alpha=0.1, r_steps=2, r_min=0.1)  # the paper's Llama-3 schedule + our floor




# -- helpers -------------------------------------------------------------------------------------------
def state_from_rows(K, V, pos=None, C=None, bias=None):
    """A one-layer state [1, R, C, D] holding rows K, V [R, L, D] (degree 1 unless bias is given)."""
    R, L, D = K.shape
    C = max(C or L, L)
    s = allocate_layer_state(1, R, C, D, K.dtype, "cpu")
    s["keys"][0, :, :L] = K
    s["values"][0, :, :L] = V
    s["bias"][0, :, :L] = 0.0 if bias is None else bias
    s["slot_pos"][0, :, :L] = torch.arange(L) if pos is None else pos
    s["fill"].fill_(L)
    return s


def compress(s, target, threshold=None, n_sink=2, n_recent=3, chunk=8, outlier_heads=(), **sched):
    sc = {**SCHED, **sched}
    s["budget"].copy_(torch.tensor([target, target if threshold is None else threshold]))
    COMPRESS(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], s["budget"], n_sink, n_recent, chunk,
             sc["r_init"], sc["r_alpha"], sc["r_steps"], sc["r_min"], list(outlier_heads))


def append(s, k, v, t):
    """Append one token (k, v: [R, D]) at cache position t to every row of a batch-1 state."""
    torch.ops.kvrewrite.cache_append(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k[None, :, None],
                                     v[None, :, None], torch.tensor([t]), torch.ones(1, 1, dtype=torch.bool))


def attend(s, q, cp=10**6):
    return ATTEND(q, s["keys"], s["values"], s["bias"], s["slot_pos"], torch.tensor([cp] * q.shape[2]), q.shape[-1] ** -0.5, 0)


def row(s, h, b=0):
    n = int(s["fill"][b, h])
    return (s["keys"][b, h, :n], s["values"][b, h, :n], s["bias"][b, h, :n].exp().round(), s["slot_pos"][b, h, :n])


def naive_csm(K, V, n, pos, n_merge, chunk):
    """The paper's CSM round in float64, spelled out: chunks of `chunk` over the middle, A = 1st, 3rd..
    of each chunk, B = 2nd, 4th..; each A's edge to its most cosine-similar B of the same chunk; the
    n_merge most similar edges of all chunks kept; stars merged by degree into their B slot."""
    K, V, n = K.double(), V.double(), n.double()
    M = K.shape[0]
    Kn = K / K.norm(dim=-1, keepdim=True)
    edges = []
    for c0 in range(0, M, chunk):
        members = list(range(c0, min(c0 + chunk, M)))
        A, B = members[0::2], members[1::2]
        for a in A:
            if B:
                sims = [float(Kn[a] @ Kn[b]) for b in B]
                j = max(range(len(B)), key=lambda i: sims[i])
                edges.append((sims[j], a, B[j]))
    kept = sorted(edges, key=lambda e: -e[0])[:n_merge]
    star = {}
    for _, a, b in kept:
        star.setdefault(b, [b]).append(a)
    removed = {a for _, a, _ in kept}
    out = []
    for i in range(M):
        if i in removed:
            continue
        mem = star.get(i, [i])
        w = n[mem]
        out.append(((w[:, None] * K[mem]).sum(0) / w.sum(), (w[:, None] * V[mem]).sum(0) / w.sum(), w.sum(),
                    int(pos[mem].max())))
    return (torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out]),
            torch.tensor([o[2] for o in out]), torch.tensor([o[3] for o in out]))


# -- csm_round vs the float64 transcription ---------------------------------------------------------------
@pytest.mark.parametrize("M,chunk,n_merge", [(16, 8, 5), (23, 8, 9), (21, 3, 6), (9, 4, 4), (30, 7, 14), (5, 2, 3),
                                             (17, 16, 1), (33, 4, 30)])
def test_csm_round_matches_naive(M, chunk, n_merge):
    """Random keys (no ties), random degrees; 3 rows at once. Includes odd chunks, a short last chunk
    and a last chunk with a single (B-less) slot; n_merge above the edge count merges every edge.
    fp32 vs float64: |k|, |v| ~ 1 after a few fp32 ops: 1e-5 is ~100 ulps, a wrong member is O(0.1)."""
    g = torch.Generator().manual_seed(M * 100 + chunk)
    R, D = 3, 16
    K, V = torch.randn(R, M, D, generator=g), torch.randn(R, M, D, generator=g)
    n = torch.randint(1, 5, (R, M), generator=g).float()
    pos = torch.randint(0, 1000, (R, M), generator=g)
    Ko, Vo, no, po = csm_round(K, V, n, pos, n_merge, chunk)
    for r in range(R):
        Ke, Ve, ne, pe = naive_csm(K[r], V[r], n[r], pos[r], n_merge, chunk)
        assert torch.equal(no[r].double(), ne) and torch.equal(po[r], pe)
        torch.testing.assert_close(Ko[r].double(), Ke, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(Vo[r].double(), Ve, atol=1e-5, rtol=1e-5)


# -- (1) exactness on identical keys ---------------------------------------------------------------------
def grouped_row(sizes, D, g, n_sink=2, n_recent=3):
    """Sinks + middle made of consecutive groups of identical (key, value) pairs + recent; every group
    has its own random direction, so identical members have cosine 1 and different groups well below."""
    K, V = [torch.randn(n_sink, D, generator=g)], [torch.randn(n_sink, D, generator=g)]
    for s in sizes:
        k, v = torch.randn(1, D, generator=g), torch.randn(1, D, generator=g)
        K.append(k.expand(s, D))
        V.append(v.expand(s, D))
    K.append(torch.randn(n_recent, D, generator=g))
    V.append(torch.randn(n_recent, D, generator=g))
    return torch.cat(K), torch.cat(V)


@pytest.mark.parametrize("case", ["one_round", "multi_round"])
def test_merging_identical_keys_is_exact(case, monkeypatch):
    """(1) Paper Eq. 2: replacing n identical (k, v) by one slot with bias log n changes nothing.
    one_round: r = 0.5, chunk 8, each chunk laid out [pair | A-B-A triple | single | pair] so one CSM
    round merges every duplicate (4 of 8). multi_round: the default decreasing schedule, one chunk over
    the middle (so no group straddles a boundary), random group sizes 1-5: several rounds, stars merging
    already-merged slots, all of it still exact.
    Tolerance: fp32 attention of the same tokens in two layouts: (3k)/3 != k by an ulp and exp(x + log 3)
    != 3 exp(x) by an ulp, so ~1e-7; any merge of two different groups moves the output by >= 1e-2."""
    g = torch.Generator().manual_seed(7)
    D, R = 32, 2
    if case == "one_round":
        sizes = [2, 3, 1, 2] * 4
        sched, chunk = dict(r_init=0.5, r_alpha=0.0, r_steps=0, r_min=0.5), 8
    else:
        sizes = torch.randint(1, 6, (30,), generator=g).tolist()
        sched, chunk = SCHED, 1024
    rows = [grouped_row(sizes, D, g) for _ in range(R)]
    K, V = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    L = K.shape[1]
    target = 2 + len(sizes) + 3
    s = state_from_rows(K, V)
    full = state_from_rows(K, V)
    calls = []
    orig = cc.csm_round
    monkeypatch.setattr(cc, "csm_round", lambda *a: calls.append(a[4]) or orig(*a))  # count the rounds
    compress(s, target, chunk=chunk, **sched)
    assert (len(calls) == 1) if case == "one_round" else (len(calls) >= 4), calls
    assert (s["fill"] == target).all()
    for h in range(R):
        _, _, deg, _ = row(s, h)
        assert deg[2:-3].tolist() == [float(x) for x in sizes]  # each group became one slot of degree |group|
    q = torch.randn(1, 2 * R, 5, D, generator=g) * 2
    torch.testing.assert_close(attend(s, q), attend(full, q), atol=1e-6, rtol=1e-6)
    # non-vacuous: dropping the log-degree bias breaks the equality
    s["bias"].masked_fill_(s["bias"] > -math.inf, 0.0)
    assert (attend(s, q) - attend(full, q)).abs().max() > 1e-2
    assert L > target


# -- (2), (8), (9): degrees, degree-weighted centroids, positions, over several compressions -------------------
def test_centroids_are_means_of_original_tokens_over_many_calls():
    """Values are one-hot token ids (values never steer the clustering), so a slot's value vector reads
    out exactly which original tokens it stands for (entries 1/n). After a post-prefill compression
    and several decode-time ones: members partition the tokens seen, degree == |members| (so degrees
    sum to the tokens seen), key == mean of the members' ORIGINAL keys, slot_pos == max member."""
    N, L0, target, g_int = 64, 40, 16, 4
    g = torch.Generator().manual_seed(11)
    R = 2
    keys = torch.randn(R, N, N, generator=g) + 0.8 * torch.randn(R, 1, N, generator=g)  # correlated, like real keys
    ids = torch.eye(N).expand(R, N, N)
    s = state_from_rows(keys[:, :L0], ids[:, :L0], C=target + g_int)
    s["fill"].fill_(L0)
    compress(s, target, target + g_int, n_sink=2, n_recent=3, chunk=8)
    n_calls = 1
    for t in range(L0, N):
        append(s, keys[:, t], ids[:, t], t)
        if int(s["fill"][0, 0]) >= target + g_int:
            n_calls += 1
        compress(s, target, target + g_int, n_sink=2, n_recent=3, chunk=8)
        for h in range(R):
            k, v, deg, pos = row(s, h)
            seen = t + 1
            assert int(deg.sum()) == seen  # (2)
            v = v[:, :seen]
            members = v > 0
            assert torch.equal(members.sum(0), torch.ones(seen, dtype=torch.long))  # a partition of the tokens
            assert torch.equal(members.sum(1).float(), deg)
            torch.testing.assert_close(v, members / deg[:, None], atol=1e-6, rtol=0)  # entries exactly 1/n
            for j in range(len(deg)):
                mem = members[j].nonzero().squeeze(1)
                torch.testing.assert_close(k[j], keys[h, mem].mean(0), atol=1e-5, rtol=1e-5)  # (8)
                assert int(pos[j]) == int(mem.max())  # (9)
    assert n_calls >= 5
    assert int(deg.max()) >= 4  # stars of merged slots really happened


def test_temporal_order_centroid_takes_b_place():
    """(9) One chunk [0..7]: A slot 6 merges into B slot 1. The centroid sits at 1's place (order of the
    B slots kept), its slot_pos is 6 (the largest member), and the others keep their order."""
    D = 16
    K = torch.eye(D)[:8].clone()
    K[6] = K[1]
    V = torch.randn(8, D)
    n = torch.ones(1, 8)
    Ko, Vo, no, po = csm_round(K[None], V[None], n, torch.arange(8)[None], 1, 8)
    assert po[0].tolist() == [0, 6, 2, 3, 4, 5, 7]
    assert no[0].tolist() == [1, 2, 1, 1, 1, 1, 1]
    torch.testing.assert_close(Vo[0, 1], (V[1] + V[6]) / 2)


# -- (3) and (4): the size after compression, protected slots ---------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("L,target", [(60, 20), (41, 40), (100, 12)])
def test_exact_target_and_protected_slots_bit_for_bit(L, target, dtype):
    """(3) fill == target, and exactly target non-empty slots; (4) the first n_sink and last n_recent
    valid slots come out bit-for-bit (left pads, 0 / 4 / 2 slots in the three rows, are not sinks).
    Middle slots carry degrees of earlier compressions."""
    n_sink, n_recent, pads = 3, 5, [0, 4, 2]
    g = torch.Generator().manual_seed(L)
    R, D, S = 3, 16, L + 4
    K = torch.randn(R, S, D, generator=g).to(dtype)
    V = torch.randn(R, S, D, generator=g).to(dtype)
    bias = torch.randint(1, 4, (R, S), generator=g).float().log()
    bias[:, :n_sink + 4] = 0.0
    bias[:, -n_recent:] = 0.0
    for h, p in enumerate(pads):
        bias[h, :p] = -math.inf
    s = state_from_rows(K, V, pos=torch.arange(S) * 3, bias=bias)
    before = {k: v.clone() for k, v in s.items()}
    compress(s, target, n_sink=n_sink, n_recent=n_recent, chunk=8)
    assert (s["fill"] == target).all()
    assert ((s["bias"] > -math.inf).sum(-1) == target).all()
    for h, p in enumerate(pads):
        for f in ("keys", "values", "bias", "slot_pos"):
            assert torch.equal(s[f][0, h, :n_sink], before[f][0, h, p:p + n_sink]), f
            assert torch.equal(s[f][0, h, target - n_recent:target], before[f][0, h, S - n_recent:]), f


# -- (5) the r schedule --------------------------------------------------------------------------------
def expected_schedule(L, target, n_sink, n_recent, r_init, r_alpha, r_steps, r_min):
    """Removed per round, in exact arithmetic: r_i = max(r_init - alpha*min(m, i), r_min) and
    n_i = min(max(1, floor(r_i * M_i)), L_i - B)."""
    r_init, r_alpha, r_min = (Fraction(str(x)) for x in (r_init, r_alpha, r_min))
    out, i = [], 0
    while L > target:
        M = L - n_sink - n_recent
        r = max(r_init - r_alpha * min(r_steps, i), r_min)
        k = min(max(1, math.floor(r * M)), L - target)
        out.append(k)
        L -= k
        i += 1
    return out


SCHEDULES = [SCHED, dict(r_init=0.45, r_alpha=0.05, r_steps=3, r_min=0.1),  # the paper's Llama-3, Llama-2
             dict(r_init=0.2, r_alpha=0.1, r_steps=2, r_min=0.05), dict(r_init=0.25, r_alpha=0.0, r_steps=0, r_min=0.25)]


@pytest.mark.parametrize("sched", SCHEDULES, ids=["llama3", "llama2", "qwen_floor", "const_0.25"])
def test_r_schedule_per_round(sched, monkeypatch):
    """(5) chelsea_rows removes n_i slots at round i (the schedule restarts at 0 in every call) and the
    last round lands exactly on B. The CSM round is replaced by a stub that removes exactly the
    n_merge it is given, so the loop is checked over many lengths quickly; the real round is below."""
    seen = []

    def stub(K, V, n, pos, n_merge, chunk):
        seen.append(n_merge)
        return K[:, n_merge:], V[:, n_merge:], n[:, n_merge:], pos[:, n_merge:]

    monkeypatch.setattr(cc, "csm_round", stub)
    for L in range(20, 320, 7):
        for target in (12, L // 5, L - 1):
            if target < 10:
                continue
            seen.clear()
            K = torch.zeros(1, L, 1)
            Ko, _, _, _ = chelsea_rows(K, K, K[..., 0], K[..., 0].long(), target, 4, 6, 256, **sched)
            assert seen == expected_schedule(L, target, 4, 6, **sched), (L, target)
            assert Ko.shape[1] == target


def test_r_schedule_real_rounds(monkeypatch):
    """(5) with the real CSM round on random keys: each round removes exactly n_i, 35%, 25%, 15%, 15%...
    of the middle, and the row ends at B. M0 = 80 is a case where r*M is an exact integer (0.25 * 52)."""
    calls = []
    orig = cc.csm_round

    def spy(K, V, n, pos, n_merge, chunk):
        out = orig(K, V, n, pos, n_merge, chunk)
        calls.append((K.shape[1], n_merge, out[0].shape[1]))
        return out

    monkeypatch.setattr(cc, "csm_round", spy)
    L, target, n_sink, n_recent = 90, 22, 4, 6
    K = torch.randn(2, L, 16)
    Ko, Vo, no, po = chelsea_rows(K, K, torch.ones(2, L), torch.arange(L).expand(2, L), target, n_sink, n_recent, 16,
                                  **SCHED)
    assert [c[1] for c in calls] == expected_schedule(L, target, n_sink, n_recent, **SCHED)
    assert [c[1] for c in calls][:3] == [28, 13, 5]  # floor(.35*80), floor(.25*52), floor(.15*39)
    assert all(M - k == out for M, k, out in calls)  # every round removed exactly what it was asked
    assert Ko.shape[1] == target and int(no.sum(1)[0]) == L


# -- (6) partition and edges ---------------------------------------------------------------------------
def test_no_edge_across_chunks():
    """(6) chunk 4: slot 3 (B of chunk 0) and slot 4 (A of chunk 1) are identical, every other pair is far
    apart. One merge is made, and it is not 4 -> 3: edges stay inside their chunk."""
    D = 16
    g = torch.Generator().manual_seed(0)
    K = torch.eye(D)[:8] + 0.3 * torch.randn(8, D, generator=g)
    K[4] = K[3]
    Ko, _, no, po = csm_round(K[None], K[None], torch.ones(1, 8), torch.arange(8)[None], 1, 4)
    assert no.shape[1] == 7
    merged = po[0][no[0] == 2].tolist()
    assert len(merged) == 1 and merged[0] not in (3, 4)
    assert 3 in po[0].tolist() and 4 in po[0].tolist()
    # the same keys with a chunk of 8: 4 (A) -> 3 (B) is now allowed, and it is the best edge
    _, _, no, po = csm_round(K[None], K[None], torch.ones(1, 8), torch.arange(8)[None], 1, 8)
    assert po[0].tolist() == [0, 1, 2, 4, 5, 6, 7] and no[0, 3] == 2


def test_a_slots_never_pair_with_a_slots():
    """(6) Slots 0 and 2 (both A) are near-identical (cos 0.99995) and slot 1 (B) only moderately similar
    to them (cos 0.45, a hair more to 0 than to 2): the one merge is 0 -> 1 (an A -> B edge), never 0
    with 2, whatever their similarity."""
    D = 16
    e = torch.eye(D)
    K = torch.stack([e[0], e[1] + 0.5 * e[0], e[0] + 0.01 * e[6], e[3], e[4], e[5] + 0.1 * e[4]])
    Ko, _, no, po = csm_round(K[None], K[None], torch.ones(1, 6), torch.arange(6)[None], 1, 8)
    assert po[0].tolist() == [1, 2, 3, 4, 5]  # 0 merged into 1 (slot_pos max(0, 1) = 1), 2 kept
    assert no[0].tolist() == [2, 1, 1, 1, 1]
    torch.testing.assert_close(Ko[0, 0], (K[0] + K[1]) / 2)


def test_alternation_restarts_in_every_chunk():
    """(6) chunk 3 over 6 slots: chunks [0 1 2] [3 4 5]; with the restart A = {0, 2, 3, 5}, B = {1, 4}.
    Slots 3, 4, 5 are near-identical, chunk 0 is not: two merges make the star {3, 5} -> 4 (one slot at
    4's place, degree 3, slot_pos 5). A global parity (B = {1, 3, 5}) could merge only one of them."""
    D = 16
    g = torch.Generator().manual_seed(1)
    K = torch.eye(D)[:6].clone()
    base = torch.randn(D, generator=g)
    K[3:6] = base + 0.01 * torch.randn(3, D, generator=g)
    _, _, no, po = csm_round(K[None], K[None], torch.ones(1, 6), torch.arange(6)[None], 2, 3)
    assert po[0].tolist() == [0, 1, 2, 5]
    assert no[0].tolist() == [1, 1, 1, 3]


def test_chunks_rebuilt_every_round(monkeypatch):
    """(6) Every round re-chunks the shrunken middle (chunk boundaries move), it does not keep the first
    round's boundaries. Sinks 2, recent 3, middle m0..m7, chunk 4, constant r = 0.25: round 0 removes 2,
    round 1 removes 1 (L 13 -> 11 -> 10). Keys: m0 = m1 = u, m2 = m3 = m4 = w, m5 = (w + x) / sqrt 2,
    m6, m7, u, w, x orthogonal.
    Round 0, chunks [m0 m1 m2 m3] [m4 m5 m6 m7]: the two cosine-1 edges m0 -> m1, m2 -> m3 (m4 -> m5 is
    0.71). Survivors c01 c23 m4 m5 m6 m7.
    Round 1, re-chunked: [c01 c23 m4 m5] [m6 m7]; m4 is an A slot of c23's chunk, m4 -> c23 (cosine 1)
    wins: degrees 2, 3, 1, 1, 1. With fixed boundaries ([c01 c23] [m4 m5 m6 m7]) m4 could never reach
    c23 and the merge would be m4 -> m5: degrees 2, 2, 2, 1, 1."""
    D = 16
    e = torch.eye(D)
    u, w, x = e[0], e[1], e[2]
    mid = torch.stack([u, u, w, w, w, (w + x) / 2 ** 0.5, e[3], e[4]])
    K = torch.cat([e[10:12], mid, e[12:15]])[None]  # sinks and recent slots orthogonal to everything
    V = torch.randn(1, 13, D, generator=torch.Generator().manual_seed(0))
    s = state_from_rows(K, V)
    calls = []
    orig = cc.csm_round
    monkeypatch.setattr(cc, "csm_round", lambda *a: calls.append((a[0].shape[1], a[4])) or orig(*a))
    compress(s, 10, n_sink=2, n_recent=3, chunk=4, r_init=0.25, r_alpha=0.0, r_steps=0, r_min=0.25)
    assert calls == [(8, 2), (6, 1)]  # two rounds, the second over the 6-slot middle
    k, v, deg, pos = row(s, 0)
    assert deg[2:-3].tolist() == [2, 3, 1, 1, 1]  # fixed boundaries: [2, 2, 2, 1, 1]
    assert pos[2:-3].tolist() == [1 + 2, 4 + 2, 5 + 2, 6 + 2, 7 + 2]  # the star {m2, m3, m4} at m3's place
    torch.testing.assert_close(k[3], w)
    torch.testing.assert_close(v[3], V[0, 4:7].mean(0))


# -- (7) global ranking ----------------------------------------------------------------------------------
def test_edges_ranked_globally_across_chunks():
    """(7) Chunk 0 holds near-duplicates, chunk 1 unrelated keys: all 4 merges go to chunk 0 (a per-chunk
    quota would split them 2 + 2)."""
    D = 32
    g = torch.Generator().manual_seed(2)
    K = torch.randn(16, D, generator=g)
    K[:8] = torch.randn(D, generator=g) + 0.05 * torch.randn(8, D, generator=g)
    _, _, no, po = csm_round(K[None], K[None], torch.ones(1, 16), torch.arange(16)[None], 4, 8)
    kept = po[0].tolist()
    assert sum(p < 8 for p in kept) == 4 and sum(p >= 8 for p in kept) == 8
    assert int(no[0, :4].sum()) == 8


# -- real model: (2), (3), (4), (10) in a generate -----------------------------------------------------------
def test_generate_degrees_budget_outliers(llama):
    """Tiny llama (2 layers x 2 KV heads), batch of 2 with a left-padded row, outlier head (layer 0, head 1).
    At every step: degrees of every row sum to that row's tokens seen (pads excluded); a compressed row
    that just shrank holds exactly B = round(R' (n + Γ)) slots with R' = (R H - H_out) / (H - H_out);
    sinks are the row's first real positions and recent slots its last; the outlier row is never
    compressed (every slot degree 1); fill <= capacity; decode-time compressions happen."""
    R, n, pad1, gamma, interval = 0.5, 40, 5, 24, 4
    rw = kvrewrite.apply(llama, "chelsea", budget=R, max_length=64, batch_size=2, prefill_chunk=8, n_sink=2,
                         n_recent=4, chunk=8, interval=interval, outlier_heads={0: [1]})
    H, H_out = 4, 1
    r_prime = (R * H - H_out) / (H - H_out)
    assert rw.method.compressed_budget() == pytest.approx(r_prime)
    B = round(r_prime * (n + gamma))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (2, n), generator=g)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :pad1] = 0
    real = torch.tensor([n, n - pad1])
    logits = rw.prefill(ids, mask, max_new_tokens=gamma)
    prev_fill = {}
    decode_compressions = 0
    for step in range(gamma):
        seen = real + step
        for li in range(2):
            st = rw.layer_state(li)
            assert int(st["budget"][0]) == B and int(st["budget"][1]) == B + interval
            assert (st["fill"] <= rw.capacities[li]).all()
            for b in range(2):
                for h in range(2):
                    fill = int(st["fill"][b, h])
                    bias = st["bias"][b, h, :fill]
                    deg = bias.exp().round()
                    assert int(deg.sum()) == int(seen[b]), (step, li, b, h)
                    pos = st["slot_pos"][b, h, :fill][bias > -math.inf]
                    last = n - 1 + step
                    if (li, h) == (0, 1):  # outlier: every token kept exactly
                        assert ((bias == 0) | (bias == -math.inf)).all()
                        assert pos.tolist() == list(range(n - int(real[b]), last + 1))
                        continue
                    assert fill < B + interval
                    if (li, b, h) in prev_fill and fill < prev_fill[(li, b, h)]:
                        assert fill == B  # just compressed: exactly the budget
                        decode_compressions += 1
                    prev_fill[(li, b, h)] = fill
                    first = n - int(real[b])
                    assert pos[:2].tolist() == [first, first + 1]  # sinks
                    assert pos[-4:].tolist() == list(range(last - 3, last + 1))  # recent
                    assert (deg[:2] == 1).all() and (deg[-4:] == 1).all()
                    assert int(deg.max()) > 1  # this row was compressed
        assert torch.isfinite(logits).all()
        logits = rw.decode_step(logits.argmax(-1))
    # 6 compressed rows (batch 2 x (1 head of layer 0 + 2 of layer 1)), each back to B every g of 23 appends
    assert decode_compressions >= 6 * ((gamma - 1) // interval)
    assert rw.capacities[0] == 64 + 8 - 1  # the outlier's layer holds every token


# -- (10) R' and outlier validation, (11) config validation ---------------------------------------------------------
def layers(*kv):
    """LayerInfo list: an int is a full-attention layer with that many KV heads, ('w', k) a sliding one."""
    return [LayerInfo(i, 8, k[1], 16, 128) if isinstance(k, tuple) else LayerInfo(i, 8, k, 16, 0)
            for i, k in enumerate(kv)]


@pytest.mark.parametrize("R,outliers", [(0.2, {0: [0]}), (0.5, {0: [0, 1], 2: [3]}), (0.5, {}), (0.25, {2: [1]})])
def test_outlier_budget_reallocation(R, outliers):
    """(10) R' = (R H - H_out) / (H - H_out) over KV heads of full-attention layers only (the sliding
    layer 1 does not count), so that the average budget over all heads stays R; targets use R'."""
    m = ChelseaMethod(budget=R, outlier_heads=outliers)
    m.bind(layers(4, ("w", 4), 4))
    H, O = 8, sum(len(v) for v in outliers.values())
    rp = (R * H - O) / (H - O)
    assert m.compressed_budget() == pytest.approx(rp)
    assert (O * 1 + (H - O) * m.compressed_budget()) / H == pytest.approx(R)
    assert m.target(1000, 200) == round(rp * 1200)
    call = m.compression_call(LayerInfo(0, 8, 4, 16, 0))
    assert call[1]["outlier_heads"] == outliers.get(0, [])


@pytest.mark.parametrize("outliers,msg", [({1: [0]}, "not a full-attention layer"), ({0: [4]}, "no KV heads"),
                                          ({5: [0]}, "not a full-attention layer"),
                                          ({0: [0, 1, 2, 3], 2: [0, 1]}, "leave no budget")])
def test_outlier_validation(outliers, msg):
    with pytest.raises(ValueError, match=msg):
        ChelseaMethod(budget=0.2, outlier_heads=outliers).bind(layers(4, ("w", 4), 4))


@pytest.mark.parametrize("kw,field", [
    (dict(budget=0), "budget"), (dict(budget=1.5), "budget"), (dict(budget="0.2"), "budget"),
    (dict(interval=0), "interval"), (dict(interval=2.0), "interval"),
    (dict(n_sink=-1), "n_sink"), (dict(n_recent=1.5), "n_recent"),
    (dict(chunk=1), "chunk"), (dict(chunk=8.0), "chunk"),
    (dict(r_init=0.0), "r_init"), (dict(r_init=0.6), "r_init"),
    (dict(r_min=0.0), "r_min"), (dict(r_min=0.51), "r_min"),
    (dict(r_alpha=-0.1), "r_alpha"), (dict(r_steps=-1), "r_steps"), (dict(r_steps=1.5), "r_steps"),
])
def test_config_validation_names_the_field(kw, field):
    """(11) Bad options raise ValueError whose message names the offending field."""
    with pytest.raises(ValueError, match=field):
        ChelseaMethod(**kw)
    with pytest.raises(ValueError, match=field):  # the same through the registry (what apply() uses)
        kvrewrite.methods.make_method("chelsea", **kw)


def test_generation_too_small_for_protected_slots():
    m = ChelseaMethod(budget=0.1, n_sink=16, n_recent=64)
    m.bind(layers(4))
    with pytest.raises(ValueError, match="n_sink"):
        m.check_generation(500, 100)  # B = 60 < 16 + 64 + 2
    m.check_generation(900, 100)  # B = 100 fits
    with pytest.raises(ValueError, match="unknown_option"):
        kvrewrite.methods.make_method("chelsea", unknown_option=1)
