"""The ``vllm`` server engine: ``VllmColocateEngine`` (one in-process ``vllm.LLM``, TP over local devices)
behind the rollout protocol; NCCL weight updates are received by every vLLM worker
(``trainer.sync.vllm_worker``), in-band updates go through vLLM's in-place reload."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.rollout.vllm_colocate import VllmColocateEngine
from trainer.server.engines import load_codec
from trainer.server.protocol import RolloutInferRequestIn
from trainer.sync.weights import AdapterWeights


class VllmServerEngine:
    kind = "vllm"

    def __init__(self, model_dir: str | Path, *, max_model_len: int, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.45, enable_lora: bool = False, max_lora_rank: int = 64,
                 enable_prefix_caching: bool = True, seed: int = 0, dtype: str = "auto",
                 engine_kwargs: dict[str, Any] | None = None):
        from trainer.modeling.coord_vocab import stop_token_ids

        self.model_name = str(model_dir)
        self.codec = load_codec(model_dir)
        self.world_size = tensor_parallel_size
        self.enable_lora = enable_lora
        self.max_model_len = max_model_len
        self.engine = VllmColocateEngine(
            model_dir, sorted(stop_token_ids(self.codec.tokenizer)), max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            enable_lora=enable_lora, max_lora_rank=max_lora_rank, enable_prefix_caching=enable_prefix_caching,
            seed=seed, dtype=dtype, rank=0, world_size=1, engine_kwargs=engine_kwargs)
        self._adapter_dir = self.engine._sync_dir / "nccl-adapter"

    def encode(self, request: RolloutInferRequestIn, index: int) -> RolloutRequest:
        return self.codec.encode(request, index)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        return self.engine.generate(requests, params)

    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        self.engine.load_full_tensors(tensors)

    def load_adapter(self, adapter: AdapterWeights) -> None:
        self.engine.load_adapter(adapter)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def state_keys(self) -> list[str]:
        keys = self.engine.llm.collective_rpc("rm_state_keys")
        return list(keys[0]) if keys else []

    def nccl_init(self, host: str, port: int, world_size: int, backend: str = "pynccl") -> None:
        self.engine.llm.collective_rpc("rm_init_communicator", args=(host, port, world_size, backend))

    def nccl_receive_named(self, name: str, dtype: str, shape: list[int]) -> None:
        self.engine.llm.collective_rpc("rm_receive_named", args=(name, dtype, list(shape)))

    def nccl_receive_flattened(self, metadatas: list[dict[str, Any]]) -> None:
        self.engine.llm.collective_rpc("rm_receive_flattened", args=(metadatas,))

    def nccl_receive_adapter(self, peft_config: dict[str, Any], metadatas: list[dict[str, Any]]) -> None:
        self.engine.llm.collective_rpc("rm_receive_adapter_flattened", args=(peft_config, metadatas, str(self._adapter_dir)))
        self.engine._load_lora(str(self._adapter_dir))
        self.engine.reset_prefix_cache()

    def finish_weights(self) -> None:
        if any(self.engine.llm.collective_rpc("rm_finish_update")):
            self.engine.lora_request = None
            self.engine.reset_prefix_cache()

    def nccl_close(self) -> None:
        self.engine.llm.collective_rpc("rm_close_communicator")

    def close(self) -> None:
        self.engine.close()
