"""kvrewrite::gemv_rms_norm on the CPU: bit for bit HF's own RMSNorm modules (Llama's and Gemma's spellings) then
F.linear, errors that name what is wrong, opcheck. The Triton kernel: test_gemv_rms_norm_triton.py (interpreter) and
test_gemv_rms_norm_gpu.py."""
import pytest
import torch
import torch.nn.functional as F

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import gemv_rms_norm as m
from kvrewrite.kernels.gemv_rms_norm import error_bound, reference_f64

OP = torch.ops.kvrewrite.gemv_rms_norm.default


def _inputs(K=48, N=40, dtype=torch.bfloat16, residual=True, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, K, generator=g).to(dtype)
    r = torch.randn(1, 1, K, generator=g).to(dtype) if residual else None
    nw = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, r, nw, w, b


def _hf_norm(unit_offset, nw, eps):
    """transformers' own RMSNorm module of that spelling, with norm weight nw."""
    if unit_offset:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm as Norm
    else:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as Norm
    norm = Norm(nw.shape[0], eps=eps).to(nw.dtype)
    with torch.no_grad():
        norm.weight.copy_(nw)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@torch.no_grad()
def test_cpu_is_hf_rms_norm_then_linear_bit_for_bit(residual, unit_offset, dtype):
    x, r, nw, w, b = _inputs(K=37, N=11, dtype=dtype, residual=residual, bias=unit_offset, seed=3)
    y, h = OP(x, r, nw, 1e-6, w, b, unit_offset=unit_offset)
    h_ref = x if r is None else x + r
    y_ref = F.linear(_hf_norm(unit_offset, nw, 1e-6)(h_ref), w, b)
    assert y.dtype == dtype and y.shape == (1, 1, 11) and y.is_contiguous()
    assert torch.equal(y, y_ref)
    if residual:
        assert torch.equal(h, h_ref) and h.is_contiguous()
    else:
        assert h.shape == (0,) and h.dtype == dtype


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_opcheck(residual, unit_offset):
    x, r, nw, w, b = _inputs(residual=residual, bias=True)
    torch.library.opcheck(OP, (x, r, nw, 1e-5, w, b), {"unit_offset": unit_offset})


def test_fake_gives_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, nw, w = torch.empty(1, 1, 32), torch.empty(32), torch.empty(24, 32)
        y, h = OP(x, torch.empty(1, 1, 32), nw, 1e-6, w)
        y0, h0 = OP(x, None, nw, 1e-6, w)
    assert (y.shape, h.shape, y0.shape, h0.shape) == ((1, 1, 24), (1, 1, 32), (1, 1, 24), (0,))


@pytest.mark.parametrize("change, match", [
    (dict(x=(2, 32)), r"x must hold one row of K=32 values .*got shape \(2, 32\)"),
    (dict(w=(24, 31)), r"x must be \[\.\.\., K=31\]"),
    (dict(r=(1, 31)), r"residual must be x's shape \(1, 32\) and dtype torch.float32, got \(1, 31\)"),
    (dict(nw=(31,)), r"norm_weight must be \[K\] = \(32,\) in x's dtype torch.float32, got \(31,\)"),
    (dict(b=(23,)), r"bias must be \[N\] = \(24,\), got \(23,\)"),
    (dict(x=(1, 0), w=(24, 0), r=(1, 0), nw=(0,)), r"K must be >= 1"),
])
def test_bad_shapes_are_named(change, match):
    shapes = dict(dict(x=(1, 32), r=(1, 32), nw=(32,), w=(24, 32), b=None), **change)
    t = {k: None if v is None else torch.randn(*v) for k, v in shapes.items()}
    with pytest.raises(ValueError, match=match):
        OP(t["x"], t["r"], t["nw"], 1e-6, t["w"], t["b"])


def test_mixed_dtypes_are_named():
    x, r, nw, w, _ = _inputs(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"residual must be .* dtype torch.bfloat16, got \(1, 1, 48\) torch.float32"):
        OP(x, r.float(), nw, 1e-6, w)
    with pytest.raises(ValueError, match=r"norm_weight must be \[K\] = \(48,\) in x's dtype torch.bfloat16, got "
                                         r"\(48,\) torch.float32"):
        OP(x, r, nw.float(), 1e-6, w)
    with pytest.raises(TypeError, match=r"share one dtype"):
        OP(x, r, nw, 1e-6, w.float())


@pytest.mark.parametrize("unit_offset", [False, True])
def test_error_bound_holds_for_the_cpu_op_and_not_for_a_wrong_norm(unit_offset):
    """The bound the kernel tests use: the CPU op (eager's roundings) is within it; the product of a norm that
    skips the norm weight's offset, or uses another eps on tiny inputs, is far outside."""
    x, r, nw, w, b = _inputs(K=300, N=64, dtype=torch.bfloat16, seed=1)
    y64, h, n64 = reference_f64(x, r, nw, 1e-6, w, b, unit_offset)
    assert torch.equal(h, x + r)
    bound = error_bound(x, w, n64, y64)
    y, _ = OP(x, r, nw, 1e-6, w, b, unit_offset=unit_offset)
    assert ((y.double() - y64).abs() / bound).max() <= 1
    wrong, _ = OP(x, r, nw, 1e-6, w, b, unit_offset=not unit_offset)
    assert ((wrong.double() - y64).abs() / bound).max() > 10
    tiny = (x * 1e-3, r * 1e-3)
    y64, _, n64 = reference_f64(*tiny, nw, 1e-6, w, b, unit_offset)
    wrong, _ = OP(*tiny, nw, 1e-4, w, b, unit_offset=unit_offset)
    assert ((wrong.double() - y64).abs() / error_bound(tiny[0], w, n64, y64)).max() > 10


@pytest.mark.skipif(m.triton is None, reason="launch_config sizes Triton tiles")
def test_preload_on_the_split_form_is_refused():
    """From SPLIT_NORM_MIN_N rows on the op splits its norm, which has no prologue to preload for: a fused-kernel
    tuning there is an error naming the way out, not a silent time of the other form."""
    N = m.SPLIT_NORM_MIN_N
    with pytest.raises(ValueError, match=r"preload=True tunes the fused kernel.*pass split_norm=False"):
        m.launch_config(N, 4096, preload=True)
    assert m.launch_config(N, 4096, preload=True, split_norm=False)["preload"] is True
    assert m.launch_config(N, 4096)["split_norm"] and not m.launch_config(N - 1, 4096)["split_norm"]


def test_norm_row_tiles_hold_rows_up_to_the_register_limit():
    """The split norm's kernel holds a row of up to NORM_REGISTER_ELEMENTS in registers (a warp per 1024 elements,
    at least NORM_WARPS) and loops over longer ones; norm_row_tiles tunes only that kernel."""
    pytest.importorskip("triton")
    N = m.SPLIT_NORM_MIN_N
    cfg = m.launch_config(N, 4096)
    assert (cfg["norm_row_tiles"] * cfg["block_k"], cfg["norm_warps"]) == (4096, m.NORM_WARPS)
    cfg = m.launch_config(N, 8192)
    assert (cfg["norm_row_tiles"] * cfg["block_k"], cfg["norm_warps"]) == (8192, 8)
    assert m.launch_config(N, 16384)["norm_row_tiles"] == 0
    with pytest.raises(ValueError, match="norm_row_tiles tunes the split norm's kernel"):
        m.launch_config(N - 1, 4096, norm_row_tiles=0)
