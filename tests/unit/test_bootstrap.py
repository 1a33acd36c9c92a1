"""Paired bootstrap over held-out images: the fast AP equals pycocotools' on the same predictions, and the interval
covers a real difference and straddles zero for none."""

from __future__ import annotations

import json
import random

import pytest

from trainer.data.objects import DetObject
from trainer.evaluation.bootstrap import coco_ap_of, f1_of, image_matches, load_matches, paired_bootstrap
from trainer.evaluation.metrics import SamplePrediction, coco_ap, evaluate_samples, sample_record


def _scene(rng: random.Random, n_gt: int, jitter: int, miss: float, extra: int) -> SamplePrediction:
    gts, preds = [], []
    for _ in range(n_gt):
        x, y = rng.randint(0, 900), rng.randint(0, 900)
        w, h = rng.randint(20, 99), rng.randint(20, 99)
        gt = DetObject("red square", "bbox_2d", (x, y, x + w, y + h))
        gts.append(gt)
        if rng.random() > miss:
            j = [rng.randint(-jitter, jitter) for _ in range(4)]
            c = [min(999, max(0, v + d)) for v, d in zip(gt.coords, j)]
            preds.append(DetObject("red square", "bbox_2d", (min(c[0], c[2]), min(c[1], c[3]),
                                                              max(c[0], c[2]), max(c[1], c[3]))))
    for _ in range(extra):
        x, y = rng.randint(0, 950), rng.randint(0, 950)
        preds.append(DetObject("blue circle", "bbox_2d", (x, y, x + 40, y + 40)))
    rng.shuffle(preds)
    return SamplePrediction(f"img-{rng.random():.12f}", tuple(gts), tuple(preds))


def _samples(seed: int, n: int, jitter: int, miss: float) -> list[SamplePrediction]:
    rng = random.Random(seed)
    return [_scene(rng, rng.randint(0, 6), jitter, miss, rng.randint(0, 2)) for _ in range(n)]


@pytest.mark.parametrize("seed, jitter, miss", [(0, 3, 0.1), (1, 12, 0.3), (2, 30, 0.5)])
def test_fast_ap_equals_pycocotools(seed, jitter, miss):
    samples = _samples(seed, 60, jitter, miss)
    expected = coco_ap(samples).ap
    got = coco_ap_of([image_matches(s.pred, s.gt, (0, 0, 0)) for s in samples])
    assert got == pytest.approx(expected, abs=1e-9)


def _write(tmp_path, name, samples):
    _, evals = evaluate_samples(samples)
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(sample_record(s, e)) + "\n" for s, e in zip(samples, evals)))
    return path


def test_interval_covers_a_real_gain_and_straddles_zero_for_none(tmp_path):
    good = _samples(7, 150, 2, 0.05)
    bad = [SamplePrediction(s.sample_id, s.gt, s.pred[: len(s.pred) // 2]) for s in good]
    a, b = load_matches(_write(tmp_path, "good", good)), load_matches(_write(tmp_path, "bad", bad))
    gain = paired_bootstrap(a, b, draws=300)
    assert gain["f1@50"].diff == pytest.approx(f1_of(list(a.values())) - f1_of(list(b.values())))
    assert gain["f1@50"].low > 0 and gain["ap"].low > 0, "dropping half the detections is a real loss"
    assert gain["f1@50"].low <= gain["f1@50"].diff <= gain["f1@50"].high
    same = paired_bootstrap(a, a, draws=50)
    assert same["ap"].diff == 0 and same["ap"].low == 0 and same["ap"].high == 0


def test_no_shared_image_is_an_error(tmp_path):
    a = load_matches(_write(tmp_path, "a", _samples(1, 5, 3, 0.1)))
    b = load_matches(_write(tmp_path, "b", _samples(2, 5, 3, 0.1)))
    with pytest.raises(ValueError, match="share no held-out image"):
        paired_bootstrap(a, b)
