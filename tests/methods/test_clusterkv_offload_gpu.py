"""ClusterKV's offload="cpu" on a GPU: the clustered layers' keys and values live in pinned host memory that the
kernels read in place (kvrewrite/offload.py), and nothing else changes: the same logits and tokens as without it
(batch 2 with left padding, window clusterings during the generation), eager, under CUDA graphs and under
torch.compile(mode="reduce-overhead"); the state's GPU memory is lower by exactly the host part."""
import pytest
import torch

import kvrewrite
from kvrewrite.offload import host_alias, is_host_memory
from tests.families import tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHUNK = 8
SMALL = dict(n_sink=2, interval=4, tokens_per_cluster=4, window_clusters=2, iters=3, dense_layers=1, budget=10)
STEPS = 14  # three window clusterings (every 4 tokens)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama").cuda()


@pytest.fixture(scope="module")
def captured(llama):
    from kvrewrite.capture import capture

    return capture(llama, batch_size=2, prefill_chunk=CHUNK)


def _apply(llama, captured, **kw):
    return kvrewrite.apply(llama, "clusterkv", max_length=64, batch_size=2, prefill_chunk=CHUNK, captured=captured,
                           **SMALL, **kw)


def _prompt():
    ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def _generate(rw, steps=STEPS):
    """Greedy prefill + decode; logits of every step [2, steps + 1, V]."""
    ids, mask = _prompt()
    logits = [rw.prefill(ids, mask, max_new_tokens=steps + 1).clone()]  # a CUDA-graph output is reused
    for _ in range(steps):
        logits.append(rw.decode_step(logits[-1].argmax(-1)).clone())
    return torch.stack(logits, 1)


def test_host_alias_is_host_memory_that_kernels_read_and_write():
    a = host_alias((3, 5, 16), torch.bfloat16, "cuda")
    assert a.device.type == "cuda" and is_host_memory(a) and bool((a == 0).all())
    src = torch.randn(3, 5, 16, device="cuda", dtype=torch.bfloat16)
    a.copy_(src)
    a[1, 2] += 1
    want = src.clone()
    want[1, 2] += 1
    assert torch.equal(a, want) and torch.equal(a.index_select(1, torch.tensor([4, 0], device="cuda")), want[:, [4, 0]])
    a.zero_()
    assert not a.any()
    assert not is_host_memory(src)


def test_offload_gives_the_same_logits_and_keeps_keys_and_values_on_the_host(llama, captured):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    plain = _apply(llama, captured)
    plain_bytes = torch.cuda.memory_allocated() - before
    before = torch.cuda.memory_allocated()
    off = _apply(llama, captured, offload="cpu")
    off_bytes = torch.cuda.memory_allocated() - before
    mem, pmem = off.cache_bytes(), plain.cache_bytes()
    kv = off.l1_keys.numel() * off.l1_keys.element_size()
    assert mem["host"] == 2 * kv and pmem["host"] == 0 and mem["kvrewrite"] == pmem["kvrewrite"]
    assert mem["device"] == pmem["device"] - mem["host"]
    assert abs((plain_bytes - off_bytes) - mem["host"]) <= 2 * 512  # the allocator rounds blocks to 512 bytes
    assert is_host_memory(off.l1_keys) and is_host_memory(off.l1_values)
    assert not any(is_host_memory(getattr(off, f"l1_{f}")) for f in ("bias", "slot_pos", "centroids", "members"))
    assert not is_host_memory(off.l0_keys) and not is_host_memory(plain.l1_keys)  # dense layer 0; no offload
    want, got = _generate(plain), _generate(off)
    assert torch.equal(got, want)
    assert int(off.l1_n_clusters.min()) > 0 and torch.equal(off.l1_members, plain.l1_members)
    assert torch.equal(off.l1_keys, plain.l1_keys) and torch.equal(off.l1_values, plain.l1_values)
    again = _generate(off)  # a second generation resets the host state in place
    assert torch.equal(again, want)


def test_offload_under_cuda_graphs(llama, captured):
    """The bench's decode loop (kvrewrite.bench.e2e.KVDecoder, mode graph): both decode variants captured in
    torch.cuda.CUDAGraph and replayed; the offloaded run feeds back the same tokens."""
    from kvrewrite.bench.e2e import KVDecoder

    toks = {}
    for name, kw in (("plain", {}), ("offload", {"offload": "cpu"})):
        rw = _apply(llama, captured, **kw)
        ids, mask = _prompt()
        rw.prefill(ids, mask, max_new_tokens=40)
        torch.manual_seed(0)
        dec = KVDecoder(rw, "graph")
        dec.warm_up(12)
        assert set(dec.graphs) == {False, True}
        seq = []
        for _ in range(12):  # three clusterings replayed from the graph
            dec.step()
            seq.append(dec.tok.clone())
        toks[name] = torch.cat(seq, 1)
    assert torch.equal(toks["offload"], toks["plain"])


def test_offload_under_torch_compile_reduce_overhead(llama, captured):
    plain = _apply(llama, captured)
    want = _generate(plain)
    off = _apply(llama, captured, offload="cpu")
    keys_ptr = off.l1_keys.data_ptr()
    off.compile(fullgraph=True, mode="reduce-overhead")
    got = _generate(off)
    assert off.l1_keys.data_ptr() == keys_ptr and is_host_memory(off.l1_keys)
    torch.testing.assert_close(off.l1_keys, plain.l1_keys, atol=1e-4, rtol=1e-4)  # written in place, not to a copy
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # Inductor fuses the dense ops: rounding differs
    assert torch.equal(got.argmax(-1), want.argmax(-1))
