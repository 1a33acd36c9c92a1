"""The same stage-2 work in every layout a machine allows (``python -m trainer bench --only layouts``;
``docs/benchmarks/layouts.json`` / ``.png``).

A layout places the learner ranks and the rollout servers on the machine's GPUs: ``colocate-N`` (N torchrun ranks,
each with its own vLLM engine that sleeps while it trains; DDP, or ZeRO-2 with ``-zero2``), ``colocate-tpN`` (N ranks
sharing one TP-N engine), ``SvL`` (S ``trainer serve --engine vllm`` processes on GPUs 0..S-1, one each, and an L-rank
learner on the rest; NCCL weight sync; ``-async``: the next step's batch decodes while this one trains). Every layout
runs the same work (``Work``: model, records per optimizer step, rollout length, images) through the product's own
entry points (``trainer serve``, ``torch.distributed.run -m trainer train``), one after the other. The learner
checkpoints every decoder layer (``Work.checkpointing``: ``full``) and runs eagerly unless the layout names its own
levers (``-auto-compile``: ``gradient_checkpointing_policy: auto``, ``compile_decoder_layers`` and, since session 25,
``compile_activation_memory_budget: auto``, as the values files ship them; ``-recload``: ``vllm.sync.recorded_load``,
as ``values-colocate.yaml`` ships it); each record says which policy and budget ran (``learner_checkpointing``,
``learner_memory_budget``).

Per layout: trained samples/s (ledger rows of every rank, i.e. samples that went through a backward pass, over the
wall time of the measured steps; the first step is warm-up), that rate per GPU against ``colocate-1``'s, the busy %
of every GPU (NVML utilisation sampled at 10 Hz over the measured steps), the learner's weight-sync seconds,
staleness, rows per step, and the peak memory of every GPU (NVML, engine pools included) and of the learner
(torch's counter). A layout that fails is recorded with its error and log tail; the others still run.
``--quick``: a tiny Qwen3-VL on the CPU with the HF backend and gloo (colocate-1, colocate-2, 1v1), so CI runs the
bench's code path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from trainer.bench.processes import start_group, stop_group
from trainer.launch.ports import listen_port, listen_ports
from trainer.telemetry import read_jsonl


@dataclass(frozen=True)
class Layout:
    """Where the work runs: ``learner_gpus`` torchrun ranks (colocated vLLM in each, or a TP-``tp`` group) after
    ``servers`` one-GPU rollout servers; ``zero``: DeepSpeed ZeRO stage (0: DDP)."""

    name: str
    learner_gpus: int
    servers: int = 0
    tp: int = 1
    zero: int = 0
    async_rollouts: bool = False
    records_per_step: int | None = None  # None: the work's
    #: ``kill-server``: once the learner logged its first step, the last server's process group is SIGKILLed (in
    #: whatever it was doing: a decode or a weight broadcast) and restarted on its port (``ServerKill``); the run
    #: trains ``FAULT_EXTRA_STEPS`` more steps than the work's
    fault: str | None = None
    #: ``vllm.pixels_during_decode``: the training pixels made while the engine (colocate) or the servers (sync
    #: server layouts) decode
    pixels_during_decode: bool = False
    #: colocate: ``vllm.sleep_level`` instead of the work's (``kv_cache``: the weights stay mapped between decodes)
    sleep_level: int | str | None = None
    #: the learner's ``training.gradient_checkpointing_policy`` instead of the work's (``auto``: sized from the
    #: learner GPU's memory, a colocated engine's share charged)
    checkpointing: str | None = None
    #: the learner's ``training.compile_decoder_layers``
    compile: bool = False
    #: colocate: ``vllm.sync.recorded_load`` (each sync replays the engine's recorded loader copies)
    recorded_load: bool = False

    @property
    def gpus(self) -> int:
        return self.learner_gpus + self.servers

    @property
    def mode(self) -> str:
        return "server" if self.servers else "colocate"


@dataclass(frozen=True)
class Work:
    """What every layout trains: ``size`` of a random Qwen3-VL (``trainer.bench.scale``), ``records_per_step`` records
    per optimizer step, ``steps`` optimizer steps (the first is warm-up), rollouts of ``max_new_tokens``."""

    size: str = "2b"
    records_per_step: int = 64
    steps: int = 3
    max_new_tokens: int = 1024
    image_size: int = 1024
    min_objects: int = 40
    max_objects: int = 80
    packing_length: int = 16384
    colocate_util: float = 0.3
    server_util: float = 0.85
    sleep_level: int = 2
    #: the learner's ``tuner.train_type`` (``RM_BENCH_LAYOUT_TUNER``): full | lora | dora (rank 16; DoRA is what
    #: ``values-3v1.yaml`` / ``values-6v2.yaml`` train)
    tuner: str = "full"
    #: the learner's ``gradient_checkpointing_policy`` on a GPU (``full``: what every layouts run before session 23
    #: used, whatever the memory; CPU runs: off)
    checkpointing: str = "full"
    timeout_s: float = 900.0


TUNERS = ("full", "lora", "dora")

LAYOUTS = (
    Layout("colocate-1", 1),
    Layout("colocate-1-r8", 1, records_per_step=8),
    Layout("colocate-2", 2),
    Layout("colocate-tp2", 2, tp=2),
    Layout("1v1-sync", 1, servers=1),
    Layout("1v1-sync-pixels", 1, servers=1, pixels_during_decode=True),  # the training pixels made during the decode
    Layout("1v1-async", 1, servers=1, async_rollouts=True),
    Layout("colocate-4", 4),
    Layout("colocate-4-zero2", 4, zero=2),
    Layout("colocate-4-r256", 4, records_per_step=256),  # 64 records per engine, as colocate-1 decodes
    Layout("colocate-1-pixels", 1, pixels_during_decode=True),
    Layout("colocate-4-r256-pixels", 4, records_per_step=256, pixels_during_decode=True),
    Layout("colocate-4-r256-pixels-sleepkv", 4, records_per_step=256, pixels_during_decode=True,
           sleep_level="kv_cache"),
    Layout("colocate-tp4", 4, tp=4),
    Layout("3v1-sync", 1, servers=3),
    Layout("3v1-sync-pixels", 1, servers=3, pixels_during_decode=True),
    Layout("3v1-async", 1, servers=3, async_rollouts=True),
    Layout("2v2-async", 2, servers=2, async_rollouts=True),
    Layout("3v1-async-kill", 1, servers=3, async_rollouts=True, fault="kill-server"),
    # the learner near its GPU's limit: checkpointing sized from the memory (``auto``) and compiled decoder layers
    Layout("colocate-1-auto-compile", 1, checkpointing="auto", compile=True),
    Layout("1v1-async-auto-compile", 1, servers=1, async_rollouts=True, checkpointing="auto", compile=True),
    Layout("3v1-async-auto-compile", 1, servers=3, async_rollouts=True, checkpointing="auto", compile=True),
    Layout("2v2-async-auto-compile", 2, servers=2, async_rollouts=True, checkpointing="auto", compile=True),
    Layout("colocate-4-r256-pixels-auto-compile", 4, records_per_step=256, pixels_during_decode=True,
           checkpointing="auto", compile=True),
    # the shipped colocate learner on two ranks, 64 records per engine, the sync's load replayed from its recording
    Layout("colocate-2-r128-pixels-auto-compile-recload", 2, records_per_step=128, pixels_during_decode=True,
           checkpointing="auto", compile=True, recorded_load=True),
    Layout("colocate-1-pixels-auto-compile-recload", 1, pixels_during_decode=True, checkpointing="auto", compile=True,
           recorded_load=True),  # the line above's same-levers baseline: one GPU, one engine, 64 records
    Layout("colocate-1-auto-compile-recload", 1, checkpointing="auto", compile=True, recorded_load=True),
    Layout("colocate-8", 8),
    Layout("6v2-async", 2, servers=6, async_rollouts=True),
    Layout("7v1-async", 1, servers=7, async_rollouts=True),
)
QUICK_WORK = Work(size="tiny", records_per_step=4, steps=2, max_new_tokens=16, image_size=64, min_objects=1,
                  max_objects=3, packing_length=4096, timeout_s=600.0)
QUICK_LAYOUTS = (Layout("colocate-1", 1), Layout("colocate-2", 2), Layout("1v1-async", 1, servers=1,
                                                                          async_rollouts=True),
                 Layout("2v1-async-kill", 1, servers=2, async_rollouts=True, fault="kill-server"))
#: ``vllm.server.readmit_after_s`` of a fault layout: the killed server is probed again this soon
FAULT_READMIT_AFTER_S = 2.0
#: a fault layout trains this many steps more than the work's: the kill comes once step 1 is logged, and the
#: learner must still push weights and decode after it (a run that ended first would prove nothing)
FAULT_EXTRA_STEPS = 3


def gpu_count() -> int:
    """GPUs NVML sees (0 without a driver); the bench process itself never opens a CUDA context."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001 - no NVML: a CPU machine
        return 0


def gpu_holders(gpus: list[int]) -> dict[int, list[int]]:
    """The pids other than this process with a compute context on each of ``gpus`` (NVML; only GPUs that have
    some)."""
    import pynvml

    pynvml.nvmlInit()
    held = {}
    for i in gpus:
        pids = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
                if p.pid != os.getpid()]
        if pids:
            held[i] = pids
    return held


def wait_for_free_gpus(gpus: list[int], timeout_s: float = 60.0,
                       holders: Callable[[list[int]], dict[int, list[int]]] = gpu_holders) -> None:
    """Wait until no process holds any of ``gpus`` (the last layout's engines may still be exiting); a layout that
    started beside another process would fail for want of memory, or measure the other's work. ``RuntimeError``
    naming the GPUs and pids after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        held = holders(gpus)
        if not held:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"GPU(s) still held after {timeout_s:.0f} s: "
                               + "; ".join(f"GPU {g} by pid(s) {pids}" for g, pids in held.items())
                               + ": stop those processes (an earlier run's learner or server?) and run again")
        time.sleep(1.0)


class GpuSampler(threading.Thread):
    """NVML utilisation and memory of every GPU, ``(time, [util %], [used GiB])`` every ``interval_s``."""

    def __init__(self, interval_s: float = 0.1):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.samples: list[tuple[float, list[int], list[float]]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        while not self._halt.is_set():
            util = [int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in handles]
            used = [pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30 for h in handles]
            self.samples.append((time.time(), util, used))
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def summary(self, start: float, end: float) -> dict[str, list[float]]:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return {}
        n = len(inside[0][1])
        return {"busy_pct": [round(sum(s[1][i] for s in inside) / len(inside), 1) for i in range(n)],
                "peak_used_gib": [round(max(s[2][i] for s in self.samples), 2) for i in range(n)]}


def layout_config(layout: Layout, work: Work, model_dir: Path, out_dir: Path, urls: list[str], cuda: bool
                  ) -> dict[str, Any]:
    records = layout.records_per_step or work.records_per_step
    rm: dict[str, Any] = {"rollout_backend": "vllm" if cuda else "hf", "rollout_generate_batch_size": records,
                          "decoding": {"max_new_tokens": work.max_new_tokens, "temperature": 0.0}}
    if cuda and layout.mode == "colocate":
        sleep = work.sleep_level if layout.sleep_level is None else layout.sleep_level
        rm["vllm"] = {"mode": "colocate", "max_model_len": 4096, "sleep_level": sleep,
                      "tensor_parallel_size": layout.tp, "gpu_memory_utilization": work.colocate_util,
                      "pixels_during_decode": layout.pixels_during_decode}
        if layout.recorded_load:
            rm["vllm"]["sync"] = {"recorded_load": True}
    if layout.mode == "server":
        rm["rollout_backend"] = "vllm"
        rm["vllm"] = {"mode": "server", "server": {
            "servers": [{"base_url": u} for u in urls], "timeout_s": 300, "infer_timeout_s": 900,
            "async_rollouts": {"enabled": layout.async_rollouts, "max_staleness_steps": 1}},
            "sync": {"mode": "full"}, "pixels_during_decode": layout.pixels_during_decode}
        if layout.fault:
            rm["vllm"]["server"].update(readmit_after_s=FAULT_READMIT_AFTER_S, readmit_max_interval_s=10.0)
    steps = work.steps
    training: dict[str, Any] = {
        "output_dir": str(out_dir), "max_steps": steps, "records_per_step": records, "learning_rate": 1e-5,
        "logging_steps": 1, "seed": 0, "disable_tqdm": True, "report_to": ["jsonl"], "packing": True,
        "packing_length": work.packing_length, "packing_buffer": 4 * records,
        "gradient_checkpointing_policy": (layout.checkpointing or work.checkpointing) if cuda else "off",
        "compile_decoder_layers": layout.compile, "bf16": cuda, "save_steps": 0}
    if cuda and layout.compile and training["gradient_checkpointing_policy"] == "auto":
        training["compile_activation_memory_budget"] = "auto"  # what the values files ship beside auto + compile
    if layout.zero:
        training["deepspeed"] = f"zero{layout.zero}"
    extra: dict[str, Any] = {}
    if work.tuner != "full":
        extra["tuner"] = {"train_type": work.tuner, "lora_rank": 16, "lora_alpha": 32}
    return {**extra,
        "model": {"path": str(model_dir), "torch_dtype": "bfloat16" if cuda else "float32"},
        "data": {"synthetic": {"num_samples": records * (steps + 1), "seed": 0, "min_objects": work.min_objects,
                               "max_objects": work.max_objects, "image_size": work.image_size}},
        "training": training,
        "custom": {"extra": {"rollout_matching": rm}},
    }


def _popen(argv: list[str], log: Path, gpus: list[int] | None) -> subprocess.Popen:
    env = {**os.environ, "VLLM_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = "1"
    return start_group(argv, log, env=env)


def _stop(proc: subprocess.Popen) -> None:
    stop_group(proc, grace_s=30.0)


def _head(path: Path, n: int = 6000) -> str:
    """The log's first lines that are not warnings (vLLM's start-up error comes early)."""
    if not path.is_file():
        return ""
    lines = [x for x in path.read_text(errors="replace").splitlines() if "Warning" not in x and "warn(" not in x]
    return "\n".join(lines)[:n]


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else ""


def stage2_steps(run_dir: Path, rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The stage-2 optimizer-step rows the learner (rank 0) has logged so far (none before its metrics file exists);
    ``rows``: the metrics file's rows, when already read."""
    rows = read_jsonl(run_dir / "metrics.jsonl") if rows is None else rows
    return [r for r in rows if r.get("phase") == "stage2" and "loss" in r]


def logged_steps(run_dir: Path) -> int:
    return len(stage2_steps(run_dir))


class ServerKill(threading.Thread):
    """``Layout.fault == "kill-server"``: once the learner logged ``after_steps`` steps, SIGKILL the server's process
    group, restart it with the same command on the same port, and wait until it answers ``/health/`` again. The
    learner must quarantine it (the decode or broadcast it was in fails), train on with the others and re-admit it
    with the current weights (``fault_outcome`` reads that from the learner's log)."""

    def __init__(self, start: Callable[[], subprocess.Popen], proc: subprocess.Popen, url: str, run_dir: Path,
                 after_steps: int = 1, timeout_s: float = 900.0):
        super().__init__(daemon=True)
        self.start_server, self.proc, self.url, self.run_dir = start, proc, url, run_dir
        self.after_steps, self.timeout_s = after_steps, timeout_s
        self.events: dict[str, Any] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        from trainer.launch.health import wait_until_healthy

        end = time.monotonic() + self.timeout_s
        while logged_steps(self.run_dir) < self.after_steps:
            if self._halt.wait(0.2) or time.monotonic() > end:
                return
        self.events["killed_after_step"] = logged_steps(self.run_dir)
        self.events["killed_at"] = time.time()
        stop_group(self.proc, grace_s=0.0)
        self.proc = self.start_server()
        self.events["restarted_at"] = time.time()
        try:
            wait_until_healthy([self.url], max(1.0, end - time.monotonic()), interval_s=0.5)
            self.events["healthy_again_at"] = time.time()
        except Exception as exc:  # noqa: BLE001 - recorded; the learner's own outcome is what the row reports
            self.events["restart_failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def fault_outcome(events: dict[str, Any], url: str, learner_log: str) -> dict[str, Any]:
    """What the learner made of a ``ServerKill``: whether (and why) it quarantined the server, whether it re-admitted
    it (after a full weight re-sync), and the restart's timings relative to the kill."""
    quarantined = next((line for line in learner_log.splitlines() if f"quarantining rollout server {url} " in line),
                       None)
    readmitted = any(f"rollout server {url} re-admitted" in line for line in learner_log.splitlines())
    t = events.get("killed_at")
    out: dict[str, Any] = {"server": url, "killed_after_step": events.get("killed_after_step"),
                           "quarantined": quarantined is not None,
                           "detected_as": quarantined.split("(", 1)[1][:240] if quarantined and "(" in quarantined
                           else None,
                           "readmitted": readmitted}
    for key in ("restarted_at", "healthy_again_at"):
        if t is not None and key in events:
            out[key.removesuffix("_at") + "_after_s"] = round(events[key] - t, 2)
    if "restart_failed" in events:
        out["restart_failed"] = events["restart_failed"]
    if t is None:
        out["not_injected"] = "the learner finished (or failed) before its first step was logged"
    return out


def measure(run_dir: Path, first_step: int = 1) -> dict[str, Any]:
    """Throughput and per-step means from a finished run's metrics (rank 0) and every rank's ledger, over the steps
    after ``first_step`` - 1 (the warm-up steps before it are left out)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = stage2_steps(run_dir, rows)
    if len(steps) <= first_step:
        raise RuntimeError(f"{len(steps)} steps logged; need more than {first_step} to measure")
    ledger = [json.loads(x) for p in sorted((run_dir / "stage2").glob("ledger*.jsonl"))
              for x in p.read_text().splitlines() if x.strip()]
    start, end = steps[first_step - 1]["time"], steps[-1]["time"]
    trained = sum(1 for r in ledger if r["step"] >= first_step)
    timed = steps[first_step:]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    setup = next((r for r in rows if r.get("phase") == "setup"), {})
    ids = [r["sample_id"] for r in ledger]
    carried = [json.loads(x)["sample_id"] for p in sorted((run_dir / "stage2").glob("carried*.jsonl"))
               for x in p.read_text().splitlines() if x.strip()]
    return {
        "window": [start, end], "steps_measured": len(timed), "trained_samples": trained,
        "trained_samples_per_s": trained / (end - start) if end > start else None,
        "step_wall_s": (end - start) / len(timed),
        "ledger": {"rows": len(ids), "duplicated": len(ids) - len(set(ids)),
                   "carried": len(carried), "carried_and_trained": len(set(carried) & set(ids))},
        "means": {k: mean(k) for k in ("time/step_s", "time/step_wall_s", "time/weight_sync_s", "time/rollout_s",
                                       "time/generate_s", "time/encode_s", "time/target_s", "time/target_ahead_s",
                                       "time/forward_s", "time/backward_s", "time/optimizer_s", "rollout/samples",
                                       "rollout/staleness_mean", "batch/rows_per_step", "batch/fill",
                                       "batch/filler_rows", "packing/carried", "gc/pause_s",
                                       "gc/gen2_collections")},
        "learner_peak_gib": max((r.get("mem/step_peak_gib", 0.0) for r in steps), default=None),
        "learner_checkpointing": setup.get("train/checkpointing_policy"),
        "learner_checkpointed_layers": setup.get("train/checkpointed_layers"),
        "learner_memory_budget": setup.get("train/compile_activation_memory_budget"),
        "learner_cpu_threads": setup.get("train/cpu_threads_per_rank"),
        "carried_at_end": len(carried),
    }


def save_model(work: Work, root: Path, cuda: bool) -> Path:
    """The random Qwen3-VL directory (built in a subprocess, so this process opens no CUDA context)."""
    out = root / f"qwen3-vl-{work.size}-random"
    if (out / ".complete").is_file():
        return out
    code = ("import sys; from pathlib import Path; from trainer.bench.scale import save_random_vl_model; "
            f"save_random_vl_model(Path({str(out)!r}), {work.size!r}, {'cuda' if cuda else 'cpu'!r})")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, **({} if cuda else {"CUDA_VISIBLE_DEVICES": ""})})
    return out


def run_layout(layout: Layout, work: Work, model_dir: Path, root: Path, cuda: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {"layout": asdict(layout), "name": layout.name, "gpus": layout.gpus}
    if layout.fault:
        work = replace(work, steps=work.steps + FAULT_EXTRA_STEPS)
        rec["steps"] = work.steps
    run_dir = root / "runs" / layout.name
    logs = root / "logs" / layout.name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True, exist_ok=True)
    servers: list[subprocess.Popen] = []
    learner: subprocess.Popen | None = None
    fault: ServerKill | None = None
    sampler = GpuSampler() if cuda else None
    learner_gpus = list(range(layout.servers, layout.gpus)) if cuda else None
    try:
        if cuda:
            wait_for_free_gpus(list(range(layout.gpus)))
        ports = listen_ports(layout.servers) if layout.servers else []
        def start_server(i: int) -> subprocess.Popen:
            argv = [sys.executable, "-m", "trainer", "serve", "--engine", "vllm" if cuda else "hf", "--model",
                    str(model_dir), "--host", "127.0.0.1", "--port", str(ports[i]), "--log-level", "warning"]
            if cuda:
                argv += ["--max-model-len", "4096", "--gpu-memory-utilization", str(work.server_util)]
            return _popen(argv, logs / f"server-{i}.log", [i] if cuda else None)

        servers.extend(start_server(i) for i in range(len(ports)))
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        if urls:
            from trainer.launch.health import wait_until_healthy

            def abort() -> str | None:
                dead = [i for i, s in enumerate(servers) if s.poll() is not None]
                return f"server {dead[0]} exited: {_tail(logs / f'server-{dead[0]}.log', 2000)}" if dead else None

            took = wait_until_healthy(urls, work.timeout_s, interval_s=1.0, abort=abort)
            rec["servers_ready_s"] = max(took.values())
        cfg_path = logs / "config.yaml"
        cfg_path.write_text(yaml.safe_dump(layout_config(layout, work, model_dir, run_dir, urls, cuda)))
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(layout.learner_gpus),
                "--master-addr", "127.0.0.1", "--master-port", str(listen_port()), "-m", "trainer", "train",
                "--config", str(cfg_path)]
        if sampler is not None:
            sampler.start()
        t0 = time.perf_counter()
        learner = _popen(argv, logs / "learner.log", learner_gpus)
        if layout.fault == "kill-server" and servers:
            victim = len(servers) - 1
            fault = ServerKill(lambda: start_server(victim), servers[victim], urls[victim], run_dir,
                               timeout_s=work.timeout_s)
            fault.start()
        try:
            rc = learner.wait(work.timeout_s)
        except subprocess.TimeoutExpired:
            _stop(learner)
            raise RuntimeError(f"learner did not finish in {work.timeout_s:.0f} s") from None
        finally:
            if fault is not None:
                fault.stop()
                servers[-1] = fault.proc
                learner_log = logs / "learner.log"
                rec["fault"] = fault_outcome(fault.events, urls[-1],
                                             learner_log.read_text(errors="replace") if learner_log.is_file() else "")
        rec["learner_wall_s"] = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"learner exited with {rc}")
        rec.update(measure(run_dir))
        records = layout.records_per_step or work.records_per_step
        # every record a step took is trained (some rank's ledger) or still waits in some rank's carry: none lost
        rec["ledger"]["unaccounted"] = records * work.steps - rec["ledger"]["rows"] - rec["ledger"]["carried"]
        if sampler is not None:
            sampler.stop()
            rec["gpu"] = sampler.summary(*rec["window"])
            busy = rec["gpu"].get("busy_pct")
            if busy and learner_gpus:
                rec["learner_idle_pct"] = round(100 - sum(busy[g] for g in learner_gpus) / len(learner_gpus), 1)
    except Exception as exc:  # noqa: BLE001 - recorded; the other layouts still run
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:800]}"
        rec["learner_log_head"] = _head(logs / "learner.log")  # where a start-up failure names its cause
        rec["learner_log_tail"] = _tail(logs / "learner.log")
    finally:
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        if learner is not None:
            _stop(learner)  # also a learner that exited: what its ranks left in its group, and its entry as a live group
        for s in servers:
            _stop(s)
    return rec


#: the Layout fields that choose how the learner and its engine run, not where: a layout that sets any of them is also
#: set against the colocate-1 run that sets the same ones
LEVERS = ("checkpointing", "compile", "pixels_during_decode", "sleep_level", "recorded_load")


_COLOCATE_1 = asdict(Layout("colocate-1", 1))


def _levers(rec: dict[str, Any]) -> tuple[Any, ...]:
    lay = rec.get("layout") or {}
    return tuple(lay.get(k, _COLOCATE_1[k]) for k in LEVERS)


def _is_colocate_1(rec: dict[str, Any]) -> bool:
    """colocate-1's placement and work, whatever its levers (``LEVERS``): a same-levers baseline."""
    lay = rec.get("layout") or {}
    return all(lay.get(k) == v for k, v in _COLOCATE_1.items() if k != "name" and k not in LEVERS)


def compare(records: list[dict[str, Any]]) -> None:
    """``per_gpu_efficiency``: trained samples/s per GPU against colocate-1's; ``speedup_vs_colocate_1``. A layout
    that sets any of ``LEVERS`` (the learner's checkpointing and compile, the engine's pixels, sleep level and
    recorded load) is also set against the colocate-1 run with exactly those levers, where one ran:
    ``speedup_vs_same_learner_colocate_1``, ``per_gpu_efficiency_same_learner`` (what the placement gives, apart from
    what the levers give)."""
    base = next((r.get("trained_samples_per_s") for r in records if r["name"] == "colocate-1"), None)
    default = _levers({})
    for r in records:
        sps = r.get("trained_samples_per_s")
        if base and sps:
            r["speedup_vs_colocate_1"] = round(sps / base, 3)
            r["per_gpu_efficiency"] = round(sps / base / r["gpus"], 3)
        if _levers(r) == default or not sps:
            continue
        same = next((c.get("trained_samples_per_s") for c in records
                     if _is_colocate_1(c) and _levers(c) == _levers(r) and c.get("trained_samples_per_s")), None)
        if same:
            r["speedup_vs_same_learner_colocate_1"] = round(sps / same, 3)
            r["per_gpu_efficiency_same_learner"] = round(sps / same / r["gpus"], 3)


def merge_calls(calls: list[Path], numbers: list[int] | None = None, **fields: Any) -> dict[str, Any]:
    """One result from several layouts-bench calls on one held machine (``calls``: their ``layouts.json``, in call
    order): every record tagged with its ``call`` (``numbers``, else 1, 2, ...), the ratios recomputed over all of
    them (``compare``: the baselines may come from another call on the same machine), ``fields`` (session, device,
    note) added."""
    results = [json.loads(Path(c).read_text()) for c in calls]
    numbers = numbers or list(range(1, len(results) + 1))
    records = [{**r, "call": n} for n, res in zip(numbers, results, strict=True) for r in res["layouts"]]
    compare(records)
    return {**results[0], "layouts": records, **fields}


def figure(result: dict[str, Any]):
    """The layouts figure, or None when no layout has a throughput: trained samples/s per layout, and each layout's
    per-GPU efficiency against colocate-1 where the run measured colocate-1; a layout without one is marked "no
    colocate-1 in this run" instead of drawn as a zero bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["layouts"] if r.get("trained_samples_per_s")]
    if not ok:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    names = [r["name"] for r in ok]
    xs = list(range(len(ok)))
    a.bar(xs, [r["trained_samples_per_s"] for r in ok], color="tab:blue")
    a.set_ylabel("trained samples / s")
    a.set_title(f"{result['work']['size']}, {result['work']['records_per_step']} records/step")
    efficiency = [r.get("per_gpu_efficiency") for r in ok]
    measured = [(x, e) for x, e in zip(xs, efficiency) if e is not None]
    same = [(x, r.get("per_gpu_efficiency_same_learner")) for x, r in zip(xs, ok)]
    same = [(x, e) for x, e in same if e is not None]
    width = 0.4 if same else 0.8
    b.bar([x - (0.2 if same else 0) for x, _ in measured], [e for _, e in measured], width=width, color="tab:green",
          label="vs colocate-1")
    if same:
        b.bar([x + 0.2 for x, _ in same], [e for _, e in same], width=width, color="tab:olive",
              label="vs colocate-1 with the same learner levers")
        b.legend(fontsize=7, loc="lower right")
    b.axhline(1.0, color="grey", lw=0.8)
    for x in (x for x, e in zip(xs, efficiency) if e is None):
        b.text(x, 0.5, "no colocate-1\nin this run", ha="center", va="center", fontsize=8, color="grey")
    b.set_ylim(0, 1.1 * max([1.0, *(e for _, e in measured), *(e for _, e in same)]))
    b.set_xlim(-0.6, len(ok) - 0.4)
    b.set_ylabel("per-GPU efficiency vs colocate-1")
    for ax in (a, b):
        ax.set_xticks(xs, names, rotation=45, ha="right")
    fig.suptitle(result.get("device", ""))
    fig.tight_layout()
    return fig


def plot(result: dict[str, Any], path: Path) -> None:
    """``figure`` saved to ``path`` (nothing written when no layout has a throughput)."""
    import matplotlib.pyplot as plt

    fig = figure(result)
    if fig is None:
        return
    fig.savefig(path, dpi=110)
    plt.close(fig)


def select(layouts: tuple[Layout, ...], gpus: int, names: str | None) -> list[Layout]:
    """The layouts that fit ``gpus``: every one in table order, or ``names`` (comma-separated) in the order named, so
    that the layout a call's limit must not cut runs first."""
    fits = [lay for lay in layouts if lay.gpus <= max(gpus, 1)]
    if not names:
        return fits
    wanted = list(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
    unknown = [n for n in wanted if n not in {lay.name for lay in layouts}]
    if unknown:
        raise ValueError(f"RM_BENCH_LAYOUTS: unknown layout(s) {unknown}; known: {[x.name for x in layouts]}")
    by_name = {lay.name: lay for lay in fits}
    return [by_name[n] for n in wanted if n in by_name]


def run(out_dir: str | Path, quick: bool = False, work_dir: str | Path | None = None) -> dict[str, Any]:
    """``RM_BENCH_LAYOUTS``: layout names to run, in that order (default: every one that fits; a named one the
    machine cannot hold is printed and listed under ``skipped``); ``RM_BENCH_LAYOUT_SIZE``: 2b | 4b;
    ``RM_BENCH_LAYOUT_RECORDS`` / ``_STEPS`` / ``_NEW_TOKENS`` / ``_TUNER``: the work; ``RM_BENCH_LAYOUT_TIMEOUT_S``:
    the most one layout's server start and learner may take (keep it inside the calling shell's own limit, so every finished
    layout is measured and written)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gpus = gpu_count()
    cuda = gpus > 0 and not quick
    work = QUICK_WORK if not cuda else Work()
    env = os.environ
    overrides = {"size": env.get("RM_BENCH_LAYOUT_SIZE"), "records_per_step": env.get("RM_BENCH_LAYOUT_RECORDS"),
                 "steps": env.get("RM_BENCH_LAYOUT_STEPS"), "max_new_tokens": env.get("RM_BENCH_LAYOUT_NEW_TOKENS"),
                 "timeout_s": env.get("RM_BENCH_LAYOUT_TIMEOUT_S"), "tuner": env.get("RM_BENCH_LAYOUT_TUNER")}
    if overrides["tuner"] and overrides["tuner"] not in TUNERS:
        raise SystemExit(f"RM_BENCH_LAYOUT_TUNER={overrides['tuner']!r}: one of {', '.join(TUNERS)}")
    casts = {"size": str, "timeout_s": float, "tuner": str}
    work = replace(work, **{k: casts.get(k, int)(v) for k, v in overrides.items() if v})
    table = LAYOUTS if cuda else QUICK_LAYOUTS
    names = env.get("RM_BENCH_LAYOUTS")
    layouts = select(table, gpus if cuda else 3, names)
    skipped = [{"name": lay.name, "gpus": lay.gpus, "why": f"needs {lay.gpus} GPUs, this machine has {gpus}"}
               for lay in (select(table, sys.maxsize, names) if names else []) if lay not in layouts]
    for sk in skipped:
        print(f"bench layouts: skipping {sk['name']}: {sk['why']}", flush=True)
    root = Path(work_dir or env.get("RM_BENCH_WORK", "/tmp/rm-bench-layouts"))
    root.mkdir(parents=True, exist_ok=True)
    model_dir = save_model(work, root, cuda)
    result: dict[str, Any] = {"work": asdict(work), "gpus": gpus, "layouts": [], "skipped": skipped,
                              "device": _device_name() if cuda else "cpu (quick: tiny model, HF backend, gloo)"}
    name = "layouts.json" if cuda else "layouts_quick.json"
    for layout in layouts:
        print(f"bench layouts: {layout.name} ({layout.gpus} GPU(s)) ...", flush=True)
        rec = run_layout(layout, work, model_dir, root, cuda)
        result["layouts"].append(rec)
        compare(result["layouts"])
        (out / name).write_text(json.dumps(result, indent=2))
        print(f"bench layouts: {layout.name}: " + (rec.get("error") or
              f"{rec['trained_samples_per_s']:.2f} samples/s, step {rec['step_wall_s']:.2f} s, "
              f"rows/step {rec['means'].get('batch/rows_per_step')}, busy {rec.get('gpu', {}).get('busy_pct')}, "
              f"checkpointing {rec.get('learner_checkpointing')}"),
              flush=True)
    plot(result, out / name.replace(".json", ".png"))
    return result


def _device_name() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        return f"{n} x {pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))}"
    except Exception:  # noqa: BLE001
        return "unknown"
