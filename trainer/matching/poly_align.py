"""Coordinate targets for matched pairs whose geometries differ or are polygons.

Point sets (a bbox is its 4 corners) are aligned by an entropic optimal-transport plan (Sinkhorn, uniform
marginals, squared-distance cost in norm1000/1000 units) used as a stop-grad aligner; each predicted point's
target is the barycentric projection of the GT points under the plan. Targets are continuous bins; the coord
loss turns them into unimodal soft labels.
"""

from __future__ import annotations

import numpy as np

from trainer.data.objects import DetObject


def sinkhorn_plan(x: np.ndarray, y: np.ndarray, epsilon: float = 0.05, iters: int = 50) -> np.ndarray:
    """Entropic OT plan between point sets ``x`` (n×2) and ``y`` (m×2), uniform marginals (log domain)."""
    cost = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1) / (1000.0**2)
    n, m = cost.shape
    log_a = np.full(n, -np.log(n))
    log_b = np.full(m, -np.log(m))
    f = np.zeros(n)
    g = np.zeros(m)
    k = -cost / epsilon
    for _ in range(iters):
        f = log_a - _logsumexp(k + g[None, :], axis=1)
        g = log_b - _logsumexp(k + f[:, None], axis=0)
    return np.exp(k + f[:, None] + g[None, :])


def _logsumexp(a: np.ndarray, axis: int) -> np.ndarray:
    m = a.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(a - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def coord_targets(pred: DetObject, gt: DetObject, epsilon: float = 0.05, iters: int = 50) -> list[float]:
    """One continuous target bin per predicted coordinate (same order as ``pred.coords``)."""
    if pred.kind == "bbox_2d" and gt.kind == "bbox_2d":
        return [float(c) for c in gt.coords]
    x = np.asarray(pred.points(), dtype=float)
    y = np.asarray(gt.points(), dtype=float)
    plan = sinkhorn_plan(x, y, epsilon, iters)
    proj = (plan @ y) / plan.sum(axis=1, keepdims=True)
    proj = np.clip(proj, 0.0, 999.0)
    if pred.kind == "poly":
        return [float(v) for v in proj.reshape(-1)]
    return [
        float((proj[0, 0] + proj[3, 0]) / 2),
        float((proj[0, 1] + proj[1, 1]) / 2),
        float((proj[1, 0] + proj[2, 0]) / 2),
        float((proj[2, 1] + proj[3, 1]) / 2),
    ]
