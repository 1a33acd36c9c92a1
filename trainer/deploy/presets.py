"""Presets: one node layout as a chart values file (``presets/<name>.values.yaml``, the source) and the same learner
config for a bare-metal run (``presets/<name>.yaml``, generated from it).

The bare-metal config is exactly the training YAML the chart mounts for that values file (Helm renders it: the
chart's default ``learner.config`` under the preset's, the rollout-server list and weight-sync port written in), with
the values file's first line (how the preset was measured) and the commands that start it on a node without
Kubernetes. ``python -m trainer.deploy.presets`` (``make presets``) writes them; ``--check`` fails when one differs.

It also writes the design's entry-point values files at the repository root (``ROOT_VALUES``: ``values-6v2.yaml``,
``values-3v1.yaml``, ``values-colocate.yaml``), so ``helm install stage2 charts/rollout-matching -f values-6v2.yaml``
runs as written from the root: each is its preset's values file, line for line, with the node directory
``/data/runs`` as the learner's output volume (the one value every install of a preset adds).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from trainer.config.loader import deep_merge
from trainer.deploy.render import _faithful, chart_defaults, render_chart

REPO = Path(__file__).resolve().parents[2]
PRESETS_DIR = REPO / "presets"
VALUES_SUFFIX = ".values.yaml"
#: the repository root's values files (the design's entry points) and the preset each one installs
ROOT_VALUES = {"values-6v2.yaml": "6v2-2b-full", "values-3v1.yaml": "3v1-2b-full",
               "values-colocate.yaml": "colocate-8-2b-full"}
#: the learner's output volume a root values file adds to its preset (the docs' `--set storage.output.hostPath=...`)
ROOT_OUTPUT_HOST_PATH = "/data/runs"


def names(directory: Path = PRESETS_DIR) -> list[str]:
    """Every preset in ``directory`` (one per ``<name>.values.yaml``), sorted."""
    return sorted(p.name[: -len(VALUES_SUFFIX)] for p in directory.glob(f"*{VALUES_SUFFIX}"))


def values_path(name: str, directory: Path = PRESETS_DIR) -> Path:
    return directory / f"{name}{VALUES_SUFFIX}"


def config_path(name: str, directory: Path = PRESETS_DIR) -> Path:
    return directory / f"{name}.yaml"


def header(name: str, directory: Path = PRESETS_DIR) -> str:
    """The values file's first line: how the preset was measured."""
    return values_path(name, directory).read_text().splitlines()[0]


def _ordered(rendered: Any, original: Any) -> Any:
    """``rendered`` with its keys in ``original``'s order (Helm sorts them), keys the chart added after them."""
    if not (isinstance(rendered, dict) and isinstance(original, dict)):
        return rendered
    keys = [k for k in original if k in rendered] + [k for k in rendered if k not in original]
    return {k: _ordered(rendered[k], original.get(k)) for k in keys}


def train_config(values: dict[str, Any]) -> dict[str, Any]:
    """The training config the chart mounts for ``values`` (the output volume is irrelevant to it: an emptyDir)."""
    output = (values.get("storage") or {}).get("output") or {}
    if not (output.get("hostPath") or output.get("claimName") or output.get("ephemeral")):
        values = deep_merge(values, {"storage": {"output": {"ephemeral": True}}})
    docs = render_chart(values, name="preset", namespace="default")
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    original = deep_merge(chart_defaults()["learner"]["config"], values["learner"]["config"])
    preferred = deep_merge(deep_merge({k: None for k in ("model", "data", "tuner", "training")}, original),
                           values["learner"]["config"])
    return _ordered(_faithful(yaml.safe_load(configmap["data"]["train.yaml"]), original), preferred)


def bare_metal_commands(name: str, values: dict[str, Any]) -> list[str]:
    """The ``python -m trainer launch`` lines that start the preset on one node: each server, then the learner."""
    defaults = chart_defaults()
    server = deep_merge(defaults["rolloutServer"], values.get("rolloutServer") or {})
    learner = deep_merge(defaults["learner"], values.get("learner") or {})
    lines = []
    for inst in server.get("instances") or []:
        lines.append(shlex.join([
            "python", "-m", "trainer", "launch", "server", "--engine", server["engine"], "--port", str(inst["port"]),
            "--gpus", ",".join(map(str, inst["gpus"])), "--model", server["model"],
            "--tensor-parallel-size", str(server["tensorParallelSize"]),
            "--gpu-memory-utilization", str(server["gpuMemoryUtilization"]),
            "--max-model-len", str(server["maxModelLen"]), "--cpu-affinity", "node"]) + " &")
    wait = ["--wait-for-servers", "config"] if server.get("instances") else []
    lines.append(shlex.join(["python", "-m", "trainer", "launch", "learner", "--config", f"presets/{name}.yaml",
                             "--gpus", ",".join(map(str, learner["gpus"])), *wait, "--resume", "auto"]))
    return lines


def bare_metal_text(name: str, directory: Path = PRESETS_DIR) -> str:
    """The whole ``presets/<name>.yaml``: header, provenance, how to start it, the training config."""
    values = yaml.safe_load(values_path(name, directory).read_text())
    intro = [header(name, directory),
             f"# Generated from presets/{name}.values.yaml by `make presets` (python -m trainer.deploy.presets): edit",
             "# that file, not this one. The learner config the chart mounts for it, for a node without Kubernetes:",
             *(f"#   {line}" for line in bare_metal_commands(name, values))]
    body = yaml.safe_dump(train_config(values), sort_keys=False, allow_unicode=True)
    return "\n".join(intro) + "\n" + body


def stale(directory: Path = PRESETS_DIR) -> list[str]:
    """Presets whose bare-metal config is missing or differs from what its values file generates."""
    return [n for n in names(directory)
            if not config_path(n, directory).is_file() or config_path(n, directory).read_text() != bare_metal_text(n, directory)]


def root_values_text(alias: str, directory: Path = PRESETS_DIR) -> str:
    """The whole root ``alias`` (e.g. ``values-6v2.yaml``): its preset's values file with the learner's output on the
    node's ``ROOT_OUTPUT_HOST_PATH``; the preset's own install line is replaced by the alias's."""
    name = ROOT_VALUES[alias]
    text = values_path(name, directory).read_text()
    if "storage" in (yaml.safe_load(text) or {}):
        raise ValueError(f"presets/{name}{VALUES_SUFFIX} sets storage: merge it into {alias} by hand or drop it")
    lines = text.splitlines()
    n_header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    header = [line for line in lines[:n_header] if "helm install" not in line and not line.startswith("#     --set")]
    intro = [*header,
             f"# Generated from presets/{name}{VALUES_SUFFIX} by `make presets` (python -m trainer.deploy.presets): edit",
             f"# that file, not this one. The preset with the node's {ROOT_OUTPUT_HOST_PATH} as the learner's output volume:",
             f"#   helm install stage2 charts/rollout-matching -f {alias} [--set node.name=<gpu-node>]"]
    storage = ["storage:", "  output:",
               f"    hostPath: {ROOT_OUTPUT_HOST_PATH}   # checkpoints and metrics; a directory uid 1000 can write"]
    return "\n".join([*intro, *lines[n_header:], *storage]) + "\n"


def stale_root_values(directory: Path = PRESETS_DIR, root: Path = REPO) -> list[str]:
    """Root values files that are missing or differ from what their preset generates."""
    return [a for a in ROOT_VALUES
            if not (root / a).is_file() or (root / a).read_text() != root_values_text(a, directory)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.deploy.presets", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming every stale bare-metal config")
    args = p.parse_args(argv)
    if args.check:
        bad = stale()
        for name in bad:
            print(f"presets/{name}.yaml differs from what presets/{name}.values.yaml generates: run `make presets`",
                  file=sys.stderr)
        bad_root = stale_root_values()
        for alias in bad_root:
            print(f"{alias} differs from what presets/{ROOT_VALUES[alias]}{VALUES_SUFFIX} generates: run `make presets`",
                  file=sys.stderr)
        return 1 if bad or bad_root else 0
    for name in names():
        config_path(name).write_text(bare_metal_text(name))
        print(f"wrote presets/{name}.yaml")
    for alias in ROOT_VALUES:
        (REPO / alias).write_text(root_values_text(alias))
        print(f"wrote {alias} (presets/{ROOT_VALUES[alias]}{VALUES_SUFFIX})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
