"""The learner's levers through ``run_training`` on the tiny Qwen3-VL (HF rollouts, packed rows, one step): the
checkpointing policy reaches the decoder layers HF checkpoints, ``training.optim`` the optimizer, Liger (a fake
module doing the same maths in torch: the kernels need Triton) the model, and the setup row records each."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import trainer.sft.run as run_module
from trainer.config.schema import validate_config
from trainer.modeling.compile import decoder_layers
from trainer.telemetry import read_jsonl


def config(tmp_path, **training) -> dict:
    return {
        "model": {"tiny": "vl"},
        "data": {"synthetic": {"num_samples": 4, "seed": 3, "min_objects": 1, "max_objects": 2, "image_size": 64}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "per_device_train_batch_size": 4,
                     "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                     "report_to": ["jsonl"], "packing": True, "packing_length": 2048, **training},
        "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf", "rollout_generate_batch_size": 4,
                                                  "decoding": {"max_new_tokens": 8},
                                                  "matching": {"mask_resolution": 64}}}},
    }


@pytest.fixture
def seen(monkeypatch):
    """What the stage-2 trainer ran with: each decoder layer's checkpointing flag and the optimizer's ``fused``."""
    out: dict = {}

    class Spy(run_module.RolloutMatchingTrainer):
        def train(self, *args, **kwargs):
            result = super().train(*args, **kwargs)
            opt = getattr(self.optimizer, "optimizer", self.optimizer)
            out.update(flags=[bool(getattr(layer, "gradient_checkpointing", False))
                              for layer in decoder_layers(self.model)], fused=opt.defaults.get("fused"),
                       optim=self.args.optim.value, packed_attention=self.packed_attn)
            return result

    monkeypatch.setattr(run_module, "RolloutMatchingTrainer", Spy)
    return out


@pytest.fixture
def fake_liger(monkeypatch):
    calls = []

    class SwiGLU:
        def forward(self, x):
            calls.append("swiglu")
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    mod = types.ModuleType("liger_kernel.transformers")
    mod.apply_liger_kernel_to_qwen3_vl = lambda **kw: calls.append(("qwen3_vl", {k: v for k, v in kw.items()
                                                                                 if k != "model"}))
    mod.LigerSwiGLUMLP = SwiGLU
    pkg = types.ModuleType("liger_kernel")
    pkg.transformers = mod
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", mod)
    return calls


def setup_and_steps(summary):
    rows = read_jsonl(summary.metrics_path)
    assert rows[0]["phase"] == "setup", "the levers' row comes first"
    steps = [r for r in rows if r.get("phase") == "stage2" and "loss" in r]
    assert len(steps) == 1 and steps[0]["loss"] == steps[0]["loss"] and steps[0]["grad_norm"] > 0
    return rows[0]


def test_the_default_run_records_no_checkpointing_and_fused_adamw(tmp_path, seen):
    row = setup_and_steps(run_module.run_training(validate_config(config(tmp_path))))
    assert (row["train/checkpointing_policy"], row["train/optim"], row["train/use_liger_kernel"]) == \
        ("off", "adamw_torch_fused", False)
    # the packed rows' attention the row names is the one the trainer ran (no CUDA here: sdpa with a block mask)
    assert row["train/packed_attention"] == seen.pop("packed_attention") == "sdpa"
    assert row["train/compile_decoder_layers"] is False
    assert seen == {"flags": [False, False], "fused": True, "optim": "adamw_torch_fused"}


def test_the_old_bool_still_means_full(tmp_path, seen):
    row = setup_and_steps(run_module.run_training(validate_config(config(tmp_path, gradient_checkpointing=True))))
    assert (row["train/checkpointing_policy"], row["train/checkpointed_layers"]) == ("full", 2)
    assert seen["flags"] == [True, True]


def test_selective_unfused_adamw_and_liger_reach_the_trainer(tmp_path, seen, fake_liger):
    cfg = config(tmp_path, gradient_checkpointing_policy="selective", optim="adamw_torch", use_liger_kernel=True)
    row = setup_and_steps(run_module.run_training(validate_config(cfg)))
    assert row["train/checkpointing_policy"] == "selective" and row["train/checkpointing_every_n_layers"] == 2
    assert row["train/checkpointed_layers"] == 1 and seen["flags"] == [True, False], \
        "HF checkpointed exactly the layer the row names (vision blocks counted first)"
    assert (row["train/optim"], seen["optim"], seen["fused"]) == ("adamw_torch", "adamw_torch", None)
    assert row["train/use_liger_kernel"] is True and row["train/liger_swiglu_mlps"] == 2
    assert fake_liger[0] == ("qwen3_vl", {"rope": True, "rms_norm": True, "swiglu": False, "cross_entropy": False,
                                          "fused_linear_cross_entropy": False})
    assert fake_liger.count("swiglu") >= 2, "the trained forward ran the bound SwiGLU in each text layer"


def test_auto_resolves_before_the_trainer_starts(tmp_path, seen, monkeypatch):
    from trainer.modeling import checkpointing

    monkeypatch.setattr(checkpointing, "device_bytes", lambda: 1.0)  # nothing fits: full
    row = setup_and_steps(run_module.run_training(validate_config(config(tmp_path,
                                                                         gradient_checkpointing_policy="auto"))))
    assert (row["train/checkpointing_requested"], row["train/checkpointing_policy"]) == ("auto", "full")
    assert seen["flags"] == [True, True]
