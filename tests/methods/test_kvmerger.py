"""KVMerger (https://arxiv.org/abs/2407.08454) end to end on a tiny llama: full attention when nothing needs merging,
compressions at B + g with every token accounted for by the degrees, invisible left padding, option errors.

The op is tested against a naive float64 implementation in tests/kernels/test_kvmerger_compress.py; here the method
wires it (with H2O's score observation) into the step graphs.
"""
import pytest
import torch

import kvrewrite
from kvrewrite.methods import make_method
from kvrewrite.methods.kvmerger import KVMergerMethod
from tests.methods.tiny_runs import CHUNK, N_PROMPT, PAD_ROW1, prompt, run



@pytest.mark.parametrize("values", ["scale", "bias"])
def test_budget_covering_every_token_is_full_attention(llama, captured, values):
    """B = 30 >= the 21 + 9 tokens, g = 1: the op runs (at fill 31 it drops the padding slots) but merges nothing,
    so the logits are full's; budget=1.0 (never due) too."""
    ids, mask = prompt()
    full = kvrewrite.apply(llama, "full", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured)
    want, fed = run(full, ids, mask, 9)
    for budget, interval in ((30, 1), (1.0, 32)):
        rw = kvrewrite.apply(llama, "kvmerger", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                             budget=budget, interval=interval, values=values)
        got, _ = run(rw, ids, mask, 9, fed)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        st = rw.layer_state(0)
        if budget == 30:  # compressed: the padding is gone, every slot stands for one token
            assert st["fill"][:, 0].tolist() == [30, 30 - PAD_ROW1]
        assert bool((st["degree"] == 1).all())


@pytest.mark.parametrize("reading,budget_mode", [("chain", "exact"), ("anchor", "epsilon")])
def test_compressions_at_b_plus_g_conserve_tokens(llama, captured, reading, budget_mode):
    """B = 12, g = 3: after the prompt each head holds 12 (chain/exact; <= 12 otherwise, epsilon 0 on the tiny model's
    keys), then grows by one per step and is merged back when it (plus its deficit) reaches 15; the degrees of the
    kept slots always add up to the row's real tokens."""
    ids, mask = prompt()
    rw = kvrewrite.apply(llama, "kvmerger", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                         budget=12, interval=3, reading=reading, budget_mode=budget_mode, epsilon=0.0)
    logits = rw.prefill(ids, mask, max_new_tokens=10)
    real = torch.tensor([N_PROMPT, N_PROMPT - PAD_ROW1])
    fills = []
    for step in range(10):
        for i, info in enumerate(rw.layers):
            st = rw.layer_state(info.index)
            # the host schedule's mirror = fill + deficit on every head (so the device is due when the host says)
            host = torch.tensor(rw.schedule.fill[i])[:, None].expand_as(st["fill"])
            assert torch.equal(st["fill"] + st["deficit"], host), (step, info.index)
            kept = torch.arange(st["keys"].shape[2]) < st["fill"][..., None]
            assert torch.equal((st["degree"] * kept).sum(-1), (real + step)[:, None].expand_as(st["fill"]))
            assert bool((st["bias"][kept] > -float("inf")).all())
        fills.append(rw.layer_state(0)["fill"].clone())
        logits = rw.decode_step(logits.argmax(-1))
    if budget_mode == "exact":
        assert [int(f.max()) for f in fills] == [12, 13, 14, 12, 13, 14, 12, 13, 14, 12]
        assert all(bool((f == f.max()).all()) for f in fills)
    else:
        assert all(int(f.max()) <= 14 for f in fills)
        assert int(rw.layer_state(1)["deficit"].max()) > 0  # some head kept fewer than B
    assert int(rw.layer_state(1)["degree"].max()) > 1  # merged sets


def test_left_padding_is_invisible(llama, captured):
    """The shorter prompt, left-padded in a batch, gives the logits it gives alone."""
    ids, mask = prompt()
    rw = kvrewrite.apply(llama, "kvmerger", max_length=48, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                         budget=10, interval=2, n_sink=1)
    got, fed = run(rw, ids, mask, 7)
    short = ids[1:, PAD_ROW1:].expand(2, -1)
    alone, _ = run(rw, short, torch.ones_like(short), 7, fed[1:].expand(2, -1))
    torch.testing.assert_close(got[1], alone[0], atol=1e-5, rtol=1e-5)


def test_calls_state_and_targets():
    from kvrewrite.context import LayerInfo

    m = KVMergerMethod(budget=100, interval=5, reading="anchor", values="bias", n_sink=2)
    layer = LayerInfo(0, 4, 2, 16, 0)
    assert m.targets(layer, 3000, 1000) == (100, 105)
    assert KVMergerMethod(budget=0.25).targets(layer, 300, 100) == (100, 132)
    op, kw = m.compression_call(layer)
    assert op is torch.ops.kvrewrite.kvmerger_compress.default
    assert kw == {"recent_ratio": 0.34, "hh_ratio": 0.24, "n_sink": 2, "epsilon": 0.75, "sigma": 5.0,
                  "sigma_mode": "fixed", "values_mode": "bias", "reading": "anchor", "budget_mode": "exact"}
    assert m.observe_call(layer) == (torch.ops.kvrewrite.accumulate_attention.default, {"stats_mode": "all"})
    fields = m.state_fields(layer)
    assert list(fields) == ["score", "pending_q", "pending_lse", "degree", "deficit"]
    assert fields["degree"].dtype == torch.int32 and fields["degree"].reset == 1
    assert fields["deficit"].dtype == torch.int64 and fields["deficit"].reset == 0


@pytest.mark.parametrize("kw,field", [
    (dict(budget=0), "budget"), (dict(interval=0), "interval"), (dict(recent_ratio=1.5), "recent_ratio"),
    (dict(hh_ratio=-0.1), "hh_ratio"), (dict(recent_ratio=0.6, hh_ratio=0.5), "recent_ratio \\+ hh_ratio"),
    (dict(epsilon=1.0), "epsilon"), (dict(sigma=0), "sigma"), (dict(n_sink=-1), "n_sink"),
    (dict(n_sink=True), "n_sink"), (dict(reading="greedy"), "reading"), (dict(budget_mode="adaptive"), "budget_mode"),
    (dict(sigma_mode="mean"), "sigma_mode"), (dict(values="avg"), "values")])
def test_config_errors(kw, field):
    with pytest.raises(ValueError, match=rf"KVMergerMethod[.:] ?{field}"):
        KVMergerMethod(**kw)
    with pytest.raises(ValueError, match=field):
        make_method("kvmerger", **kw)
