"""Per-phase peak memory (``mem/<phase>_peak_gib``): the device's peak counter is reset at every phase boundary, so
each phase's peak is its own, nested phases count for the phases around them, and the overall peak survives the
resets. A fake probe stands in for CUDA's counters, so the bookkeeping is shown without a GPU."""

from __future__ import annotations

import torch

from trainer.telemetry import PhaseTimers


class FakeMemory:
    def __init__(self) -> None:
        self.now = 0
        self.top = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.top = max(self.top, self.now)

    def free(self, n: int) -> None:
        self.now -= n

    def peak(self) -> int:
        return self.top

    def current(self) -> int:
        return self.now

    def reset(self) -> None:
        self.top = self.now


def test_each_phase_keeps_its_own_peak_and_nested_peaks_count_for_the_outer_phase():
    mem = FakeMemory()
    timers = PhaseTimers(memory=mem)
    mem.alloc(100)  # before any phase: the overall peak only
    mem.free(100)
    with timers.track_peak("step"):
        with timers.phase("rollout"):
            mem.alloc(50)
            with timers.phase("generate"):
                mem.alloc(30)  # 80 inside generate
                mem.free(30)
            mem.free(50)
        with timers.phase("forward"):
            mem.alloc(20)  # activations kept for backward
        mem.alloc(40)  # backward: 60
        mem.free(60)
        timers.record_peak("backward")
    peaks = timers.pop_peaks()
    assert peaks == {"generate": 80, "rollout": 80, "forward": 20, "backward": 60, "step": 80}
    assert timers.overall_peak == 100
    assert timers.pop_peaks() == {} and set(timers.pop()) == {"rollout", "generate", "forward"}


def test_a_phase_keeps_the_maximum_over_its_runs_and_without_a_probe_nothing_is_recorded():
    mem = FakeMemory()
    timers = PhaseTimers(memory=mem)
    for n in (10, 70, 30):
        with timers.phase("forward"):
            mem.alloc(n)
            mem.free(n)
    assert timers.pop_peaks() == {"forward": 70}
    cpu = PhaseTimers(memory=None)
    cpu.memory = None
    with cpu.phase("forward"):
        cpu.record_peak("backward")
    assert cpu.pop_peaks() == {} and "forward" in cpu.pop()


def test_the_snapshot_gives_torch_s_counts_and_the_driver_s(monkeypatch):
    """``gpu_memory_snapshot``: torch's allocated / peak / reserved beside the driver's used memory (total less free),
    which is the only one that sees what a sleeping engine has unmapped; nothing without CUDA."""
    from trainer.telemetry import gpu_memory_snapshot

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_memory_snapshot() == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 70 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 45 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 72 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (30 * gib, 80 * gib))
    assert gpu_memory_snapshot() == {"gpu_mem_allocated_gib": 45.0, "gpu_mem_peak_gib": 70.0,
                                     "gpu_mem_reserved_gib": 72.0, "gpu_mem_device_used_gib": 50.0}
