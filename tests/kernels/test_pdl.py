"""kernels/_pdl.py and rw.compile's opaque ops on the CPU: when PDL applies, the switch, and that the compiled call
sets only its one config and restores it (after a call and after a failing one). The launches: test_pdl_gpu.py."""
import pytest
import torch
import torch._functorch.config
import torch._inductor.config

from kvrewrite.kernels import _pdl
from kvrewrite.runtime import _OpaqueOpsCall


def test_no_pdl_off_cuda_or_when_switched_off():
    assert _pdl.launch_options(torch.zeros(1)) == (False, {})
    assert _pdl.enabled()
    _pdl.set_enabled(False)
    try:
        assert not _pdl.enabled()
        assert _pdl.launch_options(torch.zeros(1)) == (False, {})
    finally:
        _pdl.set_enabled(True)
    assert _pdl.enabled()


def _configs():
    return torch._functorch.config.decompose_custom_triton_ops, torch._inductor.config.triton.enable_pdl


@pytest.mark.parametrize("pdl", [True, False])
def test_opaque_call_keeps_the_ops_whole_and_restores_the_config(pdl):
    """Only decompose_custom_triton_ops is set, for the call; Inductor's own PDL switch is left as it was
    (runtime.py _OpaqueOpsCall says why), whatever kernels/_pdl.py says."""
    before = _configs()
    seen = []
    call = _OpaqueOpsCall(lambda x: seen.append(_configs()) or x + 1)
    _pdl.set_enabled(pdl)
    try:
        assert call(1) == 2
    finally:
        _pdl.set_enabled(True)
    assert seen == [(False, before[1])]
    assert _configs() == before

    def fail(x):
        raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError, match="compile failed"):
        _OpaqueOpsCall(fail)(1)
    assert _configs() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_benchmark_refuses_a_machine_without_cuda(tmp_path):
    from kvrewrite.bench import pdl as bench

    with pytest.raises(SystemExit, match="measures a CUDA device; none is available"):
        bench.main(["--out", str(tmp_path / "pdl.json")])
    assert not (tmp_path / "pdl.json").exists()


def test_compile_defaults_sit_under_the_callers_options():
    """rw.compile's Inductor defaults (runtime.COMPILE_INDUCTOR_DEFAULTS, on CUDA) are patched in around a batch-1
    decode step's call, so Inductor compiles it with them; torch.compile(options=...) still overrides them, other
    shapes compile without them, and the config is restored."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from kvrewrite.runtime import COMPILE_INDUCTOR_DEFAULTS

    assert COMPILE_INDUCTOR_DEFAULTS == {"combo_kernels": True}
    seen = []

    class Record(CustomGraphPass):
        def __call__(self, graph):
            seen.append(torch._inductor.config.combo_kernels)

        def uuid(self):
            return None  # not cacheable: Inductor compiles every time

    before = torch._inductor.config.combo_kernels
    overridden = torch.compile(lambda x: x.sin() + 1, options={"combo_kernels": False,
                                                               "post_grad_custom_post_pass": Record()})
    defaulted = torch.compile(lambda x: x.cos() + 1, options={"post_grad_custom_post_pass": Record()})
    decode = torch.ones(1, 1)  # input_ids of a batch-1 decode step; other shapes compile without the defaults
    _OpaqueOpsCall(overridden, COMPILE_INDUCTOR_DEFAULTS)(decode)
    _OpaqueOpsCall(defaulted, COMPILE_INDUCTOR_DEFAULTS)(decode)
    _OpaqueOpsCall(defaulted, COMPILE_INDUCTOR_DEFAULTS)(torch.ones(2, 1))  # a recompile: batch 2
    _OpaqueOpsCall(defaulted, COMPILE_INDUCTOR_DEFAULTS)(torch.ones(1, 64))  # a prefill chunk
    assert seen[:2] == [False, True] and seen[2:] == [before] * (len(seen) - 2) and len(seen) >= 3
    assert torch._inductor.config.combo_kernels == before


@pytest.mark.skipif(_pdl.gdc_wait is None, reason="needs Triton's CUDA extras (gdc_wait) to offer PDL at all")
def test_a_custom_ops_own_launch_says_direct(monkeypatch):
    """In a torch.library.custom_op's body wrap_triton's state reads "traced", so launch_options without direct=True
    gives no PDL there (every tp_all_reduce kernel of stop 44 launched so); direct=True, what a custom op that launches
    its kernel itself passes, gives it. A stand-in for a CUDA tensor on a PDL-capable device."""
    import types

    monkeypatch.setattr(_pdl, "_device_supports", lambda index: True)
    t = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    seen = []

    @torch.library.custom_op("kvrewrite_test::pdl_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append((_pdl.launch_options(t), _pdl.launch_options(t, direct=True)))
        return x.clone()

    probe(torch.zeros(1))
    assert seen == [((False, {}), (True, {"launch_pdl": True}))]


def test_opaque_call_runs_a_triton_op_body_on_real_tensors():
    """Under the opaque call (rw.compile) Inductor keeps a torch.library.triton_op whole and calls it at run time, so
    its body sees real tensors there (fake ones only while the graph is traced): what lets the ordered prefill kernel
    build its TMA descriptors under rw.compile (_ordered_prefill_kernels.tma_refusal). Without the call the body is
    traced into the graph and never runs on real tensors."""
    from torch._subclasses.fake_tensor import is_fake

    seen = []

    @torch.library.triton_op("kvrewrite_test::real_or_fake", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(is_fake(x))
        return x * 2

    def step(x):
        return probe(x) + 1

    x = torch.arange(4.0)
    torch._dynamo.reset()
    assert torch.equal(_OpaqueOpsCall(torch.compile(step, fullgraph=True))(x), x * 2 + 1)
    assert seen and seen[-1] is False, seen
    torch._dynamo.reset()
    seen.clear()
    assert torch.equal(torch.compile(step, fullgraph=True)(x), x * 2 + 1)
    assert seen and all(seen), seen
