"""The metric loggers of ``training.report_to`` besides ``jsonl`` and ``tensorboard``: Weights & Biases (``wandb``)
and MLflow (``mlflow``), each an optional extra (``pip install -e '.[wandb]'`` / ``'.[mlflow]'``).

Each one mirrors ``metrics.jsonl``: every row written there (``telemetry.JsonlWriter``: the setup row, stage 1,
stage 2, eval, with their rollout, sync, time and memory figures) is handed to every logger as it is written
(``telemetry.mirror_rows``), so the names are the file's by construction. Of a row, the numbers are the metrics, at
the row's ``step`` (stage 2 counts its steps from 1 again after the warm-up, as in the file); ``phase``, ``step``
and ``time`` place it; the setup row's other values (which packed attention, which checkpointing) are the run's
config (W&B) or parameters (MLflow). Only rank 0 logs (the rank that writes the file).

* W&B: one run, ``wandb.init`` with the environment's settings (``WANDB_PROJECT``, default ``rollout-matching``;
  ``WANDB_MODE=offline``; ``WANDB_DIR``, default ``output_dir``); the run's x-axis is ``step``.
* MLflow: one run in ``MLFLOW_EXPERIMENT_NAME`` (default ``rollout-matching``) of ``MLFLOW_TRACKING_URI``: a
  tracking server (``http://…``) or a local database (``sqlite:///mlflow.db``). The extra is ``mlflow-skinny`` (the
  client without the server or UI) with SQLAlchemy and Alembic for the local database. Not a file store
  (``file:…``): MLflow 3 keeps it in maintenance mode, and it stores a metric as a file, so ``loss`` leaves no room
  for ``loss/ce``. MLflow allows only letters, digits and ``_-. :/`` in a name: any other character becomes ``_``
  (``mlflow_name``; ``eval/f1@50`` is ``eval/f1_50``), as HF's MLflow callback does.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from trainer.extras import EXTRAS, MissingExtraError, require
from trainer.telemetry import ROW_FIELDS, metric_values

#: report_to value → (the module it needs, the extra that installs it), where ``trainer.extras.EXTRAS`` lacks it
LIBRARIES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
DEFAULT_PROJECT = "rollout-matching"


def require_loggers(report_to: Iterable[str], key: str = "training.report_to") -> dict[str, Any]:
    """The modules of the W&B / MLflow loggers ``report_to`` names, imported; ``MissingExtraError`` (one line, with
    the install command) for the first one that is not importable."""
    out = {}
    for name in report_to:
        if name not in LIBRARIES:
            continue
        if name in EXTRAS:  # the extras table names it: its message and install command
            out[name] = require(name, f"{key}: {name}")
            continue
        module, extra = LIBRARIES[name]
        try:
            out[name] = importlib.import_module(module)
        except ImportError as exc:
            raise MissingExtraError(
                f"{key}: {name} needs the optional extra '{extra}' (module '{module}' is not importable: {exc}). "
                f"Install it with: pip install -e '.[{extra}]'") from exc
    return out


def settings_of(row: dict[str, Any]) -> dict[str, Any]:
    """A row's values that are not metrics (``metric_values``) nor its place (``ROW_FIELDS``): the setup row's
    choices (text, booleans, lists)."""
    metrics = metric_values(row)
    return {k: v for k, v in row.items() if k not in metrics and k not in ROW_FIELDS and v is not None}


class WandbLogger:
    """One W&B run; ``log_row`` logs a ``metrics.jsonl`` row's metrics under the row's names, at its ``step``."""

    def __init__(self, output_dir: str | Path, run_name: str, config: dict[str, Any] | None = None,
                 wandb: Any = None):
        self.wandb = wandb if wandb is not None else require_loggers(["wandb"])["wandb"]
        directory = Path(os.environ.get("WANDB_DIR") or output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, name=run_name,
                                   dir=str(directory), config=config or {})
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log_row(self, row: dict[str, Any]) -> None:
        metrics = metric_values(row)
        settings = settings_of(row)
        if settings:
            self.run.config.update(settings, allow_val_change=True)
        if metrics:
            self.run.log({**metrics, "step": int(row.get("step", 0))})

    def close(self) -> None:
        self.run.finish()


_MLFLOW_UNSAFE = re.compile(r"[^0-9A-Za-z_\-. :/]")


def mlflow_name(name: str) -> str:
    """``name`` as MLflow stores it: characters MLflow refuses become ``_`` (HF's MLflow callback's rule)."""
    return _MLFLOW_UNSAFE.sub("_", name)


class MlflowLogger:
    """One MLflow run (through ``MlflowClient``: no process-wide active run); ``log_row`` logs a row's metrics at its
    ``step`` and time, names through ``mlflow_name``."""

    def __init__(self, run_name: str, mlflow: Any = None):
        self.mlflow = mlflow if mlflow is not None else require_loggers(["mlflow"])["mlflow"]
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self._names: dict[str, str] = {}  # MLflow name → the row's, so that two names never fold into one

    def _name(self, key: str) -> str:
        name = mlflow_name(key)
        if self._names.setdefault(name, key) != key:
            raise ValueError(f"metrics {self._names[name]!r} and {key!r} are both {name!r} in MLflow")
        return name

    def log_row(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param

        stamp = int(float(row.get("time", time.time())) * 1000)
        step = int(row.get("step", 0))
        metrics = [Metric(self._name(k), v, stamp, step) for k, v in metric_values(row).items()]
        params = [Param(self._name(k), str(v)[:6000]) for k, v in settings_of(row).items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limits: 1000 metrics, 100 parameters
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_loggers(report_to: Sequence[str], output_dir: str | Path, config: dict[str, Any] | None = None,
                 run_name: str | None = None) -> list[Any]:
    """The W&B / MLflow loggers ``report_to`` names (none on a rank other than 0), each run named ``run_name``
    (default: the output directory's name). Raises ``MissingExtraError`` before any run is made when a library is
    missing."""
    modules = require_loggers(report_to)
    if not modules or int(os.environ.get("RANK", "0")) != 0:
        return []
    name = run_name or Path(output_dir).resolve().name
    out: list[Any] = []
    try:
        if "wandb" in modules:
            out.append(WandbLogger(output_dir, name, config, modules["wandb"]))
        if "mlflow" in modules:
            out.append(MlflowLogger(name, modules["mlflow"]))
    except BaseException:
        close_loggers(out)
        raise
    return out


def close_loggers(loggers: Iterable[Any]) -> None:
    for logger in loggers:
        logger.close()
