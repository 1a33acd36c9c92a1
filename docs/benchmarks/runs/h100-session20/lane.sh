#!/usr/bin/env bash
# Session 20 (one H100 80GB, nvidia-h100-x1): one bench per call on the single card, through
# ../h100x2-session17/pair.sh with one spec (GPU 0). Each call is named by its argument:
#   bash lane.sh LIMIT 2b-pair   # 2B full, compile + pixels during decode + kv_cache sleep, beside TRL (Liger)
#   bash lane.sh LIMIT 4b-pair   # 4B full, the same levers, beside TRL (Liger)
#   bash lane.sh LIMIT 8b-pair   # 8B LoRA r64 at sleep level 2, compile + pixels + recorded load, beside TRL
#   bash lane.sh LIMIT 8b-kv-pair  # the same with the kv_cache sleep (does it fit 80 GB?)
#   bash lane.sh LIMIT 4b-off4k  # 4B compiled at 4k rows, no checkpointing beside auto, TRL off
#   bash lane.sh LIMIT "<spec>"  # any other bench command (call 4: 4B selective at 8k rows)
set -u
P=docs/benchmarks/runs/h100x2-session17/pair.sh
S="python -m trainer bench --only scale --out \$G"
L="RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PIXELS=1 RM_BENCH_SCALE_SLEEP=kv_cache RM_BENCH_SCALE_STEPS=4"
case "$2" in
  2b-pair) spec="RM_BENCH_SCALE=2b $L $S" ;;
  4b-pair) spec="RM_BENCH_SCALE=4b $L $S" ;;
  8b-pair) spec="RM_BENCH_SCALE=8b-lora64-sleep2-util0.35 RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PIXELS=1 RM_BENCH_SCALE_RECLOAD=1 RM_BENCH_SCALE_STEPS=4 $S" ;;
  8b-kv-pair) spec="RM_BENCH_SCALE=8b-lora64-sleep2-util0.35 RM_BENCH_SCALE_SLEEP=kv_cache RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PIXELS=1 RM_BENCH_SCALE_RECLOAD=1 RM_BENCH_SCALE_STEPS=4 $S" ;;
  4b-off4k) spec="RM_BENCH_TRL=0 RM_BENCH_SCALE=4b RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PACKING=4096 RM_BENCH_SCALE_CKPT=off,auto RM_BENCH_SCALE_STEPS=4 $S" ;;
  4b-mfu) spec="RM_BENCH_TRL=0 RM_BENCH_SCALE=4b RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PACKING=8192 RM_BENCH_SCALE_CKPT=selective,auto RM_BENCH_SCALE_STEPS=4 $S" ;;
  *) spec="$2" ;;
esac
bash "$P" "$1" "$spec"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
