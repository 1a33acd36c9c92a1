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
    for seg, (t, r, off) in enumerate(zip(targets, rows, offsets)):
        for c, lab in enumerate(t.labels):
            if lab != IGNORE_INDEX:
                if c == 0:
                    raise ValueError(f"sample {t.sample_id!r}: the first token cannot carry a label")
                ce_index.append((r, off + c))
                ce_labels.append(lab)
                ce_seg.append(seg)
        for c, tgt in zip(t.coord_positions, t.coord_targets):
            co_index.append((r, off + c))
            co_targets.append(tgt)
            co_seg.append(seg)
    return {
        "ce_index": torch.tensor(ce_index, dtype=torch.long).reshape(-1, 2),
        "ce_labels": torch.tensor(ce_labels, dtype=torch.long),
        "ce_segment": torch.tensor(ce_seg, dtype=torch.long),
        "coord_index": torch.tensor(co_index, dtype=torch.long).reshape(-1, 2),
        "coord_targets": torch.tensor(co_targets, dtype=torch.float32),
        "coord_segment": torch.tensor(co_seg, dtype=torch.long),
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
