"""``zero_optimization.stage`` of a DeepSpeed JSON file: an integral float is the stage it names (so ``3.0`` meets the
ZeRO-3 + vLLM refusal), anything else that is not a stage is refused with one line naming the key."""

from __future__ import annotations

import json

import pytest

from trainer.config.deepspeed import zero_stage
from trainer.config.errors import ConfigErrors
from trainer.config.schema import validate_config

VLLM = {"model": {"tiny": "text"}, "data": {"synthetic": {}},
        "custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": {"max_model_len": 512}}}}}
HF = {**VLLM, "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}


def _ds(tmp_path, stage) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}, "train_batch_size": "auto"}))
    return str(path)


def _errors(cfg) -> list[tuple[str, str]]:
    with pytest.raises(ConfigErrors) as exc:
        validate_config(cfg)
    return [(e.key_path, e.message) for e in exc.value.errors]


def test_a_float_stage_is_the_stage_it_names(tmp_path):
    three = _ds(tmp_path, 3.0)
    assert zero_stage(three) == 3 and type(zero_stage(three)) is int
    [(key, message)] = _errors({**VLLM, "training": {"deepspeed": three}})
    assert key == "training.deepspeed" and "ZeRO-3" in message
    validate_config({**HF, "training": {"deepspeed": three}})
    assert validate_config({**VLLM, "training": {"deepspeed": _ds(tmp_path, 2.0)}}).training.deepspeed
    assert zero_stage(_ds(tmp_path, 0)) == 0


@pytest.mark.parametrize("stage", [2.5, "3", "auto", True, 4, -1, [3]])
def test_a_stage_that_is_no_zero_stage_is_refused_naming_the_key(tmp_path, stage):
    path = _ds(tmp_path, stage)
    for cfg in (VLLM, HF):
        [(key, message)] = _errors({**cfg, "training": {"deepspeed": path}})
        assert key == "training.deepspeed"
        assert "zero_optimization.stage" in message and json.dumps(stage) in message and "\n" not in message
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        zero_stage(path)


def test_a_file_without_a_stage_or_that_is_no_json_object(tmp_path):
    none = tmp_path / "none.json"
    none.write_text('{"train_batch_size": "auto"}')
    assert zero_stage(str(none)) is None
    validate_config({**VLLM, "training": {"deepspeed": str(none)}})
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": {"stage": 3')
    [(key, message)] = _errors({**VLLM, "training": {"deepspeed": str(broken)}})
    assert key == "training.deepspeed" and "not a readable DeepSpeed JSON file" in message
