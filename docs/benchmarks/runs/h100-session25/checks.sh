#!/usr/bin/env bash
# Session 25, first call on one H100 after the bundle is installed: the packed op and the trainer through it (session
# 24's code as it now stands: the segment count unbacked) and the compiled layers' activation memory budget on CUDA.
#   bash checks.sh LIMIT_S
set -u
limit=$1
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-extra:$PWD VLLM_PLUGINS="" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rA -s tests/gpu/test_memory_budget_gpu.py \
  tests/gpu/test_varlen_kernel_gpu.py tests/gpu/test_packed_varlen_gpu.py tests/gpu/test_trainer_packed_gpu.py \
  > "$OUT/checks.log" 2>&1
echo "rc=$?" >> "$OUT/checks.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=|^E |kept for the backward" "$OUT/checks.log" | tail -n 40
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
