"""``python -m trainer data COMMAND``: dataset tools. Each data subcommand lives in the module owning its concept
(listed in ``SUBCOMMAND_MODULES``) and exposes ``register(data_subparsers)``."""

from __future__ import annotations

import argparse
import importlib

SUBCOMMAND_MODULES = ["trainer.data.convert", "trainer.data.check"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("data", help="dataset tools: import COCO/LVIS/ODVG, export to COCO, check records")
    data_subparsers = p.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    data_subparsers.required = True
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(data_subparsers)
