"""vLLM colocate rollout backend: an in-process ``vllm.LLM`` sharing the learner's devices.

Contracts:
- the prompt fed to vLLM is exactly ``RolloutRequest.prompt_token_ids`` (plus the request's images for VL
  models), so ``RolloutResult.prompt_token_ids`` equals the encoded prompt; responses end at (and include)
  the first stop id, or are cut at ``max_new_tokens`` (``finish_reason == "length"``);
- every request must fit: ``len(prompt) + max_new_tokens <= max_model_len`` (checked before decoding);
- learner world size W, ``tensor_parallel_size`` T: ``W % T == 0``; ranks ``[g*T, (g+1)*T)`` form TP group g,
  which makes one engine call on the concatenation of its ranks' requests (rank order) and slices the
  results back, so every rank gets its own results in request order;
- weight sync (``sync_full`` / ``sync_adapter``) goes through vLLM's in-place reload and ``LoRARequest``
  (``trainer.sync.vllm_worker``); every rank syncs its own engine.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.sync.weights import AdapterWeights, adapter_weights, full_weights, safetensors_bytes, write_adapter_dir

log = logging.getLogger(__name__)

WORKER_EXTENSION = "trainer.sync.vllm_worker.WeightSyncWorkerExtension"
LORA_NAME = "rm_policy"
LORA_ID = 1
KEY = "custom.extra.rollout_matching.vllm"


class VllmEngineError(RuntimeError):
    """vLLM failed; the message says what to change (no silent fallback to another backend)."""


def tp_groups(world_size: int, tp: int) -> list[list[int]]:
    """Consecutive rank groups of size ``tp``; ``world_size`` must be a multiple of it."""
    if tp < 1 or world_size < 1 or world_size % tp:
        raise ValueError(
            f"{KEY}.tensor_parallel_size={tp} must divide the learner world size {world_size} "
            "(world_size % tensor_parallel_size == 0)"
        )
    return [list(range(g * tp, (g + 1) * tp)) for g in range(world_size // tp)]


def concat_for_group(per_rank: Sequence[Sequence[Any]]) -> tuple[list[Any], list[tuple[int, int]]]:
    """Concatenate the group's per-rank request lists; return the list and each rank's ``(start, end)``."""
    flat: list[Any] = []
    spans = []
    for items in per_rank:
        spans.append((len(flat), len(flat) + len(items)))
        flat.extend(items)
    return flat, spans


def check_fits(requests: Sequence[RolloutRequest], max_new_tokens: int, max_model_len: int) -> None:
    for r in requests:
        need = len(r.prompt_token_ids) + max_new_tokens
        if need > max_model_len:
            raise ValueError(
                f"sample {r.sample_id!r}: prompt of {len(r.prompt_token_ids)} tokens + decoding.max_new_tokens="
                f"{max_new_tokens} = {need} exceeds {KEY}.max_model_len={max_model_len}; raise max_model_len "
                "or shorten the prompt / max_new_tokens"
            )


def _vllm_prompt(r: RolloutRequest) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": list(r.prompt_token_ids)}
    if r.images:
        from PIL import Image

        prompt["multi_modal_data"] = {"image": [Image.open(p).convert("RGB") for p in r.images]}
    return prompt


def sampling_params(params: DecodingParams, stop_ids: Sequence[int]):
    from vllm import SamplingParams

    kwargs: dict[str, Any] = dict(n=1, max_tokens=params.max_new_tokens, repetition_penalty=params.repetition_penalty,
                                  stop_token_ids=list(stop_ids), seed=params.seed, detokenize=False)
    if params.greedy:
        kwargs.update(temperature=0.0)
    else:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
    return SamplingParams(**kwargs)


def results_from_outputs(requests: Sequence[RolloutRequest], outputs: Sequence[Any]) -> list[RolloutResult]:
    results = []
    for r, out in zip(requests, outputs):
        choice = out.outputs[0]
        finish = "length" if choice.finish_reason == "length" else "stop"
        if choice.finish_reason not in ("stop", "length"):
            raise VllmEngineError(f"sample {r.sample_id!r}: vLLM finished with {choice.finish_reason!r}")
        results.append(RolloutResult(r.sample_id, tuple(out.prompt_token_ids), tuple(choice.token_ids), finish))
    return results


class VllmColocateEngine:
    """In-process ``vllm.LLM`` rollout engine (see module docstring)."""

    name = "vllm"
    syncs_on_every_rank = True

    def __init__(self, model_dir: str | Path, stop_ids: Sequence[int], *, max_model_len: int,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.45, enable_lora: bool = False,
                 max_lora_rank: int = 16, enable_prefix_caching: bool = True, sleep_level: int = 0, seed: int = 0,
                 dtype: str = "auto", rank: int | None = None, world_size: int | None = None,
                 engine_kwargs: dict[str, Any] | None = None):
        import torch.distributed as dist

        dist_on = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if dist_on else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if dist_on else 1)
        groups = tp_groups(self.world_size, tensor_parallel_size)
        self.tp = tensor_parallel_size
        self.group_ranks = groups[self.rank // tensor_parallel_size]
        self.group = None
        if self.tp > 1:
            if not dist_on:
                raise ValueError(f"{KEY}.tensor_parallel_size={self.tp} needs torch.distributed (launch with torchrun)")
            for ranks in groups:
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    self.group = g
        if sleep_level and not torch.cuda.is_available():
            raise ValueError(f"{KEY}.sleep_level={sleep_level} needs a CUDA GPU (vLLM's CPU backend cannot sleep); set 0")
        self.stop_ids = sorted(set(stop_ids))
        self.max_model_len = max_model_len
        self.enable_lora = enable_lora
        self.sleep_level = sleep_level
        self.lora_request = None
        self._last_full: Path | None = None
        self._sync_dir = Path(tempfile.mkdtemp(prefix="rm-vllm-sync-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        kwargs: dict[str, Any] = dict(
            model=str(model_dir), tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, seed=seed, dtype=dtype,
            worker_extension_cls=WORKER_EXTENSION,
        )
        if enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        if sleep_level:
            kwargs["enable_sleep_mode"] = True
        if self.world_size > 1:
            kwargs.update(distributed_executor_backend="external_launcher", seed=seed + self.rank // self.tp)
        kwargs.update(engine_kwargs or {})
        from vllm import LLM

        try:
            self.llm = LLM(**kwargs)
        except Exception as exc:
            shutil.rmtree(self._sync_dir, ignore_errors=True)
            raise VllmEngineError(
                f"vLLM could not start for {model_dir} ({type(exc).__name__}: {exc}). Lower {KEY}.gpu_memory_utilization "
                f"or {KEY}.max_model_len when memory is short, check the model directory, or use "
                "custom.extra.rollout_matching.rollout_backend: hf"
            ) from exc
        self._asleep = False
        if sleep_level:
            self._sleep()

    def _sleep(self) -> None:
        if self.sleep_level and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True

    def _wake(self) -> None:
        if not self._asleep:
            return
        self.llm.wake_up()
        self._asleep = False
        if self.sleep_level == 2:
            if self._last_full is not None:
                self.llm.collective_rpc("rm_reload_from_file", args=(str(self._last_full),))
            else:
                self.llm.collective_rpc("reload_weights")
            if self.lora_request is not None:
                self._load_lora(self.lora_request.lora_path)

    def _generate_local(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        if not requests:
            return []
        sp = sampling_params(params, self.stop_ids)
        try:
            outputs = self.llm.generate([_vllm_prompt(r) for r in requests], sp, lora_request=self.lora_request,
                                        use_tqdm=False)
        except torch.OutOfMemoryError as exc:
            raise VllmEngineError(
                f"vLLM ran out of memory while decoding {len(requests)} requests; lower {KEY}.gpu_memory_utilization, "
                "custom.extra.rollout_matching.rollout_generate_batch_size or decoding.max_new_tokens"
            ) from exc
        return results_from_outputs(requests, outputs)

    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        check_fits(requests, params.max_new_tokens, self.max_model_len)
        self._wake()
        try:
            if self.tp == 1:
                return self._generate_local(requests, params)
            return gather_generate_slice(list(requests), lambda reqs: self._generate_local(reqs, params), self.group,
                                         len(self.group_ranks), self.group_ranks.index(self.rank))
        finally:
            self._sleep()

    def supports_adapter_sync(self) -> bool:
        return self.enable_lora

    def sync_full(self, model: torch.nn.Module, merge_adapter: bool = True) -> None:
        """Reload the engine's weights from ``model`` (LoRA merged unless ``merge_adapter`` is false)."""
        self.load_full_tensors(full_weights(model, merge_adapter=merge_adapter), drop_adapter=merge_adapter)

    def load_full_tensors(self, tensors: dict[str, torch.Tensor], drop_adapter: bool = True) -> None:
        """Reload weights given in HF checkpoint names (all of them: vLLM re-processes whole layers)."""
        path = self._sync_dir / "full.safetensors"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(safetensors_bytes(tensors))
        tmp.replace(path)
        self._wake()
        try:
            self.llm.collective_rpc("rm_reload_from_file", args=(str(path),))
            self.llm.reset_prefix_cache()
        finally:
            self._sleep()
        self._last_full = path
        if drop_adapter:
            self.lora_request = None
        elif self.lora_request is not None:
            self._load_lora(self.lora_request.lora_path)

    def _load_lora(self, path: str) -> None:
        from vllm.lora.request import LoRARequest

        self.llm.llm_engine.add_lora(LoRARequest(LORA_NAME, LORA_ID, path, load_inplace=True))
        self.lora_request = LoRARequest(LORA_NAME, LORA_ID, path)

    def sync_adapter(self, model: torch.nn.Module) -> None:
        """Replace the engine's LoRA adapter by the model's active adapter (needs ``enable_lora``)."""
        self.load_adapter(adapter_weights(model))

    def load_adapter(self, adapter: AdapterWeights) -> None:
        if not self.enable_lora:
            raise ValueError(f"{KEY}.enable_lora must be true to sync LoRA adapters to the vLLM engine")
        path = write_adapter_dir(self._sync_dir / "adapter", adapter)
        self._wake()
        try:
            self._load_lora(str(path))
            self.llm.reset_prefix_cache()
        finally:
            self._sleep()

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()
            self.llm = None
        shutil.rmtree(self._sync_dir, ignore_errors=True)


def gather_generate_slice(requests: list[RolloutRequest], generate: Callable[[list[RolloutRequest]], list[RolloutResult]],
                          group, group_size: int, index_in_group: int) -> list[RolloutResult]:
    """All-gather the TP group's requests, run one engine call on all of them, return this rank's slice."""
    import torch.distributed as dist

    per_rank: list[Any] = [None] * group_size
    dist.all_gather_object(per_rank, requests, group=group)
    flat, spans = concat_for_group(per_rank)
    results = generate(flat)
    if len(results) != len(flat):
        raise VllmEngineError(f"engine returned {len(results)} results for {len(flat)} requests")
    start, end = spans[index_in_group]
    return results[start:end]


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``r``."""
    for allowed in VLLM_LORA_RANKS:
        if r <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {r} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def engine_from_config(rm, loaded, model) -> VllmColocateEngine:
    """Build the colocated engine from ``custom.extra.rollout_matching`` and the loaded model."""
    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.sync.weights import is_peft_model

    v = rm.vllm
    if v.max_model_len is None:
        raise ValueError(f"{KEY}.max_model_len is required for the vllm colocate backend")
    lora_rank = 16
    if is_peft_model(model):
        lora_rank = vllm_lora_rank(max(int(c.r) for c in model.peft_config.values()))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return VllmColocateEngine(
        loaded.model_dir, sorted(stop_token_ids(loaded.tokenizer)), max_model_len=v.max_model_len,
        tensor_parallel_size=v.tensor_parallel_size, gpu_memory_utilization=v.gpu_memory_utilization,
        enable_lora=v.enable_lora, max_lora_rank=lora_rank, enable_prefix_caching=v.enable_prefix_caching,
        sleep_level=v.sleep_level, seed=rm.decoding.seed or 0, dtype=dtype,
        engine_kwargs={"enforce_eager": True} if getattr(v, "enforce_eager", False) else None,
    )
