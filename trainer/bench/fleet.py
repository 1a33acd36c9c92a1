"""The rollout-server fleet for real: N ``python -m trainer serve`` processes beside one stage-2 learner, with faults::

    python -m trainer bench --only fleet [--engine vllm|scripted] [--steps N] [--out DIR]

Topology (the seeds' 6v2 / 3v1 server mode, on one machine): N server subprocesses (``--engine vllm`` on one GPU,
each with its own port, ``--gpu-memory-utilization`` and a fixed KV cache; ``--engine scripted`` for the CPU run),
all started with ``--shm-dir`` on one shared directory, and the learner in this process in server mode with
``async_rollouts``, a full in-band weight push to every healthy server every step staged once in that directory
(``sync.shm_dir``), ``infer_timeout_s`` and re-admission on. Each server runs through
``trainer.bench.fleet_server`` (``serve`` plus one injectable fault: a NaN in its next full update).

Faults, injected while training (``--no-faults`` skips them), each at a step:

* ``kill``: SIGKILL one server while it has an ``/infer/`` in flight, restart the same command on the same port;
* ``stall``: SIGSTOP one server while it has an ``/infer/`` in flight, SIGCONT ``stall_s`` later (past
  ``infer_timeout_s``);
* ``nan``: the next full weight update of one server carries a NaN: the server's own check refuses it (422).

Recorded: per step and server, the ``/infer/`` posts (client side: sent -> answered, requests, ok); the learner's
timeline (step / wait / sync); per fault, when it was injected, how the client saw it, when the server was
quarantined and re-admitted, the requests re-rolled, and the posts sent to it while quarantined (must be 0: a server
that missed an update serves nothing until it holds the current weights); the ledger (every sample trained exactly
once: 0 lost, 0 duplicated); the per-tensor weight checksums of every server at the end (all equal); and the weight
push to N servers against the same push to one server (a short second run on server 0 alone). A restart slower than
the run (a loaded CPU machine) would end the run before re-admission: the learner is held before its last
``outcome_steps`` steps until the restarted server answers ``/health/``; the seconds held are reported
(``learner_held_for_restart_s``, 0 when the restart was in time). Writes
``fleet_<gpu|cpu>.json`` and ``.png`` (one lane per server) and keeps the servers' logs under ``<out>/fleet_logs/``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from unittest import mock

import httpx

from trainer.bench.async_rollouts import fractions
from trainer.bench.processes import start_group, stop_group
from trainer.launch.ports import listen_port as free_port  # below the ephemeral range

FaultKind = Literal["kill", "stall", "nan"]


@dataclass(frozen=True)
class Fault:
    """Inject ``kind`` into server ``server`` once the learner has finished ``at_step`` steps."""

    kind: FaultKind
    server: int
    at_step: int


@dataclass(frozen=True)
class FleetSettings:
    engine: Literal["vllm", "scripted"]
    servers: int
    steps: int
    batch: int
    max_new_tokens: int
    infer_timeout_s: float
    stall_s: float
    readmit_after_s: float
    readmit_max_interval_s: float
    restart_after_s: float
    one_server_steps: int
    faults: tuple[Fault, ...]
    server_args: tuple[str, ...] = ()
    start_timeout_s: float = 600.0
    #: the learner is held before its last ``outcome_steps`` steps until every restarted server answers ``/health/``
    #: (at most ``outcome_hold_s``), so a slow restart is still re-admitted and served from inside the run
    outcome_steps: int = 3
    outcome_hold_s: float = 300.0


def gpu_settings(steps: int = 30, faults: bool = True) -> FleetSettings:
    """Six vLLM servers of a Qwen3-0.6B-shape model (2,048-token vocabulary) on one GPU beside the learner."""
    return FleetSettings(
        engine="vllm", servers=6, steps=steps, batch=12, max_new_tokens=256, infer_timeout_s=20.0, stall_s=30.0,
        readmit_after_s=3.0, readmit_max_interval_s=8.0, restart_after_s=1.0, one_server_steps=6,
        faults=(Fault("kill", 1, 5), Fault("stall", 2, 12), Fault("nan", 3, 20)) if faults else (),
        server_args=("--max-model-len", "2048", "--gpu-memory-utilization", "0.08", "--kv-cache-bytes",
                     str(4 * 2**30), "--enforce-eager", "--dtype", "bfloat16"))


def cpu_settings(steps: int = 12, faults: bool = True, servers: int = 3, one_server_steps: int = 4) -> FleetSettings:
    """Scripted servers (0.3 s per ``/infer/``) and the tiny text model: the same mechanics on a CPU."""
    return FleetSettings(
        engine="scripted", servers=servers, steps=steps, batch=2 * servers, max_new_tokens=24, infer_timeout_s=2.0,
        stall_s=4.0, readmit_after_s=0.5, readmit_max_interval_s=2.0, restart_after_s=0.5,
        one_server_steps=one_server_steps,
        faults=(Fault("kill", 1, 1), Fault("stall", 2 % servers, 4), Fault("nan", 0, 7)) if faults else (),
        server_args=("--delay-s", "0.3"))


#: GPU model: the Qwen3-0.6B shape with a vocabulary that holds the embedded tokenizer (0.44 B parameters)
GPU_SHAPE = dict(vocab_size=2048)


# -- the server processes ---------------------------------------------------------------------------------------------
@dataclass
class ServerProcess:
    """One ``trainer.bench.fleet_server`` subprocess in its own process group, output appended to ``log_path``."""

    index: int
    argv: list[str]
    port: int
    log_path: Path
    nan_trigger: Path
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n=== start {self.starts} at {time.time():.3f}: {' '.join(self.argv)}\n".encode())
        self.proc = start_group(self.argv, self.log_path,
                                env={**os.environ, "VLLM_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false"})

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace_s=30.0)

    def exited(self) -> str | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        tail = self.log_path.read_text(errors="replace")[-3000:]
        return f"server {self.index} ({self.url}) exited with {self.proc.returncode}; log tail:\n{tail}"


def server_argv(settings: FleetSettings, model_dir: Path, port: int, shm_dir: Path, trigger: Path) -> list[str]:
    return [sys.executable, "-m", "trainer.bench.fleet_server", "--nan-trigger", str(trigger), "serve",
            "--engine", settings.engine, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--shm-dir", str(shm_dir), *settings.server_args]


def wait_healthy(servers: Sequence[ServerProcess], timeout_s: float) -> dict[str, float]:
    from trainer.launch.health import wait_until_healthy

    def abort() -> str | None:
        return next((why for why in (s.exited() for s in servers) if why), None)

    return wait_until_healthy([s.url for s in servers], timeout_s, interval_s=0.5, abort=abort)


@contextlib.contextmanager
def fleet(settings: FleetSettings, model_dir: Path, work: Path, log_dir: Path) -> Iterator[list[ServerProcess]]:
    """Start ``settings.servers`` servers at once and wait for all to answer ``/health/``; stopped at the end."""
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    shm_dir = Path(tempfile.mkdtemp(prefix="rm-fleet-", dir=shm_root))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = []
    for i in range(settings.servers):
        port = free_port()
        trigger = work / f"nan-trigger-{i}"
        servers.append(ServerProcess(i, server_argv(settings, model_dir, port, shm_dir, trigger), port,
                                     log_dir / f"server-{i}.log", trigger))
    try:
        for s in servers:
            s.start()
        took = wait_healthy(servers, settings.start_timeout_s)
        print(f"bench fleet: {len(servers)} {settings.engine} servers healthy after "
              f"{max(took.values()):.1f}s", flush=True)
        yield servers
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)


# -- what the client saw ----------------------------------------------------------------------------------------------
@dataclass
class Posts:
    """Every ``/infer/`` post of the client: (url, sent, answered, requests, ok), and the posts in flight per url."""

    spans: list[tuple[str, float, float, int, bool]] = field(default_factory=list)
    inflight: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def busy(self, url: str) -> bool:
        with self.lock:
            return self.inflight[url] > 0


@contextlib.contextmanager
def record_posts() -> Iterator[Posts]:
    from trainer.rollout.server_client import ServerRolloutEngine

    posts = Posts()
    original = ServerRolloutEngine._post_infer

    def recorded(self, server, chunk, cfg):
        url = server.base_url
        with posts.lock:
            posts.inflight[url] += 1
        t0, ok = time.perf_counter(), False
        try:
            out = original(self, server, chunk, cfg)
            ok = True
            return out
        finally:
            with posts.lock:
                posts.inflight[url] -= 1
                posts.spans.append((url, t0, time.perf_counter(), len(chunk), ok))

    with mock.patch.object(ServerRolloutEngine, "_post_infer", recorded):
        yield posts


class ClientLog(logging.Handler):
    """The rollout client's and fleet's log records, with ``perf_counter`` times."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[tuple[float, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((time.perf_counter(), record.levelname, record.getMessage()))


@contextlib.contextmanager
def client_log() -> Iterator[ClientLog]:
    handler = ClientLog()
    logger = logging.getLogger("trainer.rollout")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# -- faults -----------------------------------------------------------------------------------------------------------
class FaultInjector(threading.Thread):
    """Injects ``faults`` in step order while the learner trains; ``events`` records what was done and when."""

    def __init__(self, settings: FleetSettings, servers: Sequence[ServerProcess], timeline: list, posts: Posts):
        super().__init__(daemon=True, name="fleet-faults")
        self.settings, self.servers, self.timeline, self.posts = settings, servers, timeline, posts
        self.events: list[dict[str, Any]] = []
        self.stop_event = threading.Event()
        self.watchers: list[threading.Thread] = []

    def steps_done(self) -> int:
        return sum(1 for kind, *_ in list(self.timeline) if kind == "step")

    def wait_for(self, predicate, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.stop_event.is_set():
            if predicate():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return False

    def run(self) -> None:
        for fault in sorted(self.settings.faults, key=lambda f: f.at_step):
            if not self.wait_for(lambda f=fault: self.steps_done() >= f.at_step, 1e9):
                return
            server = self.servers[fault.server]
            event: dict[str, Any] = {"kind": fault.kind, "server": fault.server, "url": server.url,
                                     "at_step": fault.at_step, "steps_done": self.steps_done()}
            if fault.kind in ("kill", "stall"):
                event["mid_decode"] = self.wait_for(lambda s=server: self.posts.busy(s.url), 120.0)
            event["t"] = time.perf_counter()
            if fault.kind == "kill":
                server.signal(signal.SIGKILL)
                server.proc.wait(30)
                time.sleep(self.settings.restart_after_s)
                server.start()
                event["restarted_t"] = time.perf_counter()
                watcher = threading.Thread(target=self._watch_health, args=(server, event), daemon=True)
                watcher.start()
                self.watchers.append(watcher)
            elif fault.kind == "stall":
                server.signal(signal.SIGSTOP)
                self.stop_event.wait(self.settings.stall_s)
                server.signal(signal.SIGCONT)
                event["resumed_t"] = time.perf_counter()
            else:
                server.nan_trigger.touch()
            self.events.append(event)
            print(f"bench fleet: {fault.kind} server {fault.server} after step {event['steps_done']}"
                  + (f" (mid-decode: {event['mid_decode']})" if "mid_decode" in event else ""), flush=True)

    def restarts_pending(self, step: int) -> bool:
        """True while a fault due by ``step`` is still being injected, or a restarted server has not answered
        ``/health/`` (nor exited) yet. Faults scheduled after ``step`` do not count: holding for them would wait for
        steps that cannot come."""
        events = list(self.events)
        if sum(1 for f in self.settings.faults if f.at_step <= step) > len(events):
            return True
        return any(e["kind"] == "kill" and "healthy_again_t" not in e and "restart_failed" not in e for e in events)

    def hold_for_outcomes(self, step: int) -> float:
        """Called by the learner before ``step``: in the last ``outcome_steps`` steps, wait (bounded) for pending
        restarts. Returns the seconds held (0 when nothing was pending)."""
        if step < self.settings.steps - self.settings.outcome_steps or not self.restarts_pending(step):
            return 0.0
        t = time.perf_counter()
        print(f"bench fleet: holding the learner before step {step + 1} until the restarted server answers",
              flush=True)
        self.wait_for(lambda: not self.restarts_pending(step), self.settings.outcome_hold_s)
        return time.perf_counter() - t

    def _watch_health(self, server: ServerProcess, event: dict[str, Any]) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while not self.stop_event.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(server.url + "/health/").status_code == 200:
                        event["healthy_again_t"] = time.perf_counter()
                        return
                if server.exited():
                    event["restart_failed"] = server.exited()
                    return
                time.sleep(0.25)

    def finish(self) -> None:
        self.stop_event.set()
        self.join(60)
        for watcher in self.watchers:
            watcher.join(5)


# -- analysis (pure) --------------------------------------------------------------------------------------------------
def ledger_check(rows: Sequence[dict[str, Any]], expected_ids: Sequence[str]) -> dict[str, Any]:
    """Exactly-once accounting of one epoch: ids never trained, trained more than once, or not in the dataset."""
    counts = Counter(r["sample_id"] for r in rows)
    expected = set(expected_ids)
    lost = sorted(expected - set(counts))
    duplicated = sorted(sid for sid, n in counts.items() if n > 1)
    unknown = sorted(set(counts) - expected)
    return {"samples": len(expected), "trained_rows": len(rows), "lost": len(lost), "duplicated": len(duplicated),
            "unknown": len(unknown), "lost_ids": lost[:20], "duplicated_ids": duplicated[:20],
            "exactly_once": not lost and not duplicated and not unknown}


def spread_per_step(timeline: Sequence[tuple[str, float, float]], spans: Sequence[tuple[str, float, float, int, bool]],
                    urls: Sequence[str]) -> list[list[int]]:
    """Requests answered by each server, per learner step: posts attributed to the step during (or before) which
    they were sent, the first step taking everything before it."""
    ends = [b for kind, _, b in timeline if kind == "step"]
    rows = [[0] * len(urls) for _ in ends]
    index = {u: i for i, u in enumerate(urls)}
    for url, sent, _, n, ok in spans:
        if not ok or url not in index or not ends:
            continue
        step = next((k for k, end in enumerate(ends) if sent <= end), len(ends) - 1)
        rows[step][index[url]] += n
    return rows


def fault_outcomes(events: Sequence[dict[str, Any]], records: Sequence[tuple[float, str, str]],
                   spans: Sequence[tuple[str, float, float, int, bool]]) -> list[dict[str, Any]]:
    """Per injected fault: the client's first quarantine of that server after it (and why), its re-admission, the
    requests lost to the fault and re-rolled elsewhere, and the posts sent to the server while it was quarantined."""
    out = []
    for event in events:
        url, t = event["url"], event["t"]
        quarantine = next(((ts, msg) for ts, _, msg in records
                           if ts >= t and msg.startswith(f"quarantining rollout server {url} ")), None)
        q_t = quarantine[0] if quarantine else None
        readmit = next((ts for ts, _, msg in records if q_t is not None and ts >= q_t
                        and msg.startswith(f"rollout server {url} re-admitted")), None)
        failed = [s for s in spans if s[0] == url and not s[4] and s[2] >= t]
        while_out = [s for s in spans if q_t is not None and s[0] == url and q_t < s[1] < (readmit or float("inf"))]
        row = {"fault": event["kind"], "server": event["server"], "after_step": event["steps_done"],
               "mid_decode": event.get("mid_decode"),
               "detected_as": quarantine[1].split("(", 1)[1][:240] if quarantine else None,
               "quarantined_after_s": None if q_t is None else round(q_t - t, 3),
               "readmitted_after_s": None if readmit is None else round(readmit - t, 3),
               "requests_failed_and_rerolled": sum(s[3] for s in failed),
               "posts_while_quarantined": len(while_out)}
        if "restarted_t" in event:
            row["restarted_after_s"] = round(event["restarted_t"] - t, 3)
        if "healthy_again_t" in event:
            row["healthy_again_after_s"] = round(event["healthy_again_t"] - t, 3)
        if "restart_failed" in event:
            row["restart_failed"] = event["restart_failed"][:500]
        out.append(row)
    return out


def checksums(urls: Sequence[str]) -> dict[str, dict[str, str] | str]:
    out: dict[str, dict[str, str] | str] = {}
    with httpx.Client(timeout=120.0, trust_env=False) as client:
        for url in urls:
            try:
                resp = client.get(url + "/rm/weights_checksum/")
                out[url] = resp.json().get("checksums", resp.json()) if resp.status_code == 200 else \
                    f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.HTTPError as exc:
                out[url] = f"{type(exc).__name__}: {exc}"
    return out


# -- one training run -------------------------------------------------------------------------------------------------
def stage2_config(settings: FleetSettings, out_dir: Path, urls: Sequence[str], shm_dir: str, model: dict[str, Any],
                  steps: int, cuda: bool) -> dict[str, Any]:
    server = {"servers": [{"base_url": u} for u in urls], "timeout_s": 60, "max_retries": 2,
              "infer_timeout_s": settings.infer_timeout_s, "readmit_after_s": settings.readmit_after_s,
              "readmit_max_interval_s": settings.readmit_max_interval_s,
              "async_rollouts": {"enabled": True, "max_staleness_steps": 1}}
    training: dict[str, Any] = {"output_dir": str(out_dir), "max_steps": steps, "per_device_train_batch_size":
                                settings.batch, "learning_rate": 1e-5, "logging_steps": 1, "seed": 0,
                                "disable_tqdm": True, "report_to": ["jsonl"], "save_steps": 0}
    if cuda:
        training["bf16"] = True
    return {
        "model": model,
        "data": {"synthetic": {"num_samples": steps * settings.batch, "seed": 0, "min_objects": 1, "max_objects": 3,
                               "image_size": 64}},
        "training": training,
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "vllm", "rollout_generate_batch_size": settings.batch,
            "decoding": {"max_new_tokens": settings.max_new_tokens, "temperature": 0.0},
            "vllm": {"mode": "server", "server": server,
                     "sync": {"mode": "full", "transport": "inband", "shm_dir": shm_dir}}}}},
    }


def train(settings: FleetSettings, servers: Sequence[ServerProcess], run_dir: Path, model: dict[str, Any],
          steps: int, cuda: bool, inject: bool) -> dict[str, Any]:
    """One stage-2 run against ``servers`` with the faults injected (when ``inject``); everything measured."""
    shm_dir = servers[0].argv[servers[0].argv.index("--shm-dir") + 1]
    cfg = stage2_config(settings, run_dir, [s.url for s in servers], shm_dir, model, steps, cuda)
    timeline: list[tuple[str, float, float]] = []
    with record_posts() as posts, client_log() as log:
        injector = FaultInjector(settings, servers, timeline, posts) if inject and settings.faults else None
        from transformers import TrainerCallback

        from trainer.sft import run as run_mod
        from trainer.sft.trainer import RolloutMatchingTrainer

        held: list[float] = []

        class HoldForOutcomes(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if injector is not None and state.global_step < steps:
                    held.append(injector.hold_for_outcomes(state.global_step))

        class Timed(RolloutMatchingTrainer):
            def __init__(self, *args: Any, **kwargs: Any):
                super().__init__(*args, **kwargs)
                if self.target_source == "rollout":
                    self.timeline = timeline
                    if injector is not None and not injector.is_alive():
                        self.add_callback(HoldForOutcomes())
                        injector.start()

        from trainer.config.schema import validate_config

        t0 = time.perf_counter()
        try:
            with mock.patch.object(run_mod, "RolloutMatchingTrainer", Timed):
                summary = run_mod.run_training(validate_config(cfg))
        finally:
            if injector is not None:
                injector.finish()
        wall = time.perf_counter() - t0
    urls = [s.url for s in servers]
    rows = [json.loads(line) for line in (Path(summary.output_dir) / "stage2" / "ledger.jsonl").read_text().splitlines()]
    data = Path(summary.output_dir) / "data" / "train.jsonl"
    expected = [json.loads(line)["id"] for line in data.read_text().splitlines() if line.strip()] if data.is_file() \
        else sorted({r["sample_id"] for r in rows})
    result = fractions(timeline, [[(a, b) for u, a, b, _, ok in posts.spans if u == url] for url in urls])
    syncs = [b - a for kind, a, b in timeline if kind == "sync"]
    result.update({
        "stage2_steps": summary.stage2_steps, "run_wall_s": round(wall, 2),
        "learner_held_for_restart_s": round(sum(held), 2),
        "sync_s": [round(s, 4) for s in syncs], "sync_s_median": statistics.median(syncs[1:] or syncs) if syncs else None,
        "requests_per_step_per_server": spread_per_step(timeline, posts.spans, urls),
        "requests_per_server": [sum(n for u, _, _, n, ok in posts.spans if u == url and ok) for url in urls],
        "ledger": ledger_check(rows, expected),
        "faults": fault_outcomes(injector.events if injector else [], log.records, posts.spans),
        "client_log": [(round(ts - t0, 3), level, msg[:400]) for ts, level, msg in log.records
                       if level != "INFO" or "re-admitted" in msg or "quarantin" in msg],
    })
    t_base = min([a for _, a, _ in timeline] + [t0])
    result["timeline"] = {
        "learner": [(k, round(a - t_base, 4), round(b - t_base, 4)) for k, a, b in timeline],
        "servers": [[(round(a - t_base, 4), round(b - t_base, 4), n, ok) for u, a, b, n, ok in posts.spans
                     if u == url] for url in urls],
        "faults": [{k: (round(v - t_base, 4) if k.endswith("_t") or k == "t" else v) for k, v in e.items()}
                   for e in (injector.events if injector else [])]}
    return result


# -- the benchmark ----------------------------------------------------------------------------------------------------
def build_model(settings: FleetSettings, work: Path, cuda: bool) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(server model dir, learner model section, shape) for the engine."""
    if settings.engine == "vllm":
        import torch

        from trainer.bench.vllm import save_random_model_dir

        model_dir = save_random_model_dir(work / "model", GPU_SHAPE, dtype=torch.bfloat16 if cuda else torch.float32)
        cfg = json.loads((model_dir / "config.json").read_text())
        section = {"path": str(model_dir), "torch_dtype": "bfloat16" if cuda else "float32"}
        return model_dir, section, {k: cfg.get(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                             "intermediate_size")}
    from trainer.modeling.fixtures import save_tiny_model

    return save_tiny_model(work / "tiny-text", "text", seed=0), {"tiny": "text", "tiny_seed": 0}, {"tiny": "text"}


def run(out_dir: str | Path, settings: FleetSettings | None = None, *, work_dir: str | Path | None = None) -> dict:
    import torch

    from trainer.bench.models import device_name

    cuda = torch.cuda.is_available()
    settings = settings or (gpu_settings() if cuda else cpu_settings())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = "gpu" if cuda else "cpu"
    log_dir = out / f"fleet_logs_{tag}"
    shutil.rmtree(log_dir, ignore_errors=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        work = Path(tmp)
        model_dir, model, shape = build_model(settings, work, cuda)
        result: dict[str, Any] = {"config": {
            **{k: v for k, v in asdict(settings).items() if k != "faults"},
            "faults": [asdict(f) for f in settings.faults], "shape": shape,
            "device": device_name("cuda") if cuda else "cpu", "torch": torch.__version__,
            "sync": "full, in-band staged once in a shared directory (sync.shm_dir), every step, every healthy server",
            "async_rollouts": "on, max_staleness_steps 1", "server_busy_from": "client side: /infer/ sent -> answered"}}
        with contextlib.suppress(ImportError):
            import vllm

            result["config"]["vllm"] = vllm.__version__
        with fleet(settings, model_dir, work, log_dir) as servers:
            result["fleet"] = train(settings, servers, work / "fleet", model, settings.steps, cuda, inject=True)
            healthy = [s for s in servers if s.exited() is None]
            sums = checksums([s.url for s in healthy])
            distinct = {json.dumps(v, sort_keys=True) for v in sums.values()}
            result["fleet"]["final_checksums_agree"] = len(distinct) == 1 and all(isinstance(v, dict)
                                                                                  for v in sums.values())
            result["fleet"]["final_checksum_servers"] = len(sums)
            print(f"bench fleet: {settings.servers} servers, {result['fleet']['stage2_steps']} steps, ledger "
                  f"{result['fleet']['ledger']}", flush=True)
            if settings.one_server_steps:
                result["one_server"] = train(settings, servers[:1], work / "one", model, settings.one_server_steps,
                                             cuda, inject=False)
    fl, one = result["fleet"], result.get("one_server")
    result["headline"] = {
        "servers": settings.servers, "steps": fl["stage2_steps"], "exactly_once": fl["ledger"]["exactly_once"],
        "lost": fl["ledger"]["lost"], "duplicated": fl["ledger"]["duplicated"],
        "faults_readmitted": sum(1 for f in fl["faults"] if f["readmitted_after_s"] is not None),
        "faults": len(fl["faults"]), "posts_while_quarantined": sum(f["posts_while_quarantined"] for f in fl["faults"]),
        "final_checksums_agree": fl["final_checksums_agree"], "learner_idle_fraction": fl.get("learner_idle_fraction"),
        "step_s_mean": fl.get("step_s_mean"), "learner_held_for_restart_s": fl["learner_held_for_restart_s"],
        "sync_s_median_fleet": fl["sync_s_median"],
        "sync_s_median_one_server": one["sync_s_median"] if one else None,
        "sync_fleet_over_one": (fl["sync_s_median"] / one["sync_s_median"]) if one and one["sync_s_median"] else None}
    result["bench_wall_s"] = round(time.perf_counter() - t_start, 1)
    path = out / f"fleet_{tag}.json"
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    h = result["headline"]
    print(f"bench fleet ({tag}): {h['servers']} servers, {h['steps']} steps, faults re-admitted "
          f"{h['faults_readmitted']}/{h['faults']}, lost {h['lost']}, duplicated {h['duplicated']}, posts while "
          f"quarantined {h['posts_while_quarantined']}, checksums agree {h['final_checksums_agree']}, learner idle "
          f"{100 * (h['learner_idle_fraction'] or 0):.1f}%, sync {h['sync_s_median_fleet']:.3f}s to "
          f"{h['servers']} vs {h['sync_s_median_one_server'] or float('nan'):.3f}s to one; {path} "
          f"({result['bench_wall_s']:.0f}s)", flush=True)
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["fleet"]["timeline"]
    lanes = len(tl["servers"]) + 1
    fig, ax = plt.subplots(figsize=(13, 0.55 * lanes + 1.6))
    colors = {"step": "tab:blue", "wait": "tab:red", "sync": "tab:orange"}
    for kind, a, b in tl["learner"]:
        ax.broken_barh([(a, b - a)], (-0.35, 0.7), color=colors[kind], alpha=0.5 if kind == "step" else 0.9,
                       zorder=1 if kind == "step" else 2)
    for i, spans in enumerate(tl["servers"], start=1):
        for a, b, _n, ok in spans:
            ax.broken_barh([(a, b - a)], (i - 0.35, 0.7), color="tab:green" if ok else "black", alpha=0.8)
    marks = {"kill": "X", "stall": "s", "nan": "v"}
    for f in tl["faults"]:
        y = f["server"] + 1
        ax.plot([f["t"]], [y], marker=marks[f["kind"]], color="crimson", markersize=10, zorder=5)
        ax.annotate(f["kind"], (f["t"], y + 0.38), fontsize=8, color="crimson")
        end = f.get("healthy_again_t") or f.get("resumed_t")
        if end:
            ax.broken_barh([(f["t"], end - f["t"])], (y - 0.45, 0.9), color="grey", alpha=0.3, zorder=0)
    for row in result["fleet"]["faults"]:
        if row["readmitted_after_s"] is not None:
            t = next(f["t"] for f in tl["faults"] if f["server"] == row["server"] and f["kind"] == row["fault"])
            ax.plot([t + row["readmitted_after_s"]], [row["server"] + 1], marker="o", color="tab:purple", zorder=5)
    ax.set_yticks(range(lanes), ["learner"] + [f"server {i}" for i in range(lanes - 1)])
    ax.set_ylim(-0.6, lanes - 0.4)
    ax.invert_yaxis()
    h = result["headline"]
    ax.set_title(f"{h['servers']} rollout servers ({result['config']['engine']}, {result['config']['device']}), "
                 f"{h['steps']} stage-2 steps: lost {h['lost']}, duplicated {h['duplicated']}, faults re-admitted "
                 f"{h['faults_readmitted']}/{h['faults']}, learner idle {100 * (h['learner_idle_fraction'] or 0):.0f}%",
                 fontsize=9)
    ax.set_xlabel("seconds (learner: blue step, red waiting on rollouts, orange weight push; servers: green /infer/ "
                  "answered, black failed; red marks: faults, grey: down/stopped, purple: re-admitted)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
