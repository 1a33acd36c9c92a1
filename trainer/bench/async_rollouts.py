"""Step-timeline benchmark of ``vllm.server.async_rollouts`` (CPU-runnable): real stage-2 training of the tiny model
in server mode against in-process scripted rollout servers that take ``delay_s`` per ``/infer/`` call, with and
without overlap. Learner busy / idle (waiting on rollouts) comes from the trainer's timeline, server busy / idle from
the servers' own decode intervals. Writes ``overlap.json`` and ``overlap.png``::

    python -m trainer bench --only async            # or: trainer.bench.async_rollouts.run(out_dir)

``learner_idle_fraction`` = time the learner waited for rollouts / wall time from the first step's start to the
last step's end; ``server_idle_fraction`` = 1 − (mean over servers of decode time) / the same wall time.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
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


def fractions(timeline: Sequence[tuple[str, float, float]], server_intervals: Sequence[Sequence[tuple[float, float]]],
              skip_steps: int = 1) -> dict[str, Any]:
    """Idle fractions over the steps after the first ``skip_steps`` (the first step cannot overlap anything)."""
    steps = [(a, b) for k, a, b in timeline if k == "step"]
    steps = steps[skip_steps:]
    if not steps:
        return {}
    start, end = steps[0][0], steps[-1][1]
    wall = end - start

    def clipped(intervals: Sequence[tuple[float, float]]) -> float:
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)

    waits = [(a, b) for k, a, b in timeline if k == "wait"]
    learner_idle = clipped(waits)
    push = clipped([(a, b) for k, a, b in timeline if k == "sync"])
    server_busy = [clipped(iv) for iv in server_intervals]
    mean_busy = sum(server_busy) / len(server_busy) if server_busy else 0.0
    return {"wall_s": wall, "steps": len(steps), "learner_idle_s": learner_idle,
            "learner_idle_fraction": learner_idle / wall, "learner_busy_fraction": 1 - learner_idle / wall,
            "server_busy_fraction": mean_busy / wall, "server_idle_fraction": 1 - mean_busy / wall,
            "step_s_mean": wall / len(steps), "weight_push_s": push, "weight_push_fraction": push / wall,
            # what can overlap a decode: targets, forward, backward, optimizer (no rollout wait, no weight push)
            "train_s_per_step": (wall - learner_idle - push) / len(steps)}


def measure(work: Path, *, async_on: bool, delay_s: float, steps: int, batch: int, servers: int,
            make_engine: Callable[[Path, float], TimedEngine] | None = None) -> dict[str, Any]:
    from trainer.data.synthetic import generate
    from trainer.modeling.fixtures import save_tiny_model

    model_dir = save_tiny_model(work / "tiny-text", "text", seed=0)
    data = generate(work / "data", steps * batch, seed=0, min_objects=1, max_objects=2)
    make_engine = make_engine or (lambda d, s: TimedEngine(d, delay_s=s))
    engines = [make_engine(model_dir, delay_s) for _ in range(servers)]
    name = "overlap" if async_on else "no_overlap"
    with serve_engines(engines) as urls:
        cfg = stage2_config(work / name, data, urls, async_on=async_on, steps=steps, batch=batch)
        summary, timeline = run_with_timeline(cfg)
    out = fractions(timeline, [[(a, b) for a, b, _ in e.intervals] for e in engines])
    t0 = min(a for _, a, _ in timeline)
    out["timeline"] = {"learner": [(k, round(a - t0, 4), round(b - t0, 4)) for k, a, b in timeline],
                       "servers": [[(round(a - t0, 4), round(b - t0, 4)) for a, b, _ in e.intervals] for e in engines]}
    out["stage2_steps"] = summary.stage2_steps
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 4.8), sharex=True)
    for ax, key in zip(axes, ("no_overlap", "overlap")):
        r = result[key]
        rows = [("learner", r["timeline"]["learner"])] + [
            (f"server {i}", [("decode", a, b) for a, b in iv]) for i, iv in enumerate(r["timeline"]["servers"])]
        colors = {"step": "tab:blue", "wait": "tab:red", "sync": "tab:orange", "decode": "tab:green"}
        for y, (_label, spans) in enumerate(rows):
            for kind, a, b in spans:
                ax.broken_barh([(a, b - a)], (y - 0.35, 0.7), color=colors[kind], alpha=0.6 if kind == "step" else 0.9,
                               zorder=1 if kind == "step" else 2)
        ax.set_yticks(range(len(rows)), [label for label, _ in rows])
        ax.set_title(f"{key.replace('_', ' ')}: learner idle {100 * r['learner_idle_fraction']:.0f}%, "
                     f"servers idle {100 * r['server_idle_fraction']:.0f}% (after step 1)", fontsize=9)
    axes[-1].set_xlabel("seconds (blue: learner training step, red: waiting on rollouts, orange: weight push, "
                        "green: server decoding)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The headline keys of an overlap result (both variants measured)."""
    no, ov = result["no_overlap"], result["overlap"]
    result["learner_idle_fraction_no_overlap"] = no["learner_idle_fraction"]
    result["learner_idle_fraction_overlap"] = ov["learner_idle_fraction"]
    result["server_idle_fraction_no_overlap"] = no["server_idle_fraction"]
    result["server_idle_fraction_overlap"] = ov["server_idle_fraction"]
    result["speedup_step_time"] = no["step_s_mean"] / ov["step_s_mean"]
    result["weight_push_fraction_overlap"] = ov["weight_push_fraction"]
    return result


def run(out_dir: str | Path, delay_s: float | None = None, steps: int = 12, batch: int = 2, servers: int = 2) -> dict:
    """Both variants; ``delay_s`` defaults to the training time per step (targets + forward + backward + optimizer:
    the step minus its rollout wait and its weight push, which no decode can overlap) measured by a short no-overlap
    calibration run with instant servers, so decode time = train time: the limit of the case the issue targets
    (decode <= train). The result records the train time of the measured no-overlap run beside it."""
    import math
    import platform

    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chosen = "given (--decode-s)"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if delay_s is None:  # calibrate: train time per step with instant servers
            cal = measure(work / "cal", async_on=False, delay_s=0.0, steps=6, batch=batch, servers=servers)
            delay_s = math.floor(cal["train_s_per_step"] * 1000) / 1000
            chosen = "calibrated: train time per step (step - rollout wait - weight push) of a no-overlap run"
        result: dict[str, Any] = {"config": {"delay_s": delay_s, "delay_chosen": chosen, "steps": steps,
                                             "per_device_train_batch_size": batch,
                                             "servers": servers, "model": "tiny text (embedded)", "device": "cpu",
                                             "engine": "scripted (in-process uvicorn, sleeps delay_s per /infer/)",
                                             "server_busy_from": "server-side decode intervals",
                                             "torch_threads": torch.get_num_threads(), "cpu": platform.processor(),
                                             "cpu_count": os.cpu_count(), "max_staleness_steps": 1,
                                             "sync": "full, in-band, every step"}}
        for name, on in (("no_overlap", False), ("overlap", True)):
            result[name] = measure(work / name, async_on=on, delay_s=delay_s, steps=steps, batch=batch, servers=servers)
    headline(result)
    result["decode_le_train"] = delay_s <= result["no_overlap"]["train_s_per_step"]
    (out / "overlap.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "overlap.png")
    print(f"async rollouts (decode {delay_s:.3f}s/call, train {result['no_overlap']['train_s_per_step']:.3f}s/step): "
          f"learner idle {100 * result['learner_idle_fraction_no_overlap']:.1f}% "
          f"-> {100 * result['learner_idle_fraction_overlap']:.1f}%, servers idle "
          f"{100 * result['server_idle_fraction_no_overlap']:.1f}% -> {100 * result['server_idle_fraction_overlap']:.1f}%, "
          f"weight push {100 * result['weight_push_fraction_overlap']:.1f}% of the overlapped wall, "
          f"step time x{result['speedup_step_time']:.2f}")
    return result
