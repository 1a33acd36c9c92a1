"""The in-band wire format: one safetensors payload (8-byte little-endian header length, JSON header, raw data).

Written and read here instead of with ``safetensors.torch.save`` / ``load`` because those copy more than once and
grow worse than linearly with the payload (measured on this project's CPU machine: ``save`` of 256 MiB 0.9 s,
of 1 GiB 8.6-13 s; ``load`` copies every tensor). ``encode`` allocates the payload once and copies every tensor
into it straight from where it lives (a GPU tensor goes device → host once); ``decode`` returns tensors that are
views of the payload (no copy). The bytes are the safetensors format: ``safetensors.torch.load`` reads what
``encode`` writes and ``decode`` reads what ``safetensors.torch.save`` writes (tests/unit/test_wire.py).
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Callable, Mapping

import torch

__all__ = ["DTYPE_CODES", "MAX_HEADER_BYTES", "SAFETENSORS_DTYPES", "WireFormatError", "decode", "encode"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in (("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
                       ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu"),
                       ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"),
                       ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("BOOL", "bool"),
                       ("C64", "complex64"))
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20


class WireFormatError(ValueError):
    """A payload that is not a well-formed safetensors blob (the message says what is wrong)."""


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
           allocate: Callable[[int], torch.Tensor] | None = None) -> bytearray | memoryview:
    """``tensors`` (any device, shared storage fine) as one safetensors payload, each tensor copied exactly once.

    ``allocate(nbytes)``, when given, returns a CPU ``uint8`` tensor of at least ``nbytes`` (e.g. a pinned staging
    buffer reused across pushes) and the payload is a ``memoryview`` of its first ``nbytes``; GPU tensors are then
    copied asynchronously and waited for once. Without it the payload is a new ``bytearray``."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPE_CODES:
            raise WireFormatError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    total = start + offset
    if allocate is None:
        buf: bytearray | memoryview = bytearray(total)
        flat = torch.frombuffer(buf, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    else:
        staging = allocate(total)
        if staging.dtype != torch.uint8 or staging.device.type != "cpu" or staging.numel() < total:
            raise ValueError(f"allocate({total}) must return a CPU uint8 tensor of at least {total} bytes")
        flat = staging[:total]
        buf = memoryview(flat.numpy()).cast("B")
    struct.pack_into("<Q", buf, 0, len(raw))
    buf[8:start] = raw
    asynchronous = allocate is not None and flat.is_pinned()
    with torch.no_grad():
        for name, t in tensors.items():
            a, b = header[name]["data_offsets"]  # type: ignore[index]
            if b > a:
                flat[start + a:start + b].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8),
                                                non_blocking=asynchronous and t.is_cuda)
    if asynchronous:
        for device in {t.device for t in tensors.values() if t.is_cuda}:
            torch.cuda.synchronize(device)
    return buf


def _header(blob: bytes | bytearray | memoryview) -> tuple[dict, int]:
    if len(blob) < 8:
        raise WireFormatError(f"payload of {len(blob)} bytes is shorter than the 8-byte safetensors header length")
    (n,) = struct.unpack_from("<Q", blob, 0)
    if n > MAX_HEADER_BYTES or 8 + n > len(blob):
        raise WireFormatError(f"header length {n} does not fit the payload of {len(blob)} bytes")
    try:
        header = json.loads(bytes(blob[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireFormatError(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WireFormatError("header is not a JSON object")
    return header, 8 + n


def decode(blob: bytes | bytearray | memoryview,
           device: torch.device | str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors payload. The tensors are read-only views of ``blob`` (they keep it
    alive); consumers copy them into their own weights. With a non-CPU ``device`` the whole data section is copied
    there once (one host-to-device transfer) and the tensors are views of that copy. Raises ``WireFormatError``
    naming the bad entry (before anything is copied)."""
    header, start = _header(blob)
    data = len(blob) - start
    metadata = header.pop("__metadata__", None) or {}
    out: dict[str, torch.Tensor] = {}
    layout: list[tuple[str, torch.dtype, list[int], int, int]] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name, entry in header.items():
            try:
                dtype = SAFETENSORS_DTYPES[entry["dtype"]]
                shape = [int(d) for d in entry["shape"]]
                a, b = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise WireFormatError(f"tensor {name!r}: malformed header entry {entry!r}") from exc
            numel = 1
            for d in shape:
                numel *= d
            size = numel * dtype.itemsize
            if not 0 <= a <= b <= data or b - a != size:
                raise WireFormatError(f"tensor {name!r}: data_offsets [{a}, {b}] do not hold {shape} {dtype} "
                                      f"within the {data} data bytes")
            if size == 0:
                out[name] = torch.empty(shape, dtype=dtype, device=device)
                continue
            layout.append((name, dtype, shape, a, size))
        base = torch.frombuffer(blob, dtype=torch.uint8, count=data, offset=start) if data else None
    on_device = device is not None and torch.device(device).type != "cpu"
    if on_device and base is not None:
        base = base.to(device)
    for name, dtype, shape, a, size in layout:
        raw = base[a:a + size]
        out[name] = (raw.view(dtype) if raw.data_ptr() % dtype.itemsize == 0 else raw.clone().view(dtype)).view(shape)
    return out, {str(k): str(v) for k, v in metadata.items()}

