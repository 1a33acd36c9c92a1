"""Mixed precision without DeepSpeed: float32 master weights, 16-bit compute.

``model.torch_dtype: bfloat16`` (or ``float16``) names the *compute* dtype. Without DeepSpeed (which keeps its own
float32 copy) the optimizer would otherwise add each AdamW step to 16-bit weights, where a step below half a bf16
ulp is lost (a norm gain near 1.0 never moves at lr 1e-4). So every trainable floating parameter is kept in float32
(the master weight the optimizer updates; LoRA / DoRA adapters included) and the forward runs under autocast in the
compute dtype; frozen parameters are held in the compute dtype. A full fine-tune loads its checkpoint in float32
(``load_dtype``), so a float32 checkpoint's master weights (a saved warm-up) come back exactly. The compute dtype is
recorded on the model: the rollout engine serves it and weight syncs cast to it (``compute_dtype``).

Invariants: every trainable floating parameter ends float32, every frozen one in the compute dtype.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

#: the attribute on the trained model that records its compute dtype
COMPUTE_DTYPE_ATTR = "rm_compute_dtype"
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MasterWeights:
    """What ``keep_master_weights_fp32`` widened: ``params`` tensors, ``added_bytes`` more device memory."""

    compute_dtype: torch.dtype
    params: int
    added_bytes: int


def load_dtype(torch_dtype: str, train_type: str, deepspeed: bool) -> torch.dtype:
    """The dtype to load a checkpoint in: float32 for a full fine-tune that keeps master weights, else
    ``torch_dtype`` (an adapter's frozen base loads 16-bit; DeepSpeed keeps its own float32 copy)."""
    dtype = getattr(torch, torch_dtype)
    if dtype in HALF_DTYPES and train_type == "full" and not deepspeed:
        return torch.float32
    return dtype


def keep_master_weights_fp32(model: torch.nn.Module, torch_dtype: str, deepspeed: bool) -> MasterWeights | None:
    """Widen every trainable 16-bit floating parameter of ``model`` to float32, hold every frozen float32 one in
    ``torch_dtype``, and record ``torch_dtype`` as its compute dtype; None (nothing changed) for a float32
    ``torch_dtype`` or under DeepSpeed. Logs one line."""
    dtype = getattr(torch, torch_dtype)
    if deepspeed or dtype not in HALF_DTYPES:
        return None
    params = added = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype in HALF_DTYPES:
            added += p.numel() * 2
            p.data = p.data.float()
            params += 1
        elif p.requires_grad and p.dtype == torch.float32:
            added += p.numel() * 2
            params += 1
        elif not p.requires_grad and p.dtype == torch.float32:
            p.data = p.data.to(dtype)
    setattr(model, COMPUTE_DTYPE_ATTR, dtype)
    log.info("model.torch_dtype %s without DeepSpeed: %d trainable tensors kept in float32 as master weights "
             "(+%.2f GiB), the forward under %s autocast, the rollout engine served %s", torch_dtype, params,
             added / 2**30, torch_dtype, torch_dtype)
    return MasterWeights(dtype, params, added)


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes in (and a rollout engine serves): the recorded one, else its first parameter's."""
    recorded = getattr(model, COMPUTE_DTYPE_ATTR, None)
    if recorded is not None:
        return recorded
    return next(model.parameters()).dtype


def serving_cast(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype a weight sync casts the model's float32 master weights to, or None when they are served as kept."""
    recorded = getattr(model, COMPUTE_DTYPE_ATTR, None)
    return recorded if recorded in HALF_DTYPES else None


def autocast_for(model: torch.nn.Module, device_type: str):
    """An autocast context in the model's compute dtype when it keeps float32 master weights, else a no-op."""
    dtype = serving_cast(model)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
