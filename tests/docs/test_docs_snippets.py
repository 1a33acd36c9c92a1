"""One source of truth: what the docs show is what the code accepts.

- every fenced ```yaml block in README.md and docs/ is a training config that validates with the schema (``extends``
  resolved against the repository as if the block were saved where its first-line comment says, else in configs/),
  unless marked ``<!-- fragment -->`` (it must still parse) or ``<!-- chart-values -->`` (rendered with the chart);
- every ``python -m trainer …`` (or ``torchrun … -m trainer …``) line of a fenced bash block parses with the real
  argument parser (``trainer.cli.build_parser``; nothing runs);
- every values file the docs name renders with the chart."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex

import pytest
import yaml

from tests.docs.docs_helpers import REPO, Block, all_blocks, doc_files, mirror_repo

YAML_BLOCKS = all_blocks("yaml")
BASH_BLOCKS = all_blocks("bash")


def saved_as(block: Block) -> str:
    """Where the block says it is saved (a first-line ``# configs/x.yaml`` comment), else ``configs/_snippet.yaml``."""
    first = block.text.splitlines()[0] if block.text.strip() else ""
    m = re.match(r"^#\s*(configs/[\w./-]+\.ya?ml)\s*$", first)
    return m.group(1) if m else "configs/_snippet.yaml"


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.where for b in YAML_BLOCKS])
def test_yaml_snippet_is_a_valid_config_or_a_marked_fragment(block, tmp_path):
    from trainer.config.errors import ConfigErrors
    from trainer.config.schema import load_config

    try:
        parsed = yaml.safe_load(block.text)
    except yaml.YAMLError as exc:
        pytest.fail(f"{block.where}: not YAML: {exc}")
    if block.marker in ("fragment", "no-check"):
        return
    if block.marker == "chart-values":
        from tests.deploy.deploy_helpers import load_values, manifests_of, render_chart
        from trainer.config.loader import deep_merge

        assert manifests_of(render_chart(deep_merge(load_values(None), parsed))), block.where
        return
    assert isinstance(parsed, dict), f"{block.where}: a config is a mapping (mark a fragment with <!-- fragment -->)"
    target = mirror_repo(tmp_path) / saved_as(block)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(block.text)
    try:
        load_config(target)
    except ConfigErrors as exc:
        pytest.fail(f"{block.where} does not validate (mark a fragment with <!-- fragment -->):\n{exc}")


def test_the_docs_have_config_snippets():
    assert sum(b.marker is None for b in YAML_BLOCKS) >= 3, [b.where for b in YAML_BLOCKS]


# --- python -m trainer … lines ---------------------------------------------------------------------------------

def shell_lines(text: str) -> list[str]:
    """The block's logical lines: continuations joined, comments dropped."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        if words:
            out.append(line)
    return out


def trainer_argv(line: str) -> list[str] | None:
    """The arguments after ``python -m trainer`` / ``torchrun … -m trainer`` on ``line`` (None: not such a line).
    Shell arithmetic ``$((…))`` stands for a number and ``$VAR`` for a value: both become ``1``."""
    if not re.search(r"-m\s+trainer(\s|$)", line):
        return None
    line = re.sub(r"\$\(\([^)]*\)\)", "1", line)
    line = re.sub(r"\$\{?[A-Za-z_]\w*\}?", "1", line)
    words = shlex.split(line, comments=True)
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "trainer":
            runner = words[i - 1] if i else ""
            if runner.endswith(("python", "python3")) or "torchrun" in words[:i]:
                rest = words[i + 2:]
                for j, w in enumerate(rest):
                    if w in ("&", "&&", ";", "|", "||", "<") or w.startswith((">", "2>")):
                        return rest[:j]
                return [w.rstrip("&") for w in rest]
    return None


COMMANDS = [(b, argv) for b in BASH_BLOCKS for line in shell_lines(b.text)
            if (argv := trainer_argv(line)) is not None]


def test_the_docs_have_trainer_commands():
    assert len(COMMANDS) >= 20, len(COMMANDS)
    assert {argv[0] for _, argv in COMMANDS} >= {"data", "validate", "train", "eval", "launch", "serve"}


def test_trainer_argv_reads_shell_lines():
    assert trainer_argv("CUDA_VISIBLE_DEVICES=$i python -m trainer serve --port $((8000 + i)) &") == \
        ["serve", "--port", "1"]
    assert trainer_argv("torchrun --nproc_per_node 4 -m trainer train --config my.yaml") == \
        ["train", "--config", "my.yaml"]
    assert trainer_argv("python -m trainer deploy render -f v.yaml > out.yaml") == ["deploy", "render", "-f", "v.yaml"]
    assert trainer_argv("python -m trainer.grpo.summary_data runs/x") is None
    assert trainer_argv("make demo   # = python -m trainer demo") is None


@pytest.fixture(scope="module")
def parser():
    from trainer.cli import build_parser

    return build_parser()


@pytest.mark.parametrize("block,argv", COMMANDS, ids=[f"{b.where}:{' '.join(a[:2])}" for b, a in COMMANDS])
def test_trainer_command_parses(block, argv, parser):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{block.where}: `python -m trainer {' '.join(argv)}` does not parse:\n{err.getvalue()}")
    assert isinstance(args, argparse.Namespace) and callable(getattr(args, "func", None))


def test_a_wrong_command_fails_the_check(parser):
    """The check can fail: a misspelt flag does not parse."""
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        parser.parse_args(["validate", "--confg", "x.yaml"])


# --- values files ----------------------------------------------------------------------------------------------

VALUES_NAME = re.compile(r"(?<![\w/.-])((?:presets|charts/rollout-matching)/[\w.-]+\.values\.yaml|values[\w.-]*\.yaml)")


def named_values_files() -> list[str]:
    names = set()
    for path in doc_files():
        names.update(VALUES_NAME.findall(path.read_text()))
    names.discard("values.yaml")  # the chart's own defaults, not a file at the root
    names.discard("values.schema.json")
    return sorted(names)


VALUES_FILES = named_values_files()


def test_the_docs_name_values_files():
    assert VALUES_FILES, "the docs name at least one values file"


@pytest.mark.parametrize("name", VALUES_FILES)
def test_named_values_file_renders_with_the_chart(name):
    from tests.deploy.deploy_helpers import load_values, manifests_of, render_chart

    assert (REPO / name).is_file(), f"the docs name {name}, which does not exist"
    docs = manifests_of(render_chart(load_values(name)))
    assert {d["kind"] for d in docs} >= {"ConfigMap"}, name
