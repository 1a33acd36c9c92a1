"""Run a benchmark table (``python -m trainer bench run benchmarks/<table>.yaml [--only NAME,...]``).

Each variant runs through the product's own entry points, one after the other: its rollout servers (``trainer
launch server``, one GPU each, GPUs 0..S-1, bound to their GPUs' cores when the learner is: ``server_argv``), then
its learner (``torch.distributed.run -m trainer train`` on the next GPUs) with the variant's validated config. A
variant whose table asks for TRL (one GPU, colocate) then runs TRL's GRPOTrainer on the same model, records and
lengths (``trainer.bench.trl_peer``). The record of each variant
(``trainer.bench.measure``: trained samples/s, per-phase means and split, MFU, the weight sync's parts, the ledger
check, ``recompiles_after_first_step``, busy % and peak memory of every GPU from NVML) is written to
``<out>/<table>.json`` as soon as it is measured, with the date, machine, versions and the command that reproduces
it. A variant that fails is recorded with its error and log; the others still run.

A learning table (``kind: learning``, ``trainer.bench.learning``) runs each variant at each of its seeds the same
way; its record is what the run learned (held-out metrics after stage 1 and after stage 2, times, mismatch) and
``<table>.json`` adds ``summary``: each variant's mean and spread over the seeds. A learning variant with servers
first writes its model (``model.tiny`` at the seed) to a folder that the servers and the learner both load.

Without a GPU the table must train the ``tiny`` model with the HF backend (and ``server: {engine: hf}``); the
learner's ranks then use gloo.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from trainer.bench import learning
from trainer.bench.measure import Work, measure, recomputed_fraction, stage2_steps, summarise_steps, trl_over_ours
from trainer.bench.models import peak_bf16_tflops
from trainer.bench.processes import start_group, stop_group
from trainer.bench.table import Table, Variant, records_per_step, select, server_settings, set_dotted, variant_config
from trainer.config.schema import validate_config
from trainer.launch.ports import listen_port, listen_ports
from trainer.telemetry import read_jsonl

#: seconds between the starts of side-by-side seeds (``parallel_seeds``): a vLLM engine sizes its share from the
#: memory free when it starts, so the next seed's engine starts after the last one has taken its share
PARALLEL_SEED_STAGGER_S = 45.0


def gpu_names() -> list[str]:
    """The GPUs NVML sees (none without a driver); the bench process itself never opens a CUDA context."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return [str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no NVML: a CPU machine
        return []


def gpu_holders(gpus: list[int]) -> dict[int, list[int]]:
    """The pids other than this process with a compute context on each of ``gpus`` (only GPUs that have some)."""
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
    """Wait until no process holds any of ``gpus`` (the last variant's engines may still be exiting); ``RuntimeError``
    naming the GPUs and pids after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while held := holders(gpus):
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


def servers_node_bound(table: Table, variant: Variant, where: Path) -> bool:
    """Whether ``variant``'s servers share the host by GPU block: its learner has ``training.cpu_affinity: node``."""
    return variant_config(table, variant, where).get("training", {}).get("cpu_affinity") == "node"


def server_argv(table: Table, variant: Variant, model_dir: Path, port: int, gpu: int | None,
                node_bound: bool) -> list[str]:
    """One of ``variant``'s rollout servers as a user starts it (``python -m trainer launch server``) on host GPU
    ``gpu``, with the variant's engine settings (else the table's); with ``node_bound`` (the variant's learner has
    ``training.cpu_affinity: node``, as the server presets ship it) bound to its GPU's block of cores
    (``--cpu-affinity node``), so servers and learner share the host as they do deployed."""
    settings = server_settings(table, variant)
    argv = [sys.executable, "-m", "trainer", "launch", "server", "--engine", settings.engine,
            "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    if gpu is not None:
        argv += ["--gpus", str(gpu)]
    if settings.engine == "vllm":
        argv += ["--max-model-len", str(settings.max_model_len), "--gpu-memory-utilization",
                 str(settings.gpu_memory_utilization)]
    if node_bound:
        argv += ["--cpu-affinity", "node"]
    return argv + ["--", "--log-level", "warning"]


def _popen(argv: list[str], log: Path, gpus: list[int] | None) -> subprocess.Popen:
    env = {**os.environ, "VLLM_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus)) if gpus is not None else ""
    if gpus is None:
        env["OMP_NUM_THREADS"] = "1"
    return start_group(argv, log, env=env)


def _head(path: Path, n: int = 6000) -> str:
    """The log's first lines that are not warnings (vLLM's start-up error comes early)."""
    if not path.is_file():
        return ""
    lines = [x for x in path.read_text(errors="replace").splitlines() if "Warning" not in x and "warn(" not in x]
    return "\n".join(lines)[:n]


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else ""


def save_model(size: str, root: Path, cuda: bool) -> Path:
    """The random Qwen3-VL directory (built in a subprocess, so this process opens no CUDA context)."""
    out = root / f"qwen3-vl-{size}-random"
    code = ("from pathlib import Path; from trainer.bench.models import save_random_vl_model; "
            f"save_random_vl_model(Path({str(out)!r}), {size!r}, {'cuda' if cuda else 'cpu'!r})")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, **({} if cuda else {"CUDA_VISIBLE_DEVICES": ""})})
    return out


def work_of(size: str, cfg: dict[str, Any], learner_gpus: int) -> Work:
    """What one learner rank does per step under ``cfg`` (a validated variant config, as a mapping)."""
    t, tuner = cfg["training"], cfg.get("tuner") or {}
    rm = cfg["custom"]["extra"]["rollout_matching"]
    train_type = tuner.get("train_type", "full")
    return Work(size=size, batch=records_per_step(t, learner_gpus) // learner_gpus,
                image_size=cfg["data"]["synthetic"].get("image_size", 64),
                tuner=train_type, lora_rank=tuner.get("lora_rank", 0) if train_type != "full" else 0,
                max_new_tokens=rm.get("decoding", {}).get("max_new_tokens", 0),
                profile_step=(t.get("profile_steps") or [0])[0])


def trl_missing() -> str | None:
    """Why TRL's side cannot run here (the packages ``trainer.bench.trl_peer`` imports), said before any variant runs,
    or None."""
    import importlib.util

    from trainer.extras import EXTRAS

    liger_module, liger_install = EXTRAS["liger"]
    missing = [m for m in ("trl", "peft", liger_module.partition(".")[0]) if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"this table runs TRL's GRPOTrainer beside its variants, but {', '.join(missing)} cannot be imported "
            f"here: install trl==0.29.1, peft and liger-kernel ({liger_install}), or run variants without `trl: true`")


def trl_peer_args(cfg: dict[str, Any], work: Work, model_dir: Path, data: Path, out: Path) -> list[str]:
    """``python -m trainer.bench.trl_peer`` arguments for the same model, records, batch, lengths and vLLM share as
    ``cfg``; TRL runs with ``use_liger_kernel`` (its kernels and fused GRPO loss)."""
    vllm = cfg["custom"]["extra"]["rollout_matching"].get("vllm") or {}
    return ["-m", "trainer.bench.trl_peer", str(model_dir), str(data), str(out), "--steps",
            str(cfg["training"]["max_steps"]), "--batch", str(work.batch), "--max-new-tokens", str(work.max_new_tokens),
            "--vllm-util", str(vllm.get("gpu_memory_utilization", 0.3)), "--lora-rank", str(work.lora_rank),
            "--liger"]


def save_learning_model(table: Table, variant: Variant, where: Path, root: Path, seed: int) -> Path | None:
    """The folder a learning variant's servers and learner load: its ``model.tiny`` at ``seed`` written there (in a
    subprocess); its ``model.path`` as given; None without servers (the learner builds its own)."""
    if not variant.servers:
        return None
    from trainer.config.schema import validate_config as _validate

    m = _validate(variant_config(table, variant, where, seed=seed)).model
    if m.path is not None:
        return Path(m.path)
    out = root / "models" / f"{variant.name}-seed{seed}"
    code = ("from pathlib import Path; from trainer.modeling.fixtures import TinyShape, save_tiny_model; "
            f"save_tiny_model(Path({str(out)!r}), {m.tiny!r}, {m.tiny_seed!r}, "
            f"shape=TinyShape(**{m.tiny_shape.model_dump()!r}))")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return out


def run_variant(table: Table, variant: Variant, where: Path, model_dir: Path | None, root: Path, cuda: bool,
                seed: int | None = None, stage: str = "all") -> dict[str, Any]:
    """One variant (a learning table's: at ``seed``): servers, learner, measurement (and TRL's side); errors are
    recorded, never raised. ``stage`` (a learning table's ``shared_warmup``): ``warmup``, the warm-up alone
    (``training.max_steps: 0``); ``stage2``, stage 2 from the warm-up checkpoint ``model_dir`` (``stage1.steps: 0``);
    ``all``, both in one run."""
    learns = table.kind == "learning"
    name = f"{variant.name}@seed{seed}" if learns else variant.name
    rec: dict[str, Any] = {"name": name, "model": variant.model or table.model, "gpus": variant.gpus,
                           "learner_gpus": variant.learner_gpus, "servers": variant.servers,
                           "baseline": variant.baseline or variant.name}
    if learns:
        rec.update(variant=variant.name, seed=seed,
                   backend=learning.backend_of(variant_config(table, variant, where, seed=seed)))
    if variant.servers:
        rec["server"] = server_settings(table, variant).model_dump()
    run_dir, logs = root / "runs" / name, root / "logs" / name
    for d in (run_dir, logs):
        shutil.rmtree(d, ignore_errors=True)
    logs.mkdir(parents=True)
    servers: list[subprocess.Popen] = []
    learner: subprocess.Popen | None = None
    sampler = GpuSampler() if cuda else None
    learner_gpus = (([0] if variant.share_gpu else list(range(variant.servers, variant.gpus))) if cuda else None)
    try:
        if cuda and not table.parallel_seeds:
            wait_for_free_gpus(list(range(variant.gpus)))
        ports = listen_ports(variant.servers) if variant.servers else []
        node_bound = cuda and servers_node_bound(table, variant, where)
        for i, port in enumerate(ports):
            argv = server_argv(table, variant, model_dir, port, i if cuda else None, node_bound)
            servers.append(_popen(argv, logs / f"server-{i}.log", [i] if cuda else None))
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        if urls:
            from trainer.launch.health import wait_until_healthy

            def abort() -> str | None:
                dead = [i for i, s in enumerate(servers) if s.poll() is not None]
                return f"server {dead[0]} exited: {_tail(logs / f'server-{dead[0]}.log', 2000)}" if dead else None

            rec["servers_ready_s"] = max(wait_until_healthy(urls, table.timeout_s, interval_s=1.0,
                                                            abort=abort).values())
        cfg = variant_config(table, variant, where, model_dir=str(model_dir) if model_dir else None,
                             output_dir=str(run_dir), urls=urls, seed=seed)
        if stage == "warmup":
            set_dotted(cfg, "training.max_steps", 0)
        elif stage == "stage2":
            set_dotted(cfg, "stage1.steps", 0)
        validate_config(cfg, source=variant.name)
        rec["config"] = cfg
        (logs / "config.yaml").write_text(yaml.safe_dump(cfg))
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(variant.learner_gpus),
                "--master-addr", "127.0.0.1", "--master-port", str(listen_port()), "-m", "trainer", "train",
                "--config", str(logs / "config.yaml")]
        if sampler is not None:
            sampler.start()
        t0 = time.perf_counter()
        learner = _popen(argv, logs / "learner.log", learner_gpus)
        try:
            rc = learner.wait(table.timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"learner did not finish in {table.timeout_s:.0f} s (the table's timeout_s)") from None
        rec["learner_wall_s"] = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"learner exited with {rc}")
        if learns:
            rec.update(learning.warmup_record(run_dir) if stage == "warmup" else learning.learning_record(run_dir))
            return rec
        work = work_of(variant.model or table.model, cfg, variant.learner_gpus)
        rec.update(measure(run_dir, records_per_step(cfg["training"], variant.learner_gpus), table.warmup_steps))
        steps = stage2_steps(read_jsonl(run_dir / "metrics.jsonl"))
        peak = peak_bf16_tflops(gpu_names()[learner_gpus[0]]) if cuda and learner_gpus else None
        full = cfg["training"].get("gradient_checkpointing_policy", "full") == "full"
        rec["phases"] = summarise_steps(work, steps, recomputed_fraction(rec["learner"], full), peak_tflops=peak)
        if sampler is not None:
            sampler.stop()
            rec["gpu"] = sampler.summary(*rec["window"])
        wants_trl = table.trl if variant.trl is None else variant.trl
        if wants_trl and cuda and variant.gpus == 1:
            _stop_all(learner, servers)
            learner, servers = None, []
            rec["trl"] = trl_side_by_side(cfg, work, model_dir, run_dir, rec["phases"])
    except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:800]}"
        rec["learner_log_head"] = _head(logs / "learner.log")
        rec["learner_log_tail"] = _tail(logs / "learner.log")
    finally:
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        _stop_all(learner, servers)
    return rec


def _stop_all(learner: subprocess.Popen | None, servers: list[subprocess.Popen]) -> None:
    for proc in ([learner] if learner is not None else []) + servers:
        stop_group(proc, grace_s=30.0)


def trl_side_by_side(cfg: dict[str, Any], work: Work, model_dir: Path, run_dir: Path, ours: dict[str, Any]
                     ) -> dict[str, Any]:
    """TRL's GRPOTrainer on ``run_dir``'s records (its own process), and the ratios TRL / ours (> 1: we are faster)."""
    out = run_dir.parent / f"{run_dir.name}-trl.json"
    cmd = [sys.executable, *trl_peer_args(cfg, work, model_dir, run_dir / "data" / "train.jsonl", out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_PLUGINS": ""})
    if proc.returncode or not out.is_file():
        return {"error": f"trl_peer exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"}
    trl = json.loads(out.read_text())
    trl["trl_over_ours"] = trl_over_ours(trl, ours)
    return trl


def compare(records: list[dict[str, Any]]) -> None:
    """Each record's throughput per GPU, and against its ``baseline`` record's (same result) where both have one:
    ``speedup_vs_baseline`` and ``per_gpu_vs_baseline`` (1.0: the extra GPUs paid for themselves exactly)."""
    by_name = {r["name"]: r for r in records}
    for r in records:
        sps = r.get("trained_samples_per_s")
        if not sps:
            continue
        r["trained_samples_per_s_per_gpu"] = sps / r["gpus"]
        base = by_name.get(r["baseline"], {})
        if base.get("trained_samples_per_s"):
            r["speedup_vs_baseline"] = round(sps / base["trained_samples_per_s"], 3)
            r["per_gpu_vs_baseline"] = round(r["trained_samples_per_s_per_gpu"]
                                             / (base["trained_samples_per_s"] / base["gpus"]), 3)


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("torch", "vllm", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def run(table: Table, table_path: Path, out_dir: Path, only: str | None = None, work_dir: Path | None = None
        ) -> dict[str, Any]:
    """Run ``only`` (or every) variant of ``table`` that fits the machine into ``out_dir/<table>.json``."""
    names = gpu_names()
    cuda = bool(names)
    variants = select(table, only)
    if not cuda and table.kind == "speed" and (big := sorted({v.model or table.model for v in variants} - {"tiny"})):
        raise SystemExit(f"bench run: {table_path} trains a random Qwen3-VL-{', '.join(big).upper()} and needs CUDA "
                         "GPUs; on a CPU run a table of the tiny model (benchmarks/cpu.yaml)")
    fits = [v for v in variants if not cuda or v.gpus <= len(names)]
    skipped = [{"name": v.name, "why": f"needs {v.gpus} GPUs, this machine has {len(names)}"}
               for v in variants if v not in fits]
    if cuda and any(v.trl if v.trl is not None else table.trl for v in fits) and (missing := trl_missing()):
        raise SystemExit(missing)
    for s in skipped:
        print(f"bench run: skipping {s['name']}: {s['why']}", flush=True)
    root = work_dir or Path("/tmp/rm-bench") / table_path.stem
    root.mkdir(parents=True, exist_ok=True)
    machine = f"{len(names)} x {names[0]}" if cuda else "cpu"
    stamp = {"date": datetime.date.today().isoformat(), "machine": machine, **_versions()}
    result: dict[str, Any] = {"table": str(table_path), **stamp, "records": [], "skipped": skipped}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{table_path.stem}.json"
    if table.kind == "learning":
        return _run_learning(table, table_path, fits, root, cuda, stamp, result, path)
    for v in fits:
        print(f"bench run: {v.name} ({v.gpus} GPU(s)) ...", flush=True)
        model_dir = save_model(v.model or table.model, root, cuda)
        rec = {**run_variant(table, v, table_path.parent, model_dir, root, cuda), **stamp,
               "command": f"python -m trainer bench run {table_path} --only {v.name}"}
        result["records"].append(rec)
        compare(result["records"])
        path.write_text(json.dumps(result, indent=2))
        print(f"bench run: {v.name}: " + (rec.get("error") or
              f"{rec['trained_samples_per_s']:.2f} samples/s, step {rec['step_wall_s']:.2f} s, recompiles after the "
              f"first step {rec['recompiles_after_first_step']}"), flush=True)
    return result


def _run_learning(table: Table, table_path: Path, variants: list[Variant], root: Path, cuda: bool,
                  stamp: dict[str, Any], result: dict[str, Any], path: Path) -> dict[str, Any]:
    """Every variant at every seed (seed-major, so a cut-short run has each variant at its first seeds; with
    ``parallel_seeds`` the seeds side by side), the summary rewritten after each record. With ``shared_warmup`` a
    seed's warm-up runs first (record ``warmup@seedN``) and its variants start from its checkpoint; the summary's
    ``comparisons`` give, per seed, each variant's difference from the warm-up and from the ``control`` with a paired
    bootstrap interval over the held-out images."""
    lock = threading.Lock()
    command = f"python -m trainer bench run {table_path}"

    def record(rec: dict[str, Any]) -> None:
        with lock:
            rec.update(stamp, command=command + (f" --only {rec['variant']}" if rec.get("variant") != "warmup"
                                                 else ""))
            result["records"].append(rec)
            result["summary"] = learning.summarise([r for r in result["records"] if r.get("variant") != "warmup"])
            path.write_text(json.dumps(result, indent=2))
            print(f"bench run: {rec['name']}: " + (rec.get("error") or
                  f"F1@0.5 {rec['after_stage1'].get('f1@50', float('nan')):.3f} -> "
                  f"{rec.get('after_stage2', rec['after_stage1']).get('f1@50', float('nan')):.3f}"), flush=True)

    def one_seed(seed: int) -> None:
        warm_dir = None
        if table.shared_warmup:
            print(f"bench run: warm-up at seed {seed} ...", flush=True)
            warm = Variant(name="warmup")
            rec = run_variant(table, warm, table_path.parent, None, root, cuda, seed=seed, stage="warmup")
            record(rec)
            if "error" in rec:
                for v in variants:
                    record({"name": f"{v.name}@seed{seed}", "variant": v.name, "seed": seed, "backend": None,
                            "error": f"its seed's warm-up failed: {rec['error']}"})
                return
            warm_dir = root / "runs" / rec["name"] / "final"
        for v in variants:
            print(f"bench run: {v.name} at seed {seed} ({v.gpus} GPU(s)) ...", flush=True)
            try:
                model_dir = warm_dir or save_learning_model(table, v, table_path.parent, root, seed)
            except subprocess.CalledProcessError as exc:
                rec = {"name": f"{v.name}@seed{seed}", "variant": v.name, "seed": seed, "backend": None,
                       "error": f"writing its model failed: {exc}"}
            else:
                rec = run_variant(table, v, table_path.parent, model_dir, root, cuda, seed=seed,
                                  stage="stage2" if warm_dir else "all")
            record(rec)

    if table.parallel_seeds:
        with concurrent.futures.ThreadPoolExecutor(len(table.seeds)) as pool:
            futures = []
            for i, seed in enumerate(table.seeds):
                futures.append(pool.submit(one_seed, seed))
                if i + 1 < len(table.seeds):
                    time.sleep(PARALLEL_SEED_STAGGER_S)  # one engine starts at a time: each sizes its memory share
            for f in futures:
                f.result()
    else:
        for seed in table.seeds:
            one_seed(seed)
    done = [r for r in result["records"] if "error" not in r]
    result["comparisons"] = learning.compare_runs(done, root / "runs", table.control, table.bootstrap_draws)
    path.write_text(json.dumps(result, indent=2))
    print(learning.markdown(result.get("summary", {})), flush=True)
    print(learning.comparisons_markdown(result["comparisons"]), flush=True)
    return result
