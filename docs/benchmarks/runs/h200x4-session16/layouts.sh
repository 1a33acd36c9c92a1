#!/usr/bin/env bash
# One layouts-bench call on a 4-GPU device machine (session 16):
#   bash layouts.sh LIMIT_S "layout,layout,..." [ENV=VALUE ...]
# The bench writes $OUT/layouts.json after every layout; the learner/server logs, metrics and ledgers go to
# $OUT/logs.tgz even when the limit cut the bench short.
set -u
limit=$1; layouts=$2; shift 2
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-extra:$PWD VLLM_PLUGINS="" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export RM_BENCH_WORK=/tmp/rm-bench-layouts RM_BENCH_LAYOUTS=$layouts
for kv in "$@"; do export "$kv"; done
timeout "$limit" python3 -m trainer bench --only layouts --out "$OUT" > "$OUT/bench.log" 2>&1
echo "rc=$?" >> "$OUT/bench.log"
(cd "$RM_BENCH_WORK" && tar czf "$OUT/logs.tgz" logs $(find runs -maxdepth 3 \( -name metrics.jsonl -o -name 'ledger*.jsonl' \) 2>/dev/null))
grep -E '^bench layouts|rc=|Error' "$OUT/bench.log" | tail -n 30
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 4
