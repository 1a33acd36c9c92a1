"""The conformance run: both directions (``trainer.conformance.rollout``, ``trainer.conformance.rlhf``) under one
deadline, the record ``DIR/swift_peers.json`` rewritten after every stage, and the summary lines."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from trainer.conformance.peers import write_json
from trainer.conformance.protocol import findings, static_routes
from trainer.conformance.rlhf import RLHF_SHAPES, run_rlhf
from trainer.conformance.rollout import client_main, run_rollout
from trainer.conformance.swift_logs import learning_signal_line

DESCRIPTION = "ms-swift peers: our code against the real ms-swift processes, both directions."
BUDGET_S = 460.0  # the whole run, both directions (the brief: under 8 minutes)
ROLLOUT_SHARE = 0.5  # of the budget when both directions run


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "vllm", "swift", "trl"):
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - recorded
            out[name] = f"unavailable ({type(exc).__name__})"
    return out


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
    p = argparse.ArgumentParser(prog="python -m trainer.conformance", description=DESCRIPTION)
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
