"""``bench --only fleet`` on the CPU: three real ``python -m trainer serve`` processes (scripted engine) beside a
stage-2 learner with ``async_rollouts``; one server is SIGKILLed mid-decode and restarted, one SIGSTOPped past
``infer_timeout_s``, one refuses a NaN update. Every fault must be detected, the server quarantined (no posts while
out) and re-admitted with the current weights, and every sample trained exactly once."""

from __future__ import annotations

import json

import pytest

from trainer.bench.fleet import cpu_settings, fault_outcomes, ledger_check, run, spread_per_step
from trainer.bench.fleet_server import poison_first_floating

pytestmark = pytest.mark.slow


def test_fleet_with_faults_trains_every_sample_once(tmp_path):
    settings = cpu_settings(steps=16, one_server_steps=2)
    result = run(tmp_path / "out", settings)
    fleet = result["fleet"]
    assert fleet["stage2_steps"] == 16
    assert fleet["ledger"]["exactly_once"], fleet["ledger"]
    assert fleet["ledger"]["samples"] == 16 * settings.batch
    assert sum(fleet["requests_per_server"]) == 16 * settings.batch, "each sample answered once by some server"
    assert all(n > 0 for n in fleet["requests_per_server"]), fleet["requests_per_server"]
    rows = {r["fault"]: r for r in fleet["faults"]}
    assert set(rows) == {"kill", "stall", "nan"}
    for row in rows.values():
        assert row["quarantined_after_s"] is not None and row["readmitted_after_s"] is not None, row
        assert row["posts_while_quarantined"] == 0, row
    assert rows["kill"]["mid_decode"] and rows["stall"]["mid_decode"]
    assert "/infer/ failed" in rows["kill"]["detected_as"] and rows["kill"]["requests_failed_and_rerolled"] > 0
    assert "timed out" in rows["stall"]["detected_as"] and rows["stall"]["requests_failed_and_rerolled"] > 0
    assert "422" in rows["nan"]["detected_as"] and "non-finite" in rows["nan"]["detected_as"]
    # the new process exists before it can be re-admitted (the fleet's own /health/ probe may see it before the
    # bench's watcher does, so health-vs-readmission order is not asserted)
    assert rows["kill"]["restarted_after_s"] < rows["kill"]["readmitted_after_s"]
    assert fleet["final_checksums_agree"] and fleet["final_checksum_servers"] == 3
    assert result["one_server"]["ledger"]["exactly_once"]
    saved = json.loads((tmp_path / "out" / "fleet_cpu.json").read_text())
    assert saved["headline"]["faults_readmitted"] == 3 and saved["headline"]["lost"] == 0
    assert (tmp_path / "out" / "fleet_cpu.png").stat().st_size > 10_000
    logs = sorted(p.name for p in (tmp_path / "out" / "fleet_logs_cpu").iterdir())
    assert logs == ["server-0.log", "server-1.log", "server-2.log"]
    assert "fault injection: NaN written into" in (tmp_path / "out" / "fleet_logs_cpu" / "server-0.log").read_text()
    assert (tmp_path / "out" / "fleet_logs_cpu" / "server-1.log").read_text().count("=== start") == 2


def test_ledger_check_names_lost_duplicated_and_unknown():
    rows = [{"sample_id": s} for s in ("a", "b", "b", "z")]
    out = ledger_check(rows, ["a", "b", "c"])
    assert (out["lost"], out["duplicated"], out["unknown"], out["exactly_once"]) == (1, 1, 1, False)
    assert out["lost_ids"] == ["c"] and out["duplicated_ids"] == ["b"]
    assert ledger_check([{"sample_id": "a"}], ["a"])["exactly_once"]


def test_spread_attributes_posts_to_the_step_they_were_sent_in():
    timeline = [("step", 0.0, 1.0), ("wait", 1.0, 1.2), ("step", 1.0, 2.0)]
    spans = [("u0", 0.5, 0.9, 2, True), ("u1", 1.5, 1.9, 3, True), ("u1", 1.6, 1.7, 4, False), ("u0", 5.0, 6, 1, True)]
    assert spread_per_step(timeline, spans, ["u0", "u1"]) == [[2, 0], [1, 3]]


def test_fault_outcome_counts_posts_sent_while_quarantined():
    events = [{"kind": "nan", "server": 0, "url": "http://s0", "t": 10.0, "steps_done": 3}]
    records = [(10.5, "WARNING", "quarantining rollout server http://s0 (refused (HTTP 422)): ..."),
               (14.0, "WARNING", "rollout server http://s0 re-admitted after a full weight re-sync")]
    spans = [("http://s0", 12.0, 12.5, 2, True), ("http://s0", 15.0, 15.5, 2, True), ("http://s1", 12, 13, 2, True)]
    [row] = fault_outcomes(events, records, spans)
    assert row["quarantined_after_s"] == 0.5 and row["readmitted_after_s"] == 4.0
    assert row["posts_while_quarantined"] == 1 and row["detected_as"].startswith("refused (HTTP 422)")


def test_poison_check_puts_one_nan_in_a_copy():
    import torch

    tensors = {"b": torch.ones(3), "a": torch.arange(4), "c": torch.zeros(2)}
    bad, name = poison_first_floating(tensors)
    assert name == "b" and torch.isnan(bad["b"][0]) and not torch.isnan(tensors["b"]).any()
    assert bad["a"] is tensors["a"] and bad["c"] is tensors["c"]


def test_the_learner_is_held_only_in_the_tail_and_only_for_faults_already_due():
    from dataclasses import replace

    from trainer.bench.fleet import Fault, FaultInjector

    settings = replace(cpu_settings(steps=10), outcome_hold_s=0.2)  # faults after steps 1, 4, 7
    inj = FaultInjector(settings, [], [], None)
    assert not inj.restarts_pending(0) and inj.restarts_pending(1), "the kill due after step 1 is not injected yet"
    kill = {"kind": "kill", "server": 1}
    inj.events.append(kill)
    assert inj.restarts_pending(3), "the restarted server has not answered yet"
    kill["healthy_again_t"] = 1.0
    assert not inj.restarts_pending(3) and inj.restarts_pending(4)
    inj.events += [{"kind": "stall"}, {"kind": "nan"}]
    assert not inj.restarts_pending(9)
    assert inj.hold_for_outcomes(2) == 0.0
    kill.pop("healthy_again_t")
    assert inj.hold_for_outcomes(5) == 0.0, "before the tail (last outcome_steps steps) nobody waits"
    assert inj.hold_for_outcomes(8) >= 0.2, "in the tail it waits (here up to outcome_hold_s)"
    kill["restart_failed"] = "exit 1"
    assert inj.hold_for_outcomes(8) == 0.0, "a restart that failed is an outcome too"
    # a short run whose faults come after its last step: never held
    late = FaultInjector(replace(settings, steps=5, faults=(Fault("kill", 0, 6),)), [], [], None)
    assert late.hold_for_outcomes(3) == 0.0
