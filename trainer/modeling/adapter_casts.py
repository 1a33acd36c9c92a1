"""peft's per-layer input cast, switched off where mixed precision makes it a pure copy.

peft keeps LoRA / DoRA weights in float32 beside a bf16 base model (``autocast_adapter_dtype``) and casts every
adapted linear's input to float32 before the adapter's A projection. When the forward runs under bf16 / fp16
autocast (the Trainer's mixed precision), autocast casts that input straight back to 16 bits for the matmul: each
adapted linear pays two copies of its whole input per forward, again per gradient-checkpoint recompute and in the
backward. On a packed 16k-token row of the 8B (7 adapted linears in each of 36 layers) those copies were ~20 % of
the forward + backward's GPU time (``training.profile_steps``, H100).

``uncast_adapter_inputs`` turns the cast off for the enclosed region only, so a forward outside autocast (HF
generation, evaluation) keeps peft's own behaviour. Invariant: under autocast the result is bit-identical (a
bf16 -> fp32 -> bf16 round trip is exact), only the copies go. That holds for plain LoRA layers without dropout,
the only ones ``adapter_layers`` returns: DoRA (and other peft variants) use the float32 input in elementwise
work that autocast leaves in float32, and dropout draws its mask per dtype.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


def adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """peft LoRA layers of ``model`` whose input cast can go: plain LoRA (no DoRA / other variant), no dropout.
    Empty for a model without such adapters or without peft installed."""
    try:
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, LoraLayer) and not getattr(m, "lora_variant", None)
            and all(isinstance(d, torch.nn.Identity) for d in m.lora_dropout.values())]


@contextmanager
def uncast_adapter_inputs(layers: Sequence[torch.nn.Module]) -> Iterator[None]:
    """peft's input cast off on ``layers`` inside the block (restored on exit, exceptions included). Only for code
    that runs its forward under autocast: without it the adapter would see a 16-bit input and float32 weights."""
    before = [getattr(m, "cast_input_dtype_enabled", True) for m in layers]
    try:
        for m in layers:
            m.cast_input_dtype_enabled = False
        yield
    finally:
        for m, old in zip(layers, before):
            m.cast_input_dtype_enabled = old
