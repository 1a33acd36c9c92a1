"""The trainer's typed settings (``trainer.sft.settings``) carry every value the config sets for it, per stage."""

from __future__ import annotations

import pytest

from trainer.config.schema import validate_config
from trainer.losses.objective import LossWeights
from trainer.sft.settings import RolloutSettings, TrainerSettings, stage1_settings, stage2_settings

CONFIG = {
    "model": {"tiny": "text"},
    "data": {"synthetic": {"num_samples": 4}},
    "stage1": {"steps": 3, "batch_size": 5},
    "training": {"per_device_train_batch_size": 3, "profile_steps": [2, 4], "phase_timing": "sync"},
    "custom": {"trainer_variant": "rollout_matching_sft", "extra": {"rollout_matching": {
        "rollout_backend": "hf",
        "decoding": {"max_new_tokens": 77, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 11},
        "loss": {"text_ce_weight": 0.5, "coord_softce_weight": 2.0, "coord_w1_weight": 0.25, "coord_gate_weight": 3.0,
                 "coord_sigma": 1.5, "logit_chunk_rows": 64},
        "rollout_buffer": {"enabled": True, "m_steps": 2},
        "mismatch": {"warn_mean_abs_diff": 0.2}}}},
}


@pytest.fixture(scope="module")
def cfg():
    return validate_config(CONFIG)


def test_stage2_settings_carry_the_configured_values(cfg):
    s = stage2_settings(cfg, image_token_id=9, packed_attn="sdpa")
    assert s.target_source == "rollout"
    d = s.rollout.decoding
    assert (d.max_new_tokens, d.temperature, d.top_p, d.top_k, d.seed) == (77, 0.7, 0.9, 5, 11)
    assert s.rollout.buffer_m_steps == 2 and s.rollout.mismatch_warn == 0.2 and s.rollout.async_max_staleness is None
    assert s.loss.weights == LossWeights(0.5, 2.0, 0.25, 3.0, 1.5) and s.loss.logit_chunk_rows == 64
    assert (s.layout.micro_batch_rows, s.layout.image_token_id, s.layout.packed_attn_implementation) == (3, 9, "sdpa")
    assert s.runtime.profile_steps == (2, 4) and s.runtime.phase_timing == "sync" and s.runtime.offload is None
    assert s.runtime.memory.batch_key == "training.per_device_train_batch_size"


def test_stage1_settings_train_ground_truth_in_stage1_batches(cfg):
    s = stage1_settings(cfg, image_token_id=None, packed_attn=None)
    assert s.target_source == "ground_truth" and s.layout.micro_batch_rows == 5
    assert s.rollout.mismatch_warn is None and s.rollout.buffer_m_steps == 1
    assert s.runtime.profile_steps == () and s.runtime.memory.batch_key != "training.per_device_train_batch_size"


def test_a_disabled_mismatch_is_not_measured():
    off = validate_config({**CONFIG, "custom": {"trainer_variant": "rollout_matching_sft", "extra": {
        "rollout_matching": {"rollout_backend": "hf", "mismatch": {"enabled": False}}}}})
    assert stage2_settings(off, None, None).rollout.mismatch_warn is None


def test_settings_refuse_values_the_trainer_cannot_run():
    with pytest.raises(ValueError, match="target_source"):
        TrainerSettings(target_source="teacher")
    with pytest.raises(ValueError, match="buffer_m_steps"):
        RolloutSettings(buffer_m_steps=0)
