"""Targets → model batch, the padded layout (one target per row; ``packed_batch`` is the packed one). Loss positions are flat ``(row, col)`` indices so the padded layout (one target
per row) and the packed layout (many targets in one row) share the loss code.

A CE label at ``(r, c)`` is predicted by the logits at ``(r, c - 1)``; the same holds for coord slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.matching.targets import IGNORE_INDEX, TrainTarget


def loss_indices(targets: Sequence[TrainTarget], rows: Sequence[int], offsets: Sequence[int]) -> dict[str, torch.Tensor]:
    """Flat ``(row, col)`` CE and coord positions of ``targets`` placed at ``rows`` / column ``offsets``."""
    ce_index, ce_labels, ce_seg = [], [], []
    co_index, co_targets, co_seg = [], [], []
    lp_index, lp_engine = [], []
    for seg, (t, r, off) in enumerate(zip(targets, rows, offsets)):
        if t.engine_logprobs:
            cols_lp = torch.tensor([p for p, _ in t.engine_logprobs], dtype=torch.long)
            lp_index.append(torch.stack([torch.full_like(cols_lp, r), cols_lp + off], dim=1))
            lp_engine.append(torch.tensor([v for _, v in t.engine_logprobs], dtype=torch.float32))
        labels = torch.tensor(t.labels, dtype=torch.long)
        cols = torch.nonzero(labels != IGNORE_INDEX).flatten()
        if cols.numel() and int(cols[0]) == 0:
            raise ValueError(f"sample {t.sample_id!r}: the first token cannot carry a label")
        ce_index.append(torch.stack([torch.full_like(cols, r), cols + off], dim=1))
        ce_labels.append(labels[cols])
        ce_seg.append(torch.full_like(cols, seg))
        positions = torch.tensor(list(t.coord_positions), dtype=torch.long)
        co_index.append(torch.stack([torch.full_like(positions, r), positions + off], dim=1))
        co_targets.append(torch.tensor(list(t.coord_targets), dtype=torch.float32))
        co_seg.append(torch.full_like(positions, seg))

    def cat(parts: list[torch.Tensor], dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
        if parts:
            return torch.cat(parts)
        return torch.empty((0, width) if width else (0,), dtype=dtype)

    return {
        "ce_index": cat(ce_index, torch.long, 2),
        "ce_labels": cat(ce_labels, torch.long),
        "ce_segment": cat(ce_seg, torch.long),
        "coord_index": cat(co_index, torch.long, 2),
        "coord_targets": cat(co_targets, torch.float32),
        "coord_segment": cat(co_seg, torch.long),
        # the train-inference mismatch (trainer.sft.mismatch): kept rollout tokens and the engine's log-probabilities
        "logp_index": cat(lp_index, torch.long, 2),
        "logp_engine": cat(lp_engine, torch.float32),
    }


def multimodal_inputs(targets: Sequence[TrainTarget]) -> dict[str, torch.Tensor]:
    """The image tensors of ``targets`` concatenated in target order (``{}`` for text-only targets)."""
    with_images = [t.mm_inputs for t in targets if t.mm_inputs]
    if not with_images:
        return {}
    return {
        "pixel_values": torch.cat([m["pixel_values"] for m in with_images]),
        "image_grid_thw": torch.cat([m["image_grid_thw"] for m in with_images]),
    }


def pad_targets(targets: Sequence[TrainTarget], pad_id: int, image_token_id: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch, one target per row."""
    if not targets:
        raise ValueError("pad_targets needs at least one target")
    width = max(t.length for t in targets)
    ids = torch.full((len(targets), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(targets), width), dtype=torch.long)
    for i, t in enumerate(targets):
        ids[i, : t.length] = torch.tensor(t.input_ids)
        mask[i, : t.length] = 1
    batch = {"input_ids": ids, "attention_mask": mask, **multimodal_inputs(targets)}
    if "pixel_values" in batch and image_token_id is not None:
        batch["mm_token_type_ids"] = (ids == image_token_id).long() * mask
    batch.update(loss_indices(targets, list(range(len(targets))), [0] * len(targets)))
    batch["num_segments"] = torch.tensor(len(targets))
    return batch
