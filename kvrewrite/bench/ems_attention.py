"""EMS's expanded attention at decode on the GPU, against clustered_attention over the same entries and dense
attention over every token (contract docs/contracts/ems.md §8, §10).

Llama-3.1-8B layout (Hq 32, Hkv 8, D 128, bf16), contexts n = 32k and 128k, batch 1 and 8, EMS at budget 0.2 with
its defaults (γ = 4, window 32, interval 32, prefill chunk 256) right after a compression: Bt = 0.2 (n + 128)
entries live (C = Bt + 31 + 256 allocated), slot_fill = R_max = 4 Bt runtime slots (R = 4 C allocated); the window's
32 entries hold one slot each, the other entries 1 + a multinomial share of the rest (mean ~4). Timed:
- expanded: kvrewrite::expanded_attention's Triton launch (fwd + combine), past_only, over those slots; with its
  launch variants (VARIANTS: the full-width form, split counts, chunk and tile sizes), each first checked against
  the default's output on the first set;
- clustered_C: kvrewrite::clustered_attention over the same C entries (one slot per entry: what the attention
  would cost without the expansion);
- dense_n: kvrewrite::clustered_attention over all n tokens (the full cache).
Each op runs once per input set inside one CUDA graph over sets rotated so that >= 256 MB is read per replay (cold
L2, as kvrewrite/bench/attention.py), median of triton's do_bench over replays, per call. The expanded output is
checked against the reference on the first set (bf16 tolerance) before timing.

Bytes the expanded kernel must move: K + V + bias + entry_start per live entry, lut + key_scale per slot, q and out.

    python -m kvrewrite.bench.ems_attention --out docs/bench/ems_attention.json
"""
import argparse
import json
import math
import re

import torch
from torch._library.triton import set_wrap_triton_enabled

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.bench.attention import ROTATE_BYTES, _graph_us, start_run
from kvrewrite.kernels import clustered_attention as ca
from kvrewrite.kernels import expanded_attention as xa

HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16
VARIANTS = {  # name -> launch_expanded_forward tuning. default: the narrow form (decode: the per-slot work on the
    # group's 4 rows of the 16-row block, running-sum segment sum) at 64 splits and 64-slot chunks (stop 51, H200:
    # 0.60-0.70x the full width's time at the four shapes below), 48 of 128 slots at batch 1 since stop 52 (the
    # end-to-end rows' choice, expanded_attention.NARROW_FEW_ROWS; "narrow_64x64" is the form it replaced there);
    # before it, the full width with tl.gather, the one-hot segment sum, 64 entries x 128 slots and
    # clustered_attention's split rule
    "default": {},
    "full_width": dict(narrow=False),
    "full_width_bj64": dict(narrow=False, block_j=64),
    "full_width_cumsum": dict(narrow=False, scatter="cumsum"),
    "full_width_bn32": dict(narrow=False, block_n=32),
    "narrow_64x64": dict(num_splits=64, block_j=64),  # stop 51's default at every batch
    "narrow_bj128": dict(block_j=128),
    "narrow_bn32": dict(block_n=32),
    **{f"narrow_splits{s}": dict(num_splits=s) for s in (32, 48, 96, 128)},
}


def sizes(n, budget=0.2, gamma=4, window=32, interval=32, chunk=256, decode=128):
    Bt = int(budget * (n + decode))
    C = Bt + interval - 1 + chunk
    return Bt, C, int(gamma * Bt), math.ceil(gamma * C)  # Bt, C, slot_fill = R_max, R


def shared_slots(rows, n_entries, n_shared, extra, R, gen, dev):
    """(entry_start [rows, n_entries] int32, lut and key_scale [rows, R]) of a slot table in entry order: every entry
    holds one slot, and `extra` more fall on the first n_shared entries (a multinomial share); a merged entry's slots
    get key scales in [0.5, 1.5), the others 1; slots past n_entries + extra are free (lut -1, scale 1)."""
    n_slots = n_entries + extra
    counts = torch.zeros(rows, n_entries, dtype=torch.int64, device=dev)
    counts.scatter_add_(1, torch.randint(0, n_shared, (rows, extra), device=dev, generator=gen),
                        torch.ones(rows, extra, dtype=torch.int64, device=dev))
    size = counts + 1
    start = torch.cumsum(size, 1) - size
    j = torch.arange(R, device=dev).expand(rows, R).contiguous()
    lut = (torch.searchsorted(start, j, right=True) - 1).int()
    lut[:, n_slots:] = -1
    merged = size.gather(1, lut.clamp_min(0).long()) > 1
    key_scale = torch.where(merged, 0.5 + torch.rand(rows, R, device=dev, generator=gen), 1.0)
    key_scale[:, n_slots:] = 1.0
    return start.int(), lut, key_scale


def expanded_set(B, n, gen):
    """One input set of the expanded attention (module docstring)."""
    Bt, C, n_slots, R = sizes(n)
    dev = "cuda"
    rows = B * HKV
    q = torch.randn(B, HQ, 1, D, device=dev, generator=gen).to(DTYPE)
    keys = torch.randn(B, HKV, C, D, device=dev, generator=gen).to(DTYPE)
    values = torch.randn(B, HKV, C, D, device=dev, generator=gen).to(DTYPE)
    bias = torch.full((B, HKV, C), -math.inf, device=dev)
    bias[..., :Bt] = 0.0
    slot_pos = torch.arange(C, device=dev).expand(B, HKV, C).contiguous()
    # slots beyond one per entry, shared among the non-window entries
    start, lut, key_scale = shared_slots(rows, Bt, Bt - 32, n_slots - Bt, R, gen, dev)
    entry_start = torch.zeros(rows, C, dtype=torch.int32, device=dev)
    entry_start[:, :Bt] = start
    slot_fill = torch.full((B, HKV), n_slots, dtype=torch.int64, device=dev)
    cpos = torch.tensor([n + 127], device=dev)
    return (q, keys, values, bias, slot_pos, cpos, entry_start.view(B, HKV, C), lut.view(B, HKV, R),
            key_scale.view(B, HKV, R), slot_fill)


def dense_set(B, n, gen, C=None):
    C = n if C is None else C
    dev = "cuda"
    q = torch.randn(B, HQ, 1, D, device=dev, generator=gen).to(DTYPE)
    keys = torch.randn(B, HKV, C, D, device=dev, generator=gen).to(DTYPE)
    values = torch.randn(B, HKV, C, D, device=dev, generator=gen).to(DTYPE)
    bias = torch.zeros(B, HKV, C, device=dev)
    slot_pos = torch.arange(C, device=dev).expand(B, HKV, C).contiguous()
    return q, keys, values, bias, slot_pos, torch.tensor([n + 127], device=dev)


def n_sets(nbytes):
    return max(1, min(16, math.ceil(ROTATE_BYTES / nbytes)))


def expanded_bytes(B, n):
    Bt, C, n_slots, R = sizes(n)
    return B * HKV * (Bt * (2 * D * 2 + 8) + n_slots * 8) + 2 * B * HQ * D * 2


def case(B, n, variants=VARIANTS):
    gen = torch.Generator(device="cuda").manual_seed(0)
    Bt, C, n_slots, R = sizes(n)
    scale = D**-0.5
    nbytes = expanded_bytes(B, n)
    sets = [expanded_set(B, n, gen) for _ in range(n_sets(nbytes))]
    out, lse = xa.triton_expanded_attention(*sets[0], scale, True)
    ref, ref_lse = xa.reference_expanded_attention(*sets[0], scale, True)
    err = (out.float() - ref.float()).abs().max().item()
    lse_err = (lse - ref_lse).abs().max().item()
    assert err < 2.5e-2 and lse_err < 1e-3, f"expanded vs reference: out {err}, lse {lse_err}"
    del ref, ref_lse

    def launcher(**tuning):
        def fn(*s):
            with set_wrap_triton_enabled(False):  # the kernels themselves, as the op's eager kernel launches them
                return xa.launch_expanded_forward(*s, scale, True, 0.0, **tuning)
        return fn

    row = dict(context=n, batch=B, Bt=Bt, C=C, slots=n_slots, R=R, expanded_bytes=nbytes, n_sets=len(sets),
               launch=xa._launch_config(B, HKV, HQ // HKV, 1, C, D, ca._num_sms(torch.device("cuda")), 2))
    variants_us = {}
    for name, tuning in variants.items():
        try:
            got, got_lse = launcher(**tuning)(*sets[0])
            err = (got.float() - out.float()).abs().max().item()
            lse_err = (got_lse - lse).abs().max().item()
            if not (err < 2.5e-2 and lse_err < 1e-3):  # a launch variant must compute the default's function
                raise AssertionError(f"{name} vs default: out {err}, lse {lse_err}")
            variants_us[name] = _graph_us(launcher(**tuning), sets)
        except Exception as e:  # noqa: BLE001  (a variant that does not compile, e.g. out of shared memory)
            variants_us[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    row["expanded_variants_us"] = variants_us
    row["expanded_us"] = variants_us["default"]
    row["expanded_gbps"] = nbytes / row["expanded_us"] / 1e3
    del sets
    torch.cuda.empty_cache()

    def clustered(*s):
        with set_wrap_triton_enabled(False):
            return ca._launch(*s, scale, 0, True)

    c_bytes = B * HKV * C * (2 * D * 2 + 4)
    sets = [dense_set(B, n, gen, C) for _ in range(n_sets(c_bytes))]
    row["clustered_C_us"] = _graph_us(clustered, sets)
    del sets
    torch.cuda.empty_cache()
    d_bytes = B * HKV * n * (2 * D * 2 + 4)
    sets = [dense_set(B, n, gen) for _ in range(n_sets(d_bytes))]
    row["dense_n_us"] = _graph_us(clustered, sets)
    del sets
    torch.cuda.empty_cache()
    row["expanded_over_clustered_C"] = row["expanded_us"] / row["clustered_C_us"]
    row["expanded_over_dense_n"] = row["expanded_us"] / row["dense_n_us"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench/ems_attention.json")
    parser.add_argument("--variants", default=None, metavar="REGEX",
                        help="time only the launch variants whose names match (the default always runs)")
    args = parser.parse_args()
    pattern = re.compile(args.variants) if args.variants else None
    variants = {k: v for k, v in VARIANTS.items() if k == "default" or pattern is None or pattern.search(k)}
    env, copy = start_run()
    rows = []
    for n in (32768, 131072):
        for B in (1, 8):
            row = case(B, n, variants=variants)
            rows.append(row)
            v = row["expanded_variants_us"]
            print(f"n={n:<6} B={B} C={row['C']} slots={row['slots']}: expanded {row['expanded_us']:.1f} us "
                  f"({row['expanded_gbps']:.0f} GB/s) | clustered over C {row['clustered_C_us']:.1f} us | dense over n "
                  f"{row['dense_n_us']:.1f} us | variants "
                  + ", ".join(f"{k} {x:.1f}" if isinstance(x, float) else f"{k} {x}" for k, x in v.items()),
                  flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
