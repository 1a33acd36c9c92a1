"""Rank-local FIFO carry buffer of post-rollout segments; a whole optimizer step's rows per ``pop_rows``
(``trainer.packing.step_rows``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.matching.targets import TrainTarget
from trainer.packing.step_rows import plan_step_rows, rows_needed

log = logging.getLogger(__name__)


class PackingBufferFull(RuntimeError):
    """More segments are waiting than ``training.packing_buffer`` allows."""


@dataclass(frozen=True)
class PackStats:
    """``capacity``: the tokens the popped rows can hold (rows x packing_length)."""

    segments: int
    tokens: int
    capacity: int
    carried: int
    rows: int

    @property
    def fill(self) -> float:
        return self.tokens / self.capacity


class PackingBuffer:
    """Segments wait here until packed; a segment is never split and never trained twice.

    ``add`` fails fast for a segment longer than ``capacity`` (naming the sample) or when the buffer would
    exceed ``max_segments``; ``pop_rows`` returns the step's rows (targets in insertion order) and keeps the rest.
    """

    def __init__(self, capacity: int, max_segments: int, min_fill_ratio: float = 0.0):
        self.capacity = capacity
        self.max_segments = max_segments
        self.min_fill_ratio = min_fill_ratio
        self.segments: list[TrainTarget] = []
        self.low_fill_packs = 0

    def __len__(self) -> int:
        return len(self.segments)

    def add(self, targets: Sequence[TrainTarget]) -> None:
        for t in targets:
            if t.length > self.capacity:
                raise ValueError(
                    f"sample {t.sample_id!r}: Y_train has {t.length} tokens > training.packing_length "
                    f"{self.capacity}; raise packing_length, lower decoding.max_new_tokens, or shorten prompts"
                )
        if len(self.segments) + len(targets) > self.max_segments:
            raise PackingBufferFull(
                f"packing buffer would hold {len(self.segments) + len(targets)} segments > training.packing_buffer "
                f"{self.max_segments}; lower training.records_per_step (raw samples per optimizer step), raise "
                "training.packing_length, or raise packing_buffer"
            )
        self.segments.extend(targets)

    def rows_needed(self) -> int:
        """Rows ``pop_rows`` makes from what waits now when no other rank needs more (0 when empty)."""
        return rows_needed([t.length for t in self.segments], self.capacity)

    def pop_rows(self, min_rows: int = 1) -> tuple[list[list[TrainTarget]], PackStats]:
        """One optimizer step's rows: at least ``min_rows`` while segments last, and every whole row's worth; the rest
        (less than one row) stays. Rows in the order made, each in insertion order."""
        plan = plan_step_rows([t.length for t in self.segments], self.capacity, min_rows)
        rows = [[self.segments[i] for i in row] for row in plan.rows]
        self.segments = [self.segments[i] for i in plan.carried]
        tokens = sum(t.length for row in rows for t in row)
        stats = PackStats(sum(len(r) for r in rows), tokens, self.capacity * max(len(rows), 1), len(self.segments),
                          len(rows))
        for row in rows:
            fill = sum(t.length for t in row) / self.capacity
            if fill < self.min_fill_ratio:
                self.low_fill_packs += 1
                log.warning("packed row fill %.2f < training.packing_min_fill_ratio %.2f (%d segments, %d carried)",
                            fill, self.min_fill_ratio, len(row), stats.carried)
        return rows, stats
