"""Hungarian matching of predicted to ground-truth objects with candidate reduction and IoU gating.

Cost of a pair = 1 − maskIoU (virtual R×R canvas). Only the top-k GT per prediction by box IoU are
candidates (ties and all-zero IoUs fall back to centre distance, then GT index — deterministic). Pairs with
maskIoU below the gate are infeasible. The assignment adds dummy rows/columns (cost 1 each) so any
prediction may stay unmatched (FP) and any GT may stay unmatched (FN); since a feasible pair costs < 1
against 2 for leaving both unmatched, the result has maximum cardinality, then minimum total cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from trainer.data.objects import DetObject
from trainer.matching.geometry import box_iou, centre_distance, mask_iou, rasterize

INFEASIBLE = 1e6
UNMATCHED_COST = 1.0


@dataclass(frozen=True)
class MatchResult:
    pairs: tuple[tuple[int, int, float], ...]
    false_positives: tuple[int, ...]
    false_negatives: tuple[int, ...]
    gated: int
    candidates_evaluated: int

    @property
    def num_matched(self) -> int:
        return len(self.pairs)


def candidate_pairs(preds: Sequence[DetObject], gts: Sequence[DetObject], top_k: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    gt_bounds = [g.bounds() for g in gts]
    for p, pred in enumerate(preds):
        pb = pred.bounds()
        ranked = sorted(range(len(gts)), key=lambda g: (-box_iou(pb, gt_bounds[g]), centre_distance(pb, gt_bounds[g]), g))
        out.extend((p, g) for g in ranked[:top_k])
    return out


def pair_costs(preds: Sequence[DetObject], gts: Sequence[DetObject], iou_threshold: float, top_k: int,
               resolution: int) -> tuple[np.ndarray, int, int]:
    """P×G cost matrix (INFEASIBLE where not a candidate or gated), gated count, candidates evaluated."""
    cost = np.full((len(preds), len(gts)), INFEASIBLE)
    pred_masks: dict[int, np.ndarray] = {}
    gt_masks: dict[int, np.ndarray] = {}
    gated_preds: set[int] = set()
    feasible_preds: set[int] = set()
    pairs = candidate_pairs(preds, gts, top_k)
    for p, g in pairs:
        if p not in pred_masks:
            pred_masks[p] = rasterize(preds[p], resolution)
        if g not in gt_masks:
            gt_masks[g] = rasterize(gts[g], resolution)
        iou = mask_iou(pred_masks[p], gt_masks[g])
        if iou >= iou_threshold and iou > 0.0:
            cost[p, g] = 1.0 - iou
            feasible_preds.add(p)
        else:
            gated_preds.add(p)
    return cost, len(gated_preds - feasible_preds), len(pairs)


def match_objects(preds: Sequence[DetObject], gts: Sequence[DetObject], iou_threshold: float = 0.3,
                  top_k: int = 5, resolution: int = 256) -> MatchResult:
    """Optimal gated assignment; pure and deterministic."""
    n_p, n_g = len(preds), len(gts)
    if n_p == 0 or n_g == 0:
        return MatchResult((), tuple(range(n_p)), tuple(range(n_g)), 0, 0)
    cost, gated, evaluated = pair_costs(preds, gts, iou_threshold, top_k, resolution)
    full = np.full((n_p + n_g, n_g + n_p), INFEASIBLE)
    full[:n_p, :n_g] = cost
    full[:n_p, n_g:][np.diag_indices(n_p)] = UNMATCHED_COST
    full[n_p:, :n_g][np.diag_indices(n_g)] = UNMATCHED_COST
    full[n_p:, n_g:] = 0.0
    rows, cols = linear_sum_assignment(full)
    pairs = []
    matched_p: set[int] = set()
    matched_g: set[int] = set()
    for r, c in zip(rows, cols):
        if r < n_p and c < n_g and cost[r, c] < INFEASIBLE:
            pairs.append((int(r), int(c), float(1.0 - cost[r, c])))
            matched_p.add(int(r))
            matched_g.add(int(c))
    pairs.sort()
    return MatchResult(
        pairs=tuple(pairs),
        false_positives=tuple(p for p in range(n_p) if p not in matched_p),
        false_negatives=tuple(g for g in range(n_g) if g not in matched_g),
        gated=gated,
        candidates_evaluated=evaluated,
    )


def first_predictions(match: MatchResult, kept: int, num_gt: int) -> MatchResult:
    """``match`` restricted to the first ``kept`` predictions: their pairs and false positives; every GT no kept
    prediction matched is a false negative."""
    pairs = tuple(p for p in match.pairs if p[0] < kept)
    matched = {g for _, g, _ in pairs}
    return MatchResult(pairs, tuple(p for p in match.false_positives if p < kept),
                       tuple(g for g in range(num_gt) if g not in matched), match.gated, match.candidates_evaluated)
