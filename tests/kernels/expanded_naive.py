"""Shared by the tests of kvrewrite::expanded_attention, expanded_attention_stats and ems_attention: an EMS state
builder and a dense float64 attention over MATERIALISED expanded keys (separate code from the references).

naive_expanded builds, per row and query, the list of visible runtime slots j (j < slot_fill, lut_j >= 0,
bias[lut_j] > -inf, slot_pos[lut_j] <= c_t) with k̂_j = key_scale_j * keys[lut_j] and v̂_j = values[lut_j], and runs
a plain float64 softmax over them, slot by slot: no gather/scatter trick, no per-entry scores.
"""
import math
from dataclasses import dataclass

import torch


@dataclass
class EmsState:
    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    slot_pos: torch.Tensor
    entry_start: torch.Tensor
    lut: torch.Tensor
    key_scale: torch.Tensor
    slot_fill: torch.Tensor
    cache_position: torch.Tensor

    def attention_args(self, q):
        return (q, self.keys, self.values, self.bias, self.slot_pos, self.cache_position, self.entry_start,
                self.lut, self.key_scale, self.slot_fill)

    def stats_args(self, q, lse):
        return (q, self.keys, self.bias, self.slot_pos, self.cache_position, self.entry_start, self.lut,
                self.key_scale, self.slot_fill, lse)


def make_state(B, Hkv, C, R, D, T, dtype, gen, prefill, dead=False, empty_row=False):
    """A random EMS layer state. Each row holds past entries (positions < P, 1-3 slots each; a merged entry's slots
    get key scales in [0.3, 2.5], an unmerged one's 1; ~1/6 are padding, bias -inf) followed, for a prefill chunk,
    by the chunk's T single-slot entries at positions P..P+T-1 (the queries' positions), or for decode by the query's
    own token at P. Entries past the fill keep finite keys and bias -inf. Slots past slot_fill hold the reset values,
    or with dead=True stale ones (lut pointing at a live entry, a key scale != 1) plus one freed slot (lut -1) inside
    [0, slot_fill). empty_row=True makes batch row 0 all padding (its queries see nothing)."""
    g = gen
    n_new = T if prefill else 1
    P = 40
    keys = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    values = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    bias = torch.full((B, Hkv, C), float("-inf"))
    slot_pos = torch.randint(0, 100, (B, Hkv, C), generator=g)  # garbage past the fill
    entry_start = torch.zeros(B, Hkv, C, dtype=torch.int32)
    lut = torch.full((B, Hkv, R), -1, dtype=torch.int32)
    key_scale = torch.ones(B, Hkv, R)
    slot_fill = torch.zeros(B, Hkv, dtype=torch.int64)
    for b in range(B):
        for h in range(Hkv):
            n_slots_max = R - n_new - (3 if dead else 0)
            n_past = int(torch.randint(max(1, C // 3), C - n_new + 1, (1,), generator=g))
            sizes = torch.randint(1, 4, (n_past,), generator=g)
            while int(sizes.sum()) > n_slots_max:  # fit the table
                sizes[int(sizes.argmax())] -= 1
                if int(sizes.min()) == 0:
                    n_past -= 1
                    sizes = sizes[sizes > 0][:n_past]
            pos = torch.randperm(P, generator=g)[:n_past].sort().values
            j = 0
            for e in range(n_past):
                k = int(sizes[e])
                entry_start[b, h, e] = j
                lut[b, h, j : j + k] = e
                if k > 1:
                    key_scale[b, h, j : j + k] = 0.3 + 2.2 * torch.rand(k, generator=g)
                bias[b, h, e] = float("-inf") if torch.rand((), generator=g) < 1 / 6 else 0.0
                slot_pos[b, h, e] = pos[e]
                j += k
            for t in range(n_new):
                e = n_past + t
                entry_start[b, h, e] = j
                lut[b, h, j] = e
                bias[b, h, e] = 0.0
                slot_pos[b, h, e] = P + t
                j += 1
            slot_fill[b, h] = j
            if dead:
                lut[b, h, 0] = -1  # a freed slot inside [0, slot_fill)
                lut[b, h, j : j + 3] = n_past  # stale slots past the fill, pointing at a live entry
                key_scale[b, h, j : j + 3] = 3.0
            if empty_row and b == 0:
                bias[b, h] = float("-inf")
    cache_position = torch.arange(P, P + T) if prefill else torch.tensor([P])
    return EmsState(keys, values, bias, slot_pos, entry_start, lut, key_scale, slot_fill, cache_position)


def visible_slots(st, b, h, c):
    """The runtime slots query position c sees in row (b, h), in slot order."""
    out = []
    for j in range(int(st.slot_fill[b, h])):
        e = int(st.lut[b, h, j])
        if e >= 0 and st.bias[b, h, e] > -math.inf and int(st.slot_pos[b, h, e]) <= c:
            out.append(j)
    return out


def naive_expanded(st, q, scale, softcap=0.0):
    """float64 dense attention over materialised expanded keys. Returns (out [B, Hq, T, D], lse [B, Hq, T],
    p [B, Hq, T, R]: each query's probability of each runtime slot, 0 where not visible)."""
    B, Hq, T, D = q.shape
    Hkv, R = st.keys.shape[1], st.lut.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Hq, T, D, dtype=torch.float64)
    lse = torch.full((B, Hq, T), -math.inf, dtype=torch.float64)
    p = torch.zeros(B, Hq, T, R, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            for t in range(T):
                js = visible_slots(st, b, h, int(st.cache_position[t]))
                if not js:
                    continue
                idx = st.lut[b, h, js].long()
                k_hat = st.key_scale[b, h, js].double()[:, None] * st.keys[b, h, idx].double()
                v_hat = st.values[b, h, idx].double()
                z = (k_hat @ q[b, hq, t].double()) * scale
                if softcap > 0:
                    z = softcap * torch.tanh(z / softcap)
                w = torch.softmax(z, dim=0)
                out[b, hq, t] = w @ v_hat
                lse[b, hq, t] = torch.logsumexp(z, dim=0)
                p[b, hq, t, js] = w
    return out, lse, p
