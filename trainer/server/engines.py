"""Engines behind the rollout server and what they share: the prompt codec and the weight-update surface.

A server engine is a ``RolloutEngine`` (decode ``RolloutRequest``s) that can also take weights:
``load_full`` (HF checkpoint names), ``load_adapter`` (LoRA, when ``enable_lora``), ``reset_prefix_cache``,
``state_keys``, and the NCCL receive calls of ms-swift's protocol (``nccl_*``; buckets received between the
first ``nccl_receive_*`` and ``finish_weights`` form one update).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.data.images import ImageRefError
from trainer.data.images import load_image as read_image
from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.server.protocol import RolloutInferRequestIn
from trainer.sync.weights import AdapterWeights

IMAGE_TAG = "<image>"


class EngineRequestError(ValueError):
    """The request cannot be served by this engine (answered with HTTP 400 and this message)."""


def load_image(ref: str):
    """``trainer.data.images.load_image``; an unreadable reference is a bad request (400)."""
    try:
        return read_image(ref)
    except ImageRefError as exc:
        raise EngineRequestError(str(exc)) from exc


class ServerEngine(Protocol):
    kind: str
    model_name: str
    world_size: int
    enable_lora: bool

    def encode(self, request: RolloutInferRequestIn, index: int) -> RolloutRequest: ...

    def decode_text(self, ids: Sequence[int]) -> str: ...

    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]: ...

    def load_full(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def load_adapter(self, adapter: AdapterWeights) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def state_keys(self) -> list[str]: ...

    def nccl_init(self, host: str, port: int, world_size: int, backend: str = "pynccl") -> None: ...

    def nccl_receive_named(self, name: str, dtype: str, shape: list[int]) -> None: ...

    def nccl_receive_flattened(self, metadatas: list[dict[str, Any]]) -> None: ...

    def nccl_receive_adapter(self, peft_config: dict[str, Any], metadatas: list[dict[str, Any]]) -> None: ...

    def finish_weights(self) -> None: ...

    def nccl_close(self) -> None: ...

    def close(self) -> None: ...


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


def load_codec(model_dir: str | Path) -> PromptCodec:
    from transformers import AutoConfig, AutoTokenizer

    from trainer.modeling.loading import VL_MODEL_TYPES, load_image_processor

    tok = AutoTokenizer.from_pretrained(model_dir)
    processor = None
    if AutoConfig.from_pretrained(model_dir).model_type in VL_MODEL_TYPES:
        processor = load_image_processor(Path(model_dir))
    return PromptCodec(tok, processor)


class LocalNcclMixin:
    """``nccl_*`` for engines whose model lives in the server process (hf, scripted, vllm with one GPU): one
    ``trainer.sync.nccl.NcclReceiver`` (rank 0 of 2) receives onto ``weights_device``; buckets are staged in
    ``pending`` and handed to ``load_full`` (which checks them) on ``finish_weights``, so a refused update changes
    nothing. Adapters are applied when their bucket arrives (``load_adapter`` checks them)."""

    _receiver = None
    _pending: dict[str, torch.Tensor] | None = None
    weights_device: torch.device = torch.device("cpu")

    def _rx(self):
        if self._receiver is None:
            raise EngineRequestError("communicator not initialised: call /init_communicator/ first")
        return self._receiver

    def nccl_init(self, host: str, port: int, world_size: int, backend: str = "pynccl") -> None:
        from trainer.sync.nccl import NcclReceiver, NcclSetupError

        if world_size != 2:
            raise EngineRequestError(f"this server has world size 1, so the group must have 2 ranks (got {world_size})")
        self.nccl_close()
        device = self.weights_device
        if backend in ("pynccl", "torch-nccl") and device.type != "cuda" and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        try:
            self._receiver = NcclReceiver(host, port, 0, world_size, backend, device)
        except NcclSetupError as exc:
            raise EngineRequestError(str(exc)) from exc
        self._pending = {}

    def _stage(self, tensors: dict[str, torch.Tensor]) -> None:
        if self._pending is None:
            self._pending = {}
        self._pending.update({k: v.to(self.weights_device) for k, v in tensors.items()})

    def nccl_receive_named(self, name: str, dtype: str, shape: list[int]) -> None:
        self._stage(self._rx().receive_named(name, dtype, shape))

    def nccl_receive_flattened(self, metadatas: list[dict[str, Any]]) -> None:
        self._stage(self._rx().receive_bucket(metadatas))

    def nccl_receive_adapter(self, peft_config: dict[str, Any], metadatas: list[dict[str, Any]]) -> None:
        tensors = {k: v.cpu() for k, v in self._rx().receive_bucket(metadatas).items()}
        self.load_adapter(AdapterWeights(peft_config, tensors))

    def finish_weights(self) -> None:
        pending, self._pending = self._pending, {}
        if pending:
            self.load_full(pending)

    def nccl_close(self) -> None:
        self._receiver = None
        self._pending = {}
