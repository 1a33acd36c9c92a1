"""Server-mode rollout backend: a client of one or more rollout servers speaking ms-swift's protocol
(``swift rollout`` or ``python -m trainer serve``).

Contracts:
- learner world size W ≥ 1, S servers: each rank sends only its own requests, to the servers
  ``servers_for_rank(S, rank, W)`` (deterministic by global rank); within a rank, N requests are split into
  contiguous chunks of ``ceil(N / k)`` over its k servers, posted concurrently and reassembled in request
  order; N == 0 sends nothing; any server error fails the call, naming the server;
- requests are ms-swift ``RolloutInferRequest`` dicts (images as strings, ``<image>`` tags in the text, our
  sample id as ``uuid``) with a ``RequestConfig`` asking for token ids (``return_details``);
- sampling seeds: each request carries its own, ``request_seed(step seed, sample id)`` (the seed the colocate engine
  gives the same record), as ``data_dict["sampling_seed"]``, which our server decodes it with. A chunk's
  ``request_config.seed`` is its first request's seed: stock ``swift rollout`` ignores ``data_dict`` in single-turn
  rollouts and seeds request i of the chunk a worker gets with ``request_config.seed + i`` (its sync engine) or every
  request with ``request_config.seed`` (``--vllm_use_async_engine``), so its seeds differ from colocate's but stay
  deterministic per step and chunk;
- ``timeout_s`` bounds start-up health waits and control calls, ``infer_timeout_s`` each ``/infer/`` post;
- weight sync: rank 0 pushes to every server (``WeightSync`` adds the barrier), through our in-band HTTP
  transport or NCCL (``sync.transport``);
- faults: membership lives in one ``ServerFleet`` (``trainer.rollout.server_fleet``). A server whose chunk fails
  (or whose weight push fails) is quarantined: no rollouts, no weight pushes (NCCL: its communicator is dropped).
  A rank whose own servers are all quarantined borrows the other ranks' healthy servers. At each sync, quarantined
  servers that are due and answer ``/health/`` get the weights built for that sync pushed to them alone (NCCL: a
  fresh communicator) and serve again only once that succeeded (``sync_full`` / ``sync_adapter``);
- overlap (``async_rollouts``): ``generate_async`` runs a ``generate`` in a background thread. Every ``generate``
  holds a read lock for its whole run (retries included) and every sync a write lock (``begin_sync`` …
  ``end_sync`` on every rank, or the push alone): a push waits for the ``/infer/`` calls in flight and new calls
  wait for the push, so a request never straddles two weight versions. ``generate_async`` takes the read lock in
  the caller's thread before returning, so the weights it decodes with are those of the caller's last sync.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from trainer.data.images import canonical_png_base64, plain_rgb_file
from trainer.rollout.server_fleet import ServerFleet, servers_for_rank  # noqa: F401 - part of this module's API
from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.rollout.vllm_colocate import request_seed
from trainer.sync.http import server_http_client
from trainer.sync.transports import InbandTransport, NcclTransport, WeightTransport, WeightTransportError
from trainer.sync.weights import AdapterWeights, adapter_weights, changing_keys, full_weights
from trainer.telemetry import phase

log = logging.getLogger(__name__)

KEY = "custom.extra.rollout_matching.vllm.server"
#: the ``data_dict`` key of a request's own sampling seed (ms-swift's ``data_dict`` is free-form request data)
SEED_FIELD = "sampling_seed"


class RolloutServerError(RuntimeError):
    """A rollout server failed, timed out or answered something unusable."""


@dataclass(frozen=True)
class ServerEndpoint:
    base_url: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


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


def _as_sent(ref: str, inline: bool) -> str:
    """An image as the servers get it: its path (or, with ``inline``, its bytes as base64), unless a plain decoder
    (``swift rollout``'s ``Image.open().convert("RGB")``) would see other pixels than the learner trains on (an EXIF
    rotation, transparency, 16-bit grey): then the learner's pixels as base64 PNG, so every server decodes exactly
    them (the prompt's token count matches either way, so only this keeps the pixels alike)."""
    if not os.path.isfile(ref):
        return ref
    if not plain_rgb_file(ref):
        return canonical_png_base64(ref)
    if inline:
        with open(ref, "rb") as fh:
            return base64.b64encode(fh.read()).decode("ascii")
    return ref


def infer_request(req: RolloutRequest, inline_images: bool = False, seed: int | None = None) -> dict[str, Any]:
    """ms-swift ``RolloutInferRequest`` payload for ``req`` (JSON-serialisable); a ``seed`` goes in
    ``data_dict[SEED_FIELD]``."""
    messages, inline = [], []
    for m in req.messages:
        content, imgs = _content_to_swift(m.get("content"))
        messages.append({"role": m["role"], "content": content})
        inline.extend(imgs)
    images = inline  # exactly the images the messages place (a text model's prompt places none)
    images = [_as_sent(p, inline_images) for p in images]
    return {"messages": messages, "images": images, "audios": [], "videos": [], "tools": None, "objects": {},
            "chat_template_kwargs": {}, "data_dict": {} if seed is None else {SEED_FIELD: seed},
            "uuid": req.sample_id}


def request_config(params: DecodingParams) -> dict[str, Any]:
    """ms-swift ``RequestConfig`` payload; token ids requested with ``return_details``."""
    return {"max_tokens": params.max_new_tokens, "temperature": params.temperature if not params.greedy else 0.0,
            "top_k": params.top_k, "top_p": params.top_p, "repetition_penalty": params.repetition_penalty,
            "num_beams": 1, "stop": [], "seed": params.seed, "stream": False,
            "logprobs": params.logprobs is not None, "top_logprobs": params.logprobs or None, "n": 1,
            "return_details": True}


def logprobs_from_choice(choice: dict[str, Any], token_ids: list[int], sample_id: str,
                         url: str) -> tuple[dict[int, float], ...]:
    """``{token id: log-probability}`` of each new token from a choice's ``logprobs.content`` (one entry per token,
    in order, as ``swift rollout`` answers them; the entries name tokens by text, the ids come from ``token_ids``)."""
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list) or len(content) != len(token_ids):
        got = "none" if not isinstance(content, list) else f"{len(content)} entries"
        raise RolloutServerError(
            f"{url}: answer for sample {sample_id!r} carries {got} of logprobs.content for {len(token_ids)} new "
            "tokens; the learner asked for them (rollout_matching.mismatch.enabled): serve an engine that returns "
            "log-probabilities, or set rollout_matching.mismatch.enabled: false")
    try:
        return tuple({int(t): float(e["logprob"])} for t, e in zip(token_ids, content))
    except (TypeError, KeyError, ValueError) as exc:
        raise RolloutServerError(f"{url}: answer for sample {sample_id!r}: a logprobs.content entry has no numeric "
                                 "logprob") from exc


def result_from_item(req: RolloutRequest, item: dict[str, Any], url: str, logprobs: bool = False) -> RolloutResult:
    """Parse a ``RolloutOutput`` or bare ``ChatCompletionResponse`` item; with ``logprobs`` its per-token
    log-probabilities too."""
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
    lps = logprobs_from_choice(choice, token_ids, req.sample_id, url) if logprobs else None
    return RolloutResult(req.sample_id, tuple(prompt_ids), tuple(token_ids), finish, extra, logprobs=lps)


class WeightVersionLock:
    """Readers (``/infer/`` rounds) share, a writer (a weight push) excludes them; a waiting writer blocks new
    readers. Not owned by a thread: a reader taken in one thread may be released in another."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def acquire_read(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            self._writers_waiting -= 1
            self._writer = True

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()


class ServerRolloutEngine:
    """Rollout engine backed by rollout servers (see module docstring)."""

    name = "server"
    syncs_on_every_rank = False
    #: the servers get the image files (paths, or their bytes with ``inline_images``) and make their own prompt ids;
    #: a request's ``pixel_values`` are never read (the trainer may make them during the decode:
    #: ``vllm.pixels_during_decode``)
    reads_images = True

    def __init__(self, servers: Sequence[ServerEndpoint], *, timeout_s: float = 240.0,
                 infer_timeout_s: float | None = None, rank: int | None = None, world_size: int | None = None,
                 transport: str = "auto", group_port: int = 51216, bucket_bytes: int = 512 * 2**20,
                 inline_images: bool = False, wait: bool = True, max_retries: int = 1,
                 readmit_after_s: float | None = None, readmit_max_interval_s: float = 300.0,
                 clock: Any = time.monotonic, nccl_backend: str = "auto", shm_dir: str | None = None,
                 broadcast_timeout_s: float = 120.0,
                 resend_frozen: bool = False, merge_precision: str = "weight_dtype"):
        import torch.distributed as dist

        dist_on = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if dist_on else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if dist_on else 1)
        self.fleet = ServerFleet(servers, rank=self.rank, world_size=self.world_size, readmit_after_s=readmit_after_s,
                                 readmit_max_interval_s=readmit_max_interval_s, clock=clock,
                                 probe_timeout_s=min(5.0, timeout_s))
        self.fleet.on_quarantine.append(self._forget_connection)
        self.servers = self.fleet.servers
        self.mine = self.fleet.mine
        self.timeout_s = timeout_s
        self.infer_timeout_s = infer_timeout_s
        self.inline_images = inline_images
        self.client = server_http_client(timeout_s)
        self.transport_choice = transport
        self.group_port = group_port
        self.bucket_bytes = bucket_bytes
        self._transport: WeightTransport | None = None
        self._engine_types: list[dict[str, Any]] | None = None
        self.max_retries = max_retries
        self.nccl_backend = nccl_backend
        self.broadcast_timeout_s = broadcast_timeout_s
        self.shm_dir = shm_dir
        #: merged full syncs send the frozen weights (vision tower, norms, frozen base) to a server once: at its
        #: first full sync and again at every re-admission; ``resend_frozen`` sends them at every sync
        self.resend_frozen = resend_frozen
        self.merge_precision = merge_precision  # ``sync.merge_precision`` (``trainer.sync.weights.full_weights``)
        self._has_frozen: set[str] = set()
        self._frozen_keys: frozenset[str] | None = None  # what the servers in ``_has_frozen`` hold for good
        self._frozen_boot: dict[str, str | None] = {}  # url -> boot_id read before its latest whole push
        #: ``{"keys": n, "bytes": n, "full_to": [...], "changing_to": [...]}`` of the latest ``sync_full``
        self.last_full_push: dict[str, Any] = {}
        self.version_lock = WeightVersionLock()
        self._sync_held = False
        self._background: ThreadPoolExecutor | None = None
        self._posts: ThreadPoolExecutor | None = None  # chunk posts beyond the first (see ``_post_all``)
        self._posts_lock = threading.Lock()
        if wait:
            self.wait_healthy(timeout_s)

    @property
    def quarantined(self) -> frozenset[str]:
        return self.fleet.quarantined

    @property
    def readmissions(self) -> list[dict[str, Any]]:
        return self.fleet.readmissions

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
        """One ``/infer/`` call; ``cfg["seed"]`` is the step's seed, each request gets its ``request_seed``."""
        url = server.base_url
        seeds = [request_seed(cfg.get("seed"), r.sample_id) for r in chunk]
        body = {"infer_requests": [infer_request(r, self.inline_images, s) for r, s in zip(chunk, seeds)],
                "request_config": {**cfg, "seed": seeds[0]}, "metrics": None, "use_tqdm": None,
                "adapter_request": None}
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
        return [result_from_item(r, it, url, bool(cfg.get("logprobs"))) for r, it in zip(chunk, items)]

    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        """Chunk over this rank's healthy servers; a failed chunk is re-chunked deterministically over the servers
        that are still healthy, up to ``max_retries`` rounds. A failed server is quarantined (it may come back
        with stale weights) until a sync re-admits it. Exhausted → ``RolloutServerError`` naming servers and
        sample ids. Results keep request order."""
        if not requests:
            return []
        self.version_lock.acquire_read()
        try:
            return self._generate(requests, params)
        finally:
            self.version_lock.release_read()

    def generate_async(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> Future:
        """``generate`` in a background thread (one at a time, in order). The read lock is taken here, before
        returning, so the decode runs on the weights of this caller's last sync, whenever the thread starts."""
        requests = list(requests)
        return self._submit(lambda: requests, params, keep_requests=False)

    def generate_async_built(self, build: Callable[[], Sequence[RolloutRequest]], params: DecodingParams) -> Future:
        """``generate_async`` whose requests ``build()`` makes in the background thread first (the chat template and
        the image processor then overlap the caller's work instead of delaying it); the future's result is
        ``(requests, results)``. The read lock is taken here, as in ``generate_async``."""
        return self._submit(build, params, keep_requests=True)

    def _submit(self, build: Callable[[], Sequence[RolloutRequest]], params: DecodingParams,
                keep_requests: bool) -> Future:
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-prefetch")
        self.version_lock.acquire_read()

        def run():
            try:
                requests = list(build())
                results = self._generate(requests, params) if requests else []
                return (requests, results) if keep_requests else results
            finally:
                self.version_lock.release_read()

        try:
            return self._background.submit(run)
        except BaseException:
            self.version_lock.release_read()
            raise

    def _generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        cfg = request_config(params)
        results: list[RolloutResult | None] = [None] * len(requests)
        pending = list(range(len(requests)))
        failures: list[str] = []
        for _ in range(self.max_retries + 1):
            healthy = self.fleet.healthy_for_rank()
            if not healthy:
                break
            spans = contiguous_chunks(len(pending), len(healthy))
            work = [(s, pending[a:b]) for s, (a, b) in zip(healthy, spans) if b > a]
            for (server, idx), (answer, error) in zip(work, self._post_all(work, requests, cfg)):
                if error is not None:
                    failures.append(str(error))
                    self.fleet.quarantine(server.base_url, str(error))
                    continue
                for i, res in zip(idx, answer):
                    results[i] = res
            pending = [i for i in pending if results[i] is None]
            if not pending:
                return [r for r in results if r is not None]
        ids = [requests[i].sample_id for i in pending]
        raise RolloutServerError(
            f"rollouts failed for {len(ids)} sample(s) {ids[:10]}{' …' if len(ids) > 10 else ''} after "
            f"{self.max_retries} retr{'y' if self.max_retries == 1 else 'ies'} ({KEY}.max_retries); "
            f"quarantined servers: {sorted(self.quarantined)}; errors: " + "; ".join(failures))

    def _post_all(self, work: list[tuple[ServerEndpoint, list[int]]], requests: Sequence[RolloutRequest],
                  cfg: dict[str, Any]) -> list[tuple[list[RolloutResult] | None, BaseException | None]]:
        """Post the chunks concurrently: the first from this thread, the others from a pool kept for the engine's
        lifetime (no threads started per call; one thread hand-off less on the path of every decode)."""
        def post(server: ServerEndpoint, idx: list[int]) -> tuple[list[RolloutResult] | None, BaseException | None]:
            try:
                return self._post_infer(server, [requests[i] for i in idx], cfg), None
            except Exception as exc:  # noqa: BLE001 - reported per chunk, as a failed future was
                return None, exc

        if len(work) > 1 and self._posts is None:
            with self._posts_lock:
                if self._posts is None:
                    self._posts = ThreadPoolExecutor(max_workers=2 * len(self.servers), thread_name_prefix="rollout-post")
        futures = [self._posts.submit(post, s, idx) for s, idx in work[1:]] if len(work) > 1 else []
        first = [post(*work[0])] if work else []
        return first + [f.result() for f in futures]

    def _forget_connection(self, url: str) -> None:
        if self._transport is not None:
            self._transport.disconnect(url)

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
            if choice == "nccl":
                self._transport = NcclTransport(self.servers, self.group_port, self.timeout_s, self.bucket_bytes,
                                                backend=self.nccl_backend,
                                                broadcast_timeout_s=self.broadcast_timeout_s)
            elif choice == "inband":
                self._transport = InbandTransport(timeout_s=max(self.timeout_s, 600.0), shm_dir=self.shm_dir)
            else:
                raise ValueError(f"unknown weight transport {choice!r}; use auto, nccl or inband")
            log.info("weight transport: %s", self._transport.name)
        return self._transport

    # -- weight sync (rank 0 pushes; membership from the fleet) ----------------------------------------------------
    def begin_sync(self) -> None:
        """Every rank, before a sync: wait for this rank's ``/infer/`` calls in flight (and hold new ones back until
        ``end_sync``), then pool the ranks' quarantines on rank 0 (it pushes to none of them)."""
        if not self._sync_held:
            with phase("sync_wait_decodes"):
                self.version_lock.acquire_write()
            self._sync_held = True
        self.fleet.pool_on_rank0()

    def end_sync(self) -> None:
        """Every rank, after a sync: adopt rank 0's membership (its pushes and re-admissions)."""
        try:
            self.fleet.adopt_rank0()
        finally:
            if self._sync_held:
                self._sync_held = False
                self.version_lock.release_write()

    def _exclusive(self):
        """The write lock for a push made outside ``begin_sync`` / ``end_sync`` (a no-op inside)."""
        if self._sync_held:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def held():
            self.version_lock.acquire_write()
            try:
                yield
            finally:
                self.version_lock.release_write()
        return held()

    def _push(self, push: Callable[[WeightTransport, list[ServerEndpoint]], dict[str, str]], what: str) -> None:
        """Push to the healthy servers; those it failed on are quarantined (the others got the whole update).
        Raises ``WeightTransportError`` only when it failed on every server it was sent to (a config problem or a
        refused update, usually)."""
        targets = self.fleet.healthy()
        failed = push(self.transport(), targets)
        for url, err in failed.items():
            self.fleet.quarantine(url, f"{what} failed: {err}")
        if targets and len(failed) >= len(targets):
            raise WeightTransportError(f"{what} failed on every rollout server: "
                                       + "; ".join(f"{u}: {e}" for u, e in failed.items()), failed)

    def sync_full(self, model: torch.nn.Module, merge_adapter: bool = True) -> None:
        """Every weight to a server that may lack the frozen ones, only ``changing_keys`` to the others (unless
        ``resend_frozen``); a base sync (``merge_adapter`` false) is always whole. A server holds the frozen weights
        once a whole push to it succeeded, for as long as it answers with the ``boot_id`` read just before that push
        (``ServerFleet.boot_ids``): a restarted process loaded its checkpoint's weights again, even when no request
        failed in between. A re-admitted server gets every weight, and again at its next sync (where its identity is
        read)."""
        with phase("sync_collect", device_work=True):
            tensors = full_weights(model, merge_adapter=merge_adapter, merge_precision=self.merge_precision)
        changing = None
        if merge_adapter and not self.resend_frozen:
            keys = changing_keys(model, merge_adapter=True)
            changing = {k: v for k, v in tensors.items() if k in keys}
            frozen = frozenset(tensors) - keys
            if not frozen:  # everything trains (a full fine-tune): every push is whole
                changing = None
            if self._frozen_keys is None or not frozen <= self._frozen_keys:
                self._has_frozen.clear()  # a key frozen now was pushed as changing (or never): every server needs it
            self._frozen_keys = frozen
        with self._exclusive():  # the lock is begin_sync's (waited for there) inside a sync
            healthy = self.fleet.healthy()
            boots: dict[str, str | None] = {}
            if changing is not None:
                with phase("sync_identity"):
                    boots = self.fleet.boot_ids([s.base_url for s in healthy])
            self._has_frozen = {u for u in self._has_frozen if u in boots and boots[u] == self._frozen_boot.get(u)}
            whole = [s for s in healthy if changing is None or s.base_url not in self._has_frozen]
            partial = [s for s in healthy if changing is not None and s.base_url in self._has_frozen]
            failed: dict[str, str] = {}
            with phase("sync_push"):
                if whole:
                    failed.update(self.transport().push_full(tensors, whole))
                if partial:
                    failed.update(self.transport().push_full(changing, partial))
            for url, err in failed.items():
                self.fleet.quarantine(url, f"full weight push failed: {err}")
            if healthy and len(failed) >= len(healthy):
                raise WeightTransportError("full weight push failed on every rollout server: "
                                           + "; ".join(f"{u}: {e}" for u, e in failed.items()), failed)
            for url in ({s.base_url for s in whole} - set(failed)) & set(boots):
                self._has_frozen.add(url)
                self._frozen_boot[url] = boots[url]
            sent = changing if partial and not whole else tensors
            self.last_full_push = {"keys": len(sent), "bytes": sum(t.numel() * t.element_size() for t in sent.values()),
                                   "whole_to": [s.base_url for s in whole],
                                   "changing_to": [s.base_url for s in partial],
                                   "changing_keys": len(changing) if changing is not None else len(tensors)}
            with phase("sync_push"):
                self._readmit_due("full" if merge_adapter else "base", full=tensors)

    def sync_adapter(self, model: torch.nn.Module) -> None:
        adapter = adapter_weights(model)
        with self._exclusive():
            self._push(lambda t, targets: t.push_adapter(adapter, targets), "adapter push")
            self._readmit_due("adapter", adapter=adapter, base=lambda: full_weights(model, merge_adapter=False))

    def _readmit_due(self, mode: str, full: dict[str, torch.Tensor] | None = None, adapter: AdapterWeights | None = None,
                     base: Callable[[], dict[str, torch.Tensor]] | None = None) -> list[str]:
        """Quarantined servers that are due and answer get this sync's weights alone (``full``; adapter mode: the
        base built once, then ``adapter``) and are re-admitted when that succeeded; otherwise they back off."""
        urls = self.fleet.due_and_answering()
        if not urls:
            return []
        transport = self.transport()
        if full is None and base is not None:
            full = base()
        done = []
        for url in urls:
            server = self.fleet.endpoint(url)
            t0 = time.monotonic()
            transport.disconnect(url)
            failed = transport.push_full(full, [server]) if full is not None else {}
            if not failed and adapter is not None:
                failed = transport.push_adapter(adapter, [server])
            if failed:
                transport.disconnect(url)
                self.fleet.back_off(url)
                probe = self.fleet.probe_of(url)
                log.warning("rollout server %s answers again but its weight re-sync failed, so it stays quarantined "
                            "(next try in %.0fs): %s", url, probe.wait if probe else 0.0, failed[url])
                continue
            seconds = round(time.monotonic() - t0, 3)
            self.fleet.readmit(url, mode=mode, transport=transport.name, seconds=seconds)
            log.warning("rollout server %s re-admitted after a full weight re-sync (%s, %s transport, %.1fs)",
                        url, mode, transport.name, seconds)
            done.append(url)
        return done

    def metadata(self) -> dict[str, Any]:
        return {"servers": [s.base_url for s in self.servers], "servers_this_rank": [s.base_url for s in self.mine],
                "rank": self.rank, "world_size": self.world_size,
                "transport": self._transport.name if self._transport else self.transport_choice,
                "max_retries": self.max_retries, **self.fleet.metadata()}

    def close(self) -> None:
        if self._background is not None:
            self._background.shutdown(wait=True, cancel_futures=True)
            self._background = None
        if self._posts is not None:
            self._posts.shutdown(wait=True, cancel_futures=True)
            self._posts = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self.fleet.close()
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
        transport=sync.transport, nccl_backend=sync.nccl_backend, group_port=sync.group_port, shm_dir=sync.shm_dir,
        broadcast_timeout_s=sync.broadcast_timeout_s,
        bucket_bytes=sync.bucket_mb * 2**20, resend_frozen=sync.resend_frozen, merge_precision=sync.merge_precision,
        max_retries=v.server.max_retries, readmit_after_s=v.server.readmit_after_s,
        readmit_max_interval_s=v.server.readmit_max_interval_s)
    log.info("rollout servers %s (this rank: %s), sync.mode %s, fallback_to_full %s, rollout seed %s",
             engine.metadata()["servers"], engine.metadata()["servers_this_rank"], sync.mode, sync.fallback_to_full,
             rm.decoding.seed)
    return engine
