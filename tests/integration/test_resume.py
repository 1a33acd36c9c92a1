"""Exact resume: a learner killed mid-run and resumed from its last checkpoint trains the same
``(epoch, sample_id, step)`` sequence as an uninterrupted run (packing carry buffer and rollout buffer included)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, name: str, *, packing: bool, buffer: bool) -> Path:
    cfg = {
        "model": {"tiny": "text"},
        "data": {"synthetic": {"num_samples": 12, "seed": 3, "min_objects": 1, "max_objects": 2}},
        "training": {"output_dir": str(tmp_path / name), "max_steps": 7, "num_train_epochs": 3,
                     "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 1e-3,
                     "save_steps": 3, "logging_steps": 1, "seed": 7, "disable_tqdm": True, "report_to": ["jsonl"],
                     "packing": packing, "packing_length": 330, "packing_buffer": 32},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "hf", "rollout_generate_batch_size": 2, "decoding": {"max_new_tokens": 16},
            "rollout_buffer": {"enabled": buffer, "m_steps": 2 if buffer else 1}}}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _command(config: Path, *extra: str) -> tuple[list[str], dict[str, str]]:
    return ([sys.executable, "-m", "trainer", "train", "--config", str(config), *extra],
            {**os.environ, "PYTHONPATH": str(REPO)})


def start(config: Path, *extra: str) -> subprocess.Popen:
    """A learner running in the background (its output kept for the failure message)."""
    cmd, env = _command(config, *extra)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]


def train(config: Path, *extra: str, kill_after_checkpoint: int | None = None) -> None:
    if kill_after_checkpoint is None:
        finish(start(config, *extra))
        return
    cmd, env = _command(config, *extra)
    # the learner stops itself right after checkpoint N is complete (SIGSTOP), then is killed there: no race with
    # the steps after it, however long this process is starved for
    cmd[1:3] = [str(REPO / "tests" / "integration" / "stop_after_checkpoint.py"), str(kill_after_checkpoint)]
    out_dir = Path(yaml.safe_load(config.read_text())["training"]["output_dir"]) / "stage2"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = out_dir / f"checkpoint-{kill_after_checkpoint}" / "rank0-rollout_state.pt"
    deadline = time.monotonic() + 900  # bounds a hang only
    while not (target.exists() and stopped(proc.pid)):
        assert proc.poll() is None, "learner exited before the checkpoint the test kills after"
        assert time.monotonic() < deadline, f"{target} never appeared or the learner never stopped (waited 900 s)"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def stopped(pid: int) -> bool:
    """The process is stopped by a signal (state ``T`` in /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def ledger(config: Path) -> list[tuple[int, str, int]]:
    out = Path(yaml.safe_load(config.read_text())["training"]["output_dir"]) / "stage2" / "ledger.jsonl"
    return [(r["epoch"], r["sample_id"], r["step"], r["rollout_step"])
            for r in map(json.loads, out.read_text().splitlines())]


@pytest.mark.slow
@pytest.mark.parametrize("packing, buffer", [(True, False), (False, True)], ids=["packing", "rollout-buffer"])
def test_killed_and_resumed_run_trains_the_same_sequence(tmp_path, packing, buffer):
    straight = write_config(tmp_path, "straight", packing=packing, buffer=buffer)
    killed = write_config(tmp_path, "killed", packing=packing, buffer=buffer)
    uninterrupted = start(straight)  # independent of the killed run: the two share the machine's cores
    train(killed, kill_after_checkpoint=3)
    finish(uninterrupted)
    partial = ledger(killed)
    assert partial and max(row[2] for row in partial) >= 2
    incomplete = tmp_path / "killed" / "stage2" / "checkpoint-6"
    assert not incomplete.exists(), "killed before the next checkpoint"
    incomplete.mkdir()
    (incomplete / "trainer_state.json").write_text('{"global_step": 6}')
    (incomplete / "rank0-rollout_state.pt.tmp").write_bytes(b"torn write")
    train(killed, "--resume-from-checkpoint", "latest")
    expected = ledger(straight)
    assert max(row[2] for row in expected) == 6
    assert any(row[3] < row[2] for row in expected), "carried or replayed targets exercise the checkpointed buffers"
    assert ledger(killed) == expected
