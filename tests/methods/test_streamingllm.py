"""StreamingLLM (https://arxiv.org/abs/2309.17453): attention sinks + a recent window, B slots in all.

kvrewrite keeps post-RoPE keys at their original positions (no re-indexing of positions inside the
cache, unlike the paper's rolling cache), so the reference here is the HF model itself run over the
whole token sequence with a 4-D boolean mask whose row t allows exactly the positions kvrewrite keeps
when token t is processed: a token's keys and values depend only on what it attended to, so one
masked forward equals the step-by-step eviction.
"""
import math

import pytest
import torch

import kvrewrite
from kvrewrite.methods import make_method
from kvrewrite.methods.streamingllm import StreamingLLMMethod
from tests.families import tiny_model

CHUNK = 8




@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


class Simulator:
    """The slots kvrewrite holds, by cache position, for a batch of one (pads: negative positions)."""

    def __init__(self, target, threshold, n_sink):
        self.target, self.threshold, self.n_sink = target, threshold, n_sink
        self.slots = []  # (position, valid)

    def step(self, positions):
        """Append a chunk; return, per token, the positions it attends to; then evict if due."""
        self.slots += [(p, p >= 0) for p in positions]
        self.evicted = False
        seen = []
        for p in positions:
            if p >= 0:
                seen.append([q for q, v in self.slots if v and q <= p])
        if len(self.slots) >= self.threshold:
            valid = [q for q, v in self.slots if v]
            if len(valid) > self.target:
                s = min(self.n_sink, self.target)
                valid = valid[:s] + valid[len(valid) - (self.target - s):]
            self.slots = [(q, True) for q in valid]
            self.evicted = True
        return seen

    def kept(self):
        return [q for q, v in self.slots if v]


def run_streaming(rw, ids, max_new):
    """Greedy prefill + decode through kvrewrite; logits [steps, V], tokens, the kept positions per step."""
    logits = [rw.prefill(ids, max_new_tokens=max_new)[0]]
    kept = [rw_kept(rw)]
    toks = []
    for _ in range(max_new - 1):
        toks.append(int(logits[-1].argmax()))
        logits.append(rw.decode_step(torch.tensor([toks[-1]]))[0])
        kept.append(rw_kept(rw))
    toks.append(int(logits[-1].argmax()))
    return torch.stack(logits), toks, kept


def rw_kept(rw):
    """Valid slot positions of every (layer, kv head) row; they must all agree for StreamingLLM."""
    out = set()
    for info in rw.layers:
        st = rw.layer_state(info.index)
        for h in range(st["fill"].shape[1]):
            n = int(st["fill"][0, h])
            out.add(tuple(st["slot_pos"][0, h, :n][st["bias"][0, h, :n] > -math.inf].tolist()))
    assert len(out) == 1, out
    return list(out.pop())


@pytest.mark.parametrize("budget,n_sink,interval", [(0.2, 4, 1), (0.3, 2, 3)])
def test_matches_masked_hf_reference(llama, budget, n_sink, interval):
    """Kept positions after every step == sinks + latest window (the simulator); and the logits of the
    last prompt token and of 5 decode steps equal the HF model under the StreamingLLM mask.
    Tolerance: both are fp32 forwards of a 2-layer model with |logits| ~ 1; different kernels (our
    attention op vs SDPA) differ by ~1e-6; 1e-4 is far below the gap to full attention (checked > 1e-2)."""
    n, max_new = 27, 6
    rw = kvrewrite.apply(llama, "streamingllm", budget=budget, max_length=64, prefill_chunk=CHUNK, n_sink=n_sink,
                         interval=interval)
    target = round(budget * (n + max_new))
    assert target > n_sink + 1
    ids = torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(5))
    logits, toks, kept = run_streaming(rw, ids, max_new)

    # the simulator: which positions each token attends to, and what is kept after each step
    sim = Simulator(target, target + interval, n_sink)
    n_pad = math.ceil(n / CHUNK) * CHUNK
    pos = list(range(n - n_pad, n))
    attends = []
    for c in range(0, n_pad, CHUNK):
        attends += sim.step(pos[c:c + CHUNK])
    assert kept[0] == sim.kept()
    evictions = 0
    for k, t in enumerate(range(n, n + max_new - 1)):
        attends += sim.step([t])
        assert kept[k + 1] == sim.kept()
        if sim.evicted:  # just evicted: the first n_sink positions and the last B - n_sink, exactly B
            assert kept[k + 1] == list(range(n_sink)) + list(range(t + 1 - (target - n_sink), t + 1))
            evictions += 1
    assert evictions >= (max_new - 1) // interval

    # the HF reference under the StreamingLLM mask
    seq = torch.cat([ids, torch.tensor([toks[:-1]])], dim=1)
    N = seq.shape[1]
    mask = torch.zeros(1, 1, N, N, dtype=torch.bool)
    for t, allowed in enumerate(attends):
        mask[0, 0, t, allowed] = True
    with torch.no_grad():
        ref = llama(seq, attention_mask=mask, position_ids=torch.arange(N)[None]).logits[0]
        full = llama(seq).logits[0]
    torch.testing.assert_close(logits, ref[n - 1:], atol=1e-4, rtol=1e-4)
    assert (full[n - 1:] - ref[n - 1:]).abs().max() > 1e-2  # the eviction really changes the answer


@pytest.mark.parametrize("kw,field", [(dict(budget=0), "budget"), (dict(budget=1.01), "budget"),
                                      (dict(n_sink=-1), "n_sink"), (dict(n_sink=2.0), "n_sink"),
                                      (dict(interval=0), "interval")])
def test_config_errors(kw, field):
    with pytest.raises(ValueError, match=field):
        StreamingLLMMethod(**kw)
    with pytest.raises(ValueError, match=field):
        make_method("streamingllm", **kw)


def test_generation_too_small_for_sinks():
    m = StreamingLLMMethod(budget=0.1, n_sink=4)
    with pytest.raises(ValueError, match="sink"):
        m.check_generation(30, 10)  # B = 4 <= n_sink
    m.check_generation(40, 10)  # B = 5


def test_compression_call_and_targets():
    from kvrewrite.context import LayerInfo

    m = StreamingLLMMethod(budget=0.25, n_sink=3, interval=5)
    op, kw = m.compression_call(LayerInfo(0, 4, 2, 16, 0))
    assert op is torch.ops.kvrewrite.evict_to_budget.default and kw == {"n_sink": 3}
    assert m.targets(LayerInfo(0, 4, 2, 16, 0), 300, 100) == (100, 105)
