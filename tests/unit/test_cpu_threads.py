"""``training.cpu_threads_per_rank``: torchrun's ``OMP_NUM_THREADS=1`` is replaced by each rank's share of the
cores under ``auto``; a user's own setting or an explicit count wins."""

from __future__ import annotations

import pytest

from trainer.config.schema import TrainingConfig
from trainer.sft.cpu_threads import apply_cpu_threads, cgroup_cpu_limit, choose_cpu_threads


def test_torchruns_one_thread_becomes_each_ranks_share_of_the_cores():
    c = choose_cpu_threads("auto", local_world_size=8, cores=128, omp_num_threads="1", current=1)
    assert c.threads == 16 and "torchrun" in c.reason and "cpu_threads_per_rank: 1" in c.reason
    assert choose_cpu_threads("auto", 4, 6, "1", 1).threads == 1, "never below one thread"
    assert choose_cpu_threads("auto", 2, 32, None, 16).threads == 16, "several ranks without the variable: a share"


def test_a_users_setting_or_a_count_wins_and_one_rank_keeps_torchs_default():
    assert choose_cpu_threads("auto", 8, 128, "4", 4) == choose_cpu_threads("auto", 8, 128, " 4 ", 4)
    assert choose_cpu_threads("auto", 8, 128, "4", 4).threads == 4
    assert choose_cpu_threads("auto", 1, 64, "1", 1).threads == 1, "one rank: a 1 is the user's"
    kept = choose_cpu_threads("auto", 1, 64, None, 48)
    assert kept.threads == 48 and kept.reason == "torch's default"
    assert choose_cpu_threads(1, 8, 128, "1", 1).threads == 1
    assert choose_cpu_threads(6, 8, 128, "1", 1).threads == 6
    odd = choose_cpu_threads("auto", 2, 16, "lots", 8)
    assert odd.threads == 8 and "'lots'" in odd.reason


def test_the_count_is_applied_to_torch_and_to_child_processes(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    try:
        applied = apply_cpu_threads(2)
        assert applied.threads == torch.get_num_threads() == 2
        import os

        assert os.environ["OMP_NUM_THREADS"] == "2"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1])
def test_a_count_below_one_is_refused_naming_the_key(bad):
    with pytest.raises(ValueError, match="cpu_threads_per_rank"):
        TrainingConfig(cpu_threads_per_rank=bad)


def test_a_containers_cpu_quota_bounds_the_cores(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("3200000 100000\n")
    assert cgroup_cpu_limit(f) == 32
    f.write_text("50000 100000\n")
    assert cgroup_cpu_limit(f) == 1, "half a CPU still runs one thread"
    f.write_text("max 100000\n")
    assert cgroup_cpu_limit(f) is None
    assert cgroup_cpu_limit(tmp_path / "absent") is None


def test_one_rank_without_the_variable_changes_nothing(monkeypatch):
    import os

    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    applied = apply_cpu_threads("auto")
    assert applied.threads == before == torch.get_num_threads() and applied.reason == "torch's default"
    assert "OMP_NUM_THREADS" not in os.environ, "a plain run's environment is left as it was"
