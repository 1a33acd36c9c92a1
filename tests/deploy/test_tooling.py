"""Build tooling around deployment: ``make job`` needs an explicit CONFIG, and ``.ci/docker.sh`` fails under CI
when no Docker daemon can run (instead of letting the container suite skip unnoticed)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from deploy_helpers import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def _make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("CONFIG", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**clean, **(env or {})})


def test_make_job_without_config_fails_and_says_to_pass_config():
    proc = _make("job")
    assert proc.returncode != 0
    assert "pass CONFIG=configs/<name>.yaml" in proc.stderr
    assert "render-job" not in proc.stdout, "nothing may be rendered or submitted without CONFIG"


def test_make_job_with_config_renders_that_config():
    proc = _make("-n", "job", "CONFIG=configs/demo.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "-m trainer render-job --config configs/demo.yaml" in proc.stdout
    assert "summary_1024" not in proc.stdout


def test_grpo_print_keeps_its_default_config():
    proc = _make("-n", "grpo-print")
    assert proc.returncode == 0, proc.stderr
    assert "launch server --engine swift --config configs/summary_1024.yaml --print-command" in proc.stdout
    proc = _make("-n", "grpo-print", "CONFIG=configs/summary_1024_attr_key_recall.yaml")
    assert "--config configs/summary_1024_attr_key_recall.yaml --print-command" in proc.stdout


def _find_links(makefile: Path, tmp_path: Path) -> str:
    """The --find-links `make setup`'s first install would pass (a dry run into a venv path that does not exist)."""
    proc = _make("-n", "-B", "-f", str(makefile), f"VENV={tmp_path}/venv", f"{tmp_path}/venv/.core")
    assert proc.returncode == 0, proc.stderr
    (value,) = set(re.findall(r"--find-links (\S+)", proc.stdout))
    return value


def test_torch_find_links_falls_back_to_the_pytorch_cpu_index(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_FIND_LINKS", raising=False)
    makefile = (REPO / "Makefile").read_text()
    expected_here = "/opt/wheels" if Path("/opt/wheels").is_dir() else "https://download.pytorch.org/whl/cpu/torch/"
    assert _find_links(REPO / "Makefile", tmp_path) == expected_here
    elsewhere = tmp_path / "Makefile.elsewhere"  # the same Makefile on a machine without /opt/wheels
    elsewhere.write_text(makefile.replace("/opt/wheels", str(tmp_path / "no-wheels-here")))
    assert _find_links(elsewhere, tmp_path) == "https://download.pytorch.org/whl/cpu/torch/"


@pytest.mark.parametrize(("base", "tag"), [("local", "0.1.0-cpu"), ("official", "0.1.0")])
def test_cpu_and_gpu_images_get_different_tags(base, tag):
    proc = _make("-n", "images", f"IMAGE_BASE={base}", "TORCH_WHEEL=/wheels/torch-2.13.0+cpu-x.whl")
    assert proc.returncode == 0, proc.stderr
    assert f'"learner rollout-matching/learner:{tag}"' in proc.stdout
    assert f'"rollout-server rollout-matching/rollout-server:{tag}"' in proc.stdout


def _fake_bin(tmp_path: Path, **scripts: str) -> Path:
    directory = tmp_path / "bin"
    directory.mkdir()
    for name, body in scripts.items():
        path = directory / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return directory


def _docker_sh(tmp_path: Path, bin_dir: Path, ci: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", DOCKERD_LOG_DIR=str(tmp_path / "logs"), DOCKERD_WAIT_S="1")
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(["bash", str(REPO / ".ci" / "docker.sh")], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.parametrize("ci", [None, "1", "true"])
def test_docker_sh_fails_under_ci_when_dockerd_cannot_start(tmp_path, ci):
    # docker.io and debootstrap "installed", but the daemon never answers
    bin_dir = _fake_bin(tmp_path, dockerd="exit 1", docker="exit 1", debootstrap="exit 0")
    proc = _docker_sh(tmp_path, bin_dir, ci)
    assert "dockerd did not come up" in proc.stderr
    if ci is None:
        assert proc.returncode == 0, proc.stderr
        assert "docker tests will skip" in proc.stderr
    else:
        assert proc.returncode == 1, proc.stderr
        assert "requires Docker" in proc.stderr


@pytest.mark.parametrize("ci", [None, "1"])
def test_docker_sh_fails_under_ci_when_docker_cannot_be_installed(tmp_path, ci):
    # no dockerd on PATH (the fake bin dir shadows nothing useful) and apt-get fails
    if shutil.which("dockerd", path="/usr/bin:/bin"):
        pytest.skip("a real dockerd is installed in /usr/bin; the install branch is not taken")
    bin_dir = _fake_bin(tmp_path, **{"apt-get": "echo 'E: no network' >&2; exit 100"})
    proc = _docker_sh(tmp_path, bin_dir, ci)
    assert "could not install docker.io" in proc.stderr
    assert proc.returncode == (0 if ci is None else 1), proc.stderr
