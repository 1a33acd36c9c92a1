"""The stage-2 objective from the final hidden states, projected through the LM head a chunk of rows at a time.

``objective_from_rows`` holds every supervised row's full-vocabulary logits at once: at a 16k-token pack of Qwen3-VL
(~9.7k supervised rows x 151,936 columns) that is ~3 GB of bf16 logits, a ~6 GB float32 copy and the ~5 GB
log-softmax the cross-entropy keeps for the backward. ``chunked_objective`` projects and reduces ``chunk_rows`` rows
at a time inside ``torch.utils.checkpoint``: a chunk's logits are gone before the next chunk is projected, and the
backward recomputes each chunk's projection (one more LM-head matmul per supervised row) and frees it in turn. What
stays for the backward is the chunks' hidden rows.

Invariants: the loss and the gradients equal ``objective_from_rows(supervised_rows(...))`` on the same inputs up to
float32 summation order (per-row terms summed per chunk, divided by the row counts); the detached terms carry the
same keys and stay on the device (``LossTerms``: nothing here waits for it); a batch without CE rows or coord slots
keeps the LM head in the graph (a zero term through it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.losses.coord import check_coord_only_gate, coord_row_terms
from trainer.losses.objective import LossTerms, LossWeights, denominators
from trainer.losses.supervised_logits import project_coord_columns, supervised_hidden


def _chunk_sums(fn: Callable[..., tuple[torch.Tensor, ...]], chunk_rows: int, *rows: torch.Tensor
                ) -> list[torch.Tensor]:
    """``fn`` over ``chunk_rows``-row slices of ``rows`` (each under ``checkpoint``), its outputs summed."""
    totals: list[torch.Tensor] | None = None
    for start in range(0, rows[0].shape[0], chunk_rows):
        part = checkpoint(fn, *(r[start:start + chunk_rows] for r in rows), use_reentrant=False)
        totals = list(part) if totals is None else [t + p for t, p in zip(totals, part)]
    assert totals is not None
    return totals


def chunked_objective(hidden: torch.Tensor, head: torch.nn.Module, batch: dict[str, torch.Tensor],
                      coord_ids: torch.Tensor, w: LossWeights, chunk_rows: int, coord_only: bool = False
                      ) -> tuple[torch.Tensor, LossTerms]:
    """Total loss and detached terms as ``objective_from_rows`` computes them from ``supervised_rows(hidden, head,
    batch, coord_ids, coord_only)``, with at most ``chunk_rows`` rows of logits alive at a time."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    check_coord_only_gate(coord_only, w.coord_gate)
    ce_hidden, coord_hidden = supervised_hidden(hidden, batch)
    labels = batch["ce_labels"].to(hidden.device)
    targets = batch["coord_targets"].to(hidden.device)
    ids = coord_ids.to(hidden.device)

    def ce_sum(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
        return (F.cross_entropy(head(h).float(), y, reduction="sum"),)

    def project(h: torch.Tensor) -> torch.Tensor:
        return project_coord_columns(h, head, ids) if coord_only else head(h)

    def coord_sums(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        softce, w1, gate = coord_row_terms(project(h), ids, t, w.coord_sigma, coord_only, need_gate=bool(w.coord_gate))
        return softce.sum(), w1.sum(), gate.sum()

    n_ce, n_coord = ce_hidden.shape[0], coord_hidden.shape[0]
    ce_den, coord_den = denominators(batch, n_ce, n_coord)
    if n_ce:
        ce = _chunk_sums(ce_sum, chunk_rows, ce_hidden, labels)[0] / ce_den
    else:
        ce = head(ce_hidden).float().sum() * 0.0
    if n_coord:
        softce, w1, gate = (s / coord_den for s in _chunk_sums(coord_sums, chunk_rows, coord_hidden, targets))
    else:
        softce = w1 = gate = project(coord_hidden).float().sum() * 0.0
    coord = w.coord_softce * softce + w.coord_w1 * w1 + w.coord_gate * gate
    total = w.text_ce * ce + coord
    terms = {
        "loss/ce": ce.detach(),
        "loss/coord_softce": softce.detach(),
        "loss/coord_w1": w1.detach(),
        "loss/coord_gate": gate.detach(),
        "loss/coord": coord.detach(),
        "tokens/ce": float(n_ce),
        "tokens/coord": float(n_coord),
    }
    if coord_only:
        del terms["loss/coord_gate"]
    return total, terms
