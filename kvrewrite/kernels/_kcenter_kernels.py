"""Triton kernels of kvrewrite::kcenter_compress (private: the op's file owns the schema, the reference and the
registration; its CUDA path calls triton_kcenter_compress). The semantics are the op's contract: per due row
(fill >= budget[1]) with V valid slots and B = budget[0], V <= B keeps them all; else the last ℓ = floor(recent_ratio
· B) and k = B - ℓ greedy k-center centres of the other n = V - ℓ (start: the first candidate; next: the candidate
farthest from the chosen ones, squared Euclidean distance in fp32, ties to the lowest slot), packed in slot order,
bias 0, fill = the kept count, bias -inf on the rest; rows not due untouched bit for bit.

Launches (nothing is read on the host; grids depend on shapes only, so a call is CUDA-graph capturable):

1. rank (grid rows): the row's valid slots ranked by a chunked cumsum (SOR[rank] = slot, POR[rank] = slot_pos);
   META[row] = [due, V, n, k] (n = k = 0 when the row keeps everything).
2. select (grid (P, G)): greedy k-center, k sequential steps per row, in rounds. The n candidates of a row are split
   into P contiguous slices, one per program, which keeps its slice's squared distance to the nearest chosen centre
   (d2, fp32) in registers, and the slice's keys too (fp32) when they fit (<= RESIDENT_KEYS // D keys), else it
   re-reads them every step in column chunks. A point's word is (d2 bits << 32) | (0xFFFF - slot) << 16 (d2 >= 0,
   so its fp32 bits order like the value: a larger word is a farther point, or an equally far one at a lower slot,
   the reference's argmax; tag bits 0-15).
   Round r: each program publishes its T + 1 largest words (tag r + 1) with an atomic exchange into
   XCH[row, r % 2, p, :] and spins (volatile loads) until all P (T + 1) words of the row carry the tag; after a CTA
   barrier it loads them once more (the threads holding copies of a word may have loaded them at different times
   in the spin; now they are fresh and stay so, and every thread agrees). Listed: each program's T best; U: the
   largest (T + 1)-th word. Every point not listed has a word <= U, and words only fall, so while the largest
   listed word exceeds U it is the global farthest point: every program, from the same list with the same
   arithmetic, takes it as the next centre, lowers the list's d2 and its own slice's by the centre's key (loaded
   from L2) and goes on; the round ends at the first best listed word <= U (at least one centre per round: the
   farthest point is always listed). Program 0 writes ORDER[row, i] = the i-th centre's slot. Why this is safe:
   - a word slot is rewritten (round r + 2) only after its writer saw all words of round r + 1, which each program
     publishes only after reading round r's: no word is overwritten before every program read it; the tag tells a
     fresh word from the one of round r - 2 or from the zeroed buffer (XCH is zeroed per call; rounds <= k <
     65535);
   - the spin needs every program of the row to run at once: the launcher makes P * G <= the SM count (G rows in
     flight, each program walks rows g, g + G, ...), so every program is resident (one per SM suffices) once the
     kernels before it in the stream are done; a GPU shared with other work (MPS limits, green contexts) could
     delay, not deadlock, as long as P * G programs fit on what is left to the process.
   Triton's interpreter runs programs one after another: it gets P = 1 (the launcher refuses more on the CPU).
3. pack (grid rows): flags of the chosen slots from ORDER; kept = recent ranks [n, V) or chosen; destinations by
   cumsum; slot_pos from POR, bias 0 on [0, kept), -inf on [kept, C), fill; SRC[dest] = slot and INFO[row] =
   [first destination that moves, kept] for 4-5.
4-5. kvrewrite/kernels/_shift_kernels.py's stage and move launches shift the kept keys and values in place.

Cost: k sequential steps per row, each an update of the slice's d2 (n / P keys x D, fp32 on the CUDA cores) and of
the list's, plus one exchange (through L2) per round of ~P T / 2 steps: bound by the steps' arithmetic and latency,
not by memory (measured: kvrewrite/bench/kcenter_compress.py; the op's module docstring).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without Triton

import struct

import torch

from kvrewrite.kernels._slot_kernels import _check_state
from kvrewrite.kernels._triton_op import triton_jit
from kvrewrite.kernels._shift_kernels import MOVE_COLUMNS, MOVE_SLOTS, _shift_move_kernel, _shift_stage_kernel
from kvrewrite.kernels.evict_by_score import _f64

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs its reference; only triton_kcenter_compress raises
    triton = tl = None

NAME = "triton_kcenter_compress"
MAX_SLOTS = 65535  # a slot and a step tag take 16 bits of the exchange word
MAX_PROGRAMS = 16  # programs per row of the select launch (more only adds exchange latency: the slices are small)
CHUNK = 4096  # lanes of the per-row passes of launches 1 and 3 (a power of two)
SELECT_WARPS = 16
LIST_SLOTS = 128  # default lookahead T = LIST_SLOTS // P - 1: the P (T + 1) list entries fill LIST_SLOTS lanes
RESIDENT_KEYS = 32768  # a slice of up to RESIDENT_KEYS // D keys is held in registers (fp32: 64 per thread of 16 warps)
TILE = 8192  # slice lanes x key columns per step of the distance update when the keys are re-read


# -- launch 1: rank ----------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C", "ratio_bits"])
def _kc_rank_kernel(BIAS, POS, FILL, BUDGET, SOR, POR, META, C, ratio_bits, CH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    fill = tl.load(FILL + row)
    due = fill >= tl.load(BUDGET + 1)
    V = tl.zeros([], tl.int32)
    n = tl.zeros([], tl.int32)
    k = tl.zeros([], tl.int32)
    if due:
        n_fill = tl.minimum(fill, C).to(tl.int32)
        for c0 in range(0, n_fill, CH):
            s = c0 + tl.arange(0, CH)
            m = s < n_fill
            valid = m & (tl.load(BIAS + base + s, mask=m, other=float("-inf")) > float("-inf"))
            vi = valid.to(tl.int32)
            r = V + tl.cumsum(vi, axis=0) - vi
            tl.store(SOR + base + r, s, mask=valid)
            tl.store(POR + base + r, tl.load(POS + base + s, mask=valid), mask=valid)
            V += tl.sum(vi, axis=0)
        target = tl.load(BUDGET)
        ell = tl.floor(_f64(ratio_bits) * target.to(tl.float64)).to(tl.int64)
        over = V.to(tl.int64) > target
        n = tl.where(over, V.to(tl.int64) - ell, 0).to(tl.int32)
        k = tl.where(over, target - ell, 0).to(tl.int32)  # < n when over (V > B)
    tl.store(META + 4 * row, due.to(tl.int32))
    tl.store(META + 4 * row + 1, V)
    tl.store(META + 4 * row + 2, n)
    tl.store(META + 4 * row + 3, k)


# -- launch 2: select --------------------------------------------------------------------------------
@triton_jit()
def _dist2(K, at, m, c_at, D, N: tl.constexpr, BLOCK_D: tl.constexpr, DCH: tl.constexpr):
    """sum((x - c)^2) in fp32 of the N keys at offsets `at` (masked by m) to the key at offset c_at."""
    acc = tl.zeros([N], tl.float32)
    for d0 in tl.static_range(0, BLOCK_D, DCH):
        dd = d0 + tl.arange(0, DCH)
        dm = dd < D
        c = tl.load(K + c_at + dd, mask=dm, other=0.0).to(tl.float32)
        x = tl.load(K + at[:, None] + dd[None, :], mask=m[:, None] & dm[None, :], other=0.0).to(tl.float32)
        diff = x - c[None, :]
        acc += tl.sum(diff * diff, axis=1)
    return acc


@triton_jit()
def _word(d2, inv):
    """The exchange word of points with squared distance d2 (>= 0; -1: not a candidate, word 0), tag bits 0."""
    return tl.where(d2 >= 0.0, (d2.to(tl.int32, bitcast=True).to(tl.int64) << 32) | inv, 0)


@triton_jit()
def _select_row(K, SOR, ORDER, XCH, ROUNDS, row, C, D, p, lo, n_mine, k, P: tl.constexpr, T: tl.constexpr,
                TT: tl.constexpr, LL: tl.constexpr, SL: tl.constexpr, BLOCK_D: tl.constexpr, DCH: tl.constexpr,
                DCH_L: tl.constexpr, RESIDENT: tl.constexpr):
    """Program p's part of row `row`'s greedy k-center: its slice is candidate ranks [lo, lo + n_mine) (< SL).
    Rounds: every program publishes its T + 1 best words; the P * T listed points and the bound U (the largest
    (T + 1)-th word: every point not listed is at most U, and a point's word only falls) let every program run
    greedy steps on the list alone while the best listed word exceeds U (module docstring). RESIDENT: the slice's
    and the list's keys are held in registers (fp32), else re-read every step in DCH / DCH_L column chunks."""
    W: tl.constexpr = T + 1
    lane = tl.arange(0, SL)
    live = lane < n_mine
    slot = tl.load(SOR + row * C + lo + lane, mask=live, other=0)
    inv = (0xFFFF - slot).to(tl.int64) << 16
    d2 = tl.where(live, float("inf"), -1.0)  # -1: not a candidate (or chosen); d2 >= 0 otherwise
    kbase = row * C * D
    at = kbase + slot.to(tl.int64) * D
    dk = tl.arange(0, BLOCK_D)
    if RESIDENT:
        xs = tl.load(K + at[:, None] + dk[None, :], mask=live[:, None] & (dk < D)[None, :], other=0.0)
        xs = xs.to(tl.float32)
    tt = tl.arange(0, TT)
    li = tl.arange(0, LL)  # list entry li: program li // W, rank li % W (rank T: that program's bound)
    in_list = li < P * W
    listed = in_list & (li % W < T)
    xrow = XCH + row * 2 * P * W
    done = tl.zeros([], tl.int32)
    rnd = tl.zeros([], tl.int32)
    while done < k:
        tag = rnd.to(tl.int64) + 1
        xat = xrow + (rnd % 2) * P * W
        word = _word(d2, inv)
        tops = tl.zeros([TT], tl.int64)
        for t in tl.static_range(W):
            b = tl.max(word, axis=0)
            tops = tl.where(tt == t, b, tops)
            word = tl.where(word == b, 0, word)
        tl.atomic_xchg(xat + p * W + tt, tops | tag, mask=tt < W, sem="relaxed")
        words = tl.load(xat + li, mask=in_list, other=tag, volatile=True)
        while tl.min(((words & 0xFFFF) == tag).to(tl.int32), axis=0) == 0:
            words = tl.load(xat + li, mask=in_list, other=tag, volatile=True)
        # The threads holding copies of one word loaded it at slightly different times: one may have seen the fresh
        # word and another the stale one. Now that the words are known fresh (and stay so until this program's next
        # publication), every thread loads them once more, after a barrier, so that all agree.
        tl.debug_barrier()
        words = tl.load(xat + li, mask=in_list, other=tag, volatile=True)
        vals = words & ~0xFFFF
        U = tl.max(tl.where(in_list & ~listed, vals, 0), axis=0)
        lcur = tl.where(listed, vals, 0)  # listed words, current (0: none or chosen)
        lslot = (0xFFFF - ((lcur >> 16) & 0xFFFF)).to(tl.int32)
        linv = lcur & 0xFFFF0000
        ld2 = (lcur >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        lat = kbase + tl.where(lcur > 0, lslot, 0).to(tl.int64) * D
        if RESIDENT:
            lk = tl.load(K + lat[:, None] + dk[None, :], mask=(lcur > 0)[:, None] & (dk < D)[None, :], other=0.0)
            lk = lk.to(tl.float32)
        best = tl.max(lcur, axis=0)
        while (best > U) & (done < k):
            centre = (0xFFFF - ((best >> 16) & 0xFFFF)).to(tl.int32)
            if p == 0:
                tl.store(ORDER + row * C + done, centre)
            done += 1
            d2 = tl.where(live & (slot == centre), -1.0, d2)
            lcur = tl.where(lcur == best, 0, lcur)
            if done < k:
                c_at = kbase + centre.to(tl.int64) * D
                if RESIDENT:
                    c = tl.load(K + c_at + dk, mask=dk < D, other=0.0).to(tl.float32)
                    dx = xs - c[None, :]
                    d2 = tl.minimum(d2, tl.sum(dx * dx, axis=1))  # -1 stays -1
                    dl = lk - c[None, :]
                    ld2 = tl.minimum(ld2, tl.sum(dl * dl, axis=1))
                else:
                    d2 = tl.minimum(d2, _dist2(K, at, live, c_at, D, SL, BLOCK_D, DCH))  # -1 stays -1
                    ld2 = tl.minimum(ld2, _dist2(K, lat, lcur > 0, c_at, D, LL, BLOCK_D, DCH_L))
                lcur = tl.where(lcur > 0, (ld2.to(tl.int32, bitcast=True).to(tl.int64) << 32) | linv, 0)
            best = tl.max(lcur, axis=0)
        rnd += 1
    if p == 0:
        tl.store(ROUNDS + row, rnd)


@triton_jit()
def _select_row_reread(K, SOR, ORDER, XCH, ROUNDS, row, C, D, p, lo, n_mine, k, S, P: tl.constexpr, T: tl.constexpr,
                       TT: tl.constexpr, LL: tl.constexpr, SL: tl.constexpr, BLOCK_D: tl.constexpr,
                       DCH: tl.constexpr, DCH2: tl.constexpr, DCH4: tl.constexpr, DCH_L: tl.constexpr):
    """_select_row with the keys re-read every step, on the smallest of three register sizes that holds the slice."""
    if SL >= 64:
        if S <= SL // 4:
            _select_row(K, SOR, ORDER, XCH, ROUNDS, row, C, D, p, lo, n_mine, k, P, T, TT, LL, SL // 4, BLOCK_D,
                        DCH4, DCH_L, False)
        elif S <= SL // 2:
            _select_row(K, SOR, ORDER, XCH, ROUNDS, row, C, D, p, lo, n_mine, k, P, T, TT, LL, SL // 2, BLOCK_D,
                        DCH2, DCH_L, False)
        else:
            _select_row(K, SOR, ORDER, XCH, ROUNDS, row, C, D, p, lo, n_mine, k, P, T, TT, LL, SL, BLOCK_D, DCH,
                        DCH_L, False)
    else:
        _select_row(K, SOR, ORDER, XCH, ROUNDS, row, C, D, p, lo, n_mine, k, P, T, TT, LL, SL, BLOCK_D, DCH, DCH_L,
                    False)


@triton_jit(do_not_specialize=["C", "rows", "G"])
def _kc_select_kernel(K, SOR, META, ORDER, XCH, ROUNDS, C, D, rows, G, P: tl.constexpr, T: tl.constexpr,
                      TT: tl.constexpr, LL: tl.constexpr, SL: tl.constexpr, BLOCK_D: tl.constexpr, DCH: tl.constexpr,
                      DCH2: tl.constexpr, DCH4: tl.constexpr, DCH_L: tl.constexpr, RES: tl.constexpr):
    p = tl.program_id(0)
    g = tl.program_id(1)
    for r in range(g, rows, G):
        row = tl.zeros([], tl.int64) + r
        n = tl.load(META + 4 * row + 2)
        k = tl.load(META + 4 * row + 3)
        if k > 0:
            S = tl.cdiv(n, P)
            lo = p * S
            n_mine = tl.maximum(tl.minimum(n - lo, S), 0)
            if RES > 0:  # RES = 0 (resident=False) compiles no register path
                if S <= RES:  # keys in registers
                    _select_row(K, SOR, ORDER, XCH, ROUNDS, row, C, D, p, lo, n_mine, k, P, T, TT, LL, RES,
                                BLOCK_D, DCH, DCH_L, True)
                else:
                    _select_row_reread(K, SOR, ORDER, XCH, ROUNDS, row, C, D, p, lo, n_mine, k, S, P, T, TT, LL,
                                       SL, BLOCK_D, DCH, DCH2, DCH4, DCH_L)
            else:
                _select_row_reread(K, SOR, ORDER, XCH, ROUNDS, row, C, D, p, lo, n_mine, k, S, P, T, TT, LL, SL,
                                   BLOCK_D, DCH, DCH2, DCH4, DCH_L)


# -- launch 3: pack ----------------------------------------------------------------------------------
@triton_jit(do_not_specialize=["C"])
def _kc_pack_kernel(BIAS, POS, FILL, SOR, POR, META, ORDER, FLAG, SRC, INFO, C, CH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * C
    due = tl.load(META + 4 * row)
    V = tl.load(META + 4 * row + 1)
    n = tl.load(META + 4 * row + 2)
    k = tl.load(META + 4 * row + 3)
    first = tl.zeros([], tl.int32)
    n_kept = tl.zeros([], tl.int32)
    if due != 0:
        first = tl.full([], 2147483647, tl.int32)
        if k > 0:  # flags of the chosen slots (candidates are the first n valid slots: slots < SOR[n])
            top = tl.load(SOR + base + n - 1) + 1
            for c0 in range(0, top, CH):
                s = c0 + tl.arange(0, CH)
                tl.store(FLAG + base + s, tl.zeros([CH], tl.int8), mask=s < top)
            tl.debug_barrier()
            for c0 in range(0, k, CH):
                i = c0 + tl.arange(0, CH)
                s = tl.load(ORDER + base + i, mask=i < k, other=0)
                tl.store(FLAG + base + s, tl.full([CH], 1, tl.int8), mask=i < k)
            tl.debug_barrier()
        for c0 in range(0, V, CH):
            r = c0 + tl.arange(0, CH)
            m = r < V
            s = tl.load(SOR + base + r, mask=m, other=0)
            chosen = tl.load(FLAG + base + s, mask=m & (r < n) & (k > 0), other=0) != 0
            keep = m & ((r >= n) | chosen)
            ki = keep.to(tl.int32)
            dest = n_kept + tl.cumsum(ki, axis=0) - ki
            moved = keep & (s != dest)
            tl.store(SRC + base + dest, s, mask=moved)
            tl.store(POS + base + dest, tl.load(POR + base + r, mask=moved), mask=moved)
            first = tl.minimum(first, tl.min(tl.where(moved, dest, 2147483647), axis=0))
            n_kept += tl.sum(ki, axis=0)
        first = tl.minimum(first, n_kept)
        for c0 in range(0, C, CH):
            j = c0 + tl.arange(0, CH)
            tl.store(BIAS + base + j, tl.where(j < n_kept, 0.0, float("-inf")), mask=j < C)
        tl.store(FILL + row, n_kept.to(tl.int64))
    tl.store(INFO + 2 * row, first)
    tl.store(INFO + 2 * row + 1, n_kept)


# -- launcher ----------------------------------------------------------------------------------------
def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def select_layout(rows: int, C: int, device: torch.device, programs: int | None = None) -> tuple:
    """(P programs per row, G rows in flight) of the select launch: P * G <= the SM count (every program resident:
    the module docstring). Default P = min(MAX_PROGRAMS, SMs // rows) (>= 1); 1 off CUDA (the interpreter)."""
    sms = _sm_count(device)
    P = programs if programs is not None else max(1, min(MAX_PROGRAMS, sms // max(rows, 1)))
    if device.type != "cuda" and P != 1:
        raise ValueError(f"{NAME}: programs={P} off CUDA; Triton's interpreter runs programs one after another, "
                         "so the programs of a row cannot wait for each other: use programs=1")
    if P < 1 or P > sms:
        raise ValueError(f"{NAME}: programs per row must be in [1, {sms}] (the SMs of {device}: the programs of "
                         f"a row must all be resident), got {P}")
    return P, max(1, min(rows, sms // P))


def triton_kcenter_compress(keys, values, bias, slot_pos, fill, budget, *, recent_ratio: float,
                            programs: int | None = None, lookahead: int | None = None, resident: bool = True,
                            select_warps: int | None = None, order=None, rounds=None) -> None:
    """Launch the five kernels (module docstring); mutates keys, values, bias, slot_pos, fill in place. programs:
    the select launch's programs per row (select_layout); lookahead its T (default LIST_SLOTS // P - 1); resident
    whether a slice of up to RESIDENT_KEYS // D keys is held in registers; select_warps its warps (SELECT_WARPS).
    Every value gives the same result (but for the fp32 summation order of the distances: near ties). order: an
    optional int32 [B * Hkv, C] tensor that receives each due row's centres (slots, in the order chosen; entries
    past the row's k are left as they were), rounds an optional int32 [B * Hkv] tensor that receives each selecting
    row's number of exchange rounds (rows without a selection: left as they were): for tests and timings. Under
    TRITON_INTERPRET=1 it runs on CPU tensors with programs = 1."""
    if triton is None:
        raise NotImplementedError(f"{NAME} needs Triton (pip install triton)")
    B, H, C, D = _check_state(NAME, keys, values, bias, slot_pos, fill, budget)
    if budget.device != keys.device:
        raise ValueError(f"{NAME}: budget is on {budget.device}, keys on {keys.device}")
    if not 0.0 <= recent_ratio <= 1.0:
        raise ValueError(f"{NAME}: recent_ratio must be in [0, 1], got {recent_ratio!r}")
    if C > MAX_SLOTS:
        raise ValueError(f"{NAME}: C = {C} slots; the kernels take C <= {MAX_SLOTS} (the op's reference runs "
                         "larger states)")
    rows = B * H
    if rows == 0 or C == 0 or D == 0:
        return
    dev = keys.device
    P, G = select_layout(rows, C, dev, programs)
    ch = min(triton.next_power_of_2(C), CHUNK)
    sor = torch.empty(rows, C, dtype=torch.int32, device=dev)
    por = torch.empty(rows, C, dtype=torch.int64, device=dev)
    meta = torch.empty(rows, 4, dtype=torch.int32, device=dev)
    if order is None:
        order = torch.empty(rows, C, dtype=torch.int32, device=dev)
    elif tuple(order.shape) != (rows, C) or order.dtype != torch.int32 or order.device != dev:
        raise ValueError(f"{NAME}: order must be int32 [B * Hkv, C] = {[rows, C]} on {dev}, got {order.dtype} "
                         f"{list(order.shape)} on {order.device}")
    T = max(1, LIST_SLOTS // P - 1) if lookahead is None else int(lookahead)
    if T < 1 or P * (T + 1) > LIST_SLOTS:
        raise ValueError(f"{NAME}: lookahead must be an int in [1, LIST_SLOTS // programs - 1 = "
                         f"{LIST_SLOTS // P - 1}] (the list's P (T + 1) words and keys are held in registers; "
                         f"Triton 3.6 failed to compile 16 programs x lookahead 16 on an H100), got {lookahead!r}")
    if rounds is None:
        rounds = torch.empty(rows, dtype=torch.int32, device=dev)
    elif tuple(rounds.shape) != (rows,) or rounds.dtype != torch.int32 or rounds.device != dev:
        raise ValueError(f"{NAME}: rounds must be int32 [B * Hkv] = {[rows]} on {dev}, got {rounds.dtype} "
                         f"{list(rounds.shape)} on {rounds.device}")
    xch = torch.zeros(rows, 2 * P * (T + 1), dtype=torch.int64, device=dev)  # exchange words (module docstring)
    _kc_rank_kernel[(rows,)](bias, slot_pos, fill, budget, sor, por, meta, C, _bits(recent_ratio), CH=ch)
    sl = triton.next_power_of_2(triton.cdiv(C, P))
    block_d = triton.next_power_of_2(D)
    dch = [max(1, min(block_d, TILE // max(sl // f, 1))) for f in (1, 2, 4)]  # key columns per distance step
    ll = triton.next_power_of_2(P * (T + 1))
    _kc_select_kernel[(P, G)](keys, sor, meta, order, xch, rounds, C, D, rows, G, P=P, T=T,
                              TT=triton.next_power_of_2(T + 1), LL=ll, SL=sl, BLOCK_D=block_d, DCH=dch[0],
                              DCH2=dch[1], DCH4=dch[2],
                              DCH_L=max(1, min(block_d, TILE // ll)),
                              RES=(1 << (RESIDENT_KEYS // block_d).bit_length() - 1) if resident else 0,
                              num_warps=select_warps or SELECT_WARPS)
    flag = torch.empty(rows, C, dtype=torch.int8, device=dev)
    src = torch.empty(rows, C, dtype=torch.int32, device=dev)
    info = torch.empty(rows, 2, dtype=torch.int32, device=dev)
    _kc_pack_kernel[(rows,)](bias, slot_pos, fill, sor, por, meta, order, flag, src, info, C, CH=ch)
    bs = min(MOVE_SLOTS, triton.next_power_of_2(C))
    ds = min(MOVE_COLUMNS, block_d)
    nslice = triton.cdiv(D, ds)
    stage_k = torch.empty_like(keys)  # of each block only the halo is written and read
    stage_v = torch.empty_like(values)
    grid = (triton.cdiv(C, bs), rows, 2 * nslice)
    for kernel in (_shift_stage_kernel, _shift_move_kernel):
        kernel[grid](keys, values, stage_k, stage_v, src, info, C, D, BLOCK_S=bs, DS=ds, NSLICE=nslice, num_warps=8)
