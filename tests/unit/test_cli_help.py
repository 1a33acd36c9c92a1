"""``python -m trainer --help`` is plain text and names every command it registers; ``python -m trainer COMMAND``
imports the module that registers that command."""

from __future__ import annotations

import argparse
import importlib

import pytest

from trainer.cli import COMMAND_MODULES, SUBCOMMAND_MODULES, build_parser, main


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_registered_command_in_plain_text(capsys):
    commands = _commands(build_parser())
    assert {"validate", "train", "launch", "supervise", "render-job", "demo"} <= set(commands)
    out = _help([], capsys)
    assert "``" not in out
    listed = out.split("Commands:", 1)[1].split(".", 1)[0]
    assert [c.strip() for c in " ".join(listed.split()).split(",")] == commands


@pytest.mark.parametrize("command", ["launch", "serve", "validate", "train"])
def test_a_commands_help_is_plain_text_too(command, capsys):
    out = _help([command], capsys)
    assert "``" not in out and f"python -m trainer {command}" in out


def test_each_command_maps_to_the_module_that_registers_it():
    owners: dict[str, str] = {}
    for name in SUBCOMMAND_MODULES:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers()
        importlib.import_module(name).register(sub)
        owners.update(dict.fromkeys(sub.choices, name))
    assert owners == COMMAND_MODULES
