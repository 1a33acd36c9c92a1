"""Kubernetes manifests from a training config: ``jobs/*.j2`` rendered with Jinja2 into plain dicts.

Order: the ConfigMap holding the resolved training YAML, one Job per rollout server, then the learner Job.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jinja2
import yaml

from trainer.deploy.schema import DeployConfig
from trainer.deploy.topology import HEALTH_PATH, Topology

TEMPLATES_ENV = "ROLLOUT_MATCHING_JOBS_DIR"


def templates_dir() -> Path:
    """``$ROLLOUT_MATCHING_JOBS_DIR``, else ``jobs/`` beside the package (repository checkout or image)."""
    override = os.environ.get(TEMPLATES_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "jobs"


def local_devices(gpus: tuple[int, ...] | list[int]) -> str:
    """Container-local device indexes for a pod that sees ``len(gpus)`` devices: ``"0,1,…"``."""
    return ",".join(str(i) for i in range(len(gpus)))


def _environment(directory: Path) -> jinja2.Environment:
    if not (directory / "learner.yaml.j2").is_file():
        raise FileNotFoundError(f"job templates not found in {directory} (set {TEMPLATES_ENV} to the jobs/ directory)")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=False,
        lstrip_blocks=False,
        autoescape=False,
    )
    env.globals["local_devices"] = local_devices
    return env


def _load(text: str, template: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{template} rendered invalid YAML: {exc}\n{text}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{template} rendered {type(doc).__name__}, expected one manifest")
    return doc


def training_yaml(config: dict[str, Any]) -> str:
    """The resolved training config as mounted into the learner (the ``deploy`` section stays outside)."""
    body = {k: v for k, v in config.items() if k != "deploy"}
    return yaml.safe_dump(body, sort_keys=False, allow_unicode=True)


def render_manifests(topology: Topology, deploy: DeployConfig, config: dict[str, Any],
                     directory: Path | None = None) -> list[dict[str, Any]]:
    """ConfigMap + rollout-server Jobs + learner Job for ``topology``."""
    env = _environment(directory or templates_dir())
    common = {"name": topology.name, "deploy": deploy, "health_path": HEALTH_PATH}
    docs = [_load(env.get_template("configmap.yaml.j2").render(config_yaml=training_yaml(config), **common),
                  "configmap.yaml.j2")]
    server_template = env.get_template("rollout-server.yaml.j2")
    with_config = topology.workload == "grpo"  # swift rollout reads custom.extra.rollout_server.* from the config
    for server in topology.servers:
        docs.append(_load(server_template.render(server=server, with_config=with_config, **common),
                          "rollout-server.yaml.j2"))
    docs.append(_load(env.get_template("learner.yaml.j2").render(learner=topology.learner, **common), "learner.yaml.j2"))
    return docs


class _BlockStrDumper(yaml.SafeDumper):
    """Multi-line strings (the mounted training YAML) as literal blocks, so the output stays readable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value and not any(line != line.rstrip() for line in value.splitlines()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockStrDumper.add_representer(str, _str)


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    return yaml.dump_all(manifests, Dumper=_BlockStrDumper, sort_keys=False, allow_unicode=True, explicit_start=True)
