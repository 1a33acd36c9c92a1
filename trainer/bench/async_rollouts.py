"""Stage-2 training in server mode against in-process scripted rollout servers, with the learner's timeline: the
harness the async-rollout tests time ``vllm.server.async_rollouts`` with (CPU-runnable).

``TimedEngine``: a scripted engine that takes ``delay_s`` per ``/infer/`` call and records its decode intervals;
``serve_engines``: each engine behind a loopback HTTP server; ``stage2_config``: the tiny model's server-mode config;
``run_with_timeline``: ``run_training`` with the trainer's step, wait and sync spans recorded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from trainer.server.scripted import ScriptedEngine


class TimedEngine(ScriptedEngine):
    """A scripted engine that records (start, end, sample ids) of every decode."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.intervals: list[tuple[float, float, tuple[str, ...]]] = []
        self.started: list[tuple[float, tuple[str, ...]]] = []
        self._lock = threading.Lock()

    def generate(self, requests, params):
        t0 = time.perf_counter()
        ids = tuple(r.sample_id for r in requests)
        with self._lock:
            self.started.append((t0, ids))
        out = super().generate(requests, params)
        with self._lock:
            self.intervals.append((t0, time.perf_counter(), ids))
        return out


@contextlib.contextmanager
def serve_engines(engines: Sequence[ScriptedEngine]):
    """Serve each engine with uvicorn on a free loopback port (background threads); yields the base URLs."""
    import socket

    import uvicorn

    from trainer.server.app import create_app

    servers, threads, urls = [], [], []
    try:
        for engine in engines:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port,
                                                   log_level="warning", lifespan="on"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            servers.append(server)
            threads.append(thread)
            deadline = time.monotonic() + 20
            while not server.started:
                if time.monotonic() > deadline or not thread.is_alive():
                    raise RuntimeError("uvicorn did not start")
                time.sleep(0.02)
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for server in servers:
            server.should_exit = True
        for thread in threads:
            thread.join(timeout=10)


def stage2_config(out_dir: str | Path, data_jsonl: str | Path, urls: Sequence[str], *, async_on: bool,
                  max_staleness: int = 1, steps: int = 6, batch: int = 2, ga: int = 1, save_steps: int = 0,
                  infer_timeout_s: float | None = None, readmit_after_s: float = 30.0, model_kind: str = "text",
                  max_new_tokens: int = 24) -> dict[str, Any]:
    """A stage-2 server-mode config (dict) for the tiny model against ``urls``."""
    server: dict[str, Any] = {"servers": [{"base_url": u} for u in urls], "timeout_s": 30, "max_retries": 1,
                              "readmit_after_s": readmit_after_s,
                              "async_rollouts": {"enabled": async_on, "max_staleness_steps": max_staleness}}
    if infer_timeout_s is not None:
        server["infer_timeout_s"] = infer_timeout_s
    return {
        "model": {"tiny": model_kind, "tiny_seed": 0},
        "data": {"train_jsonl": str(data_jsonl)},
        "training": {"output_dir": str(out_dir), "max_steps": steps, "per_device_train_batch_size": batch,
                     "gradient_accumulation_steps": ga, "learning_rate": 1e-3, "logging_steps": 1, "seed": 0,
                     "disable_tqdm": True, "report_to": ["jsonl"], "save_steps": save_steps},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "vllm", "rollout_generate_batch_size": batch,
            "decoding": {"max_new_tokens": max_new_tokens},
            "vllm": {"mode": "server", "server": server, "sync": {"mode": "full", "transport": "inband"}}}}},
    }


def run_with_timeline(cfg_dict: dict[str, Any], resume: str | None = None) -> tuple[Any, list[tuple[str, float, float]]]:
    """``run_training`` with the trainer's timeline switched on; returns (summary, timeline)."""
    from trainer.config.schema import validate_config
    from trainer.sft import run as run_mod
    from trainer.sft.trainer import RolloutMatchingTrainer

    timeline: list[tuple[str, float, float]] = []

    class Timed(RolloutMatchingTrainer):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if self.target_source == "rollout":
                self.timeline = timeline

    with mock.patch.object(run_mod, "RolloutMatchingTrainer", Timed):
        summary = run_mod.run_training(validate_config(cfg_dict), resume_from_checkpoint=resume)
    return summary, timeline
