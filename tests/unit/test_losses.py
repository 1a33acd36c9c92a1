"""Coord losses: soft targets, W1 and gate behave as specified; the objective masks what it should."""

from __future__ import annotations

import math

import torch

from trainer.losses.coord import coord_loss, soft_targets
from trainer.losses.objective import LossWeights, objective, per_segment_losses

V, C = 40, 10
COORD_IDS = torch.arange(20, 30)


def test_soft_targets_are_unimodal_and_centred():
    q = soft_targets(torch.tensor([3.0, 6.5]), sigma=1.0, num_bins=C)
    assert torch.allclose(q.sum(-1), torch.ones(2))
    assert q[0].argmax() == 3 and (q[1, 6] - q[1, 7]).abs() < 1e-6
    diffs = torch.diff(q[0])
    assert (diffs[:3] > 0).all() and (diffs[3:] < 0).all()


def test_w1_orders_predictions_by_distance_and_gate_measures_outside_mass():
    target = torch.tensor([2.0])

    def logits_peaked_at(b, outside=-30.0):
        row = torch.full((1, V), outside)
        row[0, 20:30] = -10.0
        row[0, 20 + b] = 10.0
        return row

    near = coord_loss(logits_peaked_at(3), COORD_IDS, target, 1.0)
    far = coord_loss(logits_peaked_at(9), COORD_IDS, target, 1.0)
    assert near.w1 < far.w1 and near.softce < far.softce
    assert near.gate < 1e-6
    leaky = coord_loss(logits_peaked_at(3, outside=10.0), COORD_IDS, target, 1.0)
    assert leaky.gate > 0.9


def test_coord_loss_gradient_moves_mass_towards_target():
    logits = torch.zeros(1, V, requires_grad=True)
    terms = coord_loss(logits, COORD_IDS, torch.tensor([7.0]), 1.0)
    terms.total.backward()
    g = logits.grad[0]
    assert g[27] < 0 and g[20] > 0, "descent raises the target bin and lowers far bins"
    assert (g[:20] > 0).all(), "descent lowers non-coord tokens (gate)"


def test_objective_uses_only_labelled_positions_and_segments_split():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, V)
    batch = {
        "ce_index": torch.tensor([[0, 2], [1, 5]]), "ce_labels": torch.tensor([4, 7]),
        "ce_segment": torch.tensor([0, 1]),
        "coord_index": torch.tensor([[0, 4]]), "coord_targets": torch.tensor([3.0]),
        "coord_segment": torch.tensor([0]), "num_segments": torch.tensor(2),
    }
    w = LossWeights(coord_w1=0.0, coord_gate=0.0)
    total, terms = objective(logits, batch, COORD_IDS, w)
    lp = torch.log_softmax(logits, -1)
    ce = -(lp[0, 1, 4] + lp[1, 4, 7]) / 2
    q = soft_targets(torch.tensor([3.0]), 2.0, C)[0]
    soft = -(q * torch.log_softmax(logits[0, 3, 20:30], -1)).sum()
    assert math.isclose(terms["loss/ce"], float(ce), rel_tol=1e-5)
    assert math.isclose(float(total), float(ce + soft), rel_tol=1e-5)
    per = per_segment_losses(logits, batch, COORD_IDS, w)
    assert torch.allclose(per, torch.stack([-lp[0, 1, 4] + soft, -lp[1, 4, 7]]), rtol=1e-5)
