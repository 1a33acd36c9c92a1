"""Command line: ``python -m trainer COMMAND``; ``--help`` lists every registered command in plain text.

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
                   "deploy": "trainer.deploy.cli",
                   "demo": "trainer.demo",
                   "bench": "trainer.bench"}


DESCRIPTION = "Stage-2 rollout-matching SFT and GRPO of Qwen3-VL-style models."


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser, or with ``command`` only the module owning it (when known). The description
    lists the commands registered here, so ``--help`` cannot leave one out."""
    parser = argparse.ArgumentParser(prog="python -m trainer", description=DESCRIPTION)
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
    parser.description = (f"{DESCRIPTION} Commands: {', '.join(subparsers.choices)}. "
                          "Run python -m trainer COMMAND --help for one command's options.")
    _plain_text(parser)
    return parser


def _plain_text(parser: argparse.ArgumentParser) -> None:
    """Help in plain text: the docstrings some commands take their descriptions from mark literals with reST's
    double backticks, which ``--help`` shows without them."""
    parser.description = parser.description.replace("``", "") if parser.description else parser.description
    parser.epilog = parser.epilog.replace("``", "") if parser.epilog else parser.epilog
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = action.help.replace("``", "")
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if isinstance(choice.help, str):
                    choice.help = choice.help.replace("``", "")
            for sub in dict.fromkeys(action.choices.values()):
                _plain_text(sub)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
