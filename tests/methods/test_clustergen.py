"""ClusterGen and its k-center variant end to end on the tiny models: full attention when nothing leaves the window,
folds that the host schedule mirrors (sinks + window exact, the rest in the sketch), left padding invisible (the RNG is
keyed by folded tokens, not positions), capped layers refused, option errors.

The ops are tested against float64 naive models and Algorithm 1's laws in tests/kernels/test_clustergen_fold.py,
test_kcenter*.py and test_sketch_attention*.py; here the methods wire them.
"""
import pytest
import torch

import kvrewrite
from kvrewrite.errors import RewriteError
from kvrewrite.methods import make_method
from kvrewrite.methods.clustergen import sketch_sizes
from tests.families import tiny_model
from tests.methods.tiny_runs import CHUNK, N_PROMPT, PAD_ROW1, prompt, run

SMALL = dict(n_sink=2, window=4, t=2, interval=3)


def _apply(llama, captured, method="clustergen", batch_size=2, **kw):
    opts = SMALL if method == "clustergen" else dict(interval=3)
    return kvrewrite.apply(llama, method, max_length=48, batch_size=batch_size, prefill_chunk=CHUNK,
                           captured=captured if batch_size == 2 else None, **(opts | kw))


def _full(llama, captured, ids, mask, steps):
    full = kvrewrite.apply(llama, "full", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured)
    return run(full, ids, mask, steps)


def test_window_covering_every_token_is_full_attention(llama, captured):
    """No token ever leaves the window: the sketch stays empty and the logits are full's."""
    ids, mask = prompt()
    want, fed = _full(llama, captured, ids, mask, 9)
    rw = _apply(llama, captured, budget=64, n_sink=0, window=48)
    got, _ = run(rw, ids, mask, 9, fed)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert int(rw.layer_state(0)["n_seen"].sum()) == 0


def test_kcenter_budget_covering_every_token_is_full_attention(llama, captured):
    ids, mask = prompt()
    want, fed = _full(llama, captured, ids, mask, 9)
    rw = _apply(llama, captured, "clustergen-kcenter", budget=40)
    got, _ = run(rw, ids, mask, 9, fed)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_folds_keep_sinks_and_window_exact(llama, captured):
    """B = 16 (sketch 10 slots: 5 value samples, 2 clusters of 2), g = 3: after every step each layer's exact part
    is what the host schedule mirrors, at most n_sink + window + g - 1; every valid token is exact or folded."""
    ids, mask = prompt()
    rw = _apply(llama, captured, budget=16)
    assert sketch_sizes(16, 2, 4, 2, 0.5) == (10, 5, 2)
    rw.prefill(ids, mask, max_new_tokens=13)
    valid = mask.sum(1)
    for step in range(12):
        rw.decode_step(torch.tensor([5, 7]))
        for info in rw.layers:
            st = rw.layer_state(info.index)
            fill = st["fill"]
            assert fill.tolist() == [[f] * fill.shape[1] for f in rw.schedule.fill[info.index]]
            assert bool((fill <= 2 + 4 + 3 - 1).all()), f"layer {info.index}: exact part past n_sink + window + g - 1"
            exact = torch.isfinite(st["bias"]) & (st["role"] == 0)
            n_tokens = (valid + step + 1)[:, None]
            assert torch.equal(exact.sum(-1) + st["n_seen"], n_tokens.expand_as(fill)), \
                "a valid token is neither exact nor folded"
    st = rw.layer_state(rw.layers[-1].index)
    assert bool((st["n_clusters"] >= 1).all()) and bool((st["n_clusters"] <= 2).all())
    assert bool((st["mu"] > 0).all())
    assert bool((st["delta"] >= 0).all()), "delta is calibrated at the first fold"
    assert bool(((st["role"] == 1) & torch.isfinite(st["bias"])).any()), "no key sample"
    assert bool(((st["role"] == 2) & torch.isfinite(st["bias"])).any()), "no value sample"


@pytest.mark.parametrize("method", ["clustergen", "clustergen-kcenter"])
def test_padded_row_equals_the_prompt_alone(llama, captured, method):
    """Row 1 (left-padded) of a folding batch-2 run gives the logits of its prompt run alone."""
    ids, mask = prompt()
    rw = _apply(llama, captured, method, budget=16)
    got, fed = run(rw, ids, mask, 6)
    alone = _apply(llama, captured, method, batch_size=1, budget=16)
    logits = [alone.prefill(ids[1:, PAD_ROW1:], mask[1:, PAD_ROW1:], max_new_tokens=7)]
    for i in range(6):
        logits.append(alone.decode_step(fed[1:, i]))
    torch.testing.assert_close(got[1:], torch.stack(logits, 1), atol=2e-5, rtol=1e-5)


def test_seed_changes_the_samples_and_reproduces(llama, captured):
    ids, mask = prompt()
    a = run(_apply(llama, captured, budget=16, seed=1), ids, mask, 3)[0]
    b = run(_apply(llama, captured, budget=16, seed=1), ids, mask, 3)[0]
    c = run(_apply(llama, captured, budget=16, seed=2), ids, mask, 3)[0]
    assert torch.equal(a, b), "the same seed must give the same run"
    assert not torch.equal(a, c), "another seed must draw other samples"


def test_kcenter_keeps_b_slots(llama, captured):
    ids, mask = prompt()
    rw = _apply(llama, captured, "clustergen-kcenter", budget=10)
    rw.prefill(ids, mask, max_new_tokens=13)
    for step in range(12):
        rw.decode_step(torch.tensor([5, 7]))
        for info in rw.layers:
            fill = rw.layer_state(info.index)["fill"]
            assert fill.tolist() == [[f] * fill.shape[1] for f in rw.schedule.fill[info.index]]
            assert bool((fill < 10 + 3).all())


def test_capped_layers_are_refused():
    model = tiny_model("gemma2-softcap-alternating")
    with pytest.raises(RewriteError, match=r"layer 1: .*method 'clustergen' cannot run on this layer, which caps its "
                                           r"logits \(softcap=5\.0\): ClusterGen estimates sums of exp\(q\.k\)"):
        kvrewrite.apply(model, "clustergen", max_length=32, prefill_chunk=CHUNK)


@pytest.mark.parametrize("name,kwargs,err", [
    ("clustergen", dict(t=0), r"ClusterGenMethod\.t must be an int >= 1, got 0"),
    ("clustergen", dict(window=-1), r"ClusterGenMethod\.window must be an int >= 0, got -1"),
    ("clustergen", dict(value_share=1.0), r"ClusterGenMethod\.value_share must be a number in \(0, 1\), got 1\.0"),
    ("clustergen", dict(cluster_target=0), r"ClusterGenMethod\.cluster_target must be a number in \(0, 1\), got 0"),
    ("clustergen", dict(seed=2**32), r"ClusterGenMethod\.seed must be < 2\*\*32"),
    ("clustergen-kcenter", dict(recent_ratio=1.0),
     r"ClusterGenKCenterMethod\.recent_ratio must be a number in \[0, 1\), got 1\.0"),
])
def test_option_errors(name, kwargs, err):
    with pytest.raises(ValueError, match=err):
        make_method(name, **kwargs)


def test_budget_too_small_for_a_sketch(llama, captured):
    rw = _apply(llama, captured, budget=8)  # sketch 2 slots: 1 value sample, 0 clusters of 2
    ids, mask = prompt()
    with pytest.raises(ValueError, match=r"leaves a sketch of 2 slots after n_sink=2 and window=4: 1 value samples "
                                         r"\(value_share=0\.5\) and 0 clusters of t=2 key samples"):
        rw.prefill(ids, mask, max_new_tokens=4)
    assert N_PROMPT > 8


def test_state_sizes(llama, captured):
    rw = _apply(llama, captured, budget=16)
    st = rw.layer_state(0)
    C = st["keys"].shape[2]
    assert C == 16 + 3 - 1 + CHUNK, "capacity: B_max + g - 1 + chunk, never clamped"
    assert st["rep"].shape[2] == st["count"].shape[2] == -(-C // 4) + 1  # ceil(0.5 C / t) + 1 with t = 2
    assert st["role"].dtype == torch.int8
