"""Detection metrics on hand-built cases whose answer is known by construction (trainer/evaluation/metrics.py)."""

from __future__ import annotations

import pytest

from trainer.data.objects import DetObject
from trainer.data.output_format import serialize_objects
from trainer.evaluation.metrics import (
    SamplePrediction,
    coco_box,
    evaluate_samples,
    markdown_table,
    match_counts,
    prf,
    sample_record,
)

FULL = DetObject("red square", "bbox_2d", (0, 0, 999, 999))


def box(x1, y1, x2, y2, desc="red square"):
    return DetObject(desc, "bbox_2d", (x1, y1, x2, y2))


def sample(gt, pred, sid="s", **kw):
    return SamplePrediction(sid, tuple(gt), tuple(pred), **kw)


def test_perfect_predictions_score_one_everywhere():
    gts = [box(10, 10, 200, 300), box(400, 400, 700, 650, "blue circle")]
    m, evals = evaluate_samples([sample(gts, gts, "a"), sample(gts[:1], gts[:1], "b")])
    for p in (m.at50, m.at75, m.class_at50):
        assert (p.precision, p.recall, p.f1) == (1.0, 1.0, 1.0)
    assert (m.at50.tp, m.at50.fp, m.at50.fn) == (3, 0, 0)
    assert m.coco.ap == pytest.approx(1.0) and m.coco.ap50 == pytest.approx(1.0)
    assert m.class_coco.ap == pytest.approx(1.0)
    assert m.mean_iou == pytest.approx(1.0)
    assert m.parse_failure_rate == 0.0 and m.invalid_object_rate == 0.0
    assert m.pred_per_image == m.gt_per_image == 1.5
    assert [e.agnostic.tp for e in evals] == [2, 1]


def test_prediction_at_iou_0_62_counts_at_0_5_but_not_at_0_75():
    pred = box(0, 0, 619, 999)  # covers 620 of 1000 columns of the GT: IoU 0.62 on the bin grid
    m, _ = evaluate_samples([sample([FULL], [pred])])
    assert m.mean_iou == pytest.approx(0.62)
    assert (m.at50.tp, m.at50.fp, m.at50.fn) == (1, 0, 0)
    assert (m.at75.tp, m.at75.fp, m.at75.fn) == (0, 1, 1)
    assert m.coco.ap50 == pytest.approx(1.0) and m.coco.ap75 == 0.0
    assert m.coco.ap == pytest.approx(0.3), "matched at IoU 0.50, 0.55, 0.60 of the ten COCO thresholds"


def test_iou_exactly_at_the_threshold_counts():
    half = box(0, 0, 499, 999)  # exactly half of the full-image box (bins inclusive)
    assert match_counts([half], [FULL], 0.5).pairs[0][2] == 0.5
    m, _ = evaluate_samples([sample([FULL], [half])])
    assert m.at50.tp == 1 and m.at75.tp == 0
    assert m.coco.ap50 == pytest.approx(1.0), "pycocotools matches IoU >= threshold too"
    assert m.coco.ap == pytest.approx(0.1)


def test_false_positive_and_false_negative_counts():
    gts = [box(0, 0, 100, 100), box(300, 300, 400, 400), box(600, 600, 700, 700)]
    preds = [box(0, 0, 100, 100), box(850, 850, 990, 990)]
    m, evals = evaluate_samples([sample(gts, preds)])
    assert (m.at50.tp, m.at50.fp, m.at50.fn) == (1, 1, 2)
    assert m.at50.precision == 0.5 and m.at50.recall == pytest.approx(1 / 3)
    assert m.at50.f1 == pytest.approx(0.4)
    row = sample_record(sample(gts, preds), evals[0])
    assert row["false_positives"] == [1] and row["false_negatives"] == [1, 2]
    assert row["matches"] == [{"pred": 0, "gt": 0, "iou": 1.0, "desc_match": True}]


def test_empty_split_and_all_false_positives():
    m, _ = evaluate_samples([sample([], [])])
    assert (m.at50.precision, m.at50.recall, m.at50.f1) == (1.0, 1.0, 1.0), "nothing to find, nothing claimed"
    assert m.coco.ap is None, "AP is undefined without GT"
    m, _ = evaluate_samples([sample([], [box(0, 0, 10, 10)])])
    assert (m.at50.tp, m.at50.fp, m.at50.fn) == (0, 1, 0)
    assert (m.at50.precision, m.at50.recall, m.at50.f1) == (0.0, 0.0, 0.0)
    m, _ = evaluate_samples([sample([box(0, 0, 10, 10)], [box(500, 500, 600, 600)])])
    assert (m.at50.precision, m.at50.recall) == (0.0, 0.0) and m.coco.ap == 0.0
    m, _ = evaluate_samples([sample([box(0, 0, 10, 10)], [])])
    assert (m.at50.tp, m.at50.fn) == (0, 1) and m.coco.ap == 0.0 and m.at50.precision == 0.0


def test_duplicate_predictions_are_one_tp_and_one_fp():
    gt = box(100, 100, 300, 300)
    m, _ = evaluate_samples([sample([gt], [gt, gt])])
    assert (m.at50.tp, m.at50.fp, m.at50.fn) == (1, 1, 0)
    assert m.at50.precision == 0.5 and m.at50.recall == 1.0
    # COCO AP: the first (equal-score) duplicate reaches full recall at precision 1; the later FP cannot lower it
    assert m.coco.ap == pytest.approx(1.0)


def test_desc_exact_match_class_variant():
    gt = box(100, 100, 300, 300, "red square")
    wrong = box(100, 100, 300, 300, "blue square")
    m, evals = evaluate_samples([sample([gt], [wrong])])
    assert m.at50.tp == 1 and m.coco.ap == pytest.approx(1.0)
    assert (m.class_at50.tp, m.class_at50.fp, m.class_at50.fn) == (0, 1, 1)
    assert m.class_coco.ap == 0.0
    assert sample_record(sample([gt], [wrong]), evals[0])["matches"][0]["desc_match"] is False


def test_polygon_counts_by_its_mask_for_f1_and_by_its_box_for_ap():
    tri = DetObject("red triangle", "poly", (500, 0, 999, 999, 0, 999))
    m, _ = evaluate_samples([sample([tri], [box(0, 0, 999, 999, "red triangle")])])
    assert coco_box(tri) == [0.0, 0.0, 1000.0, 1000.0]
    assert m.coco.ap == pytest.approx(1.0), "AP: the polygon's bounding box"
    assert m.mean_iou == pytest.approx(0.5, abs=0.01), "P/R/F1: the triangle's mask covers half the box"


def test_parse_failures_and_invalid_objects_from_the_real_parser():
    from trainer.evaluation.run import predictions
    from trainer.modeling.fixtures import tiny_tokenizer
    from trainer.modeling.prompts import PromptEncoder
    from trainer.rollout.types import RolloutResult
    from trainer.sft.stage2 import Stage2Pipeline

    tok = tiny_tokenizer()
    pipe = Stage2Pipeline(PromptEncoder(tok))
    objs = [box(10, 20, 300, 400), box(500, 500, 600, 700, "blue circle")]
    text = serialize_objects(objs)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cut = tok(text[: text.index('"object_2"') + 30], add_special_tokens=False)["input_ids"]
    bad = tok('{"object_1": {"desc": "x", "bbox_2d": [1, 2]}, ]]', add_special_tokens=False)["input_ids"]
    results = [RolloutResult("ok", (), tuple(ids) + (tok.eos_token_id,)),
               RolloutResult("cut", (), tuple(cut), "length"),
               RolloutResult("bad", (), tuple(bad))]
    samples = [type("S", (), {"sample_id": r.sample_id, "objects": tuple(objs)})() for r in results]
    preds = predictions(pipe, samples, results)
    assert [p.parse_failure for p in preds] == [None, "unclosed", "broken"]
    assert [len(p.pred) for p in preds] == [2, 1, 0]
    assert preds[1].truncated and preds[2].num_invalid == 1
    m, _ = evaluate_samples(preds)
    assert m.parse_failure_rate == pytest.approx(2 / 3) and m.parse_failures == {"broken": 1, "unclosed": 1}
    assert m.invalid_object_rate == pytest.approx(2 / 5), "1 truncated + 1 malformed of 5 predicted objects"
    assert (m.at50.tp, m.at50.fn) == (3, 3)


def test_prf_and_markdown_table():
    assert prf(2, 2, 0).precision == 0.5 and prf(2, 2, 0).recall == 1.0
    m, _ = evaluate_samples([sample([FULL], [FULL])])
    table = markdown_table([("before", m.flat()), ("after", m.flat())])
    assert table.splitlines()[0] == "| metric | before | after |"
    assert "| F1 @ IoU 0.5 | 1.000 | 1.000 |" in table and "| TP / FP / FN @ 0.5 | 1 / 0 / 0 | 1 / 0 / 0 |" in table


# --- random cases against independent references ------------------------------------------------------------------
# COCO AP: pycocotools' COCOeval run here on a COCO json built here (written to a file and loaded as a user would).
# P / R / F1: brute force over every partial one-to-one assignment, box IoU in closed form on the inclusive bin grid.
# The matcher's objective (trainer/matching/match.py): maximum number of pairs with IoU >= t, then maximum total IoU.

def random_case(rng, num_images=6):
    """Images with 0-4 GT and 0-5 predictions: jittered copies of GT (IoU often near the gates), random boxes,
    duplicated predictions and duplicated GT, empty images, GT-only and prediction-only images."""
    descs = ("red square", "blue circle")

    def rand_box():
        x1, y1 = int(rng.integers(0, 900)), int(rng.integers(0, 900))
        return box(x1, y1, int(rng.integers(x1, 1000)), int(rng.integers(y1, 1000)), descs[int(rng.integers(2))])

    def jitter(o):
        x1, y1, x2, y2 = o.coords
        w, h = x2 - x1 + 1, y2 - y1 + 1
        f = (12, 6, 3)[int(rng.integers(3))]  # small, medium or large shifts of each edge
        d = [int(rng.integers(-s // f - 1, s // f + 2)) for s in (w, h, w, h)]
        nx1, ny1 = min(max(x1 + d[0], 0), 999), min(max(y1 + d[1], 0), 999)
        desc = o.desc if rng.random() < 0.8 else descs[int(rng.integers(2))]
        return box(nx1, ny1, min(max(x2 + d[2], nx1), 999), min(max(y2 + d[3], ny1), 999), desc)

    def at_gate():
        # a (GT, prediction) pair whose IoU is exactly 0.5 or 0.75, or one bin column below it (gate conventions)
        w, h = 4 * int(rng.integers(10, 150)), int(rng.integers(20, 400))
        x1, y1 = int(rng.integers(0, 1000 - w)), int(rng.integers(0, 1000 - h))
        t, below = (0.5, 0.75)[int(rng.integers(2))], int(rng.integers(2))
        g = box(x1, y1, x1 + w - 1, y1 + h - 1)
        return g, box(x1, y1, x1 + int(w * t) - 1 - below, y1 + h - 1)

    samples = []
    for i in range(num_images):
        kind = rng.random()
        gt = [] if kind < 0.15 else [rand_box() for _ in range(int(rng.integers(1, 4)))]
        if gt and rng.random() < 0.2:
            gt.append(gt[0])  # duplicated GT
        pred = [jitter(g) for g in gt if rng.random() < 0.8]
        if gt and rng.random() < 0.5:
            g, p = at_gate()
            gt.append(g)
            pred.append(p)
        pred += [rand_box() for _ in range(int(rng.integers(0, 3)))]
        if pred and rng.random() < 0.3:
            pred.insert(int(rng.integers(len(pred) + 1)), pred[int(rng.integers(len(pred)))])  # duplicate
        if 0.9 < kind:
            pred = []  # GT-only image
        order = rng.permutation(len(pred))
        samples.append(sample(gt, [pred[j] for j in order][:5], f"img{i}"))
    samples.append(sample([], [], "empty"))
    samples.append(sample([], [rand_box()], "pred-only"))
    samples.append(sample([rand_box()], [rand_box()], "one-one"))
    return samples


def bin_iou(a, b):
    ax1, ay1, ax2, ay2 = a.coords
    bx1, by1, bx2, by2 = b.coords
    iw, ih = min(ax2, bx2) - max(ax1, bx1) + 1, min(ay2, by2) - max(ay1, by1) + 1
    inter = max(iw, 0) * max(ih, 0)
    return inter / ((ax2 - ax1 + 1) * (ay2 - ay1 + 1) + (bx2 - bx1 + 1) * (by2 - by1 + 1) - inter)


def brute_force_matches(pred, gt, t, class_aware=False):
    """(number of pairs, total IoU) of the best partial one-to-one assignment, by enumeration."""
    import itertools

    ok = [[bin_iou(p, g) if bin_iou(p, g) >= t and (not class_aware or p.desc == g.desc) else None for g in gt]
          for p in pred]
    for k in range(min(len(pred), len(gt)), 0, -1):
        best = None
        for ps in itertools.combinations(range(len(pred)), k):
            for gs in itertools.permutations(range(len(gt)), k):
                ious = [ok[p][g] for p, g in zip(ps, gs)]
                if None not in ious and (best is None or sum(ious) > best):
                    best = sum(ious)
        if best is not None:
            return k, best
    return 0, 0.0


def reference_coco(samples, tmp_path, class_aware=False):
    import json

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    names = sorted({o.desc for s in samples for o in (*s.gt, *s.pred)}) if class_aware else ["object"]
    cat_id = {n: i + 1 for i, n in enumerate(names)}

    def xywh(o):
        x1, y1, x2, y2 = o.coords
        return [x1, y1, x2 - x1 + 1, y2 - y1 + 1]

    anns, dets = [], []
    for img, s in enumerate(samples, start=1):
        for o in s.gt:
            b = xywh(o)
            anns.append({"id": len(anns) + 1, "image_id": img, "bbox": b, "area": b[2] * b[3], "iscrowd": 0,
                         "category_id": cat_id[o.desc] if class_aware else 1})
        dets += [{"image_id": img, "bbox": xywh(o), "score": 1.0,
                  "category_id": cat_id[o.desc] if class_aware else 1} for o in s.pred]
    path = tmp_path / f"gt-{int(class_aware)}.json"
    path.write_text(json.dumps({"images": [{"id": i + 1, "width": 1000, "height": 1000} for i in range(len(samples))],
                                "annotations": anns,
                                "categories": [{"id": i, "name": n} for n, i in cat_id.items()]}))
    ground = COCO(str(path))
    ev = COCOeval(ground, ground.loadRes(dets), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0], ev.stats[1], ev.stats[2]


@pytest.mark.parametrize("seed", range(6))
def test_random_cases_agree_with_pycocotools_and_brute_force(seed, tmp_path):
    import numpy as np

    samples = random_case(np.random.default_rng(seed))
    m, evals = evaluate_samples(samples)

    ap, ap50, ap75 = reference_coco(samples, tmp_path)
    assert (m.coco.ap, m.coco.ap50, m.coco.ap75) == (pytest.approx(ap), pytest.approx(ap50), pytest.approx(ap75))
    class_ap = reference_coco(samples, tmp_path, class_aware=True)[0]
    assert m.class_coco.ap == pytest.approx(class_ap)

    for t, got, class_aware in ((0.5, m.at50, False), (0.75, m.at75, False), (0.5, m.class_at50, True)):
        tp = 0
        for s, e in zip(samples, evals):
            k, total_iou = brute_force_matches(s.pred, s.gt, t, class_aware)
            tp += k
            if t == 0.5 and not class_aware:
                assert e.agnostic.tp == k and sum(iou for *_, iou in e.agnostic.pairs) == pytest.approx(total_iou)
                assert all(iou == pytest.approx(bin_iou(s.pred[p], s.gt[g])) for p, g, iou in e.agnostic.pairs)
        num_pred, num_gt = sum(len(s.pred) for s in samples), sum(len(s.gt) for s in samples)
        fp, fn = num_pred - tp, num_gt - tp
        p, r = tp / (tp + fp), tp / (tp + fn)
        assert (got.tp, got.fp, got.fn) == (tp, fp, fn)
        assert (got.precision, got.recall) == (pytest.approx(p), pytest.approx(r))
        assert got.f1 == pytest.approx(2 * p * r / (p + r) if p + r else 0.0)
