#!/usr/bin/env bash
# Session 20 (one H100 80GB, nvidia-h100-x1): one bench per call on the single card, through
# ../h100x2-session17/pair.sh with one spec (GPU 0). Each call is named by its argument:
#   bash lane.sh LIMIT 2b-pair   # 2B full, compile + pixels during decode + kv_cache sleep, beside TRL (Liger)
#   bash lane.sh LIMIT 4b-pair   # 4B full, the same levers, beside TRL (Liger)
#   bash lane.sh LIMIT <other>   # see the case below
set -u
P=docs/benchmarks/runs/h100x2-session17/pair.sh
S="python -m trainer bench --only scale --out \$G"
L="RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PIXELS=1 RM_BENCH_SCALE_SLEEP=kv_cache RM_BENCH_SCALE_STEPS=4"
case "$2" in
  2b-pair) spec="RM_BENCH_SCALE=2b $L $S" ;;
  4b-pair) spec="RM_BENCH_SCALE=4b $L $S" ;;
  8b-pair) spec="RM_BENCH_SCALE=8b-lora64-sleep2-util0.35 RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PIXELS=1 RM_BENCH_SCALE_RECLOAD=1 RM_BENCH_SCALE_STEPS=4 $S" ;;
  4b-mfu) spec="RM_BENCH_TRL=0 RM_BENCH_SCALE=4b RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PACKING=8192 RM_BENCH_SCALE_CKPT=selective,auto RM_BENCH_SCALE_STEPS=4 $S" ;;
  *) spec="$2" ;;
esac
bash "$P" "$1" "$spec"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
