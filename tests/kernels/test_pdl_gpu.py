"""Programmatic dependent launch (kernels/_pdl.py) on CUDA: it changes when a kernel starts, never what it computes.

1. A chain of the PDL kernels (gemv_rms_norm, gemv, gemv_glu, cache_append, clustered_attention with its combine), each reading the one before, captured in one CUDA graph with PDL and without: the same bits, and
   the same as the eager calls. A kernel that loaded or stored another kernel's data before its gdc_wait would read
   stale values here (the chain's tensors are all written by the kernel before). Again with the GEMVs' weights
   marked constant (constant_weight=True: their first weight tile is loaded before the wait).
2. rw.compile(fullgraph, reduce-overhead) of a tiny bf16 Llama (snapkv: observed attention; gemv, fused projections)
   with PDL and without: the same logits at every step, bit for bit.
Skipped without CUDA, Triton or a GPU of compute capability >= 9 (no PDL there: the kernels run as before).
"""
import pytest
import torch

import kvrewrite
from kvrewrite.bench.cuda_graphs import capture, warm_up
from kvrewrite.kernels import _pdl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(_pdl.gdc_wait is None, reason="needs Triton with its CUDA extras"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                       reason="PDL needs compute capability >= 9"),
]

OPS = torch.ops.kvrewrite


def _chain_inputs(seed=0, K=1536, N_QKV=2048, C=333, Hkv=4, G=2, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    r = lambda *s: torch.randn(*s, generator=g, **bf)  # noqa: E731
    cache = dict(keys=r(1, Hkv, C, D), values=r(1, Hkv, C, D),
                 bias=torch.zeros(1, Hkv, C, device="cuda"), slot_pos=torch.arange(C, device="cuda").repeat(1, Hkv, 1),
                 fill=torch.full((1, Hkv), C - 8, device="cuda", dtype=torch.int64))
    cache["bias"][..., C - 8:] = float("-inf")
    weights = dict(nw=r(K), w_qkv=r(N_QKV, K) / K**0.5, w_o=r(K, Hkv * G * D) / K**0.5, w_gu=r(2 * 1792, K) / K**0.5,
                   w_down=r(K, 1792) / 1792**0.5)
    return dict(x=r(1, 1, K), res=r(1, 1, K), cpos=torch.tensor([C - 8], device="cuda"), cache=cache, **weights,
                shape=(Hkv, G, D))


def _chain(t, constant=False):
    """One decoder layer's kernels, each fed by the one before (the GEMVs' weights marked constant or not). Mutates
    t["cache"] (cache_append)."""
    Hkv, G, D = t["shape"]
    qkv, h = OPS.gemv_rms_norm(t["x"], t["res"], t["nw"], 1e-5, t["w_qkv"], None, False, constant)
    q, k, v = qkv.split([Hkv * G * D, Hkv * D, Hkv * D], dim=-1)
    q = q.reshape(1, 1, Hkv * G, D).transpose(1, 2).contiguous()
    k = k.reshape(1, 1, Hkv, D).transpose(1, 2).contiguous()
    v = v.reshape(1, 1, Hkv, D).transpose(1, 2).contiguous()
    c = t["cache"]
    OPS.cache_append(c["keys"], c["values"], c["bias"], c["slot_pos"], c["fill"], k, v, t["cpos"],
                     torch.ones(1, 1, dtype=torch.bool, device="cuda"))
    attn = OPS.clustered_attention(q, c["keys"], c["values"], c["bias"], c["slot_pos"], t["cpos"], D**-0.5, 0)
    o = OPS.gemv(attn.transpose(1, 2).reshape(1, 1, -1), t["w_o"], None, constant)
    gu, h2 = OPS.gemv_rms_norm(o, h, t["nw"], 1e-5, t["w_gu"], None, False, constant)
    gate, up = gu.chunk(2, dim=-1)
    return OPS.gemv_glu(gate.contiguous(), up.contiguous(), t["w_down"], None, "silu", constant), h2, c["keys"].clone()


def _graph_run(pdl, constant=False):
    t = _chain_inputs()
    _pdl.set_enabled(pdl)
    outs = []
    try:
        warm_up(lambda: _chain(_chain_inputs(), constant))  # compiles the kernels, on other tensors
        graph = capture(lambda: outs.extend(_chain(t, constant)))
    finally:
        _pdl.set_enabled(True)
    graph.replay()
    torch.cuda.synchronize()
    return [o.clone() for o in outs]


@pytest.mark.parametrize("constant", [False, True])
def test_a_chain_in_a_cuda_graph_computes_the_same_bits_with_pdl(constant):
    eager = _chain(_chain_inputs())
    with_pdl, without = _graph_run(True, constant), _graph_run(False, constant)
    for a, b, e in zip(with_pdl, without, eager):
        assert torch.equal(a, b) and torch.equal(a, e)


def test_compiled_decode_gives_the_same_logits_with_and_without_pdl():
    from tests.families import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), device="cuda")
    logits = {}
    for pdl in (True, False):
        torch._dynamo.reset()
        _pdl.set_enabled(pdl)
        try:
            rw = kvrewrite.apply(model, "snapkv", 0.5, window=4, interval=4, max_length=64, prefill_chunk=8,
                                 gemv=True, fuse_projections=True)
            rw.compile(fullgraph=True, mode="reduce-overhead")
            out = rw.generate(ids, max_new_tokens=12, output_logits=True, return_dict_in_generate=True)
        finally:
            _pdl.set_enabled(True)
        logits[pdl] = torch.stack(out.logits)
    assert torch.equal(logits[True], logits[False])
