"""Learner-side weight transports to rollout servers.

- ``InbandTransport`` (ours, any device): one HTTP POST per server to ``/rm/update_weights_inband/`` with a
  safetensors payload; only our ``python -m trainer serve`` understands it.
- ``NcclTransport`` (GPU, what ``swift rollout`` expects): ``/init_communicator/`` on each server, then the
  learner joins each server's group as its last rank (vLLM ``StatelessProcessGroup`` + ``PyNcclCommunicator``);
  full sync = per bucket ``/update_flattened_params/`` + broadcast, then ``/process_weights_after_loading/``;
  adapter sync = ``/update_adapter_flattened_param/`` + broadcast; both end with ``/reset_prefix_cache/``.

Both keep a set of *active* servers: ``drop(url)`` takes a failed server out of every later push (NCCL: its
communicator is closed on our side and ``/close_communicator/`` is sent best-effort), ``readmit(server)`` puts it
back (NCCL: a fresh communicator is created — close, ``/init_communicator/``, join as the last rank — which is what
a restarted server needs). A push that fails on some active servers drops those, finishes on the others (so no
healthy server is left with half an update) and then raises ``WeightTransportError`` whose ``failed`` maps each
dropped server to its error; ``only=[...]`` restricts one push to some active servers (per-server re-sync).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

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


def pynccl_communicator(group: Any, device: torch.device) -> Any:
    """vLLM's ``PyNcclCommunicator`` over ``group`` (what ``swift rollout`` servers use)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    return PyNcclCommunicator(group, device=device)


class StoreBroadcastCommunicator:
    """CPU stand-in for ``PyNcclCommunicator`` with the same ``broadcast``/``rank``/``group``/``device`` surface: the
    tensor travels through the ``StatelessProcessGroup``'s TCP store. For tests and debugging with small models only
    (slow; no GPU needed on either side); production uses NCCL."""

    def __init__(self, group: Any, device: torch.device | None = None):
        self.group = group
        self.rank = group.rank
        self.device = torch.device("cpu") if device is None else device

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        if self.rank == src:
            self.group.broadcast_obj(tensor.detach().cpu().clone(), src=src)
        else:
            tensor.copy_(self.group.broadcast_obj(None, src=src))


class NcclTransport(_ActiveSet):
    """ms-swift-compatible NCCL weight sync (see module docstring); one communicator per active server, server
    ``i`` of the list on ``group_port + i``. ``communicator`` builds the learner side of a group (default vLLM's
    ``PyNcclCommunicator`` on CUDA; ``StoreBroadcastCommunicator`` stands in on CPU)."""

    name = "nccl"

    def __init__(self, servers: Sequence[ServerHandle], group_port: int = 51216, timeout_s: float = 240.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: int | None = None,
                 communicator: Callable[[Any, torch.device], Any] | None = None):
        if communicator is None:
            if not torch.cuda.is_available():
                raise WeightTransportError("sync.transport nccl needs a CUDA learner; on CPU use sync.transport: inband")
            communicator = pynccl_communicator
            self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        else:
            self.device = torch.device("cpu") if device is None else torch.device("cuda", device)
        self.communicator = communicator
        self._init_active(servers)
        self.group_port = group_port
        self.timeout_s = timeout_s
        self.client = httpx.Client(timeout=timeout_s)
        self.bucket_bytes = bucket_bytes
        self.comms: dict[str, Any] = {}
        for s in self.all_servers:
            self._connect(s)

    def _connect(self, s: ServerHandle) -> None:
        """``/init_communicator/`` on ``s`` and join its group as the last rank."""
        from vllm.distributed.utils import StatelessProcessGroup

        resp = self.client.get(s.base_url + "/get_world_size/", headers=s.headers())
        server_world = int(_check(resp, s.base_url, "get_world_size")["world_size"])
        world = server_world + 1
        host = httpx.URL(s.base_url).host
        port = self.group_port + [x.base_url for x in self.all_servers].index(s.base_url)
        resp = self.client.post(s.base_url + "/init_communicator/", headers=s.headers(),
                                json={"host": "0.0.0.0" if host not in ("127.0.0.1", "localhost") else host,
                                      "port": port, "world_size": world})
        _check(resp, s.base_url, "init_communicator")
        time.sleep(0.1)
        group = StatelessProcessGroup.create(host=host, port=port, rank=server_world, world_size=world,
                                             store_timeout=int(self.timeout_s))
        self.comms[s.base_url] = self.communicator(group, self.device)

    def _broadcast(self, url: str, tensor: torch.Tensor) -> None:
        comm = self.comms[url]
        comm.broadcast(tensor, src=comm.rank, stream=torch.cuda.current_stream() if tensor.is_cuda else None)
        if tensor.is_cuda:
            torch.cuda.synchronize()
        comm.group.barrier()

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
        targets = self._targets(only)
        for names in plan_buckets(tensors, self.bucket_bytes):
            metas, bucket = flatten((n, tensors[n].to(self.device)) for n in names)
            targets = self._push_bucket(targets, "/update_flattened_params/",
                                        {"metadatas": [m.model_dump() for m in metas]}, bucket)
        targets = self._post_all(targets, "/process_weights_after_loading/")
        self._post_all(targets, "/reset_prefix_cache/")
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
