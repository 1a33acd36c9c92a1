"""One name for a prepared checkpoint (``trainer.modeling.prepare.PREPARED_SUFFIX``): the prepare command that
``model tiny`` prints, the from-stock CPU config, every ``model prepare`` line of the docs and configs, and the
presets' model paths agree."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from trainer.cli import main
from trainer.config.loader import resolve_yaml
from trainer.modeling.prepare import PREPARED_SUFFIX, prepare_command, prepared_dir

REPO = Path(__file__).resolve().parents[2]
PREPARE_LINE = re.compile(r"python -m trainer model prepare (--from \S+ --out \S+)")


def test_the_convention():
    assert PREPARED_SUFFIX == "-coord"
    assert prepared_dir("/models/Qwen3-VL-2B-Instruct/") == "/models/Qwen3-VL-2B-Instruct-coord"
    assert prepare_command("runs/x") == "python -m trainer model prepare --from runs/x --out runs/x-coord"


def test_model_tiny_prints_the_prepare_command_the_from_stock_config_reads(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["model", "tiny", "--out", "runs/from-stock/stock"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("next: " + prepare_command("runs/from-stock/stock")), printed
    config = REPO / "configs" / "demo_from_stock.yaml"
    comments = [line.removeprefix("#").strip() for line in config.read_text().splitlines() if line.startswith("#")]
    assert prepare_command("runs/from-stock/stock") in comments, "the config's own recipe is the printed one"
    assert resolve_yaml(config)["model"]["path"] == prepared_dir("runs/from-stock/stock")


def test_every_prepare_line_of_the_docs_and_configs_writes_the_suffixed_directory():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "configs").glob("*.yaml"))]
    found = []
    for page in pages:
        for args in PREPARE_LINE.findall(page.read_text().replace("\\\n", " ")):
            words = shlex.split(args)
            source, out = words[1], words[3].rstrip("`),")
            if source.startswith("<"):
                continue  # a placeholder (`--from <checkpoint> --out <dir>`), no name to check
            found.append(out)
            assert out == prepared_dir(source) or out.startswith(prepared_dir(source) + "-"), (page.name, args)
    assert len(found) >= 3, found


def test_the_presets_train_and_serve_a_suffixed_checkpoint():
    for path in sorted((REPO / "presets").glob("*.values.yaml")):
        values = yaml.safe_load(path.read_text())
        model = values["learner"]["config"]["model"]["path"]
        assert model.endswith(PREPARED_SUFFIX), (path.name, model)
        server = (values.get("rolloutServer") or {}).get("model")
        assert server in (None, model), (path.name, server)
