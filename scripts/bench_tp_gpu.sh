#!/usr/bin/env bash
# Issue 20's GPU runs on one host with 2 GPUs (docs/tensor-parallel.md, "GPU runs"), in phases; each phase has its
# own timeout and every bench rewrites its JSON after each row, so a cut run keeps its rows.
#   scripts/bench_tp_gpu.sh [OUTDIR] [PHASES] [TAG]     (PHASES: any of a t s i I c k n m w p b j, default "t s b"; TAG
#   names the JSONs; GPUS=2,3 runs on those two GPUs, tp=1 rows on the first, so two runs can share a 4-GPU host)
# a: the all-reduce alone by message size: NCCL, torch's one-shot, push (python -m kvrewrite.bench.all_reduce)
# t: tests/test_tensor_parallel.py on the GPUs (2-process NCCL group: fp32 against tp=1 and HF, then bf16)
# s: Llama-3.1-8B shape, 32k, batch 1: full and chelsea at tp=1 (GPU 0 alone) then tp=2, decode in CUDA graphs
# i: the same for chelsea under rw.compile (Inductor + CUDA graphs, fused projections), tp=1 then tp=2
# b: Llama-3-70B shape at tp=2, 32k: chelsea and full at batch 1 and the largest batch that fits, CUDA graphs
# I: phase i's tp=2 row alone
# c: phase i's tp=2 row with the NCCL all-reduce (--tp-all-reduce collective), the one-shot kernel's baseline
# k: phase i's tp=2 row with torch's one-shot kernel (--kernel-option tp_all_reduce.PUSH=False), the push kernel's
# n: phase i's tp=2 row without the norms in the sums (--kernel-option tp_all_reduce_rms_norm.IN_GRAPHS=False)
# m: phase i's tp=2 row with the sum and the norm in two launches (--kernel-option tp_all_reduce_rms_norm.FUSED=False)
# w: phase i's tp=2 row with the lm_head whole on every rank (--kernel-option tp_all_gather.VOCAB_PARALLEL=False)
# p: where a decode step goes, tp=1 then tp=2 (python -m kvrewrite.bench.profile_decode, phase i's configuration;
#    PTP="2" profiles tp=2 alone)
# j: the 70B chelsea batch-1 row under rw.compile (Inductor + CUDA graphs, fused projections)
set -o pipefail
OUT=${1:-out/tp}
PHASES=${2:-t s b}
TAG=${3:-run1}
mkdir -p "$OUT"
# NVLink multicast stays off (the device machine's rule: it can take a shared host's GPUs out of service)
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
GPUS=${GPUS:-0,1}
export CUDA_VISIBLE_DEVICES=$GPUS
ONE=${GPUS%%,*}
LOG="$OUT/log_$TAG.txt"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee -a "$LOG"
nvidia-smi topo -m 2>&1 | head -5 | tee -a "$LOG"
B1="python -m kvrewrite.cli bench"
T2="python -m torch.distributed.run --standalone --nproc-per-node 2"
B2="$T2 -m kvrewrite.cli bench --tp 2"
C8="--contexts 32768 --batches 1 --plot /tmp/p.png"
IND="--systems chelsea $C8 --no-prefill --kv-compile inductor --fuse-projections --gemv"  # phase i's configuration
# ind2 SUFFIX [ARGS...]: phase i's tp=2 row with ARGS, into e2e_8b_ind_tp2SUFFIX_TAG.json
ind2() { local suffix=$1; shift
  timeout ${TI:-300} $B2 $IND "$@" --out "$OUT/e2e_8b_ind_tp2${suffix}_$TAG.json" 2>&1 | tee -a "$LOG"; }
for p in $PHASES; do
  echo "[$(date +%T)] phase $p" | tee -a "$LOG"
  case $p in
    a) timeout ${TA:-240} $T2 -m kvrewrite.bench.all_reduce --out "$OUT/all_reduce_$TAG.json" \
         --plot "$OUT/all_reduce_$TAG.png" 2>&1 | tee -a "$LOG" ;;
    t) timeout ${TT:-420} python -m pytest -q -x -p no:cacheprovider tests/test_tensor_parallel.py \
         -k gpu_nccl -s 2>&1 | tail -60 | tee -a "$LOG" ;;
    s) CUDA_VISIBLE_DEVICES=$ONE timeout ${TS:-150} $B1 --systems full,chelsea $C8 --out "$OUT/e2e_8b_tp1_$TAG.json" \
         2>&1 | tee -a "$LOG"
       timeout ${TS:-150} $B2 --systems full,chelsea $C8 --out "$OUT/e2e_8b_tp2_$TAG.json" 2>&1 | tee -a "$LOG" ;;
    i) CUDA_VISIBLE_DEVICES=$ONE timeout ${TI:-300} $B1 $IND --out "$OUT/e2e_8b_ind_tp1_$TAG.json" 2>&1 | tee -a "$LOG"
       ind2 "" ;;
    I) ind2 "" ;;
    c) ind2 _nccl --tp-all-reduce collective ;;
    k) ind2 _torch_one_shot --kernel-option tp_all_reduce.PUSH=False ;;
    n) ind2 _norm_apart --kernel-option tp_all_reduce_rms_norm.IN_GRAPHS=False ;;
    m) ind2 _norm_two_launches --kernel-option tp_all_reduce_rms_norm.FUSED=False ;;
    w) ind2 _lm_head_whole --kernel-option tp_all_gather.VOCAB_PARALLEL=False ;;
    p) P="-m kvrewrite.bench.profile_decode --method chelsea --fuse-projections --gemv --no-gemv-timings --layer-trace 24"
       for tp in ${PTP:-1 2}; do
         if [ "$tp" = 1 ]; then CUDA_VISIBLE_DEVICES=$ONE timeout ${TPR:-200} python $P 2>&1 | grep -v -i warn \
           > "$OUT/profile_tp1_$TAG.txt"
         else timeout ${TPR:-200} $T2 $P --tp 2 2>&1 | grep -v -i warn > "$OUT/profile_tp2_$TAG.txt"; fi
         grep -h "ms/step" "$OUT/profile_tp${tp}_$TAG.txt" | tee -a "$LOG"
       done ;;
    b) timeout ${TB:-300} $B2 --model llama-3-70b --systems chelsea,full --contexts 32768 --batches 1,max \
         --no-prefill --plot /tmp/p.png --out "$OUT/e2e_70b_tp2_$TAG.json" 2>&1 | tee -a "$LOG" ;;
    j) timeout ${TJ:-500} $B2 --model llama-3-70b --systems chelsea --contexts 32768 --batches 1 --no-prefill \
         --kv-compile inductor --fuse-projections --gemv --plot /tmp/p.png --out "$OUT/e2e_70b_ind_tp2_$TAG.json" \
         2>&1 | tee -a "$LOG" ;;
  esac
done
echo "[$(date +%T)] done" | tee -a "$LOG"
