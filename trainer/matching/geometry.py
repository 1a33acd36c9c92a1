"""Geometry in norm1000 space: rasterised masks on a virtual R×R canvas, mask IoU, box IoU."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from trainer.data.objects import NUM_BINS, DetObject


def rasterize(obj: DetObject, resolution: int = 256) -> np.ndarray:
    """Boolean R×R mask of the object's ring (bbox = its 4 corners); coords clamped to [0, 999]."""
    scale = resolution / NUM_BINS
    pts = [(min(max(x, 0), NUM_BINS - 1) * scale, min(max(y, 0), NUM_BINS - 1) * scale) for x, y in obj.points()]
    canvas = Image.new("1", (resolution, resolution), 0)
    ImageDraw.Draw(canvas).polygon(pts, fill=1, outline=1)
    return np.asarray(canvas, dtype=bool)


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    if union == 0:
        return 0.0
    return float(np.logical_and(a, b).sum() / union)


def box_iou(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    area = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / area if area > 0 else 0.0


def centre_distance(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    return float(np.hypot((a[0] + a[2] - b[0] - b[2]) / 2, (a[1] + a[3] - b[1] - b[3]) / 2))
