"""NCCL weight-update groups, the one place that builds them: rendezvous groups, communicators, backend names, and
the receiving side (``NcclReceiver``) that every server engine uses.

Backends (``sync.nccl_backend`` on the learner; the ``backend`` field of ``/init_communicator/`` on the wire):
- ``pynccl`` (wire ``pynccl``, ms-swift's and the default when the field is absent): vLLM's ``StatelessProcessGroup``
  + ``PyNcclCommunicator``; needs vLLM and CUDA on both sides;
- ``torch`` (wire ``torch-nccl`` on CUDA, ``torch-gloo`` on CPU): our ``StoreGroup`` (a ``TCPStore``) +
  ``TorchStatelessCommunicator`` (``ProcessGroupNCCL`` / ``ProcessGroupGloo`` built directly on the store), no vLLM,
  never the default process group.
The learner is always the last rank of a group; each server engine process (or each vLLM worker) is one rank.
"""

from __future__ import annotations

import importlib.util
import pickle
import threading
import time
from datetime import timedelta
from typing import Any, Literal

import torch

from trainer.sync.buckets import FlatTensorMeta, torch_dtype, unflatten


class NcclSetupError(ValueError):
    """The requested NCCL backend cannot be built here; the message says which one works instead."""


class BroadcastTimeout(RuntimeError):
    """A broadcast did not complete in time (a peer was killed or stalled mid-transfer); the communicator was aborted
    and must not be used again."""


NcclBackend = Literal["pynccl", "torch"]
WIRE_BACKENDS = ("pynccl", "torch-nccl", "torch-gloo")


def vllm_available() -> bool:
    """Whether vLLM can be imported here (needed by the ``pynccl`` backend only)."""
    return importlib.util.find_spec("vllm") is not None


def resolve_nccl_backend(requested: str = "auto") -> NcclBackend:
    """``auto`` → ``pynccl`` when vLLM is importable (what ``swift rollout`` servers speak), else ``torch``."""
    if requested == "auto":
        return "pynccl" if vllm_available() else "torch"
    if requested not in ("pynccl", "torch"):
        raise ValueError(f"unknown NCCL backend {requested!r}; use auto, pynccl or torch")
    return requested  # type: ignore[return-value]


def wire_backend(backend: NcclBackend, device: torch.device) -> str:
    """The ``/init_communicator/`` ``backend`` value: ``pynccl`` | ``torch-nccl`` (CUDA) | ``torch-gloo`` (CPU)."""
    if backend == "pynccl":
        return "pynccl"
    return "torch-nccl" if device.type == "cuda" else "torch-gloo"


class StoreGroup:
    """A stateless rendezvous group over one ``torch.distributed.TCPStore`` (rank 0 hosts it), with the surface of
    vLLM's ``StatelessProcessGroup`` that the communicators use (``rank``, ``world_size``, ``store``, ``barrier``,
    ``broadcast_obj``) and no vLLM import. It never touches the default process group, so a learner already in a
    DDP world can form it."""

    def __init__(self, store: Any, rank: int, world_size: int):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._barriers = 0
        self._objs = 0

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, store_timeout: int = 300) -> StoreGroup:
        import torch.distributed as dist

        store = dist.TCPStore(host_name=host, port=port, world_size=world_size, is_master=rank == 0,
                              timeout=timedelta(seconds=store_timeout), wait_for_workers=False)
        return cls(store, rank, world_size)

    def barrier(self) -> None:
        n = self._barriers
        self._barriers += 1
        self.store.set(f"rm_barrier/{n}/{self.rank}", b"1")
        self.store.wait([f"rm_barrier/{n}/{r}" for r in range(self.world_size)])
        if n:  # everyone passed barrier n, so everyone is done waiting on barrier n - 1
            self.store.delete_key(f"rm_barrier/{n - 1}/{self.rank}")

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        n = self._objs
        self._objs += 1
        key = f"rm_obj/{n}/{src}"
        if self.rank == src:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self.store.get(key))


def make_group(backend: NcclBackend, host: str, port: int, rank: int, world_size: int, store_timeout: int = 300) -> Any:
    """The rendezvous group of ``backend``: vLLM's ``StatelessProcessGroup`` (pynccl) or our ``StoreGroup`` (torch)."""
    if backend == "torch":
        return StoreGroup.create(host, port, rank, world_size, store_timeout)
    from vllm.distributed.utils import StatelessProcessGroup

    return StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                        store_timeout=store_timeout)


def pynccl_communicator(group: Any, device: torch.device) -> Any:
    """vLLM's ``PyNcclCommunicator`` over ``group`` (what ``swift rollout`` servers use)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    return PyNcclCommunicator(group, device=device)


class TorchStatelessCommunicator:
    """Pure-torch stand-in for vLLM's ``PyNcclCommunicator`` (same ``broadcast``/``rank``/``group``/``device``
    surface): a ``ProcessGroupNCCL`` (CUDA ``device``) or ``ProcessGroupGloo`` (CPU) constructed directly on the
    group's TCP store (under a prefix), so it needs neither vLLM nor the default process group. ``group`` is a
    ``StoreGroup`` (or anything with ``store``/``rank``/``world_size``, e.g. vLLM's ``StatelessProcessGroup``)."""

    backend = "torch"

    def __init__(self, group: Any, device: torch.device | None = None, timeout_s: float = 1800.0):
        import torch.distributed as dist

        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size
        self.device = torch.device("cpu") if device is None else torch.device(device)
        store = dist.PrefixStore("rm_torch_comm", group.store)
        if self.device.type == "cuda":
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise RuntimeError("this torch build has no NCCL (ProcessGroupNCCL); the torch backend on CUDA needs it")
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)
            self.pg = dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None, timeout_s: float | None = None) -> None:
        """``tensor`` from rank ``src`` to every rank, in place; returns once it is complete on this rank's stream
        (``stream`` is accepted for ``PyNcclCommunicator`` compatibility and unused). ``timeout_s``: past it the
        process group is aborted and ``BroadcastTimeout`` raised."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        work = self.pg.broadcast([tensor], opts)
        if timeout_s is None:
            work.wait()
            return
        try:
            done = work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo: "Timed out" or the peer's connection closed
            self.abort()
            raise BroadcastTimeout(f"broadcast failed or timed out after {timeout_s:g} s: {exc}") from exc
        if done is False:
            self.abort()
            raise BroadcastTimeout(f"broadcast did not complete within {timeout_s:g} s")

    def abort(self) -> None:
        """Tear down the process group (NCCL: ``ncclCommAbort``, which ends a kernel waiting on a dead peer)."""
        abort = getattr(self.pg, "abort", None)
        if abort is not None:
            try:
                abort()
            except Exception:  # noqa: BLE001 - the group is being thrown away
                pass


def bounded_broadcast(comm: Any, tensor: torch.Tensor, timeout_s: float, poll_s: float = 0.001) -> None:
    """Broadcast ``tensor`` from ``comm``'s own rank (the learner's) and return when it is complete, or abort the
    communicator and raise ``BroadcastTimeout`` after ``timeout_s`` (an NCCL kernel never returns when a peer dies
    mid-transfer: without the bound the sync, and the learner, hang). ``comm``: our ``TorchStatelessCommunicator``
    (the process group's own timed wait) or vLLM's ``PyNcclCommunicator`` (a CUDA event polled against the deadline,
    then ``ncclCommAbort``)."""
    if isinstance(comm, TorchStatelessCommunicator):
        comm.broadcast(tensor, src=comm.rank, timeout_s=timeout_s)
        return
    if not tensor.is_cuda:
        comm.broadcast(tensor, src=comm.rank)
        return
    stream = torch.cuda.current_stream()
    comm.broadcast(tensor, src=comm.rank, stream=stream)
    done = torch.cuda.Event()
    done.record(stream)
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            abort_pynccl(comm)
            raise BroadcastTimeout(f"broadcast did not complete within {timeout_s:g} s")
        time.sleep(poll_s)


def barrier_within(group: Any, timeout_s: float) -> None:
    """``group.barrier()`` bounded by ``timeout_s`` (``BroadcastTimeout`` past it). A ``TCPStore`` client waiting on a
    store whose host is stopped never returns (its socket poll times out and is retried), so the barrier runs in a
    daemon thread that is left behind when the deadline passes; the caller drops the group."""
    outcome: list[BaseException | None] = []
    worker = threading.Thread(target=lambda: outcome.append(_run(group.barrier)), daemon=True,
                              name="rm-sync-barrier")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise BroadcastTimeout(f"the barrier after the broadcast did not complete within {timeout_s:g} s")
    if outcome and outcome[0] is not None:
        raise outcome[0]


def _run(fn: Any) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        return exc
    return None


def abort_pynccl(comm: Any) -> None:
    """``ncclCommAbort`` on a ``PyNcclCommunicator`` (the in-flight kernel returns) and mark it unusable."""
    nccl, handle = getattr(comm, "nccl", None), getattr(comm, "comm", None)
    if nccl is not None and handle is not None and hasattr(nccl, "ncclCommAbort"):
        try:
            nccl.ncclCommAbort(handle)
        except Exception:  # noqa: BLE001 - the communicator is being thrown away
            pass
    comm.disabled = True


def communicator(backend: NcclBackend, group: Any, device: torch.device) -> Any:
    """The communicator of ``backend`` over ``group`` on ``device``."""
    if backend == "pynccl":
        return pynccl_communicator(group, device)
    return TorchStatelessCommunicator(group, device)


def join_group(backend: NcclBackend, host: str, port: int, rank: int, world_size: int, device: torch.device,
               store_timeout: int = 300) -> Any:
    """Join the weight-update group at ``host:port`` as ``rank`` of ``world_size`` and return the communicator of
    ``backend`` on ``device``; its rendezvous group (``barrier``, ``broadcast_obj``) is ``comm.group``."""
    return communicator(backend, make_group(backend, host, port, rank, world_size, store_timeout), device)


def backend_of_wire(wire: str) -> NcclBackend:
    if wire not in WIRE_BACKENDS:
        raise NcclSetupError(f"unknown NCCL backend {wire!r}; use one of {list(WIRE_BACKENDS)}")
    return "pynccl" if wire == "pynccl" else "torch"


def offered_wire_backends() -> list[str]:
    """The ``/init_communicator/`` backends this process can build (reported by ``/rm/info/``)."""
    cuda = torch.cuda.is_available()
    out = ["pynccl"] if cuda and vllm_available() else []
    if cuda and hasattr(torch.distributed, "ProcessGroupNCCL"):
        out.append("torch-nccl")
    return [*out, "torch-gloo"]


class NcclReceiver:
    """The receiving end of one weight-update group: ``rank`` of ``world_size`` (the learner is the last rank and the
    only sender). ``device``: where received tensors land (a CUDA device for ``pynccl``/``torch-nccl``; gloo receives
    on CPU and moves them to ``device``).

    A full update arrives bucket by bucket: ``stage_named`` / ``stage_bucket`` receive one and hold it in ``staged``
    (on ``stage_device``, default ``device``) until the update is whole; ``take_staged`` then hands the whole update
    to the loader, which checks it before any weight changes — or to nobody, when it is refused. Dropping the
    receiver drops what it staged."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, wire: str, device: torch.device,
                 stage_device: torch.device | None = None):
        backend = backend_of_wire(wire)
        if wire in ("pynccl", "torch-nccl") and device.type != "cuda":
            raise NcclSetupError(
                f"NCCL weight sync needs a CUDA GPU on the server ({wire} backend); on CPU use torch-gloo "
                "(sync.nccl_backend: torch on a CPU learner) or our in-band transport (POST /rm/update_weights_inband/)")
        self.device = device
        self.stage_device = device if stage_device is None else stage_device
        self.staged: dict[str, torch.Tensor] = {}
        self.src = world_size - 1
        self.comm = join_group(backend, host, port, rank, world_size,
                               device if wire != "torch-gloo" else torch.device("cpu"))

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One broadcast from the learner into a new tensor on ``device``."""
        buf = torch.empty(shape, dtype=dtype, device=self.comm.device)
        cuda = buf.is_cuda
        self.comm.broadcast(buf, src=self.src, stream=torch.cuda.current_stream() if cuda else None)
        if cuda:
            torch.cuda.synchronize()
        self.comm.group.barrier()
        return buf if buf.device == self.device else buf.to(self.device)

    def receive_each(self, metas: list[tuple[str, str, list[int]]]) -> dict[str, torch.Tensor]:
        """ms-swift's non-flattened adapter sync: one broadcast per ``(name, dtype, shape)`` in order, then a single
        barrier for all of them (``receive`` has one per tensor)."""
        tensors = {}
        for name, dtype, shape in metas:
            buf = torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=self.comm.device)
            self.comm.broadcast(buf, src=self.src, stream=torch.cuda.current_stream() if buf.is_cuda else None)
            tensors[name] = buf
        if any(t.is_cuda for t in tensors.values()):
            torch.cuda.synchronize()
        self.comm.group.barrier()
        return {k: v if v.device == self.device else v.to(self.device) for k, v in tensors.items()}

    def receive_named(self, name: str, dtype: str, shape: list[int]) -> dict[str, torch.Tensor]:
        return {name: self.receive(tuple(shape), torch_dtype(dtype))}

    def receive_bucket(self, metadatas: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """A flattened bucket (ms-swift layout), unflattened into separate tensors (copies, not views)."""
        metas = [FlatTensorMeta.model_validate(m) for m in metadatas]
        bucket = self.receive((metas[-1].end_idx,), torch.uint8)
        return {k: v.clone() for k, v in unflatten(metas, bucket).items()}

    def _stage(self, tensors: dict[str, torch.Tensor]) -> int:
        self.staged.update({k: v.to(self.stage_device) for k, v in tensors.items()})
        return len(tensors)

    def stage_named(self, name: str, dtype: str, shape: list[int]) -> int:
        """Receive one named tensor into ``staged``; returns how many tensors it staged (1)."""
        return self._stage(self.receive_named(name, dtype, shape))

    def stage_bucket(self, metadatas: list[dict[str, Any]]) -> int:
        """Receive one flattened bucket into ``staged``; returns how many tensors it staged."""
        return self._stage(self.receive_bucket(metadatas))

    def take_staged(self) -> dict[str, torch.Tensor]:
        """Everything staged since the last take, leaving nothing staged."""
        staged, self.staged = self.staged, {}
        return staged
