"""Out of GPU memory in a step: the phase it ran out in, the step, the peaks so far and the settings that lower that
phase's memory, with their keys and current values (``trainer.memory.oom``). The advice is pure and checked here per
phase; ``tests/integration/test_train_oom.py`` raises a real ``torch.OutOfMemoryError`` inside a training run."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trainer.config.schema import load_config
from trainer.memory.oom import MemorySettings, TrainingOutOfMemory, advice, explain, memory_settings
from trainer.telemetry import PhaseTimers

REPO = Path(__file__).resolve().parents[2]
RM = "custom.extra.rollout_matching"
EIGHT_B_LORA = MemorySettings(tuner="lora", packing=True, packing_length=16384, checkpointing="full",
                              gpu_memory_utilization=0.35, sleep_level=2, rollout_generate_batch_size=8,
                              max_new_tokens=2048)


def test_training_phases_name_the_forward_s_knobs_with_their_values():
    lines = advice("forward", EIGHT_B_LORA)
    assert lines[0].startswith("training.packing_length (now 16384)")
    assert not any("gradient_checkpointing" in x or "sleep_level" in x or "train_type" in x for x in lines), lines
    loose = replace(EIGHT_B_LORA, tuner="full", packing=False, batch_size=4, checkpointing="off",
                    supervised_logits_only=False, sleep_level=0)
    lines = advice(None, loose)  # outside any named phase: the backward and the optimizer step
    assert lines[0].startswith("training.per_device_train_batch_size (now 4)")
    joined = "\n".join(lines)
    for want in ("training.gradient_checkpointing_policy: full (now off)", f"{RM}.loss.supervised_logits_only: true",
                 f"{RM}.vllm.sleep_level: 2 (now 0)", "gpu_memory_utilization=0.35",
                 "tuner.train_type: lora (now full)"):
        assert want in joined, (want, lines)
    assert advice("backward", loose) == lines
    assert "zero2_offload" not in "\n".join(advice("forward", replace(loose, deepspeed="zero2_offload")))


def test_training_phases_point_at_logit_chunks_when_the_loss_holds_every_row():
    assert not any("logit_chunk_rows" in x for x in advice("forward", EIGHT_B_LORA)), "the default chunks already"
    for chunk in (None, 8192):
        lines = advice("forward", replace(EIGHT_B_LORA, logit_chunk_rows=chunk))
        assert any(x.startswith(f"{RM}.loss.logit_chunk_rows: 1024 (now {chunk})") for x in lines), lines
    full = advice("forward", replace(EIGHT_B_LORA, logit_chunk_rows=None, supervised_logits_only=False))
    assert not any("logit_chunk_rows" in x for x in full), "supervised_logits_only comes first"


def test_sync_phases_point_a_merged_lora_sync_at_the_adapter_sync():
    lines = advice("sync_collect", EIGHT_B_LORA)
    assert f"{RM}.vllm.sync.mode: adapter with {RM}.vllm.enable_lora: true (now sync.mode full)" in lines[0]
    assert advice("weight_sync", EIGHT_B_LORA) == lines
    adapter = advice("sync_load", replace(EIGHT_B_LORA, sync_mode="adapter", enable_lora=True))
    assert not any("sync.mode: adapter" in x for x in adapter)
    assert "DoRA always syncs merged weights" in advice("sync_collect", replace(EIGHT_B_LORA, tuner="dora"))[0]
    server = advice("sync_push", replace(EIGHT_B_LORA, vllm_mode="server", bucket_mb=1024))
    assert any(f"{RM}.vllm.sync.bucket_mb (now 1024)" in x for x in server), server
    full = advice("sync_wake", replace(EIGHT_B_LORA, tuner="full"))
    assert any("zero2_offload" in x for x in full), full


def test_rollout_phases_name_the_engine_s_share_or_the_hf_batch():
    lines = advice("generate", EIGHT_B_LORA)
    assert lines[0].startswith(f"{RM}.vllm.gpu_memory_utilization (now 0.35)")
    assert any(f"{RM}.offload.enabled: true (now false)" in x for x in lines)
    assert not any(f"{RM}.offload.enabled" in x for x in advice("wake", replace(EIGHT_B_LORA, offload=True)))
    hf = advice("generate", replace(EIGHT_B_LORA, rollout_backend="hf"))
    assert hf == [f"{RM}.rollout_generate_batch_size (now 8) or {RM}.decoding.max_new_tokens (now 2048): HF generate "
                  "keeps a KV cache for every sequence of a batch"]


def test_a_phase_nothing_sizes_still_gets_advice():
    lines = advice("parse", EIGHT_B_LORA)
    assert len(lines) == 1 and "training.packing_length (now 16384)" in lines[0]
    assert all(advice(p, MemorySettings()) for p in ("encode", "target", "sleep", "sync_identity", None))


def test_explain_is_an_out_of_memory_error_naming_phase_step_peaks_and_device():
    torch_msg = "CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 79.19 GiB\nmore"
    err = explain(torch.OutOfMemoryError(torch_msg), "forward", 7, EIGHT_B_LORA,
                  {"rollout": 46.5, "weight_sync": 58.7, "forward": 78.9, "encode": 44.0}, 79.19)
    assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, TrainingOutOfMemory)
    assert (err.phase, err.step) == ("forward", 7) and err.advice == advice("forward", EIGHT_B_LORA)
    text = str(err)
    assert text.startswith("training step 7 ran out of GPU memory in forward: CUDA out of memory. Tried to allocate "
                           "2.32 GiB.") and "\nmore" not in text
    assert "GPU: 79.2 GiB in all; peak allocated by phase so far: forward 78.9, weight_sync 58.7, rollout 46.5, " \
           "encode 44.0 GiB" in text
    assert "  - training.packing_length (now 16384)" in text
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == text and back.phase == "forward" and back.advice == err.advice
    stopped = err.with_checkpoint("/run/stage2/checkpoint-6")
    assert str(stopped).endswith("resume from /run/stage2/checkpoint-6 with the change (--resume-from-checkpoint "
                                 "latest).") and stopped.phase == "forward"
    assert "no checkpoint was written" in str(err.with_checkpoint(None))
    unknown = explain(torch.OutOfMemoryError(""), None, 1, EIGHT_B_LORA, {}, None)
    assert "in backward: OutOfMemoryError" in str(unknown) and "size unknown" in str(unknown)
    assert "none recorded" in str(unknown)


def test_timers_remember_the_innermost_phase_an_out_of_memory_error_left():
    timers = PhaseTimers(memory=None)
    with pytest.raises(torch.OutOfMemoryError):
        with timers.phase("weight_sync"), timers.phase("sync_collect"):
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert timers.out_of_memory_in == "sync_collect"
    timers.out_of_memory_in = None
    with pytest.raises(ValueError):
        with timers.phase("forward"):
            raise ValueError("not a memory error")
    assert timers.out_of_memory_in is None


def test_settings_are_read_from_the_config():
    cfg = load_config(REPO / "configs" / "demo.yaml")
    s = memory_settings(cfg)
    rm = cfg.custom.extra.rollout_matching
    assert (s.tuner, s.packing, s.packing_length, s.batch_size) == (
        cfg.tuner.train_type, cfg.training.packing, cfg.training.packing_length,
        cfg.training.per_device_train_batch_size)
    assert (s.rollout_backend, s.vllm_mode, s.gpu_memory_utilization, s.sleep_level, s.max_new_tokens) == (
        rm.rollout_backend, rm.vllm.mode, rm.vllm.gpu_memory_utilization, rm.vllm.sleep_level,
        rm.decoding.max_new_tokens)
    warm = memory_settings(cfg, stage1=True)
    assert (warm.packing, warm.batch_size, warm.batch_key) == (
        cfg.training.packing, cfg.stage1.batch_size, "stage1.batch_size"), "the warm-up packs as stage 2 does"


def test_a_wake_that_runs_out_points_at_the_learner_s_checkpointing_first():
    """2026-11-26 on the H100: 2B full with checkpointing off or selective every 4th layer trained, then the sleeping
    engine could not map its KV cache back; full and every 2nd layer ran."""
    every4 = replace(EIGHT_B_LORA, tuner="full", checkpointing="selective/4", gpu_memory_utilization=0.3)
    for phase in ("wake", "sync_wake"):
        lines = advice(phase, every4)
        assert lines[0].startswith("training.gradient_checkpointing_policy: full (now selective/4): the sleeping "
                                   "engine maps its pool (gpu_memory_utilization=0.3) back"), lines
        assert lines[1].startswith("training.packing_length (now 16384)"), lines
    assert advice("wake", every4)[2:] == advice("generate", every4), "then the engine's own knobs"
    assert not any("gradient_checkpointing_policy" in x for x in advice("wake", EIGHT_B_LORA)), "full already"
    assert not any("gradient_checkpointing_policy" in x
                   for x in advice("wake", replace(every4, sleep_level=0))), "an engine that never sleeps"
    assert "(now selective/4)" in advice("forward", every4)[1]


def test_the_checkpointing_label_is_the_policy_that_runs():
    from trainer.config.schema import validate_config

    cfg = load_config(REPO / "configs" / "demo.yaml")
    for update, label in (({"gradient_checkpointing_policy": "selective",
                            "gradient_checkpointing_every_n_layers": 3}, "selective/3"),
                          ({"gradient_checkpointing_policy": "selective"}, "selective/2"),
                          ({"gradient_checkpointing_policy": "off"}, "off"),
                          ({"gradient_checkpointing_policy": None, "gradient_checkpointing": True}, "full")):
        data = cfg.model_dump()
        data["training"].update(update)
        assert memory_settings(validate_config(data)).checkpointing == label, update
    assert MemorySettings().checkpointing == "off"
