"""accumulate_attention and evict_by_score on CUDA: against their CPU results, with no host sync, in a CUDA graph.

accumulate_attention runs attention_column_stats' Triton kernels on CUDA (tolerances: that op's GPU test, the
same rounding); evict_by_score runs the same tensor code on every device, so CUDA must match the CPU bit for bit.
Skipped without CUDA (and, for accumulate_attention's kernel path, Triton). Written without a GPU at hand: on a
GPU machine, `python -m pytest -m gpu -q tests/kernels/test_score_ops_gpu.py`.
"""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import attention_column_stats as acs
from tests.kernels.test_clustered_attention import make_state
from tests.kernels.test_evict_by_score import FIELDS, scored_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ACC = torch.ops.kvrewrite.accumulate_attention.default
EVICT = torch.ops.kvrewrite.evict_by_score.default
TOL = dict(atol=1e-5, rtol=5e-5)  # fp32 column sums of <= 130 queries (see test_attention_column_stats_gpu.py)


def _acc_inputs(B, Hq, Hkv, T, C, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    keys, _, bias, slot_pos, cp = make_state(B, Hkv, C, 64, T, dtype, gen=g)
    q = torch.randn(B, Hq, T, 64, generator=g).to(dtype)
    return q, keys, bias, slot_pos, cp, torch.rand(B, Hkv, C, generator=g)


@pytest.mark.skipif(acs.triton is None, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode,last,T", [("all", 0, 1), ("all", 0, 130), ("window", 32, 130), ("window", 32, 1)])
def test_accumulate_attention_matches_cpu(dtype, mode, last, T):
    args = _acc_inputs(2, 8, 2, T, 301, dtype, seed=T + last)
    cpu = [a.clone() for a in args]
    ACC(*cpu, 0.125, 0, mode, last)
    gpu = [a.cuda() for a in args]
    ACC(*gpu, 0.125, 0, mode, last)
    torch.testing.assert_close(gpu[-1].cpu(), cpu[-1], **TOL)


def _evict_state(seed):
    return scored_state(3, 4, 300, 64, [[300, 200, 250, 299], [300] * 4, [120, 299, 300, 10]], 180, 250,
                        pads=[0, 7, 3], seed=seed, dtype=torch.bfloat16)


@pytest.mark.parametrize("settings", [(32, 0.0, 7, True), (0, 0.5, 1, False)], ids=["snapkv", "h2o"])
def test_evict_by_score_bit_identical_to_cpu(settings):
    s = _evict_state(1)
    cpu = {k: v.clone() for k, v in s.items()}
    gpu = {k: v.cuda() for k, v in s.items()}
    for st in (cpu, gpu):
        EVICT(*(st[f] for f in FIELDS[:5]), st["budget"], st["score"], *settings)
    for f in FIELDS:
        assert torch.equal(gpu[f].cpu(), cpu[f]), f"{f} differs on CUDA"


def test_no_host_sync_and_cuda_graph_replay():
    """Both ops under torch.cuda.set_sync_debug_mode("error"), then captured in one CUDA graph and replayed on
    new states copied into the captured tensors, matching the same ops run eagerly on CUDA (deterministic: no
    atomics; the CPU comparison is above, per op, since the scores differ from the CPU's by rounding)."""
    s = {k: v.cuda() for k, v in _evict_state(2).items()}
    q, keys, bias, slot_pos, cp, _ = (a.cuda() for a in _acc_inputs(3, 8, 4, 1, 300, torch.bfloat16, seed=3))

    def step():
        ACC(q, s["keys"], s["bias"], s["slot_pos"], cp, s["score"], 0.125, 0, "window", 32)
        EVICT(*(s[f] for f in FIELDS[:5]), s["budget"], s["score"], 32, 0.0, 7, True)

    saved = {k: v.clone() for k, v in s.items()}
    step()  # compile the kernels first (compilation may sync)
    torch.cuda.synchronize()
    for k, v in saved.items():
        s[k].copy_(v)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        step()
    for seed in (4, 5):
        new = _evict_state(seed)
        for k, v in new.items():
            s[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want = {k: v.cuda() for k, v in new.items()}
        before = want["fill"].clone()
        ACC(q, want["keys"], want["bias"], want["slot_pos"], cp, want["score"], 0.125, 0, "window", 32)
        EVICT(*(want[f] for f in FIELDS[:5]), want["budget"], want["score"], 32, 0.0, 7, True)
        torch.cuda.synchronize()
        due = before >= 250  # the threshold: rows below it are untouched
        assert due.any() and (want["fill"][due] == 180).all() and torch.equal(want["fill"][~due], before[~due]), \
            f"expected the due rows compressed to 180, the others untouched: {before.tolist()} -> {want['fill'].tolist()}"
        for f in FIELDS:
            assert torch.equal(s[f], want[f]), f"replay {seed}: {f} differs"
