#!/usr/bin/env bash
# The one-GPU test suite (`python -m pytest -m gpu`) in three parts, each meant to fit one device call (600 s): with 4
# xdist workers on one H200 the whole suite (1951 tests) did not finish in 560 s (stop 48: ~1,400 ran). Stop 49, one
# H200, 4 workers: part 1 261 s, part 3 424 s; stop 50 (one GPU of an nvidia-h200-x2, 4 workers): part 2 334 s.
# Stop 54, one H200 (16 cores), 8 workers (the default since): part 1 123 s, part 2 172 s, part 3 221 s.
#   scripts/gpu_tests.sh PART [OUTDIR]     (PART: 1, 2 or 3; the report goes to OUTDIR/gpu_tests_partPART.txt)
#   N=4 TT=540 scripts/gpu_tests.sh ...      (N: xdist workers; TT: the timeout in seconds)
# 1: the decode attention kernels (clustered, column statistics, indexed: ~730 tests)
# 2: the expanded, score, observed, sketch and prefill attention kernels and the GLU GEMV (~650)
# 3: everything else marked gpu (every test file not in parts 1 and 2, so the three parts are the whole suite)
set -o pipefail
PART=${1:?PART: 1, 2 or 3}
OUT=${2:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
K=tests/kernels
P1="$K/test_clustered_attention_gpu.py $K/test_attention_column_stats_gpu.py $K/test_indexed_attention_gpu.py"
P2="$K/test_expanded_attention_gpu.py $K/test_score_ops_gpu.py $K/test_observed_attention_gpu.py
    $K/test_sketch_attention_gpu.py $K/test_prefill_attention_gpu.py $K/test_gemv_glu_gpu.py"
case $PART in
  1) FILES=$P1 ;;
  2) FILES=$P2 ;;
  3) FILES="tests $(for f in $P1 $P2; do printf -- '--ignore=%s ' "$f"; done)" ;;
  *) echo "gpu_tests.sh: PART must be 1, 2 or 3, got '$PART'" >&2; exit 2 ;;
esac
# shellcheck disable=SC2086  # FILES is a list of paths and options
timeout ${TT:-540} python -m pytest -q -p no:cacheprovider -m gpu -n ${N:-8} --durations=15 $FILES 2>&1 \
  | grep -v -i "benchmarkwarning\|warner(" | tee "$OUT/gpu_tests_part$PART.txt" | tail -40
