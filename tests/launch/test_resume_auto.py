"""``launch learner --resume auto``: the newest complete stage-2 checkpoint is handed to the training command; an
incomplete one (a rank's rollout state missing: killed while saving) is passed over; none means a fresh start."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from tests.launch.conftest import REPO
from trainer.config.errors import ConfigError
from trainer.launch import cli as launch_cli
from trainer.launch.resume import latest_checkpoint

STAGE2 = REPO / "configs/rollout_matching_sft_template.yaml"
SUMMARY = REPO / "configs/summary_1024.yaml"


def checkpoint(out: Path, step: int, ranks: int) -> Path:
    folder = out / "stage2" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    for rank in range(ranks):
        (folder / f"rank{rank}-rollout_state.pt").write_bytes(b"state")
    return folder


def test_latest_complete_checkpoint_for_every_rank(tmp_path):
    assert latest_checkpoint(tmp_path, 2) is None
    checkpoint(tmp_path, 3, ranks=2)
    ten = checkpoint(tmp_path, 10, ranks=2)
    checkpoint(tmp_path, 20, ranks=1)  # rank 1 never finished writing it
    (tmp_path / "stage2" / "checkpoint-30").mkdir()
    (tmp_path / "stage2" / "checkpoint-x").mkdir()
    assert latest_checkpoint(tmp_path, 2) == ten  # 10 > 3 numerically, 20 and 30 are incomplete
    assert latest_checkpoint(tmp_path, 1) == tmp_path / "stage2" / "checkpoint-20"


def _args(config: Path, **kw) -> argparse.Namespace:
    base = dict(config=str(config), nproc_per_node=None, gpus="0,1", wait_for_servers=None, health_timeout_s=1.0,
                health_interval_s=0.2, master_port=23456, print_command=False, resume="auto", extra=[])
    return argparse.Namespace(**{**base, **kw})


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"extends": str(STAGE2), "training": {"output_dir": str(tmp_path / "out")}}))
    return path


def _train_argv(monkeypatch, args: argparse.Namespace) -> list[str]:
    executed = []
    monkeypatch.setattr(launch_cli, "_exec", lambda cmd: executed.append(cmd) or 0)
    assert launch_cli.run_learner(args) == 0
    (cmd,) = executed
    return cmd.argv[cmd.argv.index("train"):]


def test_resume_auto_passes_the_checkpoint_and_starts_fresh_without_one(tmp_path, monkeypatch, capsys):
    config = _config(tmp_path)
    assert _train_argv(monkeypatch, _args(config)) == ["train", "--config", str(config)]
    assert "no complete checkpoint" in capsys.readouterr().err
    checkpoint(tmp_path / "out", 200, ranks=2)
    checkpoint(tmp_path / "out", 400, ranks=1)
    assert _train_argv(monkeypatch, _args(config)) == [
        "train", "--config", str(config), "--resume-from-checkpoint", str(tmp_path / "out/stage2/checkpoint-200")]
    other = tmp_path / "elsewhere"
    checkpoint(other, 7, ranks=2)
    argv = _train_argv(monkeypatch, _args(config, extra=["--", "--output-dir", str(other)]))
    assert argv[3:] == ["--resume-from-checkpoint", str(other / "stage2/checkpoint-7"), "--output-dir", str(other)]
    assert _train_argv(monkeypatch, _args(config, resume="never")) == ["train", "--config", str(config)]


@pytest.mark.parametrize("config, extra, message", [
    (SUMMARY, [], "grpo_summary config"),
    (STAGE2, ["--resume-from-checkpoint", "latest"], "both choose the checkpoint"),
])
def test_resume_auto_refusals(config, extra, message):
    with pytest.raises(ConfigError, match=message):
        launch_cli.resume_checkpoint("auto", launch_cli._load(str(config)), 2, extra)
