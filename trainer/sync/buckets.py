"""Flattened tensor buckets in ms-swift's wire layout (``/update_flattened_params/``).

A bucket is one ``uint8`` tensor holding the raw bytes of several tensors back to back; each tensor is
described by ``{name, shape, dtype, start_idx, end_idx, numel}`` where the indices and ``numel`` count bytes
(as ms-swift's ``FlattenedTensorBucket`` does), and ``dtype`` is the ``str(torch.dtype)`` form.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_BUCKET_BYTES = 512 * 2**20
ALIGN = 16


class FlatTensorMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=1024)
    shape: tuple[int, ...]
    dtype: str
    start_idx: int = Field(ge=0)
    end_idx: int = Field(ge=0)
    numel: int = Field(ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> FlatTensorMeta:
        if self.end_idx - self.start_idx != self.numel:
            raise ValueError(f"tensor {self.name!r}: end_idx - start_idx must equal numel (bytes)")
        dtype = torch_dtype(self.dtype)
        count = 1
        for s in self.shape:
            count *= s
        if count * dtype.itemsize != self.numel:
            raise ValueError(f"tensor {self.name!r}: shape {list(self.shape)} of {self.dtype} is not {self.numel} bytes")
        return self


def torch_dtype(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` or ``"bfloat16"`` → ``torch.bfloat16``; a clear error otherwise."""
    attr = name.split(".")[-1]
    dtype = getattr(torch, attr, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; expected e.g. 'torch.bfloat16'")
    return dtype


def flatten(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[FlatTensorMeta], torch.Tensor]:
    """Pack tensors (all on one device) into one ``uint8`` bucket and its metadata; each tensor starts at a
    multiple of ``ALIGN`` bytes so receivers can view it in place."""
    metas: list[FlatTensorMeta] = []
    chunks: list[torch.Tensor] = []
    offset = 0
    for name, tensor in named:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = -offset % ALIGN
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8, device=flat.device))
            offset += pad
        metas.append(FlatTensorMeta(name=name, shape=tuple(tensor.shape), dtype=str(tensor.dtype),
                                    start_idx=offset, end_idx=offset + flat.numel(), numel=flat.numel()))
        chunks.append(flat)
        offset += flat.numel()
    if not chunks:
        raise ValueError("cannot flatten an empty set of tensors")
    return metas, torch.cat(chunks)


def unflatten(metas: list[FlatTensorMeta], bucket: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each tensor of the bucket with its dtype and shape (a view when aligned, else a copy)."""
    if bucket.dtype != torch.uint8 or bucket.dim() != 1:
        raise ValueError("a flattened bucket is a 1-D uint8 tensor")
    if metas and metas[-1].end_idx > bucket.numel():
        raise ValueError(f"bucket has {bucket.numel()} bytes but the metadata needs {metas[-1].end_idx}")
    out = {}
    for m in metas:
        dtype = torch_dtype(m.dtype)
        piece = bucket[m.start_idx:m.end_idx]
        if m.start_idx % dtype.itemsize:
            piece = piece.clone()
        out[m.name] = piece.view(dtype).reshape(m.shape)
    return out


def bucket_bytes(metas: list[FlatTensorMeta]) -> int:
    return metas[-1].end_idx if metas else 0


def plan_buckets(named: dict[str, torch.Tensor], max_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[str]]:
    """Group names in order into buckets of at most ``max_bytes`` (a larger tensor gets a bucket of its own)."""
    if max_bytes <= 0:
        raise ValueError("max_bytes must be positive")
    current: list[str] = []
    size = 0
    for name, tensor in named.items():
        n = tensor.numel() * tensor.element_size()
        if current and size + n > max_bytes:
            yield current
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        yield current
