"""Checks that keep a bad weight update away from serving, and non-finite learner weights away from the servers.

Receivers (every rollout engine, whatever the transport) call ``check_update`` on a complete update *before* any
served weight changes: known names, exact shapes, the served dtype (a different floating dtype only with
``allow_cast``; a non-floating tensor for a floating weight never), optionally every served name present, and
finite values. The first problem raises ``WeightUpdateRefused`` naming the tensor and why (the rollout server
answers it with HTTP 422); the old weights keep serving.

The learner calls ``check_learner_weights`` before it pushes (``WeightSync.ensure_fresh``) and before it writes a
checkpoint: a non-finite parameter raises ``NonFiniteWeightsError`` naming it and the optimizer step, so the run
stops before the servers or a checkpoint receive it.

Pure torch, cheap: the specs are ``(shape, dtype)`` pairs (``spec_from_checkpoint`` reads only safetensors
headers), and the finite-value check reduces every tensor where it lives and syncs with the device once.
"""

from __future__ import annotations

import json
import struct
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.sync.wire import MAX_HEADER_BYTES, SAFETENSORS_DTYPES

__all__ = [
    "NonFiniteWeightsError",
    "TensorSpec",
    "WeightUpdateRefused",
    "check_learner_weights",
    "check_update",
    "check_update_layout",
    "describe_non_finite",
    "first_non_finite",
    "launch_finite_check",
    "spec_from_checkpoint",
    "spec_from_state_dict",
    "start_check_update",
]


@dataclass(frozen=True)
class TensorSpec:
    """What a served weight accepts: its exact shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class WeightUpdateRefused(ValueError):
    """A weight update was refused before any served weight changed. ``tensor``: the first bad tensor's name (None
    when the update as a whole is bad); ``reason``: why; ``outcome``: what the engine serves now (an engine that
    held no valid weights, e.g. a colocated one after a level-2 sleep, says so). Rollout servers answer it with
    HTTP 422."""

    def __init__(self, tensor: str | None, reason: str, outcome: str = "the old weights keep serving"):
        self.tensor = tensor
        self.reason = reason
        self.outcome = outcome
        where = f"tensor {tensor!r}: " if tensor is not None else ""
        super().__init__(f"weight update refused: {where}{reason}; {outcome}")

    def __reduce__(self):  # picklable across processes (vLLM workers) with its fields
        return type(self), (self.tensor, self.reason, self.outcome)

    def detail(self) -> dict[str, str | None]:
        """The JSON ``detail`` of the HTTP 422 answer."""
        return {"error": "weight_update_refused", "tensor": self.tensor, "reason": self.reason, "message": str(self)}


class NonFiniteWeightsError(RuntimeError):
    """The learner's parameters hold NaN/inf: training stops before they are pushed or checkpointed."""

    def __init__(self, tensor: str, step: int, last_synced_step: int | None = None, checkpoint: str | None = None):
        self.tensor = tensor
        self.step = step
        self.last_synced_step = last_synced_step
        self.checkpoint = checkpoint
        servers = ("the rollout servers keep the last good weights"
                   + (f" (synced at step {last_synced_step})" if last_synced_step is not None else ""))
        where = (f"the last checkpoint is {checkpoint}" if checkpoint
                 else "the last checkpoint is the newest complete checkpoint-* in the output directory, if any")
        super().__init__(
            f"non-finite values (NaN/inf) in learner parameter {tensor!r} at optimizer step {step}: training stops; "
            f"nothing was pushed and no checkpoint is written with these weights; {servers}; {where} "
            "(resume from it with a lower learning rate / tighter max_grad_norm, or inspect the data of this step)")

    def __reduce__(self):
        return type(self), (self.tensor, self.step, self.last_synced_step, self.checkpoint)

    def with_checkpoint(self, checkpoint: str | None) -> NonFiniteWeightsError:
        return NonFiniteWeightsError(self.tensor, self.step, self.last_synced_step,
                                     checkpoint or "none (no checkpoint was written before this step)")


def spec_from_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The spec of a loaded model's weights (``model.state_dict()``)."""
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in state.items()}


def _read_header(path: Path) -> dict:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {n} bytes is implausible")
        return json.loads(fh.read(n))


def _ties_embeddings(config: dict) -> bool:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for cfg in (config, text):
        if "tie_word_embeddings" in cfg:
            return bool(cfg["tie_word_embeddings"])
    return True  # transformers' PretrainedConfig default


def spec_from_checkpoint(model_dir: str | Path, dtype: torch.dtype | None = None) -> dict[str, TensorSpec]:
    """The spec of an HF checkpoint directory from its safetensors headers only (no tensor data is read).

    ``dtype`` (the engine's served dtype) replaces every floating dtype; ``lm_head.weight`` gets the embedding's
    spec when the config ties the embeddings and the checkpoint does not store it (what the learner sends)."""
    root = Path(model_dir)
    index = next(iter(sorted(root.glob("*.safetensors.index.json"))), None)
    if index is not None:
        files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors weights (a checkpoint spec needs safetensors files)")
    spec: dict[str, TensorSpec] = {}
    for path in files:
        for name, entry in _read_header(path).items():
            if name == "__metadata__":
                continue
            code = entry["dtype"]
            if code not in SAFETENSORS_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {code}, unknown to this torch build")
            stored = SAFETENSORS_DTYPES[code]
            served = dtype if dtype is not None and stored.is_floating_point else stored
            spec[name] = TensorSpec(tuple(int(d) for d in entry["shape"]), served)
    config_path = root / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if "lm_head.weight" not in spec and _ties_embeddings(config):
        embed = next((n for n in spec if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            spec["lm_head.weight"] = spec[embed]
    return spec


def _dtype_problem(got: torch.dtype, want: torch.dtype, allow_cast: bool) -> str | None:
    if got == want:
        return None
    if want.is_floating_point and got.is_floating_point:
        if allow_cast:
            return None
        return (f"dtype {got} != served {want} (a floating dtype the server would cast; start it with "
                "--allow-dtype-cast to accept that, or send the served dtype)")
    if want.is_floating_point:
        return f"dtype {got} is not a floating dtype; the served weight is {want} (never cast)"
    return f"dtype {got} != served {want}"


def describe_non_finite(t: torch.Tensor) -> str:
    t = t.detach()
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return f"non-finite values ({nan} NaN, {inf} inf of {t.numel()} values)"


def check_update_layout(tensors: Mapping[str, torch.Tensor], spec: Mapping[str, TensorSpec], *,
                        allow_cast: bool = False, require_all: bool = False) -> None:
    """The host-side part of ``check_update``: unknown names, shapes, dtypes, missing names (``require_all``), in
    that order; reads no tensor data."""
    unknown = [n for n in tensors if n not in spec]
    if unknown:
        more = f" (and {len(unknown) - 1} more unknown names)" if len(unknown) > 1 else ""
        raise WeightUpdateRefused(unknown[0], f"not a weight of the served model{more}")
    for name, t in tensors.items():
        want = spec[name]
        if tuple(t.shape) != tuple(want.shape):
            raise WeightUpdateRefused(name, f"shape {list(t.shape)} != served {list(want.shape)}")
    for name, t in tensors.items():
        problem = _dtype_problem(t.dtype, spec[name].dtype, allow_cast)
        if problem:
            raise WeightUpdateRefused(name, problem)
    if require_all:
        missing = [n for n in spec if n not in tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise WeightUpdateRefused(missing[0], f"missing from a full update{more}")


def check_update(tensors: Mapping[str, torch.Tensor], spec: Mapping[str, TensorSpec], *, allow_cast: bool = False,
                 require_all: bool = False, check_finite: bool = True) -> None:
    """Raise ``WeightUpdateRefused`` for the first problem of ``tensors`` against the served ``spec``, checked in
    this order: unknown names, shapes, dtypes, missing names (``require_all``), finite values (``check_finite``).
    No host copies: the finite check runs where the tensors live, with one device sync."""
    start_check_update(tensors, spec, allow_cast=allow_cast, require_all=require_all,
                       check_finite=check_finite).wait()


class PendingUpdateCheck:
    """An update whose layout passed ``check_update_layout`` and whose finite flags are computing on the device
    (``FiniteFlags``); ``wait`` reads them and raises ``WeightUpdateRefused`` for the first non-finite tensor."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], flags: FiniteFlags | None):
        self._tensors = tensors
        self._flags = flags

    def wait(self) -> None:
        bad = self._flags.first_bad() if self._flags is not None else None
        if bad is not None:
            raise WeightUpdateRefused(bad, describe_non_finite(self._tensors[bad]))


def start_check_update(tensors: Mapping[str, torch.Tensor], spec: Mapping[str, TensorSpec], *,
                       allow_cast: bool = False, require_all: bool = False, check_finite: bool = True
                       ) -> PendingUpdateCheck:
    """``check_update`` in two halves: the layout is checked now (raising as ``check_update`` does), the finite check
    is launched on the device and read by the returned check's ``wait``, so that host work (an engine's wake) can
    run while the device reduces. Nothing may be written into served weights before ``wait`` returned."""
    check_update_layout(tensors, spec, allow_cast=allow_cast, require_all=require_all)
    return PendingUpdateCheck(tensors, launch_finite_check(tensors) if check_finite else None)


class FiniteFlags:
    """Per device, one flag per floating tensor (finite or not), launched by ``launch_finite_check`` and not yet
    read; ``first_bad`` reads them (one sync per device, two when something is bad)."""

    def __init__(self, order: list[str], groups: list[tuple[list[str], torch.Tensor]]):
        self._order = order
        self._groups = groups

    def first_bad(self) -> str | None:
        """The first (in the checked mapping's order) tensor holding NaN or inf, else None."""
        bad: set[str] = set()
        for names, flags in self._groups:
            if bool(flags.all()):
                continue
            bad.update(names[int(i)] for i in torch.nonzero(~flags).flatten().tolist())
        return next((n for n in self._order if n in bad), None)


def launch_finite_check(tensors: Mapping[str, torch.Tensor]) -> FiniteFlags:
    """Launch the finite check of every floating tensor of ``tensors`` where it lives: per device, one fused
    multi-tensor max-abs (``torch._foreach_norm`` with ord=inf: NaN and ±inf propagate, finite values never
    overflow) and one ``isfinite`` over the stacked results; nothing is read back here."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            by_device.setdefault(t.device, []).append((name, t.detach()))
    groups = []
    with torch.no_grad():
        for items in by_device.values():
            flags = torch.isfinite(torch.stack(torch._foreach_norm([t for _, t in items], ord=float("inf"))))
            groups.append(([n for n, _ in items], flags))
    return FiniteFlags(list(tensors), groups)


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The first (in mapping order) floating tensor holding NaN or inf, else None (``launch_finite_check`` read at
    once)."""
    return launch_finite_check(tensors).first_bad()


#: per model, the frozen parameters a passing ``check_learner_weights`` read or skipped: (tensor id, data pointer,
#: version counter) of each
_FROZEN_FINITE: weakref.WeakKeyDictionary[torch.nn.Module, frozenset[tuple[int, int, int]]] = weakref.WeakKeyDictionary()


def _local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The values this rank holds for ``p`` (DeepSpeed ZeRO-3 keeps them in ``ds_tensor``; ``p`` is empty)."""
    return getattr(p, "ds_tensor", None) if getattr(p, "ds_tensor", None) is not None else p


def check_learner_weights(model: torch.nn.Module, global_step: int, *, last_synced_step: int | None = None,
                          checkpoint: str | None = None) -> None:
    """Raise ``NonFiniteWeightsError`` naming the first parameter with NaN/inf and ``global_step`` (the optimizer
    step that produced it). With a multi-process learner every rank checks its own (local) parameters and the
    ranks agree on the result, so all of them stop together; call it on every rank.

    Trainable parameters are read at every call. A frozen one (``requires_grad`` false: no optimizer writes it) is
    read until a call found the model finite, and again once it was replaced or written in place (its tensor, data
    pointer or version counter changed): at 8B with LoRA that is ~17 GB not re-read per sync. A write through
    ``.data`` bumps no version counter; what such a write makes non-finite is still refused by the receiver's
    ``check_update``, which reads every tensor sent."""
    import torch.distributed as dist

    todo: dict[str, torch.Tensor] = {}
    frozen: set[tuple[int, int, int]] = set()
    known = _FROZEN_FINITE.get(model, frozenset())
    for name, p in model.named_parameters():
        t = _local_tensor(p)
        if not p.requires_grad:
            mark = (id(t), t.data_ptr(), t._version)
            frozen.add(mark)
            if mark in known:
                continue
        todo[name] = t.detach()
    bad = first_non_finite(todo)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, bad)
        bad = next((g for g in gathered if g), None)  # type: ignore[assignment]
    if bad is not None:
        raise NonFiniteWeightsError(str(bad), global_step, last_synced_step, checkpoint)
    _FROZEN_FINITE[model] = frozenset(frozen)
