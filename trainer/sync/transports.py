"""Learner-side weight transports to rollout servers.

- ``InbandTransport`` (ours, any device): one HTTP POST per server to ``/rm/update_weights_inband/`` with a
  safetensors payload; only our ``python -m trainer serve`` understands it.
- ``NcclTransport`` (GPU, what ``swift rollout`` expects): ``/init_communicator/`` on each server, then the
  learner joins each server's group as its last rank (vLLM ``StatelessProcessGroup`` + ``PyNcclCommunicator``);
  full sync = per bucket ``/update_flattened_params/`` + broadcast, then ``/process_weights_after_loading/``;
  adapter sync = ``/update_adapter_flattened_param/`` + broadcast; both end with ``/reset_prefix_cache/``.
  ``backend="torch"`` (``sync.nccl_backend``) swaps vLLM's group and communicator for ours, pure torch:
  ``StoreGroup`` (a ``TCPStore``) + ``TorchStatelessCommunicator`` (``ProcessGroupNCCL`` on CUDA, gloo on CPU,
  never the default process group); it asks our server for the same with ``backend`` in ``/init_communicator/``.

Both keep a set of *active* servers: ``drop(url)`` takes a failed server out of every later push (NCCL: its
communicator is closed on our side and ``/close_communicator/`` is sent best-effort), ``readmit(server)`` puts it
back (NCCL: a fresh communicator is created — close, ``/init_communicator/``, join as the last rank — which is what
a restarted server needs). A push that fails on some active servers drops those, finishes on the others (so no
healthy server is left with half an update) and then raises ``WeightTransportError`` whose ``failed`` maps each
dropped server to its error; ``only=[...]`` restricts one push to some active servers (per-server re-sync).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import pickle
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Literal, Protocol

import httpx
import torch

from trainer.sync.buckets import DEFAULT_BUCKET_BYTES, flatten, plan_buckets
from trainer.sync.weights import AdapterWeights, safetensors_bytes

log = logging.getLogger(__name__)

INBAND_PATH = "/rm/update_weights_inband/"


class WeightTransportError(RuntimeError):
    """A weight push failed; the message names the server and what to do. ``failed``: url → error of each server
    the push failed on (those servers were dropped from the transport)."""

    def __init__(self, message: str, failed: dict[str, str] | None = None):
        super().__init__(message)
        self.failed = dict(failed or {})


class ServerHandle(Protocol):
    base_url: str

    def headers(self) -> dict[str, str]: ...


class WeightTransport(Protocol):
    name: str
    servers: list  # the active servers, in server-list order

    def push_full(self, tensors: dict[str, torch.Tensor], only: Sequence[str] | None = None) -> None: ...

    def push_adapter(self, adapter: AdapterWeights, only: Sequence[str] | None = None) -> None: ...

    def drop(self, url: str) -> None: ...

    def readmit(self, server: ServerHandle) -> None: ...

    def close(self) -> None: ...


def _check(resp: httpx.Response, url: str, what: str) -> dict[str, Any]:
    if resp.status_code == 404 and what == "in-band weight update":
        raise WeightTransportError(
            f"{url} does not offer our in-band transport (404 on {INBAND_PATH}); it is probably a `swift rollout` "
            "server: use sync.transport: nccl (needs a CUDA learner)"
        )
    if resp.status_code != 200:
        raise WeightTransportError(f"{what} on {url} failed: HTTP {resp.status_code} {resp.text[:500]}")
    try:
        return resp.json()
    except ValueError:
        return {}


def on_all(servers: Sequence[ServerHandle], fn: Callable[[ServerHandle], Any]) -> list[Any]:
    """Run ``fn`` for every server concurrently; raise one error listing every failure."""
    results, failed = on_each(servers, fn)
    if failed:
        raise WeightTransportError("weight sync failed on " + "; ".join(f"{u}: {e}" for u, e in failed.items()), failed)
    return results


def on_each(servers: Sequence[ServerHandle], fn: Callable[[ServerHandle], Any]) -> tuple[list[Any], dict[str, str]]:
    """Run ``fn`` for every server concurrently; the results of those that succeeded and url → error of the rest."""
    if not servers:
        return [], {}
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futures = [pool.submit(fn, s) for s in servers]
    failed: dict[str, str] = {}
    results = []
    for s, f in zip(servers, futures):
        exc = f.exception()
        if exc is not None:
            failed[s.base_url] = f"{type(exc).__name__}: {exc}"
        else:
            results.append(f.result())
    return results, failed


class _ActiveSet:
    """The active-server bookkeeping both transports share (see module docstring)."""

    name = "?"

    def _init_active(self, servers: Sequence[ServerHandle]) -> None:
        self.all_servers = list(servers)
        self.servers = list(servers)
        self.failed: dict[str, str] = {}

    def _targets(self, only: Sequence[str] | None) -> list[ServerHandle]:
        if only is None:
            return list(self.servers)
        missing = [u for u in only if u not in {s.base_url for s in self.servers}]
        if missing:
            raise WeightTransportError(f"{missing} are not active in the {self.name} transport (readmit them first)")
        return [s for s in self.servers if s.base_url in only]

    def _run(self, targets: list[ServerHandle], fn: Callable[[ServerHandle], Any]) -> list[ServerHandle]:
        """``fn`` on every target; failed ones are dropped and remembered; returns the targets still active."""
        _, failed = on_each(targets, fn)
        for url, err in failed.items():
            self.failed[url] = err
            self.drop(url)
        return [s for s in targets if s.base_url not in failed]

    def _raise_failed(self) -> None:
        failed, self.failed = self.failed, {}
        if failed:
            raise WeightTransportError(
                f"{self.name} weight push failed on " + "; ".join(f"{u}: {e}" for u, e in failed.items())
                + " (dropped from weight sync; the push completed on the other servers)", failed)

    def drop(self, url: str) -> None:
        self.servers = [s for s in self.servers if s.base_url != url]

    def readmit(self, server: ServerHandle) -> None:
        if server.base_url not in {s.base_url for s in self.servers}:
            order = [s.base_url for s in self.all_servers]
            self.servers = sorted([*self.servers, server],
                                  key=lambda s: order.index(s.base_url) if s.base_url in order else len(order))


class InbandTransport(_ActiveSet):
    name = "inband"

    def __init__(self, servers: Sequence[ServerHandle], timeout_s: float = 600.0):
        self._init_active(servers)
        self.client = httpx.Client(timeout=timeout_s)

    def _post(self, kind: str, blob: bytes, only: Sequence[str] | None) -> None:
        def one(s: ServerHandle) -> None:
            url = s.base_url + INBAND_PATH
            resp = self.client.post(url, params={"kind": kind}, content=blob,
                                    headers={**s.headers(), "content-type": "application/octet-stream"})
            _check(resp, url, "in-band weight update")

        self._run(self._targets(only), one)
        self._raise_failed()

    def push_full(self, tensors: dict[str, torch.Tensor], only: Sequence[str] | None = None) -> None:
        self._post("full", safetensors_bytes(tensors), only)

    def push_adapter(self, adapter: AdapterWeights, only: Sequence[str] | None = None) -> None:
        self._post("adapter", safetensors_bytes(adapter.tensors, {"peft_config": json.dumps(adapter.peft_config)}),
                   only)

    def close(self) -> None:
        self.client.close()


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

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        """``tensor`` from rank ``src`` to every rank, in place; returns once it is complete on this rank's stream
        (``stream`` is accepted for ``PyNcclCommunicator`` compatibility and unused)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()


class NcclTransport(_ActiveSet):
    """ms-swift-compatible NCCL weight sync (see module docstring); one communicator per active server, server
    ``i`` of the list on ``group_port + i``.

    ``backend`` (``auto`` | ``pynccl`` | ``torch``; auto = pynccl when vLLM is importable, else torch) picks the
    communicator: ``pynccl`` = vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator`` (what ``swift rollout``
    speaks; needs CUDA), ``torch`` = our ``StoreGroup`` + ``TorchStatelessCommunicator`` (no vLLM; NCCL on CUDA,
    gloo on a CPU learner; our server only: it is asked for with ``backend`` in ``/init_communicator/``).
    ``last_push``: bytes, buckets, seconds and broadcast seconds of the latest ``push_full``."""

    name = "nccl"

    def __init__(self, servers: Sequence[ServerHandle], group_port: int = 51216, timeout_s: float = 240.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: int | None = None, backend: str = "auto"):
        self.backend = resolve_nccl_backend(backend)
        if self.backend == "pynccl" and not vllm_available():
            raise WeightTransportError("sync.nccl_backend pynccl needs vLLM on the learner (not importable here); "
                                       "use sync.nccl_backend: torch (our servers) or install vLLM")
        cuda = torch.cuda.is_available()
        if self.backend == "pynccl" and not cuda:
            raise WeightTransportError("sync.transport nccl with the pynccl backend needs a CUDA learner; on CPU use "
                                       "sync.transport: inband (or sync.nccl_backend: torch, which runs over gloo)")
        self.communicator = pynccl_communicator if self.backend == "pynccl" else TorchStatelessCommunicator
        self.device = (torch.device("cuda", torch.cuda.current_device() if device is None else device) if cuda
                       else torch.device("cpu"))
        self._init_active(servers)
        self.group_port = group_port
        self.timeout_s = timeout_s
        self.client = httpx.Client(timeout=timeout_s)
        self.bucket_bytes = bucket_bytes
        self.comms: dict[str, Any] = {}
        self.last_push: dict[str, Any] = {}
        self._broadcast_s = 0.0
        for s in self.all_servers:
            self._connect(s)

    def _check_server_backend(self, s: ServerHandle, wire: str) -> None:
        """The torch backend is ours: make sure ``s`` offers it (a ``swift rollout`` server would wait for
        vLLM's NCCL handshake forever)."""
        resp = self.client.get(s.base_url + "/rm/info/", headers=s.headers())
        if resp.status_code == 404:
            raise WeightTransportError(f"{s.base_url} is not our rollout server (no /rm/info/), so it only speaks "
                                       "vLLM's PyNccl: set sync.nccl_backend: pynccl (needs vLLM on the learner)")
        offered = _check(resp, s.base_url, "rm/info").get("nccl_backends", ["pynccl"])
        if wire not in offered:
            raise WeightTransportError(f"{s.base_url} offers NCCL backends {offered}, not {wire!r} "
                                       "(torch-nccl needs a GPU on the server; torch-gloo is the CPU variant)")

    def _connect(self, s: ServerHandle) -> None:
        """``/init_communicator/`` on ``s`` and join its group as the last rank."""
        resp = self.client.get(s.base_url + "/get_world_size/", headers=s.headers())
        server_world = int(_check(resp, s.base_url, "get_world_size")["world_size"])
        world = server_world + 1
        host = httpx.URL(s.base_url).host
        port = self.group_port + [x.base_url for x in self.all_servers].index(s.base_url)
        body: dict[str, Any] = {"host": "0.0.0.0" if host not in ("127.0.0.1", "localhost") else host,
                                "port": port, "world_size": world}
        if self.backend == "torch":  # ms-swift's body has no backend field: sent only when not its PyNccl
            body["backend"] = wire_backend("torch", self.device)
            self._check_server_backend(s, body["backend"])
        resp = self.client.post(s.base_url + "/init_communicator/", headers=s.headers(), json=body)
        _check(resp, s.base_url, "init_communicator")
        time.sleep(0.1)
        group = make_group(self.backend, host, port, server_world, world, int(self.timeout_s))
        self.comms[s.base_url] = self.communicator(group, self.device)

    def _broadcast(self, url: str, tensor: torch.Tensor) -> None:
        comm = self.comms[url]
        t0 = time.perf_counter()
        comm.broadcast(tensor, src=comm.rank, stream=torch.cuda.current_stream() if tensor.is_cuda else None)
        if tensor.is_cuda:
            torch.cuda.synchronize()
        comm.group.barrier()
        self._broadcast_s += time.perf_counter() - t0

    def _push_bucket(self, targets: list[ServerHandle], path: str, body: dict[str, Any],
                     bucket: torch.Tensor) -> list[ServerHandle]:
        def one(s: ServerHandle) -> None:
            _check(self.client.post(s.base_url + path, headers=s.headers(), json=body), s.base_url, path)
            self._broadcast(s.base_url, bucket)

        return self._run(targets, one)

    def _post_all(self, targets: list[ServerHandle], path: str) -> list[ServerHandle]:
        return self._run(targets, lambda s: _check(self.client.post(s.base_url + path, headers=s.headers()),
                                                   s.base_url, path))

    def push_full(self, tensors: dict[str, torch.Tensor], only: Sequence[str] | None = None) -> None:
        t0 = time.perf_counter()
        self._broadcast_s = 0.0
        targets = self._targets(only)
        nbytes = nbuckets = 0
        for names in plan_buckets(tensors, self.bucket_bytes):
            metas, bucket = flatten((n, tensors[n].to(self.device)) for n in names)
            nbytes += bucket.numel()
            nbuckets += 1
            targets = self._push_bucket(targets, "/update_flattened_params/",
                                        {"metadatas": [m.model_dump() for m in metas]}, bucket)
            del bucket
        targets = self._post_all(targets, "/process_weights_after_loading/")
        self._post_all(targets, "/reset_prefix_cache/")
        self.last_push = {"bytes": nbytes, "buckets": nbuckets, "servers": len(targets),
                          "seconds": time.perf_counter() - t0, "broadcast_s": self._broadcast_s}
        self._raise_failed()

    def push_adapter(self, adapter: AdapterWeights, only: Sequence[str] | None = None) -> None:
        metas, bucket = flatten((n, t.to(self.device)) for n, t in adapter.tensors.items())
        targets = self._push_bucket(self._targets(only), "/update_adapter_flattened_param/",
                                    {"peft_config": adapter.peft_config, "metadatas": [m.model_dump() for m in metas]},
                                    bucket)
        self._post_all(targets, "/reset_prefix_cache/")
        self._raise_failed()

    def drop(self, url: str) -> None:
        """Take ``url`` out of the group: forget our communicator, ask the server to close its side (best effort,
        short timeout: the server is usually dead or stalled)."""
        super().drop(url)
        if self.comms.pop(url, None) is not None:
            headers = next((s.headers() for s in self.all_servers if s.base_url == url), {})
            try:
                self.client.post(url + "/close_communicator/", headers=headers, timeout=2.0)
            except httpx.HTTPError as exc:
                log.info("close_communicator on dropped server %s: %s (expected when it is down)", url, exc)

    def readmit(self, server: ServerHandle) -> None:
        """A fresh communicator for ``server`` (e.g. after a restart); raises ``WeightTransportError`` naming the
        server when it cannot be re-created (the caller keeps the server quarantined)."""
        if server.base_url not in {s.base_url for s in self.all_servers}:
            self.all_servers.append(server)
        self.comms.pop(server.base_url, None)
        try:
            self.client.post(server.base_url + "/close_communicator/", headers=server.headers(), timeout=5.0)
            self._connect(server)
        except Exception as exc:  # noqa: BLE001 - any failure means: this server's group cannot be re-formed
            raise WeightTransportError(
                f"{server.base_url}: could not re-create its weight-sync communicator ({type(exc).__name__}: {exc}); "
                "it stays quarantined (restart it, or check group_port + its index is reachable)",
                {server.base_url: str(exc)}) from exc
        super().readmit(server)

    def close(self) -> None:
        for s in self.servers:
            try:
                self.client.post(s.base_url + "/close_communicator/", headers=s.headers())
            except httpx.HTTPError as exc:
                log.warning("close_communicator on %s failed: %s", s.base_url, exc)
        self.comms = {}
        self.client.close()
