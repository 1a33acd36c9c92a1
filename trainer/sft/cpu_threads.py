"""How many intra-op CPU threads each learner rank's torch uses (``training.cpu_threads_per_rank``).

torchrun sets ``OMP_NUM_THREADS=1`` in every rank when it starts more than one and the variable is unset, so a
multi-rank learner runs its host-side tensor work (the image processor's resize and normalize, the packed rows'
pixel concatenation, ~0.8 GB a step at 64 records of 1024² images) on one thread, where a one-rank run uses every
core (2 × H200, 2026-11-28: the packing part of a colocate-2 rank's ``target`` phase 0.85 s against colocate-1's
0.3 s, the same 64 records per rank). ``auto`` gives each rank its share of the node's cores instead, as
``accelerate launch`` does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

AUTO = "auto"
TORCH_DEFAULT = "torch's default"


@dataclass(frozen=True)
class CpuThreads:
    """``threads``: the intra-op thread count a rank runs with; ``reason``: where it came from."""

    threads: int
    reason: str


def choose_cpu_threads(setting: int | str, local_world_size: int, cores: int, omp_num_threads: str | None,
                       current: int) -> CpuThreads:
    """The rank's thread count. ``setting``: ``training.cpu_threads_per_rank`` (a count wins). ``auto``: an
    ``OMP_NUM_THREADS`` the user set is kept, except a ``1`` beside more than one local rank (torchrun's own
    default, which cannot be told apart from a user's; ``cpu_threads_per_rank: 1`` keeps one), which becomes
    ``cores // local_world_size`` (at least 1); one rank without the variable keeps torch's default (``current``).
    ``cores``: the physical cores this process may run on."""
    if setting != AUTO:
        return CpuThreads(int(setting), "training.cpu_threads_per_rank")
    ranks = max(1, local_world_size)
    share = max(1, cores // ranks)
    raw = (omp_num_threads or "").strip()
    if raw:
        if raw == "1" and ranks > 1:
            return CpuThreads(share, f"OMP_NUM_THREADS=1 (torchrun's default with {ranks} local ranks) replaced by "
                                     f"{cores} cores / {ranks} ranks; training.cpu_threads_per_rank: 1 keeps one")
        if raw.isdigit() and int(raw) > 0:
            return CpuThreads(int(raw), "OMP_NUM_THREADS")
        return CpuThreads(share, f"OMP_NUM_THREADS={raw!r} is no thread count: {cores} cores / {ranks} ranks")
    if ranks == 1:
        return CpuThreads(current, TORCH_DEFAULT)
    return CpuThreads(share, f"{cores} cores / {ranks} ranks")


def cgroup_cpu_limit(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """The CPUs a cgroup-v2 quota allows (a Kubernetes container's ``resources.limits.cpu``: ``quota period`` in
    ``cpu.max``, rounded down, at least 1), or None without one (``max``, no file, cgroup v1)."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return max(1, int(quota) // int(period))


SYSFS_CPU = Path("/sys/devices/system/cpu")


def physical_cores_of(cpus: Iterable[int], sysfs_cpu: Path = SYSFS_CPU) -> int | None:
    """Distinct physical cores among the logical ``cpus``: ``(physical_package_id, core_id)`` pairs read from each
    CPU's ``topology`` folder under ``sysfs_cpu``; None when a CPU's topology cannot be read (no sysfs)."""
    cores = set()
    for cpu in cpus:
        topology = sysfs_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            return None
    return len(cores) or None


def usable_physical_cores(sysfs_cpu: Path = SYSFS_CPU) -> int:
    """Physical cores among the CPUs this process may run on (a container's or ``taskset``'s affinity: 8 logical
    CPUs of a hyper-threaded host are 4 cores), bounded by its cgroup's CPU quota (``cgroup_cpu_limit``). Without
    the topology in sysfs: the host's physical cores (psutil), at most the allowed CPUs."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    physical = physical_cores_of(allowed, sysfs_cpu)
    if physical is None:
        import psutil

        physical = min(psutil.cpu_count(logical=False) or len(allowed), len(allowed))
    return max(1, min(physical, cgroup_cpu_limit() or physical))


def apply_cpu_threads(setting: int | str) -> CpuThreads:
    """Choose this rank's count (``choose_cpu_threads``; ``LOCAL_WORLD_SIZE`` from torchrun), set it on torch and,
    unless it is torch's default, in ``OMP_NUM_THREADS`` (for processes this one starts); return it, with ``threads``
    read back from torch."""
    import torch

    choice = choose_cpu_threads(setting, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), usable_physical_cores(),
                                os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())
    if choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    if choice.reason != TORCH_DEFAULT:
        os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    applied = CpuThreads(torch.get_num_threads(), choice.reason)
    log.info("cpu threads per rank: %d (%s)", applied.threads, applied.reason)
    return applied
