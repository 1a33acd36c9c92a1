"""The learner's Prometheus exporter (``training.metrics_port``; off by default).

``LearnerMetrics`` owns its own registry (never the process-global one) and, once ``serve`` is called, an HTTP
server (``prometheus_client.start_http_server``, ``training.metrics_host``, loopback by default) on the main process.
``PrometheusCallback`` feeds it from every log record ``RolloutMatchingTrainer.log`` writes, so it exports exactly
what the JSONL/TensorBoard logs carry. Names (all ``rm_learner_*``):

- ``rm_learner_step``: the optimizer step of the last log record; ``rm_learner_phase{phase}`` (stage1 / stage2)
- ``rm_learner_step_phase_seconds_total{phase}``: the ``time/<phase>_s`` step timers summed over the run
  (weight_sync, rollout, target, forward, backward, step and the sub-phases generate, parse, match, build_target)
- ``rm_learner_rollout_total{stat}``: the ``rollout/*`` counts (matched, fn_appended, fp, gated, gt, valid_pred,
  invalid_pred, truncated, excluded_alignment, samples) summed over the run
- ``rm_learner_weight_syncs_total``: ``sync/weight_syncs`` summed
- ``rm_learner_logged{key}``: the last logged value of every numeric key (loss, learning rate, rates, batch fill, ...)
- with rollout servers: ``rm_learner_servers_quarantined`` (now), ``rm_learner_server_quarantines_total`` and
  ``rm_learner_server_readmissions_total`` (from the rollout client's fleet)
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from transformers import TrainerCallback

log = logging.getLogger(__name__)


class LearnerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.step = Gauge("rm_learner_step", "optimizer step of the last log record", registry=r)
        self.phase = Gauge("rm_learner_phase", "1 for the running training phase", ["phase"], registry=r)
        self.step_seconds = Counter("rm_learner_step_phase_seconds", "time/<phase>_s step timers, summed",
                                    ["phase"], registry=r)
        self.rollout = Counter("rm_learner_rollout", "rollout/* counts, summed", ["stat"], registry=r)
        self.weight_syncs = Counter("rm_learner_weight_syncs", "weight syncs to the rollout engine", registry=r)
        self.logged = Gauge("rm_learner_logged", "last logged value of each numeric log key", ["key"], registry=r)
        self.quarantined = Gauge("rm_learner_servers_quarantined", "rollout servers quarantined now", registry=r)
        self.quarantines = Counter("rm_learner_server_quarantines", "rollout servers quarantined", registry=r)
        self.readmissions = Counter("rm_learner_server_readmissions", "rollout servers re-admitted", registry=r)
        self._readmitted = 0
        self._fleet = None
        self.server = None

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Start the HTTP exporter (once); ``host`` may name an environment variable (``${POD_IP}``)."""
        if self.server is not None:
            return
        from prometheus_client import start_http_server

        host = os.path.expandvars(host)
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        log.info("learner Prometheus metrics on http://%s:%d/metrics (training.metrics_port)", host, port)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def watch_fleet(self, engine: Any) -> None:
        """Follow a rollout client's server fleet (``ServerRolloutEngine.fleet``), if the engine has one."""
        fleet = getattr(engine, "fleet", None)
        if fleet is None or fleet is self._fleet:
            return
        self._fleet = fleet
        fleet.on_quarantine.append(lambda _url: (self.quarantines.inc(), self.refresh_fleet()))
        self.refresh_fleet()

    def refresh_fleet(self) -> None:
        if self._fleet is None:
            return
        meta = self._fleet.metadata()
        self.quarantined.set(len(meta.get("quarantined", ())))
        readmitted = len(meta.get("readmissions", ()))
        if readmitted > self._readmitted:
            self.readmissions.inc(readmitted - self._readmitted)
            self._readmitted = readmitted

    def observe(self, logs: dict[str, Any], step: int, phase: str) -> None:
        """One log record of ``RolloutMatchingTrainer.log``."""
        self.step.set(step)
        for name in ("stage1", "stage2"):
            self.phase.labels(name).set(1.0 if name == phase else 0.0)
        for key, val in logs.items():
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
                continue
            if key.startswith("time/") and key.endswith("_s"):
                self.step_seconds.labels(key[len("time/"):-len("_s")]).inc(max(val, 0.0))
            elif key.startswith("rollout/") and key not in ("rollout/valid_object_rate", "rollout/match_recall"):
                self.rollout.labels(key[len("rollout/"):]).inc(max(val, 0.0))
            elif key == "sync/weight_syncs":
                self.weight_syncs.inc(max(val, 0.0))
            self.logged.labels(key).set(val)
        self.refresh_fleet()


class PrometheusCallback(TrainerCallback):
    """Feeds ``LearnerMetrics`` from the trainer's log records (main process only)."""

    def __init__(self, metrics: LearnerMetrics, phase: str):
        self.metrics = metrics
        self.phase = phase

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.metrics.observe(logs, state.global_step, self.phase)
