"""Helpers for tests that run the CLI in the test process: a small hf-backend config around a given ``model.path``,
and the torch settings ``demo`` pins for its process given back afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml


def small_config(tmp_path: Path, model_path: Path, name: str = "small.yaml") -> Path:
    """A one-step, four-record synthetic config with the hf rollout backend whose ``model.path`` is ``model_path``."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump({
        "model": {"path": str(model_path)},
        "data": {"synthetic": {"num_samples": 4, "eval_num_samples": 2, "image_size": 64}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "report_to": ["jsonl"]},
        "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}))
    return path


@contextlib.contextmanager
def torch_process_state_kept() -> Iterator[None]:
    """Restore torch's thread count and deterministic-algorithms flag on exit (``demo`` pins both for its process)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
