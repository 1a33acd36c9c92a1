#!/usr/bin/env bash
# The multi-GPU tests on a device machine with their output kept when the call's limit cuts them short:
#   bash gpu_tests.sh LIMIT_S "pytest -k expression"
# (session 16's call ran them with output piped through grep: the limit killed the pipe and nothing came back).
set -u
limit=$1; expr=${2:-}
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-extra:$PWD VLLM_PLUGINS="" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rA -x tests/gpu/test_multigpu_gpu.py ${expr:+-k "$expr"} \
  --junitxml="$OUT/junit.xml" > "$OUT/pytest.log" 2>&1
echo "rc=$?" >> "$OUT/pytest.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUT/pytest.log" | tail -n 20
