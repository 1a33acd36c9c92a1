"""Server-mode rollout backend: a client of one or more rollout servers speaking ms-swift's protocol
(``swift rollout`` or ``python -m trainer serve``).

Contracts:
- learner world size W ≥ 1, S servers: each rank sends only its own requests, to the servers
  ``servers_for_rank(S, rank, W)`` (deterministic by global rank); within a rank, N requests are split into
  contiguous chunks of ``ceil(N / k)`` over its k servers, posted concurrently and reassembled in request
  order; N == 0 sends nothing; any server error fails the call, naming the server;
- requests are ms-swift ``RolloutInferRequest`` dicts (images as strings, ``<image>`` tags in the text, our
  sample id as ``uuid``) with a ``RequestConfig`` asking for token ids (``return_details``);
- ``timeout_s`` bounds start-up health waits and control calls, ``infer_timeout_s`` each ``/infer/`` post;
- weight sync: rank 0 pushes to every server (``WeightSync`` adds the barrier), through our in-band HTTP
  transport or NCCL (``sync.transport``);
- faults: a server whose chunk fails (or whose weight push fails) is quarantined: it gets no rollouts and no
  weight pushes (NCCL: dropped from the collective group). A rank whose own servers are all quarantined borrows the
  other ranks' healthy servers (deterministic order) instead of failing. With ``readmit_after_s`` set, a quarantined server is
  probed on ``/health/`` at weight-sync points, first ``readmit_after_s`` after the failure, then with the wait
  doubling up to ``readmit_max_interval_s``; once it answers, ``WeightSync`` pushes it the full current weights
  alone (in-band: one POST; NCCL: a fresh communicator first) and only then does it serve rollouts again.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.sync.transports import InbandTransport, NcclTransport, WeightTransport, WeightTransportError
from trainer.sync.weights import adapter_weights, full_weights

log = logging.getLogger(__name__)

KEY = "custom.extra.rollout_matching.vllm.server"


class RolloutServerError(RuntimeError):
    """A rollout server failed, timed out or answered something unusable."""


@dataclass(frozen=True)
class ServerEndpoint:
    base_url: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def servers_for_rank(num_servers: int, rank: int, world_size: int) -> list[int]:
    """Server indices rank ``rank`` of ``world_size`` sends to: every W-th server starting at ``rank`` when
    there are at least as many servers as ranks, else the single server ``rank % S``."""
    if num_servers < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad topology: {num_servers} servers, rank {rank} of {world_size}")
    if num_servers >= world_size:
        return list(range(rank, num_servers, world_size))
    return [rank % num_servers]


def contiguous_chunks(n: int, k: int) -> list[tuple[int, int]]:
    """ms-swift's split: ``k`` spans ``[start, end)`` of size ``ceil(n / k)`` (trailing spans may be empty)."""
    if k < 1:
        raise ValueError("need at least one server")
    size = math.ceil(n / k) if n else 0
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(k)]


def _content_to_swift(content: Any) -> tuple[Any, list[str]]:
    """Content parts → ms-swift's string form with ``<image>`` tags, and the images in order."""
    if not isinstance(content, list):
        return content, []
    text, images = [], []
    for part in content:
        if part.get("type") == "image":
            text.append("<image>")
            ref = part.get("image")
            if isinstance(ref, str):
                images.append(ref)
        elif part.get("type") == "text":
            text.append(part.get("text", ""))
        else:
            raise ValueError(f"unsupported message content part type {part.get('type')!r}")
    return "".join(text), images


def infer_request(req: RolloutRequest, inline_images: bool = False) -> dict[str, Any]:
    """ms-swift ``RolloutInferRequest`` payload for ``req`` (JSON-serialisable)."""
    messages, inline = [], []
    for m in req.messages:
        content, imgs = _content_to_swift(m.get("content"))
        messages.append({"role": m["role"], "content": content})
        inline.extend(imgs)
    images = list(req.images) or inline
    if inline_images:
        images = [base64.b64encode(open(p, "rb").read()).decode("ascii") if os.path.isfile(p) else p for p in images]
    return {"messages": messages, "images": images, "audios": [], "videos": [], "tools": None, "objects": {},
            "chat_template_kwargs": {}, "data_dict": {}, "uuid": req.sample_id}


def request_config(params: DecodingParams) -> dict[str, Any]:
    """ms-swift ``RequestConfig`` payload; token ids requested with ``return_details``."""
    return {"max_tokens": params.max_new_tokens, "temperature": params.temperature if not params.greedy else 0.0,
            "top_k": params.top_k, "top_p": params.top_p, "repetition_penalty": params.repetition_penalty,
            "num_beams": 1, "stop": [], "seed": params.seed, "stream": False, "logprobs": False,
            "top_logprobs": None, "n": 1, "return_details": True}


def result_from_item(req: RolloutRequest, item: dict[str, Any], url: str) -> RolloutResult:
    """Parse a ``RolloutOutput`` or bare ``ChatCompletionResponse`` item."""
    response = item.get("response", item) if isinstance(item, dict) else None
    try:
        choice = response["choices"][0]
        prompt_ids = response["prompt_token_ids"]
        token_ids = choice["token_ids"]
    except (TypeError, KeyError, IndexError) as exc:
        raise RolloutServerError(f"{url}: answer for sample {req.sample_id!r} lacks prompt_token_ids/choices[0].token_ids "
                                 "(server must honour request_config.return_details)") from exc
    if prompt_ids is None or token_ids is None:
        raise RolloutServerError(f"{url}: answer for sample {req.sample_id!r} has no token ids; request return_details")
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    extra = dict(item.get("rollout_infos") or {}) if "response" in item else {}
    extra["server"] = url
    return RolloutResult(req.sample_id, tuple(prompt_ids), tuple(token_ids), finish, extra)


class ServerRolloutEngine:
    """Rollout engine backed by rollout servers (see module docstring)."""

    name = "server"
    syncs_on_every_rank = False

    def __init__(self, servers: Sequence[ServerEndpoint], *, timeout_s: float = 240.0,
                 infer_timeout_s: float | None = None, rank: int | None = None, world_size: int | None = None,
                 transport: str = "auto", group_port: int = 51216, bucket_bytes: int = 512 * 2**20,
                 inline_images: bool = False, wait: bool = True, max_retries: int = 1,
                 readmit_after_s: float | None = None, readmit_max_interval_s: float = 300.0,
                 clock: Any = time.monotonic, nccl_backend: str = "auto"):
        import torch.distributed as dist

        if not servers:
            raise ValueError(f"{KEY}.servers: at least one server is needed")
        dist_on = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if dist_on else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if dist_on else 1)
        self.servers = list(servers)
        self.mine = [self.servers[i] for i in servers_for_rank(len(self.servers), self.rank, self.world_size)]
        self.timeout_s = timeout_s
        self.infer_timeout_s = infer_timeout_s
        self.inline_images = inline_images
        self.client = httpx.Client(timeout=timeout_s)
        self.transport_choice = transport
        self.group_port = group_port
        self.bucket_bytes = bucket_bytes
        self._transport: WeightTransport | None = None
        self._engine_types: list[dict[str, Any]] | None = None
        self.max_retries = max_retries
        self.quarantined: set[str] = set()
        self.readmit_after_s = readmit_after_s
        self.readmit_max_interval_s = max(readmit_max_interval_s, readmit_after_s or 0.0)
        self._probe: dict[str, tuple[float, float]] = {}  # url -> (next probe time, current wait)
        self.readmissions: list[dict[str, Any]] = []
        self.nccl_backend = nccl_backend
        self.clock = clock
        if wait:
            self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Block until every server answers ``/health/`` with 200, or fail after ``timeout_s`` naming the rest."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.servers)
        last_error: dict[str, str] = {}
        while pending:
            still = []
            for s in pending:
                try:
                    r = self.client.get(s.base_url + "/health/", timeout=min(5.0, timeout_s))
                    if r.status_code == 200:
                        continue
                    last_error[s.base_url] = f"HTTP {r.status_code}"
                except httpx.HTTPError as exc:
                    last_error[s.base_url] = type(exc).__name__
                still.append(s)
            pending = still
            if pending and time.monotonic() >= deadline:
                detail = ", ".join(f"{s.base_url} ({last_error.get(s.base_url)})" for s in pending)
                raise RolloutServerError(
                    f"rollout servers not healthy after {timeout_s:.0f}s ({KEY}.timeout_s): {detail}; start them "
                    "(python -m trainer serve / swift rollout) or fix the server list"
                )
            if pending:
                time.sleep(poll_s)

    def _post_infer(self, server: ServerEndpoint, chunk: Sequence[RolloutRequest], cfg: dict[str, Any]) -> list[RolloutResult]:
        url = server.base_url
        body = {"infer_requests": [infer_request(r, self.inline_images) for r in chunk], "request_config": cfg,
                "metrics": None, "use_tqdm": None, "adapter_request": None}
        try:
            resp = self.client.post(url + "/infer/", json=body, headers=server.headers(),
                                    timeout=httpx.Timeout(self.timeout_s, read=self.infer_timeout_s))
        except httpx.TimeoutException as exc:
            raise RolloutServerError(f"{url}: /infer/ with {len(chunk)} requests timed out "
                                     f"({KEY}.infer_timeout_s={self.infer_timeout_s}); the server may be stalled or "
                                     "overloaded") from exc
        except httpx.HTTPError as exc:
            raise RolloutServerError(f"{url}: /infer/ failed: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise RolloutServerError(f"{url}: /infer/ answered HTTP {resp.status_code}: {resp.text[:500]}")
        items = resp.json()
        if not isinstance(items, list) or len(items) != len(chunk):
            got = len(items) if isinstance(items, list) else type(items).__name__
            raise RolloutServerError(f"{url}: /infer/ returned {got} items for {len(chunk)} requests")
        return [result_from_item(r, it, url) for r, it in zip(chunk, items)]

    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        """Chunk over this rank's healthy servers; a failed chunk is re-chunked deterministically over the servers
        that are still healthy, up to ``max_retries`` rounds. A failed server is quarantined (it may come back
        with stale weights) until ``WeightSync`` re-syncs and re-admits it (``readmit_after_s``). Exhausted → ``RolloutServerError`` naming servers and
        sample ids. Results keep request order."""
        if not requests:
            return []
        cfg = request_config(params)
        results: list[RolloutResult | None] = [None] * len(requests)
        pending = list(range(len(requests)))
        failures: list[str] = []
        for _ in range(self.max_retries + 1):
            healthy = self._healthy_servers()
            if not healthy:
                break
            spans = contiguous_chunks(len(pending), len(healthy))
            work = [(s, pending[a:b]) for s, (a, b) in zip(healthy, spans) if b > a]
            with ThreadPoolExecutor(max_workers=len(work)) as pool:
                futures = [pool.submit(self._post_infer, s, [requests[i] for i in idx], cfg) for s, idx in work]
            for (server, idx), fut in zip(work, futures):
                if fut.exception() is not None:
                    failures.append(str(fut.exception()))
                    self._quarantine(server, str(fut.exception()))
                    continue
                for i, res in zip(idx, fut.result()):
                    results[i] = res
            pending = [i for i in pending if results[i] is None]
            if not pending:
                return [r for r in results if r is not None]
        ids = [requests[i].sample_id for i in pending]
        raise RolloutServerError(
            f"rollouts failed for {len(ids)} sample(s) {ids[:10]}{' …' if len(ids) > 10 else ''} after "
            f"{self.max_retries} retr{'y' if self.max_retries == 1 else 'ies'} ({KEY}.max_retries); "
            f"quarantined servers: {sorted(self.quarantined)}; errors: " + "; ".join(failures))

    def _healthy_servers(self) -> list[ServerEndpoint]:
        """This rank's healthy servers; when all of them are quarantined, the healthy servers of the other ranks
        (they receive the same weight pushes), so one rank's faults never stop it while others can serve."""
        own = [s for s in self.mine if s.base_url not in self.quarantined]
        if own:
            return own
        borrowed = [s for s in self.servers if s.base_url not in self.quarantined]
        if borrowed:
            log.warning("rank %d: all of its rollout servers are quarantined; borrowing %s", self.rank,
                        [s.base_url for s in borrowed])
        return borrowed

    def _endpoint(self, url: str) -> ServerEndpoint:
        return next(s for s in self.servers if s.base_url == url)

    def _quarantine(self, server: ServerEndpoint, reason: str = "") -> None:
        if server.base_url in self.quarantined:
            return
        when = (f"probed for re-admission in {self.readmit_after_s:g}s ({KEY}.readmit_after_s)"
                if self.readmit_after_s else f"for the rest of the run ({KEY}.readmit_after_s is off)")
        log.warning("quarantining rollout server %s (%s): no rollouts or weight pushes until re-admitted; %s",
                    server.base_url, reason[:300] or "failed", when)
        self.quarantined.add(server.base_url)
        if self.readmit_after_s:
            self._probe[server.base_url] = (self.clock() + self.readmit_after_s, self.readmit_after_s)
        if self._transport is not None:
            self._transport.drop(server.base_url)

    def set_quarantined(self, urls: set[str] | Sequence[str]) -> None:
        """Adopt a quarantine set decided elsewhere (rank 0 in a multi-rank learner): new members are quarantined,
        missing ones re-admitted (rank 0 re-synced them)."""
        urls = set(urls)
        known = {s.base_url for s in self.servers}
        for url in sorted(urls - self.quarantined):
            if url in known:
                self._quarantine(self._endpoint(url), "failed on another learner rank")
        for url in sorted(self.quarantined - urls):
            self._readmitted(url)

    def _readmitted(self, url: str) -> None:
        self.quarantined.discard(url)
        self._probe.pop(url, None)
        transport = self._transport
        if transport is not None and url not in {s.base_url for s in transport.servers}:
            transport.readmit(self._endpoint(url))

    def answering_quarantined(self) -> list[str]:
        """Quarantined servers due for a probe that answer ``/health/`` now (they still need a re-sync); a probe
        that fails doubles the wait, up to ``readmit_max_interval_s``."""
        if not self.readmit_after_s:
            return []
        now = self.clock()
        answering = []
        for url in sorted(self.quarantined):
            due, wait = self._probe.get(url, (now, self.readmit_after_s))
            if due > now:
                continue
            try:
                ok = self.client.get(url + "/health/", timeout=min(5.0, self.timeout_s)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                answering.append(url)
            else:
                wait = min(wait * 2, self.readmit_max_interval_s)
                self._probe[url] = (now + wait, wait)
                log.info("quarantined rollout server %s still down; next probe in %.0fs", url, wait)
        return answering

    def resync_and_readmit(self, urls: Sequence[str], model: torch.nn.Module, mode: str) -> list[str]:
        """Push the current weights to each of ``urls`` alone (``mode`` full: merged weights; adapter: base +
        adapter); each server that took them is re-admitted. A failure keeps the server quarantined (logged, next
        probe after the backed-off wait). Returns the re-admitted urls."""
        if not urls:
            return []
        transport = self.transport()
        full = full_weights(model, merge_adapter=(mode == "full"))
        adapter = adapter_weights(model) if mode == "adapter" else None
        done = []
        for url in urls:
            server = self._endpoint(url)
            t0 = time.monotonic()
            try:
                transport.readmit(server)
                transport.push_full(full, only=[url])
                if adapter is not None:
                    transport.push_adapter(adapter, only=[url])
            except Exception as exc:  # noqa: BLE001 - any failure: the server stays quarantined
                transport.drop(url)
                _, wait = self._probe.get(url, (0.0, self.readmit_after_s or 1.0))
                wait = min(wait * 2, self.readmit_max_interval_s)
                self._probe[url] = (self.clock() + wait, wait)
                log.warning("rollout server %s answers again but its weight re-sync failed, so it stays quarantined "
                            "(next try in %.0fs): %s", url, wait, exc)
                continue
            self._readmitted(url)
            self.readmissions.append({"server": url, "mode": mode, "transport": transport.name,
                                      "seconds": round(time.monotonic() - t0, 3)})
            log.warning("rollout server %s re-admitted after a full weight re-sync (%s, %s transport, %.1fs)",
                        url, mode, transport.name, time.monotonic() - t0)
            done.append(url)
        return done

    def engine_types(self) -> list[dict[str, Any]]:
        if self._engine_types is None:
            out = []
            for s in self.servers:
                r = self.client.post(s.base_url + "/get_engine_type/", headers=s.headers())
                if r.status_code != 200:
                    raise RolloutServerError(f"{s.base_url}: /get_engine_type/ answered HTTP {r.status_code}: {r.text[:300]}")
                out.append(r.json())
            self._engine_types = out
        return self._engine_types

    def supports_adapter_sync(self) -> bool:
        return all(bool(t.get("enable_lora")) for t in self.engine_types())

    def transport(self) -> WeightTransport:
        if self._transport is None:
            choice = self.transport_choice
            if choice == "auto":
                choice = "nccl" if torch.cuda.is_available() else "inband"
            live = [s for s in self.servers if s.base_url not in self.quarantined]
            if choice == "nccl":
                transport: WeightTransport = NcclTransport(live, self.group_port, self.timeout_s, self.bucket_bytes,
                                                           backend=self.nccl_backend)
            elif choice == "inband":
                transport = InbandTransport(live, timeout_s=max(self.timeout_s, 600.0))
            else:
                raise ValueError(f"unknown weight transport {choice!r}; use auto, nccl or inband")
            self._transport = transport
            log.info("weight transport: %s to %s", transport.name, [s.base_url for s in live])
        return self._transport

    def _push(self, fn) -> None:
        """Push to the active servers; servers the push failed on are quarantined (the others got the whole
        update). Raises only when it failed on every server it was sent to (a config problem, usually)."""
        transport = self.transport()
        sent = len(transport.servers)
        try:
            fn(transport)
        except WeightTransportError as exc:
            if not exc.failed:
                raise
            for url in exc.failed:
                self._quarantine(self._endpoint(url), f"weight push failed: {exc.failed[url]}")
            if len(exc.failed) >= sent:
                raise

    def sync_full(self, model: torch.nn.Module, merge_adapter: bool = True) -> None:
        tensors = full_weights(model, merge_adapter=merge_adapter)
        self._push(lambda t: t.push_full(tensors))

    def sync_adapter(self, model: torch.nn.Module) -> None:
        adapter = adapter_weights(model)
        self._push(lambda t: t.push_adapter(adapter))

    def metadata(self) -> dict[str, Any]:
        return {"servers": [s.base_url for s in self.servers], "servers_this_rank": [s.base_url for s in self.mine],
                "rank": self.rank, "world_size": self.world_size,
                "transport": self._transport.name if self._transport else self.transport_choice,
                "max_retries": self.max_retries, "readmit_after_s": self.readmit_after_s,
                "quarantined": sorted(self.quarantined), "readmissions": list(self.readmissions)}

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self.client.close()


def endpoints_from_config(server_cfg) -> list[ServerEndpoint]:
    """``vllm.server`` → endpoints; API keys are read from the named environment variables."""
    if server_cfg.servers:
        out = []
        for i, s in enumerate(server_cfg.servers):
            key = None
            if s.api_key_env:
                key = os.environ.get(s.api_key_env)
                if not key:
                    raise ValueError(f"{KEY}.servers[{i}].api_key_env: environment variable {s.api_key_env} is unset")
            out.append(ServerEndpoint(s.base_url.rstrip("/"), key))
        return out
    return [ServerEndpoint(u) for u in server_cfg.base_urls()]


def engine_from_config(rm, loaded, model) -> ServerRolloutEngine:
    v = rm.vllm
    sync = v.sync
    engine = ServerRolloutEngine(
        endpoints_from_config(v.server), timeout_s=v.server.timeout_s, infer_timeout_s=v.server.infer_timeout_s,
        transport=sync.transport, nccl_backend=sync.nccl_backend, group_port=sync.group_port,
        bucket_bytes=sync.bucket_mb * 2**20,
        max_retries=v.server.max_retries, readmit_after_s=v.server.readmit_after_s,
        readmit_max_interval_s=v.server.readmit_max_interval_s)
    log.info("rollout servers %s (this rank: %s), sync.mode %s, fallback_to_full %s, rollout seed %s",
             engine.metadata()["servers"], engine.metadata()["servers_this_rank"], sync.mode, sync.fallback_to_full,
             rm.decoding.seed)
    return engine
