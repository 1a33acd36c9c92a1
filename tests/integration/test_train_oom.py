"""A real training run (tiny model, HF rollouts) that runs out of GPU memory: the ``torch.OutOfMemoryError`` that
torch raises inside a phase is what the run injects (there is no GPU here to exhaust), and the run stops with a
``TrainingOutOfMemory`` naming the phase, the step, the settings to change with their values, and the checkpoint to
resume from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config.schema import validate_config
from trainer.memory.oom import TrainingOutOfMemory
from trainer.sft import trainer as trainer_module
from trainer.sft.run import run_training

RM = "custom.extra.rollout_matching"
TORCH_MESSAGE = "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


def config(tmp_path: Path) -> dict:
    return {
        "model": {"tiny": "text"},
        "data": {"synthetic": {"num_samples": 8, "seed": 3, "min_objects": 1, "max_objects": 2, "image_size": 64}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 4, "per_device_train_batch_size": 2,
                     "learning_rate": 2e-3, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                     "report_to": ["jsonl"], "save_steps": 1, "packing": True, "packing_length": 512},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "hf", "rollout_generate_batch_size": 2,
            "decoding": {"max_new_tokens": 16}, "matching": {"mask_resolution": 64}}}},
    }


def test_out_of_memory_in_the_forward_names_the_packing_length_and_the_checkpoint(tmp_path, monkeypatch):
    calls = []
    real = trainer_module.forward_loss

    def forward_that_runs_out(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second optimizer step's forward
            raise torch.OutOfMemoryError(TORCH_MESSAGE)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "forward_loss", forward_that_runs_out)
    with pytest.raises(TrainingOutOfMemory) as info:
        run_training(validate_config(config(tmp_path)))
    err = info.value
    assert (err.phase, err.step) == ("forward", 2)
    text = str(err)
    assert text.startswith(f"training step 2 ran out of GPU memory in forward: {TORCH_MESSAGE}")
    assert "training.packing_length (now 512)" in text and "training.gradient_checkpointing_policy: full (now off)" in text
    assert text.endswith(f"resume from {tmp_path / 'run' / 'stage2' / 'checkpoint-1'} with the change "
                         "(--resume-from-checkpoint latest).")
    assert isinstance(err.__cause__, torch.OutOfMemoryError) and not isinstance(err.__cause__, TrainingOutOfMemory)


def test_out_of_memory_while_decoding_names_the_rollout_batch(tmp_path, monkeypatch):
    from trainer.rollout.hf import HFRolloutEngine

    def generate_that_runs_out(self, requests, params):
        raise torch.OutOfMemoryError(TORCH_MESSAGE)

    monkeypatch.setattr(HFRolloutEngine, "generate", generate_that_runs_out)
    with pytest.raises(TrainingOutOfMemory) as info:
        run_training(validate_config(config(tmp_path)))
    err = info.value
    assert (err.phase, err.step) == ("generate", 1)
    assert err.advice == [f"{RM}.rollout_generate_batch_size (now 2) or {RM}.decoding.max_new_tokens (now 16): HF "
                          "generate keeps a KV cache for every sequence of a batch"]
    assert "no checkpoint was written before this step" in str(err)


def test_out_of_memory_in_the_optimizer_step_names_the_optimizer_state_settings(tmp_path, monkeypatch):
    """AdamW's first ``step`` allocates its states: an OOM there gets the phase, step, advice and checkpoint too
    (before, it escaped ``training_step`` as a bare torch error)."""
    calls = []
    real = torch.optim.AdamW.step

    def step_that_runs_out(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError(TORCH_MESSAGE)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_that_runs_out)
    with pytest.raises(TrainingOutOfMemory) as info:
        run_training(validate_config(config(tmp_path)))
    err = info.value
    assert (err.phase, err.step) == ("optimizer", 2)
    assert err.advice[0].startswith("training.deepspeed: zero2 (now none)")
    assert any(a.startswith("tuner.train_type: lora (now full)") for a in err.advice)
    assert str(err).endswith(f"resume from {tmp_path / 'run' / 'stage2' / 'checkpoint-1'} with the change "
                             "(--resume-from-checkpoint latest).")


def test_optimizer_phase_and_step_wall_are_logged(tmp_path):
    from trainer.telemetry import read_jsonl

    summary = run_training(validate_config(config(tmp_path)))
    rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
    assert len(rows) == 4
    for r in rows:
        assert r["time/optimizer_s"] > 0, "clip + optimizer.step + zero_grad, outside time/step_s"
        assert r["time/step_wall_s"] >= r["time/step_s"] + r["time/optimizer_s"] - 1e-6


def test_a_step_end_callback_counts_in_step_wall_not_in_the_optimizer_phase(tmp_path):
    """Periodic evaluation runs in ``on_step_end``: its time belongs to the step-to-step wall, never to the
    optimizer phase (the step clock's ``on_step_end`` runs before every other callback's).

    The slow callback does not sleep: the step clock reads a virtual clock (``StepClock.clock`` is injectable) that
    only the callback advances, by ``SLOW_S`` each step. Real time never reaches that clock, so the figures are exact
    on any machine: the callback's seconds are all of every later step's wall and none of any step's optimizer
    phase. Were the clock's tick after the callback, each ``time/optimizer_s`` would be ``SLOW_S``."""
    from transformers import TrainerCallback

    from trainer.sft.trainer import RolloutMatchingTrainer
    from trainer.telemetry import read_jsonl

    SLOW_S = 1000.0
    virtual = {"now": 0.0}

    class SlowStepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            virtual["now"] += SLOW_S

    real_init = RolloutMatchingTrainer.__init__

    def init(self, *args, **kwargs):  # passed as run_training passes the periodic evaluation: callbacks=[...]
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), SlowStepEnd()]
        real_init(self, *args, **kwargs)
        self.step_clock.clock = lambda: virtual["now"]

    mp = pytest.MonkeyPatch()
    mp.setattr(RolloutMatchingTrainer, "__init__", init)
    try:
        summary = run_training(validate_config(config(tmp_path)))
    finally:
        mp.undo()
    rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
    assert len(rows) == 4
    assert [r["time/optimizer_s"] for r in rows] == [0.0] * 4, "the callback's time is in no optimizer phase"
    # the first step's wall starts at train begin, before any callback ran; each later one holds the previous
    # step's callback, once
    assert [r["time/step_wall_s"] for r in rows] == [0.0] + [SLOW_S] * 3
