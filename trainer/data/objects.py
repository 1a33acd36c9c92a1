"""Ground-truth and predicted objects in norm1000 space (integer bins 0..999 of the image width/height).

Conversion from pixels: ``bin = min(999, floor(x / size * 1000))`` (clamped at 0); back to pixels: the bin
centre ``(bin + 0.5) / 1000 * size``. Poly is one ring ``[x1, y1, x2, y2, ...]`` with ≥ 3 points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

NUM_BINS = 1000

GeometryKind = Literal["bbox_2d", "poly"]


def to_bin(value: float, size: float) -> int:
    """Pixel coordinate → norm1000 bin."""
    return max(0, min(NUM_BINS - 1, math.floor(value / size * NUM_BINS)))


def from_bin(k: int, size: float) -> float:
    """Norm1000 bin → pixel coordinate of the bin centre."""
    return (k + 0.5) / NUM_BINS * size


@dataclass(frozen=True)
class DetObject:
    """One object: a description and exactly one geometry (bbox_2d: 4 bins; poly: even count ≥ 6)."""

    desc: str
    kind: GeometryKind
    coords: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.desc:
            raise ValueError("desc must be a non-empty string")
        if self.kind == "bbox_2d" and len(self.coords) != 4:
            raise ValueError(f"bbox_2d needs 4 coords, got {len(self.coords)}")
        if self.kind == "poly" and (len(self.coords) < 6 or len(self.coords) % 2):
            raise ValueError(f"poly needs an even count >= 6 of coords, got {len(self.coords)}")
        if any((not isinstance(c, int)) or c < 0 or c >= NUM_BINS for c in self.coords):
            raise ValueError(f"coords must be integer bins in [0, {NUM_BINS - 1}], got {list(self.coords)}")

    def points(self) -> list[tuple[int, int]]:
        """Vertices: a bbox as its 4 corners (clockwise from top-left), a poly as its ring."""
        if self.kind == "bbox_2d":
            x1, y1, x2, y2 = self.coords
            return [(x1, y1), (x2, y1), (x2, y2), (x1, y2)]
        c = self.coords
        return [(c[i], c[i + 1]) for i in range(0, len(c), 2)]

    def bounds(self) -> tuple[int, int, int, int]:
        pts = self.points()
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        return min(xs), min(ys), max(xs), max(ys)
