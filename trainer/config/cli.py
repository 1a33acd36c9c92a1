"""``python -m trainer validate CONFIG``: resolve, validate and print the config."""

from __future__ import annotations

import argparse
import sys

import yaml

from trainer.config.errors import ConfigErrors
from trainer.config.schema import TrainConfig, load_config


def load_or_report(path: str) -> TrainConfig | None:
    """The validated config, or ``None`` after printing every problem (key paths) to stderr."""
    try:
        return load_config(path)
    except ConfigErrors as exc:
        print(exc, file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    cfg = load_or_report(args.config)
    if cfg is None:
        return 2
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True), end="")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("validate", help="resolve extends, validate and print the config")
    p.add_argument("config")
    p.set_defaults(func=run)
