"""The processes of the ms-swift conformance check: each peer (``swift rollout``, ``swift rlhf``, our server, our
rollout client) runs in a session of its own with a timeout, output to a log under ``DIR/logs/``, and its whole process
group is killed when it is stopped; where the two sides run on one or two GPUs; what a failed peer's log says."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainer.bench.processes import start_group, stop_group

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]


def placement(device_count: int) -> dict[str, Any]:
    """Where each direction's two processes run: on 2+ GPUs the server (ours or ``swift rollout``) on GPU 0 and the
    other side (ms-swift's learner or our rollout client) on GPU 1 (NCCL needs two devices); on one GPU (or none)
    both share it, the server at 0.3 of its memory."""
    if device_count >= 2:
        return {"server_env": {"CUDA_VISIBLE_DEVICES": "0"}, "learner_gpus": [1], "server_util": 0.85,
                "layout": "server on GPU 0, learner on GPU 1"}
    return {"server_env": {}, "learner_gpus": None, "server_util": 0.3, "layout": "one device shared"}


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


def learner_env(where: dict[str, Any]) -> dict[str, str]:
    """The environment of our side's process (the learner or the rollout client) for ``placement``'s layout."""
    gpus = where["learner_gpus"]
    return peer_env({"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else None)


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
                    return {"ok": True, "seconds": round(time.monotonic() - t0, 2), "body": json_or_text(r)}
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


def json_or_text(r) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text[:2000]


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


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically (write + rename), so a killed run leaves the last complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
