"""EMS's three prefill kernels at one late prefill chunk of a batch, with their launch variants, next to
clustered_attention's prefill kernel over the same entries.

    python -m kvrewrite.bench.ems_prefill [--batch 8] [--context 32768] [--chunk 2048] [--out s.json] [--quick]
                                         [--kernels expanded,fold,redundancy]

Why: a batch-8 32k EMS prefill took 3.9x the dense prefill on an H200 (stop 42's profile: the expanded attention
forward 21.5 s, its statistics fold 9.1 s and the redundancy 7.6 s of 43.9 s), where kvmerger's prefill of the
same shape spent 3.3 s in clustered_attention's prefill kernel (docs/bench.md "Stop 42 runs").

The state (Llama-3.1-8B layout: Hq 32, Hkv 8, D 128, bf16; budget 0.2, gamma 4): a row holds Bt = 0.2 (n + 320)
entries from the compressions so far (positions ascending below n - chunk; the last 32 the window, one slot
each; the others share the slots up to gamma * Bt, one each plus a multinomial share of the rest, key scales in
[0.5, 1.5) for merged ones) and the chunk's fresh entries (positions n - chunk .. n - 1, one slot each); the chunk's
queries sit at those positions. Timed, each a median of triton's do_bench (warm L2: compute-bound kernels):
- expanded: expanded_attention.launch_expanded_forward, causal (past_only False): its gathered form (the default
  and `gathered*`: the slots' rows written out by gather_slots, timed alone too (its kernel, GATHER_KERNEL, and its
  tensor code's two row copies: the advanced index and GATHER_INDEX_SELECT's index_select), then
  clustered_attention's prefill kernel with per-slot key scales), the walk (`walk*`: _expanded_prefill_kernels.py's
  own kernel) and the per-entry kernel, with their launch variants; the default is
  checked against a float32 attention over the materialised expanded keys of row (0, 0) and every variant against
  the default;
- clustered_C: clustered_attention's prefill kernels (_prefill_attention_kernels.launch_prefill) over the same
  entries with one slot each (what the attention would cost without the expansion);
- fold: ems_attention's prefill statistics fold (_ems_fold_kernels.launch_prefill_fold) with its variants (fresh
  state copies each call), s_glo checked against the default's;
- redundancy: ems_redundancy's Triton launch at the chunk's compression (window 32, Bt - 32 centres, the chunk's
  entries to be merged, pre-RoPE keys), dest checked against the default's; then its two tiers' blockings alone
  and together at 32, 256, 512 and 1024 entries to merge a row (ems_redundancy.BIG_TBM); the default's big tier walks
  the listed centres (CENTRE_LIST; `list*` its variants; `cols` and `rows*` its two layouts of R, LIST_CENTRE_ROWS),
  `walk` and the blockings before it the entry blocks.
"""
import argparse
import json
import math

import torch
from torch._library.triton import set_wrap_triton_enabled

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import _bench_ms, start_run
from kvrewrite.bench.ems_attention import shared_slots
from kvrewrite.kernels import _ems_fold_kernels as fold
from kvrewrite.kernels import _expanded_prefill_kernels as xp
from kvrewrite.kernels import _prefill_attention_kernels as pk
from kvrewrite.kernels import ems_redundancy as er
from kvrewrite.kernels import expanded_attention as xa

HQ, HKV, D, DTYPE, GAMMA, WINDOW = 32, 8, 128, torch.bfloat16, 4, 32
EXPANDED = {  # name -> launch_expanded_forward overrides; "per_entry*": the decode kernel's per-entry walk
    # the default for chunks of >= 512 queries (--chunk 2048): the slots' rows written out, then clustered_attention's
    # prefill kernel (expanded_attention.PREFILL_GATHERED)
    "default": {},
    "gathered_64x32": dict(gathered=True, block_n=32),
    "gathered_128x64_w8": dict(gathered=True, block_m=128, num_warps=8),
    # _prefill_attention_kernels.FULL_TILES off: every slot tile's loads masked (the default before stop 57)
    "gathered_masked": dict(gathered=True, full_tiles=False),
    # the slots walked in place (_expanded_prefill_kernels.py's own kernel; the default of stops 42-47): 128 x 32
    # tiles, 4 warps (16-bit, D <= 128)
    "walk": dict(gathered=False),
    "walk_64x64": dict(gathered=False, block_m=64, block_n=64),
    "walk_64x32": dict(gathered=False, block_m=64, block_n=32),
    "walk_128x64_w8": dict(gathered=False, block_n=64, num_warps=8),
    "walk_128x32_w8": dict(gathered=False, num_warps=8),
    "walk_128x32_stages3": dict(gathered=False, num_stages=3),
    "walk_128x16": dict(gathered=False, block_n=16),
    "per_entry": dict(prefill_kernel=False),
    "per_entry_cumsum": dict(prefill_kernel=False, scatter="cumsum"),
}
_PLAIN = dict(lean=False, pipe=False)  # the fold's step and loop before stop 54 (_block_p, the skip branch)
FOLD = {
    "default": {},  # LEAN's step, PIPE's loop at 2 stages (stop 54), LEAN_BLOCK_M's 64-query blocks (stop 55)
    "stop53": dict(_PLAIN, pipe_stages=3),  # the default before stop 54
    "bm64": dict(_PLAIN, block_m=64),
    "bm64_w8": dict(_PLAIN, block_m=64, num_warps=8),
    "bm128_w8": dict(_PLAIN, block_m=128, num_warps=8),
    "bj64_bm64": dict(_PLAIN, block_j=64, block_m=64),
    "bj64": dict(_PLAIN, block_j=64),
    "stages3": dict(_PLAIN, num_stages=3),
    "acc2d": dict(_PLAIN, acc2d=True),  # _ems_fold_kernels.ACC2D: one reduction over the queries per head
    "acc2d_w8": dict(_PLAIN, acc2d=True, num_warps=8),
    "acc2d_bj64": dict(_PLAIN, acc2d=True, block_j=64),
    "acc2d_bm64_w8": dict(_PLAIN, acc2d=True, block_m=64, num_warps=8),
    "plain_form": dict(_PLAIN, trans=False),  # _ems_fold_kernels.TRANS off: scores as [queries, slots]
    # _ems_fold_kernels.PIPE: the query loop without its skip branch, pipelined (q, lse, positions prefetched)
    "pipe": dict(lean=False, pipe=True, pipe_stages=3),
    "pipe_s2": dict(lean=False, pipe=True, pipe_stages=2),
    "pipe_s4": dict(lean=False, pipe=True, pipe_stages=4),
    "pipe_w8": dict(lean=False, pipe=True, pipe_stages=3, num_warps=8),
    "pipe_bm64_w8": dict(lean=False, pipe=True, pipe_stages=3, block_m=64, num_warps=8),
    "pipe_bm16": dict(lean=False, pipe=True, pipe_stages=3, block_m=16),
    # _ems_fold_kernels.LEAN: one FMA and one exp2 a score, the causal mask only in blocks that need it
    "lean": dict(lean=True, pipe=False, block_m=32),
    "lean_bm64": dict(lean=True, pipe=False, block_m=64),
    "lean_w8": dict(lean=True, pipe=False, block_m=32, num_warps=8),
    "lean_bm64_w8": dict(lean=True, pipe=False, block_m=64, num_warps=8),
    "lean_bm128_w8": dict(lean=True, pipe=False, block_m=128, num_warps=8),
    "lean_pipe_s2": dict(lean=True, pipe=True, pipe_stages=2, block_m=32),
    "lean_pipe_s3": dict(lean=True, pipe=True, pipe_stages=3, block_m=32),
    "lean_pipe_s3_bm64": dict(lean=True, pipe=True, pipe_stages=3, block_m=64),
    "lean_pipe_s2_bm64": dict(lean=True, pipe=True, pipe_stages=2, block_m=64),
    "lean_pipe_s2_bm128_w8": dict(lean=True, pipe=True, pipe_stages=2, block_m=128, num_warps=8),
}
REDUNDANCY = {
    "default": {},  # two tiers by each row's TBM count (ems_redundancy.BIG_TBM); the big one walks the listed centres
    # the entries walked in blocks, a block without a centre skipped (ems_redundancy.CENTRE_LIST off: stop 54's default)
    "walk": dict(centre_list=False),
    "small": dict(block_t=32, num_warps=4, centre_list=False),  # the small tier alone for every row (before stop 43)
    "bt64": dict(block_t=64, centre_list=False),
    "bt64_w8": dict(block_t=64, num_warps=8, centre_list=False),
    "bt128_w8": dict(block_t=128, num_warps=8, centre_list=False),
    "bn128": dict(block_n=128, centre_list=False),
    "bt64_bn128_w8": dict(block_t=64, block_n=128, num_warps=8, centre_list=False),
    "splits1": dict(splits=1, centre_list=False),
    "splits8": dict(splits=8, centre_list=False),
    "splits16": dict(splits=16, centre_list=False),  # the most the default picks (small batches); at batch 8 it picks 4
    # ems_redundancy.RECIP_NORMS off (the default before stop 53): R divided by both norm products per score
    "divide": dict(recip_norms=False),
    "divide_small": dict(recip_norms=False, block_t=32, num_warps=4),
    # CENTRE_LIST's variants (the default's big tier: 64 centres a step, 3 stages, 128 rows x 8 warps, 4 splits at B 8)
    "list_s2": dict(list_stages=2),
    "list_s4": dict(list_stages=4),
    "list_bn128": dict(block_n=128),
    "list_bn32": dict(block_n=32),
    "list_bt64_w4": dict(block_t=64, num_warps=4),
    "list_splits8": dict(splits=8),
    # LIST_CENTRE_ROWS: the listed walk's R as [centres, TBM] (`rows*`), against the [TBM, centres] form (`cols`)
    "cols": dict(centre_rows=False),
    "rows": dict(centre_rows=True),
    "rows_bn128": dict(centre_rows=True, block_n=128),
    "rows_bn32": dict(centre_rows=True, block_n=32),
    "rows_s2": dict(centre_rows=True, list_stages=2),
}
QUICK = {"expanded": ("default", "gathered_masked", "walk", "per_entry"),
         "fold": ("default", "stop53", "lean_pipe_s2_bm64", "lean_pipe_s3_bm64"),
         "redundancy": ("default", "walk", "cols", "rows", "rows_bn128")}


def prefill_state(B, n, chunk, gen, dev="cuda"):
    """The expanded attention's inputs at the chunk (module docstring) and Bt."""
    Bt = int(0.2 * (n + 320))
    C = Bt + chunk
    rows = B * HKV
    old_slots = GAMMA * Bt
    n_slots = old_slots + chunk
    R = math.ceil(GAMMA * (Bt + 31 + chunk))
    q = torch.randn(B, HQ, chunk, D, device=dev, generator=gen).to(DTYPE)
    keys = torch.randn(B, HKV, C, D, device=dev, generator=gen).to(DTYPE)
    values = torch.randn(B, HKV, C, D, device=dev, generator=gen).to(DTYPE)
    bias = torch.zeros(B, HKV, C, device=dev)
    old_pos = torch.sort(torch.randperm(n - chunk, device=dev, generator=gen)[:Bt]).values
    pos = torch.cat([old_pos, torch.arange(n - chunk, n, device=dev)])
    slot_pos = pos.expand(B, HKV, C).contiguous()
    start, lut, key_scale = shared_slots(rows, C, Bt - WINDOW, old_slots - Bt, R, gen, dev)
    slot_fill = torch.full((B, HKV), n_slots, dtype=torch.int64, device=dev)
    cpos = torch.arange(n - chunk, n, device=dev)
    return (q, keys, values, bias, slot_pos, cpos, start.view(B, HKV, C), lut.view(B, HKV, R),
            key_scale.view(B, HKV, R), slot_fill), Bt


def dense_check(args, out, scale):
    """Max abs error of out[0, :G] against a float32 attention over row (0, 0)'s materialised expanded keys."""
    q, keys, values, bias, slot_pos, cpos, _, lut, key_scale, slot_fill = args
    G = HQ // HKV
    fill = int(slot_fill[0, 0])
    e = lut[0, 0, :fill].long()
    k = keys[0, 0, e].float() * key_scale[0, 0, :fill, None]
    v = values[0, 0, e].float()
    vis = (slot_pos[0, 0, e][None, :] <= cpos[:, None]) & (bias[0, 0, e] > -math.inf)[None, :]
    s = (q[0, :G].float() @ k.T) * scale
    ref = torch.softmax(s.masked_fill(~vis, -math.inf), dim=-1) @ v
    return (out[0, :G].float() - ref).abs().max().item()


def _time(fn):
    with set_wrap_triton_enabled(False):  # the kernels themselves, as the ops' eager paths launch them
        fn()
        torch.cuda.synchronize()
        return _bench_ms(fn)


def _variants(kind, table, measure):
    """{name: measure(tuning)} over a table of launch variants, each printed; a variant that does not run (e.g. out
    of shared memory) records its error instead."""
    res = {}
    for name, tuning in table.items():
        try:
            res[name] = measure(tuning)
        except Exception as e:  # noqa: BLE001
            res[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
        print(f"  {kind} {name:10s} {res[name]}", flush=True)
    return res


def run(B, n, chunk, quick, kernels=("expanded", "fold", "redundancy")):
    gen = torch.Generator(device="cuda").manual_seed(0)
    args, Bt = prefill_state(B, n, chunk, gen)
    scale = D**-0.5
    row = dict(batch=B, context=n, chunk=chunk, Bt=Bt, C=int(args[1].shape[2]), slots=int(args[-1][0, 0]),
               R=int(args[7].shape[2]))
    def pick(table, kind):
        if kind not in kernels:
            return {"default": table["default"]}
        return {k: table[k] for k in QUICK[kind]} if quick else table

    # -- the expanded forward -------------------------------------------------------------------------------------
    with set_wrap_triton_enabled(False):
        base, base_lse = xa.launch_expanded_forward(*args, scale, False, 0.0)
    row["expanded_dense_err"] = dense_check(args, base, scale)

    def expanded(tuning):
        with set_wrap_triton_enabled(False):
            out, lse = xa.launch_expanded_forward(*args, scale, False, 0.0, **tuning)
        err = (out.float() - base.float()).abs().max().item()
        ms = _time(lambda: xa.launch_expanded_forward(*args, scale, False, 0.0, **tuning))
        return dict(ms=ms, err_vs_default=err, lse_err=(lse - base_lse).abs().max().item())

    row["expanded"] = _variants("expanded", pick(EXPANDED, "expanded"), expanded)

    if "expanded" in kernels:  # the gathered form's first pass alone, each way (the same values)
        ways = {"gather_slots_ms": dict(kernel=False, index_select=False),  # the advanced index
                "gather_slots_index_select_ms": dict(kernel=False, index_select=True),
                "gather_slots_kernel_ms": dict(kernel=True)}  # GATHER_KERNEL (the default since stop 54)
        outs = {}
        for name, way in ways.items():
            row[name] = _time(lambda: xp.gather_slots(*args[1:5], args[7], args[9], **way))
            outs[name] = xp.gather_slots(*args[1:5], args[7], args[9], **way)
        first = outs["gather_slots_ms"]
        same = all(all(torch.equal(a, b) for a, b in zip(o, first)) for o in outs.values())
        row["gather_slots_same"] = same
        del outs, first
        print(f"  gather_slots alone {row['gather_slots_ms']:.3f} ms (advanced index), "
              f"{row['gather_slots_index_select_ms']:.3f} ms (index_select), {row['gather_slots_kernel_ms']:.3f} ms "
              f"(kernel); the same outputs: {same}", flush=True)

    # -- clustered_attention's prefill kernels over the same entries, one slot each ----------------------------------
    q, keys, values, bias, slot_pos, cpos = args[:6]
    row["clustered_C_ms"] = _time(lambda: pk.launch_prefill(q, keys, values, bias, slot_pos, cpos, 0,
                                                            scale * 1.4426950408889634, 0.0, 0.0, None))
    print(f"  clustered over C entries {row['clustered_C_ms']:.3f} ms", flush=True)

    # -- the statistics fold -----------------------------------------------------------------------------------------
    lut, key_scale, slot_fill = args[7], args[8], args[9]
    R = lut.shape[2]
    state0 = [torch.rand(B, HKV, R, device="cuda") for _ in range(3)] + [torch.zeros(B, HKV, dtype=torch.int64,
                                                                                     device="cuda")]

    def fold_call(tuning):
        st = [t.clone() for t in state0]
        fold.launch_prefill_fold(q, keys, bias, slot_pos, cpos, lut, key_scale, slot_fill, base_lse, *st, scale,
                                 WINDOW, 0.0, **tuning)
        return st

    glo_ref = fold_call({})[0]

    def folded(tuning):
        err = ((fold_call(tuning)[0] - glo_ref).abs() / glo_ref.abs().clamp_min(1e-3)).max().item()
        return dict(ms=_time(lambda: fold_call(tuning)), rel_err_vs_default=err)

    row["fold"] = _variants("fold", pick(FOLD, "fold"), folded)
    row["fold_clone_ms"] = _time(lambda: [t.clone() for t in state0])

    # -- the redundancy at the chunk's compression ---------------------------------------------------------------------
    C = keys.shape[2]
    cls = torch.full((B, HKV, C), 3, dtype=torch.int32, device="cuda")
    cls[..., :Bt - WINDOW] = 2
    cls[..., Bt - WINDOW:Bt] = 1
    raw = torch.randn(B, HKV, C, D, device="cuda", generator=gen).to(DTYPE)
    due = torch.ones(B, HKV, dtype=torch.bool, device="cuda")
    ref = er.triton_ems_redundancy(keys, values, raw, cls, due, 0.6)

    def redundancy(tuning):
        got = er.triton_ems_redundancy(keys, values, raw, cls, due, 0.6, **tuning)
        return dict(ms=_time(lambda: er.triton_ems_redundancy(keys, values, raw, cls, due, 0.6, **tuning)),
                    dest_diffs=int((got != ref).sum()))

    row["redundancy"] = _variants("redundancy", pick(REDUNDANCY, "redundancy"), redundancy)
    row["merged_share"] = float((ref[..., Bt:] >= 0).float().mean())

    # -- the redundancy by the count of entries to be merged per row (32: a decode-time compression) -------------------
    # where the tiers' blockings cross (ems_redundancy.BIG_TBM)
    sweep = {}
    for n_tbm in (32, 256, 512, 1024) if "redundancy" in kernels else (32,):
        cls[..., Bt:] = 3
        cls[..., Bt + n_tbm:] = 0
        res = {}
        for name in ("default", "walk", "cols", "rows", "small", "bt64", "bt128_w8", "splits16", "divide",
                     "divide_small"):
            res[name] = _time(lambda t=REDUNDANCY[name]: er.triton_ems_redundancy(keys, values, raw, cls, due, 0.6,
                                                                                  **t))
        print(f"  redundancy at {n_tbm} per row (ms) {res}", flush=True)
        sweep[n_tbm] = res
    row["redundancy_by_tbm"] = sweep
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="the default and one or two variants per kernel")
    parser.add_argument("--kernels", default="expanded,fold,redundancy",
                        help="the kernels whose variants run (the others: their default only)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env, copy = start_run()
    row = run(args.batch, args.context, args.chunk, args.quick, tuple(args.kernels.split(",")))
    print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env, copy_gbps=copy, rows=[row]), f, indent=1)


if __name__ == "__main__":
    main()
