"""Offload context for colocated rollouts: training parameters and/or optimizer state move to CPU while the
colocated engine decodes (engine start-up and LoRA loading included), and come back before the forward.

Exception-safe (restored in ``finally``). Plain torch modules and optimizers are supported; DeepSpeed ZeRO-3
partitions parameters itself, so the context refuses it with advice instead of corrupting state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


class OffloadUnsupportedError(RuntimeError):
    """Offload cannot be applied safely to this model/optimizer."""


@dataclass
class OffloadStats:
    moved_param_bytes: int = 0
    moved_optimizer_bytes: int = 0
    peak_during_gib: float | None = None


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict, str, torch.Tensor]]:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield state, key, value


def check_offloadable(model: torch.nn.Module) -> None:
    if any(hasattr(p, "ds_id") or hasattr(p, "ds_tensor") for p in model.parameters()):
        raise OffloadUnsupportedError(
            "custom.extra.rollout_matching.offload: the model is partitioned by DeepSpeed ZeRO-3; use ZeRO-3's own "
            "offload_param / offload_optimizer settings in the DeepSpeed config instead, or disable offload"
        )


@contextmanager
def offload_for_rollout(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, offload_model: bool = True,
                        offload_optimizer: bool = True) -> Iterator[OffloadStats]:
    """Move parameters (+ grads) and optimizer state to CPU inside the block; restore devices afterwards."""
    check_offloadable(model)
    stats = OffloadStats()
    param_devices: list[tuple[torch.nn.Parameter, torch.device]] = []
    opt_devices: list[tuple[dict, str, torch.device]] = []
    try:
        if offload_model:
            for p in model.parameters():
                if p.device.type != "cpu":
                    param_devices.append((p, p.device))
                    stats.moved_param_bytes += p.numel() * p.element_size()
                    p.data = p.data.to("cpu", non_blocking=True)
                    if p.grad is not None:
                        p.grad = p.grad.to("cpu", non_blocking=True)
        if offload_optimizer and optimizer is not None:
            for state, key, value in list(_optimizer_tensors(optimizer)):
                if value.device.type != "cpu":
                    opt_devices.append((state, key, value.device))
                    stats.moved_optimizer_bytes += value.numel() * value.element_size()
                    state[key] = value.to("cpu", non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        yield stats
        if torch.cuda.is_available():
            stats.peak_during_gib = torch.cuda.max_memory_allocated() / 2**30
    finally:
        for p, device in param_devices:
            p.data = p.data.to(device, non_blocking=True)
            if p.grad is not None:
                p.grad = p.grad.to(device, non_blocking=True)
        for state, key, device in opt_devices:
            state[key] = state[key].to(device, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
