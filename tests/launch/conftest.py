"""Launcher test helpers: free ports and the real stub rollout server (``python -m trainer serve --engine scripted``)
as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.launch.ports import listen_port as free_port  # below the ephemeral range

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def machine_checks_pass(monkeypatch):
    """The launcher tests run the shipped configs, whose model and data paths exist on a training node, not here:
    ``launch learner``'s check of them (``trainer.config.preflight``, tested in tests/unit/test_preflight.py) passes
    in this process."""
    from trainer.launch import cli as launch_cli

    monkeypatch.setattr(launch_cli, "preflight_problems", lambda config: [])




def child_env() -> dict[str, str]:
    return dict(os.environ, VLLM_PLUGINS="", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def start_trainer(args: list[str], log: Path) -> subprocess.Popen:
    """``python -m trainer ARGS`` in the repository, output to ``log``."""
    fh = log.open("wb")
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=child_env(),
                            stdout=fh, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def scripted_server(tmp_path):
    """Factory: start the scripted rollout server on a fresh port; returns (base_url, process)."""
    procs: list[subprocess.Popen] = []

    def start(port: int | None = None) -> tuple[str, subprocess.Popen]:
        port = port or free_port()
        proc = start_trainer(["serve", "--engine", "scripted", "--host", "127.0.0.1", "--port", str(port)],
                             tmp_path / f"server-{port}.log")
        procs.append(proc)
        return f"http://127.0.0.1:{port}", proc

    yield start
    for p in procs:
        stop(p)
