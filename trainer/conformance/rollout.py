"""Direction (a) of the conformance check: OUR client (``ServerRolloutEngine``, in a subprocess of its own) against
the real ``swift rollout`` (built by our launcher, ``trainer.launch.commands.swift_rollout_command``) on a small
random-weight Qwen3 text model: ``/health/``, the engine-type probe, a batch of ``BATCH`` requests x ``NEW_TOKENS``
new tokens, a full weight sync through ``sync.transport: nccl`` (the only transport ``swift rollout`` has), a generate
after it (same client, then a fresh one)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from trainer.conformance.peers import (
    HOST,
    Peer,
    error_excerpt,
    learner_env,
    nccl_lines,
    peer_env,
    placement,
    run_logged,
    swift_cli,
    write_json,
)
from trainer.conformance.protocol import access_log, started_and_probed
from trainer.launch.ports import listen_port as free_port  # below the ephemeral range

MODEL_TYPE = "qwen3"
TEMPLATE = "qwen3_nothinking"  # as tests/grpo/test_swift_grpo_cpu.py: the tiny tokenizer's chat template, no <think>
BATCH = 8
NEW_TOKENS = 64


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
    return [sys.executable, "-m", "trainer.conformance", "--client", url, "--model", str(model_dir),
            "--result", str(result), "--stage", stage]


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
