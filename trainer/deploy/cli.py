"""``python -m trainer render-job --config CONFIG [--dry-run]``: training config → Kubernetes Jobs.

Resolves ``extends``, validates the training config and its ``deploy`` section once (``validate_config``), plans
the pods from the typed config (rollout servers when the config uses server mode, then the learner), renders
``jobs/*.j2``, checks the result, and either prints the YAML (``--dry-run`` or ``DRY_RUN=1``) or creates the objects
with the kubernetes client.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from trainer.config.deploy import DeployConfig
from trainer.config.errors import ConfigError, ConfigErrors
from trainer.config.loader import resolve_yaml
from trainer.config.schema import validate_config
from trainer.deploy.checks import check_manifests
from trainer.deploy.render import render_manifests, to_yaml
from trainer.deploy.submit import SubmitError, submit
from trainer.deploy.topology import job_name, plan_topology

TRUTHY = ("1", "true", "yes", "on")


def build_manifests(config_path: str) -> tuple[list[dict[str, Any]], DeployConfig]:
    """Resolved + validated config → checked manifests; raises ``ConfigErrors`` naming the keys to fix.

    The config is validated once, by the same schema ``launch`` uses (``validate_config``: every section, the
    ``deploy`` section and the GRPO rules included; GRPO warnings are logged by the schema); the plan reads the
    typed object. The resolved mapping is only what the learner mounts as its config file."""
    try:
        data = resolve_yaml(config_path)
    except ConfigError as exc:
        raise ConfigErrors(config_path, [exc]) from None
    config = validate_config(data, source=config_path)
    deploy = config.deploy
    try:
        topology = plan_topology(config, deploy, job_name(config_path, deploy))
    except ConfigError as exc:
        raise ConfigErrors(config_path, [exc]) from None
    try:
        manifests = render_manifests(topology, deploy, data)
    except ConfigError as exc:
        raise ConfigErrors(config_path, [exc]) from None
    problems = check_manifests(manifests, deploy.node_gpus, deploy.gpu_resource)
    if problems:
        raise ConfigErrors(config_path, [ConfigError("deploy", p) for p in problems])
    return manifests, deploy


def run(args: argparse.Namespace) -> int:
    dry_run = args.dry_run or os.environ.get("DRY_RUN", "").strip().lower() in TRUTHY
    try:
        manifests, deploy = build_manifests(args.config)
    except ConfigErrors as exc:
        print(exc, file=sys.stderr)
        return 2
    if dry_run:
        sys.stdout.write(to_yaml(manifests))
        return 0
    try:
        created = submit(manifests, deploy.namespace)
    except SubmitError as exc:
        print(f"render-job: {exc}", file=sys.stderr)
        return 1
    for ref in created:
        print(f"created {ref} in namespace {deploy.namespace}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("render-job", help="render a training config into Kubernetes Jobs and submit them (or print with --dry-run)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="training YAML (extends resolved); its deploy: section sets images, node, GPUs")
    p.add_argument("--dry-run", action="store_true", help="print the manifests as YAML instead of submitting (also DRY_RUN=1)")
    p.set_defaults(func=run)
    from trainer.deploy import lifecycle

    lifecycle.register(subparsers)
