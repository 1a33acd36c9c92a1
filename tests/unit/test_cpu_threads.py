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


def test_one_rank_without_the_variable_on_a_gpu_machine_changes_nothing(monkeypatch):
    import os

    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    applied = apply_cpu_threads("auto", cuda=True)
    assert applied.threads == before == torch.get_num_threads() and applied.reason == "torch's default"
    assert "OMP_NUM_THREADS" not in os.environ, "a plain run's environment is left as it was"


def test_auto_without_a_gpu_is_one_thread_per_rank_unless_a_count_says_otherwise():
    from trainer.sft.cpu_threads import CPU_DEFAULT

    for ranks, omp, bound in ((1, None, False), (2, "1", False), (4, None, True), (2, "lots", False)):
        c = choose_cpu_threads("auto", ranks, 16, omp, 16, bound=bound, cuda=False)
        assert (c.threads, c.reason) == (1, CPU_DEFAULT), (ranks, omp, bound)
    assert choose_cpu_threads("auto", 1, 16, "4", 16, cuda=False).threads == 4, "the user's OMP_NUM_THREADS wins"
    assert choose_cpu_threads(3, 1, 16, None, 16, cuda=False).threads == 3, "an explicit count wins"
    assert choose_cpu_threads("auto", 1, 16, None, 16, cuda=True).threads == 16, "a GPU machine: torch's default"


def test_a_cpu_run_takes_one_thread_as_an_explicit_1_does(monkeypatch):
    import os

    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "unset below")  # recorded, so the 1 exported here is undone after
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        applied = apply_cpu_threads("auto", cuda=False)
        assert applied.threads == torch.get_num_threads() == 1 and "no CUDA GPU" in applied.reason
        assert os.environ["OMP_NUM_THREADS"] == "1", "what an explicit cpu_threads_per_rank: 1 exports"
    finally:
        torch.set_num_threads(before)


def test_the_keys_description_says_the_cpu_default():
    description = TrainingConfig.model_fields["cpu_threads_per_rank"].description
    assert TrainingConfig().cpu_threads_per_rank == "auto"
    assert "without a CUDA GPU, 1 thread per rank" in description


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


def _fake_topology(root, layout):
    """``layout``: {logical cpu: (package, core)} written as sysfs topology files under ``root``."""
    for cpu, (package, core) in layout.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def test_each_local_rank_gets_its_own_block_of_whole_cores(tmp_path):
    from trainer.sft.cpu_threads import choose_cpu_affinity, physical_core_groups

    # two sockets of 4 cores, hyper-threaded: cpu c and c+8 are siblings
    layout = {c: (c // 4, c % 4) for c in range(8)} | {c + 8: (c // 4, c % 4) for c in range(8)}
    sysfs = _fake_topology(tmp_path, layout)
    groups = physical_core_groups(range(16), sysfs)
    assert groups[0] == (0, 8) and groups[4] == (4, 12) and len(groups) == 8
    blocks = [choose_cpu_affinity("auto", r, 2, range(16), sysfs).cpus for r in range(2)]
    assert blocks == [(0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)], "a socket each, siblings kept"
    four = [set(choose_cpu_affinity("auto", r, 4, range(16), sysfs).cpus) for r in range(4)]
    assert set().union(*four) == set(range(16)) and sum(map(len, four)) == 16, "every CPU once"
    # a container's cpuset that holds only some CPUs: only those are shared out
    inside = [choose_cpu_affinity("auto", r, 2, [2, 3, 10, 11, 4, 12], sysfs).cpus for r in range(2)]
    assert inside == [(2, 10), (3, 4, 11, 12)], "three cores: one for rank 0, two for rank 1, siblings kept"


def test_fewer_cores_than_ranks_share_round_robin_and_off_or_one_rank_is_not_bound(tmp_path):
    from trainer.sft.cpu_threads import CpuAffinity, choose_cpu_affinity

    sysfs = _fake_topology(tmp_path, {0: (0, 0), 1: (0, 1)})
    assert [choose_cpu_affinity("auto", r, 4, [0, 1], sysfs).cpus for r in range(4)] == [(0,), (1,), (0,), (1,)]
    assert choose_cpu_affinity("off", 0, 4, [0, 1], sysfs).cpus == ()
    assert choose_cpu_affinity("auto", 0, 1, [0, 1], sysfs).cpus == ()
    no_sysfs = choose_cpu_affinity("auto", 1, 2, [0, 1, 2, 3], tmp_path / "absent")
    assert no_sysfs.cpus == (2, 3), "without the topology each logical CPU counts as a core"
    assert CpuAffinity((0, 1, 2, 5, 7, 8), "x").cpu_list == "0-2,5,7-8"
    assert CpuAffinity((), "x").cpu_list is None


def test_a_bound_rank_and_the_threads_it_starts_run_only_on_its_block(tmp_path):
    """The real binding, in a child process that plays local rank 1 of 2 on this host's CPUs."""
    import json
    import os
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    code = ("import json, os, threading\n"
            "from trainer.sft.cpu_threads import apply_cpu_affinity\n"
            "a = apply_cpu_affinity('auto')\n"
            "seen = []\n"
            "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
            "t.start(); t.join()\n"
            "print(json.dumps({'cpus': list(a.cpus), 'main': sorted(os.sched_getaffinity(0)), 'thread': seen[0]}))\n")
    env = dict(os.environ, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    out = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    assert out["cpus"] and out["main"] == out["thread"] == out["cpus"]
    assert set(out["cpus"]) <= set(allowed)
    if len(allowed) > 1:
        assert set(out["cpus"]) != set(allowed), "rank 1 of 2 holds only part of the CPUs"


def test_node_blocks_follow_the_host_gpu_so_servers_and_a_learner_never_overlap(tmp_path):
    from trainer.sft.cpu_threads import choose_cpu_affinity, node_gpus_of_local_ranks

    sysfs = _fake_topology(tmp_path, {c: (0, c) for c in range(16)})
    # 6v2 on an 8-GPU host: servers on GPUs 0-5 (one process each), the learner's two ranks on GPUs 6 and 7
    servers = [set(choose_cpu_affinity("node", 0, 1, range(16), sysfs, node_gpu=g, node_gpu_count=8).cpus)
               for g in range(6)]
    ranks = node_gpus_of_local_ranks(2, "6,7")
    learner = [set(choose_cpu_affinity("node", r, 2, range(16), sysfs, node_gpu=ranks[r], node_gpu_count=8).cpus)
               for r in range(2)]
    blocks = servers + learner
    assert all(len(b) == 2 for b in blocks) and set().union(*blocks) == set(range(16))
    assert learner == [{12, 13}, {14, 15}]
    assert node_gpus_of_local_ranks(2, None) == [0, 1] and node_gpus_of_local_ranks(2, "GPU-ab,GPU-cd") == [0, 1]
    # no GPU count (a CPU machine), or an index the count does not hold: as auto (local ranks)
    assert choose_cpu_affinity("node", 1, 2, range(16), sysfs, node_gpu=7, node_gpu_count=None).cpus == \
        choose_cpu_affinity("auto", 1, 2, range(16), sysfs).cpus
    assert choose_cpu_affinity("node", 0, 1, range(16), sysfs, node_gpu=3, node_gpu_count=2).cpus == ()


def test_launch_server_binds_to_its_gpus_blocks_and_prints_the_taskset_line(monkeypatch, capsys):
    import trainer.sft.cpu_threads as ct
    from trainer.cli import main

    monkeypatch.setattr(ct, "host_gpu_count", lambda *a: 8)
    monkeypatch.setattr(ct.os, "sched_getaffinity", lambda pid: set(range(32)))
    share = ct.server_cpu_affinity([2, 3])
    assert share.cpus == tuple(range(8, 16)), "GPUs 2 and 3 of 8: the third and fourth blocks of 4 cores"
    assert main(["launch", "server", "--engine", "vllm", "--model", "/m", "--gpus", "2,3", "--cpu-affinity", "node",
                 "--print-command"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("taskset -c 8-15 ") and "CUDA_VISIBLE_DEVICES=2,3" in line
    monkeypatch.setattr(ct, "host_gpu_count", lambda *a: None)
    assert ct.server_cpu_affinity([0]).cpus == (), "no GPU count: not bound"


def test_a_bound_rank_gets_a_thread_per_core_of_its_block_not_a_share_of_it():
    # 6v2's learner: two ranks, each bound to a 4-core block of a 32-core host (node mode)
    c = choose_cpu_threads("auto", local_world_size=2, cores=4, omp_num_threads="1", current=1, bound=True)
    assert c.threads == 4 and "bound to" in c.reason
    one = choose_cpu_threads("auto", local_world_size=1, cores=4, omp_num_threads=None, current=32, bound=True)
    assert one.threads == 4, "one bound rank: its block's cores, not torch's whole-machine default"
    assert choose_cpu_threads("auto", 2, 4, "3", 3, bound=True).threads == 3, "a user's count still wins"
    assert choose_cpu_threads("auto", 2, 32, "1", 1).threads == 16, "unbound: the share, as before"


def test_a_gpu_host_makes_idle_openmp_threads_sleep_unless_the_environment_says_otherwise():
    from trainer.sft.cpu_threads import choose_omp_wait_policy

    c = choose_omp_wait_policy({}, gpus=4, torch_loaded=False)
    assert c.policy == "PASSIVE" and "4 GPU(s)" in c.reason
    user = choose_omp_wait_policy({"OMP_WAIT_POLICY": "active"}, gpus=4, torch_loaded=False)
    assert user.policy == "active" and "OMP_WAIT_POLICY=active from the environment" in user.reason
    spin = choose_omp_wait_policy({"GOMP_SPINCOUNT": "10000"}, gpus=4, torch_loaded=False)
    assert spin.policy is None and "GOMP_SPINCOUNT=10000" in spin.reason, "a spin count the user chose is kept"
    assert choose_omp_wait_policy({}, gpus=None, torch_loaded=False).policy is None, "CPU training keeps spinning"
    assert choose_omp_wait_policy({"OMP_WAIT_POLICY": " "}, gpus=0, torch_loaded=False).policy is None
    late = choose_omp_wait_policy({}, gpus=8, torch_loaded=True)
    assert late.policy is None and "before" in late.reason, "set after torch loaded the runtime, it would do nothing"


def _env_without_a_wait_policy() -> dict[str, str]:
    import os

    from trainer.sft.cpu_threads import OMP_WAIT_VARS

    return {k: v for k, v in os.environ.items() if k not in OMP_WAIT_VARS}


def _omp_display(code: str, env_extra: dict[str, str]) -> str:
    import subprocess
    import sys

    env = {**_env_without_a_wait_policy(), "OMP_DISPLAY_ENV": "VERBOSE", **env_extra}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stderr + out.stdout


def test_the_openmp_runtime_torch_loads_sees_the_policy():
    """The runtime reads the variable once, when torch loads it: ``apply_omp_wait_policy`` before ``import torch``
    (what ``python -m trainer`` does) gives it no spinning at all (GNU OpenMP's ``GOMP_SPINCOUNT = '0'``); without
    it, the default 300,000 spins. A host GPU count is faked; this machine's runtime reports its settings itself."""
    apply = ("import trainer.sft.cpu_threads as c; c.host_gpu_count = lambda: 8; "
             "print('policy', c.apply_omp_wait_policy().policy); import torch; torch.ones(8).sum()")
    shown = _omp_display(apply, {})
    assert "policy PASSIVE" in shown
    if "GOMP_SPINCOUNT" not in shown:
        pytest.skip("this torch's OpenMP runtime does not print GOMP_SPINCOUNT under OMP_DISPLAY_ENV=VERBOSE")
    assert "GOMP_SPINCOUNT = '0'" in shown
    assert "GOMP_SPINCOUNT = '300000'" in _omp_display("import torch; torch.ones(8).sum()", {})
    user = _omp_display(apply, {"GOMP_SPINCOUNT": "1000"})
    assert "policy None" in user and "GOMP_SPINCOUNT = '1000'" in user


def test_python_m_trainer_leaves_a_machine_without_gpus_at_the_runtimes_default():
    import subprocess
    import sys

    from trainer.sft.cpu_threads import host_gpu_count

    if host_gpu_count():
        pytest.skip("this machine has GPUs: python -m trainer sets OMP_WAIT_POLICY here")
    env = _env_without_a_wait_policy()
    code = ("import runpy, sys, os; sys.argv = ['trainer', '--help']\n"
            "try:\n    runpy.run_module('trainer', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('OMP_WAIT_POLICY' in os.environ)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
