"""``docs/guides/own-data.md`` runs as written: its import, check and validate commands on a tiny COCO dataset
written here (``/data/mycoco`` → a temporary folder), its example summary is what the import prints, and (slow)
its train → eval → export commands on the embedded tiny VL model."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.unit.test_data_formats import coco_fixture

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "guides" / "own-data.md"
PLACEHOLDER = "/data/mycoco"


def blocks(lang: str) -> list[str]:
    """The doc's fenced blocks whose info string is ``lang`` (``""``: bare fences)."""
    out: list[str] = []
    current: list[str] | None = None
    info = ""
    for line in DOC.read_text().splitlines(keepends=True):
        if line.startswith("```") and current is None:
            current, info = [], line[3:].strip()
        elif line.startswith("```"):
            if info == lang:
                out.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return out


def doc_commands(data: Path) -> list[list[str]]:
    """Every ``python -m trainer ...`` line of the doc's bash blocks, ``/data/mycoco`` pointed at ``data``."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("python -m trainer ") and (PLACEHOLDER in line or "configs/mycoco.yaml" in line):
                out.append(shlex.split(line.split("#")[0].replace(PLACEHOLDER, str(data))))
    return out


def workspace(tmp_path: Path) -> Path:
    """``tmp/mycoco`` in the doc's layout (train and val: the unit tests' COCO fixture) and ``tmp/configs``."""
    data = tmp_path / "mycoco"
    for split in ("train", "val"):
        src, images = coco_fixture(tmp_path / f"fixture-{split}")
        (data / "annotations").mkdir(parents=True, exist_ok=True)
        src.rename(data / "annotations" / f"instances_{split}.json")
        (data / "images").mkdir(exist_ok=True)
        images.rename(data / "images" / split)
    configs = tmp_path / "configs"
    configs.mkdir()
    shutil.copy(ROOT / "configs" / "rollout_matching_sft_template.yaml", configs)
    (config,) = [b for b in blocks("yaml") if b.startswith("# configs/mycoco.yaml")]
    # the page's checkpoint is on its GPU machine; validate checks model.path exists: a stand-in directory here
    model = re.search(r"^\s*path:\s*(/models/\S+)", config, re.M).group(1)
    stand_in = tmp_path / "models" / Path(model).name
    stand_in.mkdir(parents=True)
    (stand_in / "config.json").write_text("{}")
    (configs / "mycoco.yaml").write_text(config.replace(PLACEHOLDER, str(data)).replace(model, str(stand_in)))
    return data


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # 900 s bounds a hang only: the slowest command (train on the tiny VL model) takes ~40 s on an idle machine
    return subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def data_subcommands() -> set[str]:
    """The ``python -m trainer data`` subcommands the CLI registers."""
    import argparse

    from trainer.cli import build_parser

    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    data = top.choices["data"]
    return set(next(a for a in data._actions if isinstance(a, argparse._SubParsersAction)).choices)


def test_doc_import_check_and_validate(tmp_path):
    data = workspace(tmp_path)
    commands = doc_commands(data)
    kinds = [c[3] for c in commands]
    assert kinds.count("data") >= 4 and "validate" in kinds, commands
    assert any(c[3:5] == ["data", "check"] for c in commands), "the doc runs `data check` on its files"
    assert "check" in data_subcommands(), ("`python -m trainer data check` is not registered: trainer.data.check must "
                                           "import and be listed in trainer.data.cli.SUBCOMMAND_MODULES")
    printed = []
    for argv in commands:
        if argv[3] in ("train", "eval") or argv[3:5] == ["data", "export"]:
            continue  # the slow test below
        proc = run(argv, tmp_path)
        assert proc.returncode == 0, (argv, proc.stdout, proc.stderr)
        printed.append(proc.stdout)
    for split in ("train", "val"):
        assert (data / f"{split}.jsonl").is_file()
    example = next(b for b in blocks("") if b.startswith("imported "))
    assert printed[0] == example.replace(PLACEHOLDER, str(data)), "the doc's example summary is out of date"
    resolved = yaml.safe_load(printed[-1])
    assert resolved["data"]["train_jsonl"] == str(data / "train.jsonl") and resolved["data"]["synthetic"] is None
    assert resolved["model"]["path"] and resolved["model"]["tiny"] is None


@pytest.mark.slow
def test_doc_train_eval_export_on_the_tiny_vl_model(tmp_path, capsys, monkeypatch):
    import json

    from trainer.cli import main

    data = workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    for argv in doc_commands(data):
        if argv[3:5] == ["data", "import"]:
            assert main(argv[3:]) == 0
    tiny = {"extends": "mycoco.yaml",
            "model": {"path": None, "tiny": "vl", "torch_dtype": "float32"},
            "training": {"bf16": False, "max_steps": 2, "per_device_train_batch_size": 3, "eval_steps": 0,
                         "packing": False, "disable_tqdm": True, "report_to": ["jsonl"], "learning_rate": 2e-3,
                         "compile_decoder_layers": False, "compile_activation_memory_budget": 1.0},
            "custom": {"extra": {"rollout_matching": {
                "rollout_backend": "hf", "rollout_generate_batch_size": 3, "hf": {"compile": False, "cache_implementation": "dynamic"},
                "decoding": {"max_new_tokens": 24}, "matching": {"mask_resolution": 64},
                "vllm": {"pixels_during_decode": False}}}}}
    (tmp_path / "configs" / "mycoco_tiny.yaml").write_text(yaml.safe_dump(tiny))
    ran = []
    for argv in doc_commands(data):
        if argv[3] in ("train", "eval") or argv[3:5] == ["data", "export"]:
            args = [a.replace("configs/mycoco.yaml", "configs/mycoco_tiny.yaml") for a in argv[3:]]
            assert main(args) == 0, args
            ran.append(argv[3] if argv[3] != "data" else "export")
    assert ran == ["train", "eval", "export"]
    printed = capsys.readouterr().out
    assert "COCO box AP (pycocotools COCOeval" in printed and "class-agnostic:" in printed
    ground = json.loads((tmp_path / "runs" / "mycoco" / "eval" / "val_coco.json").read_text())
    assert {c["id"] for c in ground["categories"]} == {1, 7}, "category ids from --categories"
    assert sorted(i["id"] for i in ground["images"]) == [1, 2, 3]
