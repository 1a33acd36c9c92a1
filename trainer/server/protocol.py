"""Request and response bodies of the ms-swift rollout protocol (``swift rollout``), as pydantic models.

Request items mirror ms-swift's ``RolloutInferRequest`` and ``RequestConfig`` field for field; unknown keys in
them are ignored (ms-swift adds fields between releases) while the top-level bodies are strict. Responses are
``RolloutOutput``-shaped: ``{"response": ChatCompletionResponse, "rollout_infos": {...}}`` with the prompt ids
and each choice's ``token_ids``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer.sync.buckets import FlatTensorMeta

MAX_REQUESTS_PER_CALL = 4096
MAX_MESSAGES = 256
MAX_IMAGES = 64


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessageIn(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class RolloutInferRequestIn(_Lenient):
    """ms-swift ``RolloutInferRequest``: messages plus multimodal resources as strings (path, URL or base64)."""

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    images: list[str] = Field(default_factory=list, max_length=MAX_IMAGES)
    audios: list[str] = Field(default_factory=list)
    videos: list[str] = Field(default_factory=list)
    tools: list[Any] | None = None
    objects: dict[str, Any] = Field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    data_dict: dict[str, Any] = Field(default_factory=dict)
    uuid: str | None = None
    add_eos: bool | Literal["auto"] | None = None  # ms-swift: only for scoring completed responses; unused here

    @field_validator("images", mode="before")
    @classmethod
    def _one_image_as_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class RequestConfigIn(_Lenient):
    """ms-swift ``RequestConfig`` (None = the server's default)."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_k: int | None = Field(None, ge=-1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    num_beams: int = Field(1, ge=1)
    stop: list[str] | None = Field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    prompt_logprobs: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    length_penalty: float = 1.0
    return_details: bool = False
    structured_outputs_regex: str | None = None


class InferBody(_Strict):
    infer_requests: list[RolloutInferRequestIn] = Field(max_length=MAX_REQUESTS_PER_CALL)
    request_config: RequestConfigIn | None = None
    metrics: Any = None
    use_tqdm: bool | None = None
    adapter_request: dict[str, Any] | None = None


class InitCommunicatorBody(_Strict):
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    client_device_uuid: str | None = None
    # ours, optional (ms-swift's client never sends it): the communicator to build. None/"pynccl" = vLLM's
    # PyNcclCommunicator (ms-swift's); "torch-nccl"/"torch-gloo" = TorchStatelessCommunicator (no vLLM needed).
    backend: Literal["pynccl", "torch-nccl", "torch-gloo"] | None = None


class UpdateNamedParamBody(_Strict):
    name: str = Field(min_length=1, max_length=1024)
    dtype: str
    shape: list[int] = Field(max_length=8)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        from trainer.sync.buckets import torch_dtype

        torch_dtype(v)  # checked here: the receive itself runs in the background, after the answer
        return v

    @field_validator("shape")
    @classmethod
    def _sane_shape(cls, v: list[int]) -> list[int]:
        if any(d < 0 for d in v):
            raise ValueError(f"shape {v} has a negative dimension")
        numel = 1
        for d in v:
            numel *= d
        if numel > 2**40:
            raise ValueError(f"shape {v} has more than 2**40 elements")
        return v


class UpdateFlattenedParamsBody(_Strict):
    metadatas: list[FlatTensorMeta] = Field(min_length=1)


class UpdateAdapterFlattenedBody(_Strict):
    peft_config: dict[str, Any]
    metadatas: list[FlatTensorMeta] = Field(min_length=1)


class AdapterTensorMeta(_Strict):
    """One tensor of ms-swift's non-flattened adapter update (``/update_adapter_param/``): broadcast on its own, so
    the indices it carries are unused; ``numel`` counts elements."""

    name: str = Field(min_length=1, max_length=1024)
    dtype: str
    shape: list[int] = Field(max_length=8)
    start_idx: int | None = None
    end_idx: int | None = None
    numel: int | None = None

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        from trainer.sync.buckets import torch_dtype

        torch_dtype(v)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> AdapterTensorMeta:
        count = 1
        for d in self.shape:
            if d < 0:
                raise ValueError(f"tensor {self.name!r}: shape {self.shape} has a negative dimension")
            count *= d
        if count > 2**40:
            raise ValueError(f"tensor {self.name!r}: shape {self.shape} has more than 2**40 elements")
        if self.numel is not None and self.numel != count:
            raise ValueError(f"tensor {self.name!r}: numel {self.numel} is not the {count} elements of {self.shape}")
        return self


class UpdateAdapterParamBody(_Strict):
    peft_config: dict[str, Any]
    lora_tensors_metadata: list[AdapterTensorMeta] = Field(min_length=1)


class UpdateWeightsShmBody(_Strict):
    """Our shared-directory in-band update (``trainer.sync.shm_staging``): the staging file's name and size."""

    file: str = Field(min_length=1, max_length=255)
    bytes: int = Field(gt=8)


def logprobs_content(result, token_text, top: int | None) -> dict[str, Any]:
    """A choice's ``logprobs`` as ``swift rollout`` answers it: ``{"content": [{"token", "logprob", "bytes"}, ...]}``,
    one entry per new token of ``result`` (a ``RolloutResult`` with ``logprobs``); with ``top`` each entry also has
    ``top_logprobs``, the ``top`` most likely tokens, best first. ``token_text(id)``: the token as text."""
    if result.logprobs is None or len(result.logprobs) != len(result.response_token_ids):
        raise RuntimeError(f"sample {result.sample_id!r}: the engine returned "
                           f"{'no' if result.logprobs is None else len(result.logprobs)} log-probabilities for "
                           f"{len(result.response_token_ids)} new tokens")
    content = []
    for token, dist in zip(result.response_token_ids, result.logprobs):
        text = token_text(token)
        entry: dict[str, Any] = {"token": text, "logprob": dist[token], "bytes": list(text.encode("utf-8"))}
        if top is not None:
            best = sorted((k for k in dist if dist[k] != float("-inf")), key=lambda k: -dist[k])[:top]
            entry["top_logprobs"] = [{"token": (t := token_text(k)), "logprob": dist[k],
                                      "bytes": list(t.encode("utf-8"))} for k in best]
        content.append(entry)
    return {"content": content}


def rollout_output(model: str, prompt_ids: list[int], response_ids: list[int], finish_reason: str, text: str,
                   rollout_infos: dict[str, Any] | None = None,
                   images_size: list[tuple[int, int]] | None = None,
                   logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``RolloutOutput`` item wrapping a ``ChatCompletionResponse`` with token ids, with every field the real
    ``swift rollout`` (ms-swift 4.6) answers: the multi-turn fields empty (one turn: the trainer reads the choice's
    token ids), ``images_size`` the ``(width, height)`` of each request image (``None`` without images)."""
    response = {
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": logprobs,
            "token_ids": list(response_ids),
        }],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(response_ids),
                  "total_tokens": len(prompt_ids) + len(response_ids)},
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "prompt_token_ids": list(prompt_ids),
        "prompt_logprobs": None,
        "images_size": [list(s) for s in images_size] if images_size else None,
    }
    return {"response": response, "messages": None, "response_token_ids": [], "response_loss_mask": [],
            "rollout_infos": rollout_infos or {}, "rollout_logprobs": [], "prompt_logprobs": None}
