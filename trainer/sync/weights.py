"""What a weight sync sends: the learner's weights in HF checkpoint naming, merged or adapter-only.

- ``full_weights(model)``: every base weight a rollout engine loads, LoRA deltas merged out of place (the
  training model is not modified), names as in the HF checkpoint (``model.layers.0.self_attn.q_proj.weight``),
  ``lm_head.weight`` present even when tied (vLLM's in-place reload only refreshes the LM head when it is sent).
- ``changing_keys(model)``: the keys of ``full_weights`` that training can change (trainable parameters and the
  weights an adapter merges into); the others stay what the rollout servers loaded, so a server that has them
  need not receive them again.
- ``adapter_weights(peft_model)``: the active LoRA adapter as peft saves it (config dict + tensors).
- ``safetensors_bytes`` / ``tensors_from_safetensors``: the in-band wire format; ``write_adapter_dir``: the
  on-disk adapter layout vLLM's ``LoRARequest`` loads.
"""

from __future__ import annotations

import enum
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.precision import serving_cast
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


#: fp32 elements per batched float32 merge (256 MiB of scratch): LoRA products of one shape are computed together in
#: chunks
MERGE_CHUNK_ELEMENTS = 64 * 2**20
#: ``sync.merge_precision``: how a plain LoRA product is merged into a 16-bit weight (``_merge_terms``)
MERGE_PRECISIONS = ("weight_dtype", "float32")


@dataclass(frozen=True)
class _Slot:
    """Where one state-dict entry lives: looked up at every sync, so a parameter replaced since (``.to()``,
    ZeRO-3 gathering) is read as it is now."""

    key: str
    module: torch.nn.Module
    name: str
    is_param: bool

    def tensor(self) -> torch.Tensor | None:
        return (self.module._parameters if self.is_param else self.module._buffers).get(self.name)


@dataclass(frozen=True)
class _LoraFactors:
    """One adapter of one LoRA layer: its A/B modules (their ``weight`` is read at every sync), whether it is a
    plain linear LoRA (mergeable as ``B @ A``) and whether it is DoRA."""

    a: torch.nn.Module
    b: torch.nn.Module
    linear: bool
    dora: bool


@dataclass(frozen=True)
class _LoraLayer:
    key: str
    module: torch.nn.Module
    adapters: dict[str, _LoraFactors]


@dataclass(frozen=True)
class _Plan:
    """A model's weight layout, built once from ``state_dict`` (slow on a peft model: thousands of modules) and
    reused while the module tree and the active adapters stay the same."""

    signature: tuple[Any, ...]
    slots: tuple[_Slot, ...]
    lora_layers: tuple[_LoraLayer, ...]


def _lora_layer(key: str, module: torch.nn.Module) -> _LoraLayer:
    base_is_matrix = module.get_base_layer().weight.dim() == 2
    fan_in_fan_out = bool(getattr(module, "fan_in_fan_out", False))
    adapters = {}
    for adapter, a in module.lora_A.items():
        b = module.lora_B[adapter]
        linear = (isinstance(a, torch.nn.Linear) and isinstance(b, torch.nn.Linear) and not fan_in_fan_out
                  and base_is_matrix)
        adapters[adapter] = _LoraFactors(a, b, linear, bool(module.use_dora.get(adapter, False)))
    return _LoraLayer(key, module, adapters)


_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, _Plan] = weakref.WeakKeyDictionary()
#: ``_REGISTRATIONS[0]`` counts submodule registrations anywhere in the process (torch's global hook); a plan
#: checked at one count stays valid while it is unchanged, without walking the module tree again
_REGISTRATIONS = [0]
_CHECKED_AT: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def _count_registration(module, name, submodule):
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


def _adapters(model: torch.nn.Module) -> tuple[str, ...]:
    return tuple(model.active_adapters) if is_peft_model(model) else ()


def _still_valid(plan: _Plan, model: torch.nn.Module) -> bool:
    """One walk of the module tree: the same number of modules, every planned module still in it (a module
    replaced by another of the same kind keeps the count), every slot holding a tensor."""
    live = {id(m) for m in model.modules()}
    return (plan.signature == (len(live), _adapters(model)) and all(id(s.module) in live for s in plan.slots)
            and all(id(layer.module) in live for layer in plan.lora_layers)
            and all(s.tensor() is not None for s in plan.slots))


def _plan(model: torch.nn.Module) -> _Plan:
    """The cached plan while the module tree and the active adapters are unchanged. Walking a peft model's tree to
    tell (thousands of modules) cost as much as the rest of a sync's host work, so it is walked again only after a
    submodule was registered somewhere in the process (adding or replacing a module; peft's adapter changes do) or
    a slot lost its tensor."""
    plan = _PLANS.get(model)
    if (plan is not None and _CHECKED_AT.get(model) == _REGISTRATIONS[0] and plan.signature[1] == _adapters(model)
            and all(s.tensor() is not None for s in plan.slots)):
        return plan
    at = _REGISTRATIONS[0]
    if plan is not None and _still_valid(plan, model):
        _CHECKED_AT[model] = at
        return plan
    from peft.tuners.lora import LoraLayer

    slots = []
    for name in model.state_dict(keep_vars=True):
        if "lora_" in name or ".original_module." in name:
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if attr not in module._parameters and attr not in module._buffers:
            continue  # extra state (no tensor of the model's own)
        key = _checkpoint_name(name).replace(".modules_to_save.default.", ".")
        slots.append(_Slot(key, module, attr, attr in module._parameters))
    lora = tuple(_lora_layer(_checkpoint_name(f"{n}.weight"), m) for n, m in model.named_modules()
                 if isinstance(m, LoraLayer))
    plan = _Plan((sum(1 for _ in model.modules()), _adapters(model)), tuple(slots), lora)
    if all(s.module is not model for s in slots):  # a slot holding the model itself would keep the weak key alive
        _PLANS[model] = plan
        _CHECKED_AT[model] = at
    return plan


def _lora_deltas(plan: _Plan) -> dict[str, list[Any]]:
    """``{checkpoint weight name: merge terms}`` for every LoRA-wrapped layer of the active adapters. A term is
    ``(B, A, scaling)`` for a plain linear LoRA (merged with a matrix product) or peft's delta tensor otherwise."""
    deltas: dict[str, list[Any]] = {}
    for layer in plan.lora_layers:
        module = layer.module
        if module.merged:
            continue
        terms: list[Any] = []
        for adapter in module.active_adapters:
            factors = layer.adapters.get(adapter)
            if factors is None:
                continue
            if factors.dora:
                raise _DoraNeedsMerge()
            a, b = factors.a._parameters["weight"], factors.b._parameters["weight"]
            if factors.linear and a.dtype == b.dtype:
                terms.append((b.detach(), a.detach(), float(module.scaling[adapter])))
            else:
                terms.append(module.get_delta_weight(adapter))
        if terms:
            deltas[layer.key] = terms
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


@dataclass(frozen=True)
class LoraProduct:
    """One plain LoRA layer's merge, ``weight + scaling * b @ a``, left for whoever writes the result: ``b`` and
    ``a`` are already rounded to the weight's dtype (``merge_precision`` weight_dtype), so ``add_to`` is the one GEMM
    whose accumulator starts from the weight and whose result is rounded once, bit for bit what ``full_weights``
    returns, written into ``out`` when given (e.g. the engine's own parameter: no merged copy is made)."""

    b: torch.Tensor
    a: torch.Tensor
    scaling: float

    def add_to(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return torch.addmm(weight, self.b, self.a, alpha=self.scaling)
        return torch.addmm(weight, self.b, self.a, alpha=self.scaling, out=out)


def _merge_terms(weights: dict[str, torch.Tensor], deltas: dict[str, list[Any]], precision: str = "weight_dtype"
                 ) -> tuple[dict[str, torch.Tensor], dict[str, LoraProduct]]:
    """``weights[key]`` plus its LoRA terms for every key of ``deltas``, as (merged tensors, products left to add).
    Single-term plain LoRA layers of one shape, dtype, device and scaling are merged as a group:

    - ``precision="float32"`` (peft's arithmetic): weights and factors in the wider dtype, one stacked ``baddbmm_``
      per chunk of ``MERGE_CHUNK_ELEMENTS``, rounded once back into the weight's dtype (each weight is copied into the
      wide dtype and back: ~6x the bytes of the weight-dtype merge); merged here;
    - ``precision="weight_dtype"``: the factors rounded to the weight's dtype (as the training forward's matmuls
      use them under bf16 autocast), then one ``addmm`` per layer whose accumulator starts from the weight: the
      product and the sum accumulate in float32 inside the GEMM and are rounded once, reading and writing each
      weight once. It differs from the float32 merge by at most one rounding step in a few percent of elements.
      Returned as ``LoraProduct``s (the factors rounded, the GEMM not run).

    Layers with several terms or a non-matrix delta always merge here through ``_merged`` (wide dtype, one
    rounding)."""
    if precision not in MERGE_PRECISIONS:
        raise ValueError(f"merge precision {precision!r}: use one of {MERGE_PRECISIONS}")
    out: dict[str, torch.Tensor] = {}
    products: dict[str, LoraProduct] = {}
    groups: dict[tuple[Any, ...], list[str]] = {}
    for key, terms in deltas.items():
        w = weights[key]
        if len(terms) == 1 and isinstance(terms[0], tuple):
            b, a, scaling = terms[0]
            groups.setdefault((w.shape, w.dtype, w.device, b.shape, a.shape, b.dtype, scaling), []).append(key)
        else:
            out[key] = _merged(w, terms)
    for (shape, dtype, _, _, _, factor_dtype, scaling), keys in groups.items():
        wide = torch.promote_types(dtype, factor_dtype)
        if precision == "weight_dtype" or wide == dtype:
            b = torch.stack([deltas[k][0][0] for k in keys]).to(dtype)
            a = torch.stack([deltas[k][0][1] for k in keys]).to(dtype)
            products.update((key, LoraProduct(b[i], a[i], scaling)) for i, key in enumerate(keys))
            continue
        per_chunk = max(1, MERGE_CHUNK_ELEMENTS // max(1, shape.numel()))
        for i in range(0, len(keys), per_chunk):
            chunk = keys[i:i + per_chunk]
            if len(chunk) == 1:
                out[chunk[0]] = _merged(weights[chunk[0]], deltas[chunk[0]])
                continue
            acc = torch.stack([weights[k] for k in chunk]).to(wide)
            b = torch.stack([deltas[k][0][0] for k in chunk]).to(wide)
            a = torch.stack([deltas[k][0][1] for k in chunk]).to(wide)
            merged = acc.baddbmm_(b, a, alpha=scaling).to(dtype)
            out.update(zip(chunk, merged.unbind(0)))
    return out, products


class _DoraNeedsMerge(Exception):
    """DoRA cannot be merged as an additive delta; peft's merge/unmerge is used instead."""


@dataclass(frozen=True)
class UnmergedWeights:
    """``full_weights`` with its plain LoRA products not yet added: ``base`` holds every key of ``full_weights`` in
    its order, with its names, shapes, strides and dtypes; for a key of ``products`` the value there is the frozen
    weight the product adds to (``LoraProduct.add_to``), for every other key the value ``full_weights`` returns.
    ``merged()`` is ``full_weights``' result, bit for bit. An engine that writes the products straight into its own
    parameters (``vllm.sync.merge_into_engine``) makes no merged copy of the model."""

    base: dict[str, torch.Tensor]
    products: dict[str, LoraProduct]

    def merged(self) -> dict[str, torch.Tensor]:
        return {k: (self.products[k].add_to(v) if k in self.products else v) for k, v in self.base.items()}


def _unmerged(plan: _Plan, deltas: dict[str, list[Any]], dtype: torch.dtype | None,
              precision: str = "weight_dtype") -> UnmergedWeights:
    base = {slot.key: slot.tensor().detach() for slot in plan.slots}
    products: dict[str, LoraProduct] = {}
    if deltas:
        merged, products = _merge_terms(base, deltas, precision)
        base.update(merged)
    for key, value in base.items():
        if dtype is not None and value.is_floating_point() and value.dtype != dtype:
            if key in products:
                value = products.pop(key).add_to(value)
            value = value.to(dtype)
        base[key] = value.contiguous()
    return UnmergedWeights(base, products)


def _collect(plan: _Plan, deltas: dict[str, list[Any]], dtype: torch.dtype | None,
             precision: str = "weight_dtype") -> dict[str, torch.Tensor]:
    return _unmerged(plan, deltas, dtype, precision).merged()


@torch.no_grad()
def full_weights(model: torch.nn.Module, dtype: torch.dtype | None = None, merge_adapter: bool = True,
                 merge_precision: str = "weight_dtype") -> dict[str, torch.Tensor]:
    """Base weights in HF checkpoint naming (see module docstring), LoRA merged unless ``merge_adapter`` is
    false (then the frozen base alone); the model is left unchanged. ``merge_precision``: see ``_merge_terms``
    (DoRA always merges through peft, in its arithmetic). ``dtype`` None: float32 master weights are cast to the
    model's compute dtype (``trainer.precision``), other weights are sent as kept."""
    return unmerged_weights(model, dtype, merge_adapter, merge_precision).merged()


@torch.no_grad()
def unmerged_weights(model: torch.nn.Module, dtype: torch.dtype | None = None, merge_adapter: bool = True,
                     merge_precision: str = "weight_dtype") -> UnmergedWeights:
    """``full_weights`` with the plain LoRA layers' products left to add (``UnmergedWeights``): the factors are
    rounded and stacked here, no weight-sized tensor is made for them. DoRA, the float32 merge precision, layers
    with several adapters and a ``dtype`` cast merge here, as ``full_weights`` does."""
    if dtype is None:
        dtype = serving_cast(model)
    plan = _plan(model)
    if is_peft_model(model) and merge_adapter:
        try:
            out = _unmerged(plan, _lora_deltas(plan), dtype, merge_precision)
        except _DoraNeedsMerge:
            # peft merges DoRA in place; its unmerge divides the merged 16-bit weight back, which does not give the
            # base back (in bf16 a few percent of elements move per sync and the drift compounds). The base
            # weights of the adapter layers are kept aside and written back bit for bit instead.
            bases = [layer.module.get_base_layer().weight for layer in plan.lora_layers]
            kept = [w.detach().clone() for w in bases]
            model.merge_adapter()
            try:
                out = UnmergedWeights({k: v.clone() for k, v in _collect(plan, {}, dtype).items()}, {})
            finally:
                model.unmerge_adapter()
                for w, original in zip(bases, kept):
                    w.data.copy_(original)
    else:
        out = _unmerged(plan, {}, dtype)
    if _ties_embeddings(model) and "lm_head.weight" not in out.base:
        embed = next((k for k in out.base if k.endswith("embed_tokens.weight")), None)
        if embed is not None:
            out.base["lm_head.weight"] = out.base[embed]
    return out


def changing_keys(model: torch.nn.Module, merge_adapter: bool = True) -> frozenset[str]:
    """Keys of ``full_weights(model, merge_adapter=...)`` whose values training can change: trainable parameters;
    with ``merge_adapter``, every weight (and, with ``lora_bias``, bias) an adapter merges into; the tied
    ``lm_head.weight`` of a trainable embedding. Every other key is frozen: it keeps the value the learner loaded.
    Buffers count as frozen (no optimizer writes them)."""
    plan = _plan(model)
    keys = {s.key for s in plan.slots if s.is_param and s.tensor().requires_grad}
    if merge_adapter and is_peft_model(model):
        for layer in plan.lora_layers:
            keys.add(layer.key)
            if any(getattr(layer.module, "lora_bias", {}).values()):
                keys.add(layer.key.removesuffix("weight") + "bias")
    if _ties_embeddings(model) and any(k.endswith("embed_tokens.weight") for k in keys):
        keys.add("lm_head.weight")
    return frozenset(keys)


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


def adapter_on_vision_tower(model: torch.nn.Module) -> bool:
    """Whether the model's adapter wraps a layer of the vision tower (``tuner.freeze_vit: false``): vLLM applies a
    served LoRA adapter to the language model only, so such an adapter reaches the engine only merged."""
    if not is_peft_model(model):
        return False
    return any(".visual." in f".{layer.key}" or layer.key.startswith("visual.") for layer in _plan(model).lora_layers)


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


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      allocate=None) -> bytearray | memoryview:
    """``tensors`` (any device; shared storage fine, so tied weights are too) as one safetensors payload, each
    tensor copied once into it (``trainer.sync.wire.encode``; ``allocate`` gives it a staging buffer)."""
    return encode(tensors, metadata, allocate)


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


@torch.no_grad()
def merge_lost_fraction(model: torch.nn.Module, engine_dtype: torch.dtype = torch.bfloat16,
                        rows: int = 64) -> float | None:
    """The share of an adapter update's non-zero elements that a merge into ``engine_dtype`` weights rounds away:
    with ``W`` the base weight and ``ΔW`` the update (LoRA: ``s·B@A``; DoRA: ``m / ‖W + s·B@A‖ · (W + s·B@A) − W``,
    row norms, what the learner's forward applies), the elements where ``ΔW != 0`` but
    ``round(round(W) + ΔW) == round(W)`` in ``engine_dtype``, over the elements where ``ΔW != 0``. Computed in float32
    on the first ``rows`` output rows of every linear LoRA/DoRA layer; None for a model without such layers or an
    update that is zero so far."""
    if not is_peft_model(model):
        return None
    lost = total = 0
    for layer in _plan(model).lora_layers:
        module = layer.module
        if module.merged:
            continue
        for adapter in module.active_adapters:
            factors = layer.adapters.get(adapter)
            if factors is None or not factors.linear:
                continue
            b, a = factors.b.weight, factors.a.weight
            weight = module.get_base_layer().weight[:rows]
            delta = float(module.scaling[adapter]) * (b[:rows].float() @ a.float())
            if factors.dora:
                direction = weight.float() + delta
                magnitude = module.lora_magnitude_vector[adapter].weight[:rows].float()
                delta = (magnitude / torch.linalg.norm(direction, dim=1)).unsqueeze(1) * direction - weight.float()
            base = weight.to(engine_dtype)
            changed = delta != 0
            merged = (base.float() + delta).to(engine_dtype)
            lost += int(((merged == base) & changed).sum())
            total += int(changed.sum())
    return lost / total if total else None
