"""Command line: ``python -m trainer {train,eval,validate,data,model,serve,launch,render-job,demo,bench}``.

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
    "trainer.evaluation.cli",
    "trainer.data.cli",
    "trainer.modeling.cli",
    "trainer.server.cli",
    "trainer.launch.cli",
    "trainer.deploy.cli",
    "trainer.demo",
    "trainer.bench",
)
# the module owning each subcommand: ``main`` imports only that one (a server or benchmark machine needs none of
# the other subcommands' dependencies, e.g. scipy for ``bench``)
COMMAND_MODULES = {"validate": "trainer.config.cli", "train": "trainer.sft.cli", "eval": "trainer.evaluation.cli",
                   "data": "trainer.data.cli", "model": "trainer.modeling.cli",
                   "serve": "trainer.server.cli",
                   "launch": "trainer.launch.cli", "render-job": "trainer.deploy.cli", "supervise": "trainer.deploy.cli",
                   "demo": "trainer.demo",
                   "bench": "trainer.bench"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser, or with ``command`` only the module owning it (when known)."""
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    modules = (COMMAND_MODULES[command],) if command in COMMAND_MODULES else SUBCOMMAND_MODULES
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
