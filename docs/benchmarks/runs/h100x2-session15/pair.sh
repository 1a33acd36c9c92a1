#!/usr/bin/env bash
# Two benches at once, one per GPU of a two-GPU machine (session 15's calls):
#   bash pair.sh LIMIT_S "commands for GPU 0" "commands for GPU 1"
# Each side runs with CUDA_VISIBLE_DEVICES=<i>, RM_BENCH_WORK=/tmp/rm-bench-gpu<i>, its log in $OUT/gpu<i>.log; its
# records (scale.json, per-run JSON, metrics.jsonl, TRL JSON) are copied to $OUT/gpu<i>/ at the end.
set -u
limit=$1; shift
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-extra:$PWD VLLM_PLUGINS="" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
i=0
for spec in "$@"; do
  (
    export CUDA_VISIBLE_DEVICES=$i RM_BENCH_WORK=/tmp/rm-bench-gpu$i G=$OUT/gpu$i
    mkdir -p "$G"
    timeout "$limit" bash -c "$spec" > "$OUT/gpu$i.log" 2>&1
    echo "rc=$?" >> "$OUT/gpu$i.log"
    if [ -d "$RM_BENCH_WORK/runs" ]; then
      (cd "$RM_BENCH_WORK/runs" && find . -maxdepth 2 \( -name '*.json' -o -name 'metrics.jsonl' \) -size -20M \
        | while read -r f; do mkdir -p "$G/runs/$(dirname "$f")"; cp "$f" "$G/runs/$f"; done)
    fi
  ) &
  i=$((i+1))
done
wait
for f in "$OUT"/gpu*.log; do echo "== $f"; grep -E '^\{|^bench scale|rc=|Error|error' "$f" | tail -n 25; done
