"""``python -m trainer serve``: run a rollout server (ms-swift protocol) with the vllm, hf or scripted engine.

Exit codes: 0 after SIGTERM/SIGINT; 75 (``EXIT_ENGINE_DEAD``) when the engine died (vLLM's engine core died, or a
CUDA error poisoned the process: ``trainer.server.fatal``): the request that met it and every later engine call
answer 503, ``/health/`` answers 503, the server stops, closes the engine and exits (forced after
``DEAD_EXIT_GRACE_S`` when closing hangs), so its supervisor restarts it fresh; 3 when uvicorn could not start.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from trainer.server.fatal import EXIT_ENGINE_DEAD

log = logging.getLogger(__name__)
#: seconds an idle client connection stays open: above the 2 s after which our client drops its idle connections
#: (``trainer.sync.http``), so a request never races the server closing the connection it was sent on
KEEPALIVE_S = 30

DEAD_EXIT_GRACE_S = 30.0
EXIT_STARTUP_FAILURE = 3


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run a rollout server speaking the ms-swift rollout protocol",
                              description=__doc__)
    p.add_argument("--engine", choices=["vllm", "hf", "scripted"], required=True)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="HF model directory (required for vllm/hf; gives scripted its tokenizer)")
    p.add_argument("--api-key-env", help="name of an environment variable holding the bearer token to require")
    p.add_argument("--default-max-tokens", type=int, default=256, help="when request_config.max_tokens is null")
    p.add_argument("--max-body-mb", type=int, default=64, help="size limit of JSON request bodies")
    p.add_argument("--max-inband-mb", type=int, default=4096, help="size limit of in-band weight payloads")
    p.add_argument("--shm-dir", default=None,
                   help="also take in-band weight updates the learner staged in this directory (a tmpfs both see, "
                        "e.g. /dev/shm; the learner's sync.shm_dir): one copy instead of an HTTP body")
    p.add_argument("--log-level", default="info")
    p.add_argument("--metrics-port", type=int,
                   help="also serve the Prometheus metrics (GET /metrics, no API key) on this port; the main port "
                        "always serves them at /metrics behind the API key")
    p.add_argument("--metrics-host", help="bind address of --metrics-port (default: --host)")
    p.add_argument("--dtype", default="auto",
                   help="weights dtype (vllm: passed on; hf: auto = float32, else e.g. bfloat16)")
    p.add_argument("--device", help="hf engine: the device to serve on (e.g. cuda:0; default CPU)")
    p.add_argument("--allow-dtype-cast", action="store_true",
                   help="accept weight updates in another floating dtype than the served one and cast them (default: "
                        "refused with 422; a non-floating dtype for a floating weight is always refused)")
    v = p.add_argument_group("vllm engine")
    v.add_argument("--max-model-len", type=int, help="required with --engine vllm")
    v.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vllm: GPUs per engine; scripted: counted in /get_world_size/ (tensor x data parallel)")
    v.add_argument("--gpu-memory-utilization", type=float, default=0.45,
                   help="fraction of GPU memory (of RAM on the CPU backend) vLLM may use")
    v.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False)
    v.add_argument("--max-lora-rank", type=int, default=64)
    v.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    v.add_argument("--enforce-eager", action="store_true", help="skip torch.compile/CUDA graphs (fast start-up)")
    v.add_argument("--kv-cache-bytes", type=int, help="explicit KV-cache size (skips vLLM's memory profiling)")
    v.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("scripted engine")
    s.add_argument("--responses", type=Path, help="JSON {uuid: text or token ids} of answers to replay")
    s.add_argument("--delay-s", type=float, default=0.0, help="sleep before each answer (stalled-server tests)")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="the engine replicas of the server this one stands in for (swift rollout's "
                        "--vllm_data_parallel_size): /get_world_size/ answers --tensor-parallel-size x this, as a "
                        "swift rollout server does (NCCL weight updates need world size 1; in-band ones any)")
    s.add_argument("--die-after-calls", type=int, default=None, metavar="N",
                   help="fault injection (tests): generate calls after the first N raise a fatal engine error, as a "
                        "dead vLLM engine does (the server answers 503 and exits with code 75)")
    p.set_defaults(func=serve)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_engine(args: argparse.Namespace):
    if args.engine == "scripted":
        import torch

        from trainer.server.scripted import ScriptedEngine

        responses = json.loads(args.responses.read_text()) if args.responses else None
        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype, None)
        if args.dtype != "auto" and not isinstance(dtype, torch.dtype):
            raise SystemExit(f"serve --dtype {args.dtype}: not a torch dtype (e.g. float32, bfloat16)")
        if args.tensor_parallel_size < 1 or args.data_parallel_size < 1:
            raise SystemExit("serve --tensor-parallel-size and --data-parallel-size must be >= 1")
        return ScriptedEngine(args.model, responses=responses, delay_s=args.delay_s, enable_lora=True, dtype=dtype,
                              allow_dtype_cast=args.allow_dtype_cast, die_after_calls=args.die_after_calls,
                              world_size=args.tensor_parallel_size * args.data_parallel_size)
    if args.die_after_calls is not None:
        raise SystemExit("serve --die-after-calls is a fault-injection aid of the scripted engine only")
    if args.data_parallel_size != 1:
        raise SystemExit(f"serve --data-parallel-size: the {args.engine} engine serves one engine per server; run one "
                         "server per GPU group (or launch server --engine swift for data parallelism)")
    if not args.model:
        raise SystemExit(f"serve --engine {args.engine} needs --model DIR (a local HF model directory)")
    if args.engine == "hf":
        from trainer.server.hf_engine import HFServerEngine

        return HFServerEngine(args.model, dtype="float32" if args.dtype == "auto" else args.dtype,
                              device=args.device, allow_dtype_cast=args.allow_dtype_cast)
    if args.max_model_len is None:
        raise SystemExit("serve --engine vllm needs --max-model-len (prompt + max new tokens must fit)")
    from trainer.extras import require

    require("vllm", "serve --engine vllm")
    from trainer.server.vllm_engine import VllmServerEngine

    engine_kwargs = {}
    if args.enforce_eager:
        engine_kwargs["enforce_eager"] = True
    if args.kv_cache_bytes:
        engine_kwargs["kv_cache_memory_bytes"] = args.kv_cache_bytes
    return VllmServerEngine(
        args.model, max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank, enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
        dtype=args.dtype, allow_dtype_cast=args.allow_dtype_cast, engine_kwargs=engine_kwargs)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from trainer.server.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise SystemExit(f"--api-key-env {args.api_key_env}: that environment variable is unset or empty")
    if not _is_loopback(args.host) and api_key is None:
        log.warning("listening on %s without an API key: anyone who reaches port %d can overwrite the model's "
                    "weights; pass --api-key-env", args.host, args.port)
    if args.shm_dir and not os.path.isdir(args.shm_dir):
        raise SystemExit(f"--shm-dir {args.shm_dir}: not a directory (create it, or mount the tmpfs the learner "
                         "writes its sync.shm_dir updates to)")
    engine = build_engine(args)
    # uvicorn re-raises SIGTERM after its graceful shutdown; turning it into SystemExit lets the engine close
    # (vLLM's engine-core process would otherwise outlive the server).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    died: list[str] = []
    server: list[uvicorn.Server] = []

    def on_engine_death(reason: str) -> None:
        died.append(reason)
        log.critical("the %s engine is dead (%s): stopping the server, closing the engine and exiting with code %d "
                     "so the supervisor restarts this server", engine.kind, reason, EXIT_ENGINE_DEAD)
        watchdog = threading.Timer(DEAD_EXIT_GRACE_S, _force_exit, (DEAD_EXIT_GRACE_S,))
        watchdog.daemon = True
        watchdog.start()
        if server:
            server[0].should_exit = True

    try:
        app = create_app(engine, api_key, default_max_tokens=args.default_max_tokens,
                         max_body_bytes=args.max_body_mb * 2**20, max_inband_bytes=args.max_inband_mb * 2**20,
                         shm_dir=args.shm_dir, on_engine_death=on_engine_death)
        if args.metrics_port:
            from prometheus_client import start_http_server

            host = args.metrics_host or args.host
            start_http_server(args.metrics_port, addr=host, registry=app.state.metrics.registry)
            log.info("Prometheus metrics on http://%s:%d/metrics", host, args.metrics_port)
        server.append(uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                                        timeout_keep_alive=KEEPALIVE_S)))
        server[0].run()
        if not server[0].started:
            return EXIT_STARTUP_FAILURE
    finally:
        try:
            engine.close()
        except Exception:
            if not died:
                raise
            log.exception("closing the dead engine failed (exiting anyway)")
    return EXIT_ENGINE_DEAD if died else 0


def _force_exit(grace_s: float) -> None:
    log.critical("the server did not exit within %gs of its engine's death: exiting with code %d now", grace_s,
                 EXIT_ENGINE_DEAD)
    logging.shutdown()
    os._exit(EXIT_ENGINE_DEAD)
