"""The stage-1 warm-up packs its ground-truth targets into ``training.packing_length`` rows, as stage 2 packs its
rollouts: a padded micro-batch of ``stage1.batch_size`` long targets was several rows' tokens in one forward (a
2B warm-up of 16 records at 1024 px, 40-80 objects: one 50k-token forward, out of memory on a 141 GB GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_stage1_rows_hold_at_most_packing_length_tokens(tmp_path):
    packing_length = 384
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["data"]["synthetic"].update(num_samples=48, eval_num_samples=0, min_objects=3, max_objects=3)
    cfg["training"].update(output_dir=str(tmp_path / "run"), max_steps=1, eval_steps=0, report_to=["jsonl"],
                           packing=True, packing_length=packing_length, disable_tqdm=True)
    cfg["stage1"] = {"steps": 2, "batch_size": 16, "logging_steps": 1, "learning_rate": 3e-3, "target_workers": 2}
    cfg["custom"]["extra"]["rollout_matching"]["decoding"]["max_new_tokens"] = 8
    path = tmp_path / "stage1.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "targets built by 2 loader workers" in proc.stderr, "stage1.target_workers reaches the warm-up"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in rows if r.get("phase") == "stage1" and "batch/rows_per_step" in r]
    assert len(warm) == 2, rows
    for r in warm:
        assert r["batch/rows_per_step"] >= 2, r
        assert r["batch/tokens"] <= r["batch/rows_per_step"] * packing_length, r
