"""``python -m trainer validate CONFIG``: resolve, validate and print the config."""

from __future__ import annotations

import argparse
import sys

import yaml

from trainer.config.errors import ConfigErrors
from trainer.config.schema import load_config


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigErrors as exc:
        print(exc, file=sys.stderr)
        return 2
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True), end="")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("validate", help="resolve extends, validate and print the config")
    p.add_argument("config")
    p.set_defaults(func=run)
