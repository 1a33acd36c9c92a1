"""Kubernetes manifests from a training config: the Helm chart renders every pod, Jinja wraps the Jobs.

The pod spec (args, env, volumes, probes, security, GPU assignment, ports) has ONE source: the chart's
``charts/rollout-matching/templates/_workloads.tpl``. ``render_manifests`` maps the planned topology and the
``deploy:`` section onto chart values (``chart_values``), renders the chart with Helm's Go SDK (``helm-python-sdk``),
and wraps what it rendered with ``jobs/*.j2``, which add only each object's identity (name, namespace, labels).

``install_values`` and ``render_install`` are ``helm install``'s values and manifests without a cluster
(``python -m trainer deploy render``).

Order: the ConfigMap holding the training YAML, one Job per rollout server, the learner Job, then anything else the
chart rendered for the chosen values (a JobSet replaces the Jobs under ``gang.jobSet``; a PodDisruptionBudget).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import yaml

from trainer.config.errors import ConfigError
from trainer.config.loader import deep_merge
from trainer.deploy.schema import DeployConfig, ResourcesConfig
from trainer.deploy.topology import Topology

TEMPLATES_ENV = "ROLLOUT_MATCHING_JOBS_DIR"
CHART_ENV = "ROLLOUT_MATCHING_CHART_DIR"
MANAGED_BY = "rollout-matching-render-job"
_HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")


def templates_dir() -> Path:
    """``$ROLLOUT_MATCHING_JOBS_DIR``, else ``jobs/`` beside the package (repository checkout or image)."""
    override = os.environ.get(TEMPLATES_ENV)
    return Path(override) if override else Path(__file__).resolve().parents[2] / "jobs"


def chart_dir() -> Path:
    """``$ROLLOUT_MATCHING_CHART_DIR``, else ``charts/rollout-matching`` beside the package."""
    override = os.environ.get(CHART_ENV)
    return Path(override) if override else Path(__file__).resolve().parents[2] / "charts" / "rollout-matching"


def _environment(directory: Path) -> jinja2.Environment:
    if not (directory / "job.yaml.j2").is_file():
        raise FileNotFoundError(f"job templates not found in {directory} (set {TEMPLATES_ENV} to the jobs/ directory)")
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(directory)), undefined=jinja2.StrictUndefined,
                              autoescape=False)


def _load(text: str, template: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{template} rendered invalid YAML: {exc}\n{text}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{template} rendered {type(doc).__name__}, expected one manifest")
    return doc


def training_config(config: dict[str, Any]) -> dict[str, Any]:
    """The training config the learner mounts (the ``deploy`` section stays outside)."""
    return {k: v for k, v in config.items() if k != "deploy"}


def training_yaml(config: dict[str, Any]) -> str:
    return yaml.safe_dump(training_config(config), sort_keys=False, allow_unicode=True)


def _image(ref: str, pull_policy: str) -> dict[str, str]:
    """``repo/x:tag`` → repository + tag; a reference with a digest or without a tag stays whole (tag "")."""
    name = ref.rsplit("/", 1)[-1]
    if "@" not in ref and ":" in name:
        repository, tag = ref.rsplit(":", 1)
        return {"repository": repository, "tag": tag, "pullPolicy": pull_policy}
    return {"repository": ref, "tag": "", "pullPolicy": pull_policy}


def _resources(res: ResourcesConfig) -> dict[str, Any]:
    return {"requests": {"cpu": res.cpu, "memory": res.memory}, "limits": {"memory": res.memory}}


def _replacing(default: Any, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with a null for every key of ``default`` it lacks (at every depth): Helm merges a mapping with
    the chart's default, and a null deletes a default key, so the result replaces the default instead."""
    out = dict(given)
    if isinstance(default, dict):
        for key, value in default.items():
            if key not in out:
                out[key] = None
            elif isinstance(value, dict) and isinstance(out[key], dict):
                out[key] = _replacing(value, out[key])
    return out


def _helm() -> Any:
    try:
        import helm_python
    except ImportError:
        raise ConfigError("deploy", "rendering the Helm chart needs helm-python-sdk, which is not installed: "
                                    "pip install 'helm-python-sdk==0.2.2' (make setup installs it)") from None
    return helm_python


def chart_defaults(chart: Path | None = None) -> dict[str, Any]:
    """The chart's own ``values.yaml``."""
    with _helm().Chart.load(str(chart or chart_dir())) as loaded:
        return loaded.values


def chart_values(topology: Topology, deploy: DeployConfig, config: dict[str, Any],
                 defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Chart values for this plan: the topology's servers/learner and the ``deploy:`` section, then
    ``deploy.values`` (any chart value, e.g. ``priorityClassName``, ``caches``, ``gang``) merged over them.
    The training config replaces the chart's default ``learner.config`` (``defaults``: the chart's values)."""
    hosts = sorted({s.host for s in topology.servers})
    if len(hosts) > 1:
        raise ConfigError("custom.extra.rollout_matching.vllm.server.servers",
                          f"servers bind different loopback hosts {hosts}; use one (127.0.0.1)")
    sd, ld = deploy.server, deploy.learner
    first = topology.servers[0] if topology.servers else None
    volumes = {v.name: v for v in deploy.volumes}
    storage: dict[str, Any] = {
        slot: ({"enabled": True, "hostPath": volumes[slot].host_path, "claimName": "", "mountPath": volumes[slot].mount_path}
               if slot in volumes else {"enabled": False})
        for slot in ("models", "data")
    }
    storage["extraVolumes"] = [{"name": v.name, "hostPath": v.host_path, "mountPath": v.mount_path, "readOnly": v.read_only}
                               for v in deploy.volumes if v.name not in ("models", "data")]
    storage["output"] = {"hostPath": deploy.output_host_path or "", "claimName": "", "mountPath": deploy.output_mount_path}
    chosen = ((deploy.values.get("storage") or {}).get("output") or {}) if isinstance(deploy.values, dict) else {}
    if not (deploy.output_host_path or chosen.get("hostPath") or chosen.get("claimName") or chosen.get("ephemeral")):
        raise ConfigError("deploy.output_host_path", "the learner's checkpoints need a volume that outlives the pod: "
                          "set it to a node directory writable by deploy.run_as_user (e.g. /data/runs), or "
                          "deploy.values: {storage: {output: {claimName: <pvc>}}}, or {storage: {output: "
                          "{ephemeral: true}}} to lose them with the pod")
    values: dict[str, Any] = {
        "fullnameOverride": topology.name,
        "images": {"rolloutServer": _image(deploy.images.rollout_server, deploy.images.pull_policy),
                   "learner": _image(deploy.images.learner, deploy.images.pull_policy)},
        "imagePullSecrets": [{"name": s} for s in deploy.images.pull_secrets],
        "serviceAccountName": deploy.service_account or "",
        "node": {"name": deploy.node_name or "", "selector": dict(deploy.node_selector),
                 "tolerations": list(deploy.tolerations), "gpuCount": deploy.node_gpus},
        "gpu": {"resourceName": deploy.gpu_resource,
                "assignment": {"device_plugin": "devicePlugin", "visible_devices": "visibleDevices"}[deploy.gpu_assignment]},
        "nccl": {"hostIPC": deploy.host_ipc, **({"env": dict(deploy.nccl_env)} if deploy.nccl_env is not None else {})},
        "securityContext": {"runAsUser": deploy.run_as_user, "runAsGroup": deploy.run_as_user,
                            "fsGroup": deploy.run_as_user, "readOnlyRootFilesystem": deploy.read_only_root_filesystem},
        "storage": storage,
        "rolloutServer": {
            "host": hosts[0] if hosts else "127.0.0.1",
            "instances": [{"port": s.port, "gpus": list(s.gpus)} for s in topology.servers],
            "extraArgs": list(sd.extra_args),
            "probes": {"startup": {"periodSeconds": 10, "timeoutSeconds": 5,
                                   "failureThreshold": max(1, sd.startup_timeout_s // 10)}},
        },
        "learner": {
            "nprocPerNode": topology.learner.nproc_per_node, "gpus": list(topology.learner.gpus),
            "healthTimeoutS": topology.learner.health_timeout_s, "backoffLimit": ld.backoff_limit,
            "activeDeadlineSeconds": ld.active_deadline_s, "extraArgs": list(ld.extra_args),
            "config": _replacing(((defaults or {}).get("learner") or {}).get("config"), training_config(config)),
        },
        "tests": {"enabled": False},
    }
    # resources the deploy section sets explicitly replace the chart's; unset, the chart's defaults apply
    for key, section in (("rolloutServer", sd), ("learner", ld)):
        if "resources" in section.model_fields_set:
            res = section.resources
            values[key].update(shmSize=res.shm_size, resources=_replacing(
                ((defaults or {}).get(key) or {}).get("resources"), _resources(res)))
    if deploy.env is not None:
        values["env"] = dict(deploy.env)
    if first is not None:
        values["rolloutServer"].update(
            engine=first.engine, model=first.model or "", tensorParallelSize=first.tensor_parallel_size,
            dataParallelSize=first.data_parallel_size, gpuMemoryUtilization=first.gpu_memory_utilization,
            maxModelLen=first.max_model_len, enableLora=first.enable_lora)
    return deep_merge(values, deploy.values) if deploy.values else values


def render_chart(values: dict[str, Any], name: str, namespace: str, chart: Path | None = None) -> list[dict[str, Any]]:
    """The chart's manifests for ``values`` (Helm's Go SDK; template rules fail with the key to fix)."""
    helm = _helm()
    try:
        with helm.Chart.load(str(chart or chart_dir())) as loaded:
            rendered = loaded.render(values, name=name, namespace=namespace, is_install=True)
    except (helm.HelmValuesError, helm.HelmRenderError) as exc:
        raise ConfigError("deploy", f"the chart refused these values: {exc}") from None
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml") and "/tests/" not in path
            for doc in yaml.safe_load_all(text) if doc]


def _faithful(rendered: Any, original: Any) -> Any:
    """The chart's training YAML with the original scalars put back where Helm only changed their spelling (Go
    writes 1e-05, which YAML 1.1 readers take for a string); keys the chart set (server list, ports) stay."""
    if isinstance(rendered, dict) and isinstance(original, dict):
        return {k: _faithful(v, original[k]) if k in original else v for k, v in rendered.items()}
    if isinstance(rendered, list) and isinstance(original, list) and len(rendered) == len(original):
        return [_faithful(r, o) for r, o in zip(rendered, original)]
    if isinstance(rendered, str) and isinstance(original, (int, float)) and not isinstance(original, bool):
        try:
            return original if float(rendered) == float(original) else rendered
        except ValueError:
            return rendered
    return rendered


def _config_data(doc: dict[str, Any], config: dict[str, Any]) -> dict[str, str]:
    data = dict(doc["data"])
    if "train.yaml" in data:
        mounted = _faithful(yaml.safe_load(data["train.yaml"]), training_config(config))
        data["train.yaml"] = yaml.safe_dump(mounted, sort_keys=False, allow_unicode=True)
    return data


def _labels(doc: dict[str, Any]) -> dict[str, str]:
    labels = {k: v for k, v in (doc["metadata"].get("labels") or {}).items() if k not in _HELM_ONLY_LABELS}
    return {**labels, "app.kubernetes.io/managed-by": MANAGED_BY}


def _order(doc: dict[str, Any]) -> tuple[int, int]:
    labels = doc["metadata"].get("labels") or {}
    component = labels.get("app.kubernetes.io/component")
    rank = {"ConfigMap": 0}.get(doc["kind"], 3)
    if doc["kind"] == "Job":
        rank = 1 if component == "rollout-server" else 2
    return rank, int(labels.get("rollout-matching/server-index", 0))


def render_manifests(topology: Topology, deploy: DeployConfig, config: dict[str, Any],
                     directory: Path | None = None, chart: Path | None = None) -> list[dict[str, Any]]:
    """ConfigMap + rollout-server Jobs + learner Job for ``topology``: pods from the chart, Jobs from ``jobs/``."""
    env = _environment(directory or templates_dir())
    values = chart_values(topology, deploy, config, chart_defaults(chart))
    docs = sorted(render_chart(values, topology.name, deploy.namespace, chart), key=_order)
    out = []
    for doc in docs:
        common = {"name": doc["metadata"]["name"], "namespace": deploy.namespace, "labels": _labels(doc)}
        if doc["kind"] == "ConfigMap":
            out.append(_load(env.get_template("configmap.yaml.j2").render(data=_config_data(doc, config), **common), "configmap.yaml.j2"))
        elif doc["kind"] == "Job":
            out.append(_load(env.get_template("job.yaml.j2").render(spec=doc["spec"], **common), "job.yaml.j2"))
        else:  # JobSet (gang.jobSet), PodDisruptionBudget: as the chart rendered them, in the job's namespace
            out.append({**doc, "metadata": {**doc["metadata"], "namespace": deploy.namespace, "labels": common["labels"]}})
    return out


def _one_line(exc: BaseException) -> str:
    """Helm's message on one line (a line ending in ``:`` introduces the next)."""
    out = ""
    for part in (p.strip(" -") for p in str(exc).splitlines()):
        if part:
            out += (" " if out.endswith(":") else "; " if out else "") + part
    return out


def install_values(files: Sequence[str], sets: Sequence[str] = ()) -> dict[str, Any]:
    """The values ``helm install … -f FILE … --set KEY=VALUE …`` gives the chart: the files in order (later ones
    win; mappings merge, anything else replaces), then each ``--set``. Raises ``ConfigError`` naming the file or
    the expression."""
    helm = _helm()
    values: dict[str, Any] = {}
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"-f {name}", "no such file; give a values file such as values-6v2.yaml or "
                                            "presets/<name>.values.yaml")
        try:
            values = deep_merge(values, helm.values_from_yaml(path.read_text(encoding="utf-8")))
        except helm.HelmValuesError as exc:
            raise ConfigError(f"-f {name}", f"not a YAML mapping of chart values: {_one_line(exc)}") from None
    for expression in sets:
        try:
            values = deep_merge(values, helm.parse_set_string(expression))
        except helm.HelmValuesError as exc:
            raise ConfigError(f"--set {expression}", f"{_one_line(exc)}; write it as key.path=value") from None
    return values


def render_install(values: dict[str, Any], name: str, namespace: str,
                   chart: Path | None = None) -> list[tuple[str, str]]:
    """``(template path, manifest text)`` of every object ``helm install NAME CHART`` creates with ``values``, in
    the chart's template order; the ``helm test`` hooks, which only ``helm test`` creates, are left out. Offline: no
    cluster is contacted. Raises ``ConfigError`` with the chart's own message when it refuses the values."""
    helm = _helm()
    try:
        helm.validate_release_name(name)
    except helm.HelmInvalidArgError as exc:
        raise ConfigError("--name", _one_line(exc)) from None
    directory = chart or chart_dir()
    if not (directory / "Chart.yaml").is_file():
        raise ConfigError("--chart", f"{directory}: no Chart.yaml; point it at charts/rollout-matching")
    try:
        with helm.Chart.load(str(directory)) as loaded:
            rendered = loaded.render(values, name=name, namespace=namespace, is_install=True)
    except (helm.HelmValuesError, helm.HelmRenderError) as exc:
        raise ConfigError("values", f"the chart refused them: {_one_line(exc)}") from None
    except helm.HelmError as exc:
        raise ConfigError("--chart", f"{directory}: {_one_line(exc)}") from None
    out = []
    for path, text in sorted(rendered.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for part in re.split(r"(?m)^---[ \t]*$", text):
            doc = yaml.safe_load(part)
            if not doc:
                continue
            hook = ((doc.get("metadata") or {}).get("annotations") or {}).get("helm.sh/hook", "")
            if "test" in [h.strip() for h in hook.split(",")]:
                continue
            out.append((path, part.strip("\n")))
    return out


class _BlockStrDumper(yaml.SafeDumper):
    """Multi-line strings (the mounted training YAML) as literal blocks, so the output stays readable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value and not any(line != line.rstrip() for line in value.splitlines()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockStrDumper.add_representer(str, _str)


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    return yaml.dump_all(manifests, Dumper=_BlockStrDumper, sort_keys=False, allow_unicode=True, explicit_start=True)
