"""NAIVE float64 per-row Python models of ClusterGen's fold (docs/contracts/clustergen.md §1.5-1.11, §2, §3.2),
separate code from the op reference: the ground truth of tests/kernels/test_clustergen_fold.py and test_kcenter.py.

A Row is one (b, kv head): its exact tokens (positions, in order) and its sketch (leaders, counts, the position of
the token each key-sample / value-sample slot holds, mu, delta, n_seen, n_forced); tokens are named by position.
- Row.fold_hash(): the one-shot fold with the contract's hash uniforms (§1.8-1.9), for exact comparison with the op.
- Row.fold_coins(rng): Algorithm 1 token by token with its own coin flips (numpy Generator), for the laws.
Both split sinks / folded / window (§3.2 step 1), calibrate delta on the first fold (naive greedy k-center, §1.6)
and run the leader clustering (§1.7) in Python float64.
- greedy_naive / brute_kcenter: greedy farthest point and the exact k-center optimum over all k-subsets.
- to_state(rows, ...) builds the op state of a batch of rows (left padding allowed); read_row(state, b, h, p) reads
  one row back in the same form as Row.view().
"""
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from kvrewrite.kernels.kmeans_cluster import mix32

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Params:
    """The op's kwargs plus budget[0] (Bt); S, s, M, M_target as the contract's §1.5-1.6 (Python round)."""
    Bt: int
    n_sink: int = 1
    window: int = 2
    t: int = 2
    value_share: float = 0.5
    cluster_target: float = 0.5
    seed: int = 0
    layer: int = 0

    @property
    def S(self):
        return self.Bt - self.n_sink - self.window

    @property
    def s(self):
        return round(self.value_share * self.S)

    @property
    def M(self):
        return (self.S - self.s) // self.t

    @property
    def M_target(self):
        return max(1, round(self.cluster_target * self.M))

    def kwargs(self, **over):
        kw = dict(n_sink=self.n_sink, window=self.window, t=self.t, value_share=self.value_share,
                  cluster_target=self.cluster_target, seed=self.seed, layer=self.layer)
        kw.update(over)
        return kw


def d2(a, b):
    return float(((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2).sum())


def greedy_naive(points, k):
    """Greedy k-center in float64 Python: start at point 0, then the farthest from the chosen (lowest index on a
    tie), k times or until all are chosen. Returns (order, radius)."""
    n = len(points)
    order = []
    for _ in range(min(k, n)):
        if not order:
            order.append(0)
            continue
        best, far = None, -1.0
        for p in range(n):
            if p in order:
                continue
            dp = min(d2(points[p], points[c]) for c in order)
            if dp > far:
                best, far = p, dp
        order.append(best)
    if not order:
        return order, (math.inf if n else 0.0)
    return order, math.sqrt(max(min(d2(x, points[c]) for c in order) for x in points))


def brute_kcenter(points, k):
    """The optimal k-center radius: min over all k-subsets of the max distance to the nearest centre (<= 10 points)."""
    assert len(points) <= 10
    k = min(k, len(points))
    return min(math.sqrt(max(min(d2(x, points[c]) for c in sub) for x in points))
               for sub in itertools.combinations(range(len(points)), k))


def hash24(p: Params, head, n_seen, j):
    """The contract's §1.9 counter-based draw (h >> 8, u = result * 2^-24), Python ints."""
    return mix32(mix32(mix32(mix32(mix32(p.seed) ^ p.layer) ^ head) ^ n_seen) ^ j) >> 8


class Row:
    def __init__(self, p: Params, head=0):
        self.p, self.head = p, head
        self.exact = []                # positions of the exact tokens, in order
        self.key, self.val = {}, {}    # position -> float64 vector
        self.reps, self.counts, self.ksamp = [], [], []   # leader positions, n_i, t sample positions per cluster
        self.vsamp = [None] * p.s
        self.mu, self.delta, self.n_seen, self.n_forced = 0.0, -1.0, 0, 0
        self.leader_of, self.forced = {}, set()         # position -> cluster, force-assigned positions

    def append(self, pos, k, v):
        self.exact.append(int(pos))
        self.key[int(pos)] = np.asarray(k, np.float64)
        self.val[int(pos)] = np.asarray(v, np.float64)

    def w(self, pos):
        return float((self.val[pos] ** 2).sum())

    def _split(self):
        n_sink, window, V = self.p.n_sink, self.p.window, len(self.exact)
        nF = max(0, V - n_sink - window)
        return self.exact[:n_sink], self.exact[n_sink:n_sink + nF], self.exact[n_sink + nF:]

    def _calibrate(self, F):
        """§1.6: delta = 1.001 r, r the greedy k-center radius of F's keys with M_target centres (first fold only)."""
        if self.delta < 0:
            self.delta = 1.001 * greedy_naive([self.key[x] for x in F], self.p.M_target)[1]

    def _leaders(self, F):
        """§1.7's leader clustering of F in order; returns (counts before, joiners per cluster)."""
        old = list(self.counts)
        joiners = {}
        for x in F:
            k = self.key[x]
            dist = [d2(self.key[r], k) for r in self.reps]
            i = int(np.argmin(dist)) if dist else -1
            if i < 0 or dist[i] > self.delta ** 2:
                if len(self.reps) < self.p.M:
                    i = len(self.reps)
                    self.reps.append(x)
                    self.counts.append(0)
                    self.ksamp.append([None] * self.p.t)
                else:
                    self.n_forced += 1
                    self.forced.add(x)
            self.counts[i] += 1
            self.leader_of[x] = i
            joiners.setdefault(i, []).append(x)
        return old + [0] * (len(self.counts) - len(old)), joiners

    def fold_hash(self):
        """The one-shot fold with the contract's hash uniforms."""
        sinks, F, window = self._split()
        if F:
            self._calibrate(F)
            old, joiners = self._leaders(F)
            self.n_seen += len(F)
            p = self.p
            for i, n in enumerate(self.counts):
                for jj in range(p.t):
                    pick = (hash24(p, self.head, self.n_seen, i * p.t + jj) * n) >> 24
                    if pick >= old[i]:
                        self.ksamp[i][jj] = joiners[i][pick - old[i]]
            mu_old = self.mu
            prefix = list(itertools.accumulate((self.w(x) for x in F), initial=mu_old))[1:]
            mu_new = prefix[-1]
            for q in range(p.s):
                x = hash24(p, self.head, self.n_seen, p.M * p.t + q) * 2.0 ** -24 * mu_new
                if not x < mu_old:
                    self.vsamp[q] = F[next((l for l, P in enumerate(prefix) if P > x), len(F) - 1)]
            self.mu = mu_new
        self.exact = sinks + window

    def fold_coins(self, rng):
        """Algorithm 1 token by token (lines 11-27): one coin per token and slot."""
        sinks, F, window = self._split()
        if F:
            self._calibrate(F)
            for x in F:
                n_before = len(self.reps)
                self._leaders([x])
                i = self.leader_of[x]
                if len(self.reps) > n_before:
                    self.ksamp[i] = [x] * self.p.t
                else:
                    for jj in range(self.p.t):
                        if rng.random() < 1.0 / self.counts[i]:
                            self.ksamp[i][jj] = x
                w = self.w(x)
                prob = 1.0 if self.mu + w == 0 else w / (self.mu + w)
                for q in range(self.p.s):
                    if rng.random() < prob:
                        self.vsamp[q] = x
                self.mu += w
            self.n_seen += len(F)
        self.exact = sinks + window

    def sketch_bias(self):
        """[S] bias of every sketch slot (§1.11) and [S] role, float64."""
        p = self.p
        bias, role = [NEG_INF] * p.S, [0] * p.S
        for j in range(p.M * p.t):
            i = j // p.t
            role[j] = 1
            bias[j] = math.log(self.counts[i] / p.t) if i < len(self.counts) else NEG_INF
        for q in range(p.s):
            j = p.M * p.t + q
            role[j] = 2
            w = self.w(self.vsamp[q])
            bias[j] = math.log(self.mu / (p.s * w)) if w > 0 else NEG_INF
        return bias, role

    def view(self):
        """The row as read_row returns it."""
        v = dict(exact=list(self.exact), n_clusters=len(self.reps), reps=[self.key[r] for r in self.reps],
                 counts=list(self.counts), ksamp=[list(s) for s in self.ksamp], vsamp=list(self.vsamp), mu=self.mu,
                 delta=self.delta, n_seen=self.n_seen, n_forced=self.n_forced)
        if self.n_seen:
            v["bias"], v["role"] = self.sketch_bias()
        return v


STATE = ("keys", "values", "bias", "slot_pos", "fill", "budget", "role", "rep", "count", "n_clusters", "mu", "delta",
         "n_seen", "n_forced")


def empty_state(B, H, C, D, Mmax, Bt, threshold, dtype=torch.float32):
    """The reset state (§2): keys/values 0, bias -inf, role 0, delta -1, counters 0."""
    z = lambda *shape, dt=torch.int64: torch.zeros(*shape, dtype=dt)  # noqa: E731
    return dict(keys=z(B, H, C, D, dt=dtype), values=z(B, H, C, D, dt=dtype),
                bias=torch.full((B, H, C), NEG_INF), slot_pos=z(B, H, C), fill=z(B, H),
                budget=torch.tensor([Bt, threshold]), role=z(B, H, C, dt=torch.int8), rep=z(B, H, Mmax, D, dt=dtype),
                count=z(B, H, Mmax, dt=torch.int32), n_clusters=z(B, H), mu=torch.zeros(B, H),
                delta=torch.full((B, H), -1.0), n_seen=z(B, H), n_forced=z(B, H))


def to_state(rows, C, D, Mmax, threshold=None, pads=None, dtype=torch.float32):
    """The op state of rows[b][h] (each a Row with the same Params): left padding pads[b] slots (bias -inf, keys NaN)
    then the exact tokens; the sketch region [C - S, C) laid out as §2 (reset if the row never folded). threshold
    defaults to 0 (every row due)."""
    B, H = len(rows), len(rows[0])
    p = rows[0][0].p
    st = empty_state(B, H, C, D, Mmax, p.Bt, 0 if threshold is None else threshold, dtype)
    base = C - p.S
    for b, h in itertools.product(range(B), range(H)):
        r = rows[b][h]
        pad = 0 if pads is None else pads[b]
        st["keys"][b, h, :pad] = float("nan")
        for n, x in enumerate(r.exact):
            _put(st, b, h, pad + n, r, x)
            st["bias"][b, h, pad + n] = 0.0
        st["fill"][b, h] = pad + len(r.exact)
        st["n_clusters"][b, h], st["mu"][b, h], st["delta"][b, h] = len(r.reps), r.mu, r.delta
        st["n_seen"][b, h], st["n_forced"][b, h] = r.n_seen, r.n_forced
        if not r.n_seen:
            continue
        for i, x in enumerate(r.reps):
            st["rep"][b, h, i] = torch.from_numpy(r.key[x])
            st["count"][b, h, i] = r.counts[i]
            for jj, y in enumerate(r.ksamp[i]):
                _put(st, b, h, base + i * p.t + jj, r, y)
        for q, y in enumerate(r.vsamp):
            _put(st, b, h, base + p.M * p.t + q, r, y)
        bias, role = r.sketch_bias()
        st["bias"][b, h, base:] = torch.tensor(bias, dtype=torch.float32)
        st["role"][b, h, base:] = torch.tensor(role, dtype=torch.int8)
    return st


def _put(st, b, h, slot, r, x):
    st["keys"][b, h, slot] = torch.from_numpy(r.key[x])
    st["values"][b, h, slot] = torch.from_numpy(r.val[x])
    st["slot_pos"][b, h, slot] = x


def append_state(st, b, h, pos, k, v):
    """Append one token to row (b, h) of an op state (as kvrewrite::cache_append would)."""
    f = int(st["fill"][b, h])
    st["keys"][b, h, f] = torch.as_tensor(k, dtype=st["keys"].dtype)
    st["values"][b, h, f] = torch.as_tensor(v, dtype=st["values"].dtype)
    st["slot_pos"][b, h, f], st["bias"][b, h, f], st["fill"][b, h] = pos, 0.0, f + 1


def read_row(st, b, h, p: Params):
    """Row (b, h) of an op state in Row.view()'s form (sample slots named by their slot_pos)."""
    C = st["keys"].shape[2]
    base = C - p.S
    f = int(st["fill"][b, h])
    exact = [int(st["slot_pos"][b, h, j]) for j in range(f) if st["bias"][b, h, j] > NEG_INF]
    nc = int(st["n_clusters"][b, h])
    pos = st["slot_pos"][b, h].tolist()
    v = dict(exact=exact, n_clusters=nc, reps=[st["rep"][b, h, i].double().numpy() for i in range(nc)],
             counts=st["count"][b, h, :nc].tolist(),
             ksamp=[pos[base + i * p.t: base + (i + 1) * p.t] for i in range(nc)],
             vsamp=pos[base + p.M * p.t: base + p.M * p.t + p.s], mu=float(st["mu"][b, h]),
             delta=float(st["delta"][b, h]), n_seen=int(st["n_seen"][b, h]), n_forced=int(st["n_forced"][b, h]))
    if v["n_seen"]:
        v["bias"] = st["bias"][b, h, base:].double().tolist()
        v["role"] = st["role"][b, h, base:].tolist()
    return v
