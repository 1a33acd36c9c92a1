"""Deterministic segment selection for one packed row (carry-only post-rollout packing).

Rules (``specs/stage2.md``): Σlen ≤ capacity; the oldest segment is always included (no starvation); a
constant-volume binpacking candidate constrained to include the oldest is taken only when its total beats the
FIFO-greedy baseline; ties prefer fewer segments, then the smallest index set; the result is in insertion order.
"""

from __future__ import annotations

from collections.abc import Sequence

import binpacking


class SegmentTooLongError(ValueError):
    """A single segment exceeds ``packing_length``; it can never be packed."""


def fifo_greedy(lengths: Sequence[int], capacity: int) -> list[int]:
    chosen, total = [], 0
    for i, n in enumerate(lengths):
        if total + n <= capacity:
            chosen.append(i)
            total += n
    return chosen


def _key(indices: Sequence[int], lengths: Sequence[int]) -> tuple[int, int, tuple[int, ...]]:
    return (-sum(lengths[i] for i in indices), len(indices), tuple(sorted(indices)))


def select_segments(lengths: Sequence[int], capacity: int) -> list[int]:
    """Indices (into ``lengths``, insertion order) of the segments to pack now; empty iff ``lengths`` is."""
    if not lengths:
        return []
    for i, n in enumerate(lengths):
        if n > capacity:
            raise SegmentTooLongError(f"segment {i} has {n} tokens > packing_length {capacity}")
        if n <= 0:
            raise ValueError(f"segment {i} has non-positive length {n}")
    baseline = fifo_greedy(lengths, capacity)
    rest = {i: lengths[i] for i in range(1, len(lengths))}
    room = capacity - lengths[0]
    best = baseline
    if rest and room > 0:
        fitting = {i: n for i, n in rest.items() if n <= room}
        if fitting:
            bins = binpacking.to_constant_volume(dict(sorted(fitting.items())), room)
            for b in bins:
                candidate = [0, *sorted(b)]
                if sum(lengths[i] for i in candidate) > sum(lengths[i] for i in best) or (
                    sum(lengths[i] for i in candidate) == sum(lengths[i] for i in best)
                    and _key(candidate, lengths) < _key(best, lengths)
                ):
                    best = candidate
    return sorted(best)
