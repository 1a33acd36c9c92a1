"""``telemetry.phase``: engines and the weight sync record sub-phases (``sync_collect``, ``sync_load``, ``sleep``, ...)
into the step's timers while the trainer has them bound, and record nothing at all outside (an engine used on its
own, a background thread)."""

from __future__ import annotations

import threading

import pytest

from tests.unit.test_phase_peaks import FakeMemory
from trainer import telemetry
from trainer.telemetry import PhaseTimers, phase


def test_unbound_phases_record_nothing_and_bound_ones_nest_in_the_step_s_timers():
    timers = PhaseTimers(memory=FakeMemory())
    with phase("sync_load"):
        pass
    assert timers.pop() == {}
    with timers.bound():
        with timers.phase("weight_sync"):
            with phase("sync_collect", device_work=True):  # no GPU here: the flag must not matter
                timers.memory.alloc(30)
            with phase("sync_load"):
                timers.memory.free(30)
    with phase("sync_load"):  # unbound again after the block
        pass
    seconds, peaks = timers.pop(), timers.pop_peaks()
    assert set(seconds) == {"weight_sync", "sync_collect", "sync_load"}
    assert seconds["sync_collect"] + seconds["sync_load"] <= seconds["weight_sync"]
    assert peaks["sync_collect"] == 30 and peaks["weight_sync"] == 30


def test_a_phase_that_raises_is_still_timed_and_the_binding_is_undone():
    timers = PhaseTimers(memory=None)
    try:
        with timers.bound(), phase("sync_check"):
            raise ValueError("refused")
    except ValueError:
        pass
    assert set(timers.pop()) == {"sync_check"}
    assert telemetry._BOUND.get() is None


def test_work_on_another_thread_is_not_timed_into_the_bound_step():
    timers = PhaseTimers(memory=None)
    with timers.bound():
        worker = threading.Thread(target=lambda: phase("generate").__enter__())
        worker.start()
        worker.join()
        with phase("sync_push"):
            pass
    assert set(timers.pop()) == {"sync_push"}


def test_two_timers_bound_in_turn_each_get_their_own_phases():
    outer, inner = PhaseTimers(memory=None), PhaseTimers(memory=None)
    with outer.bound():
        with inner.bound(), phase("sleep"):
            pass
        with phase("wake"):
            pass
    assert set(inner.pop()) == {"sleep"} and set(outer.pop()) == {"wake"}


def test_a_sleep_mode_engine_times_its_sleep_and_each_wake_under_its_own_name():
    from tests.unit.test_vllm_close_wakes import _engine

    calls: list = []
    engine = _engine(2, calls)
    timers = PhaseTimers(memory=None)
    with timers.bound():
        engine.sleep()
        engine.wake(("weights",), phase_name="sync_wake")  # what a weight load does
        engine.wake()  # what a decode does: only the KV cache still sleeps
        engine.wake()  # awake: nothing to wake, nothing timed
    assert set(timers.pop()) == {"sleep", "sync_wake", "wake"}
    assert calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))], calls


class _FakeEvent:
    """A CUDA event stand-in: ``record`` stamps the next time of a fake device clock."""

    clock = [0.0]
    waits: list[str] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at = None

    def record(self):
        _FakeEvent.clock[0] += 0.25
        self.at = _FakeEvent.clock[0]

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA's


def test_event_timed_phases_count_device_seconds_once_settled(monkeypatch):
    """``phase_timing: events``: the phase's seconds come from its events, not the host's wall, and only after
    ``settle``, which waits for the device once however many phases were timed; ``discard_pending`` forgets a failed
    step's events."""
    timers = PhaseTimers(memory=FakeMemory())
    monkeypatch.setattr(telemetry.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(telemetry.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(telemetry.torch.cuda, "synchronize", lambda: _FakeEvent.waits.append("device"))
    _FakeEvent.clock[0], _FakeEvent.waits[:] = 0.0, []
    for _ in range(3):
        with timers.phase("forward", device_time="events"):
            pass
    assert "forward" not in timers.seconds or timers.seconds["forward"] == 0.0
    timers.settle()
    assert _FakeEvent.waits == ["device"], "one wait for everything queued"
    assert timers.pop()["forward"] == pytest.approx(3 * 0.25)
    with timers.phase("forward", device_time="events"):
        pass
    timers.discard_pending()
    timers.settle()
    assert timers.pop() == {} and _FakeEvent.waits == ["device", "device"]
    with pytest.raises(ValueError, match="device_time"):
        with timers.phase("forward", device_time="later"):
            pass


def test_without_a_gpu_every_device_time_is_the_wall():
    timers = PhaseTimers(memory=FakeMemory())
    for mode in ("wall", "sync", "events"):
        with timers.phase(mode, device_time=mode):
            pass
    timers.settle()
    assert set(timers.pop()) == {"wall", "sync", "events"}
