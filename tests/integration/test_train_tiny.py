"""Real training runs on the tiny models (HF rollout backend): the loss decreases, metrics are logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trainer.config.schema import validate_config
from trainer.sft.run import run_training
from trainer.telemetry import read_jsonl


def config(tmp_path: Path, kind: str, **training) -> dict:
    return {
        "model": {"tiny": kind},
        "data": {"synthetic": {"num_samples": 8, "seed": 3, "min_objects": 1, "max_objects": 2, "image_size": 64}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 14, "per_device_train_batch_size": 8,
                     "learning_rate": 2e-3, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                     "report_to": ["jsonl", "tensorboard"], **training},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "hf", "rollout_generate_batch_size": 4,
            "decoding": {"max_new_tokens": 24}, "matching": {"mask_resolution": 64}}}},
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "vl"])
def test_stage2_loss_decreases_on_tiny_models(tmp_path, kind):
    cfg = validate_config(config(tmp_path, kind))
    summary = run_training(cfg)
    rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
    assert len(rows) == 14
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    for r in rows:
        assert r["rollout/samples"] == 8 and r["rollout/gt"] > 0
        assert r["rollout/matched"] + r["rollout/fn_appended"] == r["rollout/gt"]
        assert r["time/generate_s"] > 0 and r["time/forward_s"] > 0 and r["time/parse_s"] >= 0
    assert list((Path(summary.output_dir) / "stage2").rglob("events.out.tfevents.*")), "TensorBoard events written"
    assert (Path(summary.final_model_dir) / "config.json").is_file()
    resolved = json.loads((Path(summary.output_dir) / "resolved_config.json").read_text())
    assert resolved["model"]["tiny"] == kind


@pytest.mark.slow
def test_lora_and_dora_adapters_train(tmp_path):
    for train_type in ("lora", "dora"):
        data = config(tmp_path / train_type, "text", max_steps=4)
        data["tuner"] = {"train_type": train_type, "lora_rank": 4, "lora_alpha": 8}
        summary = run_training(validate_config(data))
        rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
        assert len(rows) == 4 and all(r["grad_norm"] > 0 for r in rows)
        adapter = yaml.safe_load((Path(summary.final_model_dir) / "adapter_config.json").read_text())
        assert adapter["use_dora"] is (train_type == "dora")


@pytest.mark.slow
def test_stage2_with_post_rollout_packing(tmp_path):
    data = config(tmp_path, "text", max_steps=6, packing=True, packing_length=1024, packing_buffer=64)
    summary = run_training(validate_config(data))
    rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
    assert len(rows) == 6
    assert all(r["packing/segments_per_row"] >= 1 and 0 < r["batch/fill"] <= 1 for r in rows)


@pytest.mark.slow
def test_rollout_buffer_reuses_rollouts_and_trains_every_sample(tmp_path):
    data = config(tmp_path, "text", max_steps=-1, num_train_epochs=1, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2)
    data["custom"]["extra"]["rollout_matching"]["rollout_buffer"] = {"enabled": True, "m_steps": 3}
    cfg = validate_config(data)
    summary = run_training(cfg)
    rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
    assert len(rows) == 6, "8 samples / (2 x 2) = 2 windows, each trained for 3 optimizer steps"
    assert sum(r.get("rollout/samples", 0) for r in rows) == 8, "every sample rolled out exactly once"
    assert sum(r.get("buffer/replayed_steps", 0) for r in rows) == 4, "2 windows x (3 - 1) M-steps, each replays its whole step"
    assert max(r.get("buffer/max_staleness_steps", 0) for r in rows) == 2


@pytest.mark.slow
def test_compiled_decoder_layers_train_with_packing_and_eager_rollouts(tmp_path, monkeypatch):
    """training.compile_decoder_layers: the layers are compiled for the teacher-forced step, HF rollouts run eager
    (no recompiles for generation shapes), and the run trains with packing."""
    import torch

    from trainer.modeling import compile as compile_mod

    stances = []
    real_eager = compile_mod.eager_rollouts

    def spy(enabled):
        stances.append(enabled)
        return real_eager(enabled)

    monkeypatch.setattr("trainer.sft.trainer.eager_rollouts", spy)
    from torch._dynamo.utils import counters

    counters.clear()
    data = config(tmp_path, "text", max_steps=3, compile_decoder_layers=True, packing=True, packing_length=2048)
    summary = run_training(validate_config(data))
    assert counters["stats"]["unique_graphs"] > 0, "the teacher-forced step ran compiled layers"
    rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
    assert len(rows) == 3 and all(r["grad_norm"] > 0 and r["loss"] == r["loss"] for r in rows)
    assert stances == [True, True, True], "every rollout ran under the eager stance"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(summary.final_model_dir)
    assert sum(p.numel() for p in model.parameters()) > 0
    ids = torch.randint(0, 200, (1, 40))
    with torch.no_grad():
        eager = model(input_ids=ids).logits
    layers = compile_mod.decoder_layers(model)
    assert compile_mod.compile_decoder_layers(model) == len(layers)
    assert all(layer._compiled_call_impl is not None for layer in layers)
    with torch.no_grad():
        with torch.compiler.set_stance("force_eager"):
            forced = model(input_ids=ids).logits
        compiled = model(input_ids=ids).logits
    assert torch.allclose(compiled, eager, rtol=1e-4, atol=1e-4) and torch.equal(forced, eager)


@pytest.mark.slow
def test_logit_chunk_rows_reaches_the_stage2_loss(tmp_path, monkeypatch):
    import trainer.sft.forward as forward_module
    from trainer.losses.chunked_objective import chunked_objective

    chunks: list[int] = []

    def spy(*args, **kwargs):
        chunks.append(args[5])
        return chunked_objective(*args, **kwargs)

    monkeypatch.setattr(forward_module, "chunked_objective", spy)
    data = config(tmp_path, "text", max_steps=2)
    data["custom"]["extra"]["rollout_matching"]["loss"] = {"logit_chunk_rows": 3}
    summary = run_training(validate_config(data))
    rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
    assert len(rows) == 2 and all(r["grad_norm"] > 0 for r in rows)
    assert len(chunks) >= 2 and set(chunks) == {3}, chunks


@pytest.mark.parametrize("after_first_step", [True, False])
def test_the_heap_is_frozen_before_training_and_after_the_first_step(tmp_path, monkeypatch, after_first_step):
    """``training.freeze_heap_after_first_step`` reaches the run: the setup freeze, then (on) one more when the first
    optimizer step ends."""
    import gc

    from trainer.sft import heap
    from trainer.sft import run as run_module

    calls = []

    def spy(where):
        return lambda: calls.append(where) or gc.get_freeze_count()

    monkeypatch.setattr(run_module, "freeze_setup_objects", spy("setup"))
    monkeypatch.setattr(heap, "freeze_setup_objects", spy("first step"))
    data = config(tmp_path, "text", max_steps=2, per_device_train_batch_size=4,
                  freeze_heap_after_first_step=after_first_step)
    data["data"]["synthetic"]["num_samples"] = 4
    data["custom"]["extra"]["rollout_matching"]["decoding"]["max_new_tokens"] = 8
    run_training(validate_config(data))
    assert calls == (["setup", "first step"] if after_first_step else ["setup"])
