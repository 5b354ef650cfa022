#!/usr/bin/env bash
# Several `kvrewrite bench` invocations at once, one per GPU (CUDA_VISIBLE_DEVICES=i for the i-th), on a multi-GPU
# machine: rows that would run one after another on one GPU (A/B variants of a kernel option, methods, repeat runs)
# take the wall time of the slowest. Each row is measured on its own GPU against its own floor (the bench measures
# that GPU's copy bandwidth), so the two sides of an A/B pair ran on two GPUs of one host: compare their ms/token
# (and the spread of their floors, ~4% on the 4 H200s of docs/bench.md "Stop 33 runs").
#
#   scripts/bench_rows_parallel.sh OUT "name::bench args" ["name::bench args" ...]
#
# Writes OUT/rows.json ({name: the bench's JSON document, or {"error": ...}}) and OUT/log.txt (every row's output,
# prefixed by its name). Rows beyond the GPU count are refused. TIMEOUT (seconds, default 540) cuts every row.
set -u
OUT=$1; shift
mkdir -p "$OUT"
TMP=$(mktemp -d)
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$#" -gt "$NGPU" ]; then
  echo "bench_rows_parallel: $# rows for $NGPU GPUs; give at most $NGPU" >&2; exit 2
fi
i=0
for spec in "$@"; do
  name=${spec%%::*}; args=${spec#*::}
  # shellcheck disable=SC2086  (args are the bench's words)
  CUDA_VISIBLE_DEVICES=$i timeout "${TIMEOUT:-540}" python -m kvrewrite.cli bench $args --out "$TMP/$name.json" \
    --plot "$TMP/$name.png" > "$TMP/$name.log" 2>&1 &
  i=$((i + 1))
done
wait
for spec in "$@"; do name=${spec%%::*}; sed "s/^/[$name] /" "$TMP/$name.log"; done > "$OUT/log.txt"
python - "$TMP" "$OUT/rows.json" "$@" <<'PY'
import json, pathlib, sys
tmp, out, specs = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
docs = {}
for spec in specs:
    name = spec.split("::")[0]
    f = tmp / f"{name}.json"
    docs[name] = json.loads(f.read_text()) if f.is_file() else {"error": "no JSON: see log.txt", "args": spec}
    for r in docs[name].get("rows", []):
        print(f"{name}: {r.get('system')} n={r.get('context')} B={r.get('batch')} ms/token {r.get('ms_per_step')} "
              f"plain {r.get('ms_plain_step_median')} x floor {r.get('ratio_to_floor')} {r.get('error', '')}")
pathlib.Path(out).write_text(json.dumps(docs, indent=1))
PY
