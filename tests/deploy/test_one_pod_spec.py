"""One source for the pod spec: ``render-job`` asks the Helm chart for the pods and Jinja only wraps the Jobs, so
the chart's pods and the jobs' pods agree; ``deploy.values`` reaches every chart option."""

from __future__ import annotations

import yaml
from deploy_helpers import REPO, assert_valid_kubernetes, load_values, manifests_of, render_chart, workload

from trainer.config.loader import deep_merge
from trainer.deploy.checks import check_manifests
from trainer.deploy.cli import build_manifests


def _chart_config(values):
    (cm,) = [d for d in manifests_of(render_chart(values)) if d["kind"] == "ConfigMap"]
    return yaml.safe_load(cm["data"]["train.yaml"])


def _by_component(docs):
    return {(c, i): d["spec"] for c in ("rollout-server", "learner") for i, d in enumerate(workload(docs, c))}


def test_chart_pods_and_render_job_pods_agree(tmp_path, monkeypatch):
    """presets/3v1-2b-full.values.yaml installed with Helm vs `render-job` of the training config those pods mount: the same Jobs."""
    values = load_values("presets/3v1-2b-full.values.yaml")
    config = _chart_config(values)
    config["deploy"] = {"node_gpus": 4, "server": {"gpu_memory_utilization": 0.6}, "output_host_path": "/data/runs"}
    path = tmp_path / "stage2-3v1.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(REPO)
    jobs, _ = build_manifests(str(path))
    chart = manifests_of(render_chart({**values, "fullnameOverride": "stage2-3v1"}, name="stage2-3v1"))
    chart_specs, job_specs = _by_component(chart), _by_component(jobs)
    assert sorted(chart_specs) == sorted(job_specs) == [("learner", 0), ("rollout-server", 0), ("rollout-server", 1),
                                                        ("rollout-server", 2)]
    for key in chart_specs:
        assert job_specs[key] == chart_specs[key], f"{key}: the chart's Job spec and render-job's differ"
    (chart_cm,) = [d for d in chart if d["kind"] == "ConfigMap"]
    assert yaml.safe_load(jobs[0]["data"]["train.yaml"]) == yaml.safe_load(chart_cm["data"]["train.yaml"])
    assert [(d["kind"], d["metadata"]["name"]) for d in jobs] == [
        ("ConfigMap", "stage2-3v1-config"), ("Job", "stage2-3v1-server-0"), ("Job", "stage2-3v1-server-1"),
        ("Job", "stage2-3v1-server-2"), ("Job", "stage2-3v1-learner")]
    for d in jobs:
        assert d["metadata"]["namespace"] == "default"
        assert d["metadata"]["labels"]["rollout-matching/run"] == "stage2-3v1"
        assert d["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "rollout-matching-render-job"
        assert "helm.sh/chart" not in d["metadata"]["labels"]


def test_jobs_directory_holds_no_pod_logic():
    templates = sorted(p.name for p in (REPO / "jobs").glob("*.j2"))
    assert templates == ["configmap.yaml.j2", "job.yaml.j2"]
    for name in templates:
        text = (REPO / "jobs" / name).read_text()
        for pod_word in ("containers", "volumeMounts", "securityContext", "env:", "Probe"):
            assert pod_word not in text, f"jobs/{name} writes pod spec ({pod_word}); the chart owns it"


def test_deploy_values_reach_the_chart(tmp_path, monkeypatch):
    values = load_values("presets/3v1-2b-full.values.yaml")
    config = _chart_config(values)
    config["deploy"] = {"node_gpus": 4, "output_host_path": "/data/runs", "name": "opts", "namespace": "training",
                        "server": {"resources": {"cpu": "2", "memory": "16Gi", "shm_size": "4Gi"}},
                        "env": {"EXTRA": "1", "HF_HUB_OFFLINE": None},
                        "values": {"priorityClassName": "training-high", "jobs": {"ttlSecondsAfterFinished": 600},
                                   "caches": {"hostPath": "/var/cache/rm"}, "gang": {"queueName": "gpu-queue"},
                                   "podDisruptionBudget": {"enabled": True}}}
    path = tmp_path / "opts.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(REPO)
    docs, deploy = build_manifests(str(path))
    assert_valid_kubernetes(docs)
    assert check_manifests(docs, 4) == []
    assert [d["kind"] for d in docs] == ["ConfigMap", "Job", "Job", "Job", "Job", "PodDisruptionBudget"]
    for d in docs[1:5]:
        spec = d["spec"]["template"]["spec"]
        assert spec["priorityClassName"] == "training-high" and d["spec"]["ttlSecondsAfterFinished"] == 600
        assert d["spec"]["suspend"] is True and d["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
        assert env["EXTRA"] == "1" and "HF_HUB_OFFLINE" not in env and env["TOKENIZERS_PARALLELISM"] == "false"
        assert [v for v in spec["volumes"] if v["name"] == "compile-cache"][0]["hostPath"]["path"] == "/var/cache/rm"
    server = workload(docs, "rollout-server")[0]["spec"]["template"]["spec"]
    assert server["containers"][0]["resources"]["requests"] == {"cpu": "2", "memory": "16Gi"}
    assert [v for v in server["volumes"] if v["name"] == "dshm"][0]["emptyDir"]["sizeLimit"] == "4Gi"
    learner = workload(docs, "learner")[0]["spec"]["template"]["spec"]
    assert learner["containers"][0]["resources"]["limits"]["memory"] == "128Gi"  # the chart's default
    assert all(d["metadata"]["namespace"] == "training" for d in docs)


def test_a_jobset_is_printed_for_gang_scheduling(tmp_path, monkeypatch):
    config = deep_merge(_chart_config(load_values("presets/3v1-2b-full.values.yaml")),
                        {"deploy": {"node_gpus": 4, "output_host_path": "/data/runs", "name": "gang", "values": {"gang": {"jobSet": {"enabled": True}}}}})
    path = tmp_path / "gang.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(REPO)
    docs, _ = build_manifests(str(path))
    assert [d["kind"] for d in docs] == ["ConfigMap", "JobSet"]
    assert check_manifests(docs, 4) == []
    assert docs[1]["metadata"]["namespace"] == "default"


def test_a_jobset_is_not_submitted_with_the_client(tmp_path, monkeypatch, capsys):
    from trainer.cli import main

    config = deep_merge(_chart_config(load_values("presets/3v1-2b-full.values.yaml")),
                        {"deploy": {"node_gpus": 4, "output_host_path": "/data/runs", "name": "gang", "values": {"gang": {"jobSet": {"enabled": True}}}}})
    path = tmp_path / "gang.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.delenv("DRY_RUN", raising=False)
    assert main(["render-job", "--config", str(path)]) == 1
    assert "JobSet is a custom resource" in capsys.readouterr().err
