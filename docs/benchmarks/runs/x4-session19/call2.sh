#!/usr/bin/env bash
# Session 19, call 2: four benches at once, one per card.
#   GPU 0: the recorded-load GPU test (its test bug fixed), then 8B LoRA compiled at sleep level 2 beside kv_cache
#   GPU 1: 8B LoRA compiled, kv_cache, 8k rows, full beside selective checkpointing (MFU without the recompute)
#   GPU 2: 4B full, Liger + pixels + kv_cache beside TRL (Liger): the other 4B lever set
#   GPU 3: 2B compiled, selective checkpointing, TRL off
set -u
P=docs/benchmarks/runs/h100x2-session17/pair.sh
S="python -m trainer bench --only scale --out \$G"
bash "$P" "${1:-480}" \
  "python -m pytest -m gpu tests/gpu/test_vllm_gpu.py -k recorded_load -q -rA 2>&1 | tail -n 30; RM_BENCH_TRL=0 RM_BENCH_SCALE=8b-lora64-sleep2-util0.35 RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_SLEEP=2,kv_cache RM_BENCH_SCALE_STEPS=4 $S" \
  "RM_BENCH_TRL=0 RM_BENCH_SCALE=8b-lora64-sleep2-util0.35 RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_SLEEP=kv_cache RM_BENCH_SCALE_PACKING=8192 RM_BENCH_SCALE_CKPT=full,selective RM_BENCH_SCALE_STEPS=4 $S" \
  "RM_BENCH_SCALE=4b RM_BENCH_SCALE_LIGER=1 RM_BENCH_SCALE_PIXELS=1 RM_BENCH_SCALE_SLEEP=kv_cache RM_BENCH_SCALE_STEPS=4 $S" \
  "RM_BENCH_TRL=0 RM_BENCH_SCALE=2b RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_CKPT=selective RM_BENCH_SCALE_STEPS=4 $S"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 4
