"""Detection metrics on parsed rollouts (pure: no model, no files).

Inputs are ``SamplePrediction``s: the valid objects the strict parser (``trainer.matching.parse``) kept, its
invalid-object counts and whether the response was one complete JSON object, beside the ground truth. Outputs
are per-sample ``SampleEval``s and one ``DetectionMetrics``.

Definitions (the decisions, with their reasons, are in ``docs/reference/metrics.md``):

- **P / R / F1 @ IoU t**: the training matcher (``match_objects``: Hungarian on 1 − maskIoU, top-k candidates,
  gating at ``t``) with ``t`` as the gate; a matched pair is a TP, an unmatched prediction an FP, an unmatched
  GT an FN. Counts are summed over the split (micro average). ``P = TP/(TP+FP)``, ``R = TP/(TP+FN)``; a 0/0
  ratio is 1.0 when the other error count is 0 too (nothing predicted, nothing missed) and 0.0 otherwise.
- **class variant** (``class_*``): objects only match when their ``desc`` strings are equal (exact match after
  the parser's own strip); the matcher runs per description.
- **mask IoU**: rasterised on the matcher's virtual canvas; the default eval resolution is 1000, i.e. one
  cell per norm1000 bin, so a box ``[x1, y1, x2, y2]`` covers bins ``x1..x2`` inclusive.
- **polygons**: P/R/F1 and mean IoU use the polygon's own mask (as training does). COCO AP uses boxes only:
  a ``poly`` counts as its bounding box (min/max of its vertices).
- **COCO AP** (``pycocotools``, iouType ``bbox``) on the same inclusive-bin boxes (``w = x2 - x1 + 1``), so
  box IoUs agree with the matcher's at resolution 1000. Greedy JSON answers carry no confidence: every
  prediction scores 1.0, and pycocotools' stable sort keeps ties in (sample, emission) order, so AP is
  deterministic and comparable between checkpoints on one split but says nothing about ranking quality.
  ``None`` when the split has no GT object (undefined). Class AP averages over descriptions that have GT.
- **parse failure**: the response is not one complete JSON object (a character that cannot continue the
  JSON, or the object never closes — e.g. cut at ``max_new_tokens``). Its complete objects still count.
- **invalid-object rate**: invalid / (valid + invalid) predicted objects (the parser's own count).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.data.formats.coco import coco_evaluate
from trainer.data.objects import DetObject
from trainer.matching.match import match_objects

COCO_IOUS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))
DEFAULT_RESOLUTION = 1000


@dataclass(frozen=True)
class SamplePrediction:
    """One held-out sample as the parser left it."""

    sample_id: str
    gt: tuple[DetObject, ...]
    pred: tuple[DetObject, ...]
    invalid: Mapping[str, int] = field(default_factory=dict)
    parse_failure: str | None = None  # None | "broken" (not JSON) | "unclosed" (never closed / truncated)
    truncated: bool = False
    response_tokens: int = 0
    response_text: str = ""

    @property
    def num_invalid(self) -> int:
        return sum(self.invalid.values())


@dataclass(frozen=True)
class MatchCounts:
    tp: int
    fp: int
    fn: int
    pairs: tuple[tuple[int, int, float], ...]  # (pred index, gt index, mask IoU)


@dataclass(frozen=True)
class SampleEval:
    sample_id: str
    agnostic: MatchCounts
    classwise: MatchCounts


@dataclass(frozen=True)
class PRF:
    tp: int
    fp: int
    fn: int
    precision: float
    recall: float
    f1: float


@dataclass(frozen=True)
class COCOAP:
    ap: float | None  # mean over IoU 0.50:0.05:0.95
    ap50: float | None
    ap75: float | None
    ar100: float | None


@dataclass(frozen=True)
class DetectionMetrics:
    num_samples: int
    num_gt: int
    num_pred: int
    num_invalid: int
    at50: PRF
    at75: PRF
    class_at50: PRF
    mean_iou: float | None  # mean mask IoU of the class-agnostic matches at 0.5
    coco: COCOAP
    class_coco: COCOAP
    parse_failure_rate: float
    parse_failures: Mapping[str, int]
    invalid_object_rate: float
    invalid_reasons: Mapping[str, int]
    truncation_rate: float
    pred_per_image: float
    gt_per_image: float
    mean_response_tokens: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def flat(self, prefix: str = "") -> dict[str, float]:
        """The headline numbers as one flat ``{prefix + name: value}`` mapping (``None`` values left out)."""
        values = {
            "precision@50": self.at50.precision, "recall@50": self.at50.recall, "f1@50": self.at50.f1,
            "f1@75": self.at75.f1, "class_f1@50": self.class_at50.f1,
            "ap": self.coco.ap, "ap50": self.coco.ap50, "ap75": self.coco.ap75, "class_ap": self.class_coco.ap,
            "mean_iou": self.mean_iou, "parse_failure_rate": self.parse_failure_rate,
            "invalid_object_rate": self.invalid_object_rate, "pred_per_image": self.pred_per_image,
            "gt_per_image": self.gt_per_image, "num_samples": self.num_samples, "tp@50": self.at50.tp, "fp@50": self.at50.fp, "fn@50": self.at50.fn,
        }
        return {prefix + k: float(v) for k, v in values.items() if v is not None}


HEADLINE_ROWS = (
    ("precision @ IoU 0.5", "precision@50", "{:.3f}"),
    ("recall @ IoU 0.5", "recall@50", "{:.3f}"),
    ("F1 @ IoU 0.5", "f1@50", "{:.3f}"),
    ("F1 @ IoU 0.75", "f1@75", "{:.3f}"),
    ("F1 @ IoU 0.5, desc exact", "class_f1@50", "{:.3f}"),
    ("AP 0.50:0.95 (COCO)", "ap", "{:.3f}"),
    ("AP50", "ap50", "{:.3f}"),
    ("AP75", "ap75", "{:.3f}"),
    ("AP 0.50:0.95, desc exact", "class_ap", "{:.3f}"),
    ("mean IoU of matches", "mean_iou", "{:.3f}"),
    ("TP / FP / FN @ 0.5", None, None),
    ("parse-failure rate", "parse_failure_rate", "{:.1%}"),
    ("invalid-object rate", "invalid_object_rate", "{:.1%}"),
    ("objects per image (pred / GT)", None, None),
)


def markdown_table(columns: Sequence[tuple[str, Mapping[str, float]]]) -> str:
    """One Markdown table, a column per (title, ``DetectionMetrics.flat()``): the headline numbers side by side."""
    lines = ["| metric | " + " | ".join(t for t, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
    for label, key, fmt in HEADLINE_ROWS:
        cells = []
        for _, flat in columns:
            if key is None and label.startswith("TP / FP"):
                cells.append(" / ".join(f"{flat.get(k, 0):.0f}" for k in ("tp@50", "fp@50", "fn@50")))
            elif key is None:
                cells.append(f"{flat.get('pred_per_image', 0):.2f} / {flat.get('gt_per_image', 0):.2f}")
            else:
                cells.append(fmt.format(flat[key]) if key in flat else "n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def ratio(num: float, den: float, other_errors: float) -> float:
    """num/den; 0/0 is 1.0 when ``other_errors`` is 0 (nothing claimed, nothing missed) and 0.0 otherwise."""
    if den > 0:
        return num / den
    return 1.0 if other_errors == 0 else 0.0


def prf(tp: int, fp: int, fn: int) -> PRF:
    p = ratio(tp, tp + fp, fn)
    r = ratio(tp, tp + fn, fp)
    f1 = 2 * p * r / (p + r) if p + r > 0 else 0.0
    return PRF(tp, fp, fn, p, r, f1)


def match_counts(pred: Sequence[DetObject], gt: Sequence[DetObject], iou_threshold: float, *, top_k: int = 5,
                 resolution: int = DEFAULT_RESOLUTION, class_aware: bool = False) -> MatchCounts:
    """TP/FP/FN of one sample with the training matcher gated at ``iou_threshold`` (per ``desc`` if class-aware)."""
    if not class_aware:
        m = match_objects(pred, gt, iou_threshold, top_k, resolution)
        return MatchCounts(m.num_matched, len(m.false_positives), len(m.false_negatives), m.pairs)
    pairs: list[tuple[int, int, float]] = []
    for desc in sorted({o.desc for o in pred} | {o.desc for o in gt}):
        pi = [i for i, o in enumerate(pred) if o.desc == desc]
        gi = [i for i, o in enumerate(gt) if o.desc == desc]
        m = match_objects([pred[i] for i in pi], [gt[i] for i in gi], iou_threshold, top_k, resolution)
        pairs.extend((pi[p], gi[g], iou) for p, g, iou in m.pairs)
    pairs.sort()
    return MatchCounts(len(pairs), len(pred) - len(pairs), len(gt) - len(pairs), tuple(pairs))


def coco_box(obj: DetObject) -> list[float]:
    """COCO ``[x, y, w, h]`` of an object's bounding box on the bin grid (bins ``x1..x2`` inclusive)."""
    x1, y1, x2, y2 = obj.bounds()
    return [float(x1), float(y1), float(x2 - x1 + 1), float(y2 - y1 + 1)]


def coco_ap(samples: Sequence[SamplePrediction], class_aware: bool = False) -> COCOAP:
    """COCO box AP/AR with pycocotools (every prediction scores 1.0; see the module docstring)."""
    if not any(s.gt for s in samples):
        return COCOAP(None, None, None, None)
    descs = sorted({o.desc for s in samples for o in (*s.gt, *s.pred)}) if class_aware else []
    cat = {d: i + 1 for i, d in enumerate(descs)}

    def category(o: DetObject) -> int:
        return cat[o.desc] if class_aware else 1

    images = [{"id": i + 1, "width": 1000, "height": 1000} for i in range(len(samples))]
    gts, dets = [], []
    for img, s in enumerate(samples, start=1):
        for o in s.gt:
            box = coco_box(o)
            gts.append({"id": len(gts) + 1, "image_id": img, "category_id": category(o), "bbox": box,
                        "area": box[2] * box[3], "iscrowd": 0})
        for o in s.pred:
            dets.append({"image_id": img, "category_id": category(o), "bbox": coco_box(o), "score": 1.0})
    if not dets:
        return COCOAP(0.0, 0.0, 0.0, 0.0)
    categories = [{"id": i, "name": d} for d, i in cat.items()] if class_aware else [{"id": 1, "name": "object"}]
    stats = coco_evaluate({"images": images, "annotations": gts, "categories": categories}, dets)
    # pycocotools reports -1 where a value is undefined; area 'all', maxDets 100 are stats 0, 1, 2 and 8
    return COCOAP(*(v if v >= 0 else None for v in (stats[0], stats[1], stats[2], stats[8])))


def evaluate_samples(samples: Sequence[SamplePrediction], *, top_k: int = 5,
                     resolution: int = DEFAULT_RESOLUTION) -> tuple[DetectionMetrics, list[SampleEval]]:
    """Per-sample matches and the split's metrics."""
    evals: list[SampleEval] = []
    at75 = [0, 0, 0]
    for s in samples:
        evals.append(SampleEval(s.sample_id, match_counts(s.pred, s.gt, 0.5, top_k=top_k, resolution=resolution),
                                match_counts(s.pred, s.gt, 0.5, top_k=top_k, resolution=resolution,
                                             class_aware=True)))
        m75 = match_counts(s.pred, s.gt, 0.75, top_k=top_k, resolution=resolution)
        at75 = [at75[0] + m75.tp, at75[1] + m75.fp, at75[2] + m75.fn]

    def total(counts: Iterable[MatchCounts]) -> PRF:
        tp = fp = fn = 0
        for c in counts:
            tp, fp, fn = tp + c.tp, fp + c.fp, fn + c.fn
        return prf(tp, fp, fn)

    n = len(samples)
    num_pred = sum(len(s.pred) for s in samples)
    num_invalid = sum(s.num_invalid for s in samples)
    ious = [iou for e in evals for _, _, iou in e.agnostic.pairs]
    failures: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for s in samples:
        if s.parse_failure:
            failures[s.parse_failure] = failures.get(s.parse_failure, 0) + 1
        for k, v in s.invalid.items():
            reasons[k] = reasons.get(k, 0) + v
    metrics = DetectionMetrics(
        num_samples=n,
        num_gt=sum(len(s.gt) for s in samples),
        num_pred=num_pred,
        num_invalid=num_invalid,
        at50=total(e.agnostic for e in evals),
        at75=prf(*at75),
        class_at50=total(e.classwise for e in evals),
        mean_iou=sum(ious) / len(ious) if ious else None,
        coco=coco_ap(samples),
        class_coco=coco_ap(samples, class_aware=True),
        parse_failure_rate=sum(failures.values()) / n if n else 0.0,
        parse_failures=dict(sorted(failures.items())),
        invalid_object_rate=num_invalid / (num_pred + num_invalid) if num_pred + num_invalid else 0.0,
        invalid_reasons=dict(sorted(reasons.items())),
        truncation_rate=sum(s.truncated for s in samples) / n if n else 0.0,
        pred_per_image=num_pred / n if n else 0.0,
        gt_per_image=sum(len(s.gt) for s in samples) / n if n else 0.0,
        mean_response_tokens=sum(s.response_tokens for s in samples) / n if n else 0.0,
    )
    return metrics, evals


def object_dict(o: DetObject) -> dict[str, Any]:
    return {"desc": o.desc, o.kind: list(o.coords)}


def sample_record(s: SamplePrediction, e: SampleEval) -> dict[str, Any]:
    """One JSONL row for a user looking at failures: prediction, GT, matches, errors."""
    matched_p = {p for p, _, _ in e.agnostic.pairs}
    matched_g = {g for _, g, _ in e.agnostic.pairs}
    return {
        "sample_id": s.sample_id,
        "prediction": [object_dict(o) for o in s.pred],
        "gt": [object_dict(o) for o in s.gt],
        "matches": [{"pred": p, "gt": g, "iou": round(iou, 4), "desc_match": s.pred[p].desc == s.gt[g].desc}
                    for p, g, iou in e.agnostic.pairs],
        "false_positives": [i for i in range(len(s.pred)) if i not in matched_p],
        "false_negatives": [i for i in range(len(s.gt)) if i not in matched_g],
        "tp": e.agnostic.tp, "fp": e.agnostic.fp, "fn": e.agnostic.fn, "class_tp": e.classwise.tp,
        "parse_failure": s.parse_failure,
        "invalid_objects": dict(s.invalid),
        "truncated": s.truncated,
        "response_tokens": s.response_tokens,
        "response": s.response_text,
    }
