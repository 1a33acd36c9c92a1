"""Installs as users run them: images/install-deps.py applies the lock (the base's CUDA stack excepted), and a
plain `pip install -e '.[<the Makefile's CPU_EXTRAS>]'` resolves to the locked versions (pip's dry run)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import tomllib
from deploy_helpers import REPO

spec = importlib.util.spec_from_file_location("install_deps", REPO / "images" / "install-deps.py")
install_deps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_deps)
spec = importlib.util.spec_from_file_location("pip_check", REPO / "locks" / "pip_check.py")
pip_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pip_check)

#: the extras `make setup` installs from the lock (the Makefile's CPU_EXTRAS), and where torch's CPU wheel comes from
CPU_EXTRAS = re.search(r"^CPU_EXTRAS := (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
TORCH_FIND_LINKS = os.environ.get("TORCH_FIND_LINKS") or (
    "/opt/wheels" if os.path.isdir("/opt/wheels") else "https://download.pytorch.org/whl/cpu/torch/")

LOCK = ["# via x", "torch==2.11.0", "    # via vllm", "transformers==5.17.0", "vllm==0.26.0", "triton==3.6.0",
        "binpacking==2.0.1", "pyyaml==6.0.3", "dumb-init==1.2.5.post1"]


def test_lock_pins_apply_except_the_cuda_stack_the_base_ships_and_torch_is_never_requested():
    requirements = ["torch>=2.11", "transformers>=5.17,<5.20", "binpacking>=1.5", "PyYAML>=6.0"]
    base = {"torch": "2.11.0+cu130", "vllm": "0.26.0", "triton": "3.6.0", "transformers": "5.23.0"}
    reqs, pins, problems = install_deps.plan(requirements, LOCK, installed=base)
    assert reqs == ["transformers>=5.17,<5.20", "binpacking>=1.5", "PyYAML>=6.0"]
    # the base's transformers is replaced by the locked one; its torch / vLLM / triton stay
    assert pins == ["transformers==5.17.0", "binpacking==2.0.1", "pyyaml==6.0.3", "dumb-init==1.2.5.post1"]
    assert problems == []


def test_a_base_that_does_not_match_the_lock_stops_the_build():
    _, _, problems = install_deps.plan([], LOCK, installed={"torch": "2.9.1+cu128", "vllm": "0.33.0"})
    assert len(problems) == 2 and "torch 2.9.1+cu128, the lock says 2.11.0" in problems[0]


def test_names_are_compared_canonically():
    assert install_deps.requirement_name("Typing_Extensions>=4 ; python_version>'3'") == "typing-extensions"
    assert install_deps.requirement_name("# only a comment") is None


@pytest.mark.parametrize("lock_name,extras", [("gpu-runtime.txt", ("vllm", "swift", "deepspeed", "kubernetes")),
                                              ("cpu-test.txt", ())])
def test_every_requirement_of_an_image_is_in_its_lock(lock_name, extras):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = install_deps.lock_pins((REPO / "locks" / lock_name).read_text().splitlines())
    wanted = {install_deps.requirement_name(r) for r in project["dependencies"]} | {"dumb-init", "setuptools"}
    for extra in extras:
        wanted |= {install_deps.requirement_name(r) for r in project["optional-dependencies"][extra]}
    assert wanted - set(pins) == set(), f"not in locks/{lock_name}: run `make lock`"


def test_the_image_defaults_are_the_gpu_lock_s_extras():
    lock_mk = (REPO / "mk" / "lock.mk").read_text()
    for name in ("learner", "rollout-server"):
        extras = re.search(r"^ARG EXTRAS=(\S+)$", (REPO / "images" / name / "Dockerfile").read_text(), re.M).group(1)
        assert " ".join(f"--extra {e}" for e in extras.split(",")) in lock_mk


def lock_date(lock_name: str = "cpu-test.txt") -> str:
    """The instant of the index a lock was resolved against (its `# index as of:` header line, `make lock`)."""
    text = (REPO / "locks" / lock_name).read_text()
    match = re.search(r"^# index as of: (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) ", text, re.M)
    assert match, f"locks/{lock_name} has no '# index as of: <UTC instant>' header line: run `make lock`"
    return match.group(1)


def test_both_locks_were_resolved_against_the_same_dated_index():
    assert lock_date("cpu-test.txt") == lock_date("gpu-runtime.txt")


def test_make_lock_resolves_as_of_the_lock_s_date_and_now_moves_it():
    def dry_run(*args):
        out = subprocess.run(["make", "-n", "lock", *args], cwd=REPO, capture_output=True, text=True, check=True)
        return [line for line in out.stdout.splitlines() if " pip compile " in line]
    compiles = dry_run()
    assert len(compiles) == 2 and all(f"--exclude-newer {lock_date()} " in c and "--upgrade" in c for c in compiles)
    moved = dry_run("LOCK_DATE=now")
    date = re.search(r"--exclude-newer (\S+)", moved[0]).group(1)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", date) and date >= lock_date()


@pytest.mark.timeout(900)
def test_pip_resolves_the_extras_to_the_locked_versions(tmp_path):
    """pip's own resolver agrees with the lock: a fresh environment (--ignore-installed), `pip install -e
    '.[<CPU_EXTRAS>]'` as a dry run with the lock as constraints (`-c`, how a user applies it with
    pip), against the index as of the lock's date (`--uploaded-prior-to`). pip must find the lock a complete,
    consistent resolution: it installs exactly the lock's set of packages, at the locked versions, but for what
    locks/overrides.txt removes (plain pip installs those: the CUDA torchvision etc. that fail beside the CPU torch).
    Without the constraints the verdict followed the index this machine reaches, not the commit: files uploaded
    before the lock's date showed up there days later (cuda-pathfinder 1.9.1 of 2026-11-19, charset-normalizer
    3.5.3), and pip then picked them. What today's index would change is `make lock-check`'s report, not a test."""
    report = tmp_path / "report.json"
    find_links = TORCH_FIND_LINKS
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
           str(report), "--find-links", find_links, "--uploaded-prior-to", lock_date(),
           "-c", str(REPO / "locks" / "cpu-test.txt"), "-e", f"{REPO}[{CPU_EXTRAS}]"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=880)
    assert result.returncode == 0, result.stderr[-3000:]
    got = {pip_check.canonical(i["metadata"]["name"]): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    got.pop("rollout-matching")
    lock = pip_check.read_lock(REPO / "locks" / "cpu-test.txt")
    lock_only = {pip_check.canonical(r.split("==")[0]) for r in (REPO / "locks" / "cpu-test.in").read_text().split()
                 if "==" in r or r == "dumb-init"} - {"torch"}
    removed = {r for _, r in pip_check.read_removals(REPO / "locks" / "overrides.txt")}
    assert set(got) - set(lock) == removed, "pip adds exactly what the overrides remove"
    assert set(lock) - set(got) == lock_only, "and needs everything else in the lock"
    differ = {n: (got[n], lock[n]) for n in set(got) & set(lock) if got[n] != lock[n]}
    assert differ == {}, f"pip, as of {lock_date()}, picks other versions than the lock (pip, lock): {differ}"
