"""``training.compile_decoder_layers``: ``torch.compile`` each decoder layer of the language model (dynamic shapes).

Small models on fast GPUs are launch-bound in the teacher-forced step; compiling the layers fuses the norm / rotary /
activation kernels and cuts Python dispatch (measured in ``docs/benchmarks``). Layers are compiled in place
(``nn.Module.compile``), so checkpointing wrappers, peft adapters inside the layers and the packed attention
interface keep working. Rollouts with the HF backend run eagerly (``eager_rollouts``) unless that backend compiles
its own decoding step.

No pack layout recompiles a layer after the first step (``compile/recompiles_after_first_step``): row lengths are
dynamic, segment counts unbacked (``trainer.packing.varlen_attention.unguarded_segment_counts``), a multimodal
model's rows reach the layers in one form with or without images (``trainer.packing.packed_batch.pack_targets``), and
Inductor makes no kernel choice that guards on the row length (``LENGTH_AGNOSTIC_INDUCTOR``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

import torch

#: Inductor options (``torch._inductor.config`` names) under which no kernel choice guards on the row length. Triton's
#: mix-order reduction (the norms' weight gradients fused with their row reductions) is taken only for rows of at
#: least 4096 tokens (and 2x the hidden size, and 5 Mi elements) unless non-strict: a layer first compiled on a full
#: 8192-token row then recompiles at the first row under 4096 tokens (a rank's last row of a step in which it ran out
#: of segments, the step it also trains filler rows; 2026-11-28, 2 x H200, torch 2.11, random Qwen3-VL-2B: ``python -m
#: trainer bench run benchmarks/layouts.yaml --only colocate-2-shipped``). Non-strict keeps the fusion at every length.
LENGTH_AGNOSTIC_INDUCTOR = {"triton.mix_order_reduction_non_strict_mode": True}


def length_agnostic_options(known: Collection[str] | None = None) -> dict[str, bool]:
    """``LENGTH_AGNOSTIC_INDUCTOR``, less what ``known`` (Inductor's option names; default: this torch's) lacks. An
    Inductor with the mix-order reduction but no non-strict switch gets the reduction turned off instead."""
    if known is None:
        from torch._inductor import config as inductor_config

        known = inductor_config.get_config_copy()
    options: dict[str, bool] = {}
    for name, value in LENGTH_AGNOSTIC_INDUCTOR.items():
        fallback = name.replace("_non_strict_mode", "")
        if name in known:
            options[name] = value
        elif fallback != name and fallback in known:
            options[fallback] = False
    return options


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The language model's decoder layers (through peft wrappers and VL models)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"training.compile_decoder_layers: no decoder layers found on {type(base).__name__}; "
                         "set it to false for this model")
    return layers


def traceable_dora_weights() -> bool:
    """Make peft's DoRA read a plain base weight without a Dynamo graph break; False without peft (or without the
    helper it replaces).

    DoRA reads its base layer's weight through ``peft.utils.integrations.dequantize_module_weight``, whose torchao check
    (``type(weight).__module__.startswith``) Dynamo cannot trace: a graph break at every DoRA module of a compiled
    layer (7 a Qwen3 layer). A weight whose type is exactly ``nn.Parameter`` (nothing quantized: no HQQ ``W_q``, no
    bitsandbytes or torchao subclass) is what peft returns as it is, so it is returned directly; anything else goes
    to peft's own function. Process-wide and idempotent."""
    try:
        from peft.tuners.lora import dora
    except ImportError:
        return False
    peft_dequantize = getattr(dora, "dequantize_module_weight", None)
    if peft_dequantize is None:  # a peft that reads DoRA's weight another way: nothing to replace
        return False
    if getattr(peft_dequantize, "plain_weights_first", False):
        return True

    def dequantize_module_weight(module: torch.nn.Module) -> torch.Tensor:
        weight = getattr(module, "weight", None)
        if type(weight) is torch.nn.Parameter and not hasattr(module, "W_q"):
            return weight
        return peft_dequantize(module)

    dequantize_module_weight.plain_weights_first = True
    dora.dequantize_module_weight = dequantize_module_weight
    return True


def compile_decoder_layers(model: torch.nn.Module, activation_memory_budget: float = 1.0,
                           backend: str | Callable = "inductor") -> int:
    """Compile every decoder layer in place with dynamic shapes (peft DoRA made traceable first:
    ``traceable_dora_weights``); returns how many were compiled.

    ``activation_memory_budget`` (``training.compile_activation_memory_budget``, in (0, 1]): set process-wide as
    ``torch._functorch.config.activation_memory_budget`` before anything compiles, so the min-cut partitioner of each
    layer keeps at most that share of its default saved activations and recomputes the rest in the backward (it
    recomputes the cheapest ops first: the attention block before the MLP's matmuls). ``backend``: torch.compile's
    (tests count compiles with a counting one); Inductor gets ``length_agnostic_options``."""
    if not 0.0 < activation_memory_budget <= 1.0:
        raise ValueError(f"training.compile_activation_memory_budget {activation_memory_budget!r}: a fraction in (0, 1]")
    layers = decoder_layers(model)
    traceable_dora_weights()
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = float(activation_memory_budget)
    options = {"options": length_agnostic_options()} if backend == "inductor" else {}
    for layer in layers:
        layer.compile(dynamic=True, backend=backend, **options)
    return len(layers)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (0 when nothing was compiled; vLLM's own graphs count too, at
    engine start). A rise during training means a recompile."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextmanager
def eager_rollouts(enabled: bool) -> Iterator[None]:
    """Inside the block compiled modules run eagerly (generation shapes would only cause recompiles)."""
    if not enabled:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield
