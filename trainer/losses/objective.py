"""The stage-2 objective over a model batch: masked CE on label positions + coord losses on coord slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.losses.coord import coord_loss
from trainer.losses.supervised_logits import SupervisedRows, rows_from_logits

#: the detached terms of a loss: ``loss/*`` are 0-d tensors on the loss's device, so computing them never waits for
#: the device (``float()`` on one does); ``tokens/*`` are counts known on the host
LossTerms = dict[str, "torch.Tensor | float"]


def host_terms(terms: LossTerms) -> dict[str, float]:
    """``terms`` as Python floats (waits for the device once, on the first tensor read)."""
    return {k: float(v) for k, v in terms.items()}


@dataclass(frozen=True)
class LossWeights:
    text_ce: float = 1.0
    coord_softce: float = 1.0
    coord_w1: float = 1.0
    coord_gate: float = 1.0
    coord_sigma: float = 2.0


def denominators(batch: dict[str, torch.Tensor], n_ce: int, n_coord: int) -> tuple[int, int]:
    """The counts the CE and coord sums are divided by: the batch's own (a mean over it) or, when the batch is one
    micro-batch of a step trained in several, the step's totals (``loss_ce_denominator`` / ``loss_coord_denominator``,
    ``trainer.packing.step_rows.step_denominators``), so the micro-batches' losses sum to the step's mean."""
    ce = batch.get("loss_ce_denominator")
    coord = batch.get("loss_coord_denominator")
    return (int(ce) if ce is not None else max(n_ce, 1)), (int(coord) if coord is not None else max(n_coord, 1))


def objective_from_rows(rows: SupervisedRows, batch: dict[str, torch.Tensor], coord_ids: torch.Tensor,
                        w: LossWeights) -> tuple[torch.Tensor, LossTerms]:
    """Total loss (CE summed over CE tokens + coord loss summed over coord slots, each divided by ``denominators``:
    the means over this batch unless the step's totals are given) and detached terms (``LossTerms``; no
    ``loss/coord_gate`` term for coord-only rows: the gate is not computed there)."""
    ce_rows = rows.ce
    labels = batch["ce_labels"].to(ce_rows.device)
    ce_den, coord_den = denominators(batch, ce_rows.shape[0], rows.coord.shape[0])
    if ce_rows.shape[0]:
        ce = F.cross_entropy(ce_rows.float(), labels, reduction="sum") / ce_den
    else:
        ce = ce_rows.sum() * 0.0 + rows.coord.sum() * 0.0
    coord = coord_loss(rows.coord, coord_ids.to(rows.coord.device), batch["coord_targets"].to(rows.coord.device),
                       w.coord_sigma, w.coord_softce, w.coord_w1, w.coord_gate, coord_only=rows.coord_only,
                       denominator=coord_den)
    total = w.text_ce * ce + coord.total
    terms = {
        "loss/ce": ce.detach(),
        "loss/coord_softce": coord.softce.detach(),
        "loss/coord_w1": coord.w1.detach(),
        "loss/coord_gate": coord.gate.detach(),
        "loss/coord": coord.total.detach(),
        "tokens/ce": float(ce_rows.shape[0]),
        "tokens/coord": float(coord.count),
    }
    if rows.coord_only:
        del terms["loss/coord_gate"]
    return total, terms


def objective(logits: torch.Tensor, batch: dict[str, torch.Tensor], coord_ids: torch.Tensor,
              w: LossWeights) -> tuple[torch.Tensor, dict[str, float]]:
    """``objective_from_rows`` on the rows gathered from full ``[B, T, V]`` logits."""
    return objective_from_rows(rows_from_logits(logits, batch), batch, coord_ids, w)


def per_segment_losses(logits: torch.Tensor, batch: dict[str, torch.Tensor], coord_ids: torch.Tensor,
                       w: LossWeights) -> torch.Tensor:
    """Loss of each segment (sample) separately, ``[num_segments]``: CE mean + coord mean per sample."""
    n = int(batch["num_segments"])
    out = []
    for s in range(n):
        sub = {
            "ce_index": batch["ce_index"][batch["ce_segment"] == s],
            "ce_labels": batch["ce_labels"][batch["ce_segment"] == s],
            "coord_index": batch["coord_index"][batch["coord_segment"] == s],
            "coord_targets": batch["coord_targets"][batch["coord_segment"] == s],
        }
        out.append(objective(logits, sub, coord_ids, w)[0])
    return torch.stack(out)
