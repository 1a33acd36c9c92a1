"""Command line: ``python -m trainer {train,validate,serve,launch,render-job,demo,bench}``.

Each subcommand lives in the module that owns its concept and exposes ``register(subparsers)``;
this file only wires them together, importing lazily so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = (
    "trainer.config.cli",
    "trainer.sft.cli",
    "trainer.server.cli",
    "trainer.launch.cli",
    "trainer.deploy.cli",
    "trainer.demo",
    "trainer.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
