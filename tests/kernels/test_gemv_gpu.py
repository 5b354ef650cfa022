"""kvrewrite::gemv on CUDA: the Triton kernel against the fp32 product, on fresh random inputs.

Every output is written into memory poisoned with NaN first. Tolerance (kernels/gemv.py error_bound): one ulp
of the output dtype (the kernel's fp32 sum may round the other way) plus the fp32 summation-order error,
4 sqrt(K) 2^-24 sum_k |x_k w_nk|: a kernel that drops a K tile, a row or the bias is off by far more. Skipped without CUDA or Triton. On a GPU machine: `python -m pytest -m gpu -q tests/kernels/test_gemv_gpu.py`.
"""
import pytest
import torch
import torch.nn.functional as F

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import gemv as g
from tests.kernels.poisoned import poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(g.triton is None, reason="needs Triton"),
]

OP = torch.ops.kvrewrite.gemv.default


def _check(N, K, dtype, bias, seed, x=None, **tuning):
    gen = torch.Generator().manual_seed(seed)
    if x is None:
        x = torch.randn(1, 1, K, generator=gen).to(dtype).cuda()
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype).cuda()
    b = torch.randn(N, generator=gen).to(dtype).cuda() if bias else None
    fn = (lambda: OP(x, w, b)) if not tuning else (lambda: g.triton_gemv(x, w, b, **tuning))
    out = poisoned(fn, N * 4)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.shape == (*x.shape[:-1], N) and out.dtype == dtype
    err = ((out.float() - ref).abs() / g.error_bound(x, w, ref)).max().item()
    assert err <= 1, f"N{N} K{K} {dtype} bias {bias} {tuning}: error {err:.2f}x the bound"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N, K", [(4096, 4096), (1000, 576), (37, 700), (6144, 4096), (257, 14336), (8, 16),
                                  (1, 2048), (128256, 64)])
def test_matches_fp32_product(N, K, dtype):
    _check(N, K, dtype, bias=(N % 2 == 1), seed=N + K)


@pytest.mark.parametrize("tuning", [dict(block_n=1), dict(block_n=16, block_k=256), dict(block_k=2048, num_warps=8),
                                    dict(evict_first=True, num_stages=1)])
def test_launch_variants_compute_the_same(tuning):
    _check(333, 1500, torch.bfloat16, bias=True, seed=5, **tuning)


def test_strided_input():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, 1024, generator=gen).to(torch.bfloat16).cuda()[:, :, ::2]  # K stride 2
    _check(64, 512, torch.bfloat16, bias=True, seed=4, x=x)


def test_cuda_errors_name_the_problem():
    w = torch.randn(24, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"one CUDA device"):
        g.triton_gemv(torch.randn(1, 32, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"one row of K=32"):
        OP(torch.randn(5, 32, device="cuda", dtype=torch.bfloat16), w)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fuse_projections"])
def test_compiled_decode_with_gemv_generates_the_same_tokens(fused):
    """A tiny Llama with gemv=True under rw.compile(fullgraph, reduce-overhead) generates the tokens of the same
    model without it; every linear of its decode graph became a gemv, gemv_rms_norm or gemv_glu (fp32: the two differ by
    summation order only, far from a greedy near-tie)."""
    from tests.families import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama").to("cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, 24), device="cuda")
    outs, counts = {}, {}
    for flag in (False, True):
        rw = kvrewrite.apply(model, "chelsea", 0.5, max_length=64, prefill_chunk=8, gemv=flag, fuse_projections=fused,
                             n_sink=2, n_recent=4, chunk=8)
        counts[flag] = {t: sum(str(n.target) == t for n in rw.decode_graph.graph.nodes)
                        for t in ("aten.linear.default", "kvrewrite.gemv.default", "kvrewrite.gemv_rms_norm.default",
                                  "kvrewrite.gemv_glu.default")}
        if flag:
            rw.compile(fullgraph=True, mode="reduce-overhead")
        outs[flag] = rw.generate(ids, max_new_tokens=16)
    # passes/fuse_rms_norm_into_gemv.py turns the gemvs after an RMSNorm into kvrewrite::gemv_rms_norm,
    # passes/fuse_glu_into_gemv.py the down projections into kvrewrite::gemv_glu
    L = model.config.num_hidden_layers
    assert counts[True]["aten.linear.default"] == 0
    assert counts[True]["kvrewrite.gemv_glu.default"] == L
    assert counts[True]["kvrewrite.gemv.default"] + counts[True]["kvrewrite.gemv_rms_norm.default"] + \
        counts[True]["kvrewrite.gemv_glu.default"] == counts[False]["aten.linear.default"]
    if fused:  # q/k/v and gate/up of every layer, and the lm_head, after an RMSNorm; o_proj alone
        assert counts[True]["kvrewrite.gemv_rms_norm.default"] == 2 * L + 1
        assert counts[True]["kvrewrite.gemv.default"] == L
    assert torch.equal(outs[False], outs[True])
