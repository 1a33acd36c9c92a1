"""Each learner rank's share of the host's CPUs: how many intra-op threads its torch uses
(``training.cpu_threads_per_rank``) and which cores it runs on (``training.cpu_affinity``).

torchrun sets ``OMP_NUM_THREADS=1`` in every rank when it starts more than one and the variable is unset, so a
multi-rank learner runs its host-side tensor work (the image processor's resize and normalize, the packed rows'
pixel concatenation, ~0.8 GB a step at 64 records of 1024² images) on one thread, where a one-rank run uses every
core (2 × H200, 2026-11-28: the packing part of a colocate-2 rank's ``target`` phase 0.85 s against colocate-1's
0.3 s, the same 64 records per rank). ``auto`` gives each rank its share of the node's cores instead, as
``accelerate launch`` does. On a machine without a CUDA GPU ``auto`` is one thread per rank (``CPU_DEFAULT``): the
small models CPU runs train are fastest there, unless ``OMP_NUM_THREADS`` or a count says otherwise.

Several ranks on one host also share its cores with each rank's in-process vLLM engine, whose scheduler and
detokenizer run on one Python thread per step. ``cpu_affinity: auto`` binds each local rank (every thread of it,
and everything it starts later) to its own contiguous block of whole physical cores, so one rank's image
processing or packing never runs on the cores the other rank's engine is decoding on. Blocks follow the order of
the cores' ``(package, core_id)``, which on the usual 8-GPU node also follows the GPUs' NUMA nodes.

A bound rank's OpenMP threads must also not spin on its block. GNU OpenMP (torch's intra-op pool) lets an idle
thread busy-wait for the next parallel region unless it counts more threads than CPUs, and it counts the CPUs once,
when torch loads it: before the rank is bound, so the whole host. Within a block, the image thread's idle OpenMP
threads then spin on every core while the engine's loop and the image thread's own Python wait for one. On a GPU
host ``python -m trainer`` therefore sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads (``apply_omp_wait_policy``)
unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set; a machine without a GPU keeps the runtime's default, since
there the training itself is the host's tensor work.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

AUTO = "auto"
TORCH_DEFAULT = "torch's default"
#: ``auto`` without a CUDA GPU: the small models CPU runs train spend more on waking threads than they gain from
#: them (50 stage-1 and 5 stage-2 steps of configs/demo_from_stock.yaml on a 2-core machine: 39 s on one thread,
#: 119 s on torch's default of two)
CPU_DEFAULT = ("no CUDA GPU: one thread per rank, the fastest for the small models CPU runs train "
               "(training.cpu_threads_per_rank or OMP_NUM_THREADS sets more)")


@dataclass(frozen=True)
class CpuThreads:
    """``threads``: the intra-op thread count a rank runs with; ``reason``: where it came from."""

    threads: int
    reason: str


def choose_cpu_threads(setting: int | str, local_world_size: int, cores: int, omp_num_threads: str | None,
                       current: int, bound: bool = False, cuda: bool = True) -> CpuThreads:
    """The rank's thread count. ``setting``: ``training.cpu_threads_per_rank`` (a count wins). ``auto``: an
    ``OMP_NUM_THREADS`` the user set is kept, except a ``1`` beside more than one local rank (torchrun's own
    default, which cannot be told apart from a user's; ``cpu_threads_per_rank: 1`` keeps one); without a CUDA GPU
    (``cuda`` false) every other case is one thread (``CPU_DEFAULT``); with one, torchrun's ``1`` becomes
    ``cores // local_world_size`` (at least 1) and one rank without the variable keeps torch's default
    (``current``). ``cores``: the physical cores this process may run on; ``bound``: the process is bound to its
    own block (``training.cpu_affinity``), so ``cores`` is already its share: a thread per core of it."""
    if setting != AUTO:
        return CpuThreads(int(setting), "training.cpu_threads_per_rank")
    ranks = max(1, local_world_size)
    share = max(1, cores if bound else cores // ranks)
    whose = f"the {cores} cores this rank is bound to" if bound else f"{cores} cores / {ranks} ranks"
    raw = (omp_num_threads or "").strip()
    users = raw.isdigit() and int(raw) > 0 and not (raw == "1" and ranks > 1)
    if users:
        return CpuThreads(int(raw), "OMP_NUM_THREADS")
    if not cuda:
        return CpuThreads(1, CPU_DEFAULT)
    if raw:
        if raw == "1":
            return CpuThreads(share, f"OMP_NUM_THREADS=1 (torchrun's default with {ranks} local ranks) replaced by "
                                     f"{whose}; training.cpu_threads_per_rank: 1 keeps one")
        return CpuThreads(share, f"OMP_NUM_THREADS={raw!r} is no thread count: {whose}")
    if ranks == 1 and not bound:
        return CpuThreads(current, TORCH_DEFAULT)
    return CpuThreads(share, whose)


SYSFS_CPU = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CpuAffinity:
    """``cpus``: the logical CPUs a rank is bound to (empty: not bound); ``reason``: why."""

    cpus: tuple[int, ...]
    reason: str

    @property
    def cpu_list(self) -> str | None:
        """``cpus`` as a ``taskset``-style list (``0-7,16-23``), or None when not bound."""
        if not self.cpus:
            return None
        runs, start = [], self.cpus[0]
        for prev, cpu in zip(self.cpus, self.cpus[1:] + (None,)):
            if cpu != prev + 1:
                runs.append(f"{start}-{prev}" if prev != start else str(start))
                start = cpu
        return ",".join(runs)


def physical_core_groups(cpus: Iterable[int], sysfs_cpu: Path = SYSFS_CPU) -> list[tuple[int, ...]] | None:
    """The logical ``cpus`` grouped by physical core (hyper-thread siblings together), the groups ordered by
    ``(physical_package_id, core_id)``; None when a CPU's topology cannot be read."""
    groups: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        topology = sysfs_cpu / f"cpu{cpu}" / "topology"
        try:
            key = (int(topology.joinpath("physical_package_id").read_text()),
                   int(topology.joinpath("core_id").read_text()))
        except (OSError, ValueError):
            return None
        groups.setdefault(key, []).append(cpu)
    return [tuple(groups[k]) for k in sorted(groups)] or None


def rank_cpu_block(cores: list[tuple[int, ...]], local_rank: int, local_world_size: int) -> tuple[int, ...]:
    """Local rank ``local_rank``'s contiguous block of whole ``cores`` (from ``physical_core_groups``): the blocks
    of all ranks cover every core once, their sizes differ by at most one core; with fewer cores than ranks, ranks
    share cores round-robin (never an empty block)."""
    if not cores:
        raise ValueError("no cores to share")
    ranks = max(1, local_world_size)
    if len(cores) < ranks:
        block = [cores[local_rank % len(cores)]]
    else:
        block = cores[local_rank * len(cores) // ranks:(local_rank + 1) * len(cores) // ranks]
    return tuple(sorted(cpu for core in block for cpu in core))


def host_gpu_count(proc_gpus: Path = Path("/proc/driver/nvidia/gpus")) -> int | None:
    """The GPUs this host (or container) has, whatever ``CUDA_VISIBLE_DEVICES`` says: NVML's count (``pynvml``,
    which vLLM installs), else the driver's ``/proc`` entries; None on a machine without an NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML here: the driver's /proc entries, else nothing
        pass
    try:
        return len([p for p in proc_gpus.iterdir() if p.is_dir()]) or None
    except OSError:
        return None


def node_gpus_of_local_ranks(local_world_size: int, visible: str | None) -> list[int]:
    """The host GPU index each local rank drives: ``CUDA_VISIBLE_DEVICES``' entries in order (integer lists only),
    else the local rank itself."""
    items = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if len(items) >= local_world_size and all(v.isdigit() for v in items):
        return [int(v) for v in items[:local_world_size]]
    return list(range(local_world_size))


def choose_cpu_affinity(setting: str, local_rank: int, local_world_size: int, allowed: Iterable[int],
                        sysfs_cpu: Path = SYSFS_CPU, node_gpu: int | None = None,
                        node_gpu_count: int | None = None) -> CpuAffinity:
    """The CPUs this process binds to. ``off``: not bound. ``auto``: with several local ranks, ``rank_cpu_block``
    of the physical cores among ``allowed`` (the process's affinity, a container's cpuset) for ``local_rank``; one
    rank is not bound. ``node``: the block of host GPU ``node_gpu`` among ``node_gpu_count`` blocks, one per GPU of
    the host, so processes started separately (rollout servers, a learner beside them) share the cores without
    overlapping; without a GPU count, or a GPU index outside it, as ``auto``. Without the topology in sysfs, each
    logical CPU counts as a core."""
    if setting == "off":
        return CpuAffinity((), "cpu affinity: off")
    allowed = sorted(allowed)
    cores = physical_core_groups(allowed, sysfs_cpu) or [(cpu,) for cpu in allowed]
    if setting == "node" and node_gpu is not None and (node_gpu_count or 0) > 1 and 0 <= node_gpu < node_gpu_count:
        return CpuAffinity(rank_cpu_block(cores, node_gpu, node_gpu_count),
                           f"GPU {node_gpu} of the host's {node_gpu_count}: {len(cores)} physical cores in one "
                           "contiguous block per GPU")
    if local_world_size <= 1:
        return CpuAffinity((), "one local rank: the OS schedules its threads")
    return CpuAffinity(rank_cpu_block(cores, local_rank, local_world_size),
                       f"local rank {local_rank} of {local_world_size}: {len(cores)} physical cores in contiguous "
                       "blocks")


def bind_process(cpus: Iterable[int]) -> None:
    """Bind every thread this process has now (``/proc/self/task``), and so every one it starts later, to ``cpus``."""
    cpus = set(cpus)
    os.sched_setaffinity(0, cpus)
    for task in Path("/proc/self/task").iterdir() if Path("/proc/self/task").is_dir() else ():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass


def apply_cpu_affinity(setting: str) -> CpuAffinity:
    """Choose this rank's CPUs (``choose_cpu_affinity``; ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` from torchrun, the
    host GPU from ``CUDA_VISIBLE_DEVICES``) and bind the process to them; call it before the model, the engine or
    torch's thread pool start."""
    if not hasattr(os, "sched_setaffinity"):
        return CpuAffinity((), "this platform has no sched_setaffinity")
    rank, ranks = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    node_gpu = count = None
    if setting == "node":
        node_gpu = node_gpus_of_local_ranks(ranks, os.environ.get("CUDA_VISIBLE_DEVICES"))[rank]
        count = host_gpu_count()
    choice = choose_cpu_affinity(setting, rank, ranks, os.sched_getaffinity(0), node_gpu=node_gpu,
                                 node_gpu_count=count)
    if choice.cpus:
        bind_process(choice.cpus)
        log.info("cpu affinity: %s (%s)", choice.cpu_list, choice.reason)
    return choice


def server_cpu_affinity(gpus: list[int] | None) -> CpuAffinity:
    """A rollout server's share of the host (``launch server --cpu-affinity node``): the blocks of its host GPUs
    (``choose_cpu_affinity`` with ``node``, one block per GPU of the host, joined), not bound when the host's GPU
    count is unknown or it has one GPU."""
    allowed = os.sched_getaffinity(0)
    count = host_gpu_count()
    blocks: set[int] = set()
    for g in gpus or [0]:
        blocks.update(choose_cpu_affinity("node", 0, 1, allowed, node_gpu=g, node_gpu_count=count).cpus)
    if not blocks:
        return CpuAffinity((), f"not bound: the host's GPU count is {count}")
    return CpuAffinity(tuple(sorted(blocks)), f"GPU(s) {','.join(map(str, gpus or [0]))} of the host's {count}")


#: how the OpenMP runtime's idle threads wait; read once, when torch loads the runtime
OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass(frozen=True)
class OmpWaitPolicy:
    """``policy``: the ``OMP_WAIT_POLICY`` the process runs with (None: the OpenMP runtime's default);
    ``reason``: where it came from."""

    policy: str | None
    reason: str


def choose_omp_wait_policy(environ: Mapping[str, str], gpus: int | None, torch_loaded: bool) -> OmpWaitPolicy:
    """``PASSIVE`` on a host with GPUs (``gpus``: ``host_gpu_count``) when neither of ``OMP_WAIT_VARS`` is set and
    torch has not loaded the runtime yet; a variable the environment sets always wins."""
    for var in OMP_WAIT_VARS:
        if environ.get(var, "").strip():
            return OmpWaitPolicy(environ.get("OMP_WAIT_POLICY", "").strip() or None,
                                 f"{var}={environ[var].strip()} from the environment (python -m trainer sets "
                                 "OMP_WAIT_POLICY=PASSIVE on a GPU host where neither is set)")
    if not gpus:
        return OmpWaitPolicy(None, "no GPU on this host: the OpenMP runtime's default (the training is the host's "
                                   "tensor work)")
    if torch_loaded:
        return OmpWaitPolicy(None, "torch loaded the OpenMP runtime before python -m trainer could set "
                                   "OMP_WAIT_POLICY: the runtime's default")
    return OmpWaitPolicy("PASSIVE", f"a host with {gpus} GPU(s): idle OpenMP threads sleep instead of spinning on "
                                    "the cores the engine and the image thread need")


def apply_omp_wait_policy() -> OmpWaitPolicy:
    """Choose (``choose_omp_wait_policy``) and export ``OMP_WAIT_POLICY`` for this process and those it starts; call
    it before anything imports torch (``python -m trainer`` does)."""
    choice = choose_omp_wait_policy(os.environ, host_gpu_count(), "torch" in sys.modules)
    if choice.policy is not None and not os.environ.get("OMP_WAIT_POLICY", "").strip():
        os.environ["OMP_WAIT_POLICY"] = choice.policy
    return choice


def omp_wait_policy_in_effect() -> OmpWaitPolicy:
    """What this process's OpenMP runtime waits with, once torch has loaded it (the ``setup`` row's record)."""
    return choose_omp_wait_policy(os.environ, host_gpu_count(), torch_loaded=True)


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


def physical_cores_of(cpus: Iterable[int], sysfs_cpu: Path = SYSFS_CPU) -> int | None:
    """Distinct physical cores among the logical ``cpus`` (``physical_core_groups``); None without the topology."""
    groups = physical_core_groups(cpus, sysfs_cpu)
    return len(groups) if groups else None


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


def apply_cpu_threads(setting: int | str, bound: bool = False, cuda: bool | None = None) -> CpuThreads:
    """Choose this rank's count (``choose_cpu_threads``; ``LOCAL_WORLD_SIZE`` from torchrun; ``bound``: after
    ``apply_cpu_affinity`` bound it; ``cuda``: whether torch sees a CUDA GPU, asked when None), set it on torch
    and, unless it is torch's default, in ``OMP_NUM_THREADS`` (for processes this one starts); return it, with
    ``threads`` read back from torch."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = usable_physical_cores()
    quota = cgroup_cpu_limit()
    if bound and quota is not None:  # the container's quota is every rank's together
        cores = max(1, min(cores, quota // max(1, ranks)))
    choice = choose_cpu_threads(setting, ranks, cores, os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads(),
                                bound, cuda)
    if choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    if choice.reason != TORCH_DEFAULT:
        os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    applied = CpuThreads(torch.get_num_threads(), choice.reason)
    log.info("cpu threads per rank: %d (%s)", applied.threads, applied.reason)
    return applied
