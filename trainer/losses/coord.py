"""Coord losses at supervised coord positions: ``softCE(q, p) + λ_w1·W1(p, q) + λ_gate·gate``.

p = softmax over the 1000 coord-token logits; q = a unimodal soft target (discretised Gaussian, σ in bins)
around a continuous target bin; W1 = Σ|CDF_p − CDF_q| (1-D Wasserstein over bins, in bin units / 1000);
gate = probability mass that the full-vocabulary softmax puts outside the coord tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.data.objects import NUM_BINS


@dataclass(frozen=True)
class CoordLossTerms:
    softce: torch.Tensor
    w1: torch.Tensor
    gate: torch.Tensor
    total: torch.Tensor
    count: int


def soft_targets(target_bins: torch.Tensor, sigma: float, num_bins: int = NUM_BINS) -> torch.Tensor:
    """N×num_bins unimodal distributions centred on each (continuous) target bin."""
    grid = torch.arange(num_bins, device=target_bins.device, dtype=torch.float32)
    logits = -0.5 * ((grid[None, :] - target_bins.float()[:, None]) / sigma) ** 2
    return torch.softmax(logits, dim=-1)


def check_coord_only_gate(coord_only: bool, gate_weight: float) -> None:
    """Coord-only rows (the K coord columns) cannot give the gate, which needs the full vocabulary."""
    if coord_only and gate_weight:
        raise ValueError("coord-only logits cannot compute the coord gate; set coord_gate_weight: 0 or use "
                         "full-vocabulary coord rows")


def coord_row_terms(logits: torch.Tensor, coord_ids: torch.Tensor, target_bins: torch.Tensor, sigma: float,
                    coord_only: bool = False, need_gate: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(softce, w1, gate)`` (float32, ``[N]`` each) of the rows ``logits`` (see ``coord_loss``); the gate
    is zeros for coord-only rows."""
    check_coord_only_gate(coord_only, need_gate)
    logits = logits.float()
    coord_logits = logits if coord_only else logits.index_select(-1, coord_ids)
    log_p = F.log_softmax(coord_logits, dim=-1)
    q = soft_targets(target_bins, sigma, coord_ids.numel())
    softce = -(q * log_p).sum(-1)
    cdf_gap = torch.cumsum(log_p.exp(), -1) - torch.cumsum(q, -1)
    w1 = cdf_gap.abs().sum(-1) / coord_ids.numel()
    if coord_only:
        gate = torch.zeros_like(w1)
    else:
        inside = torch.logsumexp(coord_logits, -1) - torch.logsumexp(logits, -1)
        gate = 1.0 - inside.exp()
    return softce, w1, gate


def coord_loss(logits: torch.Tensor, coord_ids: torch.Tensor, target_bins: torch.Tensor, sigma: float,
               w_softce: float = 1.0, w_w1: float = 1.0, w_gate: float = 1.0,
               coord_only: bool = False, denominator: int | None = None) -> CoordLossTerms:
    """``logits``: N×V rows that predict the supervised coord tokens (N×K coord columns in ``coord_ids`` order
    when ``coord_only``; the gate needs the full vocabulary, so then ``w_gate`` must be 0); summed over N and divided
    by ``denominator`` (default N: the mean; a step's coord-slot count when N is one micro-batch of it)."""
    check_coord_only_gate(coord_only, w_gate)
    n = logits.shape[0]
    if n == 0:
        zero = logits.sum() * 0.0
        return CoordLossTerms(zero, zero, zero, zero, 0)
    den = n if denominator is None else denominator
    softce, w1, gate = coord_row_terms(logits, coord_ids, target_bins, sigma, coord_only, need_gate=bool(w_gate))
    total = w_softce * softce + w_w1 * w1 + w_gate * gate
    return CoordLossTerms(softce.sum() / den, w1.sum() / den, gate.sum() / den, total.sum() / den, n)
