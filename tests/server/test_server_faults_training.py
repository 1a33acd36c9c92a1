"""Real stage-2 training in server mode against three in-process scripted rollout servers, one of which stalls past
``infer_timeout_s`` mid-run: the timeout fires, the stalled chunk is re-rolled on the other servers, the stalled
server is quarantined, re-synced and re-admitted, training finishes and the ledger shows every sample of the epoch
trained exactly once."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from pathlib import Path

from trainer.config.schema import validate_config
from trainer.server.scripted import ScriptedEngine
from trainer.sft.run import run_training


class StallsOnce(ScriptedEngine):
    """Answers normally except on its ``stall_on``-th generate call, which sleeps ``stall_s`` first."""

    def __init__(self, *args, stall_on: int, stall_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.stall_on, self.stall_s = stall_on, stall_s
        self.calls_at: list[float] = []

    def generate(self, requests, params):
        self.calls_at.append(time.monotonic())
        if self.generate_calls + 1 == self.stall_on:
            time.sleep(self.stall_s)
        return super().generate(requests, params)


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_stalled_server_mid_training_loses_no_sample(serve, tmp_path):
    from trainer.data.synthetic import generate
    from trainer.modeling.fixtures import save_tiny_model
    from trainer.server.app import create_app

    model_dir = save_tiny_model(tmp_path / "vl", "vl", seed=0)  # the servers' tokenizer = the learner's
    generate(tmp_path / "data", 12, seed=0, min_objects=1, max_objects=2)
    engines = [StallsOnce(model_dir, stall_on=0, stall_s=0), StallsOnce(model_dir, stall_on=2, stall_s=3.0),
               ScriptedEngine(model_dir)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve(create_app(e))) for e in engines]
        cfg = validate_config({
            "model": {"tiny": "vl", "tiny_seed": 0},
            "data": {"train_jsonl": str(tmp_path / "data" / "train.jsonl")},
            "training": {"output_dir": str(tmp_path / "run"), "max_steps": 4, "per_device_train_batch_size": 3,
                         "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                         "report_to": ["jsonl"]},
            "custom": {"extra": {"rollout_matching": {
                "rollout_backend": "vllm", "rollout_generate_batch_size": 3, "decoding": {"max_new_tokens": 24},
                "vllm": {"mode": "server",
                         "server": {"servers": [{"base_url": u} for u in urls], "timeout_s": 30,
                                    "infer_timeout_s": 1.0, "max_retries": 1, "readmit_after_s": 0.01},
                         "sync": {"mode": "full", "transport": "inband"}}}}},
        })
        t0 = time.monotonic()
        collect = Collect()
        client_log = logging.getLogger("trainer.rollout")  # the client and its fleet (membership)
        client_log.addHandler(collect)
        level = client_log.level
        client_log.setLevel(logging.INFO)
        try:
            summary = run_training(cfg)
        finally:
            client_log.removeHandler(collect)
            client_log.setLevel(level)
    assert summary.stage2_steps == 4
    rows = [json.loads(line) for line in (Path(summary.output_dir) / "stage2" / "ledger.jsonl").read_text().splitlines()]
    counts = Counter(r["sample_id"] for r in rows)
    assert len(counts) == 12 and set(counts.values()) == {1}, f"every sample trained exactly once: {counts}"
    assert sorted({r["step"] for r in rows}) == [0, 1, 2, 3]

    stalled = engines[1]
    text = "\n".join(collect.messages) + f"\ncalls at {[round(t - t0, 2) for t in stalled.calls_at]}, others {[round(t - t0, 2) for t in engines[0].calls_at]}"
    assert stalled.generate_calls >= 3, f"the stalled server was not re-admitted and used again; client log:\n{text}"
    assert f"quarantining rollout server {urls[1]}" in text and "timed out" in text and "infer_timeout_s=1.0" in text
    assert f"rollout server {urls[1]} re-admitted after a full weight re-sync" in text
    # what each server holds (every tensor received so far, whole and changing-only pushes merged), not the last push:
    # a re-admitted server's push is whole while the others' carry only the changing weights
    held = stalled.weights_checksums()
    assert held == engines[0].weights_checksums(), "the re-admitted server holds the learner's current weights"
    assert set(held) == set(stalled.spec), "every weight of the checkpoint was pushed"
