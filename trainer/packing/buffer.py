"""Rank-local FIFO carry buffer of post-rollout segments; one packed row per ``pop_pack``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.matching.targets import TrainTarget
from trainer.packing.select import select_segments

log = logging.getLogger(__name__)


class PackingBufferFull(RuntimeError):
    """More segments are waiting than ``training.packing_buffer`` allows."""


@dataclass(frozen=True)
class PackStats:
    segments: int
    tokens: int
    capacity: int
    carried: int

    @property
    def fill(self) -> float:
        return self.tokens / self.capacity


class PackingBuffer:
    """Segments wait here until packed; a segment is never split and never trained twice.

    ``add`` fails fast for a segment longer than ``capacity`` (naming the sample) or when the buffer would
    exceed ``max_segments``; ``pop_pack`` returns the selected targets in insertion order and keeps the rest.
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
                f"{self.max_segments}; lower per_device_train_batch_size (raw samples per step), raise "
                "training.packing_length, or raise packing_buffer"
            )
        self.segments.extend(targets)

    def pop_pack(self) -> tuple[list[TrainTarget], PackStats]:
        chosen = select_segments([t.length for t in self.segments], self.capacity)
        picked = [self.segments[i] for i in chosen]
        keep = set(chosen)
        self.segments = [t for i, t in enumerate(self.segments) if i not in keep]
        stats = PackStats(len(picked), sum(t.length for t in picked), self.capacity, len(self.segments))
        if picked and stats.fill < self.min_fill_ratio:
            self.low_fill_packs += 1
            log.warning("packed row fill %.2f < training.packing_min_fill_ratio %.2f (%d segments, %d carried)",
                        stats.fill, self.min_fill_ratio, stats.segments, stats.carried)
        return picked, stats
