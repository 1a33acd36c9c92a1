"""A rollout server for the fleet benchmark's fault runs: ``python -m trainer serve`` with one injectable fault.

    python -m trainer.bench.fleet_server --nan-trigger FILE serve --engine vllm ...

Exactly ``python -m trainer serve`` (same engines, checks and protocol), except that while ``FILE`` exists the next
full weight update this server receives gets a NaN written into its first floating tensor before the engine's own
checks see it, and ``FILE`` is removed. The server's real update check then refuses it (HTTP 422), which is the
fault the benchmark studies: one server of the fleet refusing one update. Not for production use.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def poison_first_floating(tensors: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A shallow copy of ``tensors`` whose first floating tensor (in name order) holds a NaN at element 0; the
    name, or ``None`` when no tensor is floating. The caller's tensors are left untouched."""
    name = next((k for k in sorted(tensors) if tensors[k].is_floating_point() and tensors[k].numel()), None)
    if name is None:
        return dict(tensors), None
    bad = tensors[name].clone()
    bad.view(-1)[0] = float("nan")
    return {**tensors, name: bad}, name


def poison_when_triggered(load_full: Callable[[dict[str, Any]], Any], trigger: Path) -> Callable[[dict[str, Any]], Any]:
    """Wrap an engine's ``load_full``: once per ``trigger`` file, the update it is given carries a NaN."""

    @functools.wraps(load_full)
    def load(tensors: dict[str, Any]) -> Any:
        if trigger.exists():
            trigger.unlink(missing_ok=True)
            tensors, name = poison_first_floating(tensors)
            log.warning("fault injection: NaN written into %s of this full update", name)
        return load_full(tensors)

    return load


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m trainer.bench.fleet_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nan-trigger", type=Path, required=True)
    parser.add_argument("serve", nargs=argparse.REMAINDER, help="serve ... (the arguments of python -m trainer serve)")
    args = parser.parse_args(argv)
    if not args.serve or args.serve[0] != "serve":
        parser.error("give the server's command after the options: serve --engine ...")
    from trainer.server import cli as serve_cli

    build = serve_cli.build_engine

    def build_with_fault(serve_args: argparse.Namespace):
        engine = build(serve_args)
        engine.load_full = poison_when_triggered(engine.load_full, args.nan_trigger)
        return engine

    serve_cli.build_engine = build_with_fault
    commands = argparse.ArgumentParser(prog="python -m trainer").add_subparsers()
    serve_cli.register(commands)
    serve_args = commands.choices["serve"].parse_args(args.serve[1:])
    return int(serve_args.func(serve_args) or 0)


if __name__ == "__main__":
    sys.exit(main())
