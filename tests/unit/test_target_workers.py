"""Stage-1 targets built by the data loader's workers: the same targets as in the step, through the accelerator's
move to the device untouched, and the same training."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate.utils import send_to_device

from tests.tiny_trainer import tiny_stage2_trainer
from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.modeling.fixtures import build_tiny_image_processor, build_tiny_model, tiny_tokenizer
from trainer.modeling.prompts import PromptEncoder
from trainer.sft.stage2 import Stage2Pipeline
from trainer.sft.target_workers import (
    AUTO_MAX_WORKERS,
    GroundTruthCollator,
    resolve_target_workers,
    split_prepared,
)


def vl_pipeline() -> Stage2Pipeline:
    return Stage2Pipeline(PromptEncoder(tiny_tokenizer(), build_tiny_image_processor()))


def test_the_collator_builds_the_steps_targets_in_order(tmp_path):
    samples = load_jsonl(generate(tmp_path, 5, seed=2, max_objects=4))
    pipe = vl_pipeline()
    prepared = GroundTruthCollator(pipe)(samples)
    direct = pipe.ground_truth_targets(samples)
    assert [p.sample.sample_id for p in prepared] == [s.sample_id for s in samples]
    for p, t in zip(prepared, direct, strict=True):
        assert (p.target.input_ids, p.target.labels, p.target.coord_targets) == (t.input_ids, t.labels, t.coord_targets)
        assert torch.equal(p.target.mm_inputs["pixel_values"], t.mm_inputs["pixel_values"])


def test_prepared_records_pass_the_accelerators_device_move_as_they_are(tmp_path):
    samples = load_jsonl(generate(tmp_path, 2, seed=0))
    prepared = GroundTruthCollator(vl_pipeline())(samples)
    moved = send_to_device(prepared, torch.device("cpu"))
    assert type(moved) is list and all(a is b for a, b in zip(moved, prepared, strict=True))
    assert "labels" not in moved  # HF's count of label tokens looks for a dict batch
    again, targets = split_prepared(moved)
    assert again == samples and targets == [p.target for p in prepared]
    assert split_prepared(samples) == (samples, None)
    with pytest.raises(TypeError, match="mixes"):
        split_prepared([prepared[0], samples[1]])


@pytest.mark.parametrize("setting, cuda, ranks, cpus, expected", [
    (3, False, 1, 2, 3),                       # a count runs as given
    ("auto", False, 1, 64, 0),                 # no GPU: the cores train
    ("auto", True, 1, 16, AUTO_MAX_WORKERS),   # one rank of 16 cores
    ("auto", True, 8, 16, 1),                  # 2 cores a rank: one for the rank, one worker
    ("auto", True, 8, 8, 0),                   # a core a rank: none to spare
])
def test_auto_spares_each_rank_a_core(setting, cuda, ranks, cpus, expected):
    assert resolve_target_workers(setting, cuda, ranks, cpus) == expected


def test_a_warm_up_with_loader_workers_trains_as_one_without(tmp_path):
    samples = load_jsonl(generate(tmp_path / "data", 8, seed=1, max_objects=3))

    def losses(workers: int) -> list[float]:
        model = build_tiny_model("text", seed=0)[0]
        extra = {"data_collator": GroundTruthCollator(Stage2Pipeline(PromptEncoder(tiny_tokenizer())))} if workers else {}
        trainer = tiny_stage2_trainer(tmp_path / f"w{workers}", model=model, samples=samples, max_steps=3,
                                      per_device=2, target_source="ground_truth",
                                      args={"dataloader_num_workers": workers, "learning_rate": 1e-3}, **extra)
        trainer.train()
        return [r["loss"] for r in trainer.state.log_history if "loss" in r]

    inline, in_workers = losses(0), losses(2)
    assert len(inline) == 3 and inline == in_workers
    assert inline[0] != inline[-1], "the steps trained"


def test_the_config_key_takes_a_count_or_auto():
    from trainer.config.schema import validate_config

    base = {"model": {"tiny": "vl"}, "data": {"synthetic": {}},
            "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}
    cfg = validate_config({**base, "stage1": {"target_workers": 2}})
    assert cfg.stage1.target_workers == 2
    assert validate_config(base).stage1.target_workers == "auto"
    with pytest.raises(Exception, match="target_workers"):
        validate_config({**base, "stage1": {"target_workers": -1}})
    assert json.loads(json.dumps(cfg.stage1.model_dump()))["target_workers"] == 2
