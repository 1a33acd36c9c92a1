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
