"""A plain ``train`` (no torchrun) on a machine with several GPUs trains on one, never through ``nn.DataParallel``."""

from __future__ import annotations

import logging

from trainer.sft.run import one_process_one_gpu


class _Args:
    """The two attributes ``one_process_one_gpu`` reads and writes (HF's ``n_gpu`` reads ``_n_gpu``)."""

    def __init__(self, n_gpu: int):
        self._n_gpu = n_gpu

    @property
    def n_gpu(self) -> int:
        return self._n_gpu


def test_one_process_with_two_visible_gpus_uses_one(monkeypatch, caplog):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with caplog.at_level(logging.WARNING, logger="trainer.sft.run"):
        args = one_process_one_gpu(_Args(2))
    assert args.n_gpu == 1
    assert "launch learner" in caplog.text and "2 GPUs are visible" in caplog.text


def test_torchrun_ranks_and_single_gpu_runs_are_left_alone(monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert one_process_one_gpu(_Args(2)).n_gpu == 2
    monkeypatch.delenv("WORLD_SIZE")
    with caplog.at_level(logging.WARNING, logger="trainer.sft.run"):
        assert one_process_one_gpu(_Args(1)).n_gpu == 1
        assert one_process_one_gpu(_Args(0)).n_gpu == 0
    assert not caplog.text


def test_hf_arguments_read_the_override():
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="/tmp/x", use_cpu=True, report_to=[])
    args._n_gpu = 3
    assert args.n_gpu == 3
