"""select_clusters' Triton kernels on the CPU, through Triton's interpreter, against reference_select_clusters bit for
bit (the int32 index).

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_select_clusters_triton.py`
(with Triton installed; skipped otherwise, e.g. on the CPU CI). The tuning knobs are set small in some cases (16-64
key lanes, register tiers of 8 / 32 / 64 lanes, 4-16 position blocks) so that a few dozen clusters cross every path:
each register tier, the chunked passes past the lanes with their carries, the output blocks' running max. Every
scratch and output buffer is allocated filled with a poison value, so an entry the kernels forget to write (or a
marker read before it is written) shows up. The GPU test (test_select_clusters_gpu.py) runs the kernels compiled.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels import select_clusters as sc  # noqa: E402
from tests.kernels.test_select_clusters import ARGS, make_q, make_state  # noqa: E402

# 16 key lanes (chunked passes past 16 clusters), 4-8 position blocks; tiers of 8 / 32 / 64 lanes, chunked past 64
# (scores and selection as two launches by default; fused=True: one launch)
SMALL = [dict(key_chunk=16, block_e=4, block_m=8), dict(key_chunk=64, block_e=8, block_m=16, tiers=True),
         dict(key_chunk=16, block_e=4, block_m=8, block_k=16, fused=True)]
DEFAULT = [dict(), dict(tiers=False, num_warps=2), dict(fused=True),
           dict(vector_loads=True), dict(vector_loads=True, fused=True)]  # VECTOR_LOADS (D 16 and 64: whole tiles)


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """torch.empty filled with 0x5A5A5A5A-like bytes (the kernels' scratch and output)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(1515870810) if not t.is_floating_point() else t.fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned)


def check(q, st, n_sink, max_selected, window, per_query_head, knobs):
    args = (q, *(st[a] for a in ARGS))
    want = sc.reference_select_clusters(*args, n_sink=n_sink, max_selected=max_selected, window=window,
                                        per_query_head=per_query_head)
    for kn in knobs:
        got = sc._launch(*args, n_sink, max_selected, window, per_query_head, **kn)
        assert got.dtype == torch.int32 and got.shape == want.shape
        bad = (got != want).nonzero()
        assert not len(bad), f"{kn}: {len(bad)} entries differ, first at {bad[0].tolist()}: " \
                             f"{got[tuple(bad[0])]} != {want[tuple(bad[0])]}"


CASES = [  # B, Hq, Hkv, K, D, n_sink, max_selected, window, budget, dtype
    (2, 4, 2, 9, 16, 4, 12, 5, 10, torch.bfloat16),  # G 2, trimming
    (1, 3, 1, 37, 16, 0, 40, 3, 25, torch.float16),  # G 3, no sinks
    (2, 9, 3, 21, 64, 2, 17, 0, 200, torch.float32),  # Hkv 3, G 3, budget clamped to max_selected
    (1, 8, 2, 5, 16, 3, 64, 7, 999, torch.bfloat16),  # G 4, budget above every clustered token
    (1, 2, 2, 13, 64, 5, 9, 4, 3, torch.float32),  # budget < n_sink: B_sel 0
]


@pytest.mark.parametrize("per_query_head", [True, False], ids=["per_q", "shared"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-K{}-D{}-s{}-m{}-w{}-b{}-{}".format(
    *c[:9], str(c[9])[6:]))
def test_matches_reference(case, per_query_head):
    B, Hq, Hkv, K, D, n_sink, max_selected, window, budget, dtype = case
    seed = K + D
    st = make_state(B, Hkv, K, D, n_sink=n_sink, window=window, budget=budget, dtype=dtype, seed=seed,
                    short_rows=[(B - 1, Hkv - 1)] if B * Hkv > 2 else ())
    q = make_q(B, Hq, D, dtype, seed)
    check(q, st, n_sink, max_selected, window, per_query_head, DEFAULT + SMALL)


@pytest.mark.parametrize("per_query_head", [True, False], ids=["per_q", "shared"])
def test_many_clusters_and_ties(per_query_head):
    """K = 300 (5 key chunks, 10 score blocks) with ties everywhere: centroids in {-1, 0, 1} give few distinct scores,
    so t* is shared by many clusters and the tie cumsum carries across chunks; budgets trim."""
    st = make_state(1, 2, 300, 16, n_sink=2, window=3, n_used=[[300, 251]], max_size=3, budget=150, seed=3)
    g = torch.Generator().manual_seed(3)
    cen = torch.randint(-1, 2, (1, 2, 300, 16), generator=g).float()
    st["centroids"] = torch.where(st["centroids"].isnan(), st["centroids"].float(), cen).bfloat16()
    q = torch.ones(1, 4, 1, 16, dtype=torch.bfloat16)
    q[0, 1:3, 0, :8] = -1.0  # the per-head rankings differ
    knobs = [dict(block_k=32, key_chunk=64, block_m=64), dict(key_chunk=256, tiers=True)]
    for budget in (150, 2 + 299):
        st["budget"][0] = budget
        check(q, st, 2, 300, 3, per_query_head, knobs)


def test_budget_edges_and_clamped_n_clusters():
    """B_sel 1, 4, every clustered token of the fullest row and one less; n_clusters larger than K (clamped to K,
    as the reference's id test does)."""
    st = make_state(2, 2, 11, 16, n_sink=1, window=2, n_used=[[11, 7], [0, 11]], budget=0, seed=9)
    q = make_q(2, 4, 16, torch.bfloat16, 9)
    total = int(st["cluster_size"].sum(-1).max())
    for b_sel in (1, 4, total - 1, total):
        st["budget"][0] = 1 + b_sel
        check(q, st, 1, total, 2, True, SMALL)
    st["n_clusters"][1, 1] = 15
    check(q, st, 1, total, 2, False, SMALL)


def test_unused_centroids_are_never_read():
    """NaN centroids at ids >= n_clusters (make_state) and inf at size-0 ids: the index is unchanged."""
    st = make_state(1, 1, 24, 16, n_sink=2, window=2, budget=12, empty=0.4, seed=12)
    q = make_q(1, 2, 16, torch.float32, 12)
    zero = st["cluster_size"] == 0
    n = int(st["n_clusters"][0, 0])
    assert zero[0, 0, :n].any() and n < 24
    want = sc._launch(q, *(st[a] for a in ARGS), 2, 16, 2, True)
    st["centroids"] = st["centroids"].masked_fill(zero[..., None] & ~st["centroids"].isnan(), float("inf"))
    check(q, st, 2, 16, 2, True, SMALL)
    assert torch.equal(sc._launch(q, *(st[a] for a in ARGS), 2, 16, 2, True), want)


def test_counters_are_left_at_zero():
    """The fused launch's per-row counters (kvrewrite.kernels._semaphores) are back at 0 after every launch, so the
    next launch (and a CUDA graph replay) finds them ready; two launches in a row give the same index."""
    from kvrewrite.kernels._semaphores import counters

    st = make_state(2, 2, 40, 16, n_sink=2, window=3, budget=20, seed=5)
    q = make_q(2, 4, 16, torch.bfloat16, 5)
    for per_query_head in (True, False):
        first = sc._launch(q, *(st[a] for a in ARGS), 2, 30, 3, per_query_head, block_k=16)
        assert counters(sc.NAME, q, 8).eq(0).all()
        again = sc._launch(q, *(st[a] for a in ARGS), 2, 30, 3, per_query_head, block_k=16)
        assert torch.equal(first, again)
        check(q, st, 2, 30, 3, per_query_head, [dict(block_k=16)])
