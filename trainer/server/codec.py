"""The prompt codec of the rollout server: ms-swift request messages → prompt ids with the served model's own chat
template (the learner encodes prompts the same way), and response ids → text."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.data.images import ImageRefError
from trainer.data.images import load_image as read_image
from trainer.rollout.types import RolloutRequest
from trainer.server.protocol import RolloutInferRequestIn

IMAGE_TAG = "<image>"


class EngineRequestError(ValueError):
    """The request cannot be served by this engine (answered with HTTP 400 and this message)."""


def load_image(ref: str):
    """``trainer.data.images.load_image``; an unreadable reference is a bad request (400)."""
    try:
        return read_image(ref)
    except ImageRefError as exc:
        raise EngineRequestError(str(exc)) from exc


class PromptCodec:
    """Messages → prompt ids with the model's own chat template (the learner encodes prompts the same way).

    Images: ``{"type": "image"}`` content parts or ms-swift's ``<image>`` tags in string content, filled in
    order from the request's ``images`` (or the part's own ``image`` field); each placeholder is expanded to
    one ``<|image_pad|>`` per merged patch, as the training forward does.
    """

    def __init__(self, tokenizer, image_processor=None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor

    def _messages(self, req: RolloutInferRequestIn) -> tuple[list[dict[str, Any]], list[str]]:
        images = list(req.images)
        refs: list[str] = []
        out = []
        for m in req.messages:
            content = m.content
            if isinstance(content, str) and IMAGE_TAG in content:
                parts: list[dict[str, Any]] = []
                for i, piece in enumerate(content.split(IMAGE_TAG)):
                    if i:
                        parts.append({"type": "image"})
                    if piece:
                        parts.append({"type": "text", "text": piece})
                content = parts
            if isinstance(content, list):
                fixed = []
                for part in content:
                    if part.get("type") == "image":
                        ref = part.get("image") if isinstance(part.get("image"), str) else None
                        if ref is None:
                            if not images:
                                raise EngineRequestError("more image placeholders than images in the request")
                            ref = images.pop(0)
                        refs.append(ref)
                        fixed.append({"type": "image"})
                    else:
                        fixed.append(part)
                content = fixed
            out.append({"role": m.role, "content": content if content is not None else ""})
        if images:
            raise EngineRequestError(f"{len(images)} image(s) in the request have no placeholder in the messages")
        return out, refs

    def encode(self, req: RolloutInferRequestIn, index: int) -> RolloutRequest:
        from trainer.modeling.prompts import expand_image_pads

        messages, refs = self._messages(req)
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **req.chat_template_kwargs)
        except Exception as exc:
            raise EngineRequestError(f"request {index}: chat template failed: {exc}") from exc
        mm: dict[str, Any] = {}
        if refs:
            if self.image_processor is None:
                raise EngineRequestError(f"request {index} has images but the served model is text-only")
            out = self.image_processor(images=[load_image(r) for r in refs], return_tensors="pt")
            mm = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
            text = expand_image_pads(text, mm["image_grid_thw"], self.image_processor.merge_size)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        sample_id = req.uuid or str(index)
        return RolloutRequest(sample_id, tuple(m for m in messages), tuple(ids), tuple(refs), mm)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (the ``token`` of a logprobs entry)."""
        return self.tokenizer.decode([token_id])


def load_codec(model_dir: str | Path) -> PromptCodec:
    from transformers import AutoConfig, AutoTokenizer

    from trainer.modeling.loading import VL_MODEL_TYPES, load_image_processor

    tok = AutoTokenizer.from_pretrained(model_dir)
    processor = None
    if AutoConfig.from_pretrained(model_dir).model_type in VL_MODEL_TYPES:
        processor = load_image_processor(Path(model_dir))
    return PromptCodec(tok, processor)
