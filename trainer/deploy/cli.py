"""``python -m trainer render-job --config CONFIG [--dry-run]``: training config → Kubernetes Jobs.
``python -m trainer deploy render -f VALUES …``: the manifests ``helm install`` applies, rendered offline.

Resolves ``extends``, validates the training config and its ``deploy`` section once (``validate_config``), plans
the pods from the typed config (rollout servers when the config uses server mode, then the learner), renders
``jobs/*.j2``, checks the result, and either prints the YAML (``--dry-run`` or ``DRY_RUN=1``) or creates the objects
with the kubernetes client.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from trainer.config.deploy import DeployConfig
from trainer.config.errors import ConfigError, ConfigErrors
from trainer.config.loader import resolve_yaml
from trainer.config.schema import validate_config
from trainer.deploy.checks import check_manifests
from trainer.deploy.render import install_values, render_install, render_manifests, to_yaml
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


def run_deploy_render(args: argparse.Namespace) -> int:
    """Print, as YAML documents only, what ``helm install NAME CHART -f … --set …`` would apply; errors: one line
    on stderr, exit 2."""
    try:
        values = install_values(args.values, args.set)
        manifests = render_install(values, args.name, args.namespace, Path(args.chart) if args.chart else None)
    except ConfigError as exc:
        print(f"deploy render: {exc}", file=sys.stderr)
        return 2
    for path, text in manifests:
        sys.stdout.write(f"---\n# Source: {path}\n{text}\n")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("render-job", help="render a training config into Kubernetes Jobs and submit them (or print with --dry-run)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="training YAML (extends resolved); its deploy: section sets images, node, GPUs")
    p.add_argument("--dry-run", action="store_true", help="print the manifests as YAML instead of submitting (also DRY_RUN=1)")
    p.set_defaults(func=run)
    d = subparsers.add_parser("deploy", help="the Helm chart without a cluster: render what helm install would apply",
                              description="The Helm chart (charts/rollout-matching) without a Kubernetes cluster or "
                                          "the helm binary (Helm's Go SDK, helm-python-sdk).")
    deploy_subparsers = d.add_subparsers(dest="deploy_command", metavar="DEPLOY_COMMAND")
    deploy_subparsers.required = True
    r = deploy_subparsers.add_parser(
        "render", help="print the manifests helm install would apply, as YAML (nothing is contacted)",
        description="Print the objects `helm install NAME charts/rollout-matching -f FILE ... --set KEY=VALUE ...` "
                    "would create, as YAML documents on stdout (the helm test hooks left out), rendered offline "
                    "with Helm's Go SDK: no cluster and no helm binary are needed. A value the chart refuses is one "
                    "line on stderr, exit 2.")
    r.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                   help="values file, as helm's -f; repeat it: later files win, mappings merge")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one value, as helm's --set (e.g. node.name=gpu-node-1); applied after the files")
    r.add_argument("--name", default="stage2", help="the release name, helm install's NAME (default: stage2)")
    r.add_argument("-n", "--namespace", default="default", help="the release's namespace (default: default)")
    r.add_argument("--chart", default=None,
                   help="chart directory (default: charts/rollout-matching beside the package, or $ROLLOUT_MATCHING_CHART_DIR)")
    r.set_defaults(func=run_deploy_render)
    from trainer.deploy import lifecycle

    lifecycle.register(subparsers)
