"""Paired bootstrap intervals over held-out images for the difference of two runs' F1@0.5 and COCO AP.

Two evaluations of the same held-out images (``samples.jsonl`` rows, matched by ``sample_id``) are resampled
together: each draw picks images with replacement and scores both runs on that draw, so the interval is of the
difference on the same images. F1@0.5 comes from each image's (tp, fp, fn) as evaluated; AP is COCO box AP over
IoU 0.50:0.95 computed as pycocotools computes it for these predictions (every score 1.0, so detections rank in
image order; one category; ``maxDets`` 100; 101 recall points), with each image's per-threshold matches made once
and each draw only re-accumulating them (``ImageMatches``), which is what makes thousands of draws cheap.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.objects import DetObject

COCO_THRESHOLDS = np.round(np.linspace(0.5, 0.95, 10), 2)
RECALL_POINTS = np.linspace(0.0, 1.0, 101)
MAX_DETS = 100


@dataclass(frozen=True)
class ImageMatches:
    """One image: ``tp[t, d]`` whether detection ``d`` (in order, at most ``MAX_DETS``) matched at threshold ``t``;
    ``num_gt``; ``counts`` its (tp, fp, fn) at F1@0.5 as the evaluation recorded them."""

    tp: np.ndarray
    num_gt: int
    counts: tuple[int, int, int]


@dataclass(frozen=True)
class Interval:
    """A difference (A − B) on all images and its bootstrap percentile interval."""

    diff: float
    low: float
    high: float
    draws: int

    def to_json(self) -> dict[str, float]:
        return {"diff": self.diff, "low": self.low, "high": self.high, "draws": self.draws}


def _box(obj: DetObject) -> tuple[float, float, float, float]:
    x1, y1, x2, y2 = obj.bounds()
    return float(x1), float(y1), float(x2 - x1 + 1), float(y2 - y1 + 1)


def _iou(d: tuple[float, ...], g: tuple[float, ...]) -> float:
    w = min(d[0] + d[2], g[0] + g[2]) - max(d[0], g[0])
    h = min(d[1] + d[3], g[1] + g[3]) - max(d[1], g[1])
    inter = max(w, 0.0) * max(h, 0.0)
    union = d[2] * d[3] + g[2] * g[3] - inter
    return inter / union if union > 0 else 0.0


def image_matches(pred: Sequence[DetObject], gt: Sequence[DetObject], counts: tuple[int, int, int]) -> ImageMatches:
    """COCOeval's greedy matching of one image at every threshold: each detection in order takes the unmatched GT
    of highest IoU at or above the threshold."""
    dets = [_box(o) for o in pred[:MAX_DETS]]
    gts = [_box(o) for o in gt]
    ious = np.array([[_iou(d, g) for g in gts] for d in dets]).reshape(len(dets), len(gts))
    tp = np.zeros((len(COCO_THRESHOLDS), len(dets)), dtype=bool)
    for t, thr in enumerate(COCO_THRESHOLDS):
        taken = np.zeros(len(gts), dtype=bool)
        for d in range(len(dets)):
            best, match = min(float(thr), 1 - 1e-10), -1
            for g in range(len(gts)):
                if taken[g] or ious[d, g] < best:
                    continue
                best, match = ious[d, g], g
            if match >= 0:
                taken[match] = True
                tp[t, d] = True
    return ImageMatches(tp, len(gts), counts)


def coco_ap_of(images: Sequence[ImageMatches]) -> float:
    """COCO AP 0.50:0.95 of ``images`` in this order (duplicates count as distinct images)."""
    num_gt = sum(m.num_gt for m in images)
    if num_gt == 0:
        return float("nan")
    flags = np.concatenate([m.tp for m in images], axis=1) if images else np.zeros((len(COCO_THRESHOLDS), 0), bool)
    if flags.shape[1] == 0:
        return 0.0
    tps = np.cumsum(flags, axis=1, dtype=np.float64)
    fps = np.cumsum(~flags, axis=1, dtype=np.float64)
    out = []
    for t in range(flags.shape[0]):
        rc = tps[t] / num_gt
        pr = tps[t] / (tps[t] + fps[t] + np.spacing(1))
        pr = np.maximum.accumulate(pr[::-1])[::-1]
        idx = np.searchsorted(rc, RECALL_POINTS, side="left")
        q = np.where(idx < len(pr), pr[np.minimum(idx, len(pr) - 1)], 0.0)
        out.append(q.mean())
    return float(np.mean(out))


def f1_of(images: Sequence[ImageMatches]) -> float:
    tp = sum(m.counts[0] for m in images)
    fp = sum(m.counts[1] for m in images)
    fn = sum(m.counts[2] for m in images)
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def _objects(rows: Sequence[dict]) -> list[DetObject]:
    out = []
    for r in rows:
        kind = "bbox_2d" if "bbox_2d" in r else "poly"
        out.append(DetObject(r["desc"], kind, tuple(r[kind])))
    return out


def load_matches(samples_jsonl: str | Path) -> dict[str, ImageMatches]:
    """``sample_id`` → ``ImageMatches`` of an evaluation's ``samples.jsonl``."""
    out = {}
    for line in Path(samples_jsonl).read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            out[r["sample_id"]] = image_matches(_objects(r["prediction"]), _objects(r["gt"]),
                                                (int(r["tp"]), int(r["fp"]), int(r["fn"])))
    return out


def paired_bootstrap(a: dict[str, ImageMatches], b: dict[str, ImageMatches], draws: int = 2000,
                     seed: int = 0) -> dict[str, Interval]:
    """``{"f1@50": ..., "ap": ...}``: A − B on the images both hold, with 2.5 / 97.5 percentiles over ``draws``
    paired resamples. Raises when the two evaluations share no image."""
    ids = sorted(set(a) & set(b))
    if not ids:
        raise ValueError("the two evaluations share no held-out image (sample_id)")
    xs, ys = [a[i] for i in ids], [b[i] for i in ids]
    out = {}
    for key, metric in (("f1@50", f1_of), ("ap", coco_ap_of)):
        rng = np.random.default_rng(seed)  # both metrics on the same draws
        diffs = np.empty(draws)
        for k in range(draws):
            pick = rng.integers(0, len(ids), len(ids))
            diffs[k] = metric([xs[j] for j in pick]) - metric([ys[j] for j in pick])
        lo, hi = np.percentile(diffs, [2.5, 97.5])
        out[key] = Interval(metric(xs) - metric(ys), float(lo), float(hi), draws)
    return out
