"""``training.optim`` (fused AdamW) into HF's TrainingArguments and optimizer, and ``apply_model_levers``'s setup row
(``trainer.modeling.levers``): which levers ran, written first into ``metrics.jsonl``."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Trainer

from trainer.config.errors import ConfigErrors
from trainer.config.schema import validate_config
from trainer.modeling.fixtures import build_tiny_model
from trainer.modeling.levers import apply_model_levers
from trainer.sft.run import training_arguments


def stage2(tmp_path, **training) -> dict:
    return {"model": {"tiny": "vl"}, "data": {"synthetic": {"num_samples": 4}},
            "training": {"output_dir": str(tmp_path / "run"), **training},
            "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}


@pytest.mark.parametrize("optim, fused", [("adamw_torch_fused", True), ("adamw_torch", None)])
def test_optim_reaches_the_training_arguments_and_the_optimizer(tmp_path, optim, fused):
    cfg = validate_config(stage2(tmp_path, optim=optim))
    args = training_arguments(cfg, tmp_path / "out", max_steps=1, learning_rate=1e-4, batch_size=1, report_to=[])
    assert args.optim.value == optim
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is torch.optim.AdamW and kwargs.get("fused") is fused
    model = torch.nn.Linear(4, 4)
    opt = cls(model.parameters(), **kwargs)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # torch's fused AdamW runs on the CPU too


def test_the_default_is_the_fused_adamw_transformers_already_chose(tmp_path):
    """transformers picks adamw_torch_fused by default with torch >= 2.8 (both locks): the key's default keeps what
    every earlier run used, and adamw_torch is the lever to measure against it."""
    from transformers import TrainingArguments

    assert TrainingArguments.__dataclass_fields__["optim"].default == "adamw_torch_fused"
    assert validate_config(stage2(tmp_path)).training.optim == "adamw_torch_fused"


def test_an_unknown_optimizer_is_refused(tmp_path):
    with pytest.raises(ConfigErrors) as exc:
        validate_config(stage2(tmp_path, optim="adafactor"))
    assert exc.value.errors[0].key_path == "training.optim"


def test_an_unknown_packed_varlen_kernel_is_refused(tmp_path):
    assert validate_config(stage2(tmp_path)).training.packed_varlen_kernel == "op"
    with pytest.raises(ConfigErrors) as exc:
        validate_config(stage2(tmp_path, packed_varlen_kernel="flash"))
    assert exc.value.errors[0].key_path == "training.packed_varlen_kernel"


def test_the_setup_row_says_which_levers_run(tmp_path):
    model, _ = build_tiny_model("vl")
    cfg = validate_config(stage2(tmp_path, gradient_checkpointing_policy="selective",
                                 gradient_checkpointing_every_n_layers=3, optim="adamw_torch"))
    from trainer.sft.cpu_threads import CpuAffinity, CpuThreads, OmpWaitPolicy

    resolved, row = apply_model_levers(cfg, model, tmp_path, packed_attention="rm_varlen",
                                       cpu_threads=CpuThreads(4, "OMP_NUM_THREADS"),
                                       cpu_affinity=CpuAffinity((4, 5, 6, 7), "local rank 1 of 2"),
                                       omp_wait_policy=OmpWaitPolicy("PASSIVE", "a host with 2 GPU(s)"))
    assert row == {"train/use_liger_kernel": False, "train/optim": "adamw_torch", "train/compile_decoder_layers": False,
                   "train/packed_attention": "rm_varlen",
                   "train/cpu_threads_per_rank": 4, "train/cpu_threads_reason": "OMP_NUM_THREADS",
                   "train/cpu_affinity": "4-7", "train/cpu_affinity_reason": "local rank 1 of 2",
                   "train/omp_wait_policy": "PASSIVE", "train/omp_wait_policy_reason": "a host with 2 GPU(s)",
                   "train/checkpointing_policy": "selective", "train/checkpointing_requested": "selective",
                   "train/checkpointing_every_n_layers": 3, "train/checkpointed_layers": 1,
                   "train/decoder_layers": 2, "train/compile_activation_memory_budget": None,
                   "train/compile_activation_memory_budget_requested": None}
    (written,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert written["phase"] == "setup" and written["step"] == 0 and {k: written[k] for k in row} == row
    assert resolved.training.checkpointing_policy == "selective"


def test_auto_is_resolved_and_its_numbers_recorded(tmp_path, monkeypatch):
    model, _ = build_tiny_model("vl")
    cfg = validate_config(stage2(tmp_path, gradient_checkpointing_policy="auto"))
    resolved, row = apply_model_levers(cfg, model, None, device_bytes=0.0)  # no memory at all: full
    assert (row["train/checkpointing_policy"], row["train/checkpointing_requested"]) == ("full", "auto")
    assert row["train/checkpointed_layers"] == row["train/decoder_layers"] == 2
    assert set(row["train/checkpointing_estimate_gib"]) == {"off", "selective/4", "selective/3", "selective/2", "full"}
    assert row["train/checkpointing_budget_gib"] < 0
    assert row["train/estimated_peak_gib"] == pytest.approx(
        row["train/checkpointing_budget_gib"] * -1 + row["train/checkpointing_estimate_gib"]["full"]), \
        "no device memory: everything committed is over the budget"
    assert (resolved.training.checkpointing_policy, resolved.training.gradient_checkpointing) == ("full", True)
    assert not (tmp_path / "metrics.jsonl").exists(), "out=None writes nothing"
    monkeypatch.setenv("RANK", "1")
    apply_model_levers(cfg, model, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists(), "rank 0 alone writes the row"
