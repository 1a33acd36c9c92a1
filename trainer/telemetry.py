"""Rank-local timers, counters and run metadata; metrics go to JSONL and TensorBoard via the trainer's log."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


class PhaseTimers:
    """Accumulates wall-clock seconds per named phase (rollout, generate, parse, match, target, forward, ...)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


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


def gpu_memory_snapshot() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    return {
        "gpu_mem_allocated_gib": torch.cuda.memory_allocated() / 2**30,
        "gpu_mem_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


class JsonlWriter:
    """Append-only JSONL metrics file (one object per log call)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True, default=float) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
