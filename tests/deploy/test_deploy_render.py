"""``python -m trainer deploy render``: what ``helm install`` applies, rendered without a cluster or the helm binary.

The command as docs/guides/deployment.md writes it prints YAML only; every document is a Kubernetes object that
validates, and the objects are the chart's install render with the same values minus the ``helm test`` pod. ``-f``
files and ``--set`` merge as helm merges them; what the chart or helm refuses is one line on stderr, exit 2."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest
import yaml
from deploy_helpers import REPO, assert_valid_kubernetes, helm, manifests_of, pod_spec, render_chart

from trainer.cli import main
from trainer.deploy.checks import check_manifests

DEPLOYMENT = REPO / "docs" / "guides" / "deployment.md"
COMMAND = "python -m trainer deploy render -f values-6v2.yaml"


def shell(command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def objects(text: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    assert docs and all(isinstance(d, dict) and {"apiVersion", "kind", "metadata"} <= d.keys() for d in docs), text[:500]
    return docs


def test_the_deployment_guide_renders_offline_with_this_command():
    lines = [line.split("#")[0].strip() for line in DEPLOYMENT.read_text().splitlines()]
    assert any(line.startswith(COMMAND) for line in lines), f"deployment.md no longer runs `{COMMAND}`"


def test_the_documented_render_prints_what_helm_install_applies():
    proc = shell(COMMAND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = objects(proc.stdout)
    assert_valid_kubernetes(docs)
    assert check_manifests(docs, 8) == []
    values = helm.values_from_yaml((REPO / "values-6v2.yaml").read_text())
    chart = manifests_of(render_chart(values, name="stage2", namespace="default"))
    hooks = [d for d in chart if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]
    assert [d["kind"] for d in hooks] == ["Pod"], "the chart's helm test pod"
    assert docs == [d for d in chart if d not in hooks]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap"] + ["Job"] * 7, "six servers and the learner"


def test_later_files_and_set_win(tmp_path, capsys):
    mine = tmp_path / "mine.values.yaml"
    mine.write_text("learner:\n  config:\n    training:\n      output_dir: /output/mine\n")
    argv = shlex.split(f"deploy render -f {REPO / 'values-6v2.yaml'} -f {mine} --set node.name=gpu-node-1 "
                       "--name run-a -n ml")
    assert main(argv) == 0, capsys.readouterr().err
    docs = objects(capsys.readouterr().out)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    config = yaml.safe_load(cm["data"]["train.yaml"])
    assert config["training"]["output_dir"] == "/output/mine" and config["model"]["path"], "mappings merge"
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert jobs and all(d["metadata"]["name"].startswith("run-a-") for d in jobs), "--name is the release name"
    assert all(re.search(r"gpu-node-1", yaml.safe_dump(pod_spec(d))) for d in jobs), "--set node.name reaches every pod"


@pytest.mark.parametrize("args,names", [
    ("-f presets/6v2-2b-full.values.yaml", "storage.output"),
    ("-f no-such.values.yaml", "-f no-such.values.yaml: no such file"),
    ("-f values-6v2.yaml --set node.gpuCount=abc", "/node/gpuCount"),
    ("-f values-6v2.yaml --set node.name", "--set node.name"),
    ("-f values-6v2.yaml --name Bad_Name", "--name"),
])
def test_refusals_are_one_line_with_exit_2(args, names, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["deploy", "render", *shlex.split(args)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("deploy render: ") and err.count("\n") == 1, err
    assert names in err and "Traceback" not in err, err
