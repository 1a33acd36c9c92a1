"""MkDocs hook: the reference pages generated from the code at build time, and stand-ins for pages other parts of
the project own when they are absent.

- ``reference/config.md``: every key of the config schema (``trainer.config.schema.TrainConfig``): key path, type,
  default, description (the field's ``description``, else its section's docstring).
- ``reference/cli.md``: every subcommand of ``python -m trainer`` (``trainer.cli.build_parser``), its help.
- ``reference/chart-values.md``: every value of ``charts/rollout-matching/values.schema.json`` with its default from
  ``values.yaml``.
- ``changelog.md``: the repository's ``CHANGELOG.md``.
- ``reference/rollout-protocol.md``: the request-body tables between its ``protocol-models`` markers.

The page builders are pure functions of the code (``config_reference()`` ...), so tests can call them. The reference
pages are also committed, generated, so that they read where the repository is browsed:
``python -m docs._hooks.reference`` (from the repository root, in the project's environment) writes them and
``--check`` lists the stale ones (``tests/docs/test_docs_reference.py`` fails on any). The site build regenerates
them either way.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rollout-matching"

# pages other engineers own: a stand-in is generated only while the file does not exist
OWNED_ELSEWHERE = {
    "guides/prepare-checkpoint.md": "Prepare a checkpoint",
    "guides/presets.md": "Presets",
    "guides/deployment.md": "Deployment",
    "benchmarks/index.md": "Benchmarks",
}
#: the command that rewrites the committed reference pages, from the repository root
REGENERATE = "python -m docs._hooks.reference"
GENERATED_NOTE = (f"<!-- generated from the code by docs/_hooks/reference.py: edit the code, then run `{REGENERATE}`; "
                  "not this page -->\n\n")


# --- config -------------------------------------------------------------------------------------------------------

def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`".replace("'", '"') for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (list, tuple, set):
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"list[{inner}]"
    if origin is dict:
        return f"dict[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _sections(annotation: Any) -> list[type]:
    import pydantic

    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _sections(a)]


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
        if hasattr(value, "model_dump"):
            return "(section)"
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{json.dumps(value, default=str)}`"


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("``", "`").replace("|", "\\|")


def _bounds(field: Any) -> str:
    """The field's numeric bounds (``ge``/``gt``/``le``/``lt``), e.g. ``>= 1, < 1``."""
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    found = [f"{signs[k]} {getattr(m, k)}" for m in field.metadata for k in signs if getattr(m, k, None) is not None]
    return ", ".join(found)


def _doc(cls: type) -> str:
    import pydantic

    doc = cls.__doc__ or ""
    if doc == (pydantic.BaseModel.__doc__ or "") or cls.__doc__ is None:
        return ""
    from trainer.config.base import Section

    return "" if doc == Section.__doc__ else " ".join(doc.split()).replace("``", "`")


def config_keys() -> list[tuple[str, type, str, Any]]:
    """``(section path, section class, key, field)`` for every leaf key of ``TrainConfig``, depth first."""
    from trainer.config.schema import TrainConfig

    out: list[tuple[str, type, str, Any]] = []

    def walk(prefix: str, model: type) -> None:
        leaves = []
        nested = []
        for name, field in model.model_fields.items():
            subs = _sections(field.annotation)
            (nested if subs else leaves).append((name, field, subs))
        for name, field, _ in leaves:
            out.append((prefix, model, name, field))
        for name, field, subs in nested:
            path = f"{prefix}.{name}" if prefix else name
            out.append((prefix, model, name, field))
            for sub in subs:
                walk(path, sub)

    walk("", TrainConfig)
    return out


def config_reference() -> str:
    from trainer.config.schema import TrainConfig

    lines = ["# Config reference", "", GENERATED_NOTE.strip(), "",
             "Every key of the training config, generated from the one schema (`trainer/config/schema.py` and the "
             "sections it includes). A config is YAML; `extends: base.yaml` (a path or a list, relative to the "
             "including file) merges mappings deeply and replaces lists. `python -m trainer validate CONFIG` "
             "prints the resolved config or every error with its key path. Unknown keys are errors.", ""]
    by_section: dict[str, tuple[type, list[tuple[str, Any]]]] = {}
    for prefix, model, name, field in config_keys():
        by_section.setdefault(prefix, (model, []))[1].append((name, field))
    for prefix, (model, fields) in by_section.items():
        title = prefix or "top level"
        lines += [f"## `{title}`" if prefix else "## Top level", ""]
        doc = _doc(model) if model is not TrainConfig else ""
        if doc:
            lines += [doc, ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for name, field in fields:
            path = f"{prefix}.{name}" if prefix else name
            subs = _sections(field.annotation)
            desc = field.description or ""
            if subs and not desc:
                desc = f"section: see `{path}` below"
            bounds = _bounds(field)
            if bounds:
                desc = f"{desc} ({bounds})" if desc else bounds
            lines.append(f"| `{path}` | {_type_name(field.annotation)} | {_default(field)} | {_cell(desc)} |")
        lines.append("")
    return "\n".join(lines)


# --- CLI ----------------------------------------------------------------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_commands() -> list[tuple[str, argparse.ArgumentParser]]:
    """``(command words, parser)`` for every (nested) subcommand of ``python -m trainer``."""
    from trainer.cli import build_parser

    out: list[tuple[str, argparse.ArgumentParser]] = []

    def walk(words: str, parser: argparse.ArgumentParser) -> None:
        for name, sub in _subparsers(parser).items():
            out.append((f"{words} {name}", sub))
            walk(f"{words} {name}", sub)

    walk("python -m trainer", build_parser())
    return out


def cli_reference() -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"
    try:
        lines = ["# CLI reference", "", GENERATED_NOTE.strip(), "",
                 "Every subcommand of `python -m trainer` (also installed as `rollout-matching`), with the help "
                 "its parser prints (`python -m trainer COMMAND --help`).", ""]
        for words, parser in cli_commands():
            depth = words.count(" ") - 3
            lines += [f"{'#' * min(2 + depth, 4)} `{words}`", "", "```text", parser.format_help().rstrip(), "```", ""]
        return "\n".join(lines)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


# --- chart values -------------------------------------------------------------------------------------------------

def chart_values() -> list[tuple[str, str, Any, str]]:
    """``(value path, type, default, description)`` for every value the chart's schema names."""
    import yaml

    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text()) or {}
    out: list[tuple[str, str, Any, str]] = []
    missing = object()

    def default_at(path: list[str]) -> Any:
        node: Any = defaults
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return missing
            node = node[part]
        return node

    def type_of(node: dict[str, Any]) -> str:
        if "enum" in node:
            return " \\| ".join(f"`{json.dumps(v)}`" for v in node["enum"])
        kind = node.get("type")
        if isinstance(kind, list):
            return " \\| ".join(kind)
        if kind == "array" and isinstance(node.get("items"), dict) and node["items"].get("type"):
            return f"array of {node['items']['type']}"
        if kind is None and ("anyOf" in node or "oneOf" in node):
            return " \\| ".join(type_of(n) for n in node.get("anyOf", node.get("oneOf")))
        return kind or "any"

    def walk(path: list[str], node: dict[str, Any]) -> None:
        props = node.get("properties")
        if path:
            value = default_at(path)
            shown = "" if value is missing else (f"`{json.dumps(value)}`" if not isinstance(value, dict) or
                                                 not props else "(section)")
            out.append((".".join(path), type_of(node), shown, node.get("description", "")))
        for name, child in (props or {}).items():
            walk([*path, name], child)

    walk([], schema)
    return out


def chart_values_reference() -> str:
    lines = ["# Chart values reference", "", GENERATED_NOTE.strip(), "",
             "Every value of the Helm chart `charts/rollout-matching`, from its `values.schema.json` (Helm validates "
             "values against it at install and render); defaults from its `values.yaml`. The presets "
             "(`presets/*.values.yaml`, one per node layout) set a subset of these; "
             "see the [deployment guide](../guides/deployment.md).", "",
             "| value | type | default | description |", "|---|---|---|---|"]
    for path, kind, default, desc in chart_values():
        shown = default if len(default) <= 80 else default[:77] + "…`"
        lines.append(f"| `{path}` | {kind} | {shown} | {_cell(desc)} |")
    return "\n".join(lines) + "\n"


# --- pages owned elsewhere ----------------------------------------------------------------------------------------

def changelog_page() -> str:
    path = REPO / "CHANGELOG.md"
    if path.is_file():  # its links are relative to the repository root; the page sits at the docs root
        return path.read_text().replace("](docs/", "](")
    return "# Changelog\n\nThe dated history of the project lives in `CHANGELOG.md` at the repository root.\n"


def placeholder(title: str) -> str:
    return f"# {title}\n\nThis page is being written.\n"


# --- rollout protocol bodies -----------------------------------------------------------------------------------------

PROTOCOL_MARKER = "<!-- generated: protocol-models -->"
PROTOCOL_END = "<!-- end generated: protocol-models -->"
PROTOCOL_PAGE = "reference/rollout-protocol.md"


def protocol_models() -> str:
    """A table per request-body model of ``trainer/server/protocol.py``: field, type, default."""
    import pydantic

    from trainer.server import protocol

    out = []
    models = [m for name, m in vars(protocol).items()
              if isinstance(m, type) and issubclass(m, pydantic.BaseModel) and m.__module__ == protocol.__name__
              and not name.startswith("_")]
    for model in models:
        strict = model.model_config.get("extra") == "forbid"
        doc = _doc(model)
        out += [f"### `{model.__name__}`", ""]
        if doc:
            out += [doc, ""]
        out += [f"Unknown keys: {'refused (422)' if strict else 'ignored'}.", "",
                "| field | type | default |", "|---|---|---|"]
        for name, field in model.model_fields.items():
            out.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} |")
        out.append("")
    return "\n".join(out)


def with_protocol_models(markdown: str) -> str:
    """``markdown`` with the request-body tables, freshly generated, between its protocol-models markers (a page
    with the opening marker alone gets the closing one too); a page without the marker is returned as it is."""
    if PROTOCOL_MARKER not in markdown:
        return markdown
    before, rest = markdown.split(PROTOCOL_MARKER, 1)
    after = rest.split(PROTOCOL_END, 1)[1] if PROTOCOL_END in rest else rest
    generated = GENERATED_NOTE.strip() + "\n\n" + protocol_models().rstrip("\n") + "\n\n"
    return f"{before}{PROTOCOL_MARKER}\n{generated}{PROTOCOL_END}{after}"


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001 (MkDocs hook signature)
    return with_protocol_models(markdown)


# --- MkDocs hook --------------------------------------------------------------------------------------------------

def reference_pages() -> dict[str, str]:
    """The generated reference pages, as committed under docs/."""
    return {"reference/config.md": config_reference(), "reference/cli.md": cli_reference(),
            "reference/chart-values.md": chart_values_reference()}


def generated_pages() -> dict[str, str]:
    return {**reference_pages(), "changelog.md": changelog_page()}


def committed_pages(docs_dir: Path) -> dict[str, str]:
    """Every page under ``docs_dir`` that is generated in whole or in part, as it should read."""
    pages = reference_pages()
    protocol = docs_dir / PROTOCOL_PAGE
    if protocol.is_file():
        pages[PROTOCOL_PAGE] = with_protocol_models(protocol.read_text())
    return pages


def stale_pages(docs_dir: Path = REPO / "docs") -> list[str]:
    """The generated pages under ``docs_dir`` that are missing or differ from what the code generates."""
    return [uri for uri, text in committed_pages(docs_dir).items()
            if not (docs_dir / uri).is_file() or (docs_dir / uri).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=REGENERATE, description="write the generated reference pages under docs/")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming every stale page")
    p.add_argument("--docs-dir", type=Path, default=REPO / "docs", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check:
        bad = stale_pages(args.docs_dir)
        for uri in bad:
            print(f"docs/{uri} differs from what the code generates: run `{REGENERATE}`", file=sys.stderr)
        return 1 if bad else 0
    for uri, text in committed_pages(args.docs_dir).items():
        path = args.docs_dir / uri
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote docs/{uri}")
    return 0


def pages_for(docs_dir: Path) -> dict[str, str]:
    """Every page the hook adds to ``docs_dir``: the generated ones, and a stand-in for each page owned elsewhere
    that does not exist (an existing page is never replaced)."""
    pages = generated_pages()
    pages.update({uri: placeholder(title) for uri, title in OWNED_ELSEWHERE.items() if not (docs_dir / uri).is_file()})
    return pages


def on_files(files, config):  # noqa: ANN001 (MkDocs hook signature)
    from mkdocs.structure.files import File

    for uri, content in pages_for(Path(config["docs_dir"])).items():
        existing = files.get_file_from_path(uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, uri, content=content))
    return files


if __name__ == "__main__":
    sys.exit(main())
