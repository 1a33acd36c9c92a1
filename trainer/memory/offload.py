"""Offload context for colocated rollouts: training parameters and/or optimizer state move to CPU while the
colocated engine decodes (engine start-up and LoRA loading included), and come back before the forward.

Exception-safe (restored in ``finally``). Supported:

* plain torch modules and optimizers (DDP-wrapped too): ``p.data``/``p.grad`` and the optimizer state move;
* DeepSpeed ZeRO-1/2/3 through the engine's own ``offload_states``/``reload_states`` (DeepSpeed >= 0.16), which
  moves the flat bf16/fp16 buffers and re-points the parameter views, the fp32 master partitions, the gradient
  partitions and the optimizer state. Pass the ``DeepSpeedEngine`` (HF ``Trainer.model_wrapped``), not the bare
  module: moving ``p.data`` of a ZeRO-1/2 parameter frees nothing (the flat buffer the optimizer owns stays put) and
  detaches the parameter from it until DeepSpeed's next step re-points the views, so that combination is refused. Parameters ZeRO-1/2 does not manage (frozen, e.g. a
  LoRA base) are moved like plain torch ones.
* ZeRO-3's ``offload_states`` only moves fp32 master weights / optimizer state for DeepSpeed's FusedAdam; with any
  other optimizer (e.g. the torch AdamW HF creates when the DeepSpeed config has no ``optimizer`` section) those
  two are moved here, by replacing ``.data`` of the fp32 partitions and of the optimizer state tensors in place.
  Its ``lp_params`` offload also fails when the module has frozen parameters (it maps every partition onto the
  trainable flat buffer); then that move is done here with DeepSpeed's trainable mapping, and reload stays its own.
  What moves under ZeRO-3 is each parameter's partition ``p.ds_tensor``: ``p.data`` of a released ZeRO-3 parameter
  is a 0-element placeholder that stays on the accelerator (no memory; gathering allocates on the accelerator
  whatever its device), so ``p.device`` still says cuda inside the block. Every gathered parameter (persistent ones
  included) is released first (``empty_partition_cache``) and gathered again by the next forward.

Known gaps (DeepSpeed's ZeRO-1/2 ``offload_states`` has no state type for them): inside a gradient-accumulation
window ZeRO-1 keeps the pending gradient in the unpartitioned bf16 ``p.grad`` of its parameters, and ZeRO-1/2 keep
their reduction bucket buffers (``reduce_bucket_size`` elements, fp32 under ZeRO-1); both stay on the accelerator.

Not supported (``OffloadUnsupportedError`` with advice): a DeepSpeed engine without a ZeRO optimizer (stage 0),
ZeRO-3 ``offload_param`` (parameters already live off the accelerator), and a DeepSpeed too old for
``offload_states``.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


class OffloadUnsupportedError(RuntimeError):
    """Offload cannot be applied safely to this model/optimizer."""


@dataclass
class OffloadStats:
    moved_param_bytes: int = 0
    moved_optimizer_bytes: int = 0
    peak_during_gib: float | None = None
    backend: str = "torch"


_KEY = "custom.extra.rollout_matching.offload"


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and _on_accelerator(t))


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict, str, torch.Tensor]]:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield state, key, value


# Tests on CPU-only hosts set this: CPU tensors then count as "on the accelerator" and every move copies into fresh
# storage, so aliasing/view bugs show up exactly as after a real device round-trip.
_SIMULATE_DEVICE_MOVES = False


def _on_accelerator(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" or _SIMULATE_DEVICE_MOVES


def _to_host(t: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    if _SIMULATE_DEVICE_MOVES and t.device.type == "cpu":
        return t.detach().clone()
    if pin_memory and torch.cuda.is_available() and t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t)
        return host
    return t.to("cpu")


def deepspeed_engine(model: Any) -> Any | None:
    """The DeepSpeedEngine if ``model`` is one (never imports deepspeed itself)."""
    if "deepspeed" not in sys.modules:
        return None
    from deepspeed.runtime.engine import DeepSpeedEngine
    return model if isinstance(model, DeepSpeedEngine) else None


def _unwrap_optimizer(optimizer: Any) -> Any:
    """accelerate's DeepSpeedOptimizerWrapper / AcceleratedOptimizer keep the real optimizer in ``.optimizer``."""
    seen = 0
    while optimizer is not None and type(optimizer).__name__ in {"DeepSpeedOptimizerWrapper", "AcceleratedOptimizer"} \
            and seen < 4:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def _is_zero_optimizer(optimizer: Any) -> bool:
    return any(c.__module__.startswith("deepspeed.") and c.__name__ in {"DeepSpeedZeroOptimizer",
                                                                       "DeepSpeedZeroOptimizer_Stage3"}
               for c in type(optimizer).__mro__)


def check_offloadable(model: torch.nn.Module, optimizer: Any = None) -> None:
    """Refuse the plain-torch path for DeepSpeed-managed state (it would corrupt it)."""
    if any(hasattr(p, "ds_id") or hasattr(p, "ds_tensor") for p in model.parameters()):
        raise OffloadUnsupportedError(
            f"{_KEY}: the model is partitioned by DeepSpeed ZeRO-3 but no DeepSpeedEngine was passed; pass the "
            "engine (HF Trainer.model_wrapped) so its offload_states/reload_states API is used, or use "
            "zero_optimization.offload_param / offload_optimizer in the DeepSpeed config instead")
    if _is_zero_optimizer(_unwrap_optimizer(optimizer)):
        raise OffloadUnsupportedError(
            f"{_KEY}: the optimizer is a DeepSpeed ZeRO optimizer but the model is not a DeepSpeedEngine; pass the "
            "engine (HF Trainer.model_wrapped): moving p.data of ZeRO-1/2 parameters leaves the flat bf16 buffer "
            "(and the fp32 partitions) on the accelerator and detaches the parameters from it")


@contextmanager
def offload_for_rollout(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, offload_model: bool = True,
                        offload_optimizer: bool = True, pin_memory: bool = True) -> Iterator[OffloadStats]:
    """Move parameters (+ grads) and optimizer state to CPU inside the block; restore devices afterwards."""
    engine = deepspeed_engine(model)
    if engine is not None:
        with _offload_deepspeed(engine, offload_model, offload_optimizer, pin_memory) as stats:
            yield stats
        return
    check_offloadable(model, optimizer)
    stats = OffloadStats()
    param_devices: list[tuple[torch.nn.Parameter, torch.device]] = []
    opt_devices: list[tuple[dict, str, torch.device]] = []
    try:
        if offload_model:
            param_devices = _offload_params(model.parameters(), stats, pin_memory)
        if offload_optimizer and optimizer is not None:
            for state, key, value in list(_optimizer_tensors(optimizer)):
                if _on_accelerator(value):
                    opt_devices.append((state, key, value.device))
                    stats.moved_optimizer_bytes += value.numel() * value.element_size()
                    state[key] = _to_host(value, pin_memory)
        _settle()
        yield stats
        _record_peak(stats)
    finally:
        _restore_params(param_devices)
        for state, key, device in opt_devices:
            state[key] = state[key].to(device, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _offload_params(params: Any, stats: OffloadStats, pin_memory: bool) -> list[tuple[torch.nn.Parameter,
                                                                                        torch.device]]:
    moved = []
    for p in params:
        if _on_accelerator(p):
            moved.append((p, p.device))
            stats.moved_param_bytes += p.numel() * p.element_size()
            p.data = _to_host(p.data, pin_memory)
            if p.grad is not None:
                p.grad = _to_host(p.grad, pin_memory)
    return moved


def _restore_params(moved: list[tuple[torch.nn.Parameter, torch.device]]) -> None:
    for p, device in moved:
        p.data = p.data.to(device, non_blocking=True)
        if p.grad is not None:
            p.grad = p.grad.to(device, non_blocking=True)


def _settle() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _record_peak(stats: OffloadStats) -> None:
    if torch.cuda.is_available():
        stats.peak_during_gib = torch.cuda.max_memory_allocated() / 2**30


# ---------------------------------------------------------------------------------------------------------- DeepSpeed


def _ds_state_bytes(zopt: Any, stage: int) -> dict[str, int]:
    """Bytes per DeepSpeed state type that currently sit on an accelerator (what offload_states frees)."""
    if stage == 3:
        lp = [getattr(zopt, "lp_param_buffer", None)]
        grads = [getattr(zopt, "grad_partitions_flat_buffer", None)]
        hp = list(getattr(zopt, "fp32_partitioned_groups_flat", []))
    else:
        lp = list(zopt.bit16_groups_flat)
        grads = [getattr(g, "flat_partition", None) for g in zopt.averaged_gradients.values() if g is not None]
        grads += [t for g in zopt.averaged_gradients.values() if g is not None and not hasattr(g, "flat_partition")
                  for t in g]
        hp = list(zopt.single_partition_of_fp32_groups)
    buckets = [b.buffer for b in getattr(zopt, "ipg_buckets", {}).values()
               if isinstance(getattr(b, "buffer", None), torch.Tensor)] if stage == 3 else []
    optim = [v for _, _, v in _optimizer_tensors(zopt.optimizer)]
    return {"lp_params": _nbytes(lp), "lp_grads": _nbytes(grads), "contiguous_grad_buffer": _nbytes(buckets),
            "hp_params": _nbytes(hp), "optim_states": _nbytes(optim)}


@contextmanager
def _offload_deepspeed(engine: Any, offload_model: bool, offload_optimizer: bool,
                       pin_memory: bool) -> Iterator[OffloadStats]:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    stage = engine.zero_optimization_stage()
    zopt = engine.optimizer
    if stage == 0 or not _is_zero_optimizer(zopt) or not hasattr(zopt, "offload_states"):
        raise OffloadUnsupportedError(
            f"{_KEY}: DeepSpeed engine at ZeRO stage {stage} with {type(zopt).__name__}: only ZeRO-1/2/3 optimizers "
            "(DeepSpeed >= 0.16) have offload_states; use zero_optimization.stage >= 1, or disable offload")
    param_offload = engine.zero_offload_param()
    if param_offload is not None and param_offload.device != OffloadDeviceEnum.none:
        raise OffloadUnsupportedError(
            f"{_KEY}: ZeRO-3 offload_param (device={param_offload.device}) already keeps parameters off the "
            "accelerator; disable the rollout offload (or drop zero_optimization.offload_param)")
    if zopt.offloaded_states:
        raise OffloadUnsupportedError(f"{_KEY}: the engine already has offloaded states {set(zopt.offloaded_states)}")

    include: list[Any] = []
    frozen_zero3: list[torch.nn.Parameter] = []
    if offload_model:
        include += [S.lp_params, S.lp_grads] + ([S.contiguous_grad_buffer] if stage == 3 else [])
        if stage == 3:
            managed = {id(p) for group in zopt.fp16_groups for p in group}
            frozen_zero3 = [p for p in engine.module.parameters() if id(p) not in managed]
            if frozen_zero3:  # DeepSpeed's ZeRO-3 lp_params offload maps *all* module partitions onto the trainable
                include.remove(S.lp_params)  # flat buffer and fails with frozen ones: that part is done here
    own_zero3_optimizer = False
    if offload_optimizer and not engine.zero_use_cpu_optimizer():
        import deepspeed.ops.adam.fused_adam as fused_adam
        if stage == 3 and type(zopt.optimizer) is not fused_adam.FusedAdam:
            own_zero3_optimizer = True  # DeepSpeed's ZeRO-3 path asserts FusedAdam; moved here instead
            _check_zero3_hp_not_aliased(zopt)
        else:
            include += [S.hp_params, S.optim_states]
    stats = OffloadStats(backend=f"deepspeed-zero{stage}")
    sizes = _ds_state_bytes(zopt, stage)
    stats.moved_param_bytes = sum(sizes[k] for k in ("lp_params", "lp_grads", "contiguous_grad_buffer")
                                  if offload_model)
    stats.moved_optimizer_bytes = (sizes["hp_params"] + sizes["optim_states"]) if offload_optimizer and not \
        engine.zero_use_cpu_optimizer() else 0
    frozen: list[tuple[torch.nn.Parameter, torch.device]] = []
    own: list[tuple[torch.Tensor, torch.device]] = []
    try:
        if offload_model and stage < 3:
            managed = {id(p) for group in zopt.bit16_groups for p in group}
            frozen = _offload_params((p for p in engine.module.parameters() if id(p) not in managed), stats,
                                     pin_memory)
        if own_zero3_optimizer:
            own = _offload_zero3_optimizer(zopt, pin_memory)
        if frozen_zero3:
            own += _offload_zero3_lp_params(zopt, frozen_zero3, pin_memory)
            stats.moved_param_bytes += _nbytes(p.ds_tensor for p in frozen_zero3)
        if include:
            engine.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=pin_memory,
                                  non_blocking=False)
        _settle()
        yield stats
        _record_peak(stats)
    finally:
        if zopt.offloaded_states:
            engine.reload_states(non_blocking=False)
        for t, device in own:
            t.data = t.data.to(device, non_blocking=True)
        _restore_params(frozen)
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _check_zero3_hp_not_aliased(zopt: Any) -> None:
    lp = getattr(zopt, "lp_param_buffer", None)
    lp_ptr = lp.untyped_storage().data_ptr() if isinstance(lp, torch.Tensor) and lp.numel() else None
    for hp in zopt.fp32_partitioned_groups_flat:
        if hp.numel() and hp.untyped_storage().data_ptr() == lp_ptr:
            raise OffloadUnsupportedError(
                f"{_KEY}: ZeRO-3 master weights share storage with the model weights (no bf16/fp16) and the "
                f"optimizer is {type(zopt.optimizer).__name__}, not DeepSpeed FusedAdam; set offload_optimizer: false "
                "or use the DeepSpeed config's optimizer section (FusedAdam) / zero_optimization.offload_optimizer")


def _offload_zero3_optimizer(zopt: Any, pin_memory: bool) -> list[tuple[torch.Tensor, torch.device]]:
    """fp32 master partitions + optimizer state of a ZeRO-3 optimizer that is not FusedAdam: ``.data`` is replaced in
    place, so the tensors the inner optimizer holds (params and state) keep their identity."""
    moved: list[tuple[torch.Tensor, torch.device]] = []
    tensors = list(zopt.fp32_partitioned_groups_flat) + [v for _, _, v in _optimizer_tensors(zopt.optimizer)]
    for t in tensors:
        if _on_accelerator(t):
            if getattr(t, "grad", None) is not None:
                raise OffloadUnsupportedError(f"{_KEY}: ZeRO-3 fp32 partition holds a gradient (inside step?)")
            moved.append((t, t.device))
            t.data = _to_host(t.data, pin_memory)
    return moved


def _offload_zero3_lp_params(zopt: Any, frozen: list[torch.nn.Parameter],
                             pin_memory: bool) -> list[tuple[torch.Tensor, torch.device]]:
    """ZeRO-3 bf16 partitions when the module has frozen parameters. DeepSpeed's ``offload_states(lp_params)`` maps
    every module partition onto the trainable flat buffer and fails; this is the same move with the trainable
    mapping (the one its ``reload_states`` uses, so reload stays DeepSpeed's), plus the frozen partitions, which are
    standalone tensors and are moved by ``.data``."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer

    zopt.empty_partition_cache()
    moved: list[tuple[torch.Tensor, torch.device]] = []
    for p in frozen:
        t = p.ds_tensor
        if _on_accelerator(t):
            moved.append((t, t.device))
            t.data = _to_host(t.data, pin_memory)
    buf = zopt.lp_param_buffer
    if _on_accelerator(buf):
        host = _to_host(buf.data, pin_memory)
        buf.data = host
        for tensor, offset, numel in get_mapping_to_flat_buffer(zopt._get_parameter_partitions()):
            tensor.data = host.narrow(0, offset, numel)
        zopt.fp16_partitioned_groups_flat.clear()
        zopt.offloaded_states.add(OffloadStateTypeEnum.lp_params)
    return moved
