#!/usr/bin/env bash
# Two benches at once, one per GPU of a two-GPU machine (session 17's calls used session 15's copy of this):
#   bash pair.sh LIMIT_S "commands for GPU 0" "commands for GPU 1"
# Each side runs with CUDA_VISIBLE_DEVICES=<i>, RM_BENCH_WORK=/tmp/rm-bench-gpu<i>, G=$OUT/gpu<i> (pass `--out $G` to
# the bench), its log in $OUT/gpu<i>.log. Its records (scale.json, per-run JSON, metrics.jsonl, profiles, TRL JSON)
# are packed into $OUT/gpu<i>-records.tgz: the device returns at most 8 files a call, so call 3 of session 17 lost a
# scale.json that was written as a loose file.
set -u
limit=$1; shift
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-extra:$PWD VLLM_PLUGINS="" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
i=0
for spec in "$@"; do
  (
    export CUDA_VISIBLE_DEVICES=$i RM_BENCH_WORK=/tmp/rm-bench-gpu$i G=/tmp/rm-out-gpu$i
    mkdir -p "$G"
    timeout "$limit" bash -c "$spec" > "$OUT/gpu$i.log" 2>&1
    echo "rc=$?" >> "$OUT/gpu$i.log"
    if [ -d "$RM_BENCH_WORK/runs" ]; then
      (cd "$RM_BENCH_WORK/runs" && find . \( -name '*.json' -o -name 'metrics.jsonl' -o -name '*_kernels.txt' -o -name '*_host.txt' \) \
        -size -20M | while read -r f; do mkdir -p "$G/runs/$(dirname "$f")"; cp "$f" "$G/runs/$f"; done)
    fi
    tar -czf "$OUT/gpu$i-records.tgz" -C "$G" .
  ) &
  i=$((i+1))
done
wait
for f in "$OUT"/gpu*.log; do echo "== $f"; grep -E '^\{|^bench scale|rc=|Error|error' "$f" | cut -c1-600 | tail -n 25; done
