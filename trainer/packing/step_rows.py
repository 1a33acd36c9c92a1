"""One optimizer step's training rows: every segment the step's rollouts produced, packed into as many rows as it
needs (carry-only post-rollout packing, ``specs/stage2.md``).

``plan_step_rows`` pops rows with ``select_segments`` (the oldest segment is always in the next row; a segment is
never split) while fewer than ``min_rows`` rows were made or the segments still waiting fill at least one whole row.
What is left (less than one row's tokens) is carried to the next step. ``min_rows`` is how data-parallel ranks agree
on one row count: each rank asks for the largest count any rank needs, and a rank that runs out of segments before
that gets no row for the missing ones (the caller runs a zero-weight micro-batch there, so every rank makes the same
number of backward passes).

``step_denominators`` is the loss normalisation of a step trained as several micro-batches: CE and coord terms are
summed per micro-batch and divided by the step's totals, so the step's loss and gradient equal those of one row
holding every segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainer.packing.select import select_segments


@dataclass(frozen=True)
class StepRows:
    """``rows``: indices into the input lengths, one list per row, each in insertion order; ``carried``: the indices
    left for the next step, in insertion order."""

    rows: list[list[int]]
    carried: list[int]


def plan_step_rows(lengths: Sequence[int], capacity: int, min_rows: int = 1) -> StepRows:
    """Rows for one step (see the module docstring). Invariants: every index is in exactly one row or in
    ``carried``; each row's total is ``<= capacity``; ``sum(carried) < capacity`` unless ``len(rows) < min_rows``
    could not be met (then ``carried`` is empty)."""
    if min_rows < 0:
        raise ValueError(f"min_rows must be >= 0, got {min_rows}")
    waiting = list(range(len(lengths)))
    rows: list[list[int]] = []
    while waiting and (len(rows) < min_rows or sum(lengths[i] for i in waiting) >= capacity):
        picked = select_segments([lengths[i] for i in waiting], capacity)
        row = [waiting[j] for j in picked]
        rows.append(row)
        taken = set(row)
        waiting = [i for i in waiting if i not in taken]
    return StepRows(rows, waiting)


def rows_needed(lengths: Sequence[int], capacity: int) -> int:
    """How many rows ``plan_step_rows`` makes for ``lengths`` with ``min_rows=1`` (what a rank asks its peers for)."""
    return len(plan_step_rows(lengths, capacity, 1).rows) if lengths else 0


def chunk_rows(n: int, rows_per_chunk: int) -> list[list[int]]:
    """The padded layout's micro-batches: ``range(n)`` in consecutive chunks of ``rows_per_chunk``."""
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    return [list(range(s, min(s + rows_per_chunk, n))) for s in range(0, n, rows_per_chunk)]


@dataclass(frozen=True)
class StepDenominators:
    """The step's CE label count and coord slot count (each at least 1, so an empty term stays 0)."""

    ce: int
    coord: int


def step_denominators(ce_counts: Sequence[int], coord_counts: Sequence[int]) -> StepDenominators:
    return StepDenominators(max(sum(ce_counts), 1), max(sum(coord_counts), 1))
