"""Learner-side weight transports to rollout servers.

- ``InbandTransport`` (ours, any device): one HTTP POST per server to ``/rm/update_weights_inband/`` with a
  safetensors payload; only our ``python -m trainer serve`` understands it.
- ``NcclTransport`` (GPU, what ``swift rollout`` expects): ``/init_communicator/`` on each server, then the
  learner joins each server's group as its last rank (vLLM ``StatelessProcessGroup`` + ``PyNcclCommunicator``);
  full sync = per bucket ``/update_flattened_params/`` + broadcast, then ``/process_weights_after_loading/``;
  adapter sync = ``/update_adapter_flattened_param/`` + broadcast; both end with ``/reset_prefix_cache/``.
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
    """A weight push failed; the message names the server and what to do."""


class ServerHandle(Protocol):
    base_url: str

    def headers(self) -> dict[str, str]: ...


class WeightTransport(Protocol):
    name: str

    def push_full(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def push_adapter(self, adapter: AdapterWeights) -> None: ...

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
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        futures = [pool.submit(fn, s) for s in servers]
    errors = []
    results = []
    for s, f in zip(servers, futures):
        exc = f.exception()
        if exc is not None:
            errors.append(f"{s.base_url}: {exc}")
        else:
            results.append(f.result())
    if errors:
        raise WeightTransportError("weight sync failed on " + "; ".join(errors))
    return results


class InbandTransport:
    name = "inband"

    def __init__(self, servers: Sequence[ServerHandle], timeout_s: float = 600.0):
        self.servers = list(servers)
        self.client = httpx.Client(timeout=timeout_s)

    def _post(self, kind: str, blob: bytes) -> None:
        def one(s: ServerHandle) -> None:
            url = s.base_url + INBAND_PATH
            resp = self.client.post(url, params={"kind": kind}, content=blob,
                                    headers={**s.headers(), "content-type": "application/octet-stream"})
            _check(resp, url, "in-band weight update")

        on_all(self.servers, one)

    def push_full(self, tensors: dict[str, torch.Tensor]) -> None:
        self._post("full", safetensors_bytes(tensors))

    def push_adapter(self, adapter: AdapterWeights) -> None:
        self._post("adapter", safetensors_bytes(adapter.tensors, {"peft_config": json.dumps(adapter.peft_config)}))

    def close(self) -> None:
        self.client.close()


class NcclTransport:
    """ms-swift-compatible NCCL weight sync (see module docstring); one communicator per server."""

    name = "nccl"

    def __init__(self, servers: Sequence[ServerHandle], group_port: int = 51216, timeout_s: float = 240.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: int | None = None):
        if not torch.cuda.is_available():
            raise WeightTransportError("sync.transport nccl needs a CUDA learner; on CPU use sync.transport: inband")
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.servers = list(servers)
        self.client = httpx.Client(timeout=timeout_s)
        self.bucket_bytes = bucket_bytes
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.comms = []
        for i, s in enumerate(self.servers):
            resp = self.client.get(s.base_url + "/get_world_size/", headers=s.headers())
            server_world = int(_check(resp, s.base_url, "get_world_size")["world_size"])
            world = server_world + 1
            host = httpx.URL(s.base_url).host
            port = group_port + i
            resp = self.client.post(s.base_url + "/init_communicator/", headers=s.headers(),
                                    json={"host": "0.0.0.0" if host not in ("127.0.0.1", "localhost") else host,
                                          "port": port, "world_size": world})
            _check(resp, s.base_url, "init_communicator")
            time.sleep(0.1)
            group = StatelessProcessGroup.create(host=host, port=port, rank=server_world, world_size=world,
                                                 store_timeout=int(timeout_s))
            self.comms.append(PyNcclCommunicator(group, device=self.device))

    def _broadcast(self, i: int, tensor: torch.Tensor) -> None:
        comm = self.comms[i]
        comm.broadcast(tensor, src=comm.rank, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        comm.group.barrier()

    def _push_bucket(self, path: str, body: dict[str, Any], bucket: torch.Tensor) -> None:
        def one(s: ServerHandle) -> None:
            i = self.servers.index(s)
            _check(self.client.post(s.base_url + path, headers=s.headers(), json=body), s.base_url, path)
            self._broadcast(i, bucket)

        on_all(self.servers, one)

    def _post_all(self, path: str) -> None:
        on_all(self.servers, lambda s: _check(self.client.post(s.base_url + path, headers=s.headers()), s.base_url, path))

    def push_full(self, tensors: dict[str, torch.Tensor]) -> None:
        for names in plan_buckets(tensors, self.bucket_bytes):
            metas, bucket = flatten((n, tensors[n].to(self.device)) for n in names)
            self._push_bucket("/update_flattened_params/", {"metadatas": [m.model_dump() for m in metas]}, bucket)
        self._post_all("/process_weights_after_loading/")
        self._post_all("/reset_prefix_cache/")

    def push_adapter(self, adapter: AdapterWeights) -> None:
        metas, bucket = flatten((n, t.to(self.device)) for n, t in adapter.tensors.items())
        self._push_bucket("/update_adapter_flattened_param/",
                          {"peft_config": adapter.peft_config, "metadatas": [m.model_dump() for m in metas]}, bucket)
        self._post_all("/reset_prefix_cache/")

    def close(self) -> None:
        for s in self.servers:
            try:
                self.client.post(s.base_url + "/close_communicator/", headers=s.headers())
            except httpx.HTTPError as exc:
                log.warning("close_communicator on %s failed: %s", s.base_url, exc)
        self.comms = []
        self.client.close()
