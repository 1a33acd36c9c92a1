"""``python -m trainer train`` on a JSONL with bad records (the troubleshooting page's "Data" rows): one
``error:`` line naming the first bad line, the count when there are several, ``data check`` and
``data.on_bad_record: drop``; exit code 2, no traceback, and the model never loads (no ``run_metadata.json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tests.unit.test_preflight import fragments_in_order

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "guides" / "troubleshooting.md"
#: the page's messages for one bad record, several, and a file whose every record was dropped
ROWS = ("error: train.jsonl:4: …; fix it (`python -m trainer data check …` lists every problem) or set "
        "data.on_bad_record: drop …",
        "error: 3 bad records, the first: train.jsonl:4: …",
        "error: train.jsonl: no valid records, all … were dropped as bad (data.on_bad_record: drop) …")
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
GOOD = {"images": ["a.png"], "width": 64, "height": 48, "objects": [{"desc": "cat", "bbox_2d": [4, 4, 30, 40]}]}


def dataset(tmp_path: Path, bad: int) -> Path:
    """Three good records, then ``bad`` records whose box lies outside the image (the first at line 4)."""
    Image.new("RGB", (64, 48), (90, 120, 200)).save(tmp_path / "a.png")
    lines = [json.dumps({**GOOD, "id": f"good{i}"}) for i in range(3)]
    lines += [json.dumps({**GOOD, "id": f"bad{i}", "objects": [{"desc": "cat", "bbox_2d": [4, 4, 90, 40]}]})
              for i in range(bad)]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def config(tmp_path: Path, train_jsonl: Path, **data) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"tiny": "vl", "torch_dtype": "float32"},
        "data": {"synthetic": None, "train_jsonl": str(train_jsonl), **data},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "report_to": ["jsonl"], "bf16": False},
        "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}))
    return path


def train(cfg: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(cfg)], capture_output=True,
                          text=True, cwd=cwd, env={**ENV, "PYTHONPATH": str(REPO)}, timeout=900)


def the_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("bad", [1, 3])
def test_bad_records_end_train_in_one_line_with_the_hint(bad, tmp_path):
    data = dataset(tmp_path, bad)
    proc = train(config(tmp_path, data), tmp_path)
    line = the_error(proc)
    first = f"{data}:4: objects[0].bbox_2d [4.0, 4.0, 90.0, 40.0] lies outside the 64x48 image"
    lead = "error: " if bad == 1 else f"error: {bad} bad records, the first: "
    assert line.startswith(lead + first), line
    them = "it" if bad == 1 else "them"
    assert line.endswith(f"; fix {them} (`python -m trainer data check {data}` lists every problem) or set "
                         "data.on_bad_record: drop to train on the rest (each drop is logged and counted)"), line
    assert not (tmp_path / "run" / "run_metadata.json").exists(), "the model and engine never loaded"
    row = ROWS[0] if bad == 1 else ROWS[1]
    assert fragments_in_order(row, line.replace(str(data), "train.jsonl")), (row, line)


def test_a_file_whose_every_record_is_dropped_is_one_line_too(tmp_path):
    data = dataset(tmp_path, 2)
    data.write_text("\n".join(data.read_text().splitlines()[3:]) + "\n")
    line = the_error(train(config(tmp_path, data, on_bad_record="drop"), tmp_path))
    assert line == (f"error: {data}: no valid records, all 2 were dropped as bad (data.on_bad_record: drop); "
                    f"`python -m trainer data check {data}` lists their problems")
    assert fragments_in_order(ROWS[2], line.replace(str(data), "train.jsonl")), (ROWS[2], line)


def test_the_rows_are_on_the_troubleshooting_page():
    text = DOC.read_text(encoding="utf-8")
    assert all(f"``{row}``" in text or f"`{row}`" in text for row in ROWS)
