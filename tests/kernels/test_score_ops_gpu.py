"""accumulate_attention and evict_by_score on CUDA: against their CPU results, with no host sync, in a CUDA graph.

accumulate_attention runs attention_column_stats' Triton kernels on CUDA (tolerances: that op's GPU test, the
same rounding); evict_by_score runs its Triton kernels on CUDA (the tensor code where Triton is missing), which
must leave the CPU tensor code's state bit for bit (every field, NaN bits too). Skipped without CUDA (and, for
the Triton paths, Triton). Written without a GPU at hand: on a GPU machine,
`python -m pytest -m gpu -q tests/kernels/test_score_ops_gpu.py`.
"""
import math

import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import attention_column_stats as acs
from kvrewrite.kernels import evict_by_score as ebs
from kvrewrite.kernels.evict_by_score import reference_evict_by_score as cpu_reference
from kvrewrite.state import allocate_layer_state
from tests.kernels.poisoned import poisoned
from tests.kernels.test_clustered_attention import make_state
from tests.kernels.test_evict_by_score import FIELDS, scored_state, shuffle, state_args

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
                        pads=[0, 7, 3], seed=seed, dtype=torch.bfloat16, shuffled=True)


@pytest.mark.parametrize("settings", [(32, 0.0, 7, True), (0, 0.5, 1, False)], ids=["snapkv", "h2o"])
def test_evict_by_score_bit_identical_to_cpu(settings):
    s = _evict_state(1)
    cpu = {k: v.clone() for k, v in s.items()}
    gpu = {k: v.cuda() for k, v in s.items()}
    for st in (cpu, gpu):
        EVICT(*state_args(st), *settings)
    for f in FIELDS:
        assert torch.equal(gpu[f].cpu(), cpu[f]), f"{f} differs on CUDA"


def _same(a, b) -> bool:
    """Bit equality (NaN == NaN of the same bits, -0.0 != 0.0)."""
    if a.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(bits), b.view(bits)
    return a.shape == b.shape and torch.equal(a, b)


def _assert_same(cpu, gpu, what=""):
    bad = [f for f in FIELDS if not _same(gpu[f].cpu(), cpu[f])]
    assert not bad, f"{what}: {bad} differ on CUDA from the CPU (fill {cpu['fill'].tolist()})"


def _evict(st, settings, **knobs):
    """The op on st's tensors; with knobs, triton_evict_by_score called directly with them."""
    args = (*state_args(st), *settings)
    if knobs:
        ebs.triton_evict_by_score(*args, **knobs)
    elif st["keys"].is_cuda:
        EVICT(*args)
    else:
        cpu_reference(*args)


def _cpu_and_cuda(s, settings, **knobs):
    cpu = {k: v.clone() for k, v in s.items()}
    gpu = {k: v.cuda() for k, v in s.items()}
    _evict(cpu, settings)
    _evict(gpu, settings, **knobs)
    return cpu, gpu


@pytest.fixture
def triton_path(monkeypatch):
    """With Triton installed, the CUDA op must run the Triton kernels: the tensor code raises if called."""
    if ebs.triton is not None:
        def refuse(*args, **kwargs):
            raise AssertionError("evict_by_score ran the tensor code on CUDA, not the Triton kernels")

        monkeypatch.setattr(ebs, "reference_evict_by_score", refuse)


def _llama_state(B, C, target, interval, seed, Hkv=8, D=128):
    """A Llama-3.1-8B-like layer (Hkv 8, D 128, bf16), rows at the threshold (fill = target + interval), random
    distinct scores, in temporal order (order 0); for B > 1, batch row 1 is one slot short (not due)."""
    fill = target + interval
    g = torch.Generator().manual_seed(seed)
    s = allocate_layer_state(B, Hkv, C, D, torch.bfloat16, "cpu")
    s["keys"].copy_(torch.randn(B, Hkv, C, D, generator=g))
    s["values"].copy_(torch.randn(B, Hkv, C, D, generator=g))
    s["bias"][..., :fill] = torch.randint(1, 4, (B, Hkv, fill), generator=g).float().log()
    s["slot_pos"].copy_(torch.arange(C).expand(B, Hkv, C))
    s["fill"].fill_(fill)
    if B > 1:
        s["fill"][1] = fill - 1
    s["budget"].copy_(torch.tensor([target, fill]))
    s["score"] = torch.rand(B, Hkv, C, generator=g).masked_fill(s["bias"] == -math.inf, 0.0)
    s["order"] = torch.zeros(B, Hkv, C, dtype=torch.int32)
    return s


EVICT_SHAPES = [  # B, H, C, D, fills, target, threshold, pads, dtype
    (3, 4, 300, 64, [[300, 200, 250, 299], [300] * 4, [120, 299, 300, 10]], 180, 250, [0, 7, 3], torch.bfloat16),
    (2, 3, 1001, 128, [[1001, 900, 999], [950, 1001, 1000]], 700, 950, [0, 5], torch.float16),
    (1, 2, 4099, 16, [[4099, 4000]], 3000, 3100, [1], torch.float32),  # more than one select chunk
    (8, 8, 2048, 128, [[2048] * 8] * 4 + [[2000] * 8] * 4, 1600, 2010, None, torch.bfloat16),  # batch 8
    (1, 1, 32768, 16, [[32768]], 26000, 32768, None, torch.bfloat16),  # C = MAX_SLOTS
    (2, 2, 64, 16, [[64, 40], [64, 64]], 33, 64, [4, 0], torch.float32),
]
EVICT_SETTINGS = [(32, 0.0, 7, True), (0, 0.5, 1, False), (4, 0.25, 3, False), (0, 1.0, 1, True)]


@pytest.mark.skipif(ebs.triton is None, reason="needs Triton")
@pytest.mark.parametrize("settings", EVICT_SETTINGS, ids=lambda v: str(v))
@pytest.mark.parametrize("B,H,C,D,fills,target,threshold,pads,dtype", EVICT_SHAPES,
                         ids=lambda v: "fills" if isinstance(v, list) else str(v))
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("shuffled", [False, True], ids=["in_order", "shuffled"])
def test_evict_by_score_triton_bit_identical_to_cpu(B, H, C, D, fills, target, threshold, pads, dtype, settings,
                                                    ties, shuffled, triton_path):
    s = scored_state(B, H, C, D, fills, target, threshold, pads=pads, seed=C, dtype=dtype, ties=ties)
    hole = torch.rand(B, H, C, generator=torch.Generator().manual_seed(D)) < 0.02  # padding inside the rows
    s["bias"].masked_fill_(hole, -math.inf)
    s["score"].masked_fill_(hole, 0.0)
    if shuffled:  # a layout behind order, as after earlier compressions
        shuffle(s, seed=C)
    _assert_same(*_cpu_and_cuda(s, settings))


@pytest.mark.skipif(ebs.triton is None, reason="needs Triton")
@pytest.mark.parametrize("settings", [(0, 0.5, 1, False), (32, 0.0, 7, True)], ids=["h2o", "snapkv"])
@pytest.mark.parametrize("B,C,target", [(1, 8600, 6554), (8, 8600, 6554), (1, 32768, 26214)],
                         ids=lambda v: str(v))
def test_evict_by_score_triton_llama_layout(B, C, target, settings, triton_path):
    """The timed layout (kvrewrite.bench.evict_by_score): 32 slots go per due row."""
    _assert_same(*_cpu_and_cuda(_llama_state(B, C, target, 32, seed=B + C), settings))


@pytest.mark.skipif(ebs.triton is None, reason="needs Triton")
@pytest.mark.parametrize("knobs", [dict(select_chunk=64, move_slots=16, move_columns=16),
                                   dict(select_chunk=1024, move_slots=64, move_columns=32, select_warps=4,
                                        move_warps=2),
                                   dict(select_chunk=8192, move_slots=128, move_columns=128, select_warps=32)],
                         ids=["small", "medium", "large"])
def test_evict_by_score_triton_knobs_change_nothing(knobs):
    s = scored_state(2, 4, 3001, 128, [[3001, 2990, 2999, 3000], [3001] * 4], 2000, 2990, pads=[0, 40], seed=5,
                     dtype=torch.bfloat16)
    s["bias"][:, :, 100:400:3] = -math.inf  # long padding stretches: many holes, several move blocks a row
    for settings in EVICT_SETTINGS[:3]:
        _assert_same(*_cpu_and_cuda(s, settings, **knobs), str((knobs, settings)))


@pytest.mark.skipif(ebs.triton is None, reason="needs Triton")
def test_evict_by_score_triton_special_scores(triton_path):
    """NaN, +-inf, -0.0 scores, and rows with fewer than B - R older scores above -inf (a threshold of -inf)."""
    s = scored_state(2, 4, 500, 64, [[500, 480, 470, 500], [500] * 4], 300, 470, pads=[0, 9], seed=6,
                     dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, -math.nan, 2.5])
    s["score"] = values[torch.randint(0, len(values), (2, 4, 500), generator=g)]
    s["score"][1, :2] = s["score"][1, :2].masked_fill(torch.rand(2, 500, generator=g) < 0.8, -math.inf)
    for settings in EVICT_SETTINGS:
        _assert_same(*_cpu_and_cuda(s, settings), str(settings))


@pytest.mark.skipif(ebs.triton is None, reason="needs Triton")
def test_evict_by_score_triton_poisoned_and_rows_not_due(triton_path):
    """The op's scratch buffers are taken from NaN-filled memory (an entry read before it is written shows up), and
    the rows below the threshold come out unchanged, bit for bit."""
    s = _llama_state(2, 8600, 6554, 32, seed=3)
    cpu = {k: v.clone() for k, v in s.items()}
    _evict(cpu, (0, 0.5, 1, False))
    gpu = {k: v.cuda() for k, v in s.items()}

    def run():
        _evict(gpu, (0, 0.5, 1, False))
        return tuple(gpu[f] for f in FIELDS)

    out = dict(zip(FIELDS, poisoned(run, 4 * s["keys"].numel() * s["keys"].element_size())))
    _assert_same(cpu, out, "poisoned allocator")
    for f in FIELDS:  # batch row 1 is one slot below the threshold
        assert _same(out[f][1].cpu(), s[f][1]), f"{f} of a row not due changed"


@pytest.mark.skipif(ebs.triton is None, reason="needs Triton")
@pytest.mark.parametrize("settings", [(8, 0.0, 3, True), (0, 0.5, 1, False)], ids=["pooled", "h2o-like"])
def test_evict_by_score_past_max_slots_runs_the_kernels(settings):
    """C > MAX_SLOTS: the CUDA op runs the Triton kernels, the selection's bisection chunked (it ran the tensor code
    before stop 41), and matches the CPU's result."""
    C = ebs.MAX_SLOTS + 7
    s = scored_state(1, 2, C, 16, [[C, C - 900]], C - 4000, C - 1000, seed=4)
    assert ebs.supports_triton(*state_args({k: v.cuda() for k, v in s.items()}))
    _assert_same(*_cpu_and_cuda(s, settings))


def test_no_host_sync_and_cuda_graph_replay(triton_path):
    """Both ops under torch.cuda.set_sync_debug_mode("error"), then captured in one CUDA graph and replayed on
    new states copied into the captured tensors, matching the same ops run eagerly on CUDA (deterministic: no
    atomics; the CPU comparison is above, per op, since the scores differ from the CPU's by rounding). With
    Triton, evict_by_score's Triton kernels are what runs (triton_path)."""
    s = {k: v.cuda() for k, v in _evict_state(2).items()}
    q, keys, bias, slot_pos, cp, _ = (a.cuda() for a in _acc_inputs(3, 8, 4, 1, 300, torch.bfloat16, seed=3))

    def step():
        ACC(q, s["keys"], s["bias"], s["slot_pos"], cp, s["score"], 0.125, 0, "window", 32)
        EVICT(*state_args(s), 32, 0.0, 7, True)

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
        EVICT(*state_args(want), 32, 0.0, 7, True)
        torch.cuda.synchronize()
        due = before >= 250  # the threshold: rows below it are untouched
        assert due.any() and (want["fill"][due] == 180).all() and torch.equal(want["fill"][~due], before[~due]), \
            f"expected the due rows compressed to 180, the others untouched: {before.tolist()} -> {want['fill'].tolist()}"
        for f in FIELDS:
            assert torch.equal(s[f], want[f]), f"replay {seed}: {f} differs"
