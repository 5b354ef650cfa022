"""kvrewrite::observed_attention on the CPU: clustered_attention then accumulate_attention (it calls them) around the
pending query's fold, so here: the output and score against the float64 formulas, decode sequences whose deferred
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
    return (torch.zeros(B, Hkv, Hq // Hkv, D), torch.full((B, Hkv, Hq // Hkv), math.inf),
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


STEPS = 5


def _sequence(B, Hq, Hkv, C, D, n, mode, last, past_only, defer_at, launch=None, dtype=torch.float32):
    """(fused outputs, fused state, two-op outputs, two-op state) after STEPS decode steps from one prompt state."""
    fused, _ = ds.prompt_state(B, Hq, Hkv, C, D, n, dtype, seed=n)
    apart = {k: v.clone() for k, v in fused.items()}
    args = (STEPS, n, Hq, dtype, D**-0.5, mode, last, past_only)
    a = ds.run(fused, torch.Generator().manual_seed(7), *args, defer_at, True, launch)
    b = ds.run(apart, torch.Generator().manual_seed(7), *args, None, False)
    return a, fused, b, apart


SEQUENCES = [(2, 6, 2, 64, 16, 20), (1, 8, 2, 300, 32, 200), (1, 7, 1, 90, 16, 41)]  # B, Hq, Hkv, C, D, prompt


@pytest.mark.parametrize("past_only", [True, False])
@pytest.mark.parametrize("mode,last", [("all", 0), ("window", 4)])
@pytest.mark.parametrize("seq", SEQUENCES, ids=lambda s: "B{}-Hq{}Hkv{}-C{}-D{}-n{}".format(*s))
def test_deferred_statistics_equal_the_two_ops_when_folded(seq, mode, last, past_only):
    """Steps 0-3 defer, step 4 folds (a compressing step): same outputs at every step, same score after step 4,
    nothing pending; while deferred the score lags by exactly the pending query's fold."""
    a, fused, b, apart = _sequence(*seq, mode, last, past_only, lambda step: step < STEPS - 1)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused["score"], apart["score"], atol=1e-5, rtol=1e-6)
    assert torch.isinf(fused["pending_lse"]).all() and (fused["pending_lse"] > 0).all()

    _, lagging, _, apart = _sequence(*seq, mode, last, past_only, lambda step: True)
    assert (lagging["score"] - apart["score"]).abs().max() > 1e-3  # the last query is pending
    cp = torch.tensor([seq[-1] + STEPS])  # the next step's position
    oa.fold_pending(lagging["keys"], lagging["bias"], lagging["slot_pos"], cp, lagging["score"], lagging["pending_q"],
                    lagging["pending_lse"], seq[-2] ** -0.5, 0, mode)
    torch.testing.assert_close(lagging["score"], apart["score"], atol=1e-5, rtol=1e-6)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CUDA steps on the CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("past_only", [True, False])
@pytest.mark.parametrize("seq", SEQUENCES, ids=lambda s: "B{}-Hq{}Hkv{}-C{}-D{}-n{}".format(*s))
def test_cuda_steps_under_triton_interpreter(seq, past_only):
    """The CUDA path's launches (pending rows in the attention tile, split and unsplit, the compressing step's
    combine + fold) through Triton's interpreter, against the two ops."""
    pytest.importorskip("triton")
    a, fused, b, apart = _sequence(*seq, "all", 0, past_only, lambda step: step not in (2, STEPS - 1), oa._launch)
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
    with pytest.raises(ValueError, match=r"pending_q must be fp32 \[B, Hkv, G, D\]"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, pending[0][..., :3], *pending[1:], "all", 0)
    with pytest.raises(ValueError, match="defer=True keeps one decode query pending: T must be 1"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, *pending, "all", 0, False, True)


def test_broken_fill_promise_is_refused():
    """past_only: the slots a pending query saw must be those before fill - 1 (the CUDA kernel reads no slot_pos);
    with nothing pending there is no promise to keep."""
    q, keys, values, bias, slot_pos, cp, score = _inputs(1, 2, 1, 1, 10, seed=0)
    pq, plse, fill = nothing_pending(q, keys)
    bias[:] = 0.0
    OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, pq, plse, fill - 1, "all", 0, True, False)  # none pending
    plse[0, 0, 1] = 2.0
    with pytest.raises(ValueError, match="breaks the promise that the slots before position"):
        OP(q, keys, values, bias, slot_pos, cp, 0.25, 0, score, pq, plse, fill - 1, "all", 0, True, True)


def test_opcheck():
    q, keys, values, bias, slot_pos, cp, score = _inputs(2, 4, 2, 1, 12, seed=1)
    pq, plse, fill = nothing_pending(q, keys)
    plse[0] = 1.5  # something pending in row 0
    pq.normal_()
    for defer in (False, True):
        torch.library.opcheck(OP, (q, keys, values, bias, slot_pos, cp, 0.25, 0, score, pq.clone(), plse.clone(), fill,
                                   "window", 3, True, defer))
