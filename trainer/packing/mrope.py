"""3-D mRoPE position ids of one packed segment (Qwen2-VL / Qwen2.5-VL / Qwen3-VL, images only), without the
per-token Python loop of the models' ``get_rope_index`` (~5 ms a 3k-token segment on a CPU core; a 2B step of 64
records packs 63 segments).

The rule, as those models define it for images: a text run continues the position from where the sequence stands,
the same on all three axes; an image run of ``t x (h/m) x (w/m)`` tokens (``m`` the spatial merge) takes
``start + (t, row, column)`` per token; the text after it starts at ``start + max(h/m, w/m)``. A segment restarts at 0.

``SegmentPositions`` checks the rule against the model's own ``get_rope_index`` on the first segments it sees with
an image, and uses the model's for good (with a warning) if they ever differ: a model whose rule is not this one
(video grids, another family, a changed transformers) keeps its own positions.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

#: segments with an image checked against the model's ``get_rope_index`` before the rule is trusted for that model
CHECKED_SEGMENTS = 2


def image_runs(ids: torch.Tensor, image_token_id: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each maximal run of ``image_token_id`` in the 1-D ``ids``, in order."""
    is_image = (ids == image_token_id).to(torch.int8)
    edges = torch.diff(is_image, prepend=is_image.new_zeros(1), append=is_image.new_zeros(1))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends))


def segment_positions(ids: Sequence[int] | torch.Tensor, image_token_id: int, image_grid_thw: torch.Tensor | None,
                      spatial_merge_size: int) -> torch.Tensor:
    """``[3, L]`` positions of one segment by the rule above; one image run per row of ``image_grid_thw`` (``t``
    must be 1: images). ``ValueError`` when the runs and the grids disagree."""
    ids = torch.as_tensor(ids)
    runs = image_runs(ids, image_token_id)
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    if len(runs) != len(grids):
        raise ValueError(f"{len(runs)} image-token runs but {len(grids)} image grids")
    out = torch.empty(3, ids.numel(), dtype=torch.long)
    at, pos = 0, 0
    for (start, end), (t, h, w) in zip(runs, grids):
        hh, ww = h // spatial_merge_size, w // spatial_merge_size
        if t != 1 or end - start != hh * ww:
            raise ValueError(f"image run of {end - start} tokens for grid {[t, h, w]} (merge {spatial_merge_size})")
        out[:, at:start] = torch.arange(pos, pos + start - at)
        pos += start - at
        out[0, start:end] = pos
        out[1, start:end] = (torch.arange(hh) + pos).repeat_interleave(ww)
        out[2, start:end] = (torch.arange(ww) + pos).repeat(hh)
        pos += max(hh, ww)
        at = end
    out[:, at:] = torch.arange(pos, pos + ids.numel() - at)
    return out


def _rope_owner(model):
    inner = getattr(model, "model", model)
    while not hasattr(inner, "get_rope_index") and hasattr(inner, "model"):
        inner = inner.model
    return inner


class SegmentPositions:
    """Per-model choice between the rule and the model's ``get_rope_index`` (see the module docstring)."""

    def __init__(self) -> None:
        self._checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> segments agreed, or -1

    def __call__(self, model, ids: Sequence[int], image_grid_thw: torch.Tensor | None,
                 image_token_id: int) -> torch.Tensor:
        """``[3, L]`` positions of one segment."""
        owner = _rope_owner(model)
        agreed = self._checked.get(owner, 0)
        merge = getattr(getattr(getattr(owner, "config", None), "vision_config", None), "spatial_merge_size", None)
        if agreed < 0 or merge is None:
            return self.models_own(owner, ids, image_grid_thw, image_token_id)
        if agreed >= CHECKED_SEGMENTS:
            return segment_positions(ids, image_token_id, image_grid_thw, merge)
        own = self.models_own(owner, ids, image_grid_thw, image_token_id)
        try:
            ours = segment_positions(ids, image_token_id, image_grid_thw, merge)
        except ValueError as exc:
            ours, why = None, str(exc)
        else:
            why = "positions differ"
        if ours is not None and torch.equal(ours, own):
            if image_grid_thw is not None and len(image_grid_thw):
                self._checked[owner] = agreed + 1
            return own
        log.warning("mRoPE positions: %s's get_rope_index and the image rule disagree (%s); packing keeps the "
                    "model's own (slower: a Python loop per token)", type(owner).__name__, why)
        self._checked[owner] = -1
        return own

    @staticmethod
    def models_own(owner, ids: Sequence[int], image_grid_thw: torch.Tensor | None,
                   image_token_id: int) -> torch.Tensor:
        row = torch.tensor([list(ids)])
        pos, _ = owner.get_rope_index(row, image_grid_thw=image_grid_thw, video_grid_thw=None,
                                      attention_mask=torch.ones_like(row),
                                      mm_token_type_ids=(row == image_token_id).long())
        return pos[:, 0]
