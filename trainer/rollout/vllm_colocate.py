"""vLLM colocate rollout backend: an in-process ``vllm.LLM`` sharing the learner's devices.

Contracts:
- the prompt fed to vLLM is exactly ``RolloutRequest.prompt_token_ids`` (plus the request's images for VL
  models), so ``RolloutResult.prompt_token_ids`` equals the encoded prompt; responses end at (and include)
  the first stop id, or are cut at ``max_new_tokens`` (``finish_reason == "length"``);
- every request must fit: ``len(prompt) + max_new_tokens <= max_model_len`` (checked before decoding);
- learner world size W, ``tensor_parallel_size`` T: ``W % T == 0``; ranks ``[g*T, (g+1)*T)`` form TP group g,
  which makes one engine call on the concatenation of its ranks' requests (rank order) and slices the
  results back, so every rank gets its own results in request order;
- weight sync: ``sync_full`` hands the learner's tensors (HF names, LoRA merged) to the engine's model in this
  process (``InProcessVllm.load_weights``: checked, then copied into the live parameters; no file); ``sync_adapter``
  serves the LoRA adapter through ``LoRARequest``; every rank syncs its own engine;
- sleep mode: the engine sleeps after each ``generate`` and wakes only its weights for a sync;
- under torch.distributed (torchrun, any world size, 1 included) the engine runs under vLLM's external launcher on
  the learner's process group (ranks beyond one TP group are vLLM's external data parallelism); without it, in a
  plain process, vLLM's own single-process executor.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trainer.data.images import load_image
from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.rollout.vllm_compat import Decoded
from trainer.rollout.vllm_inprocess import InProcessVllm, VllmEngineError, VllmSettings
from trainer.sync.weights import adapter_weights, full_weights, unmerged_weights
from trainer.telemetry import phase

log = logging.getLogger(__name__)

__all__ = ["VllmColocateEngine", "VllmEngineError", "engine_from_config", "gather_generate_slice", "tp_groups"]

KEY = "custom.extra.rollout_matching.vllm"


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


def request_seed(seed: int | None, sample_id: str) -> int | None:
    """The sampling seed of one request: ``seed`` and the sample id hashed together (stable across processes), so
    the rows of a batch draw independent noise while a run stays reproducible; None stays None (vLLM's own RNG)."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}:{sample_id}".encode()) & 0x7FFFFFFF


def sampling_params(params: DecodingParams, stop_ids: Sequence[int], requests: Sequence[RolloutRequest] | None = None):
    """vLLM ``SamplingParams`` for ``params``; with ``requests``, one per request, each with its ``request_seed``."""
    if requests is not None:
        return [sampling_params(replace(params, seed=request_seed(params.seed, r.sample_id)), stop_ids)
                for r in requests]
    from vllm import SamplingParams

    kwargs: dict[str, Any] = dict(n=1, max_tokens=params.max_new_tokens, repetition_penalty=params.repetition_penalty,
                                  stop_token_ids=list(stop_ids), seed=params.seed, detokenize=False)
    if params.greedy:
        kwargs.update(temperature=0.0)
    else:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
    if params.logprobs is not None:
        kwargs["logprobs"] = params.logprobs
    return SamplingParams(**kwargs)


def results_from_outputs(requests: Sequence[RolloutRequest], outputs: Sequence[Decoded]) -> list[RolloutResult]:
    results = []
    for r, out in zip(requests, outputs):
        if out.finish_reason not in ("stop", "length"):
            raise VllmEngineError(f"sample {r.sample_id!r}: vLLM finished with {out.finish_reason!r}")
        results.append(RolloutResult(r.sample_id, out.prompt_token_ids, out.token_ids, out.finish_reason,
                                     logprobs=out.logprobs))
    return results


class VllmColocateEngine:
    """The colocate rollout backend: an ``InProcessVllm`` per rank (see module docstring)."""

    name = "vllm"
    syncs_on_every_rank = True
    #: decodes from the requests' image files and prompt ids; their ``pixel_values`` are never read (the trainer may
    #: compute them while this engine decodes: ``vllm.pixels_during_decode``)
    reads_images = True

    def __init__(self, model_dir: str | Path, stop_ids: Sequence[int], *, max_model_len: int,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.45, enable_lora: bool = False,
                 max_lora_rank: int = 16, enable_prefix_caching: bool = True, sleep_level: int | str = 0, seed: int = 0,
                 dtype: str = "auto", rank: int | None = None, world_size: int | None = None,
                 allow_dtype_cast: bool = False, engine_kwargs: dict[str, Any] | None = None,
                 merge_precision: str = "weight_dtype", prewake: bool = False, recorded_load: bool = False,
                 overlap_wake: bool = False, merge_into_engine: bool = False):
        import torch.distributed as dist

        dist_on = dist.is_available() and dist.is_initialized()
        #: ``sync.merge_precision`` of a merged full sync (``trainer.sync.weights.full_weights``)
        self.merge_precision = merge_precision
        #: ``sync.prewake``: a sync starts waking the sleeping weights on a thread (``InProcessVllm.wake_in_background``)
        self.prewake = prewake
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
        self.stop_ids = sorted(set(stop_ids))
        self.max_model_len = max_model_len
        self.enable_lora = enable_lora
        #: the 16-bit dtype the engine serves (a LoRA merge into it rounds: ``WeightSync`` measures the loss)
        self.engine_dtype = getattr(torch, dtype) if dtype != "auto" else None
        self.vllm = InProcessVllm(VllmSettings(
            model_dir=str(model_dir), max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, enable_lora=enable_lora, max_lora_rank=max_lora_rank,
            enable_prefix_caching=enable_prefix_caching, sleep_level=sleep_level,
            seed=seed + (self.rank // self.tp if self.world_size > 1 else 0), dtype=dtype,
            external_launcher=dist_on, allow_dtype_cast=allow_dtype_cast,
            engine_kwargs=dict(engine_kwargs or {}), key=KEY, recorded_load=recorded_load,
            overlap_wake=overlap_wake, merge_into_engine=merge_into_engine))
        self.timings: dict[str, float] = {}

    @property
    def llm(self):
        return self.vllm.llm

    def _generate_local(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        if not requests:
            return []
        prompts = [self.vllm.prompt(r.prompt_token_ids, [load_image(p) for p in r.images]) for r in requests]
        outputs = self.vllm.generate(prompts, sampling_params(params, self.stop_ids, requests))
        return results_from_outputs(requests, outputs)

    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        check_fits(requests, params.max_new_tokens, self.max_model_len)
        t0 = time.perf_counter()
        try:
            if self.tp == 1:
                return self._generate_local(requests, params)
            return gather_generate_slice(list(requests), lambda reqs: self._generate_local(reqs, params), self.group,
                                         len(self.group_ranks), self.group_ranks.index(self.rank))
        finally:
            t1 = time.perf_counter()
            self.vllm.sleep()
            self.timings = {**self.timings, "generate_s": t1 - t0, "sleep_s": time.perf_counter() - t1}

    def supports_adapter_sync(self) -> bool:
        return self.enable_lora

    def begin_sync(self) -> None:
        """Every rank syncs its own engine: nothing to agree on. With ``prewake`` the sleeping weights start waking
        on a thread here, while the learner checks and collects its weights."""
        if self.prewake:
            self.vllm.wake_in_background(("weights",))

    def end_sync(self) -> None:
        """See ``begin_sync``."""

    def sync_full(self, model: torch.nn.Module, merge_adapter: bool = True) -> None:
        """Load the model's weights (LoRA merged unless ``merge_adapter`` is false) into the engine, in process."""
        self.vllm.weights_source = lambda: full_weights(model, merge_adapter=merge_adapter,
                                                        merge_precision=self.merge_precision)
        if self.vllm.settings.merge_into_engine and merge_adapter:
            with phase("sync_collect", device_work=True):
                update = unmerged_weights(model, merge_precision=self.merge_precision)
            report = self.vllm.load_unmerged(update)
        else:
            with phase("sync_collect", device_work=not self.vllm.settings.overlap_wake):
                tensors = self.vllm.weights_source()
            report = self.vllm.load_weights(tensors)
        self.timings = {"sync_check_s": report.check_s, "sync_load_s": report.load_s,
                        "sync_gb_per_s": report.gb_per_s, "sync_bytes": report.bytes}
        if merge_adapter:
            self.vllm.drop_adapter()

    def sync_adapter(self, model: torch.nn.Module) -> None:
        """Serve the model's active LoRA adapter (needs ``enable_lora``)."""
        if not self.enable_lora:
            raise ValueError(f"{KEY}.enable_lora must be true to sync LoRA adapters to the vLLM engine")
        adapter = adapter_weights(model)
        self.vllm.load_adapter(adapter.peft_config, adapter.tensors)

    def reset_prefix_cache(self) -> bool:
        return self.vllm.reset_prefix_cache()

    def close(self) -> None:
        self.vllm.close()


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


def colocate_enable_lora(requested: bool | None, model: torch.nn.Module) -> bool:
    """``vllm.enable_lora`` resolved: as set, or (None) on for a plain LoRA learner whose adapter vLLM can serve
    (not DoRA, nothing on the vision tower), so the engine decodes with the adapter itself rather than a 16-bit
    merge of it."""
    from trainer.sync.weights import adapter_kind, adapter_on_vision_tower

    if requested is not None:
        return requested
    return adapter_kind(model) == "lora" and not adapter_on_vision_tower(model)


def engine_from_config(rm, loaded, model) -> VllmColocateEngine:
    """Build the colocated engine from ``custom.extra.rollout_matching`` and the loaded model."""
    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.precision import compute_dtype
    from trainer.sync.weights import is_peft_model

    v = rm.vllm
    if v.max_model_len is None:
        raise ValueError(f"{KEY}.max_model_len is required for the vllm colocate backend")
    enable_lora = colocate_enable_lora(v.enable_lora, model)
    lora_rank = 16
    if is_peft_model(model):
        lora_rank = vllm_lora_rank(max(int(c.r) for c in model.peft_config.values()))
    learner_dtype = str(compute_dtype(model)).removeprefix("torch.")
    dtype = learner_dtype if v.dtype == "auto" else v.dtype
    if dtype != learner_dtype and not v.sync.allow_dtype_cast:
        raise ValueError(f"{KEY}.dtype={dtype} but the learner's weights are {learner_dtype}: every sync would cast; "
                         f"set {KEY}.sync.allow_dtype_cast: true to allow that, or {KEY}.dtype: auto")
    return VllmColocateEngine(
        loaded.model_dir, sorted(stop_token_ids(loaded.tokenizer)), max_model_len=v.max_model_len,
        tensor_parallel_size=v.tensor_parallel_size, gpu_memory_utilization=v.gpu_memory_utilization,
        enable_lora=enable_lora, max_lora_rank=lora_rank, enable_prefix_caching=v.enable_prefix_caching,
        sleep_level=v.sleep_level, seed=rm.decoding.seed or 0, dtype=dtype, allow_dtype_cast=v.sync.allow_dtype_cast,
        engine_kwargs={**({"enforce_eager": True} if v.enforce_eager else {}),
                       **({"disable_custom_all_reduce": True} if v.disable_custom_all_reduce else {})} or None,
        merge_precision=v.sync.merge_precision,
        prewake=v.sync.prewake,
        recorded_load=v.sync.recorded_load,
        overlap_wake=v.sync.overlap_wake,
        merge_into_engine=v.sync.merge_into_engine,
    )
