"""The generated reference pages (docs/_hooks/reference.py) cover everything they are generated from: every key of
the config schema, every subcommand of the CLI, every value of the chart's schema, every rollout-protocol body; the
committed pages are what the code generates today (``python -m docs._hooks.reference`` rewrites them); and the
stand-ins for pages other parts of the project own appear only while those pages are missing."""

from __future__ import annotations

import importlib.util
import json

import pydantic

from tests.docs.docs_helpers import REPO

spec = importlib.util.spec_from_file_location("docs_reference_hook", REPO / "docs" / "_hooks" / "reference.py")
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)


def schema_paths(model: type[pydantic.BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        out.add(path)
        for sub in hook._sections(field.annotation):
            out |= schema_paths(sub, path)
    return out


def test_config_reference_lists_every_key_with_its_default():
    from trainer.config.schema import TrainConfig

    page = hook.config_reference()
    paths = schema_paths(TrainConfig)
    assert len(paths) > 150
    missing = sorted(p for p in paths if f"| `{p}` |" not in page)
    assert not missing, missing
    row = next(line for line in page.splitlines() if line.startswith("| `training.packing_length` |"))
    assert "`null`" in row and ">= 16" in row
    row = next(line for line in page.splitlines() if line.startswith("| `training.gradient_checkpointing_policy` |"))
    assert '`"auto"`' in row and "activation estimate" in row, "type and the field's description"


def test_cli_reference_lists_every_subcommand():
    import argparse

    from trainer.cli import build_parser

    page = hook.cli_reference()

    def walk(words, parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield f"{words} {name}", sub
                    yield from walk(f"{words} {name}", sub)

    commands = list(walk("python -m trainer", build_parser()))
    assert {"python -m trainer train", "python -m trainer data import", "python -m trainer launch learner"} <= \
        {w for w, _ in commands}
    for words, _ in commands:
        assert f"`{words}`" in page, words
    assert "--resume-from-checkpoint" in page


def test_chart_values_reference_lists_every_schema_value():
    schema = json.loads((REPO / "charts" / "rollout-matching" / "values.schema.json").read_text())
    page = hook.chart_values_reference()

    def walk(prefix, node):
        for name, child in node.get("properties", {}).items():
            path = f"{prefix}.{name}" if prefix else name
            yield path
            yield from walk(path, child)

    paths = list(walk("", schema))
    assert len(paths) > 20
    missing = [p for p in paths if f"| `{p}` |" not in page]
    assert not missing, missing


def test_protocol_bodies_are_generated_into_the_protocol_page():
    page = (REPO / "docs" / "reference" / "rollout-protocol.md").read_text()
    assert page.count(hook.PROTOCOL_MARKER) == 1 and page.count(hook.PROTOCOL_END) == 1
    out = hook.on_page_markdown(page, None, None, None)
    for model in ("InferBody", "RolloutInferRequestIn", "RequestConfigIn", "InitCommunicatorBody"):
        assert f"### `{model}`" in out, model
    assert "| `max_tokens` |" in out
    assert out.startswith(page.split(hook.PROTOCOL_MARKER)[0]) and out.endswith(page.split(hook.PROTOCOL_END)[1])
    bare = page.split(hook.PROTOCOL_MARKER)[0] + hook.PROTOCOL_MARKER + "\n"
    assert hook.with_protocol_models(bare) == hook.with_protocol_models(out), "one marker is filled in the same way"


def test_the_committed_reference_pages_are_what_the_code_generates():
    stale = hook.stale_pages()
    assert not stale, (f"stale generated pages {', '.join('docs/' + u for u in stale)}: run "
                       f"`{hook.REGENERATE}` from the repository root (with .venv/bin/python) and commit them")


def test_a_changed_schema_makes_its_page_stale(tmp_path, monkeypatch):
    for uri, text in hook.committed_pages(REPO / "docs").items():
        (tmp_path / uri).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / uri).write_text(text)
    assert hook.stale_pages(tmp_path) == []
    real = hook.config_reference
    monkeypatch.setattr(hook, "config_reference", lambda: real() + "| `training.new_key` | int | `1` | new |\n")
    assert hook.stale_pages(tmp_path) == ["reference/config.md"]
    assert hook.main(["--check", "--docs-dir", str(tmp_path)]) == 1
    assert hook.main(["--docs-dir", str(tmp_path)]) == 0
    assert hook.stale_pages(tmp_path) == [] and "training.new_key" in (tmp_path / "reference/config.md").read_text()


def test_stand_ins_only_for_missing_pages(tmp_path):
    (tmp_path / "guides").mkdir()
    (tmp_path / "guides" / "presets.md").write_text("# Presets, the real page\n")
    pages = hook.pages_for(tmp_path)
    assert "guides/presets.md" not in pages, "an existing page is never replaced"
    assert pages["guides/prepare-checkpoint.md"].startswith("# Prepare a checkpoint")
    assert {"reference/config.md", "reference/cli.md", "reference/chart-values.md", "changelog.md"} <= set(pages)
    stubbed = hook.pages_for(REPO / "docs")
    assert stubbed["reference/config.md"].startswith("# Config reference\n\n<!-- generated"), \
        "the generated page replaces the stub in the repository"
