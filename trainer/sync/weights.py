"""What a weight sync sends: the learner's weights in HF checkpoint naming, merged or adapter-only.

- ``full_weights(model)``: every base weight a rollout engine loads, LoRA deltas merged out of place (the
  training model is not modified), names as in the HF checkpoint (``model.layers.0.self_attn.q_proj.weight``),
  ``lm_head.weight`` present even when tied (vLLM's in-place reload only refreshes the LM head when it is sent).
- ``adapter_weights(peft_model)``: the active LoRA adapter as peft saves it (config dict + tensors).
- ``safetensors_bytes`` / ``tensors_from_safetensors``: the in-band wire format; ``write_adapter_dir``: the
  on-disk adapter layout vLLM's ``LoRARequest`` loads.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.sync.wire import decode, encode

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA adapter: the peft config as a JSON-serialisable dict and its tensors (peft's saved names)."""

    peft_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _checkpoint_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _ties_embeddings(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return bool(getattr(cfg, "tie_word_embeddings", False) or getattr(text_cfg, "tie_word_embeddings", False))


def _lora_deltas(model: torch.nn.Module) -> dict[str, list[Any]]:
    """``{checkpoint weight name: merge terms}`` for every LoRA-wrapped layer of the active adapters. A term is
    ``(B, A, scaling)`` for a plain linear LoRA (merged with one ``addmm``) or peft's delta tensor otherwise."""
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, list[Any]] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or module.merged:
            continue
        terms: list[Any] = []
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            if module.use_dora.get(adapter, False):
                raise _DoraNeedsMerge()
            a, b = module.lora_A[adapter], module.lora_B[adapter]
            plain = (isinstance(a, torch.nn.Linear) and isinstance(b, torch.nn.Linear) and a.weight.dtype == b.weight.dtype
                     and not getattr(module, "fan_in_fan_out", False) and module.get_base_layer().weight.dim() == 2)
            if plain:
                terms.append((b.weight.detach(), a.weight.detach(), float(module.scaling[adapter])))
            else:
                terms.append(module.get_delta_weight(adapter))
        if terms:
            deltas[_checkpoint_name(f"{module_name}.weight")] = terms
    return deltas


def _merged(weight: torch.Tensor, terms: list[Any]) -> torch.Tensor:
    """``weight`` plus its LoRA terms, computed in the wider of the two dtypes and rounded once (as peft's merge)."""
    value = weight
    for term in terms:
        if isinstance(term, tuple):
            b, a, scaling = term
            wide = torch.promote_types(value.dtype, b.dtype)
            value = torch.addmm(value.to(wide), b.to(wide), a.to(wide), alpha=scaling)
        else:
            value = value.to(torch.promote_types(value.dtype, term.dtype)) + term
    return value.to(weight.dtype)


class _DoraNeedsMerge(Exception):
    """DoRA cannot be merged as an additive delta; peft's merge/unmerge is used instead."""


def _collect(model: torch.nn.Module, deltas: dict[str, list[Any]], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if "lora_" in name or ".original_module." in name:
            continue
        key = _checkpoint_name(name).replace(".modules_to_save.default.", ".")
        value = tensor.detach()
        if key in deltas:
            value = _merged(value, deltas[key])
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[key] = value.contiguous()
    return out


@torch.no_grad()
def full_weights(model: torch.nn.Module, dtype: torch.dtype | None = None, merge_adapter: bool = True) -> dict[str, torch.Tensor]:
    """Base weights in HF checkpoint naming (see module docstring), LoRA merged unless ``merge_adapter`` is
    false (then the frozen base alone); the model is left unchanged."""
    if is_peft_model(model) and not merge_adapter:
        out = _collect(model, {}, dtype)
    elif is_peft_model(model):
        try:
            out = _collect(model, _lora_deltas(model), dtype)
        except _DoraNeedsMerge:
            model.merge_adapter()
            try:
                out = {k: v.clone() for k, v in _collect(model, {}, dtype).items()}
            finally:
                model.unmerge_adapter()
    else:
        out = _collect(model, {}, dtype)
    if _ties_embeddings(model) and "lm_head.weight" not in out:
        embed = next((k for k in out if k.endswith("embed_tokens.weight")), None)
        if embed is not None:
            out["lm_head.weight"] = out[embed]
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def adapter_kind(model: torch.nn.Module) -> str | None:
    """``"lora"``, ``"dora"`` (not servable as a vLLM adapter) or None for a model without an adapter."""
    if not is_peft_model(model):
        return None
    cfg = model.peft_config[getattr(model, "active_adapter", "default")]
    return "dora" if getattr(cfg, "use_dora", False) else "lora"


def peft_config_dict(model: torch.nn.Module, adapter_name: str | None = None) -> dict[str, Any]:
    name = adapter_name or getattr(model, "active_adapter", "default")
    return _jsonable(model.peft_config[name].to_dict())


@torch.no_grad()
def adapter_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> AdapterWeights:
    """The active adapter's tensors under the names ``save_pretrained`` writes, plus its config."""
    if not is_peft_model(model):
        raise ValueError("adapter sync needs a peft model (tuner.train_type lora/dora); use sync mode 'full'")
    from peft import get_peft_model_state_dict

    tensors = {}
    for k, v in get_peft_model_state_dict(model).items():
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        tensors[k] = v.contiguous()
    return AdapterWeights(peft_config_dict(model), tensors)


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytearray:
    """``tensors`` (any device; shared storage fine, so tied weights are too) as one safetensors payload, each
    tensor copied once into it (``trainer.sync.wire.encode``)."""
    return encode(tensors, metadata)


def tensors_from_safetensors(blob: bytes | bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors payload, as read-only views of ``blob`` (``trainer.sync.wire.decode``)."""
    return decode(blob)[0]


def write_adapter_dir(directory: str | Path, adapter: AdapterWeights) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (replacing any previous adapter there)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (ADAPTER_WEIGHTS + ".tmp")
    tmp.write_bytes(safetensors_bytes(adapter.tensors))
    tmp.replace(d / ADAPTER_WEIGHTS)
    (d / ADAPTER_CONFIG).write_text(json.dumps(adapter.peft_config, indent=1))
    return d


_CHUNK = 1 << 24


@torch.no_grad()
def tensor_checksum(tensor: torch.Tensor) -> str:
    """A bit-exact checksum of ``tensor``'s bytes, the same on any device: its raw bytes read as int32 words (bytes
    when the size is not a multiple of 4), then the wrapping int64 sums of the words and of the words times a
    position weight ``i % 65521 + 1``, as ``"<hex>-<hex>"``. Computed where the tensor lives (no host copy)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=flat.device).remainder_(65521).add_(1)
        total += w.sum()
        weighted += (w * pos).sum()
    return f"{int(total) & (2**64 - 1):016x}-{int(weighted) & (2**64 - 1):016x}"


def tensor_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``tensor_checksum`` of each tensor, by name (``/rm/weights_checksum/`` answers this for the served model)."""
    return {name: tensor_checksum(t) for name, t in tensors.items()}
