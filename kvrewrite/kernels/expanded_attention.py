"""kvrewrite::expanded_attention — attention over EMS's runtime slots, one stored key per entry.

EMS (contract docs/contracts/ems.md §6.2, issue 17) stores C entries per row (b, kv-head) and attends R runtime
slots: slot j stands for one token and reads entry lut[j] with its own key scale a_j, so a merged entry (a unit
direction) gives each member token back its own key norm. For query t at position c_t and query head hq (GQA:
KV head h = hq // G, G = Hq / Hkv):

    s_e = scale * q_t·keys[e]                                              (per entry, fp32)
    slot j is visible iff j < slot_fill, e = lut[j] >= 0, bias[e] > -inf and slot_pos[e] <= c_t
    z_j = a_j * s_e          (softcap > 0: z_j = softcap * tanh(a_j * s_e / softcap))
    o_t = sum_j e^{z_j - m} v_{lut[j]} / sum_j e^{z_j - m} = sum_e P_e v_e / sum_e P_e
    P_e = sum_{j: lut[j] = e} e^{z_j - m}
    lse_t = m + log sum_j e^{z_j - m};   no visible slot: o_t = 0, lse_t = -inf

This is exactly dense softmax attention over the expanded keys a_j·keys[lut[j]] and values values[lut[j]], computed
without forming them: scores are computed once per entry, gathered per slot, and the probabilities scattered back
per entry before P @ V. Causality is tested per entry (exact: a merged entry's members are all older than any later
chunk's queries, and slot_pos[e] is their max). Free slots, zero-class slots and padding entries never contribute.
EMS never runs on sliding-window layers (they keep clustered_attention), hence no window argument. The soft cap
applies to the scaled expanded score, as the model caps q·k̂_j.

Args:
    q:              [B, Hq, T, D]   model dtype
    keys, values:   [B, Hkv, C, D]  model dtype
    bias:           [B, Hkv, C]     fp32 (0 live, -inf free or padding; EMS uses no degree bias)
    slot_pos:       [B, Hkv, C]     int64 (an entry's newest token position)
    cache_position: [T]             int64
    entry_start:    [B, Hkv, C]     int32 (each entry's first slot; the reference needs only lut, the Triton
                                    kernel walks each entry tile's slots by it)
    lut:            [B, Hkv, R]     int32 (-1: free); key_scale: [B, Hkv, R] fp32; slot_fill: [B, Hkv] int64
    scale:          the model's softmax scale
    past_only:      the caller's promise that no live entry lies after any query (decode graphs); the function is
                    the same either way (the causal mask is applied regardless). Off CUDA the op checks the promise
                    (ValueError when broken), as kvrewrite::clustered_attention's CPU path does. On CUDA it does not:
                    the check is a host read, which would break CUDA-graph capture of the decode step (and
                    clustered_attention's CUDA kernel does not check it either).
    softcap:        the model's attn_logit_softcapping, 0 for none.
Returns:
    (out [B, Hq, T, D] in q's dtype, contiguous; lse [B, Hq, T] fp32, natural log). Mutates nothing.

Backends. CUDA (with Triton): the Triton kernel of kvrewrite/kernels/_expanded_attention_kernels.py (fp16/bf16/fp32,
D a power of two in 16..256; other D raise, as clustered_attention's kernel does) and clustered_attention's combine
kernel: split-K over runtime slots (each split's share of slot_fill read on the device), the score computed once per
entry tile, gathered per slot in registers (tl.gather), P segment-summed per entry (one-hot product), P @ V once
per tile; a decode step never forms an expanded key or value. Prefill-sized blocks without a split (PREFILL_KERNEL) run
_expanded_prefill_kernels.py instead (a compute-bound chunk gains more from whole dot products than from the
per-entry scores): each slot's key and value rows written out in slot order, then clustered_attention's prefill
kernel over them with per-slot key scales (PREFILL_GATHERED, from 512 queries), or the slots walked as a dense
attention over rows gathered per slot tile, never written. launch_expanded_forward is also what
kvrewrite::ems_attention calls (its decode optionally writing the per-entry scores S). CPU: the reference below,
through the opaque kvrewrite::expanded_attention_cpu (it checks past_only's promise, a host read). Other devices:
the reference. The op is a `torch.library.triton_op`: Inductor sees the launches and CUDA graphs capture them.

Checked: through Triton's interpreter against expanded_naive's float64 loop (tests/kernels/
test_expanded_attention_triton.py, fp32, 15 tests; the prefill kernel 5 more) and on an H100 (torch 2.11, Triton 3.6)
against a float64 dense attention over materialised expanded keys, the reference and the tiny naive cases, with merged
entries of varied key scales, dead and stale slots, padding, ragged fills, prefill T > 1, decode, softcap, G in
{1, 2, 4, 8} and MQA, nothing-visible rows, odd C and R, both segment sums and launch variants, S, a CUDA graph,
torch.compile and opcheck (tests/kernels/test_expanded_attention_gpu.py: 95 passed); KERNELS_CHECKED_ON_GPU records
that.
Speed (kvrewrite/bench/ems_attention.py, docs/bench/ems_attention.json; H100, Llama-3.1-8B layout, bf16, budget
0.2, gamma 4, CUDA graph, cold L2): decode over 4 Bt slots costs 1.86-1.98x clustered_attention over the same C
entries and 0.43-0.58x dense attention over all n tokens (32k B 1: 33.8 us vs 18.2 and 57.9).
"""
import torch
from torch.library import wrap_triton

from kvrewrite.kernels import _expanded_attention_kernels as _kernels
from kvrewrite.kernels import _expanded_prefill_kernels as _prefill
from kvrewrite.kernels import clustered_attention as ca
from kvrewrite.kernels._prefill_attention_kernels import prefill_overrides
from kvrewrite.kernels._triton_op import check_attention_shapes, check_one_cuda_device, register_triton_op
from kvrewrite.kernels.clustered_attention import check_past_only, check_softcap

try:
    import triton
except ImportError:  # CPU-only installs: the op runs its reference; only the Triton launcher raises
    triton = None

NAME = "kvrewrite::expanded_attention"
BLOCK_T = 128  # queries per block of the reference: bounds its memory to B * Hq * BLOCK_T * R floats


def _expect(name, field, t, shape, dtype):
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name}: {field} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


def check_expanded_inputs(name, q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill,
                          values=None, softcap=0.0):
    """ValueError naming the argument, its expected shape and dtype; returns (B, Hq, T, D, Hkv, C, R).
    Shared by expanded_attention, expanded_attention_stats and ems_attention."""
    B, Hq, T, D, Hkv, C = check_attention_shapes(name, q, keys, bias, slot_pos, cache_position)
    if values is not None and values.shape != keys.shape:
        raise ValueError(f"{name}: values must be [B, Hkv, C, D] = {list(keys.shape)} like keys, "
                         f"got {list(values.shape)}")
    _expect(name, "bias", bias, (B, Hkv, C), torch.float32)
    _expect(name, "slot_pos", slot_pos, (B, Hkv, C), torch.int64)
    _expect(name, "cache_position", cache_position, (T,), torch.int64)
    _expect(name, "entry_start", entry_start, (B, Hkv, C), torch.int32)
    if lut.dim() != 3 or tuple(lut.shape[:2]) != (B, Hkv):
        raise ValueError(f"{name}: lut must be [B={B}, Hkv={Hkv}, R], got {list(lut.shape)}")
    R = lut.shape[2]
    _expect(name, "lut", lut, (B, Hkv, R), torch.int32)
    _expect(name, "key_scale", key_scale, (B, Hkv, R), torch.float32)
    _expect(name, "slot_fill", slot_fill, (B, Hkv), torch.int64)
    tensors = [q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill]
    if values is not None:
        tensors.append(values)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{name}: all inputs must be on one device, got {sorted({str(t.device) for t in tensors})}")
    check_softcap(softcap, name)
    return B, Hq, T, D, Hkv, C, R


def check_promise(bias, slot_pos, cache_position, name):
    """check_past_only (ValueError when a live entry lies after a query), except on CUDA: there it would be a host
    sync inside the captured decode step (module docstring, past_only)."""
    if cache_position.device.type != "cuda":
        check_past_only(bias, slot_pos, cache_position, name)


def entry_scores(q, keys, scale):
    """s = scale * q·keys[e], fp32 [B, Hkv, G, T, C]: one score per entry and (query, group head)."""
    B, Hq, T, D = q.shape
    Hkv = keys.shape[1]
    return torch.einsum("bhgtd,bhcd->bhgtc", q.float().view(B, Hkv, Hq // Hkv, T, D), keys.float()) * scale


def live_slots(bias, lut, slot_fill):
    """(live [B, Hkv, R] bool, e [B, Hkv, R] int64): slot j is live when j < slot_fill, lut_j >= 0 and its entry's
    bias > -inf; e = lut clamped at 0 (a free slot reads entry 0, masked by live)."""
    e = lut.long().clamp_min(0)
    live = ((torch.arange(lut.shape[2], device=lut.device) < slot_fill[:, :, None]) & (lut >= 0)
            & (bias.gather(-1, e) > float("-inf")))
    return live, e


def slot_logits(s, bias, slot_pos, cache_position, lut, key_scale, slot_fill, softcap):
    """z = a_j * s[lut[j]] (capped), -inf where slot j is not visible: fp32 [B, Hkv, G, t, R] for the t queries of
    s [B, Hkv, G, t, C] at positions cache_position [t]. Scores are gathered per slot; keys never are."""
    B, Hkv, G, t, C = s.shape
    R = lut.shape[2]
    live, e = live_slots(bias, lut, slot_fill)
    z = s.gather(-1, e[:, :, None, None, :].expand(B, Hkv, G, t, R)) * key_scale[:, :, None, None, :]
    if softcap > 0:
        z = torch.tanh(z / softcap) * softcap
    causal = slot_pos.gather(-1, e)[:, :, None, :] <= cache_position[None, None, :, None]  # [B, Hkv, t, R]
    visible = live[:, :, None, None, :] & causal[:, :, None, :, :]
    return z.masked_fill(~visible, float("-inf"))


def masked_lse(z):
    """Natural-log log-sum-exp over the last axis, -inf for a row with nothing visible; also returns the row max
    (0 where nothing is visible) and sum of exp(z - max), for the softmax."""
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(z - m)
    denom = p.sum(dim=-1, keepdim=True)
    return p, denom, (m + torch.log(denom)).squeeze(-1)


def reference_expanded_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale,
                                 slot_fill, scale, past_only=False, softcap=0.0):
    """The CPU path and the ground truth (module docstring). Load-bearing choices: fp32 scores, softmax and
    accumulation; the entry score is scaled per slot before the cap; P is segment-summed back per entry
    (scatter_add over lut) so V is read per entry; rows with no visible slot return 0 and lse -inf."""
    B, Hq, T, D, Hkv, C, R = check_expanded_inputs(NAME, q, keys, bias, slot_pos, cache_position, entry_start, lut,
                                                   key_scale, slot_fill, values, softcap)
    if past_only:
        check_promise(bias, slot_pos, cache_position, NAME)
    G = Hq // Hkv
    out = torch.empty(B, Hkv, G, T, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hkv, G, T, dtype=torch.float32, device=q.device)
    e = lut.long().clamp_min(0)
    for t0 in range(0, T, BLOCK_T):
        t1 = min(t0 + BLOCK_T, T)
        s = entry_scores(q[:, :, t0:t1], keys, scale)
        z = slot_logits(s, bias, slot_pos, cache_position[t0:t1], lut, key_scale, slot_fill, softcap)
        p, denom, block_lse = masked_lse(z)  # p is 0 on invisible slots
        lse[:, :, :, t0:t1] = block_lse
        P = torch.zeros_like(s).scatter_add_(-1, e[:, :, None, None, :].expand_as(p), p)  # [B, Hkv, G, t, C]
        o = torch.einsum("bhgtc,bhcd->bhgtd", P, values.float())
        out[:, :, :, t0:t1] = o / denom.clamp_min(torch.finfo(torch.float32).tiny)
    return out.reshape(B, Hq, T, D).to(q.dtype), lse.reshape(B, Hq, T)


# ---------------------------------------------------------------------------------------------------
# Triton (CUDA): the kernel is kvrewrite/kernels/_expanded_attention_kernels.py
# ---------------------------------------------------------------------------------------------------
# tests/kernels/test_expanded_attention_gpu.py: 95 passed on an H100 (torch 2.11, Triton 3.6), both segment sums
KERNELS_CHECKED_ON_GPU = True
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)
GATHERS = {"onehot": 0, "onehot_tf32x3": 1, "gather": 2}  # the in-tile gather of s (kernel module docstring)
SCATTERS = {"onehot": 0, "cumsum": 1}  # the per-entry segment sum of p (kernel module docstring)


# Programs of the expanded kernel one SM holds, for clustered_attention's large-batch split rule (its `resident`):
# kvrewrite/bench/occupancy.py finds 230-255 registers and 41 KB at bf16, D = 128, two per SM on Hopper. 0 keeps one
# split where a decode grid overflows the SMs, the launch measured so far; the rule for this kernel is unmeasured
# (docs/bench/attention_notes.md, "Large batches"): A/B it with `kvrewrite bench --kernel-option
# expanded_attention.RESIDENT_PROGRAMS=2` before making it the default.
RESIDENT_PROGRAMS = 0

# Prefill-sized blocks (G * T > 16) without a split and without S run _expanded_prefill_kernels.py (the slots walked
# as a dense attention over gathered rows) instead of the per-entry kernel: on an H200 at batch 8, 32k, a 2048-query
# chunk over 28.5k slots of 8.7k entries (kvrewrite/bench/ems_prefill.py; docs/bench.md "Stop 42 runs"), the
# per-entry kernel took 80.1 ms (72.1 with its running-sum segment sum), the prefill kernel 40.0 with its default
# 128 x 32 tiles (59.6 with 64 x 64). False: every launch runs the per-entry kernel (an A/B switch: `prefill_kernel=
# False` in the launch overrides, `--kernel-option expanded_attention.PREFILL_KERNEL=False`).
PREFILL_KERNEL = True
# With PREFILL_GATHERED, such blocks first write each slot's key and value rows out in slot order
# (_expanded_prefill_kernels.gather_slots: 1.1 GB of transient memory at batch 8, 32k, budget 0.2) and run
# clustered_attention's prefill kernel over them with each slot's score times a_j: contiguous, pipelined loads and
# that kernel's tile ranges, where the prefill kernel's loads hang on the slot's lut entry. Compiled for sm_90 (bf16,
# D 128) the prefill kernel spills 176 bytes a thread at 64 x 64 tiles and 224 at 128 x 32; clustered_attention's
# with the key scales none at 64 x 64 (255 registers), 64 x 32 (195) or 128 x 64 with 8 warps. On an H200 (stop 48,
# the benchmark's chunk above): 30.3 ms with its 64 x 64 default (gather_slots 3.5 of it) against the walk's 40.3;
# EMS's whole batch-8 prefill 20.96 s against 21.47 (1.87x and 1.91x HF's dense prefill of the same calls); its GPU
# tests pass. The default since, for blocks of at least PREFILL_GATHERED_MIN_QUERIES queries; False walks the slots
# (`gathered=False` in the launch overrides, `--kernel-option expanded_attention.PREFILL_GATHERED=False`).
PREFILL_GATHERED = True
# The copy is a pass over every slot's rows whatever the number of queries (3.5 ms of the 30.3 above), the gain a
# share of the attention (40.3 -> 26.8 ms at 2048 queries): if both attentions scale with the queries, the two forms
# break even near 3.5 / (13.5 / 2048) = 531 queries. Shorter blocks (a prefill's last chunk, a decode step of a wide
# group: 32 query heads on one KV head make 32 rows of one query) walk the slots in place. Estimated from that one
# shape, not measured in between.
PREFILL_GATHERED_MIN_QUERIES = 512

# The narrow form (kernel module docstring, GM): where one query block holds every real row (G * T <= block_m, as at
# decode), the per-slot work runs on next_power_of_2(G * T) rows instead of block_m (16), with the running-sum
# segment sum (the one-hot product needs 16 rows). A decode step at G = 4 spent 3/4 of the full-width form's per-slot
# work on padding rows. Its programs are lighter (sm_90, bf16, D 128, split: 128 registers and 22.5 KB at 64-slot
# chunks, 158 at 128, against the full width's 230 and 41 KB) and gain from more splits and shorter slot chunks.
# H200, stop 51 (docs/bench.md "Stop 51 runs", bench/ems_attention.py, CUDA-graph replays, budget 0.2; the full
# width's 27/4/32/4 splits and 128-slot chunks against the narrow form's at 64 splits asked (54/54/60/60 whole-tile
# splits) and 64-slot chunks):
#   32k batch 1: 33.2 -> 23.2 us; 32k batch 8: 165.8 -> 113.5; 128k batch 1: 89.2 -> 58.7; 128k batch 8: 613 -> 368.
# The narrow form alone (the full width's splits and chunks) took 0.91-0.94x the full width's time; 48 splits with
# 128-slot chunks 0.73-0.85x; 32-192 splits and 48-128 with 64-slot chunks were swept. End to end (EMS, 32k, two runs
# each): batch 8 10.94-10.96 ms/token against 11.51-11.55 (-5%), batch 1 5.778 against 5.809-5.812 (-0.5%; the
# 48-split, 128-slot form ran 5.703 once: not settled). Default since; narrow=False in the launch overrides (or
# `--kernel-option expanded_attention.NARROW=False`) is the full width.
NARROW = True
# The fewest rows of the narrow form: Triton 3.6 fails to compile it for sm_90 at 1 and 2 rows (an MLIR pass,
# TritonGPUOptimizeThreadLocality, on the [GM, BLOCK_J] reductions; the H200's GPU tests of stop 51, reproduced here
# with bench/occupancy.py), and compiles 4 (G = 1 and 2 take 4 rows: 2-4x their real ones, still a quarter of 16).
NARROW_MIN_ROWS = 4


def narrow_compiles(block_n: int, block_j: int) -> bool:
    """Whether Triton 3.6 compiles the narrow form for sm_90 at these entry tiles and slot chunks (4 and 8 rows):
    both at least 32, or both 16. Every other pair fails in the same MLIR pass as 1 and 2 rows (bench/occupancy.py
    over block_n, block_j in 16..128, D 64 and 128, stop 51); _launch_config gives those the full width."""
    return (block_n >= 32 and block_j >= 32) or block_n == block_j == 16


# The narrow form's split count and slot chunk where the launch names none: NARROW_SPLITS, but at most
# NARROW_PROGRAMS programs in all (the sweep above: batches 1 and 8 of 8 KV heads, 432 and 3456 programs at 54
# splits; at batch 8, 32-96 splits were within 6% of each other). Larger batches are not measured: the cap keeps
# their grid and their split partials (B * Hq * splits * D fp32, written and read by the combine) near batch 8's
# (batch 40: 12 splits). Splits are whole entry tiles, >= 2 each, as clustered_attention's rule makes them: 64
# asked gives 54 at 32k.
NARROW_SPLITS = 64
NARROW_PROGRAMS = 4096
NARROW_BLOCK_J = 64
# Grids of at most NARROW_FEW_ROWS rows (B * Hkv: batch 1 of 8 KV heads) ask NARROW_FEW_SPLITS splits of
# NARROW_FEW_BLOCK_J-slot chunks instead. Measured end to end only (EMS, 32k, H200; docs/bench.md "Stop 52 runs"): at
# batch 1, 48 splits asked (36 given) with 128-slot chunks ran 5.71-5.73 ms/token against the 64/64 default's
# 5.77-5.78 (plain step 5.40 against 5.44; two alternating pairs on one GPU, then the rule three times against 5.78
# with it off in a later call; 5.70 in stop 51), where at batch 8 it ran 11.16 against 10.94-10.96 (stop 51). Alone
# (bench/ems_attention.py, cold L2, no S written) 48 splits ran slower at batch 1 (stop 51's sweep): the step's kernel
# differs (WRITE_S, a warm L2 after the GEMVs), so the rule follows the end-to-end rows. At batch 2 (16 rows) the 48 /
# 128 form ran 7.07 against 6.98 (plain 6.68 against 6.56; one pair): the cut stays at 8 rows (batch 4, 32 rows, was
# not compared). 0 turns the rule off.
NARROW_FEW_ROWS = 8
NARROW_FEW_SPLITS = 48
NARROW_FEW_BLOCK_J = 128


def uses_gathered(T: int, gathered: bool | None = None) -> bool:
    """Whether a prefill-kernel block of T queries runs the gathered form: `gathered` when given (a launch override),
    else PREFILL_GATHERED for T >= PREFILL_GATHERED_MIN_QUERIES."""
    return (PREFILL_GATHERED and T >= PREFILL_GATHERED_MIN_QUERIES) if gathered is None else bool(gathered)


def _launch_config(B, Hkv, G, T, C, D, num_sms, itemsize, block_m=None, block_n=None, block_j=None,
                   num_splits=None, num_warps=None, num_stages=None, gather="gather", scatter="onehot", resident=None,
                   narrow=None):
    """Tile sizes, split count and launch options from the shapes alone (one fixed launch for CUDA graphs and
    Inductor). Splits and query blocks follow clustered_attention's _launch_config (its rule counts entry tiles:
    >= 2 per split); the slots of a row are divided among the splits on the device. Overrides: the benchmark's
    sweep and the tests' small tiles.

    Defaults measured on an H100 (docs/bench/ems_attention.json, decode 32k/128k, B 1/8): tl.gather of s and the
    one-hot segment sum with 64-entry tiles and 128-slot chunks. The one-hot tf32x3 gather took 1.8-2.1x as long,
    an fp32 ieee one-hot 2.9-3.5x (per-slot bias reads then), the running-sum segment sum +8-20%, 64-slot chunks
    +1-5%, 128-entry tiles +23-31%, 32-entry tiles -4% at 32k B 1 but +8-11% elsewhere, 8 warps +4-9%.
    narrow (default NARROW): the per-slot work on gm = next_power_of_2(G * T) rows (at least NARROW_MIN_ROWS) where
    one query block holds them all, the gather is tl.gather and the tiles compile (narrow_compiles); it takes the
    running-sum segment sum and, unless given, NARROW_SPLITS splits (at most NARROW_PROGRAMS programs in all) and
    NARROW_BLOCK_J-slot chunks (NARROW_FEW_SPLITS and NARROW_FEW_BLOCK_J on grids of at most NARROW_FEW_ROWS rows).
    Else gm = block_m."""
    decode = G * T <= 16
    if block_n is None:
        block_n = 64
    cfg = ca._launch_config(B, Hkv, G, T, C, D, num_sms, itemsize, block_m=block_m, block_n=block_n,
                            num_splits=num_splits, num_warps=num_warps if num_warps is not None else
                            (4 if decode else 8), num_stages=num_stages,
                            resident=resident if resident is not None else (RESIDENT_PROGRAMS or None))
    cfg["block_j"] = block_j if block_j is not None else (128 if decode else 64)
    cfg["gather"], cfg["scatter"] = GATHERS[gather], SCATTERS[scatter]
    cfg["gm"] = cfg["block_m"]
    if (NARROW if narrow is None else narrow) and cfg["m_blocks"] == 1 and gather == "gather":
        gm = min(cfg["block_m"], max(NARROW_MIN_ROWS, triton.next_power_of_2(G * T)))
        few = B * Hkv <= NARROW_FEW_ROWS
        bj = (NARROW_FEW_BLOCK_J if few else NARROW_BLOCK_J) if block_j is None else block_j
        if gm < cfg["block_m"] and narrow_compiles(cfg["block_n"], bj):
            if num_splits is None or block_j is None:  # the narrow form's own defaults
                splits = min(NARROW_FEW_SPLITS if few else NARROW_SPLITS, max(1, NARROW_PROGRAMS // (B * Hkv)))
                return _launch_config(B, Hkv, G, T, C, D, num_sms, itemsize, block_m, block_n, bj,
                                      splits if num_splits is None else num_splits, num_warps, num_stages,
                                      gather, scatter, resident, narrow)
            cfg["gm"], cfg["scatter"] = gm, SCATTERS["cumsum"]
    return cfg


def launch_expanded_forward(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill,
                            scale, past_only=False, softcap=0.0, S=None, **tuning):
    """Launch the expanded-attention kernel and, with several splits, clustered_attention's combine kernel; returns
    (out [B, Hq, T, D] in q's dtype, contiguous; lse [B, Hq, T] fp32, natural log, -inf where nothing is visible).
    No checks (triton_expanded_attention makes them) and no host read: CUDA-graph capturable, and Triton's
    interpreter runs it on CPU tensors. `tuning`: _launch_config's overrides (benchmark sweep, tests).

    S (optional, decode only: T == 1): an fp32 [B, Hq, C] contiguous tensor that receives
        S[b, hq, e] = scale * q[b, hq, 0]·keys[b, hq // G, e]      (fp32; before the soft cap and the key scale)
    for every entry e in [lut[j_first], lut[j_last]] of some split, i.e. every entry holding a slot j < slot_fill
    (and any entry between two such entries). An entry whose slots straddle a split boundary is written by both
    splits with the same value (same tile arithmetic; the tile alignment can differ, so the two values may differ
    in the last bit of the q·k accumulation order). Entries holding no slot below slot_fill (free entries past the
    fill) are NOT written: S keeps what it held there. The per-slot logit is then a_j * S[.., lut[j]] (softcap:
    softcap * tanh(a_j * S / softcap)), as kvrewrite::ems_attention's fused decode fold reads it."""
    B, Hq, T, D = (int(n) for n in q.shape)
    Hkv, C, R = int(keys.shape[1]), int(keys.shape[2]), int(lut.shape[2])
    G = Hq // Hkv
    if S is not None and (T != 1 or tuple(S.shape) != (B, Hq, C) or S.dtype != torch.float32
                          or not S.is_contiguous()):
        raise ValueError(f"launch_expanded_forward: S must be a contiguous fp32 [B, Hq, C] = {[B, Hq, C]} tensor and "
                         f"T == 1 (decode), got S {S.dtype} {list(S.shape)} with T = {T}")
    num_sms = ca._num_sms(q.device) if q.is_cuda else 8  # 8: Triton's interpreter on CPU tensors
    prefill_kernel = tuning.pop("prefill_kernel", PREFILL_KERNEL)
    gathered = uses_gathered(T, tuning.pop("gathered", None))
    full_tiles = tuning.pop("full_tiles", None)  # the gathered form's prefill kernel (_prefill_attention_kernels)
    cfg = _launch_config(B, Hkv, G, T, C, D, num_sms, q.element_size(), **tuning)
    n_splits = cfg["num_splits"]
    split = n_splits > 1
    if softcap > 0:  # the cap in natural units, then the base-2 domain (as clustered_attention)
        qk_scale, softcap_log2 = scale / softcap, softcap * 1.4426950408889634
    else:
        qk_scale, softcap_log2 = scale * 1.4426950408889634, 0.0
    if prefill_kernel and G * T > 16 and not split and S is None:
        if gathered:
            return _prefill.launch_gathered_prefill(
                q, keys, values, bias, slot_pos, cache_position, lut, key_scale, slot_fill, qk_scale, softcap_log2,
                softcap, full_tiles=full_tiles, **prefill_overrides(tuning))
        if full_tiles is not None:
            raise ValueError("launch_expanded_forward: full_tiles tunes the gathered form's prefill kernel; this "
                             "launch walks the slots in place (gathered=False)")
        return _prefill.launch_expanded_prefill(
            q, keys, values, bias, slot_pos, cache_position, lut, key_scale, slot_fill, qk_scale, softcap_log2,
            past_only, softcap, **prefill_overrides(tuning))
    out = torch.empty((B, Hq, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    if split:
        part = torch.empty((B * Hq * T, n_splits, D), dtype=torch.float32, device=q.device)
        m_part = torch.empty((B * Hq * T, n_splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty((B * Hq * T, n_splits), dtype=torch.float32, device=q.device)
    else:
        part = m_part = l_part = out
    bias, slot_pos, entry_start = bias.contiguous(), slot_pos.contiguous(), entry_start.contiguous()
    lut, key_scale, slot_fill = lut.contiguous(), key_scale.contiguous(), slot_fill.contiguous()
    wrap_triton(_kernels._expanded_attention_fwd_kernel)[(n_splits, B * Hkv, cfg["m_blocks"])](
        q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill,
        part, m_part, l_part, lse, out if S is None else S,
        *q.stride(), *keys.stride(), *values.stride(),
        Hkv, G, T, C, R, qk_scale, softcap_log2, float(scale), n_splits,
        HEAD_DIM=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_J=cfg["block_j"], SPLIT=split,
        LOAD_POS=not past_only, SOFTCAP=softcap > 0, WRITE_S=S is not None, GATHER=cfg["gather"],
        SCATTER=cfg["scatter"], GM=cfg["gm"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split:
        wrap_triton(ca._clustered_attention_combine_kernel)[(B * Hq * T,)](
            part, m_part, l_part, out, lse, q, out, cache_position, q.stride(0), q.stride(1), q.stride(3), n_splits,
            Hq, G, HEAD_DIM=D, BLOCK_S=max(triton.next_power_of_2(n_splits), 2), WRITE_LSE=True, SAVE_Q=False,
            NPEND=1, PDL=False, TRIGGER_FIRST=False, num_warps=4,
        )
    return out, lse


def triton_expanded_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale,
                              slot_fill, scale, past_only=False, softcap=0.0, **tuning):
    """The op on CUDA through Triton: checks (shapes, dtypes fp16/bf16/fp32, D a power of two in 16..256, one CUDA
    device), then launch_expanded_forward. past_only's promise is not checked here (a host read; module
    docstring): with it the kernel reads no slot_pos and a broken promise makes future entries visible."""
    name = "triton_expanded_attention"
    if triton is None:
        raise NotImplementedError(f"{name} needs Triton (pip install triton); kvrewrite::expanded_attention itself "
                                  "runs without it")
    B, Hq, T, D, Hkv, C, R = check_expanded_inputs(name, q, keys, bias, slot_pos, cache_position, entry_start, lut,
                                                   key_scale, slot_fill, values, softcap)
    if C == 0:
        raise ValueError(f"{name}: the state has no entries (C = 0)")
    if q.dtype not in _DTYPES or keys.dtype != q.dtype or values.dtype != q.dtype:
        raise TypeError(f"{name}: q, keys and values must share one dtype of fp16/bf16/fp32, "
                        f"got {q.dtype}, {keys.dtype}, {values.dtype}")
    if D not in _HEAD_DIMS:
        raise ValueError(f"{name}: head dim D must be one of {_HEAD_DIMS}, got D={D}")
    check_one_cuda_device(name, (q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale,
                                 slot_fill))
    if softcap > 0 and ca.libdevice is None:
        raise NotImplementedError(f"{name}: softcap > 0 needs triton.language.extra.libdevice (Triton >= 3.0)")
    return launch_expanded_forward(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale,
                                   slot_fill, scale, past_only, softcap, **tuning)


# ---------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("kvrewrite::expanded_attention_cpu", mutates_args=(), device_types="cpu")
def expanded_attention_cpu(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    entry_start: torch.Tensor,
    lut: torch.Tensor,
    key_scale: torch.Tensor,
    slot_fill: torch.Tensor,
    scale: float,
    past_only: bool = False,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path, an opaque op of its own: the reference, which checks past_only's promise (a host read, which
    the triton_op's traced body must not contain)."""
    out, lse = reference_expanded_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut,
                                            key_scale, slot_fill, scale, past_only, softcap)
    return out.contiguous(), lse


@expanded_attention_cpu.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill, scale, past_only=False,
      softcap=0.0):
    B, Hq, T, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, T), dtype=torch.float32)


def expanded_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    slot_pos: torch.Tensor,
    cache_position: torch.Tensor,
    entry_start: torch.Tensor,
    lut: torch.Tensor,
    key_scale: torch.Tensor,
    slot_fill: torch.Tensor,
    scale: float,
    past_only: bool = False,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over runtime slots (module docstring). This body is the op's kernel, its fake and what Inductor
    inlines: CUDA launches the Triton kernel (once KERNELS_CHECKED_ON_GPU), CPU calls the opaque
    kvrewrite::expanded_attention_cpu (the promise check reads data), other devices run the reference."""
    check_expanded_inputs(NAME, q, keys, bias, slot_pos, cache_position, entry_start, lut, key_scale, slot_fill,
                          values, softcap)
    if q.is_cuda and triton is not None and KERNELS_CHECKED_ON_GPU:
        return triton_expanded_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut, key_scale,
                                         slot_fill, scale, past_only, softcap)
    if q.device.type == "cpu":
        return torch.ops.kvrewrite.expanded_attention_cpu(q, keys, values, bias, slot_pos, cache_position,
                                                          entry_start, lut, key_scale, slot_fill, scale, past_only,
                                                          softcap)
    out, lse = reference_expanded_attention(q, keys, values, bias, slot_pos, cache_position, entry_start, lut,
                                            key_scale, slot_fill, scale, past_only, softcap)
    return out.contiguous(), lse


expanded_attention = register_triton_op(NAME, expanded_attention, (), triton is not None)
