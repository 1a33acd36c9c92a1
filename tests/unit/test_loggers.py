"""``training.report_to``'s W&B / MLflow loggers without their libraries' runs: the mirror of ``metrics.jsonl``
(``telemetry.mirror_rows``), which values of a row are metrics, MLflow's names, and the one-line error of a missing
library (tests/integration/test_report_to.py runs both libraries for real)."""

from __future__ import annotations

import sys

import pytest
import torch

from trainer.extras import MissingExtraError
from trainer.loggers import mlflow_name, open_loggers, require_loggers, settings_of
from trainer.telemetry import JsonlWriter, metric_values, mirror_rows, read_jsonl


class Collect:
    def __init__(self):
        self.rows = []

    def log_row(self, row):
        self.rows.append(row)


def test_every_row_a_writer_appends_to_the_file_reaches_its_loggers_while_mirrored(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run" / "metrics.jsonl"
    early = JsonlWriter("run/metrics.jsonl")  # made before the mirror, by a relative path: the same file
    other = JsonlWriter(tmp_path / "other.jsonl")
    logger = Collect()
    early.write({"phase": "setup", "step": 0, "a": 1})
    with mirror_rows(path, [logger]):
        early.write({"phase": "stage2", "step": 1, "loss": 2.0})
        JsonlWriter(path).write({"phase": "eval", "step": 1, "eval/f1@50": 0.5})
        other.write({"phase": "stage2", "step": 1, "loss": 9.0})
    early.write({"phase": "stage2", "step": 2, "loss": 3.0})
    assert logger.rows == read_jsonl(path)[1:3], "the rows written inside the block, as the file has them"


def test_a_rows_metrics_are_its_numbers_and_the_rest_its_settings():
    row = {"phase": "setup", "step": 0, "time": 1.5, "loss": 2, "t": torch.tensor(0.25), "ok": True,
           "train/packed_attention": "sdpa", "gib": [1.0, 2.0], "none": None}
    assert metric_values(row) == {"loss": 2.0, "t": 0.25}
    assert settings_of(row) == {"ok": True, "train/packed_attention": "sdpa", "gib": [1.0, 2.0]}


def test_mlflow_names_keep_what_mlflow_allows_and_fold_the_rest_to_underscores():
    for name in ("loss/ce", "time/weight_sync_s", "speed/steps_per_s", "batch/fill", "train_runtime"):
        assert mlflow_name(name) == name
    assert mlflow_name("eval/f1@50") == "eval/f1_50" and mlflow_name("eval/class_f1@50") == "eval/class_f1_50"


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_library_is_one_line_naming_the_key_and_the_install_command(name, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(MissingExtraError) as info:
        require_loggers(["jsonl", name])
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"training.report_to: {name} needs the optional extra '{name}'")
    assert text.endswith(f"Install it with: pip install -e '.[{name}]'")
    with pytest.raises(MissingExtraError):
        open_loggers(["jsonl", name], "/nonexistent/run")
    assert require_loggers(["jsonl", "tensorboard"]) == {}


def test_training_with_a_missing_logger_library_stops_before_it_starts(tmp_path, monkeypatch):
    from trainer.config.schema import validate_config
    from trainer.sft.run import run_training

    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = validate_config({
        "model": {"tiny": "text"}, "data": {"synthetic": {"num_samples": 2}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "report_to": ["jsonl", "wandb"]},
        "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}})
    with pytest.raises(MissingExtraError, match=r"pip install -e '\.\[wandb\]'"):
        run_training(cfg)
    assert not (tmp_path / "run").exists(), "nothing was written: the check comes first"
