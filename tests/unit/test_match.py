"""Hungarian matching against a brute-force optimum; gating and candidate reduction."""

from __future__ import annotations

import itertools
import random

import pytest

from trainer.data.objects import DetObject
from trainer.matching.geometry import mask_iou, rasterize
from trainer.matching.match import UNMATCHED_COST, match_objects


def rand_box(rng):
    x1, y1 = rng.randint(0, 800), rng.randint(0, 800)
    return DetObject("o", "bbox_2d", (x1, y1, x1 + rng.randint(20, 199), y1 + rng.randint(20, 199)))


def brute_force(preds, gts, thr, res):
    iou = [[mask_iou(rasterize(p, res), rasterize(g, res)) for g in gts] for p in preds]
    best = (float("inf"), -1)
    n_p, n_g = len(preds), len(gts)
    for k in range(min(n_p, n_g) + 1):
        for ps in itertools.combinations(range(n_p), k):
            for gs in itertools.permutations(range(n_g), k):
                if any(iou[p][g] < thr or iou[p][g] == 0 for p, g in zip(ps, gs)):
                    continue
                cost = sum(1 - iou[p][g] for p, g in zip(ps, gs)) + UNMATCHED_COST * (n_p - k + n_g - k)
                best = min(best, (cost, k))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_optimum(seed):
    rng = random.Random(seed)
    gts = [rand_box(rng) for _ in range(rng.randint(0, 4))]
    preds = [DetObject("o", "bbox_2d", tuple(min(999, max(0, c + rng.randint(-60, 60))) for c in g.coords))
             if rng.random() < 0.7 and g.coords[2] > g.coords[0] else rand_box(rng) for g in gts]
    preds += [rand_box(rng) for _ in range(rng.randint(0, 2))]
    rng.shuffle(preds)
    preds = [p if p.coords[2] > p.coords[0] and p.coords[3] > p.coords[1] else rand_box(rng) for p in preds]
    thr, res = 0.2, 64
    m = match_objects(preds, gts, thr, top_k=len(gts) or 1, resolution=res)
    cost = sum(1 - iou for _, _, iou in m.pairs) + UNMATCHED_COST * (len(m.false_positives) + len(m.false_negatives))
    best_cost, best_k = brute_force(preds, gts, thr, res)
    assert m.num_matched == best_k
    assert cost == pytest.approx(best_cost, abs=1e-9)
    assert sorted(m.false_positives + tuple(p for p, _, _ in m.pairs)) == list(range(len(preds)))
    assert sorted(m.false_negatives + tuple(g for _, g, _ in m.pairs)) == list(range(len(gts)))


def test_gating_leaves_fp_and_fn():
    gt = DetObject("a", "bbox_2d", (100, 100, 300, 300))
    barely = DetObject("a", "bbox_2d", (250, 250, 450, 450))
    m = match_objects([barely], [gt], iou_threshold=0.5)
    assert m.pairs == () and m.false_positives == (0,) and m.false_negatives == (0,) and m.gated == 1


def test_candidate_reduction_limits_pairs_and_is_deterministic():
    rng = random.Random(3)
    gts = [rand_box(rng) for _ in range(8)]
    preds = [rand_box(rng) for _ in range(6)]
    a = match_objects(preds, gts, 0.0001, top_k=2)
    b = match_objects(preds, gts, 0.0001, top_k=2)
    assert a == b and a.candidates_evaluated == 12


def test_poly_and_bbox_masks_compare_as_shapes():
    square = DetObject("s", "bbox_2d", (100, 100, 500, 500))
    triangle = DetObject("t", "poly", (100, 100, 500, 100, 100, 500))
    iou = mask_iou(rasterize(square), rasterize(triangle))
    assert 0.45 < iou < 0.55
    m = match_objects([triangle], [square], iou_threshold=0.4)
    assert m.num_matched == 1
