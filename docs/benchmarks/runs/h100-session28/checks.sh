#!/usr/bin/env bash
# Session 28, first call on one H100 after the bundle is installed: the GPU tests whose served-weights check is now one
# helper over a weights dict (assert_weights_bit_exact: a model's state_dict, or full_weights of a LoRA learner),
# tests/gpu/test_vllm_gpu.py.
#   bash checks.sh LIMIT_S
set -u
limit=$1
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-extra:$PWD VLLM_PLUGINS="" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export RM_GPU_RESULTS="$OUT/gpu_results.jsonl"
timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rA -s \
  "tests/gpu/test_vllm_gpu.py::test_merge_into_engine_serves_the_merged_learner_bit_for_bit_and_refuses_a_nan_after_the_write" \
  "tests/gpu/test_vllm_gpu.py::test_colocate_full_sync_in_process" \
  "tests/gpu/test_vllm_gpu.py::test_recorded_load_replays_vllm_s_loader" \
  > "$OUT/checks.log" 2>&1
echo "rc=$?" >> "$OUT/checks.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=|^E |^RESULT" "$OUT/checks.log" | tail -n 40
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
