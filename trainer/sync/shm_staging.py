"""In-band weight updates through a directory the learner and a rollout server share (``sync.shm_dir`` on the
learner, ``serve --shm-dir`` on the server; one host: ``/dev/shm`` or any tmpfs both see).

The learner writes the safetensors payload (``trainer.sync.wire.encode``) once into a staging file it keeps for the
run (memory-mapped, page-locked when CUDA allows, so GPU tensors are copied to it asynchronously) and posts only its
name and size; the server (``ShmReader``) maps that file once, read-only, and page-locks its mapping too, so every
later update from that learner is one host-to-device copy at pinned-memory speed onto a GPU engine (one copy into
memory for a CPU engine), instead of an HTTP body, where uvicorn's chunked receive costs more than the copies.

Contracts:
- the server only opens a plain file name (no path separators, no leading dot) inside its own ``--shm-dir``, and
  reads the first ``nbytes`` the learner declared (a smaller update, e.g. an adapter after a full update, leaves a
  longer file); a shorter file or any other name is refused with a message naming what to change;
- a staging file never shrinks or is truncated while its name is in use: a larger update goes to a new file (new
  name) and the old one is removed, so a kept mapping never points at pages the file no longer holds; the server
  keeps the mapping of one file (the last name it read) and drops it when another name arrives or it shuts down;
- a learner and a server that do not share the directory fail at the first push with "not found in --shm-dir",
  never with a silent fallback;
- the staging file is removed when the transport closes.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import uuid
import warnings
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
    tensor backed by it. An update larger than the file gets a new file under a new ``name`` (the old one is
    removed); a smaller one reuses the file."""

    def __init__(self, shm_dir: str | os.PathLike[str]):
        self.dir = Path(shm_dir)
        if not self.dir.is_dir():
            raise ShmUpdateError(f"sync.shm_dir {str(self.dir)!r} is not a directory; create it (a tmpfs both the learner "
                                 "and the rollout servers see, e.g. /dev/shm) or drop sync.shm_dir")
        self.name = ""
        self._tensor: torch.Tensor | None = None
        self._registered = False

    @property
    def path(self) -> Path:
        return self.dir / self.name

    def allocate(self, nbytes: int) -> torch.Tensor:
        if self._tensor is None or self._tensor.numel() < nbytes:
            self.close()
            self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}.safetensors"
            with open(self.path, "xb") as f:
                f.truncate(nbytes)
            self._tensor = torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.uint8)
            self._registered = _page_lock(self._tensor, 0, self.path)
        return self._tensor

    def close(self) -> None:
        if self._tensor is not None and self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
        self._registered = False
        self._tensor = None
        if self.name:
            self.path.unlink(missing_ok=True)


_CUDA_HOST_REGISTER_READ_ONLY = 0x08


def _page_lock(tensor: torch.Tensor, flags: int, path: Path) -> bool:
    """``cudaHostRegister`` the CPU ``tensor`` so copies between it and a GPU run at pinned-memory speed; False (with
    a warning) where CUDA is absent or refuses, and copies stay pageable."""
    if not torch.cuda.is_available() or not tensor.numel():
        return False
    err = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), flags))
    if err:
        log.warning("could not page-lock the mapping of %s (CUDA error %s); its copies to and from the GPU are "
                    "pageable (slower)", path, err)
    return err == 0


class _Mapping:
    """One read-only shared mapping of a staging file, page-locked when CUDA allows."""

    def __init__(self, path: Path, st: os.stat_result, lock: bool):
        self.key = self.identity(st)
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.registered = lock and _page_lock(self.tensor, _CUDA_HOST_REGISTER_READ_ONLY, path)

    @staticmethod
    def identity(st: os.stat_result) -> tuple[int, int, int]:
        """The file (device, inode) and the size mapped: a mapping serves a later read only if all three match."""
        return st.st_dev, st.st_ino, st.st_size

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        del self.tensor
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view; the mapping goes when that view does
            pass


class ShmReader:
    """The server's side of ``--shm-dir``: ``read(name, nbytes, device)`` returns ``(tensors, metadata)`` of the update
    the learner staged as ``name`` (see the module docstring). The mapping of the last file read is kept (and
    page-locked for a GPU ``device``), so a learner's later updates cost one copy each: onto the GPU for a non-CPU
    ``device`` (the tensors are views of that copy), into memory otherwise (the learner rewrites the file for its
    next update). Calls come from one thread (the server's engine thread)."""

    def __init__(self, shm_dir: str | os.PathLike[str]):
        self.dir = Path(shm_dir)
        self._kept: _Mapping | None = None

    def read(self, name: str, nbytes: int,
             device: torch.device | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        path, st = self._checked(name, nbytes)
        on_device = device is not None and torch.device(device).type != "cpu"
        if self._kept is None or self._kept.key != _Mapping.identity(st):
            self.close()
            self._kept = _Mapping(path, st, lock=on_device and torch.device(device).type == "cuda")
        view = memoryview(self._kept.mm)[:nbytes]
        return decode(view, device) if on_device else decode(bytearray(view))

    def _checked(self, name: str, nbytes: int) -> tuple[Path, os.stat_result]:
        if not name or "/" in name or "\\" in name or name.startswith(".") or not name.startswith(PREFIX):
            raise ShmUpdateError(f"file {name!r} is not a staging file name ({PREFIX}…, no path); the learner names "
                                 "the file it wrote inside the shared directory")
        path = self.dir / name
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ShmUpdateError(f"file {name!r} not found in --shm-dir {str(self.dir)!r}: the learner and this server "
                                 "do not share that directory; mount the same tmpfs on both (same sync.shm_dir and "
                                 "--shm-dir) or drop sync.shm_dir to send the update over HTTP") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size < nbytes:
            raise ShmUpdateError(f"file {name!r} in --shm-dir holds {st.st_size} bytes, fewer than the {nbytes} the "
                                 "learner declared; an update was overwritten while in flight, or two learners share "
                                 "the directory")
        return path, st

    def close(self) -> None:
        """Drop the kept mapping (unpinning it)."""
        if self._kept is not None:
            self._kept.close()
            self._kept = None
