"""The ``vllm`` server engine: an ``InProcessVllm`` behind the rollout protocol.

Weight updates, all checked before any weight changes (``InProcessVllm.load_weights``):
- in-band (``load_full``): the safetensors payload's tensors go straight into the model;
- NCCL with one GPU (the engine is in this process): the server process is rank 0 of the group and receives onto
  the model's GPU (``LocalNcclMixin``), stages the buckets, and loads them on ``finish_weights``;
- NCCL with ``tensor_parallel_size`` > 1 (vLLM worker processes): every worker joins the group as its own rank and
  receives the same buckets (``trainer.sync.nccl.NcclReceiver`` through ``collective_rpc``); each worker stages
  them, the metadata is checked here, and ``finish_weights`` loads the staged tensors in every worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trainer.data.images import ImageRefError
from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.rollout.vllm_colocate import check_fits, results_from_outputs, sampling_params
from trainer.rollout.vllm_inprocess import InProcessVllm, VllmSettings
from trainer.server.codec import EngineRequestError, load_codec, load_image
from trainer.server.engines import LocalNcclMixin
from trainer.server.protocol import RolloutInferRequestIn
from trainer.sync.weights import AdapterWeights

KEY = "serve --engine vllm"


def _worker_nccl_init(worker, host: str, port: int, world_size: int, wire: str) -> None:
    from vllm.distributed.parallel_state import get_world_group

    from trainer.sync.nccl import NcclReceiver

    worker.rm_receiver = NcclReceiver(host, port, get_world_group().rank, world_size, wire, worker.device)


def _worker_receive(worker, metadatas: list[dict[str, Any]] | None, named: tuple[str, str, list[int]] | None) -> int:
    rx = getattr(worker, "rm_receiver", None)
    if rx is None:
        raise RuntimeError("weight-update communicator not initialised: call /init_communicator/ first")
    return rx.stage_bucket(metadatas) if metadatas is not None else rx.stage_named(*named)


def _worker_take(worker) -> dict[str, torch.Tensor]:
    """What this worker's receiver staged (nothing without one), leaving nothing staged."""
    rx = getattr(worker, "rm_receiver", None)
    return rx.take_staged() if rx is not None else {}


def _worker_take_staged(worker, load: bool) -> int:
    from trainer.rollout import vllm_compat

    staged = _worker_take(worker)
    if load and staged:
        return vllm_compat.load_checkpoint_tensors(worker, staged)
    return 0


def _worker_nccl_close(worker) -> None:
    worker.rm_receiver = None


class VllmServerEngine(LocalNcclMixin):
    kind = "vllm"
    returns_logprobs = True  # /infer/ with request_config.logprobs: per-token log-probabilities, as sampled
    takes_request_seeds = True

    def __init__(self, model_dir: str | Path, *, max_model_len: int, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.45, enable_lora: bool = False, max_lora_rank: int = 64,
                 enable_prefix_caching: bool = True, seed: int = 0, dtype: str = "auto",
                 allow_dtype_cast: bool = False, engine_kwargs: dict[str, Any] | None = None):
        from trainer.modeling.coord_vocab import stop_token_ids

        self.model_name = str(model_dir)
        self.codec = load_codec(model_dir)
        self.world_size = tensor_parallel_size
        self.enable_lora = enable_lora
        self.max_model_len = max_model_len
        self.stop_ids = sorted(stop_token_ids(self.codec.tokenizer))
        self.vllm = InProcessVllm(VllmSettings(
            model_dir=str(model_dir), max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, enable_lora=enable_lora, max_lora_rank=max_lora_rank,
            enable_prefix_caching=enable_prefix_caching, seed=seed, dtype=dtype, allow_dtype_cast=allow_dtype_cast,
            engine_kwargs={"logprobs_mode": "processed_logprobs", **(engine_kwargs or {})}, key=KEY))
        self.weights_device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self._staged_meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def encode(self, request: RolloutInferRequestIn, index: int) -> RolloutRequest:
        return self.codec.encode(request, index)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.codec.token_text(token_id)

    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams,
                 seeds: Sequence[int | None] | None = None) -> list[RolloutResult]:
        """Decode ``requests``, request i with sampling seed ``seeds[i]`` (None: the colocate engine's
        ``request_seed(params.seed, sample id)``)."""
        if seeds is not None and len(seeds) != len(requests):
            raise ValueError(f"{len(seeds)} seeds for {len(requests)} requests")
        try:
            check_fits(requests, params.max_new_tokens, self.max_model_len)
        except ValueError as exc:
            raise EngineRequestError(str(exc).replace("custom.extra.rollout_matching.vllm.max_model_len",
                                                      "the server's --max-model-len")) from exc
        try:
            prompts = [self.vllm.prompt(r.prompt_token_ids, [load_image(p) for p in r.images]) for r in requests]
        except ImageRefError as exc:
            raise EngineRequestError(str(exc)) from exc
        if seeds is None:
            sampling = sampling_params(params, self.stop_ids, requests)
        else:
            sampling = [sampling_params(replace(params, seed=s), self.stop_ids) for s in seeds]
        return results_from_outputs(requests, self.vllm.generate(prompts, sampling))

    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        self.vllm.load_weights(tensors)
        self.vllm.drop_adapter()

    def load_adapter(self, adapter: AdapterWeights) -> None:
        if not self.enable_lora:
            raise EngineRequestError("this server does not serve LoRA adapters (start it with --enable-lora)")
        self.vllm.load_adapter(adapter.peft_config, adapter.tensors)

    def reset_prefix_cache(self) -> bool:
        return self.vllm.reset_prefix_cache()

    def state_keys(self) -> list[str]:
        """vLLM's runtime parameter names (fused ``qkv_proj`` etc.), as ``swift rollout`` answers."""
        return self.vllm.collective_rpc(_worker_param_names)[0]

    def weights_checksums(self) -> dict[str, str]:
        """Checksums of the served parameters under vLLM's own names (stacked ``qkv_proj`` etc.)."""
        return self.vllm.collective_rpc(_worker_checksums)[0]

    # NCCL with worker processes (tensor_parallel_size > 1); one GPU uses LocalNcclMixin's in-process receiver.
    def _multi_worker(self) -> bool:
        return self.world_size > 1

    def nccl_init(self, host: str, port: int, world_size: int, backend: str = "pynccl") -> None:
        if not self._multi_worker():
            return super().nccl_init(host, port, world_size, backend)
        self.vllm.collective_rpc(_worker_nccl_init, host, port, world_size, backend)
        self._staged_meta = {}

    def _check_meta(self, meta: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        from trainer.sync.update_check import check_update

        probes = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in meta.items()}
        check_update(probes, self.vllm.update_spec(), allow_cast=self.vllm.settings.allow_dtype_cast,
                     check_finite=False)

    def nccl_receive_named(self, name: str, dtype: str, shape: list[int]) -> None:
        if not self._multi_worker():
            return super().nccl_receive_named(name, dtype, shape)
        from trainer.sync.buckets import torch_dtype

        self.vllm.collective_rpc(_worker_receive, None, (name, dtype, list(shape)))
        self._staged_meta[name] = (tuple(shape), torch_dtype(dtype))

    def nccl_receive_flattened(self, metadatas: list[dict[str, Any]]) -> None:
        if not self._multi_worker():
            return super().nccl_receive_flattened(metadatas)
        from trainer.sync.buckets import torch_dtype

        self.vllm.collective_rpc(_worker_receive, metadatas, None)
        self._staged_meta.update({m["name"]: (tuple(m["shape"]), torch_dtype(m["dtype"])) for m in metadatas})

    def nccl_receive_adapter(self, peft_config: dict[str, Any], metadatas: list[dict[str, Any]]) -> None:
        if not self._multi_worker():
            return super().nccl_receive_adapter(peft_config, metadatas)
        self.vllm.collective_rpc(_worker_receive, metadatas, None)
        tensors = self.vllm.collective_rpc(_worker_take_adapter)[0]
        self.load_adapter(AdapterWeights(peft_config, tensors))

    def nccl_receive_adapter_tensors(self, peft_config: dict[str, Any], metas: list[tuple[str, str, list[int]]]) -> None:
        if self._multi_worker():
            raise EngineRequestError("per-tensor adapter updates (/update_adapter_param/) are not supported with "
                                     "tensor parallelism; use the flattened sync (ms-swift's default, "
                                     "enable_flattened_weight_sync true)")
        super().nccl_receive_adapter_tensors(peft_config, metas)

    def finish_weights(self) -> None:
        if not self._multi_worker():
            return super().finish_weights()
        meta, self._staged_meta = self._staged_meta, {}
        if not meta:
            return
        try:
            self._check_meta(meta)
            bad = next((b for b in self.vllm.collective_rpc(_worker_staged_non_finite) if b is not None), None)
            if bad is not None:
                from trainer.sync.update_check import WeightUpdateRefused

                raise WeightUpdateRefused(*bad)
        except Exception:
            self.vllm.collective_rpc(_worker_take_staged, False)
            raise
        self.vllm.wake(("weights",))
        self.vllm.collective_rpc(_worker_take_staged, True)
        self.vllm.drop_adapter()
        self.vllm.reset_prefix_cache()

    def nccl_close(self) -> None:
        if not self._multi_worker():
            return super().nccl_close()
        self.vllm.collective_rpc(_worker_nccl_close)

    def close(self) -> None:
        self.nccl_close()
        self.vllm.close()


def _worker_param_names(worker) -> list[str]:
    from trainer.rollout import vllm_compat

    return [name for name, _ in vllm_compat.worker_model(worker).named_parameters()]


def _worker_staged_non_finite(worker) -> tuple[str, str] | None:
    """(name, reason) of the first staged tensor of this worker holding NaN/inf, else None."""
    from trainer.sync.update_check import describe_non_finite, first_non_finite

    rx = getattr(worker, "rm_receiver", None)
    staged = rx.staged if rx is not None else {}
    name = first_non_finite(staged)
    return None if name is None else (name, describe_non_finite(staged[name]))


def _worker_take_adapter(worker) -> dict[str, torch.Tensor]:
    return {k: v.to("cpu") for k, v in _worker_take(worker).items()}


def _worker_checksums(worker) -> dict[str, str]:
    from trainer.rollout import vllm_compat
    from trainer.sync.weights import tensor_checksums

    return tensor_checksums(dict(vllm_compat.worker_model(worker).named_parameters()))
