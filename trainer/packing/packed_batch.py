"""Pack targets into one row (bsz 1): per-segment position ids, attention that never crosses segments, and
loss indices shifted by each segment's offset.

Attention layouts: ``flash_attention_2`` and ``rm_varlen`` / ``rm_varlen_api`` (``trainer.packing.varlen_attention``)
get restarting ``position_ids`` plus ``cu_seq_lens_q/k`` and ``max_length_q/k`` (no mask is materialised; multimodal
varlen batches carry them as ``packed_cu_seq_lens`` / ``packed_max_length`` for ``packed_attention``'s side channel
instead); ``sdpa`` gets a boolean block-diagonal causal mask; ``eager`` the additive form of that mask.
For Qwen-VL models the 3-D mRoPE position ids are computed per segment (``trainer.packing.mrope``: the image rule,
checked against ``model.get_rope_index`` first) and the image tensors are concatenated in segment order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.matching.targets import TrainTarget
from trainer.packing.batching import loss_indices, multimodal_inputs
from trainer.packing.mrope import SegmentPositions
from trainer.packing.varlen_attention import VARLEN_KERNELS

VARLEN_LAYOUTS = ("flash_attention_2", *VARLEN_KERNELS.values())
#: each model's segment positions: the image rule once checked against its ``get_rope_index``, else its own
SEGMENT_POSITIONS = SegmentPositions()


def segment_ids(lengths: Sequence[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))


def block_causal_mask(lengths: Sequence[int], additive_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[1, 1, L, L] mask: causal within a segment, nothing across segments (bool, or additive float)."""
    seg = segment_ids(lengths)
    n = seg.numel()
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool)) & (seg[:, None] == seg[None, :])
    if additive_dtype is None:
        return allowed[None, None]
    mask = torch.zeros(n, n, dtype=additive_dtype)
    mask.masked_fill_(~allowed, torch.finfo(additive_dtype).min)
    return mask[None, None]


def image_positions(image_mask: torch.Tensor) -> torch.Tensor:
    """``[2, N]`` (row, column) of every image token of the ``[B, L]`` mask, in the order the boolean mask selects
    them (row-major): where the deepstack merge adds the vision features (``trainer.modeling.vision_metadata``)."""
    return torch.stack(torch.nonzero(image_mask, as_tuple=True))


def mrope_position_ids(model, targets: Sequence[TrainTarget], image_token_id: int) -> torch.Tensor:
    """[3, 1, L] mRoPE ids, computed for each segment alone and concatenated (each restarts at 0;
    ``trainer.packing.mrope``)."""
    parts = []
    for t in targets:
        try:
            parts.append(SEGMENT_POSITIONS(model, t.input_ids, t.mm_inputs.get("image_grid_thw"), image_token_id))
        except ValueError as exc:
            raise ValueError(f"sample {t.sample_id!r}: mRoPE positions: {exc}") from exc
    return torch.cat(parts, dim=-1)[:, None]


def pack_targets(targets: Sequence[TrainTarget], attn_implementation: str, model=None,
                 image_token_id: int | None = None, mask_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    if not targets:
        raise ValueError("pack_targets needs at least one target")
    lengths = [t.length for t in targets]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    ids = torch.tensor([[tok for t in targets for tok in t.input_ids]])
    batch: dict[str, torch.Tensor] = {"input_ids": ids, **multimodal_inputs(targets)}
    # a multimodal model's rows have one layout with or without images (mRoPE ids, the side channel), so what its
    # compiled decoder layers receive never changes with the pack
    multimodal = "pixel_values" in batch or (model is not None and image_token_id is not None)
    if multimodal:
        if model is None or image_token_id is None:
            raise ValueError("packing a multimodal batch needs the model (for mRoPE) and the image token id")
        batch["position_ids"] = mrope_position_ids(model, targets, image_token_id)
        images = ids == image_token_id
        batch["mm_token_type_ids"] = images.long()
        batch["image_positions"] = image_positions(images)
    else:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    if attn_implementation in VARLEN_KERNELS.values() and multimodal:
        batch["packed_cu_seq_lens"] = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()],
                                                   dtype=torch.int32)
        batch["packed_max_length"] = max(lengths)
    elif attn_implementation in VARLEN_LAYOUTS:
        cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
        batch["cu_seq_lens_q"] = cu
        batch["cu_seq_lens_k"] = cu.clone()
        batch["max_length_q"] = max(lengths)
        batch["max_length_k"] = max(lengths)
    else:
        batch["attention_mask"] = block_causal_mask(lengths, None if attn_implementation == "sdpa" else mask_dtype)
    batch.update(loss_indices(targets, [0] * len(targets), offsets))
    batch["num_segments"] = torch.tensor(len(targets))
    return batch
