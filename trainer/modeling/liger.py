"""``training.use_liger_kernel``: Liger Kernel's fused RMSNorm, SwiGLU and RoPE (Triton) in the Qwen3 / Qwen3-VL text
model, applied to the loaded (and tuned) model instance through Liger's own monkey-patch entry points
(``apply_liger_kernel_to_qwen3_vl`` / ``apply_liger_kernel_to_qwen3`` with ``model=``), pinned to liger-kernel 0.8.5
(the ``liger`` extra: ``pip install 'rollout-matching[liger]'``; it needs Triton and a CUDA GPU).

What is patched, read from liger-kernel 0.8.5's ``transformers/monkey_patch.py``:

- Liger's loss kernels stay off (``cross_entropy=False``, ``fused_linear_cross_entropy=False``): the loss is this
  project's chunked objective over supervised rows (``trainer.losses.chunked_objective``), which never calls the
  model's ``lm_head`` forward on all rows nor ``F.cross_entropy`` over the vocabulary as HF's loss does.
- RMSNorm: the instance's norms (final, input / post-attention, ``q_norm`` / ``k_norm``) get ``LigerRMSNorm.forward``
  (offset 0, llama casting), per instance.
- RoPE: ``modeling_qwen3(_vl).apply_rotary_pos_emb`` becomes ``liger_rotary_pos_emb`` (for Qwen3-VL also the vision
  tower's ``apply_rotary_pos_emb_vision``). This swap is module-global: every model of that type in the process uses
  it from then on. **Per-segment mRoPE is kept**: Liger's kernel rotates token ``(b, t)`` of q and k by ``cos[b, t]``
  / ``sin[b, t]`` as given and ignores ``position_ids``; those cos / sin come from HF's
  ``Qwen3VLTextRotaryEmbedding``, which still computes them from the packed row's 3-D position ids (each segment's
  own, ``trainer.packing.packed_batch.mrope_position_ids``) and interleaves the t / h / w sections
  before the rotation, in ``cat(freqs, freqs)`` layout, the layout Liger's kernel reads (its first half). So the
  RoPE part is applied for Qwen3-VL too.
- SwiGLU: Qwen3's entry point patches each decoder MLP (``swiglu=True``). Qwen3-VL's 0.8.5 entry point takes a
  ``swiglu`` flag but patches nothing for it, so it is called with ``swiglu=False`` and each text decoder MLP here
  gets ``LigerSwiGLUMLP.forward`` bound to it (what Liger's ``_patch_swiglu_module`` does for other models): the
  same ``gate_proj`` / ``up_proj`` / ``down_proj`` modules (peft LoRA layers included), ``silu(gate) * up`` fused.

Parameter names and the state dict do not change (weight sync, LoRA, checkpoints are unaffected).
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from trainer.extras import require

log = logging.getLogger(__name__)

KEY = "training.use_liger_kernel"
#: model_type -> Liger's entry point
ENTRY_POINTS = {"qwen3_vl": "apply_liger_kernel_to_qwen3_vl", "qwen3": "apply_liger_kernel_to_qwen3"}
#: the loss kernels stay off (module docstring)
LOSS_FLAGS = {"cross_entropy": False, "fused_linear_cross_entropy": False}


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the instance Liger's entry points accept)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def apply_liger_kernel(model: torch.nn.Module) -> dict[str, Any]:
    """Patch ``model`` (peft-wrapped or not) in place; returns what was applied. ``MissingExtraError`` naming
    ``training.use_liger_kernel`` and the install command when liger-kernel is not importable; ``ValueError`` for a
    model type Liger is not wired for here."""
    base = base_model(model)
    model_type = getattr(base.config, "model_type", None)
    if model_type not in ENTRY_POINTS:
        raise ValueError(f"{KEY}: Liger is wired for {', '.join(sorted(ENTRY_POINTS))} models here, not "
                         f"{model_type!r}; set it to false")
    liger = require("liger", f"{KEY}: true (Liger's fused RMSNorm, SwiGLU and RoPE)")
    patch = getattr(liger, ENTRY_POINTS[model_type])
    applied: dict[str, Any] = {"model_type": model_type, "entry_point": ENTRY_POINTS[model_type], "rope": True,
                               "rms_norm": True, "swiglu": True, "loss_kernels": False}
    if model_type == "qwen3":
        patch(rope=True, rms_norm=True, swiglu=True, model=base, **LOSS_FLAGS)
        applied["swiglu_mlps"] = len(base.model.layers)
    else:
        patch(rope=True, rms_norm=True, swiglu=False, model=base, **LOSS_FLAGS)
        applied["swiglu_mlps"] = _patch_swiglu(liger, base.model.language_model)
        applied["swiglu"] = applied["swiglu_mlps"] > 0
    log.info("%s: %s", KEY, applied)
    return applied


def _patch_swiglu(liger: Any, text_model: torch.nn.Module) -> int:
    """Bind ``LigerSwiGLUMLP.forward`` to each SwiGLU decoder MLP of a Qwen3-VL text model; returns how many."""
    if getattr(text_model.config, "hidden_act", None) not in ("silu", "swish"):
        log.warning("%s: hidden_act %r is not SwiGLU; MLPs left unfused", KEY, text_model.config.hidden_act)
        return 0
    forward = liger.LigerSwiGLUMLP.forward
    for layer in text_model.layers:
        layer.mlp.forward = types.MethodType(forward, layer.mlp)
    return len(text_model.layers)
