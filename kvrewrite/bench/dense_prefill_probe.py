"""A probe, not a kernel of the library: how fast can a plain dense-causal Triton kernel run a prefill chunk whose
slots are every token in position order (ClusterKV's and `full`'s chunks), against our prefill kernel and cuDNN?

Our prefill kernel (kvrewrite/kernels/_prefill_attention_kernels.py) serves slots in any order: per-slot positions,
tile ranges, 64-row query tiles that pack the GQA group. At ClusterKV's dense 2048-query chunk it runs at 0.68x cuDNN's
rate (docs/bench.md, "Stop 58 runs"), and neither its tiles, nor skipping its range bookkeeping (WHOLE_RUN), nor TMA
loads in it moved that ("Stop 59 runs"). The probe kernel below is the textbook form instead: one query head a program
(128 or 64 queries), K/V tiles of the KV head through TMA descriptors (host- or device-side) or pointers, the tiles
below the block's first query without a mask, the diagonal ones masked by slot index, the bias added per tile (left
padding's -inf).
What it shows is the headroom a dense, in-order kernel of our own would have; what it leaves out is everything such a
kernel would need in the library: the slot of the chunk's first query from the device (the fill), the soft cap, the
window, fp32, and a launch that torch.compile / torch.export can trace: wrap_triton outside Dynamo has no metadata for
a host-side TensorDescriptor argument (KeyError in get_tensor_names, torch 2.11), and the device-side form failed in
Inductor's compile of the kernel (compile_check below reproduces it), so pointer loads there for now.

Run (GPU): python -m kvrewrite.bench.dense_prefill_probe --batch 8 --out probe.json
Each variant's output is checked against the fp32 reference on row 0 (the run fails above attention_prefill's bound);
the three fastest are timed again interleaved with ours; then compile_check. Results: docs/bench.md, "Stop 59 runs".
"""
import argparse
import json
import time

import torch

from kvrewrite.bench.attention import _bench_ms, env_info
from kvrewrite.bench.attention_prefill import CASES, D, HQ, MAX_ERR_BF16, make_inputs, sdpa_ms
from kvrewrite.kernels import clustered_attention as ca

try:
    import triton
    import triton.language as tl
except ImportError:  # the probe needs a GPU with Triton; importing it elsewhere only defines nothing to launch
    triton = tl = None

LOG2E = 1.4426950408889634  # (the kernels spell it out: a Triton kernel reads no plain global)
# (block_m, block_n, warps, stages, loads): every shape that compiled in the first probe, each load form: 0 pointers,
# 1 host-side TMA descriptors (kernel arguments), 2 device-side ones (tl.make_tensor_descriptor, global scratch memory
# from triton.set_allocator)
VARIANTS = [(m, n, w, s, tma) for tma in (0, 1, 2) for m, n, w, s in (
    (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
    (64, 128, 4, 3), (128, 64, 4, 2))]


if triton is not None:
    @triton.jit
    def _probe_tile(m_i, l_i, acc, q, j, desc_k, desc_v, K, V, kv_row0, bias_ptr, q_slot, qk_scale,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr, MASK: tl.constexpr):
        start = j * BLOCK_N
        offs_n = start + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        if TMA > 0:
            k = desc_k.load([kv_row0 + start, 0])
        else:
            k = tl.load(K + (kv_row0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale + (tl.load(bias_ptr + offs_n) * 1.4426950408889634)[None, :]
        if MASK:
            s = tl.where(offs_n[None, :] <= q_slot[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA > 0:
            v = desc_v.load([kv_row0 + start, 0])
        else:
            v = tl.load(V + (kv_row0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return m_new, l_i, acc

    @triton.jit
    def _probe_kernel(Q, K, V, BIAS, OUT, desc_k, desc_v, ROWS, Hq, Hkv, T, C, n0, qk_scale, HEAD_DIM: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
        """Query block pid_m of head (b, hq): queries in slots n0 + [0, T) of contiguous [B, Hkv, C, D] keys/values,
        each seeing the slots up to its own; q and out contiguous [B, Hq, T, D]; bias fp32 [B, Hkv, C]. desc_k/desc_v:
        TMA 1 host descriptors, else unused; ROWS = B * Hkv * C (TMA 2 builds the descriptors over K and V)."""
        pid_m = tl.program_id(0)
        bhq = tl.program_id(1)
        b = bhq // Hq
        h = (bhq % Hq) // (Hq // Hkv)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        m_ok = offs_m < T
        rows = (bhq.to(tl.int64) * T + offs_m)[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(Q + rows, mask=m_ok[:, None], other=0.0)
        kv_row0 = (b * Hkv + h) * C
        if TMA == 2:
            dk = tl.make_tensor_descriptor(K, shape=[ROWS, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
            dv = tl.make_tensor_descriptor(V, shape=[ROWS, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        else:
            dk = desc_k
            dv = desc_v
        bias_ptr = BIAS + (b * Hkv + h).to(tl.int64) * C
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        n_full = (pid_m * BLOCK_M + n0) // BLOCK_N  # tiles every query of the block sees whole
        n_end = tl.cdiv(tl.minimum(n0 + (pid_m + 1) * BLOCK_M, n0 + T), BLOCK_N)
        for j in range(0, n_full):
            m_i, l_i, acc = _probe_tile(m_i, l_i, acc, q, j, dk, dv, K, V, kv_row0, bias_ptr, n0 + offs_m,
                                        qk_scale, BLOCK_N, HEAD_DIM, TMA, False)
        for j in range(n_full, n_end):
            m_i, l_i, acc = _probe_tile(m_i, l_i, acc, q, j, dk, dv, K, V, kv_row0, bias_ptr, n0 + offs_m,
                                        qk_scale, BLOCK_N, HEAD_DIM, TMA, True)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(OUT + rows, o.to(OUT.dtype.element_ty), mask=m_ok[:, None])


def probe(q, k, v, bias, n0, block_m, block_n, num_warps, num_stages, tma):
    """The probe kernel's output [B, Hq, T, D] for queries in slots n0 + [0, T)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, Hq, T, Dh = q.shape
    Hkv, C = k.shape[1], k.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    k2, v2 = k.view(B * Hkv * C, Dh), v.view(B * Hkv * C, Dh)
    if tma == 1:
        dk, dv = TensorDescriptor.from_tensor(k2, [block_n, Dh]), TensorDescriptor.from_tensor(v2, [block_n, Dh])
    else:
        dk, dv = k2, v2
    _probe_kernel[(triton.cdiv(T, block_m), B * Hq)](q, k, v, bias, out, dk, dv, B * Hkv * C, Hq, Hkv, T, C, n0,
                                                     Dh ** -0.5 * LOG2E, HEAD_DIM=Dh, BLOCK_M=block_m,
                                                     BLOCK_N=block_n, TMA=tma, num_warps=num_warps,
                                                     num_stages=num_stages)
    return out


def _scratch(size: int, alignment: int, stream):
    """triton.set_allocator's allocator: the global scratch memory device-side descriptors live in."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def compile_check(batch: int = 1) -> dict:
    """Can torch.compile trace a triton_op whose kernel builds device-side descriptors (no host TensorDescriptor
    argument: wrap_triton outside Dynamo has no metadata for one)? The probe's TMA 2 form behind a torch.library
    triton_op, run eagerly and under torch.compile(fullgraph=True): {"ok", "max_diff" or "error"}."""
    from torch.library import triton_op, wrap_triton

    T, n_past, C, start = 256, 1024, 1024 + 256 + 64, 1024
    q, k, v, bias, pos, cp = make_inputs(T, n_past, C, start, batch=batch)

    @triton_op("kvrewrite_probe::dense_device_tma", mutates_args=())
    def dense_device_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        B, Hq, Tq, Dh = q.shape
        Hkv, Cs = k.shape[1], k.shape[2]
        out = torch.empty_like(q)
        wrap_triton(_probe_kernel)[(triton.cdiv(Tq, 128), B * Hq)](
            q, k, v, bias, out, k, v, B * Hkv * Cs, Hq, Hkv, Tq, Cs, n_past, Dh ** -0.5 * LOG2E, HEAD_DIM=Dh,
            BLOCK_M=128, BLOCK_N=64, TMA=2, num_warps=4, num_stages=2)
        return out

    try:
        eager = dense_device_tma(q, k, v, bias)
        compiled = torch.compile(lambda *a: torch.ops.kvrewrite_probe.dense_device_tma(*a) * 1.0, fullgraph=True)
        got = compiled(q, k, v, bias)
        torch.cuda.synchronize()
        return dict(ok=True, max_diff=(got.float() - eager.float()).abs().max().item())
    except Exception as e:  # noqa: BLE001  (the question is whether it traces)
        msg = str(e)
        at = msg.find("CompilationError")
        return dict(ok=False, error=msg[max(at, 0):][:3000])


def run(batch: int, case: str) -> dict:
    T, n_past, C, start = CASES[case]
    if start != n_past:
        raise SystemExit(f"{case!r}: the probe needs slots in position order (slot i holds position i)")
    q, k, v, bias, pos, cp = make_inputs(T, n_past, C, start, batch=batch)
    scale = D ** -0.5
    flops = 4.0 * batch * HQ * T * D * (n_past + (T + 1) / 2)
    ref = ca.reference_clustered_attention(q[:1], k[:1], v[:1], bias[:1], pos[:1], cp, scale, 0).float()  # row 0
    ours = lambda: ca.triton_clustered_attention(q, k, v, bias, pos, cp, scale, 0, False)  # noqa: E731
    res = dict(case=case, batch=batch, gflop=flops / 1e9, sdpa_ms=sdpa_ms(q, k, v, n_past + T), rows=[])
    res["ours"] = dict(ms=_bench_ms(ours), err=(ours()[:1].float() - ref).abs().max().item())
    print(f"ours {res['ours']['ms']:.3f} ms err {res['ours']['err']:.1e} | SDPA {res['sdpa_ms']}", flush=True)
    for cfg in VARIANTS:
        t0 = time.time()
        f = lambda: probe(q, k, v, bias, n_past, *cfg)  # noqa: E731
        try:
            err = (f()[:1].float() - ref).abs().max().item()
            ms = _bench_ms(f)
            row = dict(cfg=cfg, ms=ms, tflops=flops / ms / 1e9, err=err)
        except Exception as e:  # noqa: BLE001  (a shape that does not compile)
            row = dict(cfg=cfg, error=repr(e)[:300])
        row["wall_s"] = time.time() - t0
        res["rows"].append(row)
        print(row, flush=True)
    best = sorted((r for r in res["rows"] if "ms" in r), key=lambda r: r["ms"])[:3]
    res["round2"] = [dict(cfg=r["cfg"], ms=_bench_ms(lambda: probe(q, k, v, bias, n_past, *r["cfg"])),
                          ours=_bench_ms(ours)) for r in best]  # interleaved with ours
    for r in res["round2"]:
        print("round 2", r, flush=True)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--case", default="clusterkv 32k chunk 2048 (16k used)")
    p.add_argument("--out", default="dense_prefill_probe.json")
    args = p.parse_args(argv)
    triton.set_allocator(_scratch)
    res = dict(env=env_info(), **run(args.batch, args.case))
    res["compile_check"] = compile_check()
    print("compile check (device-side descriptors under torch.compile):", res["compile_check"], flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    bad = [r for r in res["rows"] if r.get("err", 0) > MAX_ERR_BF16]
    if bad:
        raise SystemExit(f"probe outputs off the fp32 reference by more than {MAX_ERR_BF16}: {bad[:3]}")


if __name__ == "__main__":
    main()
