"""``bench --only fleet`` on a CUDA GPU with real vLLM: three ``serve --engine vllm`` processes beside the stage-2
learner on one GPU, one server SIGKILLed mid-decode and restarted, one SIGSTOPped past ``infer_timeout_s``, one
refusing a NaN update. Every fault is detected, the server quarantined (no posts while out) and re-admitted with the
current weights, every sample trained exactly once, and the servers' checksums agree at the end. The six-server run
with its figures is ``python -m trainer bench --only fleet`` (docs/guides/reliability.md).

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_fleet_gpu.py`` (about 5 minutes)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (../shared/tools/gpu-bundle)"),
]


def test_three_vllm_servers_with_faults_train_every_sample_once(tmp_path):
    from trainer.bench.fleet import Fault, gpu_settings, run

    settings = dataclasses.replace(
        gpu_settings(steps=20), servers=3, batch=6, max_new_tokens=128, infer_timeout_s=15.0, stall_s=20.0,
        one_server_steps=3, faults=(Fault("kill", 1, 2), Fault("stall", 2, 6), Fault("nan", 0, 14)))
    result = run(tmp_path / "out", settings)
    fleet = result["fleet"]
    assert fleet["stage2_steps"] == 20
    assert fleet["ledger"]["exactly_once"] and fleet["ledger"]["samples"] == 20 * 6, fleet["ledger"]
    rows = {r["fault"]: r for r in fleet["faults"]}
    assert set(rows) == {"kill", "stall", "nan"}
    for row in rows.values():
        assert row["quarantined_after_s"] is not None and row["readmitted_after_s"] is not None, row
        assert row["posts_while_quarantined"] == 0, row
    assert "timed out" in rows["stall"]["detected_as"] and "422" in rows["nan"]["detected_as"]
    assert fleet["final_checksums_agree"] and fleet["final_checksum_servers"] == 3
    assert result["one_server"]["ledger"]["exactly_once"]
