"""Learner-side weight transports to rollout servers: stateless pushes that report per-server errors.

``push_full(tensors, targets)`` / ``push_adapter(adapter, targets)`` send one update to every target concurrently
and return ``{url: error}`` for the targets it failed on; the others got the whole update. Who the targets are is
decided by the caller (``trainer.rollout.server_fleet.ServerFleet`` owns membership).

- ``InbandTransport`` (ours, any device): one HTTP POST per server to ``/rm/update_weights_inband/`` with a
  safetensors payload; only our ``python -m trainer serve`` understands it.
- ``NcclTransport`` (GPU, what ``swift rollout`` expects): ``/init_communicator/`` on each server, then the
  learner joins each server's group as its last rank (``trainer.sync.nccl``); full sync = per bucket
  ``/update_flattened_params/`` + broadcast, then ``/process_weights_after_loading/``; adapter sync =
  ``/update_adapter_flattened_param/`` + broadcast; both end with ``/reset_prefix_cache/``. It keeps one
  communicator per server it has connected (a connection cache, not membership): ``disconnect(url)`` forgets one
  (after a failure), and the next push to that server connects afresh — which is what a restarted server needs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import httpx
import torch

from trainer.sync.buckets import DEFAULT_BUCKET_BYTES, flatten, plan_buckets
from trainer.sync.http import server_http_client
from trainer.sync.nccl import (  # noqa: F401 - re-exported for callers of the transport layer
    BroadcastTimeout,
    StoreGroup,
    TorchStatelessCommunicator,
    barrier_within,
    bounded_broadcast,
    join_group,
    resolve_nccl_backend,
    vllm_available,
    wire_backend,
)
from trainer.sync.shm_staging import SHM_PATH, ShmStaging
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
    """Stateless pushes: each returns ``{url: error}`` for the targets it failed on (the rest got the update)."""

    name: str

    def push_full(self, tensors: dict[str, torch.Tensor], targets: Sequence[ServerHandle]) -> dict[str, str]: ...

    def push_adapter(self, adapter: AdapterWeights, targets: Sequence[ServerHandle]) -> dict[str, str]: ...

    def disconnect(self, url: str) -> None: ...

    def close(self) -> None: ...


def _check(resp: httpx.Response, url: str, what: str) -> dict[str, Any]:
    if resp.status_code == 404 and what == "in-band weight update":
        raise WeightTransportError(
            f"{url} does not offer our in-band transport (404 on {INBAND_PATH}); it is probably a `swift rollout` "
            "server: use sync.transport: nccl (needs a CUDA learner)"
        )
    if resp.status_code == 422:  # the server refused the content (e.g. a weight update: bad name/shape/dtype/NaN)
        try:
            detail = resp.json().get("detail")
        except (ValueError, AttributeError):
            detail = None
        text = detail if isinstance(detail, str) else resp.text[:500]
        raise WeightTransportError(f"{what} on {url} refused (HTTP 422): {text}")
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


BODY_CHUNK_BYTES = 8 * 2**20
#: largest full update staged in pinned host memory by ``InbandTransport`` (kept for the run; larger ones go pageable)
PINNED_STAGING_MAX_BYTES = 8 * 2**30


def body_chunks(blob: bytes | bytearray | memoryview, chunk_bytes: int | None = None) -> Iterator[memoryview]:
    """``blob`` as zero-copy slices of at most ``chunk_bytes``. httpcore sends a ``bytes`` body with
    ``buffer = buffer[sent:]`` after every partial ``send``, copying the rest each time: quadratic in the body size
    (a 1.5 GB update took minutes on one host). Slices of a ``memoryview`` are views, so the send stays linear."""
    chunk_bytes = chunk_bytes or BODY_CHUNK_BYTES
    view = memoryview(blob)
    for start in range(0, len(view), chunk_bytes):
        yield view[start:start + chunk_bytes]


class InbandTransport:
    """Full weights / adapters as one safetensors body per server (``POST INBAND_PATH``); the body streams in
    ``body_chunks`` with its ``Content-Length`` declared (no chunked transfer encoding); with ``shm_dir`` the payload
    is written once into a staging file there and only its name is posted (``trainer.sync.shm_staging``). ``last_push``: bytes,
    encode seconds (device-to-host copy into the payload) and post seconds (all targets) of the latest push."""

    name = "inband"

    def __init__(self, timeout_s: float = 600.0, pinned_staging_max_bytes: int = PINNED_STAGING_MAX_BYTES,
                 shm_dir: str | None = None):
        self.client = server_http_client(timeout_s)
        self.last_push: dict[str, float] = {}
        self.pinned_staging_max_bytes = pinned_staging_max_bytes
        self._staging: torch.Tensor | None = None
        self.shm = ShmStaging(shm_dir) if shm_dir else None

    def _allocator(self, tensors: dict[str, torch.Tensor]):
        """The shared directory's staging file with ``shm_dir``; else a pinned staging buffer, kept and reused across
        pushes, when the update lives on a GPU and fits ``pinned_staging_max_bytes`` (one asynchronous device-to-host
        copy per tensor instead of pageable copies); ``None`` (a fresh ``bytearray``) otherwise."""
        if self.shm is not None:
            return self.shm.allocate
        if not any(t.is_cuda for t in tensors.values()):
            return None
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + 2**20
        if need > self.pinned_staging_max_bytes:
            return None

        def allocate(nbytes: int) -> torch.Tensor:
            if self._staging is None or self._staging.numel() < nbytes:
                self._staging = None
                self._staging = torch.empty(max(nbytes, need), dtype=torch.uint8, pin_memory=True)
            return self._staging

        return allocate

    def _post(self, kind: str, blob: bytes | bytearray | memoryview, targets: Sequence[ServerHandle],
              encode_s: float = 0.0) -> dict[str, str]:
        def one(s: ServerHandle) -> None:
            if self.shm is not None:
                url = s.base_url + SHM_PATH
                resp = self.client.post(url, params={"kind": kind}, headers=s.headers(),
                                        json={"file": self.shm.name, "bytes": len(blob)})
                if resp.status_code == 404:
                    raise WeightTransportError(f"{url}: 404; the server was not started with --shm-dir (or is not "
                                               "ours): start it with --shm-dir on the directory of sync.shm_dir, or "
                                               "drop sync.shm_dir")
                _check(resp, url, "in-band weight update (shared directory)")
                return
            url = s.base_url + INBAND_PATH
            resp = self.client.post(url, params={"kind": kind}, content=body_chunks(blob),
                                    headers={**s.headers(), "content-type": "application/octet-stream",
                                             "content-length": str(len(blob))})
            _check(resp, url, "in-band weight update")

        t0 = time.perf_counter()
        errors = on_each(targets, one)[1]
        self.last_push = {"bytes": len(blob), "encode_s": encode_s, "post_s": time.perf_counter() - t0}
        return errors

    def push_full(self, tensors: dict[str, torch.Tensor], targets: Sequence[ServerHandle]) -> dict[str, str]:
        t0 = time.perf_counter()
        blob = safetensors_bytes(tensors, allocate=self._allocator(tensors))
        return self._post("full", blob, targets, time.perf_counter() - t0)

    def push_adapter(self, adapter: AdapterWeights, targets: Sequence[ServerHandle]) -> dict[str, str]:
        t0 = time.perf_counter()
        blob = safetensors_bytes(adapter.tensors, {"peft_config": json.dumps(adapter.peft_config)},
                                 allocate=self._allocator(adapter.tensors))
        return self._post("adapter", blob, targets, time.perf_counter() - t0)

    def disconnect(self, url: str) -> None:
        """Nothing to forget: every in-band push is self-contained."""

    def close(self) -> None:
        self.client.close()
        self._staging = None
        if self.shm is not None:
            self.shm.close()


BROADCAST_TIMEOUT_KEY = "custom.extra.rollout_matching.vllm.sync.broadcast_timeout_s"


class NcclTransport:
    """ms-swift-compatible NCCL weight sync (see module docstring); server ``i`` of ``servers`` (the full list, fixed
    for the run) forms its group on ``group_port + i``.

    ``backend`` (``auto`` | ``pynccl`` | ``torch``; auto = pynccl when vLLM is importable, else torch) picks the
    communicator (``trainer.sync.nccl``); the torch backend is asked for with ``backend`` in ``/init_communicator/``
    (our servers only). ``last_push``: bytes, buckets, seconds and broadcast seconds of the latest ``push_full``."""

    name = "nccl"

    def __init__(self, servers: Sequence[ServerHandle], group_port: int = 51216, timeout_s: float = 240.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: int | None = None, backend: str = "auto",
                 broadcast_timeout_s: float = 120.0):
        #: one bucket's broadcast to one server must complete within this (``BROADCAST_TIMEOUT_KEY``)
        self.broadcast_timeout_s = broadcast_timeout_s
        self.backend = resolve_nccl_backend(backend)
        if self.backend == "pynccl" and not vllm_available():
            raise WeightTransportError("sync.nccl_backend pynccl needs vLLM on the learner (not importable here); "
                                       "use sync.nccl_backend: torch (our servers) or install vLLM")
        cuda = torch.cuda.is_available()
        if self.backend == "pynccl" and not cuda:
            raise WeightTransportError("sync.transport nccl with the pynccl backend needs a CUDA learner; on CPU use "
                                       "sync.transport: inband (or sync.nccl_backend: torch, which runs over gloo)")
        self.device = (torch.device("cuda", torch.cuda.current_device() if device is None else device) if cuda
                       else torch.device("cpu"))
        self.order = [s.base_url for s in servers]
        self.group_port = group_port
        self.timeout_s = timeout_s
        self.client = server_http_client(timeout_s)
        self.bucket_bytes = bucket_bytes
        self.comms: dict[str, Any] = {}
        self.dropped_comms: list[Any] = []
        self.last_push: dict[str, Any] = {}
        self._broadcast_s = 0.0

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

    def connect(self, s: ServerHandle) -> None:
        """``/init_communicator/`` on ``s`` and join its group as the last rank (a no-op when connected)."""
        if s.base_url in self.comms:
            return
        if s.base_url not in self.order:
            self.order.append(s.base_url)
        try:
            self.client.post(s.base_url + "/close_communicator/", headers=s.headers(), timeout=5.0)
        except httpx.HTTPError:
            pass
        resp = self.client.get(s.base_url + "/get_world_size/", headers=s.headers())
        server_world = int(_check(resp, s.base_url, "get_world_size")["world_size"])
        world = server_world + 1
        host = httpx.URL(s.base_url).host
        port = self.group_port + self.order.index(s.base_url)
        body: dict[str, Any] = {"host": "0.0.0.0" if host not in ("127.0.0.1", "localhost") else host,
                                "port": port, "world_size": world}
        if self.backend == "torch":  # ms-swift's body has no backend field: sent only when not its PyNccl
            body["backend"] = wire_backend("torch", self.device)
            self._check_server_backend(s, body["backend"])
        resp = self.client.post(s.base_url + "/init_communicator/", headers=s.headers(), json=body)
        _check(resp, s.base_url, "init_communicator")
        time.sleep(0.1)
        self.comms[s.base_url] = join_group(self.backend, host, port, server_world, world, self.device,
                                            int(self.timeout_s))

    def _connected(self, targets: Sequence[ServerHandle]) -> tuple[list[ServerHandle], dict[str, str]]:
        failed = on_each([s for s in targets if s.base_url not in self.comms], self.connect)[1]
        for url in failed:
            self.disconnect(url)
        return [s for s in targets if s.base_url not in failed], failed

    def _broadcast(self, url: str, tensor: torch.Tensor) -> None:
        """One bucket to ``url``, bounded by ``broadcast_timeout_s``: a server killed or stalled mid-broadcast fails
        this push (its communicator aborted, the error naming the key) instead of hanging the learner."""
        comm = self.comms[url]
        t0 = time.perf_counter()
        try:
            bounded_broadcast(comm, tensor, self.broadcast_timeout_s)
            barrier_within(comm.group, self.broadcast_timeout_s)
        except Exception as exc:  # noqa: BLE001 - BroadcastTimeout, or the store's timeout / a closed connection
            raise WeightTransportError(
                f"NCCL broadcast to {url} did not finish within {BROADCAST_TIMEOUT_KEY}={self.broadcast_timeout_s:g} s "
                f"({type(exc).__name__}: {str(exc)[:200]}): the server died or stalled mid-update; its communicator was "
                "aborted, it is quarantined, and it is re-admitted with the current weights once it answers again. "
                "Raise the key if a healthy broadcast of one bucket (sync.bucket_mb) can take that long") from exc
        self._broadcast_s += time.perf_counter() - t0

    def _each(self, targets: list[ServerHandle], fn: Callable[[ServerHandle], Any],
              failed: dict[str, str]) -> list[ServerHandle]:
        """``fn`` on every target; the ones it failed on are disconnected and added to ``failed``."""
        errors = on_each(targets, fn)[1]
        for url, err in errors.items():
            failed[url] = err
            self.disconnect(url)
        return [s for s in targets if s.base_url not in errors]

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Callable[[ServerHandle], Any]:
        return lambda s: _check(self.client.post(s.base_url + path, headers=s.headers(), json=body), s.base_url, path)

    def push_full(self, tensors: dict[str, torch.Tensor], targets: Sequence[ServerHandle]) -> dict[str, str]:
        t0 = time.perf_counter()
        self._broadcast_s = 0.0
        live, failed = self._connected(targets)
        nbytes = nbuckets = 0
        for names in plan_buckets(tensors, self.bucket_bytes):
            metas, bucket = flatten((n, tensors[n].to(self.device)) for n in names)
            nbytes += bucket.numel()
            nbuckets += 1
            post = self._post("/update_flattened_params/", {"metadatas": [m.model_dump() for m in metas]})
            live = self._each(live, lambda s, post=post, bucket=bucket: (post(s), self._broadcast(s.base_url, bucket)),
                              failed)
            del bucket
        live = self._each(live, self._post("/process_weights_after_loading/"), failed)
        live = self._each(live, self._post("/reset_prefix_cache/"), failed)
        self.last_push = {"bytes": nbytes, "buckets": nbuckets, "servers": len(live),
                          "seconds": time.perf_counter() - t0, "broadcast_s": self._broadcast_s}
        return failed

    def push_adapter(self, adapter: AdapterWeights, targets: Sequence[ServerHandle]) -> dict[str, str]:
        live, failed = self._connected(targets)
        metas, bucket = flatten((n, t.to(self.device)) for n, t in adapter.tensors.items())
        post = self._post("/update_adapter_flattened_param/",
                          {"peft_config": adapter.peft_config, "metadatas": [m.model_dump() for m in metas]})
        live = self._each(live, lambda s: (post(s), self._broadcast(s.base_url, bucket)), failed)
        self._each(live, self._post("/reset_prefix_cache/"), failed)
        return failed

    def disconnect(self, url: str) -> None:
        """Forget ``url``'s communicator and ask the server to close its side (best effort, short timeout: the
        server is usually dead or stalled); the next push to it connects afresh."""
        comm = self.comms.pop(url, None)
        if comm is None:
            return
        # never destroyed while the run lasts: a process group whose peer died or stalled can block in its destructor
        self.dropped_comms.append(comm)
        try:
            self.client.post(url + "/close_communicator/", timeout=2.0)
        except httpx.HTTPError as exc:
            log.info("close_communicator on %s: %s (expected when it is down)", url, exc)

    def close(self) -> None:
        for url in list(self.comms):
            try:
                self.client.post(url + "/close_communicator/")
            except httpx.HTTPError as exc:
                log.warning("close_communicator on %s failed: %s", url, exc)
        self.comms = {}
        self.client.close()
