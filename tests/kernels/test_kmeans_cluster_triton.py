"""kmeans_cluster's Triton kernel on the CPU, through Triton's interpreter, against reference_kmeans_cluster: labels,
sizes, starts, members, n_clusters and cluster_end exactly, centroids within the dtype's rounding (the sums run in
another order), on planted keys (test_kmeans_cluster.plant: no near-ties).

Runs only under the interpreter: `TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_kmeans_cluster_triton.py`
(with Triton installed; skipped otherwise). Block sizes are set to 16 in most cases (SMALL) so that a few dozen
points cross every block, split and chunk boundary; both launch modes run: persistent (one program: the interpreter
runs programs one after another, so a grid barrier with more would wait forever) and one launch per phase with
several programs. The GPU test (test_kmeans_cluster_gpu.py) runs the kernel compiled.
"""
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's interpreter on the CPU: set TRITON_INTERPRET=1 (and install Triton)",
                allow_module_level=True)
pytest.importorskip("triton")

from kvrewrite.kernels.kmeans_cluster import reference_kmeans_cluster, triton_kmeans_cluster  # noqa: E402
from tests.kernels.test_kmeans_cluster import (  # noqa: E402
    FIELDS, Args, append_tokens, assert_state, clone, make_state, plant)

SMALL = dict(block_p=16, block_c=16, update_c=16, update_p=16, final_c=16, scatter_p=16, prep_chunk=32, write_p=16,
             init_k=16, splits=3, update_sub=16)
MODES = {"persistent": dict(persistent=True),  # (launches: also every iteration of a converged row)
         "launches": dict(persistent=False, programs=3, stop_when_converged=False),
         "elementwise argmax": dict(persistent=True, assign_elem=True)}


def check(s, a: Args, clamp=False, what="", head_offset=0, **knobs):
    want, got = clone(s), clone(s)
    reference_kmeans_cluster(*(want[f] for f in FIELDS), *a.kwargs().values(), clamp=clamp, head_offset=head_offset)
    triton_kmeans_cluster(*(got[f] for f in FIELDS), *a.kwargs().values(), head_offset=head_offset, **knobs)
    assert_state(got, want, s["keys"].dtype, what)
    return got


CASES = [  # B, H, C, D, K, fills, pads, threshold, dtype, args
    (2, 3, 53, 16, 12, [[53, 30, 47], [50, 53, 20]], [0, 5], 40, torch.bfloat16, Args(tokens_per_cluster=6, seed=3)),
    (1, 2, 150, 32, 40, [[150, 131]], [7], None, torch.float16, Args(n_sink=4, tokens_per_cluster=4, seed=11)),
    (1, 1, 37, 64, 8, [[37]], None, None, torch.float32, Args(n_sink=1, tokens_per_cluster=5, iters=3, seed=2)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,H,C,D,K,fills,pads,threshold,dtype,args", CASES,
                         ids=lambda v: "" if isinstance(v, Args) else str(v))
def test_prefill_matches_reference(B, H, C, D, K, fills, pads, threshold, dtype, args, mode):
    s = make_state(B, H, C, D, K, fills, pads, threshold, dtype, seed=C + D)
    args = plant(s, args, seed=C)
    check(s, args, **SMALL, **MODES[mode])


@pytest.mark.parametrize("mode", MODES)
def test_unplanted_fp32_keeps_moving(mode):
    """Random Gaussian keys (fp32: the kernel's sums differ from the reference's by ulps, no near-tie flips here):
    labels change over several iterations, at a different pace per row (a row that has converged skips the rest)."""
    a = Args(n_sink=2, tokens_per_cluster=10, iters=8, seed=4)
    s = make_state(1, 3, 90, 16, 16, [[90, 85, 77]], dtype=torch.float32, seed=5)
    check(s, a, **SMALL, **MODES[mode])


@pytest.mark.parametrize("mode", ["persistent", "launches"])
def test_head_offset(mode):
    """head_offset (a tensor-parallel rank's first KV head) hashed with the state's head as the reference does."""
    s = make_state(2, 2, 40, 16, 10, [[40, 33], [38, 40]], pads=[0, 3], dtype=torch.bfloat16, seed=12)
    a = plant(s, Args(n_sink=2, tokens_per_cluster=5, iters=2, seed=6), head_offset=5)
    check(s, a, head_offset=5, **SMALL, **MODES[mode])


def test_default_blocks_many_clusters():
    """The default block sizes, 300 slots into 75 clusters (two assign blocks of centroids, 5 reduce blocks)."""
    a = Args(n_sink=4, tokens_per_cluster=4, iters=2, seed=5)
    s = make_state(1, 1, 304, 16, 80, [[304]], seed=6)
    a = plant(s, a)
    check(s, a, programs=1)


def test_prefill_then_windows():
    """Prefill, a call with the window not full (nothing changes), then two window clusterings appended."""
    a = Args(n_sink=3, tokens_per_cluster=5, window=12, window_clusters=4, iters=2, seed=7)
    s = make_state(2, 2, 80, 32, 16, [[40, 40], [40, 40]], pads=[0, 6], dtype=torch.bfloat16, seed=9)
    a = plant(s, a)
    s = check(s, a, what="prefill", **SMALL)
    for step in range(2):
        append_tokens(s, 7, seed=step)
        s = check(s, a, what=f"not due {step}", **SMALL)
        append_tokens(s, 5, seed=10 + step)
        s["bias"][1, 0, int(s["fill"][1, 0]) - 2] = -math.inf  # a padding slot inside a window
        a = plant(s, a, seed=20 + step)
        s = check(s, a, what=f"window {step}", **SMALL, **MODES["launches"])
    assert s["n_clusters"].tolist() == [[16, 16], [15, 15]] and (s["cluster_end"] == 64).all()


def test_small_rows_and_clamp():
    """L = 0, fewer valid slots than n_sink, L < window_clusters, and more clusters than K (the kernel clamps; the
    reference's clamp=True does the same)."""
    a = Args(n_sink=4, tokens_per_cluster=2, iters=2, seed=1)
    s = make_state(1, 4, 48, 16, 6, [[4, 2, 12, 40]], threshold=1, seed=3)
    a = plant(s, a, clamp=True)
    s = check(s, a, clamp=True, **SMALL)
    assert s["n_clusters"].tolist() == [[0, 0, 4, 6]]  # 8 / 2 = 4; 36 / 2 = 18 clamped to K = 6
    a = Args(n_sink=4, tokens_per_cluster=2, window=4, window_clusters=5, iters=2, seed=1)
    append_tokens(s, 4, seed=4)
    s["bias"][0, 0, [5, 7]] = -math.inf
    a = plant(s, a, clamp=True)
    s = check(s, a, clamp=True, **SMALL)
    assert s["n_clusters"].tolist() == [[2, 4, 6, 6]] and s["cluster_end"].tolist() == [[8, 6, 16, 44]]


def test_no_row_due_is_untouched():
    s = make_state(2, 2, 40, 16, 8, [[40, 30], [35, 39]], threshold=41, dtype=torch.float16)
    got = clone(s)
    triton_kmeans_cluster(*(got[f] for f in FIELDS), *Args().kwargs().values(), **SMALL)
    assert all(torch.equal(got[f], s[f]) for f in FIELDS)
