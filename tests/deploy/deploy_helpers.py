"""Helpers for the deployment tests: chart rendering through Helm's Go SDK and manifest validation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rollout-matching"
TOPOLOGY_FILES = ("presets/6v2-2b-full.values.yaml", "presets/3v1-2b-full.values.yaml",
                  "presets/colocate-4-2b-full.values.yaml")
ALL_VALUES = (None, *TOPOLOGY_FILES)  # the chart defaults and some presets (tests/deploy/test_presets.py: all of them)
#: what the install command adds to every values file (`--set storage.output.hostPath=/data/runs`, the docs' line):
#: the chart refuses to render without an output volume
INSTALL_SET = {"storage": {"output": {"hostPath": "/data/runs"}}}
# Versions the manifests must validate against: the chart's minimum (kubeVersion) and the newest schema shipped.
KUBE_VERSIONS = ("1.27.0", "1.37.0")


def load_values(name: str | None, install_set: bool = True) -> dict[str, Any]:
    """Values of a preset file (``None``: the chart defaults alone), with the install command's ``INSTALL_SET``
    unless ``install_set`` is false."""
    from trainer.config.loader import deep_merge

    values = {} if name is None else helm.values_from_yaml((REPO / name).read_text())
    return deep_merge(values, copy.deepcopy(INSTALL_SET)) if install_set else values


def render_chart(values: dict[str, Any], name: str = "stage2", namespace: str = "ml") -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values, name=name, namespace=namespace, is_install=True)


def render_docs(values_file: str | None, overrides: dict[str, Any] | None = None,
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(values, manifests)`` of the chart rendered with a topology file's values (``None``: the defaults), with
    ``overrides`` merged over them."""
    from trainer.config.loader import deep_merge

    values = load_values(values_file)
    if overrides:
        values = deep_merge(values, copy.deepcopy(overrides))
    return values, manifests_of(render_chart(values))


def assert_lint_clean(values: dict[str, Any]) -> None:
    """``helm lint --strict`` reports no error and no warning."""
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def node_gpus(values: dict[str, Any]) -> int:
    """GPUs of the node the values describe (the chart's default 8)."""
    return values.get("node", {}).get("gpuCount", 8)


def train_yaml(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The training config the chart mounts (its one ConfigMap's ``train.yaml``)."""
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return yaml.safe_load(cm["data"]["train.yaml"])


def manifests_of(rendered: dict[str, str]) -> list[dict[str, Any]]:
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def assert_valid_kubernetes(docs: list[dict[str, Any]]) -> None:
    """Every manifest validates (strict: no unknown fields) against the Kubernetes OpenAPI schemas."""
    assert docs, "nothing rendered"
    for doc in docs:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{doc['kind']} {doc['metadata']['name']} invalid for Kubernetes {version}: "
                                     f"{exc.message} at {list(exc.path)}") from None


def workload(docs: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    def labels(doc):
        tpl = doc if doc["kind"] == "Pod" else doc["spec"]["template"]
        return (tpl.get("metadata") or {}).get("labels") or {}
    return [d for d in docs if d["kind"] in ("Pod", "Job", "Deployment")
            and labels(d).get("app.kubernetes.io/component") == component]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def args_of(doc: dict[str, Any]) -> list[str]:
    return [str(a) for a in pod_spec(doc)["containers"][0].get("args") or []]


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]
