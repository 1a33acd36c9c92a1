"""Rank-local timers, counters and run metadata; metrics go to JSONL (mirrored to W&B / MLflow: ``mirror_rows``) and
TensorBoard via the trainer's log."""

from __future__ import annotations

import gc
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch


class CudaPeakMemory:
    """torch.cuda's allocated-bytes counters (the caching allocator's, vLLM's sleep-mode pool included)."""

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated()

    def current(self) -> int:
        return torch.cuda.memory_allocated()

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats()


class PhaseTimers:
    """Accumulates wall-clock seconds per named phase (rollout, generate, parse, match, target, forward, ...), and,
    with a memory probe (CUDA's by default on a GPU), the peak allocated bytes inside each phase.

    Peaks: the device's peak counter is read and reset at every phase boundary; what it read is folded into every
    phase open at that moment, so a nested phase's peak also counts for the phases around it, and ``peak_bytes``
    holds, per phase, the maximum over its runs since the last ``pop_peaks``. ``overall_peak`` is the maximum since
    the timers were made (the counter the boundaries reset)."""

    def __init__(self, memory: Any | None = None, track_memory: bool = True) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.memory = None if not track_memory else (
            memory if memory is not None else (CudaPeakMemory() if torch.cuda.is_available() else None))
        self.peak_bytes: dict[str, int] = {}
        self.overall_peak = 0
        self._open: list[list[Any]] = []
        #: the innermost phase a ``torch.OutOfMemoryError`` left (None: none did since it was last cleared)
        self.out_of_memory_in: str | None = None
        #: event-timed phases not yet counted: (name, start event, end event)
        self._pending: list[tuple[str, Any, Any]] = []

    @classmethod
    def time_only(cls) -> PhaseTimers:
        """Timers that never touch the device's peak-memory counter (for work on another thread, whose resets
        would cut the step's own peaks)."""
        return cls(track_memory=False)

    def _boundary(self) -> int:
        seen = self.memory.peak()
        for entry in self._open:
            entry[1] = max(entry[1], seen)
        self.overall_peak = max(self.overall_peak, seen)
        self.memory.reset()
        return seen

    @contextmanager
    def track_peak(self, name: str) -> Iterator[None]:
        """Peak allocated bytes of the block, kept under ``name`` (no time recorded)."""
        if self.memory is None:
            yield
            return
        self._boundary()
        entry = [name, self.memory.current()]
        self._open.append(entry)
        try:
            yield
        finally:
            self._boundary()
            self._open.remove(entry)
            self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), entry[1])

    def record_peak(self, name: str) -> None:
        """Keep the peak since the last boundary under ``name`` (what ran since the last phase ended)."""
        if self.memory is not None:
            seen = self._boundary()
            self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), seen)

    @contextmanager
    def phase(self, name: str, device_time: str = "wall") -> Iterator[None]:
        """Time the block under ``name``. ``device_time`` for blocks that launch GPU work (CPU runs time the wall in
        every mode): ``wall``, the host's time in the block; ``sync``, the device is synchronized before the block
        ends, so its kernels' time is in it (the host waits there); ``events``, CUDA events recorded on the current
        stream around the block, their elapsed time counted at ``settle()`` (the device's time from where it reached
        the block to where it finished it, with no host wait inside the block)."""
        if device_time not in ("wall", "sync", "events"):
            raise ValueError(f"device_time must be wall, sync or events, got {device_time!r}")
        events = device_time == "events" and torch.cuda.is_available()
        start = time.perf_counter()
        pair = None
        if events:
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            pair[0].record()
        try:
            with self.track_peak(name):
                yield
                if device_time == "sync" and torch.cuda.is_available():
                    torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            if self.out_of_memory_in is None:  # the innermost phase it passed through
                self.out_of_memory_in = name
            raise
        finally:
            if pair is None:
                self.seconds[name] += time.perf_counter() - start
            else:
                pair[1].record()
                self._pending.append((name, *pair))

    def settle(self) -> None:
        """Wait for the device to finish everything queued (on a GPU: one host wait, however many blocks were timed)
        and add the event-timed phases' (``phase(device_time="events")``) device time to ``seconds``."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for name, begin, end in self._pending:
            self.seconds[name] += begin.elapsed_time(end) / 1000.0
        self._pending.clear()

    def discard_pending(self) -> None:
        """Forget event-timed phases not yet settled (a step that failed before ``settle``)."""
        self._pending.clear()

    @contextmanager
    def bound(self) -> Iterator[PhaseTimers]:
        """Make these the timers ``telemetry.phase`` records into, for the enclosed block (this thread / context
        only: work handed to other threads is not timed into the step)."""
        token = _BOUND.set(self)
        try:
            yield self
        finally:
            _BOUND.reset(token)

    def pop(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out

    def pop_peaks(self) -> dict[str, int]:
        out = dict(self.peak_bytes)
        self.peak_bytes.clear()
        return out


_BOUND: ContextVar[PhaseTimers | None] = ContextVar("rollout_matching_phase_timers", default=None)


@contextmanager
def phase(name: str, device_work: bool = False) -> Iterator[None]:
    """A sub-phase of whatever step the calling code runs in: recorded as ``time/<name>_s`` (and its peak memory as
    ``mem/<name>_peak_gib``) by the timers bound with ``PhaseTimers.bound``; nothing at all when none are bound
    (engines used outside the trainer). ``device_work``: the block launches GPU kernels whose time belongs to it,
    so the device is synchronized before the phase closes (only while timers are bound)."""
    timers = _BOUND.get()
    if timers is None:
        yield
        return
    with timers.phase(name):
        yield
        if device_work and torch.cuda.is_available():
            torch.cuda.synchronize()


class Counters:
    def __init__(self) -> None:
        self.values: dict[str, float] = defaultdict(float)

    def add(self, stats: dict[str, float]) -> None:
        for k, v in stats.items():
            self.values[k] += v

    def pop(self) -> dict[str, float]:
        out = dict(self.values)
        self.values.clear()
        return out


def gpu_memory_snapshot(timers: PhaseTimers | None = None) -> dict[str, float]:
    """GiB of the current CUDA device: torch's allocator (allocated now, its peak, reserved now) and the driver's view
    (``gpu_mem_device_used_gib``: total less free, every process and every allocator, a sleeping vLLM's mapped memory
    included and its unmapped pool not). torch counts a sleeping engine's pool as allocated whether or not it is mapped,
    so only the driver's figure says how full the card is; read at the end of a step, the reserved figure still holds
    the blocks the backward left in torch's cache. ``timers``: their boundaries reset CUDA's peak counter, so theirs is
    folded in."""
    if not torch.cuda.is_available():
        return {}
    peak = max(torch.cuda.max_memory_allocated(), timers.overall_peak if timers is not None else 0)
    free, total = torch.cuda.mem_get_info()
    return {
        "gpu_mem_allocated_gib": torch.cuda.memory_allocated() / 2**30,
        "gpu_mem_peak_gib": peak / 2**30,
        "gpu_mem_reserved_gib": torch.cuda.memory_reserved() / 2**30,
        "gpu_mem_device_used_gib": (total - free) / 2**30,
    }


#: what places a metrics row (not a metric): its phase, optimizer step and Unix time
ROW_FIELDS = ("phase", "step", "time")
#: the loggers each metrics file is mirrored to (``mirror_rows``), by the file's resolved path
_MIRRORS: dict[Path, list[Any]] = {}


def metric_values(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's metrics: its numbers (what ``JsonlWriter`` writes as a number: a float or int, a numpy or
    one-element torch scalar; booleans, text, lists and None are not), ``ROW_FIELDS`` left out."""
    out = {}
    for k, v in row.items():
        if k in ROW_FIELDS or v is None or isinstance(v, (bool, str, list, tuple, dict)):
            continue
        if isinstance(v, (int, float)) or hasattr(v, "__float__"):
            out[k] = float(v)
    return out


@contextmanager
def mirror_rows(path: str | Path, loggers: list[Any]) -> Iterator[None]:
    """Within the block, every row any ``JsonlWriter`` appends to ``path`` is also handed to each logger's
    ``log_row(row)`` (``trainer.loggers``: W&B, MLflow), the same dict, after it is written: the loggers see the
    file's rows, names and all, whichever part of the run wrote them."""
    key = Path(path).resolve()
    _MIRRORS.setdefault(key, []).extend(loggers)
    try:
        yield
    finally:
        mirrored = _MIRRORS.get(key, [])
        for logger in loggers:
            if logger in mirrored:
                mirrored.remove(logger)
        if not mirrored:
            _MIRRORS.pop(key, None)


class JsonlWriter:
    """Append-only JSONL metrics file (one object per log call), mirrored to the loggers ``mirror_rows`` names."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._key = self.path.resolve()

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True, default=float) + "\n")
        for logger in _MIRRORS.get(self._key, ()):
            logger.log_row(record)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


class GcClock:
    """Python's garbage collector, seen from its callbacks: seconds paused in collections and their count (all,
    and of the oldest generation) since the last ``pop``. Collections run inside whatever phase allocated; these
    overlap the phases, they are not one of them. Counting from ``open`` to ``close`` (the callback's lifetime)."""

    def __init__(self):
        self._started: float | None = None
        self.seconds = 0.0
        self.collections = 0
        self.oldest = 0

    def open(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, event: str, info: dict[str, Any]) -> None:
        if event == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None
            self.collections += 1
            self.oldest += int(info.get("generation") == 2)

    def pop(self) -> dict[str, float]:
        out = {"gc/pause_s": self.seconds, "gc/collections": float(self.collections),
               "gc/gen2_collections": float(self.oldest)}
        self.seconds, self.collections, self.oldest = 0.0, 0, 0
        return out

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


class StepClock:
    """Per optimizer step: ``optimizer_s`` (the last ``training_step``'s end to ``on_step_end``: clipping,
    ``optimizer.step()``, the scheduler, ``zero_grad``) and ``step_wall_s`` (one ``on_step_end`` to the next, the first
    from ``on_train_begin``), host time at the callbacks (no device synchronisation there); the same clock times our
    trainer and TRL's (``trainer.bench.trl_peer``). ``clock`` is injectable (tests)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.optimizer_s: list[float] = []
        self.step_wall_s: list[float] = []
        self._last_step_end: float | None = None
        self._training_step_end: float | None = None

    def train_begin(self) -> None:
        self._last_step_end = self.clock()

    def training_step_end(self) -> None:
        """Called as ``training_step`` returns (each micro-batch's; the last one before the optimizer counts)."""
        self._training_step_end = self.clock()

    def step_end(self) -> tuple[float | None, float | None]:
        """This step's ``(optimizer_s, step_wall_s)``, each None when its start was not seen."""
        now = self.clock()
        optimizer = wall = None
        if self._training_step_end is not None:
            optimizer = now - self._training_step_end
            self.optimizer_s.append(optimizer)
            self._training_step_end = None
        if self._last_step_end is not None:
            wall = now - self._last_step_end
            self.step_wall_s.append(wall)
        self._last_step_end = now
        return optimizer, wall


def step_clock_callback(clock: StepClock, on_step_end=None):
    """A ``TrainerCallback`` that drives ``clock``; ``on_step_end(optimizer_s, step_wall_s)`` runs after it ticked."""
    from transformers import TrainerCallback

    class _Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.train_begin()

        def on_step_end(self, args, state, control, **kwargs):
            ticked = clock.step_end()
            if on_step_end is not None:
                on_step_end(*ticked)

    return _Clock()


def install_step_clock(trainer: Any, clock: StepClock, on_step_end=None) -> None:
    """Put ``clock``'s callback first in ``trainer``'s callbacks, so work other callbacks do at a step's end
    (a periodic evaluation) counts in the next ``step_wall_s``, never in ``optimizer_s``."""
    trainer.callback_handler.callbacks.insert(0, step_clock_callback(clock, on_step_end))
