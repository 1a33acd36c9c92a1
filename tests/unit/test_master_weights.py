"""Float32 master weights under a 16-bit ``model.torch_dtype``: an AdamW step at lr 1e-4 moves a norm gain near 1.0
(half a bf16 ulp there is 0.004, so a direct bf16 update loses it), the engine is served the compute dtype."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.tiny_trainer import tiny_stage2_trainer
from trainer.modeling.fixtures import build_tiny_model
from trainer.precision import compute_dtype, keep_master_weights_fp32, serving_cast
from trainer.sync.weights import full_weights


def _norm(model) -> torch.Tensor:
    return model.model.norm.weight


def _one_step(tmp_path, model, name):
    before = _norm(model).detach().float().clone()
    trainer = tiny_stage2_trainer(tmp_path / name, model=model, records=2, max_steps=1, bf16=True,
                                  target_source="ground_truth", args={"learning_rate": 1e-4, "optim": "adamw_torch"})
    trainer.train()
    return before, _norm(model).detach().float()


def test_a_norm_gain_moves_with_master_weights_and_not_in_plain_bf16(tmp_path):
    plain = build_tiny_model("text", seed=0)[0].to(torch.bfloat16)
    before, after = _one_step(tmp_path, plain, "plain")
    assert torch.equal(before, after), "a 1e-4 step on bf16 weights near 1.0 rounds away (the failure it fixes)"

    master = build_tiny_model("text", seed=0)[0].to(torch.bfloat16)
    widened = keep_master_weights_fp32(master, "bfloat16", deepspeed=False)
    assert widened is not None and widened.params == sum(1 for _ in master.parameters())
    assert all(p.dtype == torch.float32 for p in master.parameters())
    before, after = _one_step(tmp_path, master, "master")
    moved = (after - before).abs()
    assert moved.max() > 5e-5 and moved.max() < 5e-3, "the step lands at the learning rate's scale"


def test_frozen_parameters_stay_16_bit_and_the_engine_gets_the_compute_dtype():
    model = build_tiny_model("text", seed=0)[0].to(torch.bfloat16)
    model.model.embed_tokens.weight.requires_grad_(False)
    keep_master_weights_fp32(model, "bfloat16", deepspeed=False)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.float32
    assert compute_dtype(model) == torch.bfloat16 and serving_cast(model) == torch.bfloat16
    sent = full_weights(model)
    assert {t.dtype for t in sent.values()} == {torch.bfloat16}


@pytest.mark.parametrize("torch_dtype, deepspeed", [("float32", False), ("bfloat16", True)])
def test_nothing_changes_in_float32_or_under_deepspeed(torch_dtype, deepspeed):
    model = build_tiny_model("text", seed=0)[0].to(getattr(torch, torch_dtype))
    assert keep_master_weights_fp32(model, torch_dtype, deepspeed=deepspeed) is None
    assert {p.dtype for p in model.parameters()} == {getattr(torch, torch_dtype)}
    assert serving_cast(model) is None


def test_a_bf16_config_trains_float32_master_weights_end_to_end(tmp_path):
    """``trainer train`` on a config with ``model.torch_dtype: bfloat16``: the warm-up's step at lr 1e-4 moves the
    final norm gain, the log says how the weights are kept, and the saved model's norm differs from the initial one."""
    from trainer.cli import main

    cfg = {"model": {"tiny": "text", "torch_dtype": "bfloat16"},
           "data": {"synthetic": {"num_samples": 4, "max_objects": 2, "image_size": 64}},
           "training": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "per_device_train_batch_size": 2,
                        "learning_rate": 1e-4, "report_to": ["jsonl"], "optim": "adamw_torch"},
           "stage1": {"steps": 1, "learning_rate": 1e-4, "batch_size": 2},
           "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf", "decoding": {"max_new_tokens": 8}}}}}
    path = tmp_path / "bf16.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(path)]) in (0, None)
    run = tmp_path / "run"
    initial = load_file(next(run.glob("tiny-model-*/model.safetensors")))
    final = load_file(run / "final" / "model.safetensors")
    key = next(k for k in initial if k.endswith("model.norm.weight"))
    assert final[key].dtype == torch.float32, "the saved model holds the master weights"
    assert not torch.equal(final[key].float(), initial[key].float()), "the norm gain moved"
    resolved = json.loads((run / "resolved_config.json").read_text())
    assert resolved["model"]["torch_dtype"] == "bfloat16"
