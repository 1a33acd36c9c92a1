#!/usr/bin/env bash
# Session 19, call 1 on a four-GPU machine: four benches at once, one per card (../h100x2-session17/pair.sh).
#   GPU 0: 8B LoRA with every lever that measured a gain (compile, kv_cache sleep, pixels during decode, recorded
#          load) beside TRL (Liger); TRL's side now bans the vision tokens
#   GPU 1: 4B full, compile + pixels + kv_cache, beside TRL (Liger)
#   GPU 2: 2B full, compile + pixels + kv_cache, beside TRL (Liger)
#   GPU 3: 4B compiled, 8k rows, full beside selective checkpointing (the MFU lever pair), TRL off
set -u
P=docs/benchmarks/runs/h100x2-session17/pair.sh
S="python -m trainer bench --only scale --out \$G"
L="RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PIXELS=1 RM_BENCH_SCALE_SLEEP=kv_cache RM_BENCH_SCALE_STEPS=4"
bash "$P" "${1:-560}" \
  "RM_BENCH_SCALE=8b-lora64-sleep2-util0.35 RM_BENCH_SCALE_RECLOAD=1 $L $S" \
  "RM_BENCH_SCALE=4b $L $S" \
  "RM_BENCH_SCALE=2b $L $S" \
  "RM_BENCH_TRL=0 RM_BENCH_SCALE=4b RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PACKING=8192 RM_BENCH_SCALE_CKPT=full,selective RM_BENCH_SCALE_STEPS=4 $S"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 4
