#!/usr/bin/env bash
# Session 24, call 1 on a 4-GPU machine (bundle installed): the packed-attention op's GPU tests (GPU 0), the packed
# trainer tests through it (GPU 1) and the attention micro-benchmark (GPU 2), at once.
#   bash op_checks.sh LIMIT_S
set -u
limit=$1
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-extra:$PWD VLLM_PLUGINS="" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
D=docs/benchmarks/runs/h200x4-session24
(CUDA_VISIBLE_DEVICES=0 timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rA tests/gpu/test_varlen_kernel_gpu.py \
  > "$OUT/op_tests.log" 2>&1; echo "rc=$?" >> "$OUT/op_tests.log") &
(CUDA_VISIBLE_DEVICES=1 timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rA tests/gpu/test_packed_varlen_gpu.py \
  tests/gpu/test_trainer_packed_gpu.py > "$OUT/packed_tests.log" 2>&1; echo "rc=$?" >> "$OUT/packed_tests.log") &
(CUDA_VISIBLE_DEVICES=2 timeout "$limit" python3 $D/varlen_micro.py > "$OUT/varlen_micro.json" 2> "$OUT/varlen_micro.err";
  echo "rc=$?" >> "$OUT/varlen_micro.err") &
wait
for f in "$OUT"/op_tests.log "$OUT"/packed_tests.log; do echo "== $f"; grep -E "PASSED|FAILED|ERROR|passed|failed|rc=|^E " "$f" | tail -n 30; done
echo "== micro"; cat "$OUT/varlen_micro.json"; tail -n 5 "$OUT/varlen_micro.err"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 4
