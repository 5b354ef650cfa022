#!/usr/bin/env bash
# The whole `kvrewrite bench` grid on one GPU, in phases; each phase is cut by its own timeout and
# rewrites its JSON after every row, so a cut run keeps its rows.
#   scripts/bench_gpu.sh [OUTDIR] [PHASES]     (PHASES: any of a to l, default "a b c d")
# a: batch 1, 16k/32k/64k, HF eager + kvrewrite methods (real prefill), hf-compiled at 32k
# b: 32k, batch 16 and the largest batch that fits per system, every system (synthetic state)
# c: 32k batch 1 and 16 (CB=1: batch 1 only), kvrewrite decode through rw.compile(mode="reduce-overhead") (Inductor)
# d: the headline rows: 32k batch 1, HF eager + compiled vs chelsea with fused projections and the Triton GEMV, compiled decode
#    and compiled prefill in chunks of 2048 (docs/bench.md, "Later runs")
# e: the prefill of a batch (issue 21): 32k, batch ${EB:-8}, the real compiled prefill of ${ES:-snapkv,chelsea} in
#    chunks of 2048 against HF's dense prefill of the same batch (--batch-prefill; not part of the default phases)
# f: 128k at batch ${FB:-4} (issue 21's long row): full, snapkv and chelsea, compiled decode, synthetic state (not default)
# g: kernel sweeps (not default): attention_column_stats' launch variants at h2o's batch-8 prefill chunk
#    (bench/column_stats.py), and the decode attention's variants at 32k batch 1 with each kernel's own time
# h: the prefill chunk's attention at batch ${HB:-8} (bench/attention_prefill.py --sweep: tiles, warps, stages), and
#    attention_column_stats' single changes to its default (--quick: the pipelined walk among them); not default
# i: EMS's prefill kernels at one late chunk of a batch-${IB:-8} 32k prefill (bench/ems_prefill.py: the expanded
#    attention, its statistics fold and the redundancy, with their launch variants); not default
# j: EMS's decode-time kernels at 32k (not default): the expanded attention's launch variants (bench/ems_attention.py:
#    split counts and the narrow form among them), the redundancy by TBM count at batch 1 and 8 (bench/ems_prefill.py:
#    its launch variants)
# k: stop 62's ClusterGen and ClusterKV checks (not default): the fold's reservoir launch variants (bench/clustergen_fold.py
#    --reservoir-sweep, batches 8 and 1), ClusterGen's 32k batch-1 decode on the replayed synthetic state with the
#    resolve's 32- and 128-key blocks, and ClusterKV's clustering against HF's dense prefill (bench/kmeans_cluster.py
#    --prefill-out); ClusterGen's batch-8 prefill is phase e with ES=clustergen
# l: stop 63's ClusterGen follow-ups (not default): ClusterGen's largest batch at 32k (issue 21's row, --isolate), its
#    batch-1 decode profile with a layer trace, and clustergen-kcenter's re-selection with its resident / warps knobs
#    (its select launch spills 344 B a thread offline: docs/bench.md "Stop 63 runs")
set -o pipefail
OUT=${1:-out/bench}
PHASES=${2:-a b c d}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee -a "$OUT/log.txt"
B="python -m kvrewrite.cli bench"
for p in $PHASES; do
  case $p in
    a) timeout ${TA:-300} $B --contexts 16384,32768,65536 --batches 1 --hf-compiled-contexts 32768 \
         --out "$OUT/e2e_b1.json" --plot /tmp/e2e_a.png 2>&1 | tee -a "$OUT/log.txt" ;;
    b) timeout ${TB:-240} $B --contexts 32768 --batches 16,max --no-prefill \
         --out "$OUT/e2e_batch.json" --plot /tmp/e2e_b.png 2>&1 | tee -a "$OUT/log.txt" ;;
    c) timeout ${TC:-400} $B --systems chelsea,full --contexts 32768 --batches ${CB:-1,16} --no-prefill \
         --kv-compile inductor --out "$OUT/e2e_inductor.json" --plot /tmp/e2e_c.png 2>&1 | tee -a "$OUT/log.txt" ;;
    d) timeout ${TD:-500} $B --systems hf-eager,hf-compiled,chelsea --contexts 32768 --batches 1 --prefill-chunk 2048 \
         --fuse-projections --gemv --kv-compile inductor --out "$OUT/e2e_headline.json" --plot /tmp/e2e_d.png 2>&1 | tee -a "$OUT/log.txt" ;;
    e) timeout ${TE:-500} $B --systems hf-eager,${ES:-snapkv,chelsea} --contexts 32768 --batches ${EB:-8} --batch-prefill \
         --prefill-chunk 2048 --fuse-projections --kv-compile inductor --out "$OUT/e2e_batch_prefill.json" \
         --plot /tmp/e2e_e.png 2>&1 | tee -a "$OUT/log.txt" ;;
    f) timeout ${TF:-500} $B --systems full,snapkv,chelsea --contexts 131072 --batches ${FB:-4} --no-prefill \
         --fuse-projections --kv-compile inductor --out "$OUT/e2e_128k_batch.json" --plot /tmp/e2e_f.png 2>&1 \
         | tee -a "$OUT/log.txt" ;;
    g) timeout ${TG:-300} python -m kvrewrite.bench.column_stats --out "$OUT/sweep_column_stats.json" 2>&1 \
         | tee -a "$OUT/log.txt"
       timeout ${TG:-300} python -m kvrewrite.bench.attention --sweep "$OUT/sweep_attention_b1.json" \
         --sweep-shapes 1:6554 --no-table 2>&1 | tee -a "$OUT/log.txt" ;;
    h) timeout ${TH:-300} python -m kvrewrite.bench.attention_prefill --batch ${HB:-8} --cases "chelsea 32k chunk 2048" \
         --sweep --out "$OUT/attention_prefill_b${HB:-8}.json" 2>&1 | tee -a "$OUT/log.txt"
       timeout ${TH:-300} python -m kvrewrite.bench.column_stats --quick --out "$OUT/sweep_column_stats_quick.json" 2>&1 \
         | tee -a "$OUT/log.txt" ;;
    i) timeout ${TI:-300} python -m kvrewrite.bench.ems_prefill --batch ${IB:-8} --out "$OUT/ems_prefill_b${IB:-8}.json" \
         2>&1 | tee -a "$OUT/log.txt" ;;
    j) timeout ${TJ:-300} python -m kvrewrite.bench.ems_attention --out "$OUT/ems_attention.json" 2>&1 \
         | tee -a "$OUT/log.txt"
       for jb in 1 8; do
         timeout ${TJ:-300} python -m kvrewrite.bench.ems_prefill --batch $jb --kernels redundancy \
           --out "$OUT/ems_redundancy_b$jb.json" 2>&1 | tee -a "$OUT/log.txt"
       done ;;
    k) timeout ${TK:-300} python -m kvrewrite.bench.clustergen_fold --batches 8 1 --no-reference --reservoir-sweep \
         --out "$OUT/clustergen_fold_reservoir.json" 2>&1 | tee -a "$OUT/log.txt"
       for rb in 32 128; do
         timeout ${TK:-300} $B --systems clustergen --contexts 32768 --batches 1 --no-prefill --fuse-projections --gemv \
           --kv-compile inductor --kernel-option _clustergen_fold_kernels.RES_B=$rb --out "$OUT/e2e_clustergen_b1_rb$rb.json" \
           --plot /tmp/e2e_k.png 2>&1 | tee -a "$OUT/log.txt"
       done
       timeout ${TK:-300} python -m kvrewrite.bench.kmeans_cluster --prefill-out "$OUT/clusterkv_prefill_cost.json" 2>&1 \
         | tee -a "$OUT/log.txt" ;;
    l) timeout ${TL:-500} $B --systems clustergen --contexts 32768 --batches max --isolate --no-prefill --fuse-projections \
         --kv-compile inductor --out "$OUT/e2e_clustergen_max_batch.json" --plot /tmp/e2e_l.png 2>&1 | tee -a "$OUT/log.txt"
       timeout ${TL:-500} python -m kvrewrite.bench.profile_decode --method clustergen --fuse-projections --gemv \
         --layer-trace 24 2>&1 | tee "$OUT/decode_profile_clustergen.txt" | tail -60
       timeout ${TL:-500} python -m kvrewrite.bench.kcenter_compress --reference none \
         --out "$OUT/kcenter_compress.json" 2>&1 | tee -a "$OUT/log.txt" ;;
  esac
done
python - "$OUT" <<'PY'
import json, sys, pathlib
from kvrewrite.bench.plot_e2e import plot_e2e
out = pathlib.Path(sys.argv[1])
docs = [json.loads(p.read_text()) for p in sorted(out.glob("e2e_*.json")) if p.name != "e2e_all.json"]
if docs:
    merged = dict(docs[0], rows=[r for d in docs for r in d["rows"]])
    (out / "e2e_all.json").write_text(json.dumps(merged, indent=1))
    plot_e2e(merged, out / "e2e_all.png")
    print("merged", len(merged["rows"]), "rows")
PY
