"""vLLM's weight loading, recorded once and replayed as grouped copies (``vllm.sync.recorded_load``).

vLLM's ``load_weights`` walks every checkpoint tensor through Python (name mapping, the stacked qkv / gate_up
shards, tensor-parallel narrowing) and ends, for each one, in a ``copy_`` into a view of a parameter: host time that
grows with the tensor count (0.05–0.08 s per sync at Qwen3-VL-8B on an H100). ``record_load`` runs the loader under a
dispatch mode that writes down each of those copies — which input, which view of it, into which view of which
parameter — and ``LoadPlan.replay`` repeats them for a later update with the same names, shapes, strides, dtypes and
aliasing into the same parameters, as one multi-tensor copy per dtype pair.

A load is recorded only when the loader did nothing else with the values. Any of these makes it unrecordable
(``LoadRefused`` names which), and vLLM's loader then keeps running for every update: an input read by an operator
that is neither a view nor the source of a ``copy_`` into a parameter (a cast, arithmetic, ``.item()``); a copy into
a tensor that is not a parameter; a parameter written by anything but such a copy; a parameter given new storage. A
constant written into a parameter (vLLM's zeroed padding rows) does not depend on the update and stays as the
recorded load left it. Replay refuses (``LoadPlan.mismatch`` says why) when the update or the parameters differ from
the recording; the caller then loads through vLLM again and records anew.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: (shape, stride, dtype, device) of an input tensor
Signature = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, str]


#: writes of a constant into a parameter (vLLM's padded vocabulary rows): independent of the update, so what the
#: recorded load left there holds for every replay
CONSTANT_WRITES = frozenset({torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default})


class LoadRefused(RuntimeError):
    """The loader did something a replay of copies cannot repeat."""


@dataclass(frozen=True)
class RecordedCopy:
    """``dst.copy_(inputs[name].as_strided(size, stride, offset + inputs[name].storage_offset()))``; ``dst`` is a view
    of ``param``, the engine parameter as the loader found it."""

    name: str
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dst: torch.Tensor
    param: torch.Tensor


def _signature(t: torch.Tensor) -> Signature:
    return tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)


def _aliasing(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """Per name (in order): the index of the first name on the same storage and this tensor's storage offset."""
    first: dict[int, int] = {}
    out = []
    for i, t in enumerate(tensors.values()):
        out.append((first.setdefault(t.untyped_storage().data_ptr(), i), t.storage_offset()))
    return tuple(out)


@dataclass
class LoadPlan:
    """The copies of one recorded load and what an update must look like to replay them."""

    signatures: dict[str, Signature]
    aliasing: tuple[tuple[int, int], ...]
    copies: list[RecordedCopy]
    #: each copy's parameter address when recorded (a parameter given new storage since is not replayed into)
    destinations: tuple[int, ...]

    def mismatch(self, tensors: Mapping[str, torch.Tensor]) -> str | None:
        """Why ``tensors`` cannot be replayed into the recorded parameters, or None when they can."""
        if list(tensors) != list(self.signatures):
            return "the update's tensor names differ from the recorded load's"
        bad = next((n for n, t in tensors.items() if _signature(t) != self.signatures[n]), None)
        if bad is not None:
            return f"{bad}: shape, stride, dtype or device differs from the recorded load's"
        if _aliasing(tensors) != self.aliasing:
            return "the update's tensors share storage differently from the recorded load's"
        if tuple(c.param.data_ptr() for c in self.copies) != self.destinations:
            return "the engine's parameters moved since the load was recorded"
        return None

    def replay(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Repeat the recorded copies from ``tensors`` (``mismatch`` must be None); returns how many."""
        _copy_grouped([(c.dst, _source_view(c, tensors[c.name])) for c in self.copies])
        return len(self.copies)

    def replay_into(self, tensors: Mapping[str, torch.Tensor], products: Mapping[str, Any]
                    ) -> list[tuple[str, torch.Tensor]]:
        """``replay`` of an update whose ``products`` are not yet added (``mismatch(tensors)`` must be None): for a
        name of ``products`` the recorded load read ``products[name].add_to(tensors[name])`` (see
        ``trainer.sync.weights.LoraProduct``). A copy of that whole tensor into a destination of its shape and dtype
        runs the product with the destination as its output (no merged tensor is made); any other copy of it reads
        the merged tensor, made once. Returns ``(name, destination)`` of every copy in recorded order: what was
        written, for the caller's finite check."""
        merged: dict[str, torch.Tensor] = {}
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for c in self.copies:
                src = tensors[c.name]
                product = products.get(c.name)
                if product is not None:
                    if _whole(c, src):
                        product.add_to(src, out=c.dst)
                        continue
                    if c.name not in merged:
                        merged[c.name] = product.add_to(src)
                    src = merged[c.name]
                pairs.append((c.dst, _source_view(c, src)))
        _copy_grouped(pairs)
        return [(c.name, c.dst) for c in self.copies]


def _source_view(c: RecordedCopy, src: torch.Tensor) -> torch.Tensor:
    return src.as_strided(c.size, c.stride, src.storage_offset() + c.offset)


def _whole(c: RecordedCopy, src: torch.Tensor) -> bool:
    """Whether ``c`` copies all of the contiguous ``src`` into a contiguous destination of its shape and dtype."""
    return (c.offset == 0 and c.size == tuple(src.shape) and src.is_contiguous()
            and c.stride == tuple(src.stride()) and tuple(c.dst.shape) == c.size and c.dst.dtype == src.dtype
            and c.dst.is_contiguous())


def _copy_grouped(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair, one multi-tensor copy per (destination dtype, source dtype, device)."""
    groups: dict[tuple[torch.dtype, torch.dtype, str], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in pairs:
        dsts, srcs = groups.setdefault((dst.dtype, src.dtype, str(dst.device)), ([], []))
        dsts.append(dst)
        srcs.append(src)
    with torch.no_grad():
        for (dst_dtype, src_dtype, _), (dsts, srcs) in groups.items():
            if dst_dtype == src_dtype:
                torch._foreach_copy_(dsts, srcs)
            else:
                for d, s in zip(dsts, srcs):
                    d.copy_(s)


class _CopyRecorder(TorchDispatchMode):
    """Writes down each ``copy_`` from a view of an input into a view of a parameter; anything else done with an
    input or to a parameter goes into ``refusals``. A module-level class holding its maps as attributes: a class
    defined inside ``record_load`` closing over them formed a reference cycle that kept the whole update alive until
    Python's collector ran (8B on an H200, 2026-11-27: 11.5 GiB more through the recording step)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], parameters: list[torch.Tensor]):
        super().__init__()
        self.inputs: dict[int, list[tuple[str, int, int, torch.Tensor]]] = {}
        for name, t in tensors.items():
            self.inputs.setdefault(t.untyped_storage().data_ptr(), []).append((name, t.storage_offset(), t.numel(), t))
        self.params = {p.untyped_storage().data_ptr(): p for p in parameters}
        self.copies: list[RecordedCopy] = []
        self.refusals: list[str] = []

    def release(self) -> None:
        """Drop every reference to the update (the recorded copies keep parameter views only)."""
        self.inputs.clear()
        self.params.clear()

    def source(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(input name, element offset within it) of a view of an input, None when ``t`` is no input's."""
        found = self.inputs.get(t.untyped_storage().data_ptr())
        if not found:
            return None
        span = [(n, start, numel) for n, start, numel, inp in found
                if start <= t.storage_offset() < start + max(numel, 1) and inp.dtype == t.dtype]
        if len({(start, numel) for _, start, numel in span}) == 1:
            span = span[:1]  # names of one tensor (a tied lm_head): the replay checks they still are
        if len(span) != 1:
            self.refusals.append(f"a view of {found[0][0]} could not be told apart from the other inputs on its "
                                 "storage")
            return None
        return span[0][0], t.storage_offset() - span[0][1]

    def is_input(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.inputs

    def writes_param(self, func, args, kwargs) -> bool:
        for i, a in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else (kwargs or {}).get(a.name)
            if a.alias_info is not None and a.alias_info.is_write:
                if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.params
                       for t in tree_leaves(value)):
                    return True
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = tree_leaves((args, kwargs or {}))
        if func is torch.ops.aten.copy_.default and self.is_input(args[1]) and not self.is_input(args[0]):
            dst = args[0]
            if dst.untyped_storage().data_ptr() not in self.params:
                self.refusals.append(f"{func}: a copy into a tensor that is not a parameter")
            else:
                where = self.source(args[1])
                if where is not None:
                    self.copies.append(RecordedCopy(where[0], where[1], tuple(args[1].shape),
                                                    tuple(args[1].stride()), dst,
                                                    self.params[dst.untyped_storage().data_ptr()]))
        elif any(self.is_input(t) for t in leaves) and not func.is_view:
            name = next(n for t in leaves if self.is_input(t) for n, *_ in self.inputs[t.untyped_storage().data_ptr()])
            self.refusals.append(f"{func} reads {name}")
        elif func._schema.is_mutable and func not in CONSTANT_WRITES and self.writes_param(func, args, kwargs):
            self.refusals.append(f"{func} writes a parameter outside a copy from the update")
        return func(*args, **(kwargs or {}))


def record_load(load: Callable[[], Any], tensors: Mapping[str, torch.Tensor],
                parameters: list[torch.Tensor]) -> LoadPlan:
    """Run ``load`` (which reads ``tensors`` into ``parameters``) and return its copies as a ``LoadPlan``; the load
    itself always completes. Raises ``LoadRefused`` after it when the loader did something a replay cannot repeat.
    Neither the plan nor the error keeps a reference to ``tensors``."""
    recorder = _CopyRecorder(tensors, parameters)
    before = [p.data_ptr() for p in parameters]
    try:
        with recorder:
            load()
    finally:
        recorder.release()
    copies, refusals = recorder.copies, recorder.refusals
    moved = sum(p.data_ptr() != ptr for p, ptr in zip(parameters, before))
    if moved:
        refusals.append(f"the loader gave {moved} parameter(s) new storage (a replay would write the old one)")
    if refusals:
        raise LoadRefused(refusals[0] + (f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else ""))
    if not copies:
        raise LoadRefused("the loader copied nothing from the update into a parameter")
    return LoadPlan({n: _signature(t) for n, t in tensors.items()}, _aliasing(tensors), copies,
                    tuple(c.param.data_ptr() for c in copies))
