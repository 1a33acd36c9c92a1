"""FastAPI app speaking ms-swift's rollout protocol (``swift rollout``) in front of a server engine.

Endpoints: see ``docs/reference/rollout-protocol.md``. Ours, marked ``/rm/``:
``POST /rm/update_weights_inband/?kind=full|adapter`` (body: safetensors bytes; adapters carry their peft
config as the ``peft_config`` metadata entry) — the CPU-capable weight transport — and ``GET /rm/info/``.

Engine calls run one at a time on a worker thread. As in ``swift rollout``, the NCCL update endpoints answer
at once and receive in the background (the client broadcasts after the answer); a failure there is reported
by the next call that waits (``/process_weights_after_loading/``, ``/infer/``, ...).

An engine failure that leaves the engine dead (``trainer.server.fatal.fatal_engine_error``: vLLM's
``EngineDeadError``, a CUDA error other than out-of-memory) answers that call and every later engine call 503 with
``detail`` saying the engine is dead and the process is exiting, ``/health/`` answers 503, and ``on_engine_death``
(given by ``python -m trainer serve``: close the engine, exit with ``EXIT_ENGINE_DEAD``) is called once.

Every weight update is checked by the engine before any served weight changes (``trainer.sync.update_check``);
a refused one (``WeightUpdateRefused``: unknown name, shape, dtype, non-finite values) answers HTTP 422 with
``detail`` naming the tensor and the reason (plus ``tensor`` and ``reason`` fields), also when the refusal
happened in a background NCCL receive (then on the next waiting call, once); the old weights keep serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from trainer.rollout.server_client import SEED_FIELD
from trainer.rollout.types import DecodingParams
from trainer.rollout.vllm_colocate import request_seed
from trainer.server.codec import EngineRequestError
from trainer.server.engines import ServerEngine
from trainer.server.fatal import EngineDead, dead_detail, fatal_engine_error
from trainer.server.metrics import CONTENT_TYPE_LATEST, RequestCounterMiddleware, ServerMetrics
from trainer.server.protocol import (
    InferBody,
    InitCommunicatorBody,
    RequestConfigIn,
    UpdateAdapterFlattenedBody,
    UpdateAdapterParamBody,
    UpdateFlattenedParamsBody,
    UpdateNamedParamBody,
    UpdateWeightsShmBody,
    logprobs_content,
    rollout_output,
)
from trainer.sync import wire
from trainer.sync.nccl import offered_wire_backends
from trainer.sync.shm_staging import SHM_PATH, ShmReader, ShmUpdateError
from trainer.sync.transports import INBAND_PATH
from trainer.sync.update_check import WeightUpdateRefused
from trainer.sync.weights import AdapterWeights

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 * 2**20
DEFAULT_MAX_INBAND_BYTES = 4 * 2**30


class BodyTooLarge(HTTPException):
    """Raised while a body streams in past its limit; an ``HTTPException`` so FastAPI's body parsing re-raises it
    (as 413) instead of turning it into a generic 400."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds this endpoint's limit of {limit} bytes")


class BodyLimitMiddleware:
    """Answer 413 when a request body exceeds its route's limit (declared or streamed size)."""

    def __init__(self, app, limit: int, inband_limit: int):
        self.app = app
        self.limit = limit
        self.inband_limit = inband_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.inband_limit if scope["path"].rstrip("/") == INBAND_PATH.rstrip("/") else self.limit
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _too_large(send, limit)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge:
            await _too_large(send, limit)


async def _too_large(send, limit: int) -> None:
    body = json.dumps({"detail": f"request body exceeds this endpoint's limit of {limit} bytes"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class EngineRunner:
    """Serialises engine calls on one thread; background (fire-and-forget) failures surface on the next wait.
    A fatal failure (``fatal_engine_error``) marks the engine dead (``dead``: why), calls ``on_fatal`` once, and
    makes this and every later call raise ``EngineDead`` without touching the engine."""

    def __init__(self, on_fatal: Callable[[str], None] | None = None):
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.failure: BaseException | None = None
        self.lock = threading.Lock()
        self.dead: str | None = None
        self.on_fatal = on_fatal

    def _died(self, exc: BaseException) -> str | None:
        """``exc``'s fatal reason (recorded, ``on_fatal`` called the first time), else ``None``; a refused request
        or update is never fatal (its message may quote the request)."""
        if isinstance(exc, (EngineRequestError, WeightUpdateRefused)):
            return None
        reason = fatal_engine_error(exc)
        if reason is None:
            return None
        with self.lock:
            first = self.dead is None
            if first:
                self.dead = reason
        if first:
            log.critical("the engine died: %s", reason, exc_info=exc)
            if self.on_fatal is not None:
                self.on_fatal(reason)
        return self.dead

    def _guarded(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run():
            if self.dead is not None:
                raise EngineDead(self.dead)
            try:
                return fn()
            except BaseException as exc:
                with self.lock:
                    self.failure = exc
                if self._died(exc) is None:
                    log.exception("background engine call failed")
                raise
        return run

    def fire(self, fn: Callable[[], Any]) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)
        self.pool.submit(self._guarded(fn))

    async def call(self, fn: Callable[[], Any]) -> Any:
        def run():
            if self.dead is not None:
                raise EngineDead(self.dead)
            with self.lock:
                failure, self.failure = self.failure, None
            if isinstance(failure, WeightUpdateRefused):
                raise WeightUpdateRefused(failure.tensor, f"{failure.reason} (refused by an earlier background "
                                          "weight-update call)") from failure
            if isinstance(failure, EngineRequestError):
                raise EngineRequestError(f"an earlier background weight-update call was refused: {failure}") from failure
            if failure is not None:
                raise RuntimeError(f"an earlier background weight-update call failed: {failure!r}") from failure
            try:
                return fn()
            except Exception as exc:
                reason = self._died(exc)
                if reason is not None:
                    raise EngineDead(reason) from exc
                raise
        if self.dead is not None:
            raise EngineDead(self.dead)
        return await asyncio.wrap_future(self.pool.submit(run))

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def request_image_sizes(images: list[str] | None) -> list[tuple[int, int]] | None:
    """``(width, height)`` of each request image for ms-swift's ``images_size`` (informative: ``None`` without
    images, or when one cannot be read by header, e.g. an engine that does not look at images)."""
    if not images:
        return None
    from trainer.data.images import ImageRefError, image_size

    try:
        return [image_size(ref) for ref in images]
    except ImageRefError:
        return None


def decoding_params(cfg: RequestConfigIn | None, default_max_tokens: int) -> DecodingParams:
    """ms-swift ``RequestConfig`` → our ``DecodingParams``; unsupported settings are a 400, not ignored."""
    cfg = cfg or RequestConfigIn()
    unsupported = []
    if cfg.n != 1:
        unsupported.append(f"n={cfg.n} (one completion per request; repeat the request instead)")
    if cfg.num_beams != 1:
        unsupported.append(f"num_beams={cfg.num_beams}")
    if cfg.stream:
        unsupported.append("stream=true")
    if cfg.stop:
        unsupported.append("stop strings (decoding stops at the model's end-of-turn/EOS ids)")
    if cfg.prompt_logprobs:
        unsupported.append("prompt_logprobs")
    if cfg.structured_outputs_regex:
        unsupported.append("structured_outputs_regex")
    if unsupported:
        raise EngineRequestError("request_config not supported by this server: " + "; ".join(unsupported))
    return DecodingParams(
        max_new_tokens=cfg.max_tokens or default_max_tokens,
        temperature=cfg.temperature if cfg.temperature is not None else 0.0,
        top_p=cfg.top_p if cfg.top_p is not None else 1.0,
        top_k=cfg.top_k if cfg.top_k is not None else -1,
        repetition_penalty=cfg.repetition_penalty if cfg.repetition_penalty is not None else 1.0,
        seed=cfg.seed,
        logprobs=(cfg.top_logprobs or 0) if (cfg.logprobs or cfg.top_logprobs) else None,
    )


def request_seeds(items: list[Any], requests: list[Any], seed: int | None) -> list[int | None]:
    """Each request's sampling seed: its ``data_dict["sampling_seed"]`` when given (an integer in [0, 2**63)),
    else ``request_seed(seed, sample id)`` (``request_config.seed``; None stays None), as the colocate engine seeds
    the same record. A given seed that is not such an integer is a 400 naming the request."""
    seeds = []
    for i, (item, req) in enumerate(zip(items, requests)):
        given = item.data_dict.get(SEED_FIELD)
        if given is None:
            seeds.append(request_seed(seed, req.sample_id))
        elif isinstance(given, int) and not isinstance(given, bool) and 0 <= given < 2**63:
            seeds.append(given)
        else:
            raise EngineRequestError(f"infer_requests[{i}].data_dict.{SEED_FIELD}: {given!r} is not an integer "
                                     "in [0, 2**63)")
    return seeds


def create_app(engine: ServerEngine, api_key: str | None = None, *, default_max_tokens: int = 256,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_inband_bytes: int = DEFAULT_MAX_INBAND_BYTES,
               shm_dir: str | None = None, on_engine_death: Callable[[str], None] | None = None) -> FastAPI:
    """The rollout-server app for ``engine``; with ``api_key`` every endpoint but health needs the bearer token.
    With ``shm_dir`` it also takes in-band updates staged in that directory (``POST SHM_PATH``).
    Its Prometheus metrics (``trainer.server.metrics``) are ``app.state.metrics`` and ``GET /metrics``.
    ``on_engine_death(reason)`` is called once, from the engine's thread, when the engine dies (module docstring);
    ``app.state.runner.dead`` is the reason then."""
    runner = EngineRunner(on_engine_death)
    updates: list[dict[str, Any]] = []
    boot_id = uuid.uuid4().hex  # this server process (app), so a learner can tell a restarted server from it
    metrics = ServerMetrics(engine.kind, engine.model_name)
    metrics.set_version(getattr(engine, "weights_version", None))
    nccl_pending: dict[str, str] = {}  # kind -> NCCL updates received, accepted once weights are processed
    nccl_started: list[float] = []  # perf_counter of the pending NCCL sync's first update call

    def require_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
            raise HTTPException(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                headers={"WWW-Authenticate": "Bearer"})

    shm_reader = ShmReader(shm_dir) if shm_dir is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        runner.shutdown()
        if shm_reader is not None:
            shm_reader.close()

    app = FastAPI(title="rollout-matching rollout server", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.engine = engine
    app.state.runner = runner
    app.state.updates = updates
    app.state.metrics = metrics
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes, inband_limit=max_inband_bytes)
    routes: set[str] = set()  # filled once every route is declared
    app.add_middleware(RequestCounterMiddleware, metrics=metrics, routes=routes)
    guarded = [Depends(require_key)]

    @app.exception_handler(EngineRequestError)
    async def _bad_request(_: Request, exc: EngineRequestError):
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(WeightUpdateRefused)
    async def _refused(_: Request, exc: WeightUpdateRefused):
        log.warning("%s", exc)
        metrics.refused.inc()
        nccl_pending.clear()
        nccl_started.clear()
        return JSONResponse({"detail": str(exc), "tensor": exc.tensor, "reason": exc.reason}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return JSONResponse({"detail": "invalid request body: " + "; ".join(problems[:20]), "errors": problems},
                            status_code=422)

    @app.exception_handler(EngineDead)
    async def _engine_dead(_: Request, exc: EngineDead):
        return JSONResponse({"detail": dead_detail(engine.kind, exc.reason), "engine_dead": True}, status_code=503)

    @app.exception_handler(RuntimeError)
    async def _engine_failed(_: Request, exc: RuntimeError):
        return JSONResponse({"detail": f"engine error: {exc}"}, status_code=500)

    def record(endpoint: str, transport: str, kind: str, **extra: Any) -> None:
        if transport == "nccl" and not nccl_started:
            nccl_started.append(time.perf_counter())
        updates.append({"endpoint": endpoint, "transport": transport, "kind": kind, "time": time.time(), **extra})

    def nccl_done() -> None:
        """The NCCL updates received since the last check went through the engine's checks: accepted."""
        if nccl_pending and nccl_started:
            metrics.synced("nccl", time.perf_counter() - nccl_started[0])
        nccl_started.clear()
        for kind in list(nccl_pending):
            metrics.accepted(nccl_pending.pop(kind), kind, getattr(engine, "weights_version", None))

    @app.get("/health/")
    @app.get("/health")
    async def health():
        if runner.dead is not None:
            return JSONResponse({"status": "dead", "detail": dead_detail(engine.kind, runner.dead)}, status_code=503)
        return {"status": "ok"}

    @app.get("/get_world_size/", dependencies=guarded)
    async def get_world_size():
        return {"world_size": engine.world_size}

    @app.post("/get_engine_type/", dependencies=guarded)
    async def get_engine_type():
        return {"engine_type": "LLMEngine", "enable_multi_turn": False, "use_gym_env": False,
                "enable_lora": engine.enable_lora}

    @app.get("/get_model_state_keys/", dependencies=guarded)
    async def get_model_state_keys():
        return {"keys": await runner.call(engine.state_keys)}

    @app.post("/infer/", dependencies=guarded)
    async def infer(body: InferBody):
        if body.adapter_request:
            raise EngineRequestError("adapter_request is not supported; sync the adapter with the weight-update endpoints")
        params = decoding_params(body.request_config, default_max_tokens)
        if params.logprobs is not None and not getattr(engine, "returns_logprobs", False):
            raise EngineRequestError(f"request_config.logprobs: the {engine.kind} engine does not return "
                                     "log-probabilities (serve with --engine vllm or hf, or drop logprobs)")
        top = body.request_config.top_logprobs if body.request_config else None
        requests = [engine.encode(r, i) for i, r in enumerate(body.infer_requests)]
        seeds = request_seeds(body.infer_requests, requests, params.seed)
        seeded = {"seeds": seeds} if getattr(engine, "takes_request_seeds", False) else {}
        start = time.perf_counter()
        metrics.in_flight.inc()
        try:
            results = await runner.call(lambda: engine.generate(requests, params, **seeded)) if requests else []
        finally:
            metrics.in_flight.dec()
            metrics.infer_latency.observe(time.perf_counter() - start)
        metrics.rollout_requests.inc(len(results))
        metrics.prompt_tokens.inc(sum(len(res.prompt_token_ids) for res in results))
        metrics.generated_tokens.inc(sum(len(res.response_token_ids) for res in results))
        return [rollout_output(engine.model_name, list(res.prompt_token_ids), list(res.response_token_ids),
                               res.finish_reason, engine.decode_text(res.response_token_ids), res.extra,
                               images_size=request_image_sizes(req.images),
                               logprobs=None if params.logprobs is None else logprobs_content(
                                   res, engine.token_text, top))
                for req, res in zip(body.infer_requests, results)]

    @app.post("/init_communicator/", dependencies=guarded)
    async def init_communicator(body: InitCommunicatorBody):
        if body.world_size != engine.world_size + 1:
            raise EngineRequestError(f"world_size must be this server's world size + 1 = {engine.world_size + 1}")
        refusal = getattr(engine, "nccl_refusal", None)  # an engine that cannot join this group says so now
        if refusal:
            raise EngineRequestError(refusal)
        if body.backend is None:  # ms-swift's call (PyNccl): engines keep their three-argument nccl_init
            runner.fire(lambda: engine.nccl_init(body.host, body.port, body.world_size))
        else:
            offered = nccl_backends()
            if body.backend not in offered:
                raise EngineRequestError(f"NCCL backend {body.backend!r} is not available on this server (it offers "
                                         f"{offered}; pynccl needs vLLM and a GPU, torch-nccl a GPU)")
            runner.fire(lambda: engine.nccl_init(body.host, body.port, body.world_size, backend=body.backend))
        return {"message": "Request received, initializing communicator"}

    @app.post("/update_named_param/", dependencies=guarded)
    async def update_named_param(body: UpdateNamedParamBody):
        runner.fire(lambda: engine.nccl_receive_named(body.name, body.dtype, body.shape))
        record("update_named_param", "nccl", "full", num_tensors=1)
        nccl_pending["full"] = "nccl"
        return {"message": "Request received, updating named parameter"}

    @app.post("/update_flattened_params/", dependencies=guarded)
    async def update_flattened_params(body: UpdateFlattenedParamsBody):
        metas = [m.model_dump() for m in body.metadatas]
        runner.fire(lambda: engine.nccl_receive_flattened(metas))
        record("update_flattened_params", "nccl", "full", num_tensors=len(metas), bytes=metas[-1]["end_idx"])
        nccl_pending["full"] = "nccl"
        return {"message": "Request received, updating flattened parameters"}

    @app.post("/update_adapter_flattened_param/", dependencies=guarded)
    async def update_adapter_flattened_param(body: UpdateAdapterFlattenedBody):
        if not engine.enable_lora:
            raise EngineRequestError("this server does not serve LoRA adapters (start it with LoRA enabled)")
        metas = [m.model_dump() for m in body.metadatas]
        runner.fire(lambda: engine.nccl_receive_adapter(body.peft_config, metas))
        record("update_adapter_flattened_param", "nccl", "adapter", num_tensors=len(metas), bytes=metas[-1]["end_idx"])
        nccl_pending["adapter"] = "nccl"
        return {"message": "Request received, updating adapter parameter"}

    @app.post("/update_adapter_param/", dependencies=guarded)
    async def update_adapter_param(body: UpdateAdapterParamBody):
        if not engine.enable_lora:
            raise EngineRequestError("this server does not serve LoRA adapters (start it with LoRA enabled)")
        metas = [(m.name, m.dtype, list(m.shape)) for m in body.lora_tensors_metadata]
        runner.fire(lambda: engine.nccl_receive_adapter_tensors(body.peft_config, metas))
        record("update_adapter_param", "nccl", "adapter", num_tensors=len(metas))
        nccl_pending["adapter"] = "nccl"
        return {"message": "Request received, updating adapter parameter (non-flattened)"}

    @app.post("/process_weights_after_loading/", dependencies=guarded)
    async def process_weights_after_loading():
        await runner.call(engine.finish_weights)
        nccl_done()
        return {"message": "Weights processed after loading"}

    @app.post("/reset_prefix_cache/", dependencies=guarded)
    async def reset_prefix_cache():
        ok = await runner.call(engine.reset_prefix_cache)
        nccl_done()  # an adapter sync ends here (it has no process_weights_after_loading)
        return {"message": f"Request received, resetting prefix cache status: {ok}"}

    @app.post("/reset_encoder_cache/", dependencies=guarded)
    async def reset_encoder_cache():
        ok = await runner.call(engine.reset_prefix_cache)
        return {"message": f"Request received, resetting the prefix and encoder caches together: {ok}"}

    @app.post("/reset_mm_cache/", dependencies=guarded)
    async def reset_mm_cache():
        return {"message": "Request received, nothing to reset: processed images do not depend on the weights"}

    @app.post("/close_communicator/", dependencies=guarded)
    async def close_communicator():
        runner.fire(engine.nccl_close)
        return {"message": "Request received, closing communicator"}

    @app.post(INBAND_PATH, dependencies=guarded)
    async def update_weights_inband(request: Request, kind: Literal["full", "adapter"] = Query(...)):
        t0 = started = time.perf_counter()
        blob = await _read_body(request)
        t1 = time.perf_counter()
        try:  # on the engine's thread: with a GPU engine this is the one host-to-device copy of the payload
            tensors, meta = await runner.call(lambda: wire.decode(blob, getattr(engine, "weights_device", None)))
        except wire.WireFormatError as exc:
            raise EngineRequestError(f"body is not a safetensors payload: {exc}") from exc
        return await apply_update("rm/update_weights_inband", "inband", kind, tensors, meta, len(blob), started,
                                  read_s=round(t1 - t0, 4), decode_s=round(time.perf_counter() - t1, 4))

    async def apply_update(endpoint: str, transport: str, kind: str, tensors: dict[str, Any], meta: dict[str, str],
                           nbytes: int, started: float, **timings: float) -> dict[str, Any]:
        """Load decoded in-band ``tensors`` (full or adapter) on the engine thread; record it with its timings
        (``started``: the request's perf_counter at arrival)."""
        t0 = time.perf_counter()
        if not tensors:
            raise EngineRequestError("the safetensors payload holds no tensors")
        if kind == "adapter":
            if not engine.enable_lora:
                raise EngineRequestError("this server does not serve LoRA adapters (start it with LoRA enabled)")
            if "peft_config" not in meta:
                raise EngineRequestError("adapter payloads carry their peft config as safetensors metadata 'peft_config'")
            adapter = AdapterWeights(json.loads(meta["peft_config"]), tensors)
            await runner.call(lambda: engine.load_adapter(adapter))
        else:
            await runner.call(lambda: engine.load_full(tensors))
        record(endpoint, transport, kind, num_tensors=len(tensors), bytes=nbytes, **timings,
               load_s=round(time.perf_counter() - t0, 4))
        metrics.accepted("inband", kind, getattr(engine, "weights_version", None))
        metrics.synced(transport, time.perf_counter() - started)
        return {"message": f"{kind} weights loaded", "num_tensors": len(tensors)}

    if shm_dir is not None:
        @app.post(SHM_PATH, dependencies=guarded)
        async def update_weights_shm(body: UpdateWeightsShmBody, kind: Literal["full", "adapter"] = Query(...)):
            t0 = started = time.perf_counter()
            try:  # on the engine's thread: one host-to-device copy of the staged file onto a GPU engine
                tensors, meta = await runner.call(
                    lambda: shm_reader.read(body.file, body.bytes, getattr(engine, "weights_device", None)))
            except (ShmUpdateError, wire.WireFormatError) as exc:
                raise EngineRequestError(f"shared-directory update: {exc}") from exc
            return await apply_update("rm/update_weights_shm", "inband-shm", kind, tensors, meta, body.bytes, started,
                                      decode_s=round(time.perf_counter() - t0, 4))

    @app.get("/rm/identity/", dependencies=guarded)
    async def identity():
        """This server process: ``boot_id`` is drawn at start-up, so a learner tells a restarted server (which loaded
        its weights from the checkpoint again) from the one it pushed to before."""
        return {"boot_id": boot_id}

    @app.get("/rm/info/", dependencies=guarded)
    async def info():
        return {"engine": engine.kind, "model": engine.model_name, "world_size": engine.world_size,
                "enable_lora": engine.enable_lora, "weights_version": getattr(engine, "weights_version", None),
                "updates": updates[-100:], "inband_path": INBAND_PATH, "nccl_backends": nccl_backends(),
                "shm_dir": shm_dir, "boot_id": boot_id}

    @app.get("/rm/weights_checksum/", dependencies=guarded)
    async def weights_checksum():
        """Per-tensor checksums of the served weights (``trainer.sync.weights.tensor_checksums``), to check that a
        weight sync arrived bit-exact."""
        fn = getattr(engine, "weights_checksums", None)
        if fn is None:
            raise EngineRequestError(f"the {engine.kind} engine does not report weight checksums")
        return {"checksums": await runner.call(fn)}

    @app.get("/metrics", dependencies=guarded)
    @app.get("/metrics/", dependencies=guarded)
    async def prometheus_metrics():
        """Prometheus text exposition of ``app.state.metrics`` (``trainer.server.metrics``)."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    routes.update(r.path for r in app.routes if hasattr(r, "path"))
    return app


async def _read_body(request: Request) -> bytes | bytearray:
    """The request body; with a ``Content-Length`` it streams into one buffer of that size (a weight payload is
    copied once here instead of collected in chunks and joined)."""
    declared = request.headers.get("content-length", "")
    if not declared.isdigit():
        return await request.body()
    buf = bytearray(int(declared))
    pos = 0
    async for chunk in request.stream():
        end = pos + len(chunk)
        if end > len(buf):
            raise EngineRequestError(f"body is longer than its Content-Length of {len(buf)} bytes")
        buf[pos:end] = chunk
        pos = end
    if pos != len(buf):
        raise EngineRequestError(f"body of {pos} bytes is shorter than its Content-Length of {len(buf)} bytes")
    return buf


def nccl_backends() -> list[str]:
    """The ``/init_communicator/`` backends this server process can build (reported by ``/rm/info/``)."""
    return offered_wire_backends()
