"""Engines behind the rollout server and what they share: the prompt codec and the weight-update surface.

A server engine is a ``RolloutEngine`` (decode ``RolloutRequest``s) that can also take weights:
``load_full`` (HF checkpoint names), ``load_adapter`` (LoRA, when ``enable_lora``), ``reset_prefix_cache``,
``state_keys``, and the NCCL receive calls of ms-swift's protocol (``nccl_*``; buckets received between the
first ``nccl_receive_*`` and ``finish_weights`` form one update).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.server.protocol import RolloutInferRequestIn
from trainer.sync.weights import AdapterWeights

IMAGE_TAG = "<image>"


class EngineRequestError(ValueError):
    """The request cannot be served by this engine (answered with HTTP 400 and this message)."""


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


def load_image(ref: str):
    """A PIL image from a local path, a ``data:`` URI or bare base64 (no network fetches)."""
    from PIL import Image

    if ref.startswith(("http://", "https://")):
        raise EngineRequestError(f"image URLs are not fetched by this server; send a local path or base64 ({ref[:60]})")
    if ref.startswith("data:"):
        ref = ref.split(",", 1)[-1]
    else:
        try:
            is_file = Path(ref).is_file()
        except (OSError, ValueError):  # name too long, NUL byte, ...
            is_file = False
        if is_file:
            try:
                return Image.open(ref).convert("RGB")
            except (OSError, ValueError, Image.DecompressionBombError) as exc:
                raise EngineRequestError(f"image file {ref[:200]!r} cannot be read as an image: {exc}") from exc
    try:
        return Image.open(io.BytesIO(base64.b64decode(ref, validate=True))).convert("RGB")
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as exc:
        raise EngineRequestError(f"image {ref[:60]!r} is neither a readable file nor base64 image data") from exc


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


class LocalNcclReceiver:
    """NCCL weight receiver inside the server process (scripted and hf engines; vLLM's workers have their own).

    Joins the learner's group as rank 0 of 2. ``backend`` (sent by the learner in ``/init_communicator/``):
    ``pynccl`` (ms-swift's; the default when absent) = vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``
    (GPU only); ``torch-nccl`` / ``torch-gloo`` = ``trainer.sync.transports.TorchStatelessCommunicator`` on our
    ``StoreGroup`` (no vLLM; NCCL on this process's GPU, or gloo on CPU). Received tensors are collected until
    ``finish`` hands them to ``apply``.
    """

    def __init__(self):
        self.comm = None
        self.pending: dict[str, torch.Tensor] = {}

    def init(self, host: str, port: int, world_size: int, backend: str = "pynccl") -> None:
        from trainer.sync.transports import TorchStatelessCommunicator, make_group

        if backend not in ("pynccl", "torch-nccl", "torch-gloo"):
            raise EngineRequestError(f"unknown NCCL backend {backend!r}; use pynccl, torch-nccl or torch-gloo")
        if backend in ("pynccl", "torch-nccl") and not torch.cuda.is_available():
            raise EngineRequestError(
                f"NCCL weight sync needs a CUDA GPU on the server ({backend} backend); on CPU use torch-gloo "
                "(sync.nccl_backend: torch on a CPU learner) or our in-band transport (POST /rm/update_weights_inband/)"
            )
        if world_size != 2:
            raise EngineRequestError(f"this server has world size 1, so the group must have 2 ranks (got {world_size})")
        self.close()
        group = make_group("pynccl" if backend == "pynccl" else "torch", host, port, 0, world_size)
        if backend == "pynccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

            self.comm = PyNcclCommunicator(group, device=torch.device("cuda", torch.cuda.current_device()))
        elif backend == "torch-nccl":
            self.comm = TorchStatelessCommunicator(group, torch.device("cuda", torch.cuda.current_device()))
        else:
            self.comm = TorchStatelessCommunicator(group, torch.device("cpu"))

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.comm is None:
            raise EngineRequestError("communicator not initialised: call /init_communicator/ first")
        buf = torch.empty(shape, dtype=dtype, device=self.comm.device)
        cuda = buf.is_cuda
        self.comm.broadcast(buf, src=1, stream=torch.cuda.current_stream() if cuda else None)
        if cuda:
            torch.cuda.synchronize()
        self.comm.group.barrier()
        return buf

    def close(self) -> None:
        self.comm = None
        self.pending = {}


class LocalNcclMixin:
    """``nccl_*`` for engines that live in the server process: receive into ``pending`` (on ``weights_device``:
    the served model's device, so a GPU model's update never leaves the GPU), apply on finish."""

    _receiver: LocalNcclReceiver | None = None
    _pending_adapter: AdapterWeights | None = None
    weights_device: torch.device = torch.device("cpu")

    def _rx(self) -> LocalNcclReceiver:
        if self._receiver is None:
            self._receiver = LocalNcclReceiver()
        return self._receiver

    def nccl_init(self, host: str, port: int, world_size: int, backend: str = "pynccl") -> None:
        self._rx().init(host, port, world_size, backend)

    def nccl_receive_named(self, name: str, dtype: str, shape: list[int]) -> None:
        from trainer.sync.buckets import torch_dtype

        self._rx().pending[name] = self._rx().receive(tuple(shape), torch_dtype(dtype)).to(self.weights_device)

    def nccl_receive_flattened(self, metadatas: list[dict[str, Any]]) -> None:
        from trainer.sync.buckets import FlatTensorMeta, unflatten

        metas = [FlatTensorMeta.model_validate(m) for m in metadatas]
        bucket = self._rx().receive((metas[-1].end_idx,), torch.uint8).to(self.weights_device)
        self._rx().pending.update({k: v.clone() for k, v in unflatten(metas, bucket).items()})

    def nccl_receive_adapter(self, peft_config: dict[str, Any], metadatas: list[dict[str, Any]]) -> None:
        from trainer.sync.buckets import FlatTensorMeta, unflatten

        metas = [FlatTensorMeta.model_validate(m) for m in metadatas]
        bucket = self._rx().receive((metas[-1].end_idx,), torch.uint8).cpu()
        self.load_adapter(AdapterWeights(peft_config, {k: v.clone() for k, v in unflatten(metas, bucket).items()}))

    def finish_weights(self) -> None:
        rx = self._rx()
        if rx.pending:
            tensors, rx.pending = rx.pending, {}
            self.load_full(tensors)

    def nccl_close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
