"""The documented CPU sequence, through the CLI as a user types it (docs/guides/prepare-checkpoint.md): a tiny stock
checkpoint -> ``model prepare`` -> ``train`` (stage 1, then stage 2) -> ``eval``, with configs/demo_from_stock.yaml
cut to a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.telemetry import read_jsonl

REPO = Path(__file__).resolve().parents[2]
SHORT = {  # configs/demo_from_stock.yaml, a few steps of each stage
    "data": {"synthetic": {"num_samples": 16, "eval_num_samples": 4}},
    "training": {"max_steps": 2, "eval_steps": 0, "per_device_train_batch_size": 4, "disable_tqdm": True,
                 "report_to": ["jsonl"], "save_steps": 6},
    "stage1": {"steps": 6, "logging_steps": 3, "batch_size": 8},
    "custom": {"extra": {"rollout_matching": {"rollout_generate_batch_size": 4, "decoding": {"max_new_tokens": 48}}}},
}


def cli(cwd: Path, *args: str) -> str:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{args}: rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.slow
def test_stock_prepare_stage1_stage2_eval_via_the_cli(tmp_path):
    config = tmp_path / "demo_from_stock_short.yaml"
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "demo_from_stock.yaml"), **SHORT}))
    hint = cli(tmp_path, "model", "tiny", "--out", "runs/from-stock/stock").split("next: ")[1].split()
    assert hint[:3] == ["python", "-m", "trainer"], hint
    out = cli(tmp_path, *hint[3:])  # the prepare command `model tiny` prints: the config reads its --out
    assert "prepared runs/from-stock/stock-coord: 1000 coord tokens" in out, out
    cli(tmp_path, "train", "--config", str(config))
    run = tmp_path / "runs" / "from-stock" / "train"
    rows = read_jsonl(run / "metrics.jsonl")
    stage1 = [r for r in rows if r.get("phase") == "stage1" and "loss" in r]
    assert [r["step"] for r in stage1] == [3, 6]
    assert all(r["learning_rate"] == 3e-3 and r["speed/steps_per_s"] > 0 for r in stage1), stage1
    assert len([r for r in rows if r.get("phase") == "stage2" and "loss" in r]) == 2
    assert (run / "stage1" / "checkpoint-6" / "config.json").is_file(), "the guide evaluates stage-1 checkpoints"
    evals = [r for r in rows if r.get("phase") == "eval"]
    assert [r["step"] for r in evals] == [0, 2], "held-out eval after stage 1 and after stage 2"
    printed = cli(tmp_path, "eval", "--config", str(config), "--checkpoint", "latest")
    assert "parse" in printed.lower()
    result = json.loads((run / "eval" / "final" / "metrics.json").read_text())
    assert 0.0 <= result["parse_failure_rate"] <= 1.0
    assert result["parse_failure_rate"] == pytest.approx(evals[-1]["eval/parse_failure_rate"])
