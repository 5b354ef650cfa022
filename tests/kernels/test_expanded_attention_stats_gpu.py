"""expanded_attention_stats' Triton kernel compiled on CUDA (kvrewrite/kernels/_ems_fold_kernels.py) against the op's
reference (on the same GPU, from the same inputs) and, on a small case, the dense float64 column sums of
tests/kernels/expanded_naive.py: fp16/bf16/fp32, D 64/128/256, GQA G 1/4 and MQA, ragged slot_fill, padding entries,
freed and stale slots, a batch row that sees nothing, `last` > T, the soft cap.

Tolerance: the kernel and the reference both sum fp32 probabilities (each within ~1e-6 relative: the dot's order,
exp2 against exp) over <= 200 queries: 1e-4 absolute on column sums of O(1). A wrong key scale, head, mask or
query block moves a column sum by >= 1e-2.
"""
import pytest
import torch

from kvrewrite.kernels.expanded_attention import reference_expanded_attention
from kvrewrite.kernels.expanded_attention_stats import (reference_expanded_attention_stats, fold_kernels,
                                                        triton_expanded_attention_stats)
from tests.kernels.expanded_naive import EmsState, make_state, naive_expanded

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(fold_kernels() is None, reason="needs Triton"),
]
TOL = dict(atol=1e-4, rtol=1e-4)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# (B, Hq, Hkv, C, R, D, T, prefill, options)
CASES = {
    "prefill-G4-D128": (2, 8, 2, 301, 700, 128, 200, True, {}),
    "prefill-G1-D64-dead": (2, 4, 4, 150, 333, 64, 100, True, {"dead": True}),
    "prefill-MQA-D256": (1, 3, 1, 120, 280, 256, 70, True, {}),
    "decode-llama-G4": (2, 32, 8, 257, 600, 128, 1, False, {}),
    "nothing-visible": (2, 4, 2, 60, 150, 64, 17, True, {"empty_row": True}),
}


def big_state(B, Hkv, C, R, D, T, dtype, g, prefill, dead=False, empty_row=False):
    """expanded_naive.make_state's kind of state (read its docstring) at sizes past its 40 past positions: past
    entries at distinct positions < P = 4 C, 1-3 slots each (merged ones with key scales in [0.3, 2.5]), ~1/6
    padding, then the chunk's T single-slot entries at P..P+T-1 (decode: the query's own at P); C > 1.5 T."""
    n_new = T if prefill else 1
    P = 4 * C
    keys = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    values = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    bias = torch.full((B, Hkv, C), float("-inf"))
    slot_pos = torch.randint(0, 2 * P, (B, Hkv, C), generator=g)  # garbage past the fill
    entry_start = torch.zeros(B, Hkv, C, dtype=torch.int32)
    lut = torch.full((B, Hkv, R), -1, dtype=torch.int32)
    key_scale = torch.ones(B, Hkv, R)
    slot_fill = torch.zeros(B, Hkv, dtype=torch.int64)
    for b in range(B):
        for h in range(Hkv):
            n_past = int(torch.randint(max(1, C // 3), C - n_new + 1, (1,), generator=g))
            sizes = torch.randint(1, 4, (n_past,), generator=g)
            n_past = min(n_past, int((sizes.cumsum(0) <= R - n_new - (3 if dead else 0)).sum()))
            sizes = torch.cat([sizes[:n_past], torch.ones(n_new, dtype=torch.long)])
            n = n_past + n_new
            ends = sizes.cumsum(0)
            entry_start[b, h, :n] = (ends - sizes).int()
            j = int(ends[-1])
            owner = torch.repeat_interleave(torch.arange(n), sizes)
            lut[b, h, :j] = owner.int()
            merged = sizes[owner] > 1
            key_scale[b, h, :j] = torch.where(merged, 0.3 + 2.2 * torch.rand(j, generator=g), 1.0)
            pad = torch.rand(n_past, generator=g) < 1 / 6
            bias[b, h, :n_past] = torch.where(pad, float("-inf"), 0.0)
            bias[b, h, n_past:n] = 0.0
            slot_pos[b, h, :n_past] = torch.randperm(P, generator=g)[:n_past].sort().values
            slot_pos[b, h, n_past:n] = P + torch.arange(n_new)
            slot_fill[b, h] = j
            if dead:
                lut[b, h, 0] = -1  # a freed slot inside [0, slot_fill)
                lut[b, h, j:j + 3] = n_past  # stale slots past the fill, pointing at a live entry
                key_scale[b, h, j:j + 3] = 3.0
            if empty_row and b == 0:
                bias[b, h] = float("-inf")
    cache_position = torch.arange(P, P + T) if prefill else torch.tensor([P])
    return EmsState(keys, values, bias, slot_pos, entry_start, lut, key_scale, slot_fill, cache_position)


def state(case, dtype, seed=0, q_std=1.0):
    B, Hq, Hkv, C, R, D, T, prefill, opts = CASES[case]
    g = torch.Generator().manual_seed(seed)
    st = big_state(B, Hkv, C, R, D, T, dtype, g, prefill=prefill, **opts)
    q = (q_std * torch.randn(B, Hq, T, D, generator=g)).to(dtype)
    return st, q, not prefill


def to_cuda(st):
    for f in st.__dataclass_fields__:
        setattr(st, f, getattr(st, f).cuda())
    return st


def run(st, q, last, past_only, softcap=0.0, **knobs):
    scale = q.shape[-1] ** -0.5
    _, lse = reference_expanded_attention(*st.attention_args(q), scale, past_only, softcap)
    got = triton_expanded_attention_stats(*st.stats_args(q, lse), scale, last, past_only, softcap, **knobs)
    want = reference_expanded_attention_stats(*st.stats_args(q, lse), scale, last, past_only, softcap)
    return got, want


# _ems_fold_kernels' forms: {} the defaults (TRANS, LEAN's step, PIPE's loop at 2 stages, LEAN_BLOCK_M's 32-query
# blocks: the same launch as lean-pipe-bm32); each other case names every knob it depends on
OFF = dict(lean=False, pipe=False)


@pytest.mark.parametrize("knobs", [dict(OFF, trans=False), dict(acc2d=True, trans=False), dict(OFF),
                                   dict(acc2d=True, trans=True), dict(lean=False, pipe=True, pipe_stages=3),
                                   dict(lean=False, pipe=True, pipe_stages=2), dict(lean=False, pipe=True, num_warps=8),
                                   dict(lean=True, pipe=False, block_m=32), dict(lean=True, pipe=True, block_m=32),
                                   dict(lean=True, pipe=False, block_m=64), {}],
                         ids=["plain", "acc2d", "trans", "acc2d-trans", "pipe", "pipe-s2", "pipe-w8", "lean",
                              "lean-pipe-bm32", "lean-bm64", "default"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, dtype, knobs):
    st, q, past_only = state(case, dtype)
    st, q = to_cuda(st), q.cuda()
    T = q.shape[2]
    for last in (0, 13, T + 50):  # T + 50: clamped to T, recent == total
        (total, recent), (ref_t, ref_r) = run(st, q, last, past_only, **knobs)
        assert total.dtype == recent.dtype == torch.float32 and total.shape == ref_t.shape
        torch.testing.assert_close(total, ref_t, **TOL)
        torch.testing.assert_close(recent, ref_r, **TOL)
        if last > T:
            torch.testing.assert_close(recent, total, rtol=0, atol=0)
    if case == "nothing-visible":
        assert (total[0] == 0).all() and (total[1].sum(-1) - T).abs().max() < 1e-3


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_softcap(dtype):
    st, q, _ = state("prefill-G4-D128", dtype, seed=1, q_std=6.0)
    st, q = to_cuda(st), q.cuda()
    (total, recent), (ref_t, ref_r) = run(st, q, 40, False, softcap=10.0)
    torch.testing.assert_close(total, ref_t, **TOL)
    torch.testing.assert_close(recent, ref_r, **TOL)
    (plain, _), _ = run(st, q, 40, False)
    assert (plain - total).abs().max() > 1e-2  # the cap is exercised


@pytest.mark.parametrize("softcap", [0.0, 10.0])
def test_matches_naive_float64(softcap):
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, C, R, D, T, last = 2, 4, 2, 70, 150, 64, 33, 9
    st = make_state(B, Hkv, C, R, D, T, torch.float32, g, prefill=True, dead=True)
    q = 4 * torch.randn(B, Hq, T, D, generator=g)
    _, _, p = naive_expanded(st, q, D**-0.5, softcap)
    (total, recent), _ = run(to_cuda(st), q.cuda(), last, False, softcap)
    torch.testing.assert_close(total.cpu().double(), p.sum(dim=2), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(recent.cpu().double(), p[:, :, T - last:].sum(dim=2), atol=2e-5, rtol=1e-5)
