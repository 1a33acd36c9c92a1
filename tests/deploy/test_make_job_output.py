"""``DRY_RUN=1 make job CONFIG=configs/summary_1024.yaml`` (docs/guides/deployment.md) prints YAML only: its stdout,
redirected to a file as the docs do, holds Kubernetes objects alone, each valid against the Kubernetes schemas, so
``kubectl apply -f`` takes the file. ``make job`` sets up only what rendering needs (no torch, no test extras)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import yaml
from deploy_helpers import REPO, assert_valid_kubernetes

COMMAND = "DRY_RUN=1 make job CONFIG=configs/summary_1024.yaml"


def shell(command: str) -> subprocess.CompletedProcess:
    """``command`` in bash from the repository root, the venv's ``bin`` first on PATH."""
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MAKEFLAGS", None)
    env.pop("MAKELEVEL", None)
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def kubernetes_objects(text: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    for doc in docs:
        assert isinstance(doc, dict) and {"apiVersion", "kind", "metadata"} <= doc.keys(), \
            f"not a Kubernetes object: {str(doc)[:200]!r}"
    return docs


def test_the_docs_print_the_jobs_with_this_command():
    text = (REPO / "docs" / "guides" / "deployment.md").read_text()
    assert re.search(rf"^{re.escape(COMMAND)}\s", text, re.M), f"deployment.md no longer runs `{COMMAND}`"


def test_dry_run_make_job_writes_only_valid_kubernetes_objects_to_the_file(tmp_path):
    out = tmp_path / "summary-1024.yaml"
    proc = shell(f"{COMMAND} > {out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = kubernetes_objects(out.read_text())
    assert [d["kind"] for d in docs] == ["ConfigMap", "Job", "Job"], [d["kind"] for d in docs]
    assert_valid_kubernetes(docs)


def test_kubernetes_objects_rejects_what_make_used_to_echo():
    """The check above can fail: the recipe line make echoed before the YAML is no Kubernetes object."""
    try:
        kubernetes_objects(".venv/bin/python -m trainer render-job --config configs/summary_1024.yaml\n---\n"
                           "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    except AssertionError as exc:
        assert "not a Kubernetes object" in str(exc)
    else:
        raise AssertionError("the echoed recipe line passed as a Kubernetes object")


def test_make_job_sets_up_the_render_stage_only():
    """``make job`` depends on the light ``.deploy`` stage (the package, PyYAML, pydantic, Jinja2, Helm's SDK, the
    kubernetes client), not on ``setup`` (the whole test lock) nor on torch."""
    proc = shell("make -n --no-print-directory job CONFIG=configs/summary_1024.yaml")
    assert proc.returncode == 0, proc.stderr
    assert ".venv/.deploy" in proc.stdout and ".installed" not in proc.stdout + proc.stderr
    stage = shell("make -n --no-print-directory -B .venv/.deploy")
    assert stage.returncode == 0, stage.stderr
    installs = [line for line in stage.stdout.splitlines() if "uv pip install" in line]
    assert installs and not any(re.search(r"\btorch\b|-r locks/|\.\[", line) for line in installs), installs


def test_render_job_imports_no_torch():
    probe = ("import runpy, sys\n"
             "class Block:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('torch', 'transformers', 'numpy'):\n"
             "            raise ImportError('blocked ' + name)\n"
             "sys.meta_path.insert(0, Block())\n"
             "sys.argv = ['trainer', 'render-job', '--config', 'configs/summary_1024.yaml', '--dry-run']\n"
             "runpy.run_module('trainer', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_valid_kubernetes(kubernetes_objects(proc.stdout))
