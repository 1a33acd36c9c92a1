"""LM-head logits only at the positions stage 2 supervises.

Prompt, image and unsupervised rollout-prefix tokens need hidden states but no logits. Inside
``capture_lm_head_input`` the model's output embedding projects an empty slice and the final hidden states are
kept instead; ``supervised_rows`` then projects only the rows that predict a CE label or a coord slot. With
``coord_only`` (allowed when the coord gate weight is 0) coord rows are projected onto the coord-token columns
alone. No full-vocabulary logits (and no fp32 copy of them) exist for unsupervised positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SupervisedRows:
    """Logit rows that predict the supervised tokens, in batch index order.

    ``ce``: ``[N_ce, V]``. ``coord``: ``[N_coord, V]``, or ``[N_coord, K]`` over ``coord_ids`` when ``coord_only``.
    """

    ce: torch.Tensor
    coord: torch.Tensor
    coord_only: bool = False


@dataclass
class HiddenCapture:
    hidden: torch.Tensor | None = None


def _predicting(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of ``rows`` (``[B, T, ·]``) at ``(r, c - 1)`` for every ``(r, c)`` in ``index``."""
    return rows[index[:, 0], index[:, 1] - 1]


def rows_from_logits(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> SupervisedRows:
    """The full-logits path: gather supervised rows out of ``[B, T, V]`` logits."""
    return SupervisedRows(_predicting(logits, batch["ce_index"]), _predicting(logits, batch["coord_index"]))


def output_embedding(model: torch.nn.Module) -> torch.nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head); set "
                         "custom.extra.rollout_matching.loss.supervised_logits_only: false")
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", None) or config
    if getattr(text_config, "final_logit_softcapping", None):
        raise ValueError("supervised-only logits do not apply final_logit_softcapping; set "
                         "custom.extra.rollout_matching.loss.supervised_logits_only: false for this model")
    return head


@contextmanager
def capture_lm_head_input(model: torch.nn.Module) -> Iterator[HiddenCapture]:
    """Inside the block the model's LM head sees a zero-length sequence; the hidden states it was given are
    kept in the yielded capture (the last call wins). The hook is removed on exit, also on exceptions."""
    capture = HiddenCapture()

    def keep_and_empty(_module, args):
        hidden = args[0]
        capture.hidden = hidden
        return (hidden[..., :0, :], *args[1:])

    handle = output_embedding(model).register_forward_pre_hook(keep_and_empty)
    try:
        yield capture
    finally:
        handle.remove()


def _plain_linear(head: torch.nn.Module) -> bool:
    weight = getattr(head, "weight", None)
    return type(head) is torch.nn.Linear and weight is not None and not hasattr(weight, "ds_id")


def project_coord_columns(hidden: torch.Tensor, head: torch.nn.Module, coord_ids: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` at the ``coord_ids`` columns only (``[N, K]``): the K weight rows alone when the head is a
    plain linear layer, else the full projection then the columns."""
    ids = coord_ids.to(hidden.device)
    if _plain_linear(head):
        bias = None if head.bias is None else head.bias.index_select(0, ids)
        return F.linear(hidden, head.weight.index_select(0, ids), bias)
    return head(hidden).index_select(-1, ids)


def supervised_hidden(hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The final hidden states ``[N_ce, H]`` and ``[N_coord, H]`` that predict the CE labels and the coord slots."""
    return (_predicting(hidden, batch["ce_index"].to(hidden.device)),
            _predicting(hidden, batch["coord_index"].to(hidden.device)))


def supervised_rows(hidden: torch.Tensor, head: torch.nn.Module, batch: dict[str, torch.Tensor],
                    coord_ids: torch.Tensor, coord_only: bool = False) -> SupervisedRows:
    """Project the final hidden states ``[B, T, H]`` through ``head`` only at supervised positions."""
    ce_hidden, coord_hidden = supervised_hidden(hidden, batch)
    ce = head(ce_hidden)
    if not coord_only:
        return SupervisedRows(ce, head(coord_hidden))
    return SupervisedRows(ce, project_coord_columns(coord_hidden, head, coord_ids), coord_only=True)
