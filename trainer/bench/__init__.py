"""``python -m trainer bench`` (``make bench``): the benchmarks behind ``docs/benchmarks/``.

* ``run TABLE [--only NAME,...]``: a table of configurations (``benchmarks/*.yaml``: a base trainer config and named
  variants, ``trainer.bench.table``) through one runner (``trainer.bench.runner``): layouts, ours beside TRL's
  GRPOTrainer, any lever; JSON records under ``--out``;
* ``plot``: the published PNGs redrawn from the JSON records (``trainer.bench.plots``);
* ``packing``: teacher-forced forward + backward, padded vs packed (``trainer.bench.packing``);
* ``vllm-images``: vLLM rollout speed on Qwen3-VL images, our engine vs plain vLLM (``trainer.bench.vllm_images``).

Without a subcommand (``make bench``): ``run benchmarks/cpu.yaml``, the tiny model end to end on any machine. The
modules are imported lazily, so ``python -m trainer --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CPU_TABLE = Path("benchmarks/cpu.yaml")


def _run_table(args: argparse.Namespace) -> int:
    from trainer.bench.runner import run
    from trainer.bench.table import BenchTableError, load_table

    path = Path(args.table)
    try:
        table = load_table(path)
        run(table, path, Path(args.out), only=args.only, work_dir=Path(args.work) if args.work else None)
    except BenchTableError as exc:
        print(f"bench run: {exc}")
        return 2
    return 0


def _plot(args: argparse.Namespace) -> int:
    from trainer.bench.plots import plot_all

    for path in plot_all(args.records, args.out):
        print(path)
    return 0


def _packing(args: argparse.Namespace) -> int:
    import torch

    from trainer.bench.packing import QWEN3_0_6B, TINY, plot, run_bench

    if not args.quick and not torch.cuda.is_available():
        print("bench packing: the figure needs a CUDA GPU (the Qwen3-0.6B shape); `--quick` runs a tiny model on the CPU")
        return 2
    if args.quick:
        result = run_bench(TINY, micro_batch=2, segments=8, wide=4, min_len=16, max_len=64, repeats=1)
    else:
        result = run_bench(QWEN3_0_6B, args.micro_batch, args.segments, args.wide, args.min_len, args.max_len,
                           args.repeats, gradient_checkpointing=not args.no_gradient_checkpointing,
                           compile_layers=not args.no_compile)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "packing.png")
    for r in result["results"]:
        print(f"{r['variant']:40s} " + (r["error"] if "error" in r else
              f"{r['real_tokens_per_s']:10.0f} tok/s  x{r['speedup_vs_padded_full']:.2f}  peak {r['peak_gib']} GiB"))
    return 0


def _vllm_images(args: argparse.Namespace) -> int:
    from trainer.bench.vllm_images import run as run_vllm_images

    requests = tuple(int(n) for n in args.requests.split(",")) if args.requests else None
    run_vllm_images(Path(args.out), size=args.size, requests=requests, new_tokens=args.new_tokens,
                    pixel_threads=args.pixel_threads, plain=not args.no_plain)
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "action", None) is None:  # make bench: the CPU table, end to end
        args = argparse.Namespace(table=str(CPU_TABLE), only=None, out=args.out, work=None)
        return _run_table(args)
    return args.action(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: tables of configurations (run), plots, packing, vLLM images")
    p.add_argument("--out", default="runs/bench", help="where JSON records are written (default: runs/bench)")
    p.set_defaults(func=run, action=None)
    sub = p.add_subparsers(dest="bench_command")
    r = sub.add_parser("run", help="run a benchmark table (benchmarks/*.yaml): a base config and named variants")
    r.add_argument("table", help="the table's YAML file, e.g. benchmarks/layouts.yaml")
    r.add_argument("--only", default=None, help="comma-separated variant names, run in that order")
    r.add_argument("--out", default="runs/bench", help="where <table>.json is written")
    r.add_argument("--work", default=None, help="model, run and log directories (default: /tmp/rm-bench/<table>)")
    r.set_defaults(action=_run_table)
    pl = sub.add_parser("plot", help="redraw the published PNGs from the JSON records")
    pl.add_argument("--records", default="docs/benchmarks", help="directory of the JSON records")
    pl.add_argument("--out", default=None, help="where the PNGs go (default: beside the records)")
    pl.set_defaults(action=_plot)
    pk = sub.add_parser("packing", help="teacher-forced forward + backward, padded vs packed rows (GPU; --quick: CPU)")
    pk.add_argument("--out", default="runs/bench")
    pk.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    pk.add_argument("--micro-batch", type=int, default=4)
    pk.add_argument("--segments", type=int, default=32, help="targets trained per timed pass")
    pk.add_argument("--wide", type=int, default=16, help="segments per forward of the wide variants")
    pk.add_argument("--min-len", type=int, default=300)
    pk.add_argument("--max-len", type=int, default=2000)
    pk.add_argument("--repeats", type=int, default=3)
    pk.add_argument("--no-gradient-checkpointing", action="store_true")
    pk.add_argument("--no-compile", action="store_true", help="skip the compiled-decoder-layer variants")
    pk.set_defaults(action=_packing)
    v = sub.add_parser("vllm-images", help="vLLM rollout speed on Qwen3-VL with 1024 px images (GPU + vLLM)")
    v.add_argument("--out", default="runs/bench")
    v.add_argument("--size", choices=("2b", "4b", "8b"), default="2b")
    v.add_argument("--requests", default=None, help="comma-separated records per decode (default 32)")
    v.add_argument("--new-tokens", type=int, default=None, help="greedy new tokens per record (default 1024)")
    v.add_argument("--pixel-threads", default="",
                   help="also decode beside the training-pixel thread: comma-separated default | N threads")
    v.add_argument("--no-plain", action="store_true", help="leave plain vLLM out")
    v.set_defaults(action=_vllm_images)
