"""Fixtures for summary-GRPO tests: the shipped configs (resolved) and a small synthetic summary dataset."""

from __future__ import annotations

import copy
from pathlib import Path

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
