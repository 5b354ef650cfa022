"""ems_attention's CUDA path (triton_ems_attention: the forward, then the fold kernels of
kvrewrite/kernels/_ems_fold_kernels.py) on CUDA against the op's CPU reference: a prefill chunk (the stats kernel's
FOLD variant) then 70 decode steps with l_win = 32 (rotations at steps 32 and 64; rows starting at different
win_count rotate at other steps too), each decode step replayed from a CUDA graph and run under
torch.cuda.set_sync_debug_mode("error"); fp32 and bf16, Llama-ish GQA (Hq 32, Hkv 8, D 128) and MQA, ragged
slot_fill, padding entries, s_loc_past/s_loc_cur NaN-poisoned before the prefill (the chunk overwrites them).

Tolerance: the CPU reference and the kernels both accumulate fp32 probabilities (each within ~1e-6 relative); over
71 calls the scores (sums of O(1)) agree to ~1e-5: 5e-5 absolute. win_count is compared exactly.
"""
import pytest
import torch

import kvrewrite  # noqa: F401  (registers the ops)
from kvrewrite.kernels import ems_attention as ea
from kvrewrite.kernels.expanded_attention_stats import fold_kernels
from tests.kernels.test_expanded_attention_stats_gpu import big_state
from tests.kernels.test_ems_attention import with_room

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(fold_kernels() is None, reason="needs Triton"),
]
TOL = dict(atol=5e-5, rtol=1e-5)
CACHE_APPEND = torch.ops.kvrewrite.cache_append.default
EMS_APPEND = torch.ops.kvrewrite.ems_append.default
FIELDS = ("keys", "values", "bias", "slot_pos", "entry_start", "lut", "key_scale", "slot_fill", "fill", "raw_keys",
          "token_pos", "slot_order", "s_glo", "s_loc_past", "s_loc_cur", "win_count")


def build(B, Hq, Hkv, C, R, D, T, steps, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    st = big_state(B, Hkv, C, R, D, T, dtype, g, prefill=True)
    fill, raw_keys, token_pos, slot_order = with_room(st, steps, steps)
    s = dict(st.__dict__, fill=fill, raw_keys=raw_keys.to(dtype), token_pos=token_pos, slot_order=slot_order)
    R = s["lut"].shape[2]
    s["s_glo"] = torch.rand(B, Hkv, R, generator=g).masked_fill(torch.arange(R) >= st.slot_fill[:, :, None], 0.0)
    s["s_loc_past"] = torch.full((B, Hkv, R), float("nan"))
    s["s_loc_cur"] = torch.full((B, Hkv, R), float("nan"))
    s["win_count"] = torch.randint(0, 31, (B, Hkv), generator=g)
    return s, g


def attn_args(s, q):
    return (q, s["keys"], s["values"], s["bias"], s["slot_pos"], s["cache_position"], s["entry_start"], s["lut"],
            s["key_scale"], s["s_glo"], s["s_loc_past"], s["s_loc_cur"], s["slot_fill"], s["win_count"])


def append(s, k, v):
    valid = torch.ones(k.shape[0], 1, dtype=torch.bool, device=k.device)
    CACHE_APPEND(s["keys"], s["values"], s["bias"], s["slot_pos"], s["fill"], k, v, s["cache_position"], valid)
    EMS_APPEND(s["keys"], s["bias"], s["fill"], k, s["cache_position"], valid, s["entry_start"], s["raw_keys"],
               s["lut"], s["key_scale"], s["token_pos"], s["slot_order"], s["slot_fill"])


def compare(gpu, cpu, what):
    for f in ("s_glo", "s_loc_past", "s_loc_cur"):
        torch.testing.assert_close(gpu[f].cpu(), cpu[f], **TOL, msg=lambda m, f=f: f"{what}, {f}: {m}")
    assert torch.equal(gpu["win_count"].cpu(), cpu["win_count"]), f"{what}: win_count"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Hq, Hkv, D", [(32, 8, 128), (4, 1, 64)], ids=["llama-GQA", "MQA"])
def test_prefill_then_70_decode_steps_in_a_cuda_graph(Hq, Hkv, D, dtype):
    B, C, R, T, steps, l_win = 2, 90, 200, 40, 70, 32
    scale = D ** -0.5
    cpu, g = build(B, Hq, Hkv, C, R, D, T, steps, dtype, seed=0)
    gpu = {f: t.cuda() for f, t in cpu.items()}
    # -- the prefill chunk (T = 40 > l_win): the stats kernel's FOLD variant
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    out = ea.triton_ems_attention(*attn_args(gpu, q.cuda()), scale, False, 0.0, l_win)
    want = ea.reference_ems_attention(*attn_args(cpu, q), scale, False, 0.0, l_win)
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                               rtol=0)
    compare(gpu, cpu, "prefill")
    assert not gpu["s_loc_past"].isnan().any() and (gpu["win_count"] == 0).all()
    gpu["win_count"].copy_(torch.tensor([[0] * Hkv, [5] * Hkv]))  # rows rotate at different steps
    cpu["win_count"].copy_(gpu["win_count"].cpu())
    # -- decode: one step captured (on copies: the capture must not advance the real state), replayed 70 times
    static_q = torch.zeros(B, Hq, 1, D, dtype=dtype, device="cuda")
    cp = int(cpu["cache_position"][-1])
    gpu["cache_position"] = torch.tensor([cp + 1], device="cuda")
    warm = {f: t.clone() for f, t in gpu.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ea.triton_ems_attention(*attn_args(warm, static_q), scale, True, 0.0, l_win)  # compiles the kernels
    torch.cuda.current_stream().wait_stream(side)
    saved = {f: gpu[f].clone() for f in ("s_glo", "s_loc_past", "s_loc_cur", "win_count")}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ea.triton_ems_attention(*attn_args(gpu, static_q), scale, True, 0.0, l_win)
    for f, t in saved.items():  # capturing runs nothing, but be sure
        gpu[f].copy_(t)
    rotated = set()
    for step in range(1, steps + 1):
        cp += 1
        cpu["cache_position"] = torch.tensor([cp])
        gpu["cache_position"].fill_(cp)
        k, v = torch.randn(2, B, Hkv, 1, D, generator=g).to(dtype)
        qs = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
        append(cpu, k, v)
        append(gpu, k.cuda(), v.cuda())
        static_q.copy_(qs.cuda())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = ea.reference_ems_attention(*attn_args(cpu, qs), scale, True, 0.0, l_win)
        torch.testing.assert_close(static_out.cpu().float(), want.float(),
                                   atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=0)
        compare(gpu, cpu, f"step {step}")
        rotated |= {(step, b) for b in range(B) if int(cpu["win_count"][b, 0]) == 0}
    assert {(32, 0), (64, 0), (27, 1), (59, 1)} <= rotated
    assert (cpu["s_loc_cur"] != 0).any()


def test_eager_decode_has_no_host_sync_and_the_op_dispatches(monkeypatch):
    """An eager decode step of the kernel path under set_sync_debug_mode("error"); then the registered op on CUDA
    with KERNELS_CHECKED_ON_GPU forced on runs the same path (the CPU reference's state)."""
    B, Hq, Hkv, C, R, D, T = 2, 8, 2, 60, 150, 128, 1
    g = torch.Generator().manual_seed(3)
    st = big_state(B, Hkv, C, R, D, T, torch.bfloat16, g, prefill=False, dead=True)
    cpu = dict(st.__dict__)
    cpu.update(s_glo=torch.rand(B, Hkv, R, generator=g), s_loc_past=torch.rand(B, Hkv, R, generator=g),
               s_loc_cur=torch.rand(B, Hkv, R, generator=g), win_count=torch.tensor([[2, 3], [0, 3]]))
    q = torch.randn(B, Hq, 1, D, generator=g).to(torch.bfloat16)
    gpu = {f: t.cuda() for f, t in cpu.items()}
    qc = q.cuda()  # before the debug mode: a copy from pageable host memory synchronizes
    ea.triton_ems_attention(*attn_args({f: t.clone() for f, t in gpu.items()}, qc), 0.1, True, 0.0, 4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ea.triton_ems_attention(*attn_args(gpu, qc), 0.1, True, 0.0, 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ea.reference_ems_attention(*attn_args(cpu, q), 0.1, True, 0.0, 4)
    compare(gpu, cpu, "eager decode")
    monkeypatch.setattr(ea, "KERNELS_CHECKED_ON_GPU", True)
    calls = []
    monkeypatch.setattr(ea, "triton_ems_attention", lambda *a, **k: calls.append(1) or ea_triton(*a, **k))
    torch.ops.kvrewrite.ems_attention(*attn_args(gpu, qc), scale=0.1, past_only=True, softcap=20.0, l_win=4)
    ea.reference_ems_attention(*attn_args(cpu, q), 0.1, True, 20.0, 4)
    assert calls == [1]
    compare(gpu, cpu, "op, softcap")


ea_triton = ea.triton_ems_attention
