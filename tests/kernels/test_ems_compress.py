"""kvrewrite::ems_compress (the whole compression: score, partition, redundancy, merge) against the float64 naive
model (tests/kernels/ems_naive.py) and the properties of docs/contracts/ems.md §6.5 / §9."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import kvrewrite  # noqa: F401  (registers the ops)
from tests.kernels import ems_naive as N

OP = torch.ops.kvrewrite.ems_compress.default
STATE = N.STATE_FIELDS


def compress(s, l_win=2, pool=3, gamma=2.0, tau=0.2):
    OP(*(s[f] for f in STATE), l_win=l_win, pool=pool, gamma=gamma, tau=tau)


def attention_history(rows, n_heads=2, l_win=2, seed=0):
    """Scores of a causal prefill from float64 dense attention: each row's n_heads query heads (GQA group) attend
    to the row's tokens; s_glo = the column sums over every query, s_loc_past = over the last l_win queries."""
    g = torch.Generator().manual_seed(seed)
    for row in itertools.chain.from_iterable(rows):
        toks = [e.members[0] for e in row]
        K = torch.stack([t.k_post for t in toks])
        glo, loc = torch.zeros(len(toks), dtype=torch.float64), torch.zeros(len(toks), dtype=torch.float64)
        for t in range(len(toks)):
            q = torch.randn(n_heads, K.shape[1], generator=g, dtype=torch.float64)
            p = torch.softmax((q @ K[:t + 1].T) / math.sqrt(K.shape[1]), -1).sum(0)
            glo[:t + 1] += p
            if t >= len(toks) - l_win:
                loc[:t + 1] += p
        for t, a, b in zip(toks, glo.float().double(), loc.float().double()):
            t.s_glo, t.s_loc_past, t.s_loc_cur = float(a), float(b), 0.0


def test_tau_one_is_pure_eviction_by_the_global_local_score():
    """tau = 1: the kept entries are the window plus the top N_imp by pooled g (g from a float64 attention
    history, Eq. 2), their K/V bit-identical, no merged slots."""
    bt, l_win, pool, n = 8, 3, 3, 20
    rows = N.random_rows(1, 2, n, 8, seed=1)
    attention_history(rows, l_win=l_win)
    s = N.to_state(rows, 24, 48, budget=(bt, bt + 4))
    old = {k: v.clone() for k, v in s.items()}
    compress(s, l_win=l_win, pool=pool, gamma=2.0, tau=1.0)
    for h in range(2):
        toks = [e.members[0] for e in rows[0][h]]
        glo = torch.tensor([t.s_glo for t in toks], dtype=torch.float64)
        loc = torch.tensor([t.s_loc_past for t in toks], dtype=torch.float64)
        g = torch.maximum(loc.sum() / glo.sum() * glo, loc)
        pooled = F.avg_pool1d(g[:n - l_win].view(1, 1, -1), pool, 1, pool // 2).view(-1)
        top = sorted(torch.argsort(pooled, descending=True)[:bt - l_win].tolist())
        kept = top + list(range(n - l_win, n))
        assert s["token_pos"][0, h, :bt].tolist() == kept
        assert torch.equal(s["keys"][0, h, :bt], old["keys"][0, h, kept])
        assert torch.equal(s["values"][0, h, :bt], old["values"][0, h, kept])
        assert torch.equal(s["raw_keys"][0, h, :bt], old["raw_keys"][0, h, kept])
    assert s["fill"].tolist() == [[bt, bt]] and s["slot_fill"].tolist() == [[bt, bt]]
    assert (s["key_scale"] == 1).all() and s["lut"][0, :, :bt].tolist() == [list(range(bt))] * 2
    N.check_invariants(s, l_win=l_win, r_max=2 * bt, bt=bt)


def planted(n_copies, n_noise, seed):
    """One row: 6 distinct high-score tokens, n_copies exact copies (K, pre-K, V) of them with score 0, n_noise
    random tokens with score 0, then a 2-token window."""
    g = torch.Generator().manual_seed(seed)
    base = [N.single(*(torch.randn(8, generator=g) for _ in range(3)), i, s_glo=2.0 + i) for i in range(6)]
    row = list(base)
    for i in range(n_copies):
        src = base[i % 6]
        row.append(N.single(src.key.float(), src.raw.float(), src.value.float(), len(row)))
    for _ in range(n_noise):
        row.append(N.single(*(torch.randn(8, generator=g) for _ in range(3)), len(row)))
    for _ in range(2):
        row.append(N.single(*(torch.randn(8, generator=g) for _ in range(3)), len(row), s_glo=1.0))
    return row


def attend_all(row, queries):
    return torch.stack([N.attend(row, q, 1 / math.sqrt(8))[0] for q in queries])


@pytest.mark.parametrize("pos", ["without", "with"])
def test_identical_tokens_merge_exactly(pos):
    """Copies of centres merge into them: attention after compression equals dense attention over every original
    token (1e-5)."""
    row = planted(5, 0, seed=2)
    s = N.to_state([[row]], 16, 32, pos=pos, budget=(8, 9))
    compress(s, l_win=2, pool=1, gamma=math.inf, tau=0.99)
    assert s["fill"].tolist() == [[8]] and s["slot_fill"].tolist() == [[13]]
    qs = torch.randn(4, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    got = attend_all(N.from_state(s)[0][0], qs)
    assert torch.allclose(got, attend_all(row, qs), rtol=1e-5, atol=1e-5)


def test_zero_class_never_contributes():
    """Random low-score TBM tokens go to the zero class at tau 0.99: attention equals dense attention over
    exactly the surviving original tokens."""
    row = planted(3, 4, seed=4)
    s = N.to_state([[row]], 16, 32, budget=(8, 9))
    compress(s, l_win=2, pool=1, gamma=math.inf, tau=0.99)
    kept = set(s["token_pos"][0, 0, :int(s["slot_fill"][0, 0])].tolist())
    assert kept == set(range(9)) | {13, 14}  # the 4 noise tokens (9..12) are gone
    qs = torch.randn(4, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2
    survivors = [e for e in row if e.members[0].pos in kept]
    got = attend_all(N.from_state(s)[0][0], qs)
    assert torch.allclose(got, attend_all(survivors, qs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos", ["without", "with"])
@pytest.mark.parametrize("gamma,tau,pool", [(2.0, 0.2, 3), (1.0, 0.2, 3), (math.inf, 0.1, 3), (2.0, 0.0, 1),
                                              (1.5, 0.3, 7), (4.0, 0.6, 7)])
def test_matches_naive_model(pos, gamma, tau, pool):
    bt, l_win = 7, 2
    rows = N.random_rows(2, 2, 18, 8, pads=(0, 3), seed=6, dup=0.4)
    s = N.to_state(rows, 24, 48, pos=pos, budget=(bt, bt + 3))
    compress(s, l_win=l_win, pool=pool, gamma=gamma, tau=tau)
    want = [[N.compress(r, bt, l_win, pool, gamma, tau, pos)[0] for r in rb] for rb in rows]
    N.assert_rows_close(N.from_state(s), want)
    N.check_invariants(s, l_win=l_win, r_max=N.counts(bt, l_win, gamma)[2], bt=bt)


def test_left_padded_row_equals_the_prompt_alone():
    """Batch 2, row 1 left-padded by 3: after compression it equals the same prompt compressed alone, bit for
    bit."""
    n, pad = 15, 3
    batch = N.random_rows(2, 2, n + pad, 8, pads=(0, pad), seed=7, dup=0.4)
    alone = [[row[pad:] for row in batch[1]]]
    s = N.to_state(batch, 24, 48, budget=(7, 10))
    a = N.to_state(alone, 24, 48, budget=(7, 10))
    compress(s, tau=0.1)
    compress(a, tau=0.1)
    for f in STATE:
        if f == "budget":
            continue
        t, u = s[f][1], a[f][0]
        if f in ("keys", "values", "raw_keys", "bias", "slot_pos", "entry_start"):
            t, u = t[:, :7], u[:, :7]
        assert torch.equal(t, u), f
    assert (a["slot_fill"] > 7).any()


@pytest.mark.parametrize("interval", [1, 4, 32])
def test_decode_keeps_a_valid_table(interval):
    """A prompt, then 120 decode steps (random scores accumulating, compression when fill >= Bt + interval):
    the invariants hold after every step and the state equals the naive model's."""
    bt, l_win, gamma, tau = 6, 2, 2.0, 0.1
    rows = N.random_rows(1, 2, 10, 4, seed=8, dup=0.3)
    s = N.to_state(rows, bt + interval + 12, 80, budget=(bt, bt + interval))
    g = torch.Generator().manual_seed(9)
    n_due, extra = 0, 0
    for step in range(120):
        due = int(s["fill"][0, 0]) >= bt + interval
        compress(s, l_win=l_win, pool=3, gamma=gamma, tau=tau)
        if due:
            n_due += 1
            extra = max(extra, int((s["slot_fill"] - s["fill"]).max()))
            rows = [[N.compress(r, bt, l_win, 3, gamma, tau, "without")[0] for r in rows[0]]]
            N.check_invariants(s, l_win=l_win, r_max=N.counts(bt, l_win, gamma)[2], bt=bt)
        N.check_invariants(s, l_win=l_win)
        N.assert_rows_close(N.from_state(s), rows)
        # one decode token, then this step's attention mass on every live slot (mirrored on the naive tokens)
        fresh = N.random_rows(1, 2, 1, 4, seed=1000 + step, pos0=100 + step)
        k, r, v = (torch.stack([getattr(fresh[0][h][0], f).float() for h in range(2)])[None, :, None]
                   for f in ("key", "raw", "value"))
        N.append_state(s, k, r, v, [100 + step])
        for h in range(2):
            t = fresh[0][h][0].members[0]
            t.s_glo = t.s_loc_past = t.s_loc_cur = 0.0  # appended slots start at 0
            rows[0][h] += fresh[0][h]
            sf = int(s["slot_fill"][0, h])
            s["s_glo"][0, h, :sf] += torch.rand(sf, generator=g)
            s["s_loc_cur"][0, h, :sf] += torch.rand(sf, generator=g)
            toks = {t.pos: t for e in rows[0][h] for t in e.members}
            for j in range(sf):
                t = toks[int(s["token_pos"][0, h, j])]
                t.s_glo, t.s_loc_cur = float(s["s_glo"][0, h, j]), float(s["s_loc_cur"][0, h, j])
    assert n_due == {1: 120, 4: 30, 32: 3}[interval]
    assert extra == N.counts(bt, l_win, gamma)[2] - bt  # merged slots filled the table up to R_max


def test_rows_not_due_untouched_bit_for_bit():
    rows = N.random_rows(2, 1, 12, 4, seed=10, dup=0.3)
    rows[1][0] = rows[1][0][:8]
    s = N.to_state(rows, 16, 24, budget=(5, 10))
    old = {k: v.clone() for k, v in s.items()}
    compress(s)
    for f in STATE:
        assert torch.equal(s[f][1] if f != "budget" else s[f], old[f][1] if f != "budget" else old[f]), f
    assert s["fill"].tolist() == [[5], [8]]


def test_errors():
    s = N.to_state(N.random_rows(1, 1, 6, 4), 8, 8, budget=(2, 4))
    with pytest.raises(ValueError, match="cannot hold the 2-token local window"):
        compress(s, l_win=2)
    s["budget"] = torch.tensor([4, 5])
    with pytest.raises(ValueError, match="tau must be in"):
        compress(s, tau=-0.5)
    with pytest.raises(ValueError, match="pool must be an odd"):
        compress(s, pool=4)
    s["slot_fill"] = s["slot_fill"].int()
    with pytest.raises(ValueError, match="slot_fill must be torch.int64"):
        compress(s)


def test_opcheck():
    s = N.to_state(N.random_rows(2, 1, 12, 4, seed=11, dup=0.3), 16, 24, budget=(5, 8))
    torch.library.opcheck(OP, tuple(s[f] for f in STATE), dict(l_win=2, pool=3, gamma=2.0, tau=0.2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_state(dtype):
    """A 16-bit state (inputs rounded to it for the naive model too): the same decisions and layout, merged
    keys/values within the dtype's rounding, ||a_j keys[lut_j]|| = n_j to fp32 precision, the invariants."""
    bt, l_win = 7, 2
    rows = N.random_rows(2, 2, 18, 8, pads=(0, 3), seed=12, dup=0.4)
    for e in itertools.chain.from_iterable(itertools.chain.from_iterable(rows)):
        e.key, e.raw, e.value = (x.to(dtype).double() for x in (e.key, e.raw, e.value))
        e.members[0].n = float(e.key.norm())
    norms = {(b, h, e.members[0].pos): e.members[0].n for b, h in itertools.product(range(2), range(2))
             for e in rows[b][h]}
    s = N.to_state(rows, 24, 48, dtype=dtype, budget=(bt, bt + 3))
    compress(s, l_win=l_win, gamma=2.0, tau=0.2)
    want = [[N.compress(r, bt, l_win, 3, 2.0, 0.2, "without")[0] for r in rb] for rb in rows]
    N.assert_rows_close(N.from_state(s), want, rtol=2e-2)
    N.check_invariants(s, l_win=l_win, r_max=2 * bt, bt=bt)
    assert (s["slot_fill"] > s["fill"]).any()
    for b, h in itertools.product(range(2), range(2)):
        for j in range(int(s["slot_fill"][b, h])):
            got = float((s["key_scale"][b, h, j] * s["keys"][b, h, int(s["lut"][b, h, j])].float()).norm())
            assert got == pytest.approx(norms[(b, h, int(s["token_pos"][b, h, j]))], rel=1e-6)


def test_due_row_within_budget_drops_only_its_padding():
    """V <= Bt: everything is kept as it is, the padding entries and their slots go (fill = V)."""
    rows = N.random_rows(2, 1, 10, 4, pads=(0, 3), seed=13)
    s = N.to_state(rows, 12, 16, budget=(12, 10))
    old = {k: v.clone() for k, v in s.items()}
    compress(s)
    assert s["fill"].tolist() == [[10], [7]] and s["slot_fill"].tolist() == [[10], [7]]
    assert torch.equal(s["keys"][0], old["keys"][0]) and torch.equal(s["keys"][1, :, :7], old["keys"][1, :, 3:10])
    assert s["token_pos"][1, 0, :7].tolist() == list(range(3, 10)) and (s["key_scale"] == 1).all()
    N.check_invariants(s, l_win=2)
    N.assert_rows_close(N.from_state(s), [[[e for e in r if e.valid] for r in rb] for rb in rows])


def paper_step(row, bt, l_win, pool, gamma, tau):
    """The paper's Fig. 5(b) decode step, literally, on a row of Bt + 1 entries (written apart from
    N.compress): the least important of the N_imp + 1 centres is demoted and merges, as a whole group, into its
    most redundant centre or goes to the zero class (gamma = 1: evicted); then one member slot leaves the table if
    it holds more than R_max."""
    g, gp = N.score(row, l_win, pool)
    centres = list(range(len(row) - l_win))
    low = min(centres, key=lambda i: (gp[id(row[i].members[0])], -i))  # the later entry loses a tie
    d = row[low]
    new = [e for i, e in enumerate(row) if i != low]
    if gamma > 1 and tau < 1:
        cos = lambda x, y: max(N._cos(x, y), 0.0)  # noqa: E731
        r = [(round(cos(d.raw, new[i].raw) * cos(d.value, new[i].value), 12), -i) for i in range(len(centres) - 1)]
        best, neg_c = max(r)
        if best >= tau:
            c = new[-neg_c]
            w = [sum(g[id(t)] for t in e.members) for e in (c, d)]
            if sum(w) <= 0:
                w = [float(len(c.members)), float(len(d.members))]
            unit_mean = lambda x, y: N._unit(w[0] * N._unit(x) + w[1] * N._unit(y))  # noqa: E731
            new[-neg_c] = N.Entry(unit_mean(c.key, d.key), unit_mean(c.raw, d.raw),
                                  (w[0] * c.value + w[1] * d.value) / sum(w), c.members + d.members, merged=True)
    r_max = N.counts(bt, l_win, gamma)[2]
    live = sum(len(e.members) for e in new)
    if r_max is not None and live > r_max:
        assert live == r_max + 1
        cands = [t for e in new[:len(centres) - 1] for t in e.members[1:]]
        gone = min(cands, key=lambda t: (gp[id(t)], -t.pos))
        for e in new:
            e.members = [t for t in e.members if t is not gone]
    return new


@pytest.mark.parametrize("gamma,tau", [(1.5, 0.1), (2.0, 0.3), (1.0, 0.1)])
def test_interval_one_is_the_papers_per_step_procedure(gamma, tau):
    bt, l_win, pool = 6, 2, 3
    rows = N.random_rows(1, 1, bt, 4, seed=14, dup=0.5)
    s = N.to_state(rows, bt + 2, 40, budget=(bt, bt + 1))
    row = rows[0][0]
    gen = torch.Generator().manual_seed(15)
    merges = 0
    for step in range(40):
        fresh = N.random_rows(1, 1, 1, 4, seed=2000 + step, pos0=100 + step, dup=0.0)[0][0][0]
        src = row[int(torch.randint(0, len(row), (1,), generator=gen))]
        if step % 2:  # every other token is a near copy of a cached one: merges happen
            fresh.key, fresh.raw, fresh.value = (x + 0.05 * torch.randn(4, generator=gen, dtype=torch.float64)
                                                 for x in (src.key, src.raw, src.value))
            fresh.key, fresh.raw, fresh.value = fresh.key.float().double(), fresh.raw.float().double(), \
                fresh.value.float().double()
            fresh.members[0].n = float(fresh.key.norm())
        t = fresh.members[0]
        t.s_glo = t.s_loc_past = t.s_loc_cur = 0.0
        N.append_state(s, fresh.key.float().view(1, 1, 1, 4), fresh.raw.float().view(1, 1, 1, 4),
                       fresh.value.float().view(1, 1, 1, 4), [100 + step])
        row = row + [fresh]
        sf = int(s["slot_fill"][0, 0])
        s["s_glo"][0, 0, :sf] += torch.rand(sf, generator=gen)
        s["s_loc_cur"][0, 0, :sf] += torch.rand(sf, generator=gen)
        toks = {t.pos: t for e in row for t in e.members}
        for j in range(sf):
            t = toks[int(s["token_pos"][0, 0, j])]
            t.s_glo, t.s_loc_cur = float(s["s_glo"][0, 0, j]), float(s["s_loc_cur"][0, 0, j])
        compress(s, l_win=l_win, pool=pool, gamma=gamma, tau=tau)
        before = sum(len(e.members) for e in row)
        row = paper_step(row, bt, l_win, pool, gamma, tau)
        merges += sum(len(e.members) for e in row) == before
        N.assert_rows_close(N.from_state(s), [[row]])
        N.check_invariants(s, l_win=l_win, r_max=N.counts(bt, l_win, gamma)[2], bt=bt)
    assert (merges > 0) == (gamma > 1)


def test_full_entry_and_slot_capacity():
    """fill == C and slot_fill == R (no free entry or slot; merged entries from a first compression)."""
    rows = N.random_rows(1, 2, 12, 4, seed=16, dup=0.5)
    rows = [[N.compress(r, 6, 2, 3, 2.0, 0.0, "without")[0] for r in rb] for rb in rows]
    for h in range(2):
        rows[0][h] += N.random_rows(1, 1, 6, 4, seed=17 + h, pos0=50, dup=0.5)[0][0]
    R = max(sum(len(e.members) for e in r) for r in rows[0])
    s = N.to_state(rows, 12, R, budget=(6, 12))
    assert s["slot_fill"].max() == R and s["fill"].min() == 12
    compress(s, l_win=2, pool=7, gamma=2.0, tau=0.0)
    want = [[N.compress(r, 6, 2, 7, 2.0, 0.0, "without")[0] for r in rb] for rb in rows]
    N.assert_rows_close(N.from_state(s), want)
    N.check_invariants(s, l_win=2, r_max=12, bt=6)



def empty_state(B, H, C, R, D, budget):
    """A layer's EMS state at its reset values (§3), pos "without"."""
    i32 = dict(dtype=torch.int32)
    return {"keys": torch.zeros(B, H, C, D), "values": torch.zeros(B, H, C, D),
            "bias": torch.full((B, H, C), -math.inf), "slot_pos": torch.zeros(B, H, C, dtype=torch.long),
            "fill": torch.zeros(B, H, dtype=torch.long), "budget": torch.tensor(budget),
            "entry_start": torch.zeros(B, H, C, **i32), "raw_keys": torch.zeros(B, H, C, D),
            "lut": torch.full((B, H, R), -1, **i32), "key_scale": torch.ones(B, H, R),
            "token_pos": torch.zeros(B, H, R, **i32), "slot_order": torch.full((B, H, R), -1, **i32),
            "s_glo": torch.zeros(B, H, R), "s_loc_past": torch.zeros(B, H, R), "s_loc_cur": torch.zeros(B, H, R),
            "slot_fill": torch.zeros(B, H, dtype=torch.long)}


def test_with_the_append_and_attention_ops():
    """A prefill of 12 tokens, then 20 decode steps through cache_append, ems_append, ems_attention (G = 2) and
    ems_compress (interval 4, tau 0: merges): the attention output over the merged table equals dense float64
    attention over the materialised expanded keys, and after every step the state equals the naive model's
    (scores taken from the state: the attention ops' own tests check them)."""
    ops = torch.ops.kvrewrite
    B, H, G, D, C, R = 2, 2, 2, 8, 24, 64
    bt, l_win, interval = 6, 2, 4
    gen = torch.Generator().manual_seed(0)
    s = empty_state(B, H, C, R, D, [bt, bt + interval])
    win_count = torch.zeros(B, H, dtype=torch.long)
    rows = [[[] for _ in range(H)] for _ in range(B)]
    n_due = 0
    for T, pos0 in [(12, 0)] + [(1, 12 + i) for i in range(20)]:
        k, kr, v = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))
        cp, valid = torch.arange(pos0, pos0 + T), torch.ones(B, T, dtype=torch.bool)
        ops.cache_append(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k, v, cp, valid)
        ops.ems_append(s["keys"], s["bias"], s["fill"], kr, cp, valid,
                       *(s[f] for f in ("entry_start", "raw_keys", "lut", "key_scale", "token_pos", "slot_order",
                                        "slot_fill")))
        for b, h, t in itertools.product(range(B), range(H), range(T)):
            rows[b][h].append(N.single(k[b, h, t], kr[b, h, t], v[b, h, t], pos0 + t))
        q = torch.randn(B, H * G, T, D, generator=gen)
        out = ops.ems_attention(q, *(s[f] for f in ("keys", "values", "bias", "slot_pos")), cp,
                                *(s[f] for f in ("entry_start", "lut", "key_scale", "s_glo", "s_loc_past",
                                                 "s_loc_cur", "slot_fill")), win_count,
                                scale=D ** -0.5, past_only=T == 1, softcap=0.0, l_win=l_win)
        st = N.from_state(s)
        for b, hq in itertools.product(range(B), range(H * G)):
            want, _ = N.attend(st[b][hq // G], q[b, hq, T - 1], D ** -0.5)
            assert torch.allclose(out[b, hq, T - 1].double(), want, rtol=1e-5, atol=1e-5)
        for b, h in itertools.product(range(B), range(H)):  # the op's scores onto the naive tokens
            toks = {t.pos: t for e in rows[b][h] for t in e.members}
            for j in range(int(s["slot_fill"][b, h])):
                t = toks[int(s["token_pos"][b, h, j])]
                t.s_glo, t.s_loc_past, t.s_loc_cur = (float(s[f][b, h, j]) for f in ("s_glo", "s_loc_past",
                                                                                     "s_loc_cur"))
        due = int(s["fill"][0, 0]) >= bt + interval
        compress(s, l_win=l_win, pool=3, gamma=2.0, tau=0.0)
        if due:
            n_due += 1
            rows = [[N.compress(r, bt, l_win, 3, 2.0, 0.0, "without")[0] for r in rb] for rb in rows]
        N.check_invariants(s, l_win=l_win)
        N.assert_rows_close(N.from_state(s), rows)
    assert n_due == 6 and (s["slot_fill"] > s["fill"]).all()
