"""Exact resume: a learner killed mid-run and resumed from its last checkpoint trains the same
``(epoch, sample_id, step)`` sequence as an uninterrupted run (packing carry buffer and rollout buffer included)."""

from __future__ import annotations

import json
import os
import shlex
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


# --- the chart's learner command, killed and started again ------------------------------------------------------

def chart_learner_args(config: Path) -> list[str]:
    """The learner container's arguments as the chart renders them for a preset (one rank), config path swapped."""
    import helm_python as helm

    values = yaml.safe_load((REPO / "presets" / "colocate-4-2b-full.values.yaml").read_text())
    values["learner"].update(nprocPerNode=1, gpus=[0])
    values["storage"] = {"output": {"hostPath": "/data/runs"}}
    with helm.Chart.load(str(REPO / "charts" / "rollout-matching")) as chart:
        rendered = chart.render(values, name="stage2", namespace="ml", is_install=True)
    (learner,) = [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text)
                  if d and d["kind"] == "Job" and d["metadata"]["name"].endswith("-learner")]
    args = [str(a) for a in learner["spec"]["template"]["spec"]["containers"][0]["args"]]
    assert args[args.index("--resume") + 1] == "auto", "the chart's learner resumes by itself"
    return [str(config) if a == "/etc/rollout-matching/train.yaml" else a for a in args]


def write_epoch_config(tmp_path: Path, name: str) -> Path:
    """4 steps of 4 records over 16 samples, a checkpoint every 2: one epoch, so every sample id is trained at most
    once."""
    path = write_config(tmp_path, name, packing=True, buffer=False)
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["synthetic"]["num_samples"] = 16
    cfg["training"].update(num_train_epochs=1, max_steps=4, save_steps=2)
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(args: list[str], log: Path, stop_after_checkpoint: int | None = None) -> subprocess.Popen:
    """``python -m trainer <args>``, its output in ``log``; with ``stop_after_checkpoint`` the command it would exec
    runs with ``stop_after_checkpoint.py`` in place of ``-m trainer`` (the rank stops itself once checkpoint N is
    complete)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "trainer", *args]
    if stop_after_checkpoint is not None:
        printed = subprocess.run([*cmd, "--print-command"], env=env, capture_output=True, text=True, timeout=600)
        assert printed.returncode == 0, printed.stderr
        words = shlex.split(printed.stdout.strip())
        assignments = words[:words.index(sys.executable)]
        cmd = words[len(assignments):]
        env.update(a.split("=", 1) for a in assignments)
        i = cmd.index("trainer") - 1
        assert cmd[i:i + 3] == ["-m", "trainer", "train"], cmd
        cmd[i:i + 2] = [str(REPO / "tests" / "integration" / "stop_after_checkpoint.py"), str(stop_after_checkpoint)]
    with open(log, "w") as out:  # a file, not a pipe: nobody reads a run's output while it trains
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def process_tree(pid: int) -> dict[int, str]:
    """``pid`` and its descendants (torchrun starts its workers in sessions of their own) with their states."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(stat.parent.name)] = (fields[0], int(fields[1]))
    tree, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        if p in table:
            tree[p] = table[p][0]
            frontier += [c for c, (_, parent) in table.items() if parent == p]
    return tree


@pytest.mark.slow
def test_the_chart_learner_command_started_again_after_a_kill_loses_and_repeats_no_sample(tmp_path):
    straight, killed = write_epoch_config(tmp_path, "straight"), write_epoch_config(tmp_path, "killed")
    logs = {name: tmp_path / f"{name}.log" for name in ("straight", "first", "again")}
    uninterrupted = launch(chart_learner_args(straight), logs["straight"])
    first = launch(chart_learner_args(killed), logs["first"], stop_after_checkpoint=2)
    target = tmp_path / "killed" / "stage2" / "checkpoint-2" / "rank0-rollout_state.pt"
    deadline = time.monotonic() + 900  # bounds a hang only
    while not (target.exists() and "T" in process_tree(first.pid).values()):
        assert first.poll() is None, logs["first"].read_text()[-4000:]
        assert time.monotonic() < deadline, f"{target} never appeared or the learner never stopped (waited 900 s)"
        time.sleep(0.02)
    for pid in process_tree(first.pid):  # the pod dies: torchrun and its rank
        os.kill(pid, signal.SIGKILL)
    first.wait()
    assert not (tmp_path / "killed" / "stage2" / "checkpoint-4").exists()
    again = launch(chart_learner_args(killed), logs["again"])  # the Job's next pod: the same command
    assert again.wait(timeout=900) == 0, logs["again"].read_text()[-4000:]
    assert f"resume auto: {tmp_path / 'killed' / 'stage2' / 'checkpoint-2'}" in logs["again"].read_text()
    assert uninterrupted.wait(timeout=900) == 0, logs["straight"].read_text()[-4000:]
    expected, resumed = ledger(straight), ledger(killed)
    assert max(row[2] for row in expected) == 3 and len({row[1] for row in expected}) == len(expected)
    assert resumed == expected
    assert sorted(row[1] for row in resumed) == sorted(row[1] for row in expected), "no sample lost"
    assert len({row[1] for row in resumed}) == len(resumed), "no sample trained twice"
