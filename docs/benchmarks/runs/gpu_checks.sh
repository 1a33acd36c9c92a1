#!/usr/bin/env bash
# GPU tests on a device machine with the bundle installed, from the repository root (session 28 on; sessions 26-27
# kept a copy each with the test ids written in):
#   bash docs/benchmarks/runs/gpu_checks.sh LIMIT_S TEST_ID [TEST_ID ...]
# pytest's log goes to $OUT/checks.log, each test's RESULT lines to $OUT/gpu_results.jsonl.
set -u
limit=$1; shift
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-extra:$PWD VLLM_PLUGINS="" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export RM_GPU_RESULTS="$OUT/gpu_results.jsonl"
timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rA -s "$@" > "$OUT/checks.log" 2>&1
echo "rc=$?" >> "$OUT/checks.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=|^E |^RESULT" "$OUT/checks.log" | tail -n 40
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
