"""The deployment entry points, run as the docs write them, from the repository root, as far as each runs without a
cluster or a GPU:

- ``helm install stage2 charts/rollout-matching -f values-6v2.yaml`` (and ``values-3v1.yaml``, ``values-colocate.yaml``):
  the chart rendered as that install would render it (Helm's Go SDK, ``is_install``), nothing added by the test,
  linted, validated against the Kubernetes schemas and checked (GPUs, ports, the learner waiting for every server);
- ``make job CONFIG=configs/summary_1024.yaml``: the command make runs for it, run with ``DRY_RUN=1``;
- the 4-GPU colocate ``docker run``: its image is the chart's learner image, its arguments parse with the image's
  entry point (``python -m trainer``), the config it mounts validates and its paths lie on the mounted volumes, and
  the learner command it runs starts 4 ranks (``--print-command``);
- the container suite the deployment guide names exists and is marked ``docker``.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest
import yaml
from deploy_helpers import (
    CHART,
    REPO,
    args_of,
    assert_lint_clean,
    assert_valid_kubernetes,
    flag,
    helm,
    manifests_of,
    pod_spec,
    render_chart,
    train_yaml,
    workload,
)

from trainer.cli import main
from trainer.config.loader import deep_merge
from trainer.config.schema import load_config, validate_config
from trainer.deploy import presets
from trainer.deploy.checks import check_manifests

DEPLOYMENT = REPO / "docs" / "guides" / "deployment.md"
#: the install commands as the docs write them -> (node GPUs, rollout servers, learner ranks)
HELM_INSTALLS = {
    "helm install stage2 charts/rollout-matching -f values-6v2.yaml": (8, 6, 2),
    "helm install stage2 charts/rollout-matching -f values-3v1.yaml": (4, 3, 1),
    "helm install stage2 charts/rollout-matching -f values-colocate.yaml": (8, 0, 8),
}
MAKE_JOB = "make job CONFIG=configs/summary_1024.yaml"


def docs_text() -> str:
    return "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))])


def bash_lines(text: str) -> list[str]:
    """Every logical line (continuations joined) of ``text``'s fenced bash blocks."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        out += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return out


def helm_install(command: str) -> tuple[str, str, dict]:
    """``(release, chart directory, merged values)`` of a ``helm install`` line: its ``-f`` files in order, later
    files win (mappings merge, lists replace, as Helm merges them)."""
    words = shlex.split(command, comments=True)
    assert words[:2] == ["helm", "install"], command
    release, chart, rest = words[2], words[3], words[4:]
    values: dict = {}
    i = 0
    while i < len(rest):
        assert rest[i] in ("-f", "--values"), f"{command}: only -f files here, got {rest[i]!r}"
        values = deep_merge(values, helm.values_from_yaml((REPO / rest[i + 1]).read_text()))
        i += 2
    return release, chart, values


def test_the_docs_give_each_install_command_as_written():
    lines = bash_lines(docs_text())
    for command in HELM_INSTALLS:
        assert any(line.split("#")[0].strip() == command for line in lines), f"no docs page runs `{command}`"
    assert command_in(lines, MAKE_JOB), f"no docs page runs `{MAKE_JOB}`"


def command_in(lines: list[str], command: str) -> bool:
    return any(command in line.split("#")[0] for line in lines)


@pytest.mark.parametrize("command", HELM_INSTALLS)
def test_helm_install_renders_as_written_from_the_repository_root(command):
    release, chart, values = helm_install(command)
    assert (REPO / chart).resolve() == CHART.resolve()
    assert_lint_clean(values)
    with helm.Chart.load(str(REPO / chart)) as loaded:
        docs = manifests_of(loaded.render(values, name=release, namespace="default", is_install=True))
    assert_valid_kubernetes(docs)
    node, n_servers, ranks = HELM_INSTALLS[command]
    assert check_manifests(docs, node) == []
    servers, (learner,) = workload(docs, "rollout-server"), workload(docs, "learner")
    assert len(servers) == n_servers and flag(args_of(learner), "--nproc-per-node") == str(ranks)
    gpus = [pod_spec(d)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for d in [*servers, learner]]
    assert sum(gpus) == node
    assert all(pod_spec(d)["hostNetwork"] for d in [*servers, learner]), "one node's network, servers on its loopback"
    urls = [f"http://127.0.0.1:{flag(args_of(s), '--port')}" for s in servers]
    if urls:
        assert flag(args_of(learner), "--wait-for-servers").split(",") == urls
    (output,) = [v for v in pod_spec(learner)["volumes"] if v["name"] == "output"]
    assert output["hostPath"]["path"] == presets.ROOT_OUTPUT_HOST_PATH, "checkpoints outlive the pod"
    assert flag(args_of(learner), "--resume") == "auto"
    validate_config(train_yaml(docs), source=command)


def test_helm_install_without_the_root_file_is_refused_as_the_chart_says():
    """The root file is what makes the bare command work: the preset alone names no output volume."""
    name = presets.ROOT_VALUES["values-6v2.yaml"]
    values = helm.values_from_yaml(presets.values_path(name).read_text())
    with pytest.raises(helm.HelmRenderError, match="storage.output"):
        render_chart(values)


def test_make_job_runs_render_job_on_the_config_and_dry_run_prints_valid_jobs(monkeypatch, capsys):
    proc = subprocess.run(["make", "--no-print-directory", "-n", *MAKE_JOB.split()[1:]], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if "-m trainer render-job" in ln]
    argv = shlex.split(line)
    argv = argv[argv.index("trainer") + 1:]
    assert argv == ["render-job", "--config", "configs/summary_1024.yaml"]
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("DRY_RUN", "1")
    assert main(argv) == 0, capsys.readouterr().err
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert_valid_kubernetes(docs)
    assert check_manifests(docs, 8) == []
    (server,), (learner,) = workload(docs, "rollout-server"), workload(docs, "learner")
    limits = [pod_spec(d)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for d in (server, learner)]
    assert limits == [6, 2], "6 rollout GPUs + 2 learner GPUs"


# --- docker run: the 4-GPU colocate learner ----------------------------------------------------------------------

DOCKER_VALUE_OPTIONS = {"--gpus", "-v", "--volume", "--shm-size", "--ipc", "--name", "--restart", "--network",
                        "--user", "-u", "-e", "--env"}


def docker_run(line: str) -> tuple[dict[str, list[str]], str, list[str]]:
    """``(options, image, arguments to the entry point)`` of a ``docker run`` line."""
    words = shlex.split(line, comments=True)
    assert words[:2] == ["docker", "run"], line
    options: dict[str, list[str]] = {}
    i = 2
    while words[i].startswith("-"):
        if words[i] in DOCKER_VALUE_OPTIONS:
            options.setdefault(words[i], []).append(words[i + 1])
            i += 2
        else:
            options.setdefault(words[i], []).append("")
            i += 1
    return options, words[i], words[i + 1:]


def entry_point(image: str) -> tuple[list[str], str]:
    """The ``ENTRYPOINT`` and ``WORKDIR`` of ``images/<image>/Dockerfile``."""
    text = (REPO / "images" / image / "Dockerfile").read_text()
    return json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1)), \
        re.findall(r"^WORKDIR (\S+)$", text, re.M)[-1]


def test_the_docs_4_gpu_colocate_docker_run_runs_the_image_entry_point_on_a_valid_config(capsys):
    (line,) = [ln.replace('"$PWD/', f'"{REPO}/') for ln in bash_lines(DEPLOYMENT.read_text())
               if ln.startswith("docker run") and "--gpus 4" in ln]
    options, image, argv = docker_run(line)
    with helm.Chart.load(str(CHART)) as chart:
        learner_image = chart.values["images"]["learner"]
    assert image == f"{learner_image['repository']}:{learner_image['tag']}", "the GPU learner image the chart runs"
    entry, _ = entry_point("learner")
    assert entry[-3:] == ["python", "-m", "trainer"], entry
    assert argv[:2] == ["launch", "learner"]
    mounts = {}
    for spec in options["-v"]:
        host, container, *mode = spec.split(":")
        mounts[container] = (host, mode == ["ro"])
    config = flag(argv, "--config")
    host_config, _ = mounts[config]
    cfg = load_config(host_config)
    rm = cfg.custom.extra.rollout_matching
    assert (rm.rollout_backend, rm.vllm.mode, rm.vllm.tensor_parallel_size) == ("vllm", "colocate", 1)

    def volume_of(path: str) -> tuple[str, bool]:
        hits = [m for m in mounts if path.startswith(m.rstrip("/") + "/")]
        assert hits, f"{path} lies on no mounted volume ({sorted(mounts)})"
        return mounts[max(hits, key=len)]

    assert volume_of(cfg.model.path)[0] == "/data/models"
    assert volume_of(cfg.data.train_jsonl)[0] == "/data/datasets"
    output_host, read_only = volume_of(cfg.training.output_dir)
    assert output_host == "/data/runs" and not read_only, "the output is written to the node"
    gpus = flag(argv, "--gpus").split(",")
    assert options["--gpus"] == ["4"] and len(gpus) == 4 == int(flag(argv, "--nproc-per-node"))
    local = [host_config if a == config else a for a in argv]
    assert main([*local, "--print-command", "--master-port", "29600"]) == 0, capsys.readouterr().err
    assert "torch.distributed.run --nproc_per_node 4" in capsys.readouterr().out


def test_the_container_suite_the_docs_name_exists_and_needs_docker():
    named = set(re.findall(r"tests/deploy/test_containers\.py", DEPLOYMENT.read_text()))
    assert named, "the deployment guide names the container suite"
    suite = (REPO / "tests" / "deploy" / "test_containers.py").read_text()
    assert "pytestmark = pytest.mark.docker" in suite and "testcontainers" in suite
