"""A NAIVE float64 per-row Python model of EMS (the contract docs/contracts/ems.md, §9), separate code from the op
references: the ground truth of the EMS op tests.

A row is a list of Entry objects in head-position order; an entry holds its member tokens (head token first, then
as §6.9.5 orders them). Compression is the literal steps of §6.6-6.9 with Python sorts and loops and the tie rules
given there (R_dc rounded to 12 decimals, so that centres equal up to float64 noise tie to the smallest).
`to_state` / `from_state` convert between rows and the op state layout of §3; `check_invariants` asserts §3's
invariants on a state; `append_state` is §6.1 on a state dict; `random_rows` / `assert_rows_close` are the tests'
fixtures. `attend` is a dense float64 softmax over the materialised expanded keys; §6.4's `fold` is not modelled
here (the attention ops' tests keep their own dense reference).
"""
import math

import torch

NEG_INF = float("-inf")
SLOT_FIELDS = ("entry_start", "raw_keys", "lut", "key_scale", "token_pos", "slot_order", "s_glo", "s_loc_past",
               "s_loc_cur", "slot_fill")
STATE_FIELDS = ("keys", "values", "bias", "slot_pos", "fill", "budget") + SLOT_FIELDS


def _unit(x):
    n = float(x.norm())
    return x / n if n > 0 else torch.zeros_like(x)


def _cos(x, y):
    nx, ny = float(x.norm()), float(y.norm())
    return 0.0 if nx == 0 or ny == 0 else float(x @ y) / (nx * ny)


class Token:
    """One runtime slot: its position, original norm n, scores (and the original keys/value when known)."""

    def __init__(self, pos, n, s_glo=0.0, s_loc_past=0.0, s_loc_cur=0.0, k_post=None, k_pre=None, v=None):
        self.pos, self.n = int(pos), float(n)
        self.s_glo, self.s_loc_past, self.s_loc_cur = float(s_glo), float(s_loc_past), float(s_loc_cur)
        self.k_post, self.k_pre, self.v = k_post, k_pre, v


class Entry:
    """One base-state entry: key (the model key if unmerged, a unit direction if merged), raw direction, value,
    valid (False for padding), members (head token first)."""

    def __init__(self, key, raw, value, members, valid=True, merged=False):
        self.key, self.raw, self.value = key.double(), None if raw is None else raw.double(), value.double()
        self.members, self.valid, self.merged = list(members), bool(valid), bool(merged)

    def expanded_key(self, tok):
        return tok.n * _unit(self.key) if self.merged else self.key


def single(k_post, k_pre, v, pos, valid=True, **scores):
    """An unmerged entry made by one appended token."""
    k_post = k_post.double()
    tok = Token(pos, float(k_post.norm()), k_post=k_post, k_pre=None if k_pre is None else k_pre.double(),
                v=v.double(), **scores)
    return Entry(k_post, k_pre, v, [tok], valid=valid)


def append(row, k_pre, k_post, v, pos, valid):
    """§6.1 on the model: one single-token entry per token, in order."""
    for t in range(len(pos)):
        row.append(single(k_post[t], k_pre[t], v[t], pos[t], valid=bool(valid[t])))


def attend(row, q, scale):
    """Dense float64 softmax of q [D] over the materialised expanded keys of the row's valid entries:
    (out [D], {id(token): p})."""
    toks = [(e, t) for e in row if e.valid for t in e.members]
    if not toks:
        return torch.zeros_like(q, dtype=torch.float64), {}
    z = torch.stack([scale * (q.double() @ e.expanded_key(t)) for e, t in toks])
    p = torch.softmax(z, 0)
    out = sum(float(p[i]) * e.value for i, (e, _) in enumerate(toks))
    return out, {id(t): float(p[i]) for i, (_, t) in enumerate(toks)}


# -- compression: §6.6-6.9 ---------------------------------------------------------------------------------------
def counts(Bt, l_win, gamma):
    """(N_imp, N_tbm, R_max); N_tbm / R_max are None for gamma = inf (no limit)."""
    n_imp = max(Bt - l_win, 0)
    if math.isinf(gamma):
        return n_imp, None, None
    n_tbm = math.floor((gamma - 1) * Bt)
    return n_imp, n_tbm, Bt + n_tbm


def window_entries(row, l_win):
    valid = [i for i, e in enumerate(row) if e.valid]
    return set(valid[len(valid) - min(l_win, len(valid)):])


def score(row, l_win, pool):
    """§6.6: ({id(token): g}, {id(token): g_pooled}) over the live tokens; window tokens pooled -inf."""
    live = [t for e in row if e.valid for t in e.members]
    loc = {id(t): t.s_loc_past + t.s_loc_cur for t in live}
    den = sum(t.s_glo for t in live)
    alpha = 0.0 if den == 0 else sum(loc.values()) / den
    g = {id(t): max(alpha * t.s_glo, loc[id(t)]) for t in live}
    win = window_entries(row, l_win)
    P = sorted((t for i, e in enumerate(row) if e.valid and i not in win for t in e.members), key=lambda t: t.pos)
    h = (pool - 1) // 2
    gp = {id(t): NEG_INF for t in live}
    for i, t in enumerate(P):
        gp[id(t)] = sum(g[id(P[k])] for k in range(i - h, i + h + 1) if 0 <= k < len(P)) / pool
    return g, gp


def partition(row, gp, Bt, l_win, gamma):
    """§6.7: cls per entry (0 free, 1 window, 2 centre, 3 TBM, 4 evicted)."""
    cls = [0] * len(row)
    win = window_entries(row, l_win)
    cand = [i for i, e in enumerate(row) if e.valid and i not in win]
    for i in win:
        cls[i] = 1
    if len(win) + len(cand) <= Bt:
        for i in cand:
            cls[i] = 2
        return cls
    n_imp, n_tbm, _ = counts(Bt, l_win, gamma)
    ranked = sorted(cand, key=lambda i: (-gp[id(row[i].members[0])], i))
    for r, i in enumerate(ranked):
        cls[i] = 2 if r < n_imp else 3 if (n_tbm is None or r < n_imp + n_tbm) else 4
    return cls


def redundancy(row, cls, tau, pos):
    """§6.8: dest per entry (the centre, itself for kept entries, -1 for the zero class / dropped)."""
    dest = [i if c in (1, 2) else -1 for i, c in enumerate(cls)]
    centres = [i for i, c in enumerate(cls) if c == 2]
    for d, c in enumerate(cls):
        if c != 3 or not centres:
            continue
        a = (lambda e: e.raw) if pos == "without" else (lambda e: e.key)
        best, arg = NEG_INF, -1
        for cc in centres:  # ascending: a tie keeps the smallest centre
            r = max(_cos(a(row[d]), a(row[cc])), 0.0) * max(_cos(row[d].value, row[cc].value), 0.0)
            r = round(r, 12)  # float64 noise between parallel centres is a tie
            if r > best:
                best, arg = r, cc
        dest[d] = arg if (tau < 1 and best >= tau) else -1
    return dest


def merge(row, g, gp, cls, dest, Bt, l_win, gamma, pos):
    """§6.9: the new row (new Entry objects; tokens are shared)."""
    groups = {c: [c] + [d for d in range(len(row)) if cls[d] == 3 and dest[d] == c]
              for c in range(len(row)) if cls[c] in (1, 2)}
    new = []
    for c in sorted(groups):
        G = groups[c]
        members = [t for e in G for t in row[e].members]
        if len(G) == 1:
            e = row[c]
            new.append([Entry(e.key, e.raw, e.value, members, merged=e.merged), cls[c]])
            continue
        W = [sum(g[id(t)] for t in row[e].members) for e in G]
        if sum(W) <= 0:
            W = [float(len(row[e].members)) for e in G]
        m = sum(w * _unit(row[e].key) for w, e in zip(W, G))
        key = _unit(m) if float(m.norm()) > 0 else row[c].key
        value = sum(w * row[e].value for w, e in zip(W, G)) / sum(W)
        raw = None
        if pos == "without":
            mr = sum(w * _unit(row[e].raw) for w, e in zip(W, G))
            raw = _unit(mr) if float(mr.norm()) > 0 else row[c].raw
        new.append([Entry(key, raw, value, members, merged=True), cls[c]])
    _, _, r_max = counts(Bt, l_win, gamma)
    live = sum(len(e.members) for e, _ in new)
    if r_max is not None and live > r_max:
        cand = [t for e, c in new if c == 2 for t in e.members[1:]]
        cand.sort(key=lambda t: (gp[id(t)], -t.pos))
        gone = {id(t) for t in cand[:live - r_max]}
        for e, _ in new:
            e.members = [t for t in e.members if id(t) not in gone]
    return [e for e, _ in new]


def compress(row, Bt, l_win, pool, gamma, tau, pos):
    """§6.5 on one row (due): score, partition, redundancy, merge. Returns (new row, info dict)."""
    g, gp = score(row, l_win, pool)
    cls = partition(row, gp, Bt, l_win, gamma)
    dest = redundancy(row, cls, tau, pos)
    return merge(row, g, gp, cls, dest, Bt, l_win, gamma, pos), dict(g=g, gp=gp, cls=cls, dest=dest)


# -- conversion to / from the op state of §3 ---------------------------------------------------------------------
def to_state(rows, C, R, dtype=torch.float32, pos="without", budget=(0, 0)):
    """rows[b][h]: a row (list of Entry). Returns the state dict (STATE_FIELDS), every tensor at its reset values
    past fill / slot_fill (keys/values/raw_keys past fill: 0)."""
    B, H = len(rows), len(rows[0])
    D = rows[0][0][0].key.numel()
    s = {"keys": torch.zeros(B, H, C, D, dtype=dtype), "values": torch.zeros(B, H, C, D, dtype=dtype),
         "bias": torch.full((B, H, C), NEG_INF), "slot_pos": torch.zeros(B, H, C, dtype=torch.int64),
         "fill": torch.zeros(B, H, dtype=torch.int64), "budget": torch.tensor(list(budget), dtype=torch.int64),
         "entry_start": torch.zeros(B, H, C, dtype=torch.int32),
         "raw_keys": torch.zeros(B, H, C if pos == "without" else 0, D, dtype=dtype),
         "lut": torch.full((B, H, R), -1, dtype=torch.int32), "key_scale": torch.ones(B, H, R),
         "token_pos": torch.zeros(B, H, R, dtype=torch.int32),
         "slot_order": torch.full((B, H, R), -1, dtype=torch.int32),
         "s_glo": torch.zeros(B, H, R), "s_loc_past": torch.zeros(B, H, R), "s_loc_cur": torch.zeros(B, H, R),
         "slot_fill": torch.zeros(B, H, dtype=torch.int64)}
    for b in range(B):
        for h in range(H):
            j, slots = 0, []
            for e, ent in enumerate(rows[b][h]):
                s["keys"][b, h, e] = ent.key.to(dtype)
                s["values"][b, h, e] = ent.value.to(dtype)
                if pos == "without":
                    s["raw_keys"][b, h, e] = ent.raw.to(dtype)
                s["bias"][b, h, e] = 0.0 if ent.valid else NEG_INF
                s["slot_pos"][b, h, e] = max(t.pos for t in ent.members)
                s["entry_start"][b, h, e] = j
                stored = float(s["keys"][b, h, e].double().norm())
                for t in ent.members:
                    s["lut"][b, h, j] = e
                    s["key_scale"][b, h, j] = (t.n / stored if stored > 0 else 1.0) if ent.merged else 1.0
                    s["token_pos"][b, h, j] = t.pos
                    s["s_glo"][b, h, j], s["s_loc_past"][b, h, j] = t.s_glo, t.s_loc_past
                    s["s_loc_cur"][b, h, j] = t.s_loc_cur
                    slots.append((t.pos, j))
                    j += 1
            s["fill"][b, h] = len(rows[b][h])
            s["slot_fill"][b, h] = j
            for k, (_, jj) in enumerate(sorted(slots)):
                s["slot_order"][b, h, k] = jj
    return s


def from_state(s):
    """The rows of a state (rows[b][h], lists of Entry): merged is True where an entry has > 1 slot or a slot with
    key_scale != 1; a token's n is key_scale * ||stored key|| (float64)."""
    B, H = s["fill"].shape
    with_raw = s["raw_keys"].shape[2] > 0
    rows = []
    for b in range(B):
        rows.append([])
        for h in range(H):
            fill, sf = int(s["fill"][b, h]), int(s["slot_fill"][b, h])
            row = []
            for e in range(fill):
                lo = int(s["entry_start"][b, h, e])
                hi = int(s["entry_start"][b, h, e + 1]) if e + 1 < fill else sf
                key = s["keys"][b, h, e].double()
                kn = float(key.norm())
                a = [float(s["key_scale"][b, h, j]) for j in range(lo, hi)]
                toks = [Token(int(s["token_pos"][b, h, j]), a[j - lo] * kn, float(s["s_glo"][b, h, j]),
                              float(s["s_loc_past"][b, h, j]), float(s["s_loc_cur"][b, h, j])) for j in range(lo, hi)]
                merged = hi - lo > 1 or any(x != 1 for x in a)
                row.append(Entry(key, s["raw_keys"][b, h, e] if with_raw else None, s["values"][b, h, e], toks,
                                 valid=bool(s["bias"][b, h, e] > NEG_INF), merged=merged))
            rows[-1].append(row)
    return rows


def check_invariants(s, l_win=None, r_max=None, bt=None):
    """§3's invariants on a state (asserts): lut in [0, fill) and non-decreasing below slot_fill, every valid entry
    has a slot and entry_start agrees with lut, slot_order a permutation sorted by token_pos with distinct
    positions, the last l_win valid entries hold one slot each, reset values past slot_fill; r_max / bt: the
    post-compression bounds slot_fill <= r_max and fill == bt."""
    B, H = s["fill"].shape
    R = s["lut"].shape[2]
    for b in range(B):
        for h in range(H):
            fill, sf = int(s["fill"][b, h]), int(s["slot_fill"][b, h])
            lut = s["lut"][b, h].tolist()
            assert all(0 <= x < fill for x in lut[:sf]), (b, h, lut[:sf], fill)
            assert all(lut[j] <= lut[j + 1] for j in range(sf - 1)), (b, h, lut[:sf])
            for e in range(fill):
                if float(s["bias"][b, h, e]) > NEG_INF:
                    assert e in lut[:sf], (b, h, e)
                if e in lut[:sf]:
                    assert int(s["entry_start"][b, h, e]) == lut.index(e), (b, h, e)
            order = s["slot_order"][b, h, :sf].tolist()
            assert sorted(order) == list(range(sf)), (b, h, order)
            tp = [int(s["token_pos"][b, h, j]) for j in order]
            assert all(tp[k] < tp[k + 1] for k in range(sf - 1)), (b, h, tp)
            if l_win is not None:
                valid = [e for e in range(fill) if float(s["bias"][b, h, e]) > NEG_INF]
                for e in valid[len(valid) - min(l_win, len(valid)):]:
                    assert lut[:sf].count(e) == 1, (b, h, e)
            assert lut[sf:] == [-1] * (R - sf) and s["slot_order"][b, h, sf:].tolist() == [-1] * (R - sf)
            assert s["key_scale"][b, h, sf:].eq(1).all() and s["token_pos"][b, h, sf:].eq(0).all()
            for f in ("s_glo", "s_loc_past", "s_loc_cur"):
                assert s[f][b, h, sf:].eq(0).all(), (b, h, f)
            if r_max is not None:
                assert sf <= r_max, (b, h, sf, r_max)
            if bt is not None:
                assert fill == bt, (b, h, fill, bt)


# -- test fixtures -------------------------------------------------------------------------------------------------
def random_rows(B, H, n, D, pads=(), seed=0, dup=0.0, pos0=0):
    """rows[b][h] of n single-token entries (positions pos0.., random post/pre keys and values; fp32-exact values),
    random scores (s_glo in [0, 4), locals in [0, 1)); pads[b] leading padding entries in batch row b; dup: the
    chance that a token copies an earlier token's keys and value plus 5% noise (redundant tokens, never exact ties
    that fp32 could break either way)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        rows.append([])
        for h in range(H):
            row = []
            for t in range(n):
                kp, kr, v = (torch.randn(D, generator=g).double() for _ in range(3))
                if row and float(torch.rand(1, generator=g)) < dup:
                    src = row[int(torch.randint(0, len(row), (1,), generator=g))]
                    kp, kr, v = (x + 0.05 * torch.randn(D, generator=g).double() for x in (src.key, src.raw, src.value))
                sc = torch.rand(3, generator=g).double() * torch.tensor([4.0, 1.0, 1.0], dtype=torch.float64)
                sc = sc.float().double()
                e = single(kp.float(), kr.float(), v.float(), pos0 + t, valid=t >= (pads[b] if b < len(pads) else 0),
                           s_glo=float(sc[0]), s_loc_past=float(sc[1]), s_loc_cur=float(sc[2]))
                if not e.valid:
                    e.members[0].s_glo = e.members[0].s_loc_past = e.members[0].s_loc_cur = 0.0
                row.append(e)
            rows[-1].append(row)
    return rows


def assert_rows_close(got, want, rtol=1e-5, exact_scores=True):
    """Two rows[b][h] structures describe the same cache: per valid entry the member positions (exact, in order),
    the scores (exact), the expanded keys n_j * unit(key) (rtol), the value, the raw direction (rtol). Padding
    entries are ignored (got must not hold any after a compression)."""
    for b, (gb, wb) in enumerate(zip(got, want)):
        for h, (g_row, w_row) in enumerate(zip(gb, wb)):
            g_row = [e for e in g_row if e.valid]
            w_row = [e for e in w_row if e.valid]
            assert [[t.pos for t in e.members] for e in g_row] == [[t.pos for t in e.members] for e in w_row], (b, h)
            for ge, we in zip(g_row, w_row):
                for gt, wt in zip(ge.members, we.members):
                    if exact_scores:
                        assert (gt.s_glo, gt.s_loc_past, gt.s_loc_cur) == (wt.s_glo, wt.s_loc_past, wt.s_loc_cur)
                    gk, wk = gt.n * _unit(ge.key), wt.n * _unit(we.key)
                    assert torch.allclose(gk, wk, rtol=rtol, atol=rtol), (b, h, gt.pos, gk, wk)
                assert torch.allclose(ge.value, we.value, rtol=rtol, atol=rtol), (b, h, ge.members[0].pos)
                if ge.raw is not None and we.raw is not None:
                    gr = ge.raw if not we.merged else _unit(ge.raw)
                    assert torch.allclose(gr, we.raw if not we.merged else _unit(we.raw), rtol=rtol, atol=rtol)


def append_state(s, k_post, k_pre, v, pos, valid=None):
    """§6.1 (+ cache_append) applied to a state dict for the tests: token t of every row [B, H, T, D] becomes entry
    fill + t with one slot at slot_fill + t (key_scale 1, scores 0)."""
    B, H, T, _ = k_post.shape
    for b in range(B):
        for h in range(H):
            f, sf = int(s["fill"][b, h]), int(s["slot_fill"][b, h])
            for t in range(T):
                e, j = f + t, sf + t
                s["keys"][b, h, e], s["values"][b, h, e] = k_post[b, h, t], v[b, h, t]
                s["bias"][b, h, e] = 0.0 if valid is None or valid[b, t] else NEG_INF
                s["slot_pos"][b, h, e] = pos[t]
                s["entry_start"][b, h, e] = j
                if s["raw_keys"].shape[2] > 0:
                    s["raw_keys"][b, h, e] = k_pre[b, h, t]
                s["lut"][b, h, j], s["key_scale"][b, h, j] = e, 1.0
                s["token_pos"][b, h, j], s["slot_order"][b, h, j] = pos[t], j
            s["fill"][b, h] += T
            s["slot_fill"][b, h] += T
