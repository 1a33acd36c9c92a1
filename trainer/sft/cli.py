"""``python -m trainer train --config CONFIG``."""

from __future__ import annotations

import argparse
import logging
import sys

from trainer.config.cli import is_rank_zero, load_or_report, preflight_or_report, report


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet = not is_rank_zero()  # under torchrun every rank finds the same problems: rank 0 prints them
    cfg = load_or_report(args.config, quiet=quiet)
    if cfg is None:
        return 2
    if args.output_dir:
        cfg.training.output_dir = args.output_dir
    if args.max_steps is not None:
        cfg.training.max_steps = args.max_steps
    if not preflight_or_report(cfg, quiet=quiet):  # before any model loads; every rank exits 2
        return 2
    from trainer.data.records import DatasetError
    from trainer.modeling.loading import ModelPathError
    from trainer.sft.run import run_training
    from trainer.sync.update_check import NonFiniteWeightsError

    try:
        summary = run_training(cfg, resume_from_checkpoint=args.resume_from_checkpoint)
    except NonFiniteWeightsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except ModelPathError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DatasetError as exc:  # bad records: the training records are read before the model loads
        report([str(exc)], quiet)
        return 2
    print(f"done: {summary.stage2_steps} stage-2 steps, outputs in {summary.output_dir}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # every rank leaves the group before the interpreter exits
        dist.barrier()
        dist.destroy_process_group()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="run stage-2 rollout-matching SFT from a YAML config")
    p.add_argument("--config", required=True)
    p.add_argument("--output-dir", default=None, help="override training.output_dir")
    p.add_argument("--max-steps", type=int, default=None, help="override training.max_steps")
    p.add_argument("--resume-from-checkpoint", default=None, metavar="PATH|latest",
                   help="resume stage 2 exactly (model, optimizer, RNG, data position, rollout + packing buffers)")
    p.set_defaults(func=run)
