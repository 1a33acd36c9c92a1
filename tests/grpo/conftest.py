"""Fixtures for summary-GRPO tests: the shipped configs (resolved) and a small synthetic summary dataset."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from trainer.config.loader import resolve_yaml

REPO = Path(__file__).resolve().parents[2]
SUMMARY_CONFIGS = ("configs/summary_1024.yaml", "configs/summary_1024_attr_key_recall.yaml")


@pytest.fixture
def summary_cfg() -> dict:
    """A fresh resolved ``summary_1024`` mapping (tests mutate it)."""
    return copy.deepcopy(resolve_yaml(REPO / "configs/summary_1024.yaml"))


@pytest.fixture(scope="session")
def summary_dataset(tmp_path_factory) -> Path:
    from trainer.grpo.summary_data import write_dataset

    return write_dataset(tmp_path_factory.mktemp("summary_data"), num_samples=48, seed=3)


def tiny_text_grpo_config(tmp_path: Path, summary_dataset: Path, extends: str, *, batch: int,
                          rlhf: dict[str, Any]) -> tuple[Path, Path]:
    """A ``swift rlhf`` GRPO config on CPU: ``extends`` (a shipped summary config) with a tiny text Qwen3, the summary
    rows without images, generation by the learner itself (``use_vllm: false``; server mode needs NCCL, i.e. GPUs),
    no bf16 / DeepSpeed, 2 steps of ``batch``; ``rlhf`` adds to or overrides the rlhf section. Returns the config's
    path and the output directory."""
    import yaml

    from trainer.conformance.rlhf import text_rows
    from trainer.modeling.fixtures import save_tiny_model

    model = save_tiny_model(tmp_path / "tiny_text", kind="text")
    rows = text_rows(summary_dataset, tmp_path / "text.jsonl")
    out_dir = tmp_path / "out"
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(yaml.safe_dump({
        "extends": str(REPO / extends),
        "model": {"path": str(model), "torch_dtype": "float32"},
        "data": {"train_jsonl": str(rows)},
        "training": {"output_dir": str(out_dir), "bf16": False, "deepspeed": None, "per_device_train_batch_size": batch,
                     "gradient_accumulation_steps": 1, "max_steps": 2, "save_steps": 0,
                     "gradient_checkpointing": False, "report_to": []},
        "rlhf": {"model_type": "qwen3", "template": "qwen3_nothinking", "use_vllm": False, "vllm_mode": None,
                 "max_length": 1024, "dynamic_sample": False, **rlhf},
        "custom": {"extra": {"rollout_server": None}},
    }, allow_unicode=True))
    return cfg, out_dir
