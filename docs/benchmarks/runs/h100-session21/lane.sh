#!/usr/bin/env bash
# Session 21 (one H100 80GB, nvidia-h100-x1): one bench per call on the single card, through
# ../h100x2-session17/pair.sh with one spec (GPU 0). Each call is named by its argument:
#   bash lane.sh LIMIT 4b-4k-timing   # 4B compiled, 4k rows, no checkpointing: phase_timing events beside sync, step 4 profiled
#   bash lane.sh LIMIT 4b-16k-timing  # the same at 16k rows with full checkpointing
#   bash lane.sh LIMIT 4b-4k-host     # (next session) 4k rows, no checkpointing: host_vision_metadata on beside off
#   bash lane.sh LIMIT "<spec>"       # any other bench command
set -u
P=docs/benchmarks/runs/h100x2-session17/pair.sh
S="python -m trainer bench --only scale --out \$G"
T="RM_BENCH_TRL=0 RM_BENCH_SCALE=4b RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_PHASE_TIMING=events,sync RM_BENCH_SCALE_PROFILE=4 RM_BENCH_SCALE_STEPS=4"
case "$2" in
  4b-4k-timing) spec="$T RM_BENCH_SCALE_PACKING=4096 RM_BENCH_SCALE_CKPT=off $S" ;;
  4b-16k-timing) spec="$T RM_BENCH_SCALE_PACKING=16384 $S" ;;
  4b-4k-host) spec="RM_BENCH_TRL=0 RM_BENCH_SCALE=4b RM_BENCH_SCALE_COMPILE=1 RM_BENCH_SCALE_HOST_VISION=1,0 RM_BENCH_SCALE_PROFILE=4 RM_BENCH_SCALE_STEPS=4 RM_BENCH_SCALE_PACKING=4096 RM_BENCH_SCALE_CKPT=off $S" ;;
  *) spec="$2" ;;
esac
bash "$P" "$1" "$spec"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
