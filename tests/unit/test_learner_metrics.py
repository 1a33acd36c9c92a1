"""The learner's Prometheus exporter (``trainer.sft.metrics``, ``training.metrics_port``): the step timers and
rollout counts ``RolloutMatchingTrainer.log`` writes, and the rollout client's quarantines / re-admissions, scraped
over HTTP from its own registry."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from transformers import TrainerControl, TrainerState, TrainingArguments

from trainer.config.schema import TrainingConfig
from trainer.launch.ports import listen_port as _free_port  # below the ephemeral range
from trainer.rollout.server_client import ServerEndpoint
from trainer.rollout.server_fleet import ServerFleet
from trainer.sft.metrics import LearnerMetrics, PrometheusCallback


def _scrape(port):
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _v(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


class _Engine:
    def __init__(self, fleet):
        self.fleet = fleet


def test_exporter_serves_step_timers_rollout_counts_and_fleet_events(tmp_path, monkeypatch):
    monkeypatch.setenv("RM_TEST_HOST", "127.0.0.1")
    fleet = ServerFleet([ServerEndpoint("http://127.0.0.1:1"), ServerEndpoint("http://127.0.0.1:2")],
                        readmit_after_s=5.0)
    metrics, port = LearnerMetrics(), _free_port()
    metrics.watch_fleet(_Engine(fleet))
    metrics.serve(port, "${RM_TEST_HOST}")
    try:
        cb = PrometheusCallback(metrics, "stage2")
        args, control = TrainingArguments(str(tmp_path), report_to=[]), TrainerControl()
        state = TrainerState()
        state.global_step = 3
        logs = {"loss": 1.5, "learning_rate": 1e-4, "time/rollout_s": 2.0, "time/forward_s": 0.5, "time/step_s": 3.0,
                "rollout/matched": 4.0, "rollout/gt": 5.0, "rollout/match_recall": 0.8, "sync/weight_syncs": 1.0}
        cb.on_log(args, state, control, logs=logs)
        state.global_step = 4
        cb.on_log(args, state, control, logs={**logs, "time/rollout_s": 1.0})
        fleet.quarantine("http://127.0.0.1:2", "connection refused")
        m = _scrape(port)
        assert _v(m, "rm_learner_step") == 4
        assert _v(m, "rm_learner_phase", phase="stage2") == 1 and _v(m, "rm_learner_phase", phase="stage1") == 0
        assert _v(m, "rm_learner_step_phase_seconds_total", phase="rollout") == 3.0
        assert _v(m, "rm_learner_step_phase_seconds_total", phase="step") == 6.0
        assert _v(m, "rm_learner_rollout_total", stat="matched") == 8.0
        assert _v(m, "rm_learner_rollout_total", stat="match_recall") is None  # a rate, not a count
        assert _v(m, "rm_learner_logged", key="rollout/match_recall") == 0.8
        assert _v(m, "rm_learner_logged", key="loss") == 1.5
        assert _v(m, "rm_learner_weight_syncs_total") == 2.0
        assert _v(m, "rm_learner_servers_quarantined") == 1
        assert _v(m, "rm_learner_server_quarantines_total") == 1
        assert _v(m, "rm_learner_server_readmissions_total") == 0

        fleet.readmit("http://127.0.0.1:2", mode="full", transport="inband", seconds=0.1)
        state.global_step = 5
        cb.on_log(args, state, control, logs={"loss": 1.0})
        m = _scrape(port)
        assert _v(m, "rm_learner_servers_quarantined") == 0
        assert _v(m, "rm_learner_server_readmissions_total") == 1
        assert _v(m, "rm_learner_server_quarantines_total") == 1
    finally:
        metrics.close()
        fleet.close()


def test_two_exporters_do_not_share_a_registry_and_the_port_is_off_by_default():
    a, b = LearnerMetrics(), LearnerMetrics()
    a.observe({"time/step_s": 1.0}, 1, "stage2")
    assert b.registry.get_sample_value("rm_learner_step_phase_seconds_total", {"phase": "step"}) is None
    assert a.registry.get_sample_value("rm_learner_step_phase_seconds_total", {"phase": "step"}) == 1.0
    assert TrainingConfig().metrics_port is None and TrainingConfig().metrics_host == "127.0.0.1"
