"""``python -m trainer eval`` on a held-out JSONL with bad records (``data.eval_jsonl`` or ``--split``), or a split
file that is not there: one ``error:`` line naming the first bad line or the file, exit code 2, no traceback, and
nothing evaluated (no ``eval`` output directory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.integration.test_bad_records_cli import ENV, REPO, config, dataset, the_error


def eval_cli(cfg: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", "eval", "--config", str(cfg), *extra], capture_output=True,
                          text=True, cwd=cwd, env={**ENV, "PYTHONPATH": str(REPO)}, timeout=900)


def with_eval_jsonl(cfg: Path, eval_jsonl: Path) -> Path:
    raw = yaml.safe_load(cfg.read_text())
    raw["data"]["eval_jsonl"] = str(eval_jsonl)
    cfg.write_text(yaml.safe_dump(raw))
    return cfg


def test_bad_eval_jsonl_ends_eval_in_one_line(tmp_path):
    data = dataset(tmp_path, 3)
    cfg = with_eval_jsonl(config(tmp_path, data), data)
    line = the_error(eval_cli(cfg, tmp_path))
    assert line.startswith(f"error: 3 bad records, the first: {data}:4: objects[0].bbox_2d "
                           "[4.0, 4.0, 90.0, 40.0] lies outside the 64x48 image"), line
    assert not (tmp_path / "run" / "eval").exists(), "nothing was evaluated"


def test_bad_or_missing_split_ends_eval_in_one_line(tmp_path):
    data = dataset(tmp_path, 1)
    cfg = config(tmp_path, data)
    line = the_error(eval_cli(cfg, tmp_path, "--split", str(data)))
    assert line.startswith(f"error: {data}:4: objects[0].bbox_2d"), line
    missing = tmp_path / "nope.jsonl"
    assert the_error(eval_cli(cfg, tmp_path, "--split", str(missing))) == f"error: {missing}: dataset file not found"
    assert not (tmp_path / "run" / "eval").exists(), "nothing was evaluated"
