"""Prompt construction and encoding: one chat template for rollouts and the training forward alike.

``PromptEncoder.encode(sample)`` returns the prompt token ids (image placeholders expanded for VL models)
plus the multimodal tensors; rollout backends and the trainer both use it, which is what makes the strict
prompt-alignment check meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.data.images import load_image
from trainer.data.records import DatasetError, Sample

DEFAULT_INSTRUCTION = (
    "Detect every object. Answer with one JSON object: keys object_1, object_2, ... in reading order, "
    "each {\"desc\": ..., \"bbox_2d\": [x1, y1, x2, y2]} or {\"desc\": ..., \"poly\": [...]} with coord tokens."
)


@dataclass
class EncodedPrompt:
    input_ids: list[int]
    messages: list[dict[str, Any]]
    images: list[str]
    mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)


IMAGE_PAD = "<|image_pad|>"


def expand_image_pads(text: str, image_grid_thw: torch.Tensor, merge_size: int) -> str:
    """Replace the i-th ``<|image_pad|>`` by ``t*h*w / merge_size**2`` copies (the Qwen2/2.5/3-VL rule)."""
    pieces = text.split(IMAGE_PAD)
    if len(pieces) - 1 != len(image_grid_thw):
        raise ValueError(f"prompt has {len(pieces) - 1} image placeholders but {len(image_grid_thw)} images")
    out = [pieces[0]]
    for grid, rest in zip(image_grid_thw.tolist(), pieces[1:]):
        n = grid[0] * grid[1] * grid[2] // (merge_size**2)
        out.append(IMAGE_PAD * n + rest)
    return "".join(out)


def upright_image(sample: Sample, path: str):
    """Image ``path`` of ``sample`` as trained on (``load_image``: EXIF orientation applied, RGB); its size must be
    the record's (checked from the header at load; this catches a file replaced since, or an orientation PIL only
    finds once the pixels are decoded)."""
    image = load_image(path)
    if image.size != (sample.width, sample.height):
        raise DatasetError(f"sample {sample.sample_id!r}: image {path} is {image.size[0]}x{image.size[1]} as displayed "
                           f"but the record declares {sample.width}x{sample.height}; run `python -m trainer data "
                           "check` on the dataset")
    return image


class PromptEncoder:
    """Builds chat messages for a sample and encodes them with the model's template.

    Text-only models see the record's ``scene`` text (an error if it lacks one); VL models see the images,
    preprocessed by the model's image processor, with one ``<|image_pad|>`` per merged patch. ``pixel_dtype``
    (a 16-bit model's weight dtype, or None): the pixel values are kept in it. The vision tower casts them to its
    weights' dtype first thing, so a 16-bit model sees the same values, and every copy of them (packing, to the GPU,
    the carry, the rollout buffer) moves half the bytes of float32.
    """

    def __init__(self, tokenizer, image_processor=None, system_prompt: str | None = None,
                 instruction: str = DEFAULT_INSTRUCTION, pixel_dtype: torch.dtype | None = None):
        if pixel_dtype is not None and pixel_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"pixel_dtype must be a 16-bit model dtype or None (float32 pixels), got {pixel_dtype}")
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.system_prompt = system_prompt
        self.instruction = instruction
        self.pixel_dtype = pixel_dtype

    @property
    def multimodal(self) -> bool:
        return self.image_processor is not None

    def messages(self, sample: Sample) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        if self.multimodal:
            content = [{"type": "image", "image": p} for p in sample.images]
            content.append({"type": "text", "text": self.instruction})
            msgs.append({"role": "user", "content": content})
        else:
            if sample.scene is None:
                raise ValueError(
                    f"sample {sample.sample_id!r} has no 'scene' text; a text-only model needs it "
                    "(use a VL model, or add scene text to the record)"
                )
            msgs.append({"role": "user", "content": f"{self.instruction}\nScene: {sample.scene}"})
        return msgs

    def encode(self, sample: Sample, pixels: bool = True) -> EncodedPrompt:
        """The prompt ids and, for a VL model, ``mm_inputs`` (``pixel_values``, ``image_grid_thw``). ``pixels=False``
        (only where ``can_defer_pixels``): ``image_grid_thw`` alone, computed from the record's displayed size the way
        the image processor resizes; ``pixels`` computes the rest later (the ids are the same either way)."""
        msgs = self.messages(sample)
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if not self.multimodal:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return EncodedPrompt(list(ids), msgs, list(sample.images))
        mm: dict[str, torch.Tensor] = {}
        if sample.images:
            if pixels:
                mm = self.pixels(sample)
            else:
                if not self.can_defer_pixels:
                    raise ValueError(f"{type(self.image_processor).__name__} is not a Qwen2-VL-style processor: the "
                                     "image grid cannot be known before its pixels")
                mm = {"image_grid_thw": torch.tensor([self.image_grid(sample.width, sample.height)] * len(sample.images))}
            text = expand_image_pads(text, mm["image_grid_thw"], self.image_processor.merge_size)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return EncodedPrompt(list(ids), msgs, list(sample.images), mm)

    def pixels(self, sample: Sample) -> dict[str, torch.Tensor]:
        """``pixel_values`` (in ``pixel_dtype``) and ``image_grid_thw`` of the sample's images: the image processor's
        work, no tokenizer (safe on another thread while this encoder's tokenizer is in use)."""
        images = [upright_image(sample, p) for p in sample.images]
        out = self.image_processor(images=images, return_tensors="pt")
        values = out["pixel_values"]
        return {"pixel_values": values if self.pixel_dtype is None else values.to(self.pixel_dtype),
                "image_grid_thw": out["image_grid_thw"]}

    @property
    def can_defer_pixels(self) -> bool:
        """A Qwen2/2.5/3-VL-style processor that resizes (``patch_size``, ``merge_size``, ``size`` with
        ``shortest_edge`` / ``longest_edge`` in pixels): its grid follows from the image size alone."""
        ip = self.image_processor
        return (ip is not None and getattr(ip, "do_resize", False) and isinstance(getattr(ip, "patch_size", None), int)
                and isinstance(getattr(ip, "merge_size", None), int)
                and all(isinstance(e, int) for e in self._pixel_bounds()))

    def _pixel_bounds(self) -> tuple[Any, Any]:
        """The processor's ``size`` as ``(min_pixels, max_pixels)`` (a dict or transformers' ``SizeDict``)."""
        size = getattr(self.image_processor, "size", None)
        keys = ("shortest_edge", "longest_edge")
        return tuple(size.get(k) if isinstance(size, dict) else getattr(size, k, None) for k in keys)

    def image_grid(self, width: int, height: int) -> list[int]:
        """``[t, h, w]`` patches the image processor makes of a ``width`` x ``height`` image (one frame)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.image_processor
        lo, hi = self._pixel_bounds()
        h, w = smart_resize(height, width, factor=ip.patch_size * ip.merge_size, min_pixels=lo, max_pixels=hi)
        return [1, h // ip.patch_size, w // ip.patch_size]

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
