#!/usr/bin/env bash
# Session 26, first call on one H100 after the bundle is installed: vllm.sync.overlap_wake at sleep level 2 with a LoRA
# learner (tests/gpu/test_vllm_gpu.py), level 2's sleep/wake beside it, and the activation-budget test after its move
# onto tests/compiled_layer.py (session 25 ran it before the move).
#   bash checks.sh LIMIT_S
set -u
limit=$1
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-extra:$PWD VLLM_PLUGINS="" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export RM_GPU_RESULTS="$OUT/gpu_results.jsonl"
timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rA -s tests/gpu/test_memory_budget_gpu.py \
  "tests/gpu/test_vllm_gpu.py::test_overlap_wake_serves_the_merged_learner_and_refuses_a_nan_after_the_wake" \
  "tests/gpu/test_vllm_gpu.py::test_sleep_levels_release_memory_and_wake_identical[2]" \
  > "$OUT/checks.log" 2>&1
echo "rc=$?" >> "$OUT/checks.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=|^E |kept for the backward|^RESULT" "$OUT/checks.log" | tail -n 40
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
