#!/usr/bin/env bash
# Session 27 (one H100 80GB, nvidia-h100-x1): one bench command per call, from the repository root with the bundle
# installed. The records of this call only (files newer than its start: RM_BENCH_WORK persists on a held machine and
# keeps the built models), without the runs' checkpoint directories, come back as $OUT/records.tgz.
#   bash lane.sh LIMIT_S "<bench command, writing under \$G>"
set -u
limit=$1; spec=$2
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-extra:$PWD VLLM_PLUGINS="" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export RM_BENCH_WORK=/tmp/rm-bench G=/tmp/rm-out-$$
mkdir -p "$G" "$RM_BENCH_WORK"
marker=$(mktemp)
timeout "$limit" bash -c "$spec" > "$OUT/bench.log" 2>&1
echo "rc=$?" >> "$OUT/bench.log"
if [ -d "$RM_BENCH_WORK/runs" ]; then
  (cd "$RM_BENCH_WORK/runs" && find . -newer "$marker" \( -name '*.json' -o -name 'metrics.jsonl' -o -name '*_kernels.txt' \
    -o -name '*_host.txt' \) -not -path '*/final/*' -not -path '*/checkpoint-*' -size -20M \
    | while read -r f; do mkdir -p "$G/runs/$(dirname "$f")"; cp "$f" "$G/runs/$f"; done)
fi
tar -czf "$OUT/records.tgz" -C "$G" .
grep -E '^\{"name|^\{"trl|^bench scale|^\[scale\]|rc=|Error|error' "$OUT/bench.log" | cut -c1-700 | tail -n 30
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
