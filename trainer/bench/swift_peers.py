"""ms-swift peers on one or two GPUs: our code against the real ms-swift processes, both directions.

``python -m trainer.bench.swift_peers --out DIR [--only rollout|rlhf] [--size text|4b]`` writes
``DIR/swift_peers.json`` and keeps every subprocess's full log in ``DIR/logs/``:

* ``rollout``: the real ``swift rollout`` (built by our launcher, ``trainer.launch.commands.swift_rollout_command``)
  on a small random-weight Qwen3 text model, driven by OUR client (``ServerRolloutEngine``, in a subprocess of its
  own): ``/health/``, the engine-type probe, a batch of 8 requests x 64 new tokens, a full weight sync through
  ``sync.transport: nccl`` (the only transport ``swift rollout`` has), a generate after it (same client, then a
  fresh one);
* ``rlhf``: ms-swift's GRPO trainer (``swift rlhf``, argv built by our launcher from
  ``configs/summary_1024_attr_key_recall.yaml`` shrunk to the tiny model, ``use_vllm: true``, ``vllm_mode: server``)
  against OUR server (``python -m trainer serve --engine vllm``), 2 steps. Sampling at ``GRPO_TEMPERATURE`` (1.0),
  and besides the config's summary rewards (constant at random weights: no parseable summary) the run scores
  ``signal.length_distinct`` (``trainer/grpo/signal_reward.py``, added to the argv with its plugin), which differs
  between a prompt's completions, so GRPO has advantages to learn from; every step's reward, reward_std,
  frac_reward_zero_std, loss and grad_norm are read from ms-swift's logs into ``rlhf.per_step``, and
  ``rlhf.learning_signal`` says whether every step (after the first) had reward_std > 0 and grad_norm > 0
  (``trainer.grpo.signal_reward``).

On one GPU the NCCL weight sync puts two ranks on the same device, which NCCL refuses; whatever happens is recorded
(error text, log excerpts), never hidden. ``protocol_findings`` lists what the peers did that disagrees with our
protocol code: non-2xx answers in either server's access log, endpoint answers whose fields differ between
``swift rollout`` and our server, and routes one server has and the other lacks.

Never hangs: every subprocess runs in its own session with a timeout and its whole process group is killed at the
end; one global deadline (``BUDGET_S``, under 8 minutes) bounds the run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.bench.processes import start_group, stop_group
from trainer.launch.ports import listen_port as free_port  # below the ephemeral range

BUDGET_S = 460.0  # the whole run, both directions (the brief: under 8 minutes)
ROLLOUT_SHARE = 0.5  # of the budget when both directions run
HOST = "127.0.0.1"
MODEL_TYPE = "qwen3"
TEMPLATE = "qwen3_nothinking"  # as tests/grpo/test_swift_grpo_cpu.py: the tiny tokenizer's chat template, no <think>
BATCH = 8
NEW_TOKENS = 64
SUMMARY_CONFIG = "configs/summary_1024_attr_key_recall.yaml"
REPO = Path(__file__).resolve().parents[2]
GRPO_TEMPERATURE = 1.0  # > 0: a prompt's num_generations completions must differ, or their rewards cannot
SIGNAL_REWARD = "signal.length_distinct"  # trainer/grpo/signal_reward.py (module docstring there)
SIGNAL_REWARD_WEIGHT = 1.0
SIGNAL_PLUGIN = REPO / "trainer/grpo/signal_reward.py"


@dataclass(frozen=True)
class RlhfShape:
    """The model and GRPO settings of the rlhf direction. ``text``: a random Qwen3 text model (the 0.6B shape on a
    GPU, tiny on the CPU) on the summary rows without images, the protocol check. ``4b``: a random
    Qwen3-VL-4B on the summary rows with ~1024x1024 images, the summary config's DoRA r32 on ViT + LLM, completions of
    the config's 2048 tokens (random weights never stop), gradient checkpointing, CUDA graphs on the server."""

    name: str
    model_type: str
    template: str
    images: bool
    image_size: int
    max_completion_length: int
    max_length: int
    per_device_train_batch_size: int
    num_generations: int
    generation_batch_size: int
    max_steps: int
    gradient_checkpointing: bool
    max_model_len: int
    enforce_eager: bool


RLHF_SHAPES = {
    "text": RlhfShape("text", MODEL_TYPE, TEMPLATE, images=False, image_size=64, max_completion_length=NEW_TOKENS,
                      max_length=1024, per_device_train_batch_size=2, num_generations=2, generation_batch_size=4,
                      max_steps=2, gradient_checkpointing=False, max_model_len=2048, enforce_eager=True),
    "4b": RlhfShape("4b", "qwen3_vl", "qwen3_vl", images=True, image_size=1024, max_completion_length=2048,
                    max_length=8192, per_device_train_batch_size=4, num_generations=4, generation_batch_size=4,
                    max_steps=3, gradient_checkpointing=True, max_model_len=8192, enforce_eager=False),
}


def placement(device_count: int) -> dict[str, Any]:
    """Where each direction's two processes run: on 2+ GPUs the server (ours or ``swift rollout``) on GPU 0 and the
    other side (ms-swift's learner or our rollout client) on GPU 1 (NCCL needs two devices); on one GPU (or none)
    both share it, the server at 0.3 of its memory."""
    if device_count >= 2:
        return {"server_env": {"CUDA_VISIBLE_DEVICES": "0"}, "learner_gpus": [1], "server_util": 0.85,
                "layout": "server on GPU 0, learner on GPU 1"}
    return {"server_env": {}, "learner_gpus": None, "server_util": 0.3, "layout": "one device shared"}


_ACCESS = re.compile(r'"(GET|POST|PUT|DELETE|PATCH) (\S+) HTTP/[\d.]+" (\d{3})')


# -- subprocess plumbing -----------------------------------------------------------------------------------------------


def swift_cli(route: str) -> list[str]:
    """``swift <route>`` without the console script: ``swift.cli.main`` runs ``sys.executable <swift/cli/<route>.py>``
    (``torch.distributed.run`` first when ``NPROC_PER_NODE`` is set, for pt/sft/rlhf/infer). ``rollout`` is exec'd as
    that file (what ``swift rollout`` ends up running); ``rlhf`` goes through ``swift.cli.main`` so the torchrun
    wrapping stays the console script's."""
    if route == "rlhf":
        return [sys.executable, "-m", "swift.cli.main", "rlhf"]
    spec = importlib.util.find_spec(f"swift.cli.{route}")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"swift.cli.{route} (ms-swift not installed?)")
    return [sys.executable, spec.origin]


def peer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS", ""), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "USE_HF": "1"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra or {})
    return env


class Peer:
    """One subprocess in its own session, output (stdout + stderr) to ``log``; ``stop()`` kills its whole group."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.argv = [str(a) for a in argv]
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.proc = start_group(self.argv, log, env=env or peer_env(), cwd=cwd, append=False)
        self.wall_s: float | None = None
        self.timed_out = False
        self.log_bytes_at_kill = 0

    def wait(self, timeout_s: float) -> int | None:
        try:
            self.proc.wait(max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.log_bytes_at_kill = self.log.stat().st_size
        return self.stop()

    def stop(self) -> int | None:
        if self.wall_s is None:
            self.wall_s = round(time.monotonic() - self.t0, 2)
        stop_group(self.proc)
        return self.proc.returncode

    def record(self) -> dict[str, Any]:
        return {"command": shlex.join(self.argv), "rc": self.proc.returncode, "wall_s": self.wall_s,
                "timed_out": self.timed_out, "log": f"logs/{self.log.name}"}


def run_logged(argv: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> dict[str, Any]:
    """Run ``argv`` to completion or ``timeout_s`` (then its group is killed); the record of ``Peer``."""
    p = Peer(argv, log, env, cwd)
    p.wait(timeout_s)
    out = p.record()
    if p.timed_out:  # what it was doing when the timeout hit, not the traceback of the kill itself
        before = log.read_bytes()[:p.log_bytes_at_kill].decode(errors="replace").splitlines()
        out["error"] = (f"no exit within {timeout_s:.0f}s: killed (process group); its last lines before the kill:\n"
                        + "\n".join(ln[:400] for ln in before[-25:]))
    elif out["rc"] != 0:
        out["error"] = error_excerpt(log.read_text(errors="replace"))
    return out


def wait_health(url: str, peer: Peer, timeout_s: float) -> dict[str, Any]:
    """Poll ``url/health/`` until 200, the peer exits, or ``timeout_s``."""
    import httpx

    t0 = time.monotonic()
    last = "not polled"
    with httpx.Client(timeout=5.0, trust_env=False) as c:
        while True:
            try:
                r = c.get(url + "/health/")
                if r.status_code == 200:
                    return {"ok": True, "seconds": round(time.monotonic() - t0, 2), "body": _json_or_text(r)}
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if peer.proc.poll() is not None:
                return {"ok": False, "seconds": round(time.monotonic() - t0, 2),
                        "error": f"server exited with code {peer.proc.returncode} before /health/ answered: "
                                 + error_excerpt(peer.log.read_text(errors="replace"))}
            if time.monotonic() - t0 >= timeout_s:
                return {"ok": False, "seconds": round(time.monotonic() - t0, 2),
                        "error": f"/health/ not 200 after {timeout_s:.0f}s (last: {last})"}
            time.sleep(1.0)


# -- reading logs and answers ------------------------------------------------------------------------------------------
def error_excerpt(text: str, limit: int = 4000) -> str:
    """The last traceback of ``text`` (with the lines that follow it), else its last error-looking lines, else its
    tail; at most ``limit`` characters."""
    i = text.rfind("Traceback (most recent call last)")
    if i >= 0:
        return text[i:][-limit:]
    lines = [ln for ln in text.splitlines() if re.search(r"error|exception|fail|NCCL WARN|refus", ln, re.I)]
    return ("\n".join(lines[-30:]) if lines else text[-limit:])[-limit:]


def nccl_lines(text: str, limit: int = 40) -> list[str]:
    keep = [ln.strip()[:400] for ln in text.splitlines()
            if re.search(r"NCCL|nccl|Duplicate GPU|ncclInvalidUsage|init_communicator|communicator", ln)]
    return keep[-limit:]


def access_log(text: str) -> list[dict[str, Any]]:
    """uvicorn access lines ``"POST /infer/ HTTP/1.1" 200`` → method, path, status (in order)."""
    return [{"method": m, "path": p, "status": int(s)} for m, p, s in _ACCESS.findall(text)]


def non_2xx(requests: list[dict[str, Any]], direction: str, server: str) -> list[dict[str, Any]]:
    seen: dict[tuple[str, str, int], int] = {}
    for r in requests:
        if not 200 <= r["status"] < 300:
            key = (r["method"], r["path"], r["status"])
            seen[key] = seen.get(key, 0) + 1
    return [{"direction": direction, "kind": "status", "detail": f"{server} answered {m} {p} with HTTP {s} ({n}x)"}
            for (m, p, s), n in seen.items()]


def _json_or_text(r) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text[:2000]


def _shape(value: Any, depth: int = 3) -> Any:
    """Field names (recursively, first list item) of a JSON answer: what the protocol comparison looks at."""
    if depth <= 0:
        return type(value).__name__
    if isinstance(value, dict):
        return {k: _shape(v, depth - 1) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_shape(value[0], depth - 1)] if value else []
    return type(value).__name__


def probe_endpoints(url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Raw answers (status, body, field shape) of the endpoints our client and ms-swift's client call before any
    sync: ``/health/``, ``/get_world_size/``, ``/get_engine_type/``, ``/get_model_state_keys/``, one ``/infer/``
    (our request body, ``return_details``) and ``/close_communicator/`` with no communicator open."""
    import httpx

    from trainer.rollout.server_client import infer_request, request_config
    from trainer.rollout.types import DecodingParams, RolloutRequest

    req = RolloutRequest("probe-0", ({"role": "user", "content": "probe"},), ())
    calls = [("GET", "/health/", None), ("GET", "/get_world_size/", None), ("POST", "/get_engine_type/", None),
             ("GET", "/get_model_state_keys/", None),
             ("POST", "/infer/", {"infer_requests": [infer_request(req)],
                                  "request_config": request_config(DecodingParams(max_new_tokens=4)),
                                  "metrics": None, "use_tqdm": None, "adapter_request": None}),
             ("POST", "/close_communicator/", None)]
    out: dict[str, Any] = {}
    with httpx.Client(timeout=timeout_s, trust_env=False) as c:
        for method, path, body in calls:
            try:
                r = c.request(method, url + path, json=body)
                answer = _json_or_text(r)
                if path == "/get_model_state_keys/" and isinstance(answer, dict):
                    keys = answer.get("keys") or []
                    answer = {**answer, "keys": keys[:5] + (["…"] if len(keys) > 5 else [])}
                out[f"{method} {path}"] = {"status": r.status_code, "shape": _shape(answer),
                                           "body": answer if path != "/infer/" else None}
            except httpx.HTTPError as exc:
                out[f"{method} {path}"] = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
    return out


def compare_probes(swift: dict[str, Any], ours: dict[str, Any]) -> list[dict[str, Any]]:
    """Where our server answers an endpoint differently from ``swift rollout`` (status code or field shape)."""
    found = []
    for key in sorted(set(swift) & set(ours)):
        a, b = swift[key], ours[key]
        if a.get("status") != b.get("status"):
            found.append({"direction": "both", "kind": "status",
                          "detail": f"{key}: swift rollout HTTP {a.get('status')}, ours HTTP {b.get('status')}"})
        elif a.get("shape") != b.get("shape"):
            found.append({"direction": "both", "kind": "fields", "detail": f"{key}: answers differ in shape",
                          "swift": a.get("shape"), "ours": b.get("shape")})
    return found


def _routes(source: str, pattern: str) -> set[str]:
    return {f"{m.upper()} {p}" for m, p in re.findall(pattern, source)}


def static_routes() -> dict[str, Any]:
    """Routes ``swift rollout`` registers (its source) vs routes our server registers (``trainer/server/app.py``)."""
    out: dict[str, Any] = {}
    spec = importlib.util.find_spec("swift")
    ours = _routes((REPO / "trainer/server/app.py").read_text(), r"@app\.(get|post)\(\"([^\"]+)\"")
    if spec is None or not spec.submodule_search_locations:
        return {"error": "ms-swift not installed"}
    src = Path(list(spec.submodule_search_locations)[0]) / "pipelines/infer/rollout.py"
    if not src.is_file():
        return {"error": f"{src} not found"}
    swift = _routes(src.read_text(), r"self\.app\.(get|post)\('([^']+)'")
    out["swift_rollout"] = sorted(swift)
    out["only_swift"] = sorted(swift - ours)
    out["only_ours"] = sorted(ours - swift)
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically (write + rename), so a killed run leaves the last complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


# -- direction (a): our client against swift rollout ---------------------------------------------------------------------
def rollout_argv(model_dir: Path, port: int, util: float = 0.3) -> list[str]:
    """``swift rollout`` as our launcher builds it (one GPU, tiny model), with ``swift`` replaced by its module."""
    from trainer.launch.commands import ServerOptions, swift_rollout_command

    cmd = swift_rollout_command(ServerOptions(
        engine="swift", host=HOST, port=port, model=str(model_dir), tensor_parallel_size=1, data_parallel_size=1,
        gpu_memory_utilization=util, max_model_len=2048, model_type=MODEL_TYPE, template=TEMPLATE,
        extra=["--vllm_enforce_eager", "true", "--torch_dtype", "bfloat16"]))
    assert cmd.argv[:2] == ["swift", "rollout"], cmd.argv
    return swift_cli("rollout") + cmd.argv[2:]


def client_argv(url: str, model_dir: Path, result: Path, stage: str) -> list[str]:
    return [sys.executable, "-m", "trainer.bench.swift_peers", "--client", url, "--model", str(model_dir),
            "--result", str(result), "--stage", stage]


def started_and_probed(url: str, server: Peer, wait_s: float, r: dict[str, Any], save) -> bool:
    """Wait (at most ``wait_s``) for the peer's ``/health/``, then probe its endpoints; recorded in ``r`` (saved
    after each). False when it never came up (``r["failed"]["server_start"]`` says why)."""
    health = wait_health(url, server, wait_s)
    r["server"]["health"] = health
    save()
    if not health["ok"]:
        r["failed"]["server_start"] = health["error"]
        return False
    r["worked"].append("server_start")
    r["probes"] = probe_endpoints(url)
    save()
    return True


def learner_env(where: dict[str, Any]) -> dict[str, str]:
    """The environment of our side's process (the learner or the rollout client) for ``placement``'s layout."""
    gpus = where["learner_gpus"]
    return peer_env({"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else None)


def run_rollout(out: Path, model_dir: Path, deadline: float, result: dict[str, Any], save,
                device_count: int = 0) -> None:
    port = free_port()
    url = f"http://{HOST}:{port}"
    r: dict[str, Any] = result.setdefault("rollout", {"worked": [], "failed": {}})
    where = placement(device_count)
    r["placement"] = where["layout"]
    argv = rollout_argv(model_dir, port, where["server_util"])
    server = Peer(argv, out / "logs/swift_rollout.log", env=peer_env(where["server_env"]))
    r["server"] = {"command": shlex.join(argv), "env": where["server_env"]}
    try:
        if not started_and_probed(url, server, min(240.0, deadline - time.monotonic() - 20), r, save):
            return
        res = out / "logs/rollout_client.json"
        left = deadline - time.monotonic() - 15
        r["client"] = run_logged(client_argv(url, model_dir, res, "all"), out / "logs/rollout_client.log",
                                 min(200.0, left * 0.8), env=learner_env(where))
        stages = json.loads(res.read_text()) if res.is_file() else {}
        r["client"]["stages"] = stages
        if r["client"]["timed_out"]:
            r["failed"]["client"] = (f"client subprocess killed after {r['client']['wall_s']}s; stages finished: "
                                     f"{sorted(stages)}")
        if not stages.get("generate_fresh_client", {}).get("ok"):  # the first client died or hung before it
            res2 = out / "logs/rollout_client_retry.json"
            r["client_retry"] = run_logged(client_argv(url, model_dir, res2, "generate"),
                                           out / "logs/rollout_client_retry.log",
                                           min(60.0, deadline - time.monotonic() - 12), env=learner_env(where))
            r["client_retry"]["stages"] = json.loads(res2.read_text()) if res2.is_file() else {}
            if "generate_fresh_client" not in r["client_retry"]["stages"]:
                r["client_retry"]["stages"]["generate_fresh_client"] = {
                    "ok": False, "error": f"no answer (client rc {r['client_retry']['rc']}, timed out: "
                                          f"{r['client_retry']['timed_out']}); see logs/rollout_client_retry.log"}
        for src in (stages, r.get("client_retry", {}).get("stages", {})):
            for name, st in src.items():
                if isinstance(st, dict) and "ok" in st:
                    (r["worked"].append(name) if st["ok"] else r["failed"].__setitem__(name, st.get("error")))
    finally:
        server.stop()
        r["server"].update({k: v for k, v in server.record().items() if k != "command"})
        text = server.log.read_text(errors="replace")
        r["server"]["nccl_lines"] = nccl_lines(text)
        r["server"]["requests"] = access_log(text)
        if server.proc.returncode not in (0, -signal.SIGTERM, None) and "server_start" not in r["worked"]:
            r["server"]["error"] = error_excerpt(text)
        save()


# -- the client subprocess of direction (a) ------------------------------------------------------------------------------
def _within(seconds: float, fn):
    """``fn()`` in a daemon thread; (value, error, hung) with hung=True when it did not return in ``seconds``."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - recorded
            box["error"] = f"{type(exc).__name__}: {exc}"
            box["trace"] = traceback.format_exc()[-4000:]

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        return None, f"did not return within {seconds:.0f}s (hung)", True
    return box.get("value"), box.get("error"), False


def client_main(url: str, model_dir: Path, result_path: Path, stage: str) -> int:
    """Our ``ServerRolloutEngine`` against ``url``; every stage is saved to ``result_path`` as soon as it ends, and
    the process leaves with ``os._exit`` (a half-initialised NCCL communicator must not block the exit)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
    from trainer.rollout.types import DecodingParams, RolloutRequest

    res: dict[str, Any] = {}

    def save():
        write_json(result_path, res)

    def stage_run(name: str, fn, seconds: float = 90.0):
        t0 = time.perf_counter()
        value, err, hung = _within(seconds, fn)
        res[name] = {"ok": err is None, "seconds": round(time.perf_counter() - t0, 3), **(value or {})}
        if err:
            res[name]["error"] = err
        if hung:
            res[name]["hung"] = True
        save()
        return err is None

    tok = AutoTokenizer.from_pretrained(model_dir)
    reqs = []
    for i in range(BATCH):
        msgs = ({"role": "user", "content": f"Describe scene {i}: a red box left of {i + 2} blue spheres."},)
        ids = tok.apply_chat_template(list(msgs), add_generation_prompt=True, tokenize=False)
        reqs.append(RolloutRequest(f"peer-{i}", msgs, tuple(tok.encode(ids, add_special_tokens=False))))
    params = DecodingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    state: dict[str, Any] = {}

    def connect():
        state["engine"] = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=60.0, infer_timeout_s=120.0,
                                              transport="nccl", group_port=free_port(), max_retries=0)
        return {"world_size_client": state["engine"].world_size}

    def engine_type():
        return {"engine_types": state["engine"].engine_types(),
                "supports_adapter_sync": state["engine"].supports_adapter_sync()}

    def generate(engine_key: str = "engine", tag: str = "first"):
        def go():
            out = state[engine_key].generate(reqs, params)
            state[tag] = [r.response_token_ids for r in out]
            lens = [len(r.response_token_ids) for r in out]
            problems = [f"sample {r.sample_id}: {len(r.response_token_ids)} tokens" for r in out
                        if not 1 <= len(r.response_token_ids) <= NEW_TOKENS]
            problems += [f"sample {q.sample_id} answered as {r.sample_id}" for q, r in zip(reqs, out)
                         if q.sample_id != r.sample_id]
            problems += [f"sample {r.sample_id}: token id {t} outside vocab" for r in out
                         for t in r.response_token_ids[:1] if not 0 <= t < 1 << 20]
            if problems:
                raise AssertionError("; ".join(problems))
            return {"n": len(out), "response_lengths": lens, "finish_reasons": [r.finish_reason for r in out],
                    "prompt_lengths": [len(r.prompt_token_ids) for r in out],
                    "prompt_ids_match_local_chat_template": [r.prompt_token_ids == q.prompt_token_ids
                                                             for q, r in zip(reqs, out)],
                    "first_response_ids": list(out[0].response_token_ids[:16]),
                    "same_as_first_generate": (None if tag == "first" or "first" not in state
                                               else state[tag] == state["first"])}
        return go

    def sync():
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
        model.to(dev)
        g = torch.Generator(device="cpu").manual_seed(1)
        with torch.no_grad():  # a visible change: decoding after a working sync differs from the first generate
            for p in model.parameters():
                p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p))
        t0 = time.perf_counter()
        try:
            state["engine"].sync_full(model)
        finally:
            state["sync_s"] = time.perf_counter() - t0
        t = state["engine"]._transport
        return {"transport": getattr(t, "name", None), "backend": getattr(t, "backend", None),
                "last_push": getattr(t, "last_push", None), "quarantined": sorted(state["engine"].quarantined)}

    def fresh():
        state["engine2"] = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=30.0, infer_timeout_s=120.0,
                                               transport="inband", max_retries=0)
        return generate("engine2", "fresh")()

    try:
        if stage == "generate":
            stage_run("generate_fresh_client", fresh, 90.0)
            return 0
        if not stage_run("connect_health", connect, 75.0):
            return 0
        stage_run("engine_type", engine_type, 30.0)
        stage_run("generate", generate(), 120.0)
        synced = stage_run("sync_nccl", sync, 75.0)
        if not synced and "engine" in state:
            res["sync_nccl"]["quarantined_after"] = sorted(state["engine"].quarantined)
            save()
        if not res["sync_nccl"].get("hung"):
            stage_run("generate_after_sync_same_client", generate("engine", "after"), 90.0)
            stage_run("generate_fresh_client", fresh, 90.0)
        return 0
    finally:
        save()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# -- direction (b): swift rlhf GRPO against our server -------------------------------------------------------------------
def serve_argv(model_dir: Path, port: int, shape: RlhfShape = RLHF_SHAPES["text"], util: float = 0.3) -> list[str]:
    """Our server as our launcher builds it (``trainer.launch.commands.trainer_serve_command``)."""
    from trainer.launch.commands import ServerOptions, trainer_serve_command

    return trainer_serve_command(ServerOptions(
        engine="vllm", host=HOST, port=port, model=str(model_dir), gpu_memory_utilization=util,
        max_model_len=shape.max_model_len,
        extra=[*(["--enforce-eager"] if shape.enforce_eager else []), "--dtype", "bfloat16"])).argv


def text_rows(src: Path, dst: Path) -> Path:
    """The summary rows without images (a text model), as in ``tests/grpo/test_swift_grpo_cpu.py``."""
    with dst.open("w", encoding="utf-8") as out:
        for line in src.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            row.pop("images", None)
            row["messages"][-1]["content"] = row["messages"][-1]["content"].replace("<image>", "")
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return dst


def grpo_config(work: Path, model_dir: Path, port: int, group_port: int, *, bf16: bool = True,
                shape: RlhfShape = RLHF_SHAPES["text"], server_util: float = 0.3) -> Path:
    """``summary_1024_attr_key_recall.yaml`` at ``shape``'s sizes, one learner, server mode on ``port``."""
    import yaml

    from trainer.grpo.summary_data import write_dataset

    data = write_dataset(work / "summary_data", num_samples=16, seed=3, image_size=shape.image_size)
    rows = data if shape.images else text_rows(data, work / "text.jsonl")
    cfg = work / "peers_grpo.yaml"
    cfg.write_text(yaml.safe_dump({
        "extends": str(REPO / SUMMARY_CONFIG),
        "model": {"path": str(model_dir), "torch_dtype": "bfloat16" if bf16 else "float32"},
        "data": {"train_jsonl": str(rows)},
        "training": {"output_dir": str(work / "grpo_out"), "bf16": bf16, "deepspeed": None,
                     "per_device_train_batch_size": shape.per_device_train_batch_size,
                     "gradient_accumulation_steps": 1, "max_steps": shape.max_steps, "save_steps": 0,
                     "gradient_checkpointing": shape.gradient_checkpointing, "report_to": []},
        "rlhf": {"model_type": shape.model_type, "template": shape.template, "use_vllm": True, "vllm_mode": "server",
                 "vllm_server_host": [HOST], "vllm_server_port": [port], "vllm_server_group_port": [group_port],
                 "vllm_server_timeout": 60, "num_generations": shape.num_generations,
                 "temperature": GRPO_TEMPERATURE,
                 "generation_batch_size": shape.generation_batch_size,
                 "max_completion_length": shape.max_completion_length, "max_length": shape.max_length,
                 "dynamic_sample": False},
        "custom": {"extra": {"rollout_server": {"vllm_data_parallel_size": 1, "vllm_tensor_parallel_size": 1,
                                                "vllm_max_model_len": shape.max_model_len,
                                                "vllm_gpu_memory_utilization": server_util,
                                                "vllm_limit_mm_per_prompt": {"image": 1} if shape.images else None,
                                                "gpus": None, "learner_gpus": None}}},
    }, allow_unicode=True))
    return cfg


def rlhf_command(cfg_path: Path, gpus: list[int] | None = None) -> tuple[list[str], dict[str, str]]:
    """``swift rlhf`` argv + env exactly as ``python -m trainer launch learner`` builds it (one process), with
    ``swift`` replaced by ``python -m swift.cli.main``."""
    from trainer.config.loader import resolve_yaml
    from trainer.config.schema import validate_config
    from trainer.launch.commands import learner_command

    config = validate_config(resolve_yaml(cfg_path), source=str(cfg_path))
    cmd = learner_command(str(cfg_path), config, nproc=1, gpus=gpus)
    assert cmd.argv[:2] == ["swift", "rlhf"], cmd.argv
    return swift_cli("rlhf") + cmd.argv[2:], dict(cmd.env)


def server_timings(url: str) -> dict[str, float]:
    """What our server measured over the run, from its ``/metrics``: ``/infer/`` calls and seconds, new tokens,
    accepted weight syncs and their seconds (server side: receive + load; ``trainer.server.metrics``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(timeout=30.0, trust_env=False) as c:
        text = c.get(url + "/metrics").text
    want = {"rm_server_infer_latency_seconds_count": "infer_calls", "rm_server_infer_latency_seconds_sum": "infer_s",
            "rm_server_generated_tokens_total": "generated_tokens", "rm_server_prompt_tokens_total": "prompt_tokens",
            "rm_server_weight_sync_seconds_count": "syncs", "rm_server_weight_sync_seconds_sum": "sync_s"}
    out = {v: 0.0 for v in want.values()}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in want:
                out[want[sample.name]] += sample.value
    return out


def step_seconds(records: list[dict[str, Any]]) -> list[float]:
    """Each optimizer step's wall seconds from ms-swift's ``logging.jsonl`` (``train_speed(s/it)`` is the running
    mean since the start, so step k took ``k * speed_k - (k-1) * speed_(k-1)``)."""
    elapsed = []
    for rec in records:
        done = str(rec.get("global_step/max_steps", "")).split("/")[0]
        if done.isdigit() and "train_speed(s/it)" in rec and "train_runtime" not in rec:
            elapsed.append((int(done), int(done) * float(rec["train_speed(s/it)"])))
    out, last = [], 0.0
    for _, total in sorted(elapsed):
        out.append(round(total - last, 3))
        last = total
    return out


def grpo_step_summary(steps: list[float], server: dict[str, float], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step: the learner's wall seconds (mean of steps 2.. when there are more than one: step 1 pays the
    warm-ups); the server's ``/infer/`` seconds over the run per step (ms-swift generates once per step here, and
    its connection check adds one short call, ~0.1 s, counted in) and seconds per weight sync (server side)."""
    timed = steps[1:] if len(steps) > 1 else steps
    gen = server["infer_s"] / len(steps) if steps else None
    sync = server["sync_s"] / server["syncs"] if server["syncs"] else None
    mean = sum(timed) / len(timed) if timed else None
    mem = [float(r["memory(GiB)"]) for r in records if "memory(GiB)" in r]
    return {"steps_s": steps, "step_s_mean": round(mean, 3) if mean else None,
            "steps_in_mean": f"{len(steps) - len(timed) + 1}..{len(steps)}" if timed else None,
            "generate_s_per_step": round(gen, 3) if gen else None, "infer_calls": int(server["infer_calls"]),
            "weight_sync_s_per_sync_server_side": round(sync, 3) if sync else None, "syncs": int(server["syncs"]),
            "generated_tokens": int(server["generated_tokens"]), "prompt_tokens": int(server["prompt_tokens"]),
            "rest_of_step_s": round(mean - (gen or 0.0) - (sync or 0.0), 3) if mean else None,
            "learner_peak_reserved_gib": max(mem) if mem else None}


def extend_list_flag(argv: list[str], flag: str, values: list[str]) -> list[str]:
    """``argv`` with ``values`` appended to the list that follows ``flag`` (``flag`` and them at the end when
    absent)."""
    if flag not in argv:
        return [*argv, flag, *values]
    i = argv.index(flag) + 1
    while i < len(argv) and not argv[i].startswith("--"):
        i += 1
    return [*argv[:i], *values, *argv[i:]]


def with_template_ids_plugin(argv: list[str]) -> list[str]:
    """``argv`` with ``trainer/bench/swift_template_ids.py`` added to its ``--external_plugins`` (after the ones
    there)."""
    return extend_list_flag(argv, "--external_plugins", [str(Path(__file__).with_name("swift_template_ids.py"))])


def with_signal_reward(argv: list[str]) -> list[str]:
    """``argv`` with ``SIGNAL_REWARD`` scored too: its plugin in ``--external_plugins``, its name in
    ``--reward_funcs`` and, where the config weighs its rewards, ``SIGNAL_REWARD_WEIGHT`` in ``--reward_weights``
    (the config schema only knows the summary rewards, so it is added here, not in the YAML)."""
    out = extend_list_flag(argv, "--external_plugins", [str(SIGNAL_PLUGIN)])
    out = extend_list_flag(out, "--reward_funcs", [SIGNAL_REWARD])
    if "--reward_weights" in out:
        out = extend_list_flag(out, "--reward_weights", [f"{SIGNAL_REWARD_WEIGHT:g}"])
    return out


_LOG_DICT = re.compile(r"\{'[^{}]*\}")


def log_records(text: str) -> list[dict[str, Any]]:
    """ms-swift's per-step log lines in its console log (``{'loss': '0', 'grad_norm': '0', ..., 'global_step/
    max_steps': '1/3', ...}``, after the progress bar) as dicts, numbers as floats: the fallback when
    ``logging.jsonl`` is missing."""
    import ast

    out = []
    for m in _LOG_DICT.finditer(text):
        try:
            rec = ast.literal_eval(m.group(0))
        except (ValueError, SyntaxError):
            continue
        if not isinstance(rec, dict) or "global_step/max_steps" not in rec:
            continue
        for k, v in rec.items():
            with contextlib.suppress(TypeError, ValueError):
                rec[k] = float(v) if k != "global_step/max_steps" else v
        out.append(rec)
    return out


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def step_metrics(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per optimizer step of ms-swift's log records: reward (mean), reward_std, frac_reward_zero_std,
    loss, grad_norm, kl, and the mean/std of ``SIGNAL_REWARD``; ``varying_rewards``: the reward functions whose std
    over the step's completions was > 0."""
    out: dict[int, dict[str, Any]] = {}
    for rec in records:
        done = str(rec.get("global_step/max_steps", "")).split("/")[0]
        if not done.isdigit() or "train_runtime" in rec or not ("reward" in rec or "loss" in rec):
            continue
        row = {"step": int(done)}
        for k in ("reward", "reward_std", "frac_reward_zero_std", "loss", "grad_norm", "kl"):
            row[k] = _num(rec.get(k))
        row["signal_reward_mean"] = _num(rec.get("rewards/LengthDistinctReward/mean"))
        row["signal_reward_std"] = _num(rec.get("rewards/LengthDistinctReward/std"))
        row["varying_rewards"] = sorted(k.split("/")[1] for k, v in rec.items()
                                        if k.startswith("rewards/") and k.endswith("/std") and (_num(v) or 0.0) > 0)
        out[row["step"]] = row
    return [out[k] for k in sorted(out)]


def learning_signal(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether GRPO had anything to learn from: ``ok`` when there was a step and every step after the first (the
    only one when there is one) had reward_std > 0, grad_norm > 0 and (where logged) frac_reward_zero_std < 1 (at
    least one prompt whose completions scored differently; ``scale_rewards: batch`` makes reward_std the batch's, which
    is > 0 across prompts even when every group is flat); ``reason`` says which steps failed."""
    stds = [s["reward_std"] for s in steps if s.get("reward_std") is not None]
    checked = steps[1:] if len(steps) > 1 else steps
    bad = []
    for s in checked:
        why = []
        if not (s.get("reward_std") or 0.0) > 0:
            why.append(f"reward_std {s.get('reward_std')}")
        if not (s.get("grad_norm") or 0.0) > 0:
            why.append(f"grad_norm {s.get('grad_norm')}")
        if s.get("frac_reward_zero_std") is not None and s["frac_reward_zero_std"] >= 1.0:
            why.append("frac_reward_zero_std 1")
        if why:
            bad.append(f"step {s['step']}: " + ", ".join(why))
    ok = bool(checked) and not bad
    out: dict[str, Any] = {
        "steps": len(steps), "checked_steps": (f"{checked[0]['step']}..{checked[-1]['step']}" if checked else None),
        "reward_std_min": min(stds) if stds else None, "reward_std_max": max(stds) if stds else None,
        "nonzero_grad_norm_steps": sum(1 for s in steps if (s.get("grad_norm") or 0.0) > 0), "ok": ok}
    if not ok:
        out["reason"] = "; ".join(bad) if bad else "no GRPO step was logged"
    return out


def run_rlhf(out: Path, work: Path, model_dir: Path, deadline: float, result: dict[str, Any], save,
             shape: RlhfShape = RLHF_SHAPES["text"], device_count: int = 0) -> None:
    port, group_port = free_port(), free_port()
    url = f"http://{HOST}:{port}"
    r: dict[str, Any] = result.setdefault("rlhf", {"worked": [], "failed": {}})
    where = placement(device_count)
    r["shape"], r["placement"] = asdict(shape), where["layout"]
    argv = serve_argv(model_dir, port, shape, where["server_util"])
    server = Peer(argv, out / "logs/trainer_serve.log", env=peer_env(where["server_env"]))
    r["server"] = {"command": shlex.join(argv), "env": where["server_env"]}
    try:
        if not started_and_probed(url, server, min(300.0, deadline - time.monotonic() - 40), r, save):
            return
        cfg = grpo_config(work, model_dir, port, group_port, shape=shape, server_util=where["server_util"])
        argv_rlhf, env = rlhf_command(cfg, where["learner_gpus"])
        argv_rlhf = with_signal_reward(argv_rlhf)
        env["MASTER_PORT"] = str(free_port())
        if shape.images:  # the embedded tokenizer's image ids for ms-swift's Qwen-VL template (module docstring)
            argv_rlhf = with_template_ids_plugin(argv_rlhf)
            env["RM_SWIFT_TOKENIZER_DIR"] = str(model_dir)
        (out / "logs/peers_grpo.yaml").write_text(cfg.read_text())
        r["learner"] = {"env": env, "temperature": GRPO_TEMPERATURE,
                        "added_reward": {"name": SIGNAL_REWARD, "weight": SIGNAL_REWARD_WEIGHT,
                                         "plugin": str(SIGNAL_PLUGIN.relative_to(REPO))}}
        r["learner"].update(run_logged(argv_rlhf, out / "logs/swift_rlhf.log",
                                       deadline - time.monotonic() - 20, env=peer_env(env), cwd=work))
        text = (out / "logs/swift_rlhf.log").read_text(errors="replace")
        r["learner"]["nccl_lines"] = nccl_lines(text)
        r["learner"]["connected"] = "Connected to vLLM server" in text
        logs = sorted((work / "grpo_out").glob("*/logging.jsonl"))
        records = [json.loads(x) for x in logs[0].read_text().splitlines() if x.strip()] if logs else []
        r["learner"]["metrics_source"] = "logging.jsonl" if records else "swift_rlhf.log"
        r["per_step"] = step_metrics(records or log_records(text))
        r["learning_signal"] = learning_signal(r["per_step"])
        steps = [x.get("global_step/max_steps") for x in records if "global_step/max_steps" in x]
        r["learner"]["steps"] = steps
        r["learner"]["rewards"] = [{k: v for k, v in x.items() if k.startswith("reward")} for x in records
                                   if "reward" in x][:3]
        if r["learner"]["connected"]:
            r["worked"].append("connect_and_init_communicator_request")
        if steps:
            r["worked"].append(f"grpo_steps {steps[-1]}")
        if r["learning_signal"]["ok"]:
            r["worked"].append("learning_signal")
        if r["learner"]["rc"] != 0:
            r["failed"]["swift_rlhf"] = r["learner"].get("error")
        (out / "logs").joinpath("grpo_logging.jsonl").write_text("\n".join(json.dumps(x) for x in records))
        with contextlib.suppress(Exception):  # the server may have died; then there is nothing to read
            r["server"]["timings"] = server_timings(url)
            r["timing"] = grpo_step_summary(step_seconds(records), r["server"]["timings"], records)
    except Exception as exc:  # noqa: BLE001 - our side failed building the run: recorded, not raised
        r["failed"]["runner"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    finally:
        server.stop()
        r["server"].update({k: v for k, v in server.record().items() if k != "command"})
        text = server.log.read_text(errors="replace")
        r["server"]["nccl_lines"] = nccl_lines(text)
        r["server"]["requests"] = access_log(text)
        save()


def learning_signal_line(summary: dict[str, Any] | None, steps: list[dict[str, Any]]) -> str:
    """The bench's one line about ``learning_signal`` (``None``: the run never got to ms-swift's logs): loud when
    it is not ok."""
    if summary is None:
        return "rlhf: NO LEARNING SIGNAL - the GRPO run did not get to its logs (see rlhf.failed)"
    per = "; ".join(f"step {s['step']}: reward {s['reward']} std {s['reward_std']} loss {s['loss']} "
                    f"grad_norm {s['grad_norm']}" for s in steps)
    if summary["ok"]:
        return (f"rlhf learning signal ok: reward_std {summary['reward_std_min']}..{summary['reward_std_max']}, "
                f"grad_norm > 0 in {summary['nonzero_grad_norm_steps']}/{summary['steps']} steps ({per})")
    return (f"rlhf: NO LEARNING SIGNAL - GRPO learned nothing in this run ({summary.get('reason')}); "
            f"per step: {per or 'none logged'}")


# -- the run ---------------------------------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "vllm", "swift", "trl"):
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - recorded
            out[name] = f"unavailable ({type(exc).__name__})"
    return out


def findings(result: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    a, b = result.get("rollout", {}), result.get("rlhf", {})
    found += non_2xx(a.get("server", {}).get("requests", []), "rollout (our client -> swift rollout)", "swift rollout")
    found += non_2xx(b.get("server", {}).get("requests", []), "rlhf (swift rlhf -> our server)", "our server")
    if a.get("probes") and b.get("probes"):
        found += compare_probes(a["probes"], b["probes"])
    st = result.get("static_routes", {})
    for route in st.get("only_swift", []):
        found.append({"direction": "static", "kind": "route", "detail": f"swift rollout has {route}, our server not"})
    for name, err in a.get("failed", {}).items():
        if err and "answered HTTP" in str(err):
            found.append({"direction": "rollout (our client -> swift rollout)", "kind": "client", "detail":
                          f"{name}: {str(err)[:600]}"})
    return found


def run(out_dir: str | Path, only: str | None = None, budget_s: float = BUDGET_S, size: str = "text") -> dict[str, Any]:
    """Both directions (or ``only`` one); ``size`` picks the rlhf direction's ``RlhfShape`` (``4b`` runs the rlhf
    direction only: ``swift rollout`` is checked at the small shape)."""
    import torch

    from trainer.bench.models import CPU_SHAPE, GPU_SHAPE, save_random_model_dir

    t_start = time.monotonic()
    deadline = t_start + budget_s
    out = Path(out_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if size not in RLHF_SHAPES:
        raise ValueError(f"--size must be one of {sorted(RLHF_SHAPES)}, got {size!r}")
    shape = RLHF_SHAPES[size]
    if size != "text":
        only = "rlhf"
    cuda = torch.cuda.is_available()
    devices = torch.cuda.device_count() if cuda else 0
    result: dict[str, Any] = {
        "schema": "swift_peers/1", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "only": only or "both",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "device_count": devices, "versions": versions(), "budget_s": budget_s,
        "model": {"size": size, "model_type": shape.model_type, "template": shape.template, "weights": "random",
                  "tokenizer": "trainer.modeling.fixtures.tiny_tokenizer",
                  **({"shape": GPU_SHAPE if cuda else CPU_SHAPE} if size == "text" else {})},
        "static_routes": static_routes(), "protocol_findings": [],
        "notes": ["ms-swift's GRPO server mode has no weight sync besides NCCL: RLHFArguments._init_external_vllm "
                  "always calls VLLMClient.init_communicator (swift/arguments/rlhf_args.py), so on one GPU the "
                  "learner and the server's vLLM worker are two NCCL ranks on one device. The one-GPU alternative "
                  "is vllm_mode colocate (no server), which this check does not exercise."]}
    path = out / "swift_peers.json"

    def save():
        result["wall_s"] = round(time.monotonic() - t_start, 2)
        result["protocol_findings"] = findings(result)
        write_json(path, result)

    save()
    with tempfile.TemporaryDirectory(prefix="swift_peers_") as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        if size == "text":
            model_dir = save_random_model_dir(work / "model", GPU_SHAPE if cuda else CPU_SHAPE,
                                              dtype=torch.bfloat16 if cuda else torch.float32)
        else:
            from trainer.bench.models import save_random_vl_model

            model_dir, _ = save_random_vl_model(work / "model", size, "cuda" if cuda else "cpu")
        result["model"]["build_s"] = round(time.monotonic() - t0, 2)
        save()
        both = only is None
        if only in (None, "rollout"):
            end = t_start + budget_s * ROLLOUT_SHARE if both else deadline
            try:
                run_rollout(out, model_dir, end, result, save, devices)
            except Exception as exc:  # noqa: BLE001 - recorded
                result.setdefault("rollout", {}).setdefault("failed", {})["runner"] = \
                    f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
            save()
        if only in (None, "rlhf"):
            run_rlhf(out, work, model_dir, deadline, result, save, shape, devices)
            save()
    print(json.dumps({k: {"worked": v.get("worked"), "failed": sorted(v.get("failed", {}))}
                      for k, v in result.items() if k in ("rollout", "rlhf")}, indent=2))
    if result.get("rlhf", {}).get("timing"):
        print("rlhf timing:", json.dumps(result["rlhf"]["timing"]))
    if "rlhf" in result:
        print(learning_signal_line(result["rlhf"].get("learning_signal"), result["rlhf"].get("per_step", [])))
    print(f"swift peers: {len(result['protocol_findings'])} protocol finding(s); {path} ({result['wall_s']} s)")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.bench.swift_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/swift_peers")
    p.add_argument("--only", choices=("rollout", "rlhf"), default=None)
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="deadline for the whole run (default %(default)s)")
    p.add_argument("--size", choices=sorted(RLHF_SHAPES), default="text",
                   help="the rlhf direction's model (4b: Qwen3-VL-4B with images, rlhf direction only)")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: the client subprocess of 'rollout'
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--stage", default="all", choices=("all", "generate"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        return client_main(args.client, Path(args.model), Path(args.result), args.stage)
    run(args.out, args.only, args.budget_s, args.size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
