"""kvrewrite::ems_merge — EMS's merge of the to-be-merged groups into their centres, the LUT cap and the compaction
of entries and slots (docs/contracts/ems.md §6.9).

Per due row (cls from kvrewrite::ems_partition, dest from kvrewrite::ems_redundancy, g and g_pooled from
kvrewrite::ems_score), in this order:

1. Groups. Kept entries K = cls in {1, 2}. For a centre c, G_c = [c] + the TBM d with dest_d = c, d ascending.
   Slots of entries with dest -1 (the zero class, level-1 evicted, padding) die: freed, never a zero key.
2. Weights. W_e = the sum of g over e's slots. If sum_{e in G_c} W_e <= 0, W_e := |slots(e)| (decision 1).
3. Merge, only for centres with |G_c| >= 2 (every other entry keeps its keys, values, raw_keys and its slots'
   key_scale bit for bit):
       u_e = keys[e] / ||keys[e]|| (0 if the norm is 0);  m = sum_{e in G_c} W_e u_e
       keys[c] = (m / ||m||).to(dtype) if ||m|| > 0 else unchanged
       values[c] = (sum W_e values[e] / sum W_e).to(dtype)
       raw_keys[c] = unit(sum W_e unit(raw_keys[e])).to(dtype)          (pos "without"; the same rules)
       every slot j of every e in G_c: n_j = key_scale_j * ||keys_old[e]||, key_scale_j = n_j / ||keys[c]|| (the
       stored new key; 1 if that norm is 0), so ||key_scale_j * keys[lut_j]|| = n_j (decision 2); lut_j = c.
4. LUT cap. If the live slots (the slots of K) exceed R_max = Bt + floor((gamma - 1) * Bt) (no cap for
   gamma = inf), that many are dropped among the non-head slots of centres: the lowest g_pooled first, on a tie
   the larger token_pos first. A head slot and the window's slots are never dropped.
5. Layout. Kept entries packed in ascending old index (head-position order), fill = |K|. An entry's slots: its
   own old slots in old order (head first), then each merged d's slots in old order, d ascending, minus the
   dropped ones; each carries its lut (the new entry), key_scale, token_pos and the three scores. entry_start =
   the new first slot, slot_pos[e] = the max token_pos of its slots, bias = 0; slot_order = the old one remapped
   with the dead slots removed (still sorted by position); slot_fill = the live slots.
6. Freed entries [fill, C): bias -inf, entry_start 0; keys, values, slot_pos and raw_keys left as they are (as
   evict_by_score). Freed slots [slot_fill, R): lut -1, key_scale 1, slot_order -1, token_pos 0, scores 0.
7. win_count is not an argument (not touched). Rows not due are untouched, bit for bit.

The group sums of step 2-3 are fp64 segment sums (a cumulative sum over the entries sorted by group, differenced),
rounded once to the stored dtype: deterministic on every device, no float atomics; the contract's fp32 order of
summation is therefore not the reference's, and the tests compare with the float64 model at 1e-6 relative.

State (mutated): keys, values [B, Hkv, C, D]; bias fp32, slot_pos int64, entry_start int32 [B, Hkv, C]; fill,
slot_fill [B, Hkv] int64; raw_keys [B, Hkv, C or 0, D] (0 entries: pos "with"); lut, token_pos, slot_order int32
and key_scale, s_glo, s_loc_past, s_loc_cur fp32 [B, Hkv, R]. Read: budget [2] int64, g, g_pooled [B, Hkv, R]
fp32, cls, dest [B, Hkv, C] int32, due [B, Hkv] bool. Args: gamma (float >= 1, inf allowed).

Backends: the reference below (static-shape tensor code: stable sorts, cumulative sums, gathers and scatters of
integers; no host reads; deterministic) is the CPU path and the ground truth. The CUDA path is `_cuda_impl`'s
choice: the Triton kernels of kvrewrite/kernels/_ems_merge_kernels.py (nine launches; their docstring) once
KERNELS_CHECKED_ON_GPU records that their GPU tests passed and the state fits them (D <= 256; any R since stop 41,
when a 32k prompt at batch 8 with chunks of 2048, R = 36836, was found running this reference: 1035 ms a
compressing step on an H200 where the kernels took ~41 ms; docs/bench.md "Stop 41 runs"), else this reference
(logged once). The kernels sum the weights in fp64 (as the reference) and the merged
directions and values in fp32 in the groups' order, so merged floats agree with the reference to ~1e-7 relative;
every discrete result (layout, lut, cap, slot_order) is exact. Freed entries' keys/values/raw_keys rows are left
as they were by the kernels; the reference leaves a merged centre's new row there when that centre's old index is
freed (never read either way; the tests compare the kept entries [0, fill)).

Checked: through Triton's interpreter against this reference and the naive model (tests/kernels/
test_ems_merge_triton.py), and compiled on an H100 (torch 2.11, Triton 3.6) against this reference on the same GPU
(fp32/fp16/bf16, D 64/128, C 517, R 1201, pos with/without, gamma 1/1.25/4/inf, tau 0/0.6/1, padding, rows not
due, three successive merges with ||a_j keys[lut_j]|| == n_j), the naive model and a CUDA graph replay
(tests/kernels/test_ems_merge_gpu.py: 47 passed). Measured there on a Llama-3.1-8B-shaped 32k state at budget
0.2 (Hkv 8, C 6866, R 27464, D 128, bf16; tests/kernels/test_ems_compress_gpu.py run as a script, CUDA events,
eager, the nine launches' Python overhead included, which varied 0.5-1.4 ms between two runs): B = 1
prefill-chunk compression 0.6-1.4 ms vs the reference's 14.7 ms, decode-time 0.5-0.9 ms vs 14.3-15.5 ms; B = 8:
1.3-1.5 ms vs 30-31 ms and 0.75-0.8 ms vs 29.5-30.8 ms. GPU time of the launches (profiler, B = 1): ~230 us at
prefill, ~195 us at decode, of which the per-row layout launch is ~98 us (the next step: its per-slot passes as
parallel launches), the group launch ~20 us, the staged move ~35 us.
"""
import importlib

import torch

from kvrewrite.kernels._fallbacks import reference_fallback
from kvrewrite.kernels._slot_kernels import _check_state
from kvrewrite.kernels.ems_partition import CENTRE, WINDOW, tbm_count
from kvrewrite.kernels.ems_score import check_due, check_slot_table, live_slots

NAME = "kvrewrite::ems_merge"
NEG_INF = float("-inf")
SLOT_FLOATS = ("s_glo", "s_loc_past", "s_loc_cur")


def _segment_sum(x, tgt):
    """fp64 sums of x [B, H, C, *] over the entries with the same target tgt [B, H, C] (-1: none), at the target's
    index; deterministic (a cumulative sum over the entries sorted by target, differenced)."""
    B, H, C = tgt.shape
    extra = x.shape[3:]
    key = torch.where(tgt >= 0, tgt.long(), C)
    order = torch.sort(key, dim=-1, stable=True).indices
    xo = x.double().gather(2, order.view(B, H, C, *([1] * len(extra))).expand(B, H, C, *extra))
    xo = torch.where((key.gather(-1, order) < C).view(B, H, C, *([1] * len(extra))), xo, 0.0)
    cs = torch.cat([torch.zeros_like(xo[:, :, :1]), xo.cumsum(2)], dim=2)
    size = torch.zeros(B, H, C + 1, dtype=torch.long, device=tgt.device).scatter_add_(
        -1, key, torch.ones_like(key))[..., :C]
    first = size.cumsum(-1) - size
    idx = lambda i: i.view(B, H, C, *([1] * len(extra))).expand(B, H, C, *extra)  # noqa: E731
    return cs.gather(2, idx(first + size)) - cs.gather(2, idx(first)), size


def _unit(x):
    n = x.norm(dim=-1, keepdim=True)
    return torch.where(n > 0, x / torch.where(n > 0, n, 1.0), 0.0)


def _merged(x, w, tgt, fallback):
    """unit(sum_e w_e unit(x_e)) per target (fp64), or fallback where that sum is 0."""
    m, _ = _segment_sum(w[..., None] * _unit(x.double()), tgt)
    return torch.where(m.norm(dim=-1, keepdim=True) > 0, _unit(m), fallback.double())


def reference_ems_merge(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
                        slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, g, g_pooled, cls, dest, due, gamma):
    B, H, C, D = keys.shape
    R = lut.shape[-1]
    dev = keys.device
    ar_c, ar_r = torch.arange(C, device=dev), torch.arange(R, device=dev)
    live, e_of = live_slots(bias, fill, lut, slot_fill)
    kept = due[..., None] & ((cls == WINDOW) | (cls == CENTRE))
    tgt = torch.where(due[..., None], dest.long(), -1)  # old target entry of every entry (-1: dies)
    slot_tgt = torch.where(live, tgt.gather(-1, e_of), -1)
    alive = slot_tgt >= 0
    tgt_c = slot_tgt.clamp_min(0)

    # 2. weights: segment sums of g over each entry's (contiguous) slots
    cnt = torch.zeros(B, H, C, dtype=torch.long, device=dev).scatter_add_(-1, e_of, live.long())
    cs = torch.cat([torch.zeros(B, H, 1, dtype=torch.float64, device=dev),
                    torch.where(live, g, 0.0).double().cumsum(-1)], dim=-1)
    start = entry_start.long().clamp(0, R)
    w = torch.where(cnt > 0, cs.gather(-1, (start + cnt).clamp(max=R)) - cs.gather(-1, start), 0.0)
    w_sum, size = _segment_sum(w, tgt)
    w = torch.where(w_sum.gather(-1, tgt.clamp_min(0)) <= 0, cnt.double(), w)
    w_sum, _ = _segment_sum(w, tgt)

    # 3. merge (computed at the centres' old indices)
    merged = kept & (size >= 2)
    m4 = merged[..., None]
    new_keys = torch.where(m4, _merged(keys, w, tgt, keys).to(keys.dtype), keys)
    v_sum, _ = _segment_sum(w[..., None] * values.double(), tgt)
    new_values = torch.where(m4, (v_sum / torch.where(w_sum > 0, w_sum, 1.0)[..., None]).to(values.dtype), values)
    new_raw = raw_keys
    if raw_keys.shape[2] > 0:
        new_raw = torch.where(m4, _merged(raw_keys, w, tgt, raw_keys).to(raw_keys.dtype), raw_keys)
    old_norm = keys.double().norm(dim=-1)
    new_norm = new_keys.double().norm(dim=-1)
    n_j = key_scale.double() * old_norm.gather(-1, e_of)
    nn_j = new_norm.gather(-1, tgt_c)
    scale_m = torch.where(nn_j > 0, n_j / torch.where(nn_j > 0, nn_j, 1.0), 1.0).float()
    new_scale = torch.where(alive & merged.gather(-1, tgt_c), scale_m, key_scale)

    # 4. the LUT cap: drop the lowest-g_pooled non-head slots of centres (ties: the later token first)
    n_live = alive.sum(-1, keepdim=True)
    cand = alive & (cls.gather(-1, tgt_c) == CENTRE) & (ar_r != entry_start.long().gather(-1, tgt_c))
    if gamma != float("inf"):
        bt = budget[0]
        n_drop = (n_live - (bt + tbm_count(bt, gamma, C))).clamp_min(0)
        by_pos = torch.sort(token_pos, dim=-1, descending=True, stable=True).indices
        key = torch.where(cand, g_pooled, float("inf")).gather(-1, by_pos)
        order = by_pos.gather(-1, torch.sort(key, dim=-1, stable=True).indices)
        rank = torch.empty_like(order).scatter_(-1, order, cand.gather(-1, order).long().cumsum(-1) - 1)
        alive = alive & ~(cand & (rank < n_drop))

    # 5. layout: entries
    new_idx = kept.long().cumsum(-1) - 1
    n_kept = kept.sum(-1, keepdim=True)
    e_dst = torch.where(kept, new_idx, C + ar_c)
    e_src = torch.cat([ar_c, ar_c]).expand(B, H, 2 * C).scatter(-1, e_dst, ar_c.expand(B, H, C))[..., :C]
    live_e = ar_c < n_kept
    g4 = lambda t: t.gather(2, e_src[..., None].expand(B, H, C, t.shape[-1]))  # noqa: E731

    # slots: sorted by (new entry, own slots first then d ascending, old slot)
    new_e = new_idx.gather(-1, tgt_c)
    sub = torch.where(e_of == tgt_c, 0, e_of + 1)
    skey = torch.where(alive, new_e * (C + 1) + sub, (C + 1) * (C + 1))
    s_src = torch.sort(skey, dim=-1, stable=True).indices  # new slot k <- old slot s_src[k]
    n_slots = alive.sum(-1, keepdim=True)
    live_s = ar_r < n_slots
    new_pos = torch.empty_like(s_src).scatter_(-1, s_src, ar_r.expand(B, H, R))  # old slot -> new slot
    new_lut = torch.where(live_s, new_e.gather(-1, s_src), -1)
    cnt_new = torch.zeros(B, H, C + 1, dtype=torch.long, device=dev).scatter_add_(
        -1, torch.where(live_s, new_lut, C), torch.ones_like(new_lut))[..., :C]
    new_start = torch.where(live_e, cnt_new.cumsum(-1) - cnt_new, 0)
    tp_new = torch.where(live_s, token_pos.gather(-1, s_src), 0)
    pos_max = torch.full((B, H, C + 1), -1, dtype=torch.long, device=dev).scatter_reduce(
        -1, torch.where(live_s, new_lut, C), tp_new.long(), "amax")[..., :C]
    # slot_order: the old token-position order of the surviving slots, remapped
    o = slot_order.long().clamp(0, R - 1)
    keep_o = (ar_r < slot_fill[..., None]) & (slot_order >= 0) & alive.gather(-1, o)
    o_dst = torch.where(keep_o, keep_o.long().cumsum(-1) - 1, R)
    new_order = torch.full((B, H, R + 1), -1, dtype=torch.long, device=dev).scatter(
        -1, o_dst, new_pos.gather(-1, o))[..., :R]

    out = {
        "keys": g4(new_keys), "values": g4(new_values), "raw_keys": g4(new_raw) if raw_keys.shape[2] > 0 else raw_keys,
        "bias": torch.where(live_e, 0.0, NEG_INF), "slot_pos": torch.where(live_e, pos_max, slot_pos.gather(-1, e_src)),
        "entry_start": new_start, "fill": n_kept[..., 0], "slot_fill": n_slots[..., 0], "lut": new_lut,
        "key_scale": torch.where(live_s, new_scale.gather(-1, s_src), 1.0), "token_pos": tp_new,
        "slot_order": new_order,
        **{f: torch.where(live_s, t.gather(-1, s_src), 0.0)
           for f, t in zip(SLOT_FLOATS, (s_glo, s_loc_past, s_loc_cur))},
    }
    state = dict(keys=keys, values=values, raw_keys=raw_keys, bias=bias, slot_pos=slot_pos, entry_start=entry_start,
                 fill=fill, slot_fill=slot_fill, lut=lut, key_scale=key_scale, token_pos=token_pos,
                 slot_order=slot_order, s_glo=s_glo, s_loc_past=s_loc_past, s_loc_cur=s_loc_cur)
    for f, t in state.items():
        d = due.view(B, H, *([1] * (t.dim() - 2)))
        t.copy_(torch.where(d, out[f].to(t.dtype), t))


def check_ems_state(name, keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale,
                    token_pos, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill):
    """ValueError naming the field unless the EMS state has the layout of docs/contracts/ems.md §3. Returns
    (B, H, C, D, R)."""
    B, H, C, D = _check_state(name, keys, values, bias, slot_pos, fill, budget)
    if tuple(entry_start.shape) != (B, H, C) or entry_start.dtype != torch.int32:
        raise ValueError(f"{name}: entry_start must be torch.int32 {[B, H, C]}, got {entry_start.dtype} "
                         f"{list(entry_start.shape)}")
    if tuple(raw_keys.shape) not in ((B, H, C, D), (B, H, 0, D)) or raw_keys.dtype != keys.dtype:
        raise ValueError(f"{name}: raw_keys must be {keys.dtype} {[B, H, C, D]} (pos 'without') or {[B, H, 0, D]} "
                         f"(pos 'with'), got {raw_keys.dtype} {list(raw_keys.shape)}")
    _, _, _, R = check_slot_table(name, bias, fill, slot_fill, lut=(lut, torch.int32),
                                  key_scale=(key_scale, torch.float32), token_pos=(token_pos, torch.int32),
                                  slot_order=(slot_order, torch.int32), s_glo=(s_glo, torch.float32),
                                  s_loc_past=(s_loc_past, torch.float32), s_loc_cur=(s_loc_cur, torch.float32))
    for field, t in (("entry_start", entry_start), ("raw_keys", raw_keys), ("lut", lut), ("key_scale", key_scale),
                     ("token_pos", token_pos), ("slot_order", slot_order), ("s_glo", s_glo),
                     ("s_loc_past", s_loc_past), ("s_loc_cur", s_loc_cur), ("slot_fill", slot_fill)):
        if not t.is_contiguous() or t.device != keys.device:
            raise ValueError(f"{name}: {field} must be contiguous and on {keys.device} (the op updates it in place)")
    return B, H, C, D, R


def _check_inputs(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
                  slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, g, g_pooled, cls, dest, due, gamma):
    B, H, C, D, R = check_ems_state(NAME, keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut,
                                    key_scale, token_pos, slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill)
    for field, t, shape, dtype in (("g", g, (B, H, R), torch.float32), ("g_pooled", g_pooled, (B, H, R), torch.float32),
                                   ("cls", cls, (B, H, C), torch.int32), ("dest", dest, (B, H, C), torch.int32)):
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != keys.device:
            raise ValueError(f"{NAME}: {field} must be {dtype} {list(shape)} on {keys.device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    check_due(NAME, due, B, H)
    if not gamma >= 1:
        raise ValueError(f"{NAME}: gamma must be a float >= 1 (math.inf allowed), got {gamma}")


MUTATED = ("keys", "values", "bias", "slot_pos", "fill", "entry_start", "raw_keys", "lut", "key_scale", "token_pos",
           "slot_order", "s_glo", "s_loc_past", "s_loc_cur", "slot_fill")


# -- the CUDA path ------------------------------------------------------------------------------------
# tests/kernels/test_ems_merge_gpu.py passed on an H100 (torch 2.11, Triton 3.6; 47 tests, in a run of 92 with
# test_ems_redundancy_gpu.py and test_ems_compress_gpu.py, all passed)
KERNELS_CHECKED_ON_GPU = True


def _cuda_impl(keys, lut):
    """THE one place that decides the CUDA path: the Triton launcher once checked on a GPU, when Triton imports and
    the state fits the kernels, else None (the reference, logged once)."""
    if not KERNELS_CHECKED_ON_GPU:
        return None
    try:
        mod = importlib.import_module("kvrewrite.kernels._ems_merge_kernels")
    except ImportError:
        return None
    return mod.triton_ems_merge if mod.supports(keys, lut) else None


@torch.library.custom_op(NAME, mutates_args=MUTATED)
def ems_merge(keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, slot_pos: torch.Tensor,
              fill: torch.Tensor, budget: torch.Tensor, entry_start: torch.Tensor, raw_keys: torch.Tensor,
              lut: torch.Tensor, key_scale: torch.Tensor, token_pos: torch.Tensor, slot_order: torch.Tensor,
              s_glo: torch.Tensor, s_loc_past: torch.Tensor, s_loc_cur: torch.Tensor, slot_fill: torch.Tensor,
              g: torch.Tensor, g_pooled: torch.Tensor, cls: torch.Tensor, dest: torch.Tensor, due: torch.Tensor,
              *, gamma: float) -> None:
    """Merge, cap and compact the due rows in place (module docstring). CPU runs the reference; CUDA
    `_cuda_impl`'s choice."""
    args = (keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
            slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, g, g_pooled, cls, dest, due, gamma)
    _check_inputs(*args)
    reference_ems_merge(*args)


@ems_merge.register_kernel("cuda")
def _(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos, slot_order,
      s_glo, s_loc_past, s_loc_cur, slot_fill, g, g_pooled, cls, dest, due, *, gamma):
    args = (keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos,
            slot_order, s_glo, s_loc_past, s_loc_cur, slot_fill, g, g_pooled, cls, dest, due, gamma)
    _check_inputs(*args)
    launcher = _cuda_impl(keys, lut)
    if launcher is not None:
        launcher(*args)
        return
    reference_fallback("ems_merge: CUDA runs the tensor reference (KERNELS_CHECKED_ON_GPU=%s, R=%d, D=%d)",
                       KERNELS_CHECKED_ON_GPU, lut.shape[-1], keys.shape[-1])
    reference_ems_merge(*args)


@ems_merge.register_fake
def _(keys, values, bias, slot_pos, fill, budget, entry_start, raw_keys, lut, key_scale, token_pos, slot_order,
      s_glo, s_loc_past, s_loc_cur, slot_fill, g, g_pooled, cls, dest, due, *, gamma):
    return None
