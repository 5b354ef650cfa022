"""Method.append_call and Method.attention_call, and the state dimension "L", with a test-only method.

`kvrewrite_test::record_pre_rope` (the append op) writes each step's k_pre into a [B, Hkv, L, D] field at the
tokens' cache positions and copies fill; `kvrewrite_test::counted_attention` (the attention op) is
clustered_attention that adds `step` to a per-row counter. On tiny models the recorded keys must be HF's
pre-RoPE keys, the logits full's, and the counters the number of graph runs.
"""
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import kvrewrite
from kvrewrite.errors import RewriteError
from kvrewrite.methods.base import Method
from kvrewrite.state import StateField, allocate_layer_state, full_length
from tests.families import tiny_model
from tests.passes.hf_pre_rope import hf_pre_rope_keys

MAX_LENGTH, CHUNK, N_PROMPT, STEPS, STEP = 48, 8, 16, 4, 3
APPEND, ATTEND = "kvrewrite_test::record_pre_rope", "kvrewrite_test::counted_attention"


@torch.library.custom_op(APPEND, mutates_args=("seen", "fill_seen"))
def record_pre_rope(keys: torch.Tensor, bias: torch.Tensor, fill: torch.Tensor, k_pre: torch.Tensor,
                    cache_position: torch.Tensor, token_valid: torch.Tensor, seen: torch.Tensor,
                    fill_seen: torch.Tensor) -> None:
    seen[:, :, cache_position] = k_pre.to(seen.dtype)
    fill_seen.copy_(fill)


@torch.library.custom_op(ATTEND, mutates_args=("calls",))
def counted_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                      slot_pos: torch.Tensor, cache_position: torch.Tensor, calls: torch.Tensor, scale: float,
                      past_only: bool, softcap: float, step: int) -> torch.Tensor:
    calls += step
    return torch.ops.kvrewrite.clustered_attention(q, keys, values, bias, slot_pos, cache_position, scale, 0,
                                                   past_only=past_only, softcap=softcap)


@counted_attention.register_fake
def _(q, keys, values, bias, slot_pos, cache_position, calls, scale, past_only, softcap, step):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@dataclass
class HooksMethod(Method):
    """Keeps everything (no compression op); records the pre-RoPE keys and replaces the attention."""

    name: ClassVar[str] = "hooks_test"
    also: str = ""  # "observe" or "select": a forbidden combination

    def compression_call(self, layer):
        return None

    def state_fields(self, layer) -> dict:
        return {"seen": StateField(("B", "Hkv", "L", "D"), None, 0.0),
                "fill_seen": StateField(("B", "Hkv"), torch.int64, 0),
                "calls": StateField(("B", "Hkv"), torch.int64, 0)}

    def append_call(self, layer):
        return torch.ops.kvrewrite_test.record_pre_rope.default, {}

    def attention_call(self, layer):
        return torch.ops.kvrewrite_test.counted_attention.default, {"step": STEP}

    def observe_call(self, layer):
        return (torch.ops.kvrewrite.accumulate_attention.default, {}) if self.also == "observe" else None

    def select_call(self, layer, max_length):
        return (torch.ops.kvrewrite.select_clusters.default, {}) if self.also == "select" else None


def _greedy(rw, ids) -> tuple[list, torch.Tensor]:
    """Per step logits [1, V] of a prefill and STEPS decode steps, and every token the cache saw."""
    logits = [rw.prefill(ids, torch.ones_like(ids), max_new_tokens=STEPS + 1)]
    tokens = [ids]
    for _ in range(STEPS):
        tokens.append(logits[-1].argmax(-1, keepdim=True))
        logits.append(rw.decode_step(tokens[-1][:, 0]))
    return logits, torch.cat(tokens, 1)


def _ops(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: 2 sliding-window layers, k_norm
def test_hooks_record_pre_rope_keys_and_attend_like_full(family):
    from kvrewrite.capture import capture

    model = tiny_model(family)
    captured = capture(model, batch_size=1, prefill_chunk=CHUNK)  # one capture, rewritten for both methods
    rw = kvrewrite.apply(model, HooksMethod(), max_length=MAX_LENGTH, captured=captured)
    full = kvrewrite.apply(model, "full", max_length=MAX_LENGTH, captured=captured)
    ids = torch.randint(1, 128, (1, N_PROMPT), generator=torch.Generator().manual_seed(0))
    got, seen_tokens = _greedy(rw, ids)
    want, _ = _greedy(full, ids)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"step {step}")

    full_layers = [i.index for i in rw.layers if not i.window]
    n_tokens = N_PROMPT + STEPS
    hf = hf_pre_rope_keys(model, seen_tokens)
    for info in rw.layers:
        st = rw.layer_state(info.index)
        if info.window:
            assert "seen" not in st  # windowed layers never run the method
            continue
        assert st["seen"].shape == (1, info.num_kv_heads, full_length(MAX_LENGTH, CHUNK), info.head_dim)
        torch.testing.assert_close(st["seen"][:, :, :n_tokens], hf[info.index], rtol=1e-5, atol=1e-5)
        assert not st["seen"][:, :, n_tokens:].any()
        assert torch.equal(st["fill_seen"], st["fill"])  # the op runs after cache_append
        runs = N_PROMPT // CHUNK + STEPS
        assert (st["calls"] == STEP * runs).all()

    graphs = {"prefill": rw.prefill_graph, "decode": rw.decode_graph, "decode_compress": rw.decode_compress_graph}
    for kind, gm in graphs.items():
        ops = _ops(gm)
        attends = [n for n in ops if n.target == torch.ops.kvrewrite_test.counted_attention.default]
        appends = [n for n in ops if n.target == torch.ops.kvrewrite_test.record_pre_rope.default]
        dense = [n for n in ops if n.target == torch.ops.kvrewrite.clustered_attention.default]
        assert sorted(n.meta["kvrewrite"]["layer"] for n in attends) == full_layers, kind
        assert sorted(n.meta["kvrewrite"]["layer"] for n in appends) == full_layers, kind
        assert len(dense) == len(rw.layers) - len(full_layers), kind  # sliding layers keep clustered_attention
        for n in attends:
            assert n.kwargs["past_only"] is (kind != "prefill") and n.kwargs["step"] == STEP
            assert n.meta["kvrewrite"]["role"] == "hooks_test_attention"


@pytest.mark.parametrize("also", ["observe", "select"])
def test_attention_call_refuses_observe_and_select(also):
    with pytest.raises(RewriteError, match=rf"layer 0: .*'hooks_test' has an attention_call and {also}_call"):
        kvrewrite.apply(tiny_model("llama"), HooksMethod(also=also), max_length=MAX_LENGTH, prefill_chunk=CHUNK)


def test_other_methods_get_no_pre_rope_key():
    """Only an append_call method computes k_pre: full's graph equals the capture's (no extra nodes)."""
    rw = kvrewrite.apply(tiny_model("llama"), "full", max_length=MAX_LENGTH, prefill_chunk=CHUNK)
    roles = {n.meta.get("kvrewrite", {}).get("role") for n in _ops(rw.prefill_graph)}
    assert "method_append" not in roles and "attention" in roles


def test_state_dim_l():
    L = full_length(MAX_LENGTH, CHUNK)
    extra = {"tokens": StateField(("B", "Hkv", "L"), torch.int32, -1),
             "per_token": StateField(lambda B, H, C, D, L: (B, H, L + C, D), None, 0.0),
             "per_slot": StateField(lambda B, H, C, D: (B, H, C), torch.float32, 0.0)}
    s = allocate_layer_state(2, 3, 10, 4, torch.float16, "cpu", extra, L=L)
    assert s["tokens"].shape == (2, 3, L) and (s["tokens"] == -1).all()
    assert s["per_token"].shape == (2, 3, L + 10, 4) and s["per_token"].dtype == torch.float16
    assert s["per_slot"].shape == (2, 3, 10)
    for name in ("tokens", "per_token"):
        with pytest.raises(ValueError, match="L .*full_length"):
            allocate_layer_state(2, 3, 10, 4, torch.float16, "cpu", {name: extra[name]})
