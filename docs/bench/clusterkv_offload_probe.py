"""The probe behind docs/bench/clusterkv_offload_h100_probe.json (kvrewrite/offload.py on a GPU): a Triton kernel
reads and writes through host_alias inside a CUDA graph replay (exact values), and the cost of ClusterKV's ops
reading keys/values through the host alias vs device memory, one Llama-3.1-8B layer (Hkv 8, Hq 32, D 128, bf16,
34k slots, 32k filled): zero-copy sequential read, bulk host-to-device copy, zero_, the decode gather
(indexed_attention, 1344 rows per list, per query head and per KV head), a 1024-query prefill chunk
(clustered_attention). Run: PYTHONPATH=. OUT=<dir> python docs/bench/clusterkv_offload_probe.py"""
import json
import os
import time

import torch
import triton
import triton.language as tl

import kvrewrite.kernels  # noqa: F401
from kvrewrite.offload import host_alias, is_host_memory

out = {}


@triton.jit
def _scale_copy(src, dst, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(src + i, mask=m)
    tl.store(dst + i, x * 2 + 1, mask=m)


# 1. Triton reads and writes through the alias inside a CUDA graph replay
n = 1 << 20
a = host_alias((n,), torch.float32, "cuda")
b = host_alias((n,), torch.float32, "cuda")
torch.cuda.synchronize()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    _scale_copy[(triton.cdiv(n, 1024),)](a, b, n, BLOCK=1024)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    _scale_copy[(triton.cdiv(n, 1024),)](a, b, n, BLOCK=1024)
ok = []
for seed in range(3):
    ref = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    a.copy_(ref.cuda())
    g.replay()
    torch.cuda.synchronize()
    ok.append(bool(torch.equal(b.cpu(), ref * 2 + 1)))
out["triton_graph_exact"] = ok
out["alias_is_host"] = is_host_memory(a)
out["alias_ptr_eq_registered"] = a.data_ptr()
print("triton in graph:", ok, flush=True)


def timeit(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        t.append(e0.elapsed_time(e1))
    t.sort()
    return t[len(t) // 2]


# 2. one Llama-3.1-8B layer at 32k: Hkv 8, Hq 32, D 128, bf16
B, Hkv, Hq, D, C = 1, 8, 32, 128, 34 * 1024
dt = torch.bfloat16
kd = torch.randn(B, Hkv, C, D, device="cuda", dtype=dt)
vd = torch.randn(B, Hkv, C, D, device="cuda", dtype=dt)
kh, vh = host_alias(kd.shape, dt, "cuda"), host_alias(vd.shape, dt, "cuda")
kh.copy_(kd)
vh.copy_(vd)
fill = 32 * 1024
bias = torch.full((B, Hkv, C), float("-inf"), device="cuda")
bias[..., :fill] = 0
slot_pos = torch.arange(C, device="cuda").expand(B, Hkv, C).contiguous()
nbytes = kd.numel() * 2
res = {}
res["seq_read_GBps_alias"] = nbytes / timeit(lambda: kh.sum(dtype=torch.float32)) / 1e6
res["seq_read_GBps_device"] = nbytes / timeit(lambda: kd.sum(dtype=torch.float32)) / 1e6
res["zero_ms_alias_one_tensor"] = timeit(lambda: kh.zero_(), 3)
kh.copy_(kd)
scratch = torch.empty_like(kd)
res["h2d_copy_GBps_alias_to_device"] = nbytes / timeit(lambda: scratch.copy_(kh)) / 1e6
# decode: S = 16 sinks + 1008 selected + 320 window per query head (select_per="query_head")
S = 1344
g = torch.Generator(device="cuda").manual_seed(0)
idx_q = torch.stack([torch.randperm(fill, generator=g, device="cuda")[:S].sort().values for _ in range(Hq)])[None].int()
idx_kv = idx_q[:, ::4].contiguous()
q1 = torch.randn(B, Hq, 1, D, device="cuda", dtype=dt)
for name, idx in (("query_head", idx_q), ("kv_head", idx_kv)):
    for where, (k, v) in (("device", (kd, vd)), ("alias", (kh, vh))):
        o = torch.ops.kvrewrite.indexed_attention(q1, k, v, bias, idx, D ** -0.5)
        res[f"indexed_{name}_{where}_ms"] = timeit(lambda: torch.ops.kvrewrite.indexed_attention(q1, k, v, bias, idx,
                                                                                                    D ** -0.5))
        res[f"indexed_{name}_{where}_out"] = o.float().sum().item()
# prefill chunk: 1024 queries at positions fill-1024 .. fill-1 over the keys so far
T = 1024
qp = torch.randn(B, Hq, T, D, device="cuda", dtype=dt)
cpos = torch.arange(fill - T, fill, device="cuda")
for where, (k, v) in (("device", (kd, vd)), ("alias", (kh, vh))):
    res[f"prefill_chunk_{where}_ms"] = timeit(lambda: torch.ops.kvrewrite.clustered_attention(
        qp, k, v, bias, slot_pos, cpos, D ** -0.5, 0, False, 0.0), 3)
# decode dense (clustered_attention T=1) over the alias, for reference: what a dense layer would cost on the host
q1c = q1
res["dense_decode_alias_ms"] = timeit(lambda: torch.ops.kvrewrite.clustered_attention(
    q1c, kh, vh, bias, slot_pos, cpos[-1:], D ** -0.5, 0, True, 0.0), 3)
res["dense_decode_device_ms"] = timeit(lambda: torch.ops.kvrewrite.clustered_attention(
    q1c, kd, vd, bias, slot_pos, cpos[-1:], D ** -0.5, 0, True, 0.0), 5)
t0 = time.perf_counter()
big = host_alias((B, Hkv, C, D), dt, "cuda")
torch.cuda.synchronize()
res["host_alias_alloc_s_one_layer_tensor"] = time.perf_counter() - t0
del big
out["layer"] = res
for k, v in res.items():
    print(f"{k}: {v}", flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w") as f:
    json.dump(out, f, indent=1)
