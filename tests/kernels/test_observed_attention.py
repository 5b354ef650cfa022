"""kvrewrite::observed_attention on the CPU: clustered_attention then accumulate_attention (it calls them) around the
pending queries' fold, so here: the output and score against the float64 formulas, decode sequences whose deferred
statistics equal the two ops' at every step that folds, the argument checks, opcheck. The same sequences through
the CUDA steps under Triton's interpreter (TRITON_INTERPRET=1, with triton installed); the fused CUDA kernels:
test_observed_attention_gpu.py."""
import math
import os

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels.observed_attention import reference_observed_attention
from kvrewrite.kernels import observed_attention as oa
from tests.kernels import decode_sequence as ds
from tests.kernels.test_attention_column_stats import dense_probs
from tests.kernels.test_clustered_attention import make_state, naive_attention

OP = torch.ops.kvrewrite.observed_attention.default


def _inputs(B, Hq, Hkv, T, C, seed):
    g = torch.Generator().manual_seed(seed)
    keys, values, bias, slot_pos, cp = make_state(B, Hkv, C, 16, T, torch.float32, gen=g)
    return torch.randn(B, Hq, T, 16, generator=g), keys, values, bias, slot_pos, cp, torch.rand(B, Hkv, C, generator=g)


def nothing_pending(q, keys):
    """(pending_q, pending_lse, fill) of a state with nothing pending whose last slot is the step's token."""
    B, Hq, _, D = q.shape
    Hkv, C = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    P = oa.pending_entries(G)
    return (torch.zeros(B, Hkv, P, G, D), torch.full((B, Hkv, P, G), math.inf),
            torch.full((B, Hkv), C, dtype=torch.int64))


@pytest.mark.parametrize("T,mode,last", [(1, "all", 0), (6, "all", 0), (1, "window", 4), (6, "window", 4)])
def test_matches_float64(T, mode, last):
    q, keys, values, bias, slot_pos, cp, score = _inputs(2, 6, 2, T, 40, seed=T)
    before = score.clone()
    ref_score = score.clone()
    out = OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, *nothing_pending(q, keys), mode, last)
    torch.testing.assert_close(out.double(), naive_attention(q, keys, values, bias, slot_pos, cp, 0.25, 0),
                               atol=2e-5, rtol=1e-5)
    p = dense_probs(q, keys, bias, slot_pos, cp, 0.25, 0).view(2, 2, 3, T, 40)
    if mode == "all":
        want = before.double() + p.sum(dim=(2, 3))
    else:
        observed = p[:, :, :, T - last:].sum(dim=3).mean(dim=2)
        want = before.double() + observed if T == 1 else observed
    torch.testing.assert_close(score.double(), want, atol=5e-5, rtol=1e-5)
    ref = reference_observed_attention(q, keys, values, bias, slot_pos, cp, 0.25, 0, ref_score,
                                       *nothing_pending(q, keys), mode, last)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(score, ref_score, atol=1e-6, rtol=1e-6)


STEPS = 6


def _sequence(B, Hq, Hkv, C, D, n, mode, last, past_only, defer_at, launch=None, dtype=torch.float32, steps=STEPS):
    """(fused outputs, fused state, two-op outputs, two-op state) after `steps` decode steps from one prompt state."""
    fused, _ = ds.prompt_state(B, Hq, Hkv, C, D, n, dtype, seed=n)
    apart = {k: v.clone() for k, v in fused.items()}
    args = (steps, n, Hq, dtype, D**-0.5, mode, last, past_only)
    a = ds.run(fused, torch.Generator().manual_seed(7), *args, defer_at, True, launch)
    b = ds.run(apart, torch.Generator().manual_seed(7), *args, None, False)
    return a, fused, b, apart


# B, Hq, Hkv, C, D, prompt: G = 3 (P = 4 entries; the steps at positions 20-25 fold at 20 and 24), G = 4 (P = 3;
# positions 200-205 fold at 201 and 204), G = 7 (P = 1: every step folds the previous one)
SEQUENCES = [(2, 6, 2, 64, 16, 20), (1, 8, 2, 300, 32, 200), (1, 7, 1, 90, 16, 41)]


def test_pending_entries_fill_the_decode_tile():
    assert [oa.pending_entries(G) for G in (1, 2, 3, 4, 5, 7, 8, 12, 16)] == [15, 7, 4, 3, 2, 1, 1, 1, 1]
    # entry e at position c holds the query of ((c - e - 1) mod P) + 1 steps before
    assert oa.pending_steps_ago(torch.tensor([203]), 3).tolist() == [2, 1, 3]  # 201, 202 (entry 2: 200, emptied)
    assert oa.pending_steps_ago(torch.tensor([204]), 3).tolist() == [3, 2, 1]  # 201, 202, 203


@pytest.mark.parametrize("past_only", [True, False])
@pytest.mark.parametrize("mode,last", [("all", 0), ("window", 4)])
@pytest.mark.parametrize("seq", SEQUENCES, ids=lambda s: "B{}-Hq{}Hkv{}-C{}-D{}-n{}".format(*s))
def test_deferred_statistics_equal_the_two_ops_when_folded(seq, mode, last, past_only):
    """Steps 0-4 defer, step 5 folds (a compressing step): same outputs at every step, same score after step 5,
    nothing pending; while deferred the score lags by exactly the pending queries' fold, and the entries hold the
    queries since the last step at c mod P == 0."""
    a, fused, b, apart = _sequence(*seq, mode, last, past_only, lambda step: step < STEPS - 1)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused["score"], apart["score"], atol=1e-5, rtol=1e-6)
    assert torch.isinf(fused["pending_lse"]).all() and (fused["pending_lse"] > 0).all()

    B, Hq, Hkv, C, D, n = seq
    P = oa.pending_entries(Hq // Hkv)
    for steps in range(1, STEPS + 1):
        _, lagging, _, apart = _sequence(*seq, mode, last, past_only, lambda step: True, steps=steps)
        c = n + steps  # the next step's position
        last_fold = max(p for p in range(n, c) if p % P == 0) if any(p % P == 0 for p in range(n, c)) else n
        held = [p % P for p in range(last_fold, c)]  # the entries written since (and by) the last folding step
        finite = torch.isfinite(lagging["pending_lse"]).all(dim=(0, 1, 3))
        assert finite.tolist() == [e in held for e in range(P)], steps
        assert (lagging["score"] - apart["score"]).abs().max() > 1e-3  # the pending queries are not in it yet
        oa.fold_pending(lagging["keys"], lagging["bias"], lagging["slot_pos"], torch.tensor([c]), lagging["score"],
                        lagging["pending_q"], lagging["pending_lse"], D**-0.5, 0, mode)
        torch.testing.assert_close(lagging["score"], apart["score"], atol=1e-5, rtol=1e-6)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CUDA steps on the CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("past_only", [True, False])
@pytest.mark.parametrize("seq", SEQUENCES + [(1, 4, 1, 600, 16, 500)],  # the last: 2 splits (interpreter: 8 "SMs")
                         ids=lambda s: "B{}-Hq{}Hkv{}-C{}-D{}-n{}".format(*s))
def test_cuda_steps_under_triton_interpreter(seq, past_only):
    """The CUDA path's launches (pending rows in the attention tile, split and unsplit, the compressing step's
    combine + fold) through Triton's interpreter, against the two ops."""
    pytest.importorskip("triton")
    a, fused, b, apart = _sequence(*seq, "all", 0, past_only, lambda step: step not in (3, STEPS - 1), oa._launch)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused["score"], apart["score"], atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_named():
    q, keys, values, bias, slot_pos, cp, score = _inputs(1, 2, 1, 3, 10, seed=0)
    pending = nothing_pending(q, keys)
    with pytest.raises(ValueError, match="mode must be one of"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, *pending, "sum", 0)
    with pytest.raises(ValueError, match=r"score must be fp32 \[B, Hkv, C\]"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score[:, :, :5], *pending, "all", 0)
    with pytest.raises(ValueError, match=r"pending_q must be fp32 \[B, Hkv, P, G, D\] = \(1, 1, 7, 2, 16\)"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, pending[0][..., :3], *pending[1:], "all", 0)
    with pytest.raises(ValueError, match=r"pending_lse must be fp32 \[B, Hkv, P, G\]"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, pending[0], pending[1][:, :, :1], pending[2], "all", 0)
    with pytest.raises(ValueError, match="defer=True keeps decode queries pending, one per step: T must be 1"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, *pending, "all", 0, False, True)


def test_broken_fill_promise_is_refused():
    """past_only: the slots a query pending since k steps saw must be those before fill - k (the CUDA kernel reads
    no slot_pos); with nothing pending there is no promise to keep."""
    q, keys, values, bias, slot_pos, cp, score = _inputs(1, 2, 1, 1, 10, seed=0)
    pq, plse, fill = nothing_pending(q, keys)
    bias[:] = 0.0
    slot_pos[:] = torch.arange(10)  # one slot per decode step, as cache_append writes them
    cp = torch.tensor([9])
    OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, pq, plse, fill - 1, "all", 0, True, False)  # none pending
    k = oa.pending_steps_ago(cp, 7)
    assert int(k[0]) == 2
    plse[0, 0, 0, 1] = 2.0  # entry 0: pending since k[0] steps
    OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, pq, plse.clone(), fill, "all", 0, True, True)
    with pytest.raises(ValueError, match=f"the slots up to position {int(cp[0]) - int(k[0])} .*pending since "
                                         f"{int(k[0])} step"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, pq, plse, fill - 1, "all", 0, True, True)


def test_opcheck():
    q, keys, values, bias, slot_pos, cp, score = _inputs(2, 4, 2, 1, 12, seed=1)
    pq, plse, fill = nothing_pending(q, keys)
    P = plse.shape[2]
    plse[0, :, (int(cp[0]) - 1) % P] = 1.5  # row 0: the previous step's query is pending (the entry of k = 1)
    pq.normal_()
    for defer in (False, True):
        torch.library.opcheck(OP, (q, keys, values, bias, slot_pos, cp, 0.25, 0, score, pq.clone(), plse.clone(), fill,
                                   "window", 3, True, defer))
