"""``matching.targets.overlaps_any`` (which tokens of an FN append fall in a ``desc`` value) equals the per-span scan
it replaced, on random token ranges and disjoint spans in text order (empty spans and zero-width tokens included)."""

from __future__ import annotations

import random

from trainer.matching.targets import overlaps_any


def _scan(offsets, spans):
    return [any(a < e and b > s for s, e in spans) for a, b in offsets]


def test_equals_the_scan_of_every_span():
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(200), 2 * rng.randrange(0, 12)))
        spans = [(cuts[i], cuts[i + 1] - rng.randrange(0, 2) * (cuts[i + 1] - cuts[i])) for i in range(0, len(cuts), 2)]
        offsets = []
        at = 0
        while at < 210:
            width = rng.randrange(0, 6)
            offsets.append((at, at + width) if rng.random() > 0.05 else (0, 0))
            at += max(width, 1)
        assert overlaps_any(offsets, spans) == _scan(offsets, spans), (offsets, spans)
