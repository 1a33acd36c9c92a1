"""In-band weight updates through a directory the learner and a rollout server share (``sync.shm_dir`` on the
learner, ``serve --shm-dir`` on the server; one host: ``/dev/shm`` or any tmpfs both see).

The learner writes the safetensors payload (``trainer.sync.wire.encode``) once into a staging file it keeps for the
run (memory-mapped, page-locked when CUDA allows, so GPU tensors are copied to it asynchronously) and posts only its
name and size; the server reads that file (one host-to-device copy onto a GPU engine; one read into memory for a
CPU engine) instead of receiving the bytes over HTTP, where uvicorn's chunked body receive costs more than the copies.

Contracts:
- the server only opens a plain file name (no path separators, no leading dot) inside its own ``--shm-dir``, and
  reads the first ``nbytes`` the learner declared (the staging file only grows, so a smaller update, e.g. an adapter
  after a full update, leaves a longer file); a shorter file or any other name is refused with a message naming what
  to change;
- a learner and a server that do not share the directory fail at the first push with "not found in --shm-dir",
  never with a silent fallback;
- the staging file is removed when the transport closes.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import torch

from trainer.sync.wire import decode

log = logging.getLogger(__name__)

SHM_PATH = "/rm/update_weights_shm/"
PREFIX = "rm-update-"


class ShmUpdateError(ValueError):
    """A shared-directory update the server cannot read; the message says what to change."""


class ShmStaging:
    """The learner's staging file in ``shm_dir``; ``allocate(nbytes)`` (for ``wire.encode``) returns a CPU ``uint8``
    tensor backed by it, grown (never shrunk) when an update is larger than the last one."""

    def __init__(self, shm_dir: str | os.PathLike[str]):
        self.dir = Path(shm_dir)
        if not self.dir.is_dir():
            raise ShmUpdateError(f"sync.shm_dir {str(self.dir)!r} is not a directory; create it (a tmpfs both the learner "
                                 "and the rollout servers see, e.g. /dev/shm) or drop sync.shm_dir")
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}.safetensors"
        self.path = self.dir / self.name
        self._tensor: torch.Tensor | None = None
        self._registered = False

    def allocate(self, nbytes: int) -> torch.Tensor:
        if self._tensor is None or self._tensor.numel() < nbytes:
            self._release()
            with open(self.path, "wb") as f:
                f.truncate(nbytes)
            self._tensor = torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.uint8)
            self._register()
        return self._tensor

    def _register(self) -> None:
        """Page-lock the mapping (``cudaHostRegister``) so device-to-host copies into it run asynchronously."""
        if not torch.cuda.is_available() or self._tensor is None or not self._tensor.numel():
            return
        err = torch.cuda.cudart().cudaHostRegister(self._tensor.data_ptr(), self._tensor.numel(), 0)
        self._registered = int(err) == 0
        if not self._registered:
            log.warning("could not page-lock the shm staging file %s (CUDA error %s); copies into it are synchronous",
                        self.path, int(err))

    def _release(self) -> None:
        if self._tensor is not None and self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
        self._registered = False
        self._tensor = None

    def close(self) -> None:
        self._release()
        self.path.unlink(missing_ok=True)


def read_update(shm_dir: str | os.PathLike[str], name: str, nbytes: int,
                device: torch.device | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the update the learner staged as ``name`` in ``shm_dir`` (see module docstring):
    on a non-CPU ``device`` views of one host-to-device copy of the mapped file; otherwise the file is read into
    memory first (the learner rewrites it for the next update)."""
    if not name or "/" in name or "\\" in name or name.startswith(".") or not name.startswith(PREFIX):
        raise ShmUpdateError(f"file {name!r} is not a staging file name ({PREFIX}…, no path); the learner names "
                             "the file it wrote inside the shared directory")
    path = Path(shm_dir) / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ShmUpdateError(f"file {name!r} not found in --shm-dir {str(shm_dir)!r}: the learner and this server do "
                             "not share that directory; mount the same tmpfs on both (same sync.shm_dir and "
                             "--shm-dir) or drop sync.shm_dir to send the update over HTTP") from None
    if not path.is_file() or size < nbytes:
        raise ShmUpdateError(f"file {name!r} in --shm-dir holds {size} bytes, fewer than the {nbytes} the learner "
                             "declared; an update was overwritten while in flight, or two learners share the directory")
    if device is not None and torch.device(device).type != "cpu":
        mapped = torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8)
        return decode(memoryview(mapped.numpy()), device)
    blob = bytearray(nbytes)
    with open(path, "rb") as f:
        if f.readinto(blob) != nbytes:
            raise ShmUpdateError(f"file {name!r} shrank while it was read; retry the update")
    return decode(blob)
