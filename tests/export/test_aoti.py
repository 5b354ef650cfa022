"""AOTInductor target: compiled packages + the loader reproduce rw.generate.

CPU (C++ packages): one tiny llama with chelsea settings that compress in prefill and on decode steps,
all three graphs compiled once (the module fixture; about 60-100 s on the 2-core CI, most of it
Inductor's C++ compile). GPU (marked gpu): the same on CUDA, where the package holds Inductor's Triton
kernels and kvrewrite::clustered_attention's own Triton kernel; plus torch_export on CUDA.
"""
import functools
import subprocess
import sys
import zipfile

import pytest
import torch

import kvrewrite
import kvrewrite.export
from kvrewrite.export import loader
from tests.families import tiny_model

PROMPT, NEW = 24, 12
CHELSEA = dict(budget=0.5, n_sink=2, n_recent=4, chunk=8, interval=4)


def _inputs(device="cpu"):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids.to(device), mask.to(device)


def _rw(device, **kw):
    m = tiny_model("llama").to(device)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return kvrewrite.apply(m, "chelsea", max_length=40, batch_size=2, prefill_chunk=16, **(CHELSEA | kw))


_PROBE = """
import sys, torch
class M(torch.nn.Module):
    def forward(self, x):
        return x.sin() + 1
path = sys.argv[1]
if sys.argv[2] == "compile":
    ep = torch.export.export(M().cuda(), (torch.randn(8, device="cuda"),))
    torch._inductor.aoti_compile_and_package(ep, package_path=path)
else:
    x = torch.randn(8, device="cuda")
    out = torch._inductor.aoti_load_package(path)(x)
    assert torch.allclose(out[0] if isinstance(out, (list, tuple)) else out, x.sin() + 1)
"""


@functools.cache
def _plain_cuda_aoti_fault(tmp: str) -> str | None:
    """Why this machine cannot load ANY CUDA AOTInductor package (a two-line x.sin() + 1 module compiled and loaded
    in child processes, without kvrewrite), or None when it can. The H200 device machine's aoti_load_package died
    with SIGSEGV on such a package in every session since 2026-11-24 (docs/deploy.md): the CUDA aoti tests then skip
    naming that, where a crash took the pytest worker down with them."""
    path = f"{tmp}/plain.pt2"
    for step in ("compile", "load"):
        try:
            r = subprocess.run([sys.executable, "-c", _PROBE, path, step], capture_output=True, text=True,
                               timeout=300)
        except subprocess.TimeoutExpired:
            return f"a plain CUDA AOTInductor package (x.sin() + 1) did not {step} in 300 s on this machine"
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
            return (f"a plain CUDA AOTInductor package (x.sin() + 1, no kvrewrite) fails to {step} on this machine "
                    f"(exit code {r.returncode}; torch {torch.__version__}, CUDA {torch.version.cuda}): {tail}")
    return None


def _skip_unless_cuda_aoti_loads(target, tmp_path_factory):
    if target == "aoti" and (fault := _plain_cuda_aoti_fault(str(tmp_path_factory.getbasetemp()))):
        pytest.skip(fault)


def _check_generate(rw, path, device):
    m = loader.load(path)
    ids, mask = _inputs(device)
    ref = rw.generate(ids, mask, max_new_tokens=NEW)
    out = m.generate(ids, mask, max_new_tokens=NEW)
    assert torch.equal(out, ref), f"loader\n{out[:, PROMPT:]}\n!= rw.generate\n{ref[:, PROMPT:]}"
    for name in ("fill", "slot_pos"):  # the same compressions ran, row by row
        i = ("keys", "values", "bias", "slot_pos", "fill", "budget").index(name)
        assert torch.equal(m.state[i], getattr(rw, f"l0_{name}"))
    # the logits of a fresh prefill: compiled kernels vs eager, rounding only
    a, b = rw.prefill(ids, mask, max_new_tokens=NEW), m.prefill(ids, mask, max_new_tokens=NEW)
    diff = (a - b).abs().max().item()
    assert diff <= 1e-4, f"prefill logits differ by {diff:.3g}"
    return diff


def _step_matches_eager(rw, step, args):
    """One compiled decode_compress step against the eager graph from copies of rw's state: logits within 1e-4, every
    integer state field equal, floats within 1e-5. Returns (the state's names, the eager state after the step)."""
    from kvrewrite.export.common import graph_of

    eager = [t.clone() for t in rw.state_tensors()]
    compiled = [t.clone() for t in rw.state_tensors()]
    want = graph_of(rw, "decode_compress")(*args, *eager)
    got = step(*args, compiled)
    assert (got - want).abs().max().item() <= 1e-4
    names = [f"l{info.index}_{f}" for k, info in enumerate(rw.layers) for f in rw.layer_fields(k)]
    for name, a, b in zip(names, compiled, eager):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
        else:
            assert torch.equal(a, b), name
    return names, eager


@torch.no_grad()
def test_aoti_cpu_generate_matches_eager(tmp_path):
    rw = _rw("cpu")
    path = kvrewrite.export.aoti(rw, tmp_path)
    assert sorted(p.name for p in path.glob("*.pt2")) == ["decode.pt2", "decode_compress.pt2", "prefill.pt2"]
    print(f"aoti cpu: prefill logits max diff {_check_generate(rw, path, 'cpu'):.3g}")


def test_outlier_heads_reach_the_op_as_a_mask():
    from kvrewrite.export.aot_inductor import _mask_outlier_lists

    rw = _rw("cpu", budget=0.6, outlier_heads={1: [1]})
    gm = _mask_outlier_lists(rw.decode_compress_graph)
    masks = [n.args[-1] for n in gm.graph.nodes if n.op == "call_function"
             and n.target == torch.ops.kvrewrite_export.chelsea_compress_masked.default]
    assert masks == [0, 2], masks  # layer 0: none, layer 1: KV head 1
    assert not [n for n in gm.graph.nodes if n.target == torch.ops.kvrewrite.chelsea_compress.default]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("target", ["aoti", "torch_export"])
@torch.no_grad()
def test_cuda_generate_matches_eager(tmp_path, tmp_path_factory, target):
    _skip_unless_cuda_aoti_loads(target, tmp_path_factory)
    rw = _rw("cuda")
    path = getattr(kvrewrite.export, target)(rw, tmp_path)
    diff = _check_generate(rw, path, "cuda")
    print(f"{target} cuda: prefill logits max diff {diff:.3g}")
    if target == "aoti":  # the attention's own Triton kernel is compiled into the package
        with zipfile.ZipFile(path / "decode.pt2") as z:
            text = b"".join(z.read(n) for n in z.namelist() if n.endswith((".cpp", ".json", ".py")))
            names = z.namelist()
        assert any(n.endswith(".cubin") for n in names), names
        assert b"clustered_attention_fwd_kernel" in text, "the clustered attention Triton kernel is not in the package"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("target", ["aoti", "torch_export"])
@torch.no_grad()
def test_cuda_kvmerger_generate_matches_eager(tmp_path, tmp_path_factory, target):
    """KVMerger on CUDA (its Triton kernels behind the proxy executor / the exported op): the three programs
    reproduce rw.generate with re-merges every 4 decode steps."""
    _skip_unless_cuda_aoti_loads(target, tmp_path_factory)
    m = tiny_model("llama").cuda()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    rw = kvrewrite.apply(m, "kvmerger", max_length=40, batch_size=2, prefill_chunk=16, budget=12, interval=4)
    path = getattr(kvrewrite.export, target)(rw, tmp_path)
    print(f"kvmerger {target} cuda: prefill logits max diff {_check_generate(rw, path, 'cuda'):.3g}")


@torch.no_grad()
def test_aoti_cpu_clusterkv_step_matches_eager(tmp_path):
    """ClusterKV's decode step with compression compiled alone (one package: ~20 s of C++ compile, not three): on a
    state three decode steps past the prompt, where this step's window clustering is due, the package computes the
    eager graph's logits (1e-4) and the same index (every integer field equal, centroids within 1e-5): kmeans_cluster
    (six mutated index fields, keyword-only ints), select_clusters and indexed_attention through the proxy executor.
    The whole generation from three packages was checked by hand (docs/deploy.md)."""
    from kvrewrite.export.common import example_inputs

    m = tiny_model("llama")
    m.generation_config.eos_token_id = None
    rw = kvrewrite.apply(m, "clusterkv", max_length=40, batch_size=2, prefill_chunk=16, budget=10, n_sink=2,
                         interval=4, tokens_per_cluster=4, window_clusters=2, iters=4, dense_layers=1)
    path = kvrewrite.export.aoti(rw, tmp_path, graphs=("decode_compress",))
    step = loader.load(path).steps["decode_compress"]
    ids, mask = _inputs()
    logits = rw.prefill(ids, mask, max_new_tokens=NEW)
    for _ in range(3):
        logits = rw.decode_step(logits.argmax(-1))
    args = list(example_inputs(rw, "decode_compress"))[:4]
    args[0] = logits.argmax(-1)[:, None]
    args[1], args[2] = args[1] + PROMPT + 3, args[2] + 32 + 3  # 24 tokens in two chunks of 16, then 3 steps
    names, eager = _step_matches_eager(rw, step, args)
    n_clusters = rw.layer_state(1)["n_clusters"]
    assert bool((eager[names.index("l1_n_clusters")] > n_clusters).all()), "the window clustering did not run"


@torch.no_grad()
def test_aoti_cpu_kvmerger_step_matches_eager(tmp_path):
    """KVMerger's decode step with compression compiled alone (one package, as ClusterKV's): on the state one decode
    step past the prompt, where this step's re-merge is due, the package computes the eager graph's logits (1e-4)
    and the same state (every integer field, degree and deficit included, equal; keys, values, scores within 1e-5):
    kvmerger_compress (eight mutated fields, float and str keyword options) through the proxy executor."""
    m = tiny_model("llama")
    m.generation_config.eos_token_id = None
    rw = kvrewrite.apply(m, "kvmerger", max_length=40, batch_size=2, prefill_chunk=16, budget=8, interval=2, n_sink=1,
                         values="bias", sigma_mode="distance")
    path = kvrewrite.export.aoti(rw, tmp_path, graphs=("decode_compress",))
    step = loader.load(path).steps["decode_compress"]
    ids, mask = _inputs()
    logits = rw.prefill(ids, mask, max_new_tokens=NEW)
    logits = rw.decode_step(logits.argmax(-1))
    assert rw.schedule.due(1), "the next step does not re-merge"
    args = [logits.argmax(-1)[:, None], rw._next_position[:, None], rw._next_cache_position,
            torch.ones(2, 1, dtype=torch.bool)]
    names, eager = _step_matches_eager(rw, step, args)
    fill = names.index("l0_fill")
    assert bool((eager[fill] < rw.state_tensors()[fill] + 1).all()), "the re-merge did not run"
