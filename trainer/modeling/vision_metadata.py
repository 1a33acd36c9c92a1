"""Qwen3-VL's vision metadata made on the host, so the encoder reads no GPU value back (``host_vision_metadata``).

Qwen3-VL's vision encoder derives its attention segments, rotary positions and position-embedding interpolation from
``image_grid_thw``. On a GPU grid each derivation reads values back to the host (``repeat_interleave`` with tensor
repeats, ``.tolist()``, and, without flash attention, a ``.tolist()`` of the segment lengths for each of q, k and v in
every vision layer): one wait for the GPU each, about eighty a packed row at 4B (24 vision layers), and every one drains
the GPU's queue. transformers (>= 5.17,
``transformers.vision_utils``) lets a caller hand these in precomputed. ``install_host_vision_metadata`` adds a forward
pre-hook to the vision encoder: when ``grid_thw`` arrives on the host (the trainer keeps ``image_grid_thw`` there), the
hook computes them with transformers' own helpers on the CPU, moves what the GPU needs to the pixels' device without
waiting, and leaves the segment boundaries on the host where only their lengths are read. A grid on the GPU (HF-backend
rollouts) passes through untouched.

The deepstack merge of the text model adds the encoder's features at the image tokens through a boolean mask, a
host wait per deepstack layer in the forward and more in the backward. The collator's ``image_positions``
(``trainer.packing.packed_batch``, from the token ids on the host) let it index by position instead:
``install_host_vision_metadata`` also wraps the text model's ``_deepstack_process``, which uses the positions
``deepstack_positions`` hands it for one forward when their count matches the features, and the model's own merge
otherwise.

Invariant: the encoder's outputs equal those it computes from the grid itself (``vision_metadata`` calls the helpers
the encoder would call, with the encoder's own settings); the merge by positions equals the merge by mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

#: what a vision encoder must expose for the helpers to reproduce its own derivation (Qwen3-VL's, Qwen3-VL-MoE's)
_ENCODER_ATTRS = ("num_grid_per_side", "interpolation_mode", "interpolation_align_corners", "spatial_merge_size",
                  "config")


@dataclass(frozen=True)
class VisionMetadata:
    """The encoder's per-batch metadata, all on the host: segment boundaries (int32), the longest segment, the
    patches' rotary position ids and the position-embedding interpolation taps."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    interp_indices: torch.Tensor
    interp_weights: torch.Tensor


def supports_host_metadata(encoder: torch.nn.Module) -> bool:
    """Whether ``encoder`` derives its metadata through ``transformers.vision_utils`` with these settings."""
    return all(hasattr(encoder, a) for a in _ENCODER_ATTRS) and type(encoder).__name__.startswith("Qwen3VL")


def vision_metadata(encoder: torch.nn.Module, grid_thw: torch.Tensor) -> VisionMetadata:
    """What ``encoder`` would derive from ``grid_thw`` (a host tensor), by the same helpers and settings."""
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    if grid_thw.device.type != "cpu":
        raise ValueError(f"vision_metadata needs the grid on the host, got {grid_thw.device}")
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=encoder.num_grid_per_side, mode=encoder.interpolation_mode,
        align_corners=encoder.interpolation_align_corners, spatial_merge_size=encoder.config.spatial_merge_size)
    cu = get_vision_cu_seqlens(grid_thw)
    longest = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
    return VisionMetadata(cu, longest, get_vision_position_ids(grid_thw, encoder.spatial_merge_size), indices, weights)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def encoder_kwargs(meta: VisionMetadata, device: torch.device, flash: bool) -> dict[str, Any]:
    """The encoder's precomputed kwargs: rotary ids and interpolation taps on ``device``; the segment boundaries on
    the host unless the encoder's attention is flash-style (``flash``: it reads them on the GPU)."""
    return {"cu_seqlens": _to_device(meta.cu_seqlens, device) if flash else meta.cu_seqlens,
            "max_seqlen": meta.max_seqlen,
            "position_ids": _to_device(meta.position_ids, device),
            "interp_indices": _to_device(meta.interp_indices, device),
            "interp_weights": _to_device(meta.interp_weights, device)}


def _pre_hook(encoder: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
    pixels = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(grid, torch.Tensor) or grid.device.type != "cpu" or "cu_seqlens" in kwargs:
        return None
    from transformers.utils.generic import is_flash_attention_requested

    extra = encoder_kwargs(vision_metadata(encoder, grid), pixels.device, is_flash_attention_requested(encoder.config))
    return args, {**kwargs, **extra}


def _merge_by_positions(text_model: torch.nn.Module, merge_by_mask):
    def merge(hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor, visual_embeds: torch.Tensor) -> torch.Tensor:
        positions = getattr(text_model, "_rm_image_positions", None)
        if positions is None or positions.shape[1] != visual_embeds.shape[0] or hidden_states.dim() != 3:
            return merge_by_mask(hidden_states, visual_pos_masks, visual_embeds)
        visual_embeds = visual_embeds.to(hidden_states.device, hidden_states.dtype)
        return hidden_states.index_put((positions[0], positions[1]), visual_embeds, accumulate=True)

    return merge


def deepstack_owner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The text model whose deepstack merge ``install_host_vision_metadata`` wrapped (None: none was), to find once
    and hand to ``deepstack_positions`` at every forward."""
    return next((m for m in model.modules() if getattr(m, "_rm_merge_by_positions", False)), None)


@contextmanager
def deepstack_positions(text: torch.nn.Module | None, positions: torch.Tensor | None) -> Iterator[None]:
    """For the enclosed forward, the wrapped text model (``deepstack_owner``) merges the deepstack features at
    ``positions`` (``image_positions``, on the model's device); nothing changes when either is None."""
    if text is None or positions is None:
        yield
        return
    text._rm_image_positions = positions
    try:
        yield
    finally:
        text._rm_image_positions = None


def install_host_vision_metadata(model: torch.nn.Module) -> bool:
    """Hook the model's Qwen3-VL vision encoder and wrap its text model's deepstack merge, once (found among its
    modules, through a PEFT wrapper too); False when it has no such encoder (a text model, another family), and
    nothing is changed."""
    encoder = next((m for m in model.modules() if supports_host_metadata(m)), None)
    if encoder is None:
        return False
    if not getattr(encoder, "_rm_host_metadata", False):
        encoder.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        encoder._rm_host_metadata = True
    for text in (m for m in model.modules() if hasattr(m, "_deepstack_process")):
        if not getattr(text, "_rm_merge_by_positions", False):
            text._deepstack_process = _merge_by_positions(text, text._deepstack_process)
            text._rm_merge_by_positions = True
            text._rm_image_positions = None
    return True
