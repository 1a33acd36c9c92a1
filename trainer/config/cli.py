"""``python -m trainer validate CONFIG``: resolve, validate and print the config, after checking what it needs of
this machine (``trainer.config.preflight``: paths, installed extras, the backend); ``--schema-only`` skips that
check."""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from trainer.config.errors import ConfigErrors
from trainer.config.schema import TrainConfig, load_config


def is_rank_zero(environ: dict[str, str] | None = None) -> bool:
    """Whether this process prints what every rank would: ``RANK`` (else ``LOCAL_RANK``) is unset or 0."""
    env = os.environ if environ is None else environ
    rank = env.get("RANK", env.get("LOCAL_RANK", "0")).strip() or "0"
    return rank == "0"


def report(lines: list[str], quiet: bool = False) -> None:
    """Each problem as one ``error:`` line on stderr (nothing when ``quiet``: a rank other than 0)."""
    if not quiet:
        for line in lines:
            print(f"error: {line}", file=sys.stderr)


def load_or_report(path: str, quiet: bool = False) -> TrainConfig | None:
    """The validated config, or ``None`` after printing every problem (one line each, with its key path)."""
    try:
        return load_config(path)
    except ConfigErrors as exc:
        report([str(e) for e in exc.errors], quiet)
        return None


def preflight_or_report(cfg: TrainConfig, quiet: bool = False, note: str = "") -> bool:
    """``True`` when this machine can run ``cfg``; else print every problem (one line each), then ``note`` when a
    path is among them, and return ``False``."""
    from trainer.config.preflight import preflight

    problems = preflight(cfg)
    report([str(p) for p in problems], quiet)
    if note and not quiet and any(p.kind == "path" for p in problems):
        print(f"note: {note}", file=sys.stderr)
    return not problems


def run(args: argparse.Namespace) -> int:
    cfg = load_or_report(args.config)
    if cfg is None:
        return 2
    if not args.schema_only and not preflight_or_report(
            cfg, note="a config for another machine (a pod's mounts): validate --schema-only checks its keys only"):
        return 2
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True), end="")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("validate", help="resolve extends, validate, check this machine, print the config",
                              description="Resolve extends, validate every key and rule, check what the config needs "
                              "of this machine (the data, image and model paths exist, the extras it needs are "
                              "installed, the rollout backend fits the machine), then print the resolved config. Each "
                              "problem is one line; exit code 2.")
    p.add_argument("config")
    p.add_argument("--schema-only", action="store_true",
                   help="check the keys and rules only, not this machine (a config for another machine, e.g. a "
                        "pod's, whose paths exist there)")
    p.set_defaults(func=run)
