"""Rollout buffering (E-step / M-steps) and the dataloader repeater that keeps every sample trained.

With ``m_steps = m`` and ``gradient_accumulation_steps = g``: the raw micro-batches arrive in windows of ``g``;
each *full* window is yielded ``m`` times in a row (``repeat_windows``). The first pass over a window is the
E-step (rollout + match + encode + pack, cached per micro-batch position); the next ``m - 1`` passes are M-steps
that replay copies of the cached prepared batches — no rollouts, no repacking. A final partial window is not
repeated. Staleness (optimizer steps since the rollouts were generated) is at most ``m - 1``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def repeat_windows(batches: Iterable[T], window: int, m_steps: int) -> Iterator[T]:
    """Yield each full window of ``window`` items ``m_steps`` times; a trailing partial window once."""
    if window < 1 or m_steps < 1:
        raise ValueError("window and m_steps must be >= 1")
    buf: list[T] = []
    for b in batches:
        buf.append(b)
        if len(buf) == window:
            for _ in range(m_steps):
                yield from buf
            buf = []
    yield from buf


def repeated_length(n_batches: int, window: int, m_steps: int) -> int:
    full, rest = divmod(n_batches, window)
    return full * window * m_steps + rest


class StaleBufferError(RuntimeError):
    """An M-step received raw samples that differ from the E-step's (the repeater is not in place)."""


@dataclass
class _Entry:
    fingerprint: tuple[str, ...]
    prepared: Any


class RolloutBuffer:
    """Caches prepared micro-batches on E-steps and replays them on M-steps (positions inside a window)."""

    def __init__(self, window: int, m_steps: int):
        self.window = window
        self.m_steps = m_steps
        self.micro_step = 0
        self.cache: dict[int, _Entry] = {}
        self.e_steps = 0
        self.m_replays = 0

    @property
    def position(self) -> tuple[int, int]:
        """(pass within the window cycle, micro-batch index within the window) for the next call."""
        return (self.micro_step // self.window) % self.m_steps, self.micro_step % self.window

    def prepare(self, sample_ids: Sequence[str], make: Callable[[], Any]) -> tuple[Any, bool, int]:
        """Prepared batch, whether it is fresh (E-step), and its staleness in optimizer steps."""
        cycle, slot = self.position
        self.micro_step += 1
        fp = tuple(sample_ids)
        if cycle == 0 or slot not in self.cache:
            prepared = make()
            self.cache[slot] = _Entry(fp, copy.deepcopy(prepared))
            self.e_steps += cycle == 0
            return prepared, True, 0
        entry = self.cache[slot]
        if entry.fingerprint != fp:
            raise StaleBufferError(
                f"M-step {cycle} of window slot {slot} got samples {list(fp)[:4]}… but the E-step rolled out "
                f"{list(entry.fingerprint)[:4]}…; the dataloader must repeat each accumulation window m_steps times"
            )
        self.m_replays += 1
        return copy.deepcopy(entry.prepared), False, cycle


class RepeatingLoader:
    """Wraps a dataloader so that ``iter`` goes through ``repeat_windows``; other attributes pass through."""

    def __init__(self, loader: Any, window: int, m_steps: int, skip_first: int = 0):
        self.loader = loader
        self.window = window
        self.m_steps = m_steps
        self.skip_first = skip_first

    def __iter__(self) -> Iterator[Any]:
        """Repeated stream; on resume the first ``skip_first`` repeated items (already trained) are dropped once."""
        skip, self.skip_first = self.skip_first, 0
        return itertools.islice(repeat_windows(self.loader, self.window, self.m_steps), skip, None)

    def __len__(self) -> int:
        return repeated_length(len(self.loader), self.window, self.m_steps)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
