"""What every engine behind the rollout server offers (``ServerEngine``), and the in-process NCCL receive most of
them share (``LocalNcclMixin``); the prompt codec is ``trainer.server.codec``.

A server engine is a ``RolloutEngine`` (decode ``RolloutRequest``s) that can also take weights:
``load_full`` (HF checkpoint names), ``load_adapter`` (LoRA, when ``enable_lora``), ``reset_prefix_cache``,
``state_keys``, and the NCCL receive calls of ms-swift's protocol (``nccl_*``; buckets received between the
first ``nccl_receive_*`` and ``finish_weights`` form one update).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.server.codec import EngineRequestError
from trainer.server.protocol import RolloutInferRequestIn
from trainer.sync.weights import AdapterWeights


class ServerEngine(Protocol):
    kind: str
    model_name: str
    world_size: int
    enable_lora: bool
    #: fills ``RolloutResult.logprobs`` when ``DecodingParams.logprobs`` is set, and has ``token_text(id)``
    returns_logprobs: bool
    #: optional (absent = False): ``generate`` takes ``seeds=``, one sampling seed per request (the request's
    #: ``data_dict["sampling_seed"]``, else derived from ``request_config.seed`` and its ``uuid``); an engine
    #: without it decodes the call with ``params.seed`` (hf: one seeded stream per call; scripted: no sampling)
    takes_request_seeds: bool

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

    def nccl_receive_adapter_tensors(self, peft_config: dict[str, Any], metas: list[tuple[str, str, list[int]]]) -> None: ...

    def finish_weights(self) -> None: ...

    def nccl_close(self) -> None: ...

    def close(self) -> None: ...


class LocalNcclMixin:
    """``nccl_*`` for engines whose model lives in the server process (hf, scripted, vllm with one GPU): one
    ``trainer.sync.nccl.NcclReceiver`` (rank 0 of 2) receives and stages the buckets on ``weights_device``; they are
    handed to ``load_full`` (which checks them) on ``finish_weights``, so a refused update changes nothing. Adapters
    are applied when their bucket arrives (``load_adapter`` checks them)."""

    _receiver = None
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
            self._receiver = NcclReceiver(host, port, 0, world_size, backend, device, stage_device=self.weights_device)
        except NcclSetupError as exc:
            raise EngineRequestError(str(exc)) from exc

    def nccl_receive_named(self, name: str, dtype: str, shape: list[int]) -> None:
        self._rx().stage_named(name, dtype, shape)

    def nccl_receive_flattened(self, metadatas: list[dict[str, Any]]) -> None:
        self._rx().stage_bucket(metadatas)

    def nccl_receive_adapter(self, peft_config: dict[str, Any], metadatas: list[dict[str, Any]]) -> None:
        tensors = {k: v.cpu() for k, v in self._rx().receive_bucket(metadatas).items()}
        self.load_adapter(AdapterWeights(peft_config, tensors))

    def nccl_receive_adapter_tensors(self, peft_config: dict[str, Any], metas: list[tuple[str, str, list[int]]]) -> None:
        tensors = {k: v.cpu() for k, v in self._rx().receive_each(metas).items()}
        self.load_adapter(AdapterWeights(peft_config, tensors))

    def finish_weights(self) -> None:
        staged = self._receiver.take_staged() if self._receiver is not None else {}
        if staged:
            self.load_full(staged)

    def nccl_close(self) -> None:
        self._receiver = None
