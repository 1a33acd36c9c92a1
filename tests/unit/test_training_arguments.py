"""``training_arguments(step_records=True)``: HF gets a step's records per rank as one micro-batch; stage 2 takes
``training.records_per_step``, the stage-1 warm-up keeps its own ``stage1.batch_size``."""

from __future__ import annotations

import pytest

from trainer.config.schema import validate_config
from trainer.sft.run import records_per_rank, training_arguments


def _cfg(tmp_path, **training):
    return validate_config({"model": {"tiny": "text"}, "data": {"synthetic": {"num_samples": 8}},
                            "training": {"output_dir": str(tmp_path), "report_to": ["jsonl"], **training},
                            "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}})


def test_stage2_takes_records_per_step_and_stage1_its_own_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = _cfg(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, records_per_step=64)
    common = dict(max_steps=1, learning_rate=1e-4, report_to=[], step_records=True)
    stage2 = training_arguments(cfg, tmp_path / "s2", batch_size=4, records_per_step=64, **common)
    stage1 = training_arguments(cfg, tmp_path / "s1", batch_size=16, **common)
    assert (stage2.per_device_train_batch_size, stage2.gradient_accumulation_steps) == (64, 1)
    assert (stage1.per_device_train_batch_size, stage1.gradient_accumulation_steps) == (48, 1), \
        "the warm-up's 16 x GA 3, not stage 2's records_per_step"


def test_records_per_rank():
    assert records_per_rank(None, 4, 3, 2) == 12
    assert records_per_rank(64, 4, 3, 4) == 16
    with pytest.raises(ValueError, match="records_per_step=10 is not a multiple"):
        records_per_rank(10, 1, 1, 4)
