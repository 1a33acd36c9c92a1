"""``python -m trainer eval --config CONFIG [--checkpoint DIR|latest] [--split FILE.jsonl] [--out DIR]``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from trainer.config.cli import load_or_report
    from trainer.data.records import DatasetError
    from trainer.evaluation.run import EvalSetupError, evaluate_config, write_eval
    from trainer.modeling.loading import ModelPathError

    cfg = load_or_report(args.config)
    if cfg is None:
        return 2
    try:
        result, title = evaluate_config(cfg, args.checkpoint, args.split)
    except (EvalSetupError, ModelPathError, DatasetError) as exc:  # bad records: the split is read before the model
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = "base" if args.checkpoint is None else Path(title).name
    out = Path(args.out) if args.out else Path(cfg.training.output_dir) / "eval" / name
    paths = write_eval(out, result, title)
    print(paths["markdown"].read_text())
    print(f"metrics: {paths['json']}\nper-sample results: {paths['samples']}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="greedy rollouts on a held-out split → detection metrics (P/R/F1, COCO AP)")
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", default=None, metavar="DIR|latest",
                   help="a saved model or peft adapter directory, or 'latest' (output_dir/final, else the newest "
                        "output_dir/stage2/checkpoint-*); default: the configured model as is")
    p.add_argument("--split", default=None, metavar="FILE.jsonl",
                   help="held-out records (default: data.eval_jsonl or the synthetic eval split)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where metrics.json, metrics.md and samples.jsonl go (default: output_dir/eval/<checkpoint>)")
    p.set_defaults(func=run)
