"""Per-phase peak memory (``mem/<phase>_peak_gib``): the device's peak counter is reset at every phase boundary, so
each phase's peak is its own, nested phases count for the phases around them, and the overall peak survives the
resets. A fake probe stands in for CUDA's counters, so the bookkeeping is shown without a GPU."""

from __future__ import annotations

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
