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


def _hyperthreaded_sysfs(root, packages: int = 2, cores: int = 8):
    """A fake ``/sys/devices/system/cpu``: ``packages`` x ``cores`` physical cores, two threads each (logical CPU
    ``c`` and ``c + packages * cores`` are siblings, Linux's numbering)."""
    n = packages * cores
    for cpu in range(2 * n):
        core = cpu % n
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{core // cores}\n")
        (topology / "core_id").write_text(f"{core % cores}\n")
    return root


def test_the_physical_cores_are_counted_among_the_allowed_cpus_only(tmp_path, monkeypatch):
    """A cpuset of 8 logical CPUs (4 cores and their hyper-threads) on a 16-core, 32-thread host: 4 cores, not the
    host's 16 nor the 8 logical CPUs; core ids repeat across packages and are told apart by the package."""
    from trainer.sft import cpu_threads

    sysfs = _hyperthreaded_sysfs(tmp_path / "cpu")
    assert cpu_threads.physical_cores_of(range(32), sysfs) == 16
    cpuset = {0, 1, 2, 3, 16, 17, 18, 19}
    assert cpu_threads.physical_cores_of(cpuset, sysfs) == 4
    assert cpu_threads.physical_cores_of({0, 8}, sysfs) == 2, "core 0 of package 0 and core 0 of package 1"
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: cpuset)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: None)
    assert cpu_threads.usable_physical_cores(sysfs) == 4
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: 3)
    assert cpu_threads.usable_physical_cores(sysfs) == 3, "the cgroup quota still bounds it"
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr("psutil.cpu_count", lambda logical=True: 16)
    assert cpu_threads.usable_physical_cores(tmp_path / "absent") == 8, \
        "no topology: the host's physical cores, at most the allowed CPUs"
