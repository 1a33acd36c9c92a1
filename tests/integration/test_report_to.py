"""``training.report_to: [wandb, mlflow]`` with the real libraries: W&B offline (its run file read back record by
record), MLflow on a local store (SQLite in the test's directory, read back with ``MlflowClient``; MLflow 3's file store
cannot hold ``loss`` beside ``loss/ce``). One short run (tiny text model, rollouts from an
in-process scripted rollout server with in-band weight syncs: a stage-1 step, two stage-2 steps, an eval before,
between and after) logs to both; every row of
``metrics.jsonl`` (setup, stage1, stage2, eval) reached each logger with the same metric names (MLflow's only with
the characters it refuses turned into ``_``), the same values and the same step."""

from __future__ import annotations

import glob
import json
import math
import struct
from pathlib import Path

import pytest

pytest.importorskip("wandb", reason="wandb is not installed (the wandb extra; make setup installs it)")
pytest.importorskip("mlflow", reason="mlflow is not installed (the mlflow extra; make setup installs it)")

from tests.server.conftest import serve_app  # noqa: E402
from trainer.config.schema import validate_config  # noqa: E402
from trainer.loggers import mlflow_name, settings_of  # noqa: E402
from trainer.modeling.fixtures import save_tiny_model  # noqa: E402
from trainer.server.app import create_app  # noqa: E402
from trainer.server.scripted import ScriptedEngine  # noqa: E402
from trainer.sft.run import run_training  # noqa: E402
from trainer.telemetry import metric_values, read_jsonl  # noqa: E402

BLOCK, HEADER = 32768, 7  # W&B's run file: ":W&B", magic, version, then LevelDB-log records in 32 KiB blocks


def wandb_records(path: Path):
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, parts = HEADER, []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST (FIRST and MIDDLE continue in the next block)
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=0.0)


def run_config(tmp_path: Path, url: str) -> dict:
    return {
        "model": {"tiny": "text", "tiny_seed": 0},
        "data": {"synthetic": {"num_samples": 8, "seed": 3, "min_objects": 1, "max_objects": 2, "image_size": 64,
                               "eval_num_samples": 2}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "per_device_train_batch_size": 4,
                     "eval_steps": 1, "learning_rate": 2e-3, "seed": 0, "disable_tqdm": True, "logging_steps": 1,
                     "report_to": ["jsonl", "wandb", "mlflow"], "packing": True, "packing_length": 512},
        "stage1": {"steps": 1, "batch_size": 2, "logging_steps": 1},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "vllm", "rollout_generate_batch_size": 4, "decoding": {"max_new_tokens": 24},
            "matching": {"mask_resolution": 64},
            "vllm": {"mode": "server", "server": {"servers": [{"base_url": url}], "timeout_s": 60},
                     "sync": {"mode": "full", "transport": "inband"}}}}},
    }


def test_every_metrics_row_reaches_wandb_and_mlflow_under_its_names(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "report-to-test")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "report-to-test")
    server_model = save_tiny_model(tmp_path / "server-model", "text", seed=0)  # the learner's tokenizer
    with serve_app(create_app(ScriptedEngine(server_model))) as url:
        summary = run_training(validate_config(run_config(tmp_path, url)))
    rows = read_jsonl(summary.metrics_path)
    assert {r["phase"] for r in rows} == {"setup", "stage1", "stage2", "eval"}
    expected = [(int(r["step"]), metric_values(r)) for r in rows if metric_values(r)]
    names = {n for _, m in expected for n in m}
    # every family the trainer logs is in the file, hence checked below: losses, rollouts, phases, eval, speed
    for name in ("loss", "loss/ce", "rollout/samples", "time/rollout_s", "time/weight_sync_s", "eval/f1@50",
                 "speed/steps_per_s", "train_runtime"):
        assert name in names, name

    # W&B: each history record is one row: its metrics, named as in the file, at the row's step
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    logged, config = [], {}
    for record in wandb_records(Path(run_file)):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = items.pop("step")
            logged.append((int(step), {k: float(v) for k, v in items.items() if not k.startswith("_")}))
        elif kind == "config":
            config.update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.config.update})
    assert len(logged) == len(expected), "one W&B history row per metrics.jsonl row"
    for (step, got), (want_step, want) in zip(logged, expected):
        assert step == want_step and set(got) == set(want), (step, sorted(set(got) ^ set(want)))
        assert all(same(got[k], want[k]) for k in want), (step, {k: (got[k], want[k]) for k in want})
    setup = next(r for r in rows if r["phase"] == "setup")
    assert settings_of(setup), "the setup row names its choices (packed attention, checkpointing)"
    assert {k: config.get(k) for k in settings_of(setup)} == settings_of(setup), "the setup row's choices: config"
    assert not any(k in config for r in rows for k in metric_values(r)), "metrics are not config"

    # MLflow: one run; every metric's history is the file's (step, value) pairs, names through mlflow_name
    assert len({mlflow_name(n) for n in names}) == len(names), "no two names fold into one"
    assert mlflow_name("eval/f1@50") == "eval/f1_50" and mlflow_name("time/weight_sync_s") == "time/weight_sync_s"
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("report-to-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert set(run.data.metrics) == {mlflow_name(n) for n in names}
    for name in names:
        history = sorted((m.step, repr(m.value)) for m in client.get_metric_history(run.info.run_id, mlflow_name(name)))
        assert history == sorted((step, repr(m[name])) for step, m in expected if name in m), name
    params = run.data.params
    assert {k: params.get(mlflow_name(k)) for k in settings_of(setup)} == \
        {k: str(v) for k, v in settings_of(setup).items()}, "the setup row's choices: the run's parameters"
