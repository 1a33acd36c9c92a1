"""The stage-2 trainer on CUDA with packing: varlen attention in every packed forward and in the activation-
checkpoint recompute, supervised-only logits, text and Qwen3-VL tiny models, every sample trained once.

Run on a GPU machine: ``python -m pytest -m gpu tests/gpu/test_trainer_packed_gpu.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.packing.varlen_attention import varlen_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not varlen_available(), reason="needs CUDA + torch varlen attention")]


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_packed_training_on_cuda_uses_varlen_through_backward(tmp_path, kind, monkeypatch):
    from trainer.config.schema import validate_config
    from trainer.sft.run import run_training
    from trainer.telemetry import read_jsonl

    calls = {"fwd": 0, "grad_enabled": 0}
    from trainer.packing import varlen_attention

    real = varlen_attention.varlen_attention

    def counting(*args, **kwargs):
        calls["fwd"] += 1
        calls["grad_enabled"] += int(torch.is_grad_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(varlen_attention, "varlen_attention", counting)
    steps = 4
    data = {
        "model": {"tiny": kind, "torch_dtype": "bfloat16"},
        "data": {"synthetic": {"num_samples": 8, "seed": 3, "min_objects": 1, "max_objects": 3, "image_size": 64}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": steps, "per_device_train_batch_size": 4,
                     "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                     "report_to": ["jsonl"], "bf16": True, "gradient_checkpointing": True, "packing": True,
                     "packing_length": 4096},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "hf", "rollout_generate_batch_size": 4, "decoding": {"max_new_tokens": 24},
            "matching": {"mask_resolution": 64}}}},
    }
    summary = run_training(validate_config(data))
    setup = next(r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "setup")
    assert setup["train/packed_attention"] == "rm_varlen", setup
    rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
    assert len(rows) == steps and all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in rows)
    assert all(r["packing/segments_per_row"] >= 1 for r in rows)
    layers = 2
    # forward (grad on) + checkpoint recompute in backward (grad on): at least 2 calls per layer per step
    assert calls["fwd"] >= 2 * layers * steps, calls
    ledger = [json.loads(line) for line in (Path(summary.output_dir) / "stage2" / "ledger.jsonl").read_text().splitlines()]
    ids = [r["sample_id"] for r in ledger]
    assert len(ids) >= steps and len(ids) == len(set((r["sample_id"], r["epoch"]) for r in ledger))
