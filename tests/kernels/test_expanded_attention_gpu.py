"""kvrewrite::expanded_attention on CUDA: the Triton kernel against a float64 dense attention over materialised
expanded keys, against the reference, S (the per-entry scores for kvrewrite::ems_attention), CUDA graphs and
torch.compile. Skipped without CUDA or Triton.

States (ems_state below): per row, past entries holding 1..6 slots (a merged entry's slots have key scales in
[0.3, 2.5]; ~1/6 are padding, bias -inf), then the chunk's T single-slot entries (prefill, causal per entry) or the
query's own token (decode); ragged fills per row; a freed slot (lut -1) at slot 0 and stale slots past slot_fill in
every other row; optionally a row that is all padding (its queries see nothing: out 0, lse -inf). Every op call runs
in NaN-filled memory (tests/kernels/poisoned.py), so an output the kernel forgets to write fails the comparison.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import expanded_attention as xa
from tests.kernels.expanded_naive import EmsState, make_state, naive_expanded
from tests.kernels.poisoned import poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(xa.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.expanded_attention.default
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# out against float64 on the same (rounded) inputs:
#   fp32: ieee dots everywhere (q·k, the one-hot gather and segment sum, P @ V), fp32 softmax in base 2 over up to
#         ~5k slots (the one-hot segment sum: ieee; the running-sum variant: differences of sums <= 128): ~1e-6;
#         5e-5 leaves headroom and is ~1e3 below what a real bug moves (a key scale dropped, a
#         wrong head, an off-by-one mask or a slot counted twice: >= 1e-2);
#   fp16 / bf16: p rounded to the dtype in the segment sum, P again before P @ V (2 x 2**-11 / 2**-8 relative),
#         output rounded once: 4e-3 / 2.5e-2.
# lse does not see those roundings (fp32 sums; s gathered exactly, or tf32x3: ~2**-21 relative): 1e-4 for every dtype.
TOL = {torch.float32: dict(atol=5e-5, rtol=5e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2)}
LSE_TOL = dict(atol=1e-4, rtol=1e-4)


def ems_state(B, Hkv, C, R, D, T, dtype, prefill, seed, empty_row=False, max_group=6, device="cuda"):
    """A random EMS layer state on the GPU (module docstring); the pattern of expanded_naive.make_state at sizes its
    per-position draw cannot reach."""
    g = torch.Generator().manual_seed(seed)
    n_new = T if prefill else 1
    P0 = 8 * C  # past positions are drawn below P0; the chunk's (or the query's) are P0, P0 + 1, ...
    keys = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    values = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    bias = torch.full((B, Hkv, C), -math.inf)
    slot_pos = torch.randint(0, 10 * C, (B, Hkv, C), generator=g)
    entry_start = torch.zeros(B, Hkv, C, dtype=torch.int32)
    lut = torch.full((B, Hkv, R), -1, dtype=torch.int32)
    key_scale = torch.ones(B, Hkv, R)
    slot_fill = torch.zeros(B, Hkv, dtype=torch.int64)
    for b in range(B):
        for h in range(Hkv):
            row = b * Hkv + h
            n_past = int(torch.randint(max(1, C // 2), C - n_new + 1, (1,), generator=g))
            sizes = torch.randint(1, max_group + 1, (n_past,), generator=g)
            room = R - n_new - 3
            keep = int((sizes.cumsum(0) <= room).sum())
            n_past, sizes = keep, sizes[:keep]
            pos = torch.randperm(P0, generator=g)[:n_past].sort().values
            starts = torch.cumsum(sizes, 0) - sizes
            n = int(sizes.sum())
            entry_start[b, h, :n_past] = starts.int()
            lut[b, h, :n] = torch.repeat_interleave(torch.arange(n_past), sizes).int()
            scales = 0.3 + 2.2 * torch.rand(n, generator=g)
            merged = torch.repeat_interleave(sizes > 1, sizes)
            key_scale[b, h, :n] = torch.where(merged, scales, 1.0)
            bias[b, h, :n_past] = torch.where(torch.rand(n_past, generator=g) < 1 / 6, -math.inf, 0.0)
            slot_pos[b, h, :n_past] = pos
            e = torch.arange(n_past, n_past + n_new)
            entry_start[b, h, e] = torch.arange(n, n + n_new, dtype=torch.int32)
            lut[b, h, n:n + n_new] = e.int()
            bias[b, h, e] = 0.0
            slot_pos[b, h, e] = P0 + torch.arange(n_new)
            slot_fill[b, h] = n + n_new
            if row % 2:  # a freed slot inside [0, slot_fill), stale slots past it
                lut[b, h, 0] = -1
                j = n + n_new
                lut[b, h, j:j + 3] = n_past
                key_scale[b, h, j:j + 3] = 3.0
            if empty_row and b == 0:
                bias[b, h] = -math.inf
    cpos = torch.arange(P0, P0 + T) if prefill else torch.tensor([P0])
    st = EmsState(keys, values, bias, slot_pos, entry_start, lut, key_scale, slot_fill, cpos)
    return EmsState(*(getattr(st, f).to(device) for f in st.__dataclass_fields__))


def dense64(st, q, scale, softcap=0.0):
    """float64 softmax attention over the materialised expanded keys a_j * keys[lut_j] and values values[lut_j] of
    every visible slot (vectorised on the GPU; same function as expanded_naive.naive_expanded, which is too slow at
    these sizes and is used on the tiny cases)."""
    B, Hq, T, D = q.shape
    Hkv, C, R = st.keys.shape[1], st.keys.shape[2], st.lut.shape[2]
    G = Hq // Hkv
    e = st.lut.long().clamp_min(0)
    k_hat = st.key_scale.double()[..., None] * st.keys.double().gather(2, e[..., None].expand(B, Hkv, R, D))
    v_hat = st.values.double().gather(2, e[..., None].expand(B, Hkv, R, D))
    live = ((torch.arange(R, device=q.device) < st.slot_fill[..., None]) & (st.lut >= 0)
            & (st.bias.gather(2, e) > -math.inf))
    vis = live[:, :, None, :] & (st.slot_pos.gather(2, e)[:, :, None, :] <= st.cache_position[None, None, :, None])
    z = torch.einsum("bhgtd,bhrd->bhgtr", q.double().view(B, Hkv, G, T, D), k_hat) * scale
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    z = z.masked_fill(~vis[:, :, None], -math.inf)
    lse = torch.logsumexp(z, dim=-1)
    w = torch.exp(z - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.einsum("bhgtr,bhrd->bhgtd", w, v_hat)
    return out.reshape(B, Hq, T, D), lse.reshape(B, Hq, T)


def check(out, lse, want, want_lse, dtype, what=""):
    assert out.dtype == dtype and out.is_contiguous() and lse.dtype == torch.float32
    err = (out.double() - want).abs().max()
    torch.testing.assert_close(out.double(), want, **TOL[dtype], msg=lambda m: f"{what} out (max diff {err:.3g}): {m}")
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), f"{what} lse: -inf at different queries"
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin], **LSE_TOL, msg=lambda m: f"{what} lse: {m}")


def nbytes(st, q):
    return 4 * q.numel() * q.element_size() + 8 * st.lut.numel() * 8


# (B, Hq, Hkv, C, R, D, T, prefill, options)
CASES = {
    "decode-llama-G4": (2, 32, 8, 701, 2803, 128, 1, False, {}),
    "decode-G1-D64": (3, 4, 4, 333, 1331, 64, 1, False, {}),
    "decode-G2-empty-row": (2, 8, 4, 257, 1021, 64, 1, False, {"empty_row": True}),
    "decode-MQA-D16": (1, 8, 1, 97, 389, 16, 1, False, {}),
    "prefill-G4-T37": (1, 16, 4, 401, 1601, 128, 37, True, {}),
    "prefill-G2-T130-D64": (2, 8, 4, 517, 2069, 64, 130, True, {"empty_row": True}),
    "prefill-G1-T5-D256": (1, 2, 2, 141, 563, 256, 5, True, {}),
}


SCATTER = pytest.mark.parametrize("scatter", list(xa.SCATTERS))  # both segment sums, on every main case


@SCATTER
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_dense_float64(case, dtype, scatter):
    B, Hq, Hkv, C, R, D, T, prefill, opts = CASES[case]
    st = ems_state(B, Hkv, C, R, D, T, dtype, prefill, seed=list(CASES).index(case), **opts)
    q = torch.randn(B, Hq, T, D, device="cuda").to(dtype)
    scale = D**-0.5
    want, want_lse = dense64(st, q, scale)
    for past_only in ([False, True] if not prefill else [False]):
        out, lse = poisoned(lambda: xa.triton_expanded_attention(*st.attention_args(q), scale, past_only,
                                                                 scatter=scatter), nbytes(st, q))
        check(out, lse, want, want_lse, dtype, f"past_only={past_only}")
    ref, ref_lse = xa.reference_expanded_attention(*st.attention_args(q), scale)
    torch.testing.assert_close(out.double(), ref.double(), **TOL[dtype])
    if opts.get("empty_row"):
        assert (out[0] == 0).all() and (lse[0] == -math.inf).all()


@pytest.mark.parametrize("tuning", [
    dict(num_splits=1), dict(num_splits=7), dict(block_n=16, block_j=16, num_splits=5),
    dict(block_m=16, block_n=16, block_j=16, num_splits=5), dict(block_n=32, block_j=16, num_splits=5),
    dict(block_n=128, block_j=32), dict(block_j=128), dict(gather="onehot"), dict(gather="onehot_tf32x3"),
    dict(scatter="cumsum"), dict(scatter="cumsum", block_j=128), dict(scatter="cumsum", block_n=16, block_j=16),
    dict(scatter="cumsum", gather="onehot_tf32x3", num_splits=7),
    dict(narrow=True), dict(narrow=True, num_splits=7, block_j=128),  # NARROW (decode: 4 rows of 16)
    dict(narrow=False), dict(narrow=False, num_splits=7, block_j=64),  # the full width (decode: 16 rows)
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
@pytest.mark.parametrize("case", ["decode-llama-G4", "prefill-G4-T37"])
def test_launch_variants(case, tuning):
    """Every tile, chunk, split and gather choice computes the same function (merged entries straddle them)."""
    B, Hq, Hkv, C, R, D, T, prefill, opts = CASES[case]
    dtype = torch.bfloat16
    st = ems_state(B, Hkv, C, R, D, T, dtype, prefill, seed=5)
    q = torch.randn(B, Hq, T, D, device="cuda").to(dtype)
    want, want_lse = dense64(st, q, D**-0.5)
    out, lse = poisoned(lambda: xa.launch_expanded_forward(*st.attention_args(q), D**-0.5, not prefill, 0.0,
                                                           **tuning), nbytes(st, q))
    check(out, lse, want, want_lse, dtype, str(tuning))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[1] // v[2] * v[6] <= 16])
def test_narrow_form(case, dtype):
    """expanded_attention.NARROW (one query block: G * T <= 16): the per-slot work on next_power_of_2(G * T) rows,
    against float64, with and without the soft cap (tanh is libdevice's: GPU only)."""
    B, Hq, Hkv, C, R, D, T, prefill, opts = CASES[case]
    st = ems_state(B, Hkv, C, R, D, T, dtype, prefill, seed=11, **opts)
    q = torch.randn(B, Hq, T, D, device="cuda").to(dtype)
    for softcap in (0.0, 10.0):
        want, want_lse = dense64(st, q, D**-0.5, softcap)
        out, lse = poisoned(lambda: xa.launch_expanded_forward(*st.attention_args(q), D**-0.5, not prefill, softcap,
                                                               narrow=True), nbytes(st, q))
        check(out, lse, want, want_lse, dtype, f"softcap={softcap}")


@SCATTER
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", ["decode-llama-G4", "prefill-G2-T130-D64"])
def test_softcap(case, dtype, scatter):
    B, Hq, Hkv, C, R, D, T, prefill, opts = CASES[case]
    st = ems_state(B, Hkv, C, R, D, T, dtype, prefill, seed=11, **opts)
    q = (4 * torch.randn(B, Hq, T, D, device="cuda")).to(dtype)  # logits of O(20) (a_j up to 2.5): the cap matters
    want, want_lse = dense64(st, q, D**-0.5, softcap=10.0)
    uncapped, _ = dense64(st, q, D**-0.5)
    assert (uncapped - want).abs().max() > 0.1
    out, lse = poisoned(lambda: xa.triton_expanded_attention(*st.attention_args(q), D**-0.5, not prefill, 10.0,
                                                           scatter=scatter),
                        nbytes(st, q))
    check(out, lse, want, want_lse, dtype, "softcap")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_gather_slots_kernel(D, dtype):
    """GATHER_KERNEL's launch (gather_slots on CUDA) writes the tensor code's four outputs bit for bit, into poisoned
    memory: D 96 masks its columns, the others load whole rows as vectors; an empty row, padding entries."""
    from kvrewrite.kernels import _expanded_prefill_kernels as xp

    st = ems_state(2, 4, 301, 1207, D, 64, dtype, True, seed=17, empty_row=True)
    args = (st.keys, st.values, st.bias, st.slot_pos, st.lut, st.slot_fill)
    want = xp.gather_slots(*args, kernel=False)
    got = poisoned(lambda: xp.gather_slots(*args), sum(t.nbytes for t in want))
    for name, a, b in zip(("keys", "values", "bias", "slot_pos"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    assert (want[2] == -math.inf).any() and (want[2] == 0).any()


@pytest.mark.parametrize("tuning", [{}, dict(block_n=32), dict(block_m=128, num_warps=8), dict(block_m=16, block_n=16),
                                    dict(gathered=True), dict(gathered=True, block_m=128, block_n=32),
                                    dict(gathered=True, index_select=True),  # the tensor code's row copies:
                                    dict(gathered=True, index_select=False)],  # GATHER_KERNEL off
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()) or "default")
@pytest.mark.parametrize("softcap", [0.0, 10.0])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", ["prefill-G4-T37", "prefill-G2-T130-D64", "prefill-G1-T5-D256"])
def test_prefill_kernel(case, dtype, softcap, tuning, monkeypatch):
    """The prefill forms (one split; _expanded_prefill_kernels.py, counted) against float64 over materialised
    expanded keys, with and without the soft cap, fp32/fp16/bf16, D 64/128/256, several tilings: `gathered` (the
    default from PREFILL_GATHERED_MIN_QUERIES queries), the slots' rows written out and clustered_attention's prefill
    kernel with per-slot key scales; without (the default for these few queries), the slot-walking kernel."""
    from kvrewrite.kernels import _expanded_prefill_kernels as xp

    tuning = dict(tuning)
    if "index_select" in tuning:  # gather_slots' tensor code, by either row copy; else its kernel (GATHER_KERNEL)
        monkeypatch.setattr(xp, "GATHER_KERNEL", False)
        monkeypatch.setattr(xp, "GATHER_INDEX_SELECT", tuning.pop("index_select"))
    B, Hq, Hkv, C, R, D, T, prefill, opts = CASES[case]
    if Hq // Hkv * T <= 16:
        T = 17  # a prefill-sized block
    if D > 128 and tuning.get("block_m", 64) > 64:
        pytest.skip("128-row query tiles of D = 256 are not a launch the config makes (registers)")
    st = ems_state(B, Hkv, C, R, D, T, dtype, prefill, seed=13, **opts)
    q = ((4 if softcap else 1) * torch.randn(B, Hq, T, D, device="cuda")).to(dtype)
    want, want_lse = dense64(st, q, D**-0.5, softcap=softcap)
    calls = []
    name = "launch_gathered_prefill" if xa.uses_gathered(T, tuning.get("gathered")) else "launch_expanded_prefill"
    launch = getattr(xp, name)
    monkeypatch.setattr(xp, name, lambda *a, **k: calls.append(1) or launch(*a, **k))
    out, lse = poisoned(lambda: xa.launch_expanded_forward(*st.attention_args(q), D**-0.5, False, softcap,
                                                           num_splits=1, **tuning), nbytes(st, q))
    assert calls == [1]
    check(out, lse, want, want_lse, dtype, f"prefill kernel {tuning}")
    if opts.get("empty_row"):
        assert (out[0] == 0).all() and (lse[0] == -math.inf).all()


@pytest.mark.parametrize("case", ["decode-G4", "decode-MQA", "prefill-G2", "dead-slots",
                                  "nothing-visible", "decode-nothing-visible"])
def test_tiny_cases_against_naive(case):
    """The CPU tests' tiny states (tests/kernels/test_expanded_attention.py) against expanded_naive's slot-by-slot
    float64 loop, in fp32 and bf16."""
    from tests.kernels.test_expanded_attention import CASES as TINY

    B, Hq, Hkv, C, R, D, T, mode, opts = TINY[case]
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(3)
        st = make_state(B, Hkv, C, R, D, T, dtype, g, prefill=mode == "prefill", **opts)
        q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
        want, want_lse, _ = naive_expanded(st, q, D**-0.5)
        cuda = EmsState(*(getattr(st, f).cuda() for f in st.__dataclass_fields__))
        out, lse = xa.triton_expanded_attention(*cuda.attention_args(q.cuda()), D**-0.5, mode == "decode")
        check(out.cpu(), lse.cpu(), want, want_lse, dtype, case)


@pytest.mark.parametrize("tuning", [{}, dict(num_splits=7), dict(block_n=16, block_j=16, num_splits=5),
                                    dict(scatter="cumsum"), dict(scatter="cumsum", num_splits=7), dict(narrow=True)],
                         ids=["default", "splits7", "small", "cumsum", "cumsum-splits7", "narrow"])
def test_entry_scores_S(tuning):
    """S[b, hq, e] = scale * q·keys[e] for every entry holding a slot below slot_fill (and those between); free
    entries past the last one keep what S held. Values against float64."""
    B, Hq, Hkv, C, R, D = 2, 32, 8, 701, 2803, 128
    st = ems_state(B, Hkv, C, R, D, 1, torch.bfloat16, False, seed=7)
    q = torch.randn(B, Hq, 1, D, device="cuda").to(torch.bfloat16)
    S = torch.full((B, Hq, C), math.nan, device="cuda")
    out, lse = xa.launch_expanded_forward(*st.attention_args(q), D**-0.5, True, 0.0, S=S, **tuning)
    G = Hq // Hkv
    want = torch.einsum("bhgd,bhcd->bhgc", q.double().view(B, Hkv, G, D), st.keys.double()).reshape(B, Hq, C) * D**-0.5
    for b in range(B):
        for h in range(Hkv):
            n = int(st.slot_fill[b, h])
            used = st.lut[b, h, :n]
            lo, hi = int(used[used >= 0].min()), int(used.max())
            rows = slice(h * G, (h + 1) * G)
            torch.testing.assert_close(S[b, rows, lo:hi + 1].double(), want[b, rows, lo:hi + 1], atol=1e-3, rtol=1e-4)
            assert S[b, rows, hi + 1:].isnan().all()
    want_out, want_lse = dense64(st, q, D**-0.5)
    check(out, lse, want_out, want_lse, torch.bfloat16, "with S")


def test_S_needs_decode_shape():
    B, Hq, Hkv, C, R, D, T = 1, 4, 2, 33, 131, 16, 3
    st = ems_state(B, Hkv, C, R, D, T, torch.float32, True, seed=1)
    q = torch.randn(B, Hq, T, D, device="cuda")
    with pytest.raises(ValueError, match="T == 1"):
        xa.launch_expanded_forward(*st.attention_args(q), 0.25, False, 0.0, S=torch.zeros(B, Hq, C, device="cuda"))


@pytest.fixture
def kernel_on(monkeypatch):
    monkeypatch.setattr(xa, "KERNELS_CHECKED_ON_GPU", True)


def test_op_runs_the_kernel_in_a_cuda_graph(kernel_on):
    """The op (a triton_op) is captured in a CUDA graph; replays with new data in the same buffers (new queries,
    a new slot table and fills) equal the eager op."""
    B, Hq, Hkv, C, R, D = 2, 32, 8, 701, 2803, 128
    dtype, scale = torch.bfloat16, D**-0.5
    st = ems_state(B, Hkv, C, R, D, 1, dtype, False, seed=21)
    q = torch.randn(B, Hq, 1, D, device="cuda").to(dtype)
    args = st.attention_args(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        OP(*args, scale, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = OP(*args, scale, True)
    for seed in (22, 23):
        st2 = ems_state(B, Hkv, C, R, D, 1, dtype, False, seed=seed)
        q2 = torch.randn(B, Hq, 1, D, device="cuda").to(dtype)
        for dst, src in zip(args, st2.attention_args(q2)):
            dst.copy_(src)
        graph.replay()
        want, want_lse = OP(*args, scale, True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        d64, d64_lse = dense64(st2, q2, scale)
        check(out, lse, d64, d64_lse, dtype, f"graph replay {seed}")


def test_op_under_torch_compile(kernel_on):
    B, Hq, Hkv, C, R, D, T = 1, 8, 2, 129, 517, 64, 9
    st = ems_state(B, Hkv, C, R, D, T, torch.float16, True, seed=31)
    q = torch.randn(B, Hq, T, D, device="cuda").to(torch.float16)
    fn = torch.compile(lambda *a: OP(*a, D**-0.5, False, 0.0), fullgraph=True)
    out, lse = fn(*st.attention_args(q))
    want, want_lse = OP(*st.attention_args(q), D**-0.5, False, 0.0)
    # Inductor compiles the user-defined kernel anew: an fp16 output may differ by one rounding (seen: 1 of 4608
    # elements by 1 ulp); both are checked against float64 below
    torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    d64, d64_lse = dense64(st, q, D**-0.5)
    check(out, lse, d64, d64_lse, torch.float16, "compiled")


def test_op_opcheck_on_cuda(kernel_on):
    B, Hq, Hkv, C, R, D = 1, 4, 2, 33, 131, 16
    st = ems_state(B, Hkv, C, R, D, 1, torch.float32, False, seed=41)
    q = torch.randn(B, Hq, 1, D, device="cuda")
    torch.library.opcheck(OP, (*st.attention_args(q), D**-0.5), {"past_only": True, "softcap": 0.0})
