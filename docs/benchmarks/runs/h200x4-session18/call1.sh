#!/usr/bin/env bash
# Session 18, call 1 on a four-H100 machine: four benches at once, one per card (../h100x2-session17/pair.sh).
#   GPU 0: the GPU sleep tests (levels 1, 2, kv_cache) and the recorded load, then 2B compiled beside TRL (Liger)
#   GPU 1: 8B LoRA, sleep level 2 beside kv_cache (the sync without a wake), TRL off
#   GPU 2: 8B LoRA compiled with the kv_cache sleep beside TRL (Liger)
#   GPU 3: 4B eager beside compiled, TRL off
set -u
P=docs/benchmarks/runs/h100x2-session17/pair.sh
S="python -m trainer bench --only scale --out \$G"
bash "$P" "${1:-500}" \
  "python -m pytest -m gpu tests/gpu/test_vllm_gpu.py -k 'sleep_levels or recorded_load' -q -rA 2>&1 | tail -n 40; RM_BENCH_SCALE=2b RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_STEPS=4 $S" \
  "RM_BENCH_TRL=0 RM_BENCH_SCALE=8b-lora64-sleep2-util0.35 RM_BENCH_SCALE_SLEEP=2,kv_cache RM_BENCH_SCALE_STEPS=4 $S" \
  "RM_BENCH_SCALE=8b-lora64-sleep2-util0.35 RM_BENCH_SCALE_SLEEP=kv_cache RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_STEPS=4 $S" \
  "RM_BENCH_TRL=0 RM_BENCH_SCALE=4b RM_BENCH_SCALE_COMPILE=0,1 RM_BENCH_SCALE_STEPS=4 $S"
