"""vLLM benchmarks (``python -m trainer bench --only vllm|vllm-step``; CUDA + vLLM; ``docs/benchmarks/vllm.json``):

* ``engine``: new tokens/s of the project's colocate engine (``VllmColocateEngine``: in-process ``InProcessVllm``)
  vs plain ``vllm.LLM.generate`` (default settings, its own process) on the same model and workload: Qwen3-0.6B
  shape with random weights, 64 and 512 requests, prompts of 256–512 random tokens, 256 new tokens, greedy, no stop;
  each side runs every workload ``REPEATS`` times (prefix cache reset before each) and reports the median run;
* ``sync``: colocate full sync GB/s (in-process ``load_weights``, with the update check timed apart; plain and
  LoRA-enabled engine with a LoRA learner, merge included) and in-band sync to ``serve --engine vllm`` (HTTP body
  and shared directory);
* ``step`` (``vllm-step``): one stage-2 optimizer step, vLLM colocate (sleep level 2) vs the HF backend with a static
  cache + compiled decoding, packing on, split into rollout / weight sync / forward / backward.
Headline figures at the top level of the JSON: ``engine_over_raw_vllm`` (per workload and the minimum) and
``colocate_sync_gb_s``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer.bench.models import QWEN3_0_6B, device_name, random_qwen3

WORKLOADS = (64, 512)
NEW_TOKENS = 256
REPEATS = 3


def save_random_model_dir(out: Path, shape: dict[str, int] | None = None, dtype=torch.bfloat16) -> Path:
    """A Qwen3-0.6B-shape random model directory (151,936-token vocabulary, tied embeddings) with the embedded
    tokenizer (whose ids fit in that vocabulary) and no EOS, so decoding always runs to ``max_tokens``."""
    from trainer.modeling.fixtures import tiny_tokenizer

    if (out / "config.json").is_file():
        return out
    tok = tiny_tokenizer()
    dims = {**QWEN3_0_6B, **(shape or {})}
    if dims["vocab_size"] < len(tok):
        raise ValueError(f"vocab_size {dims['vocab_size']} is smaller than the tokenizer's {len(tok)}")
    model = random_qwen3(dims, dtype=dtype, eos_token_id=None, max_position_embeddings=4096)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + n)
    lens = torch.randint(256, 513, (n,), generator=g)
    return [torch.randint(100, vocab - 1, (int(k),), generator=g).tolist() for k in lens]


def _raw_main(model_dir: str, util: float, out: str) -> None:
    """Plain vLLM, as a user would call it (own process, default engine settings)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, gpu_memory_utilization=util, max_model_len=1024, dtype="bfloat16", seed=0,
              skip_tokenizer_init=True, enforce_eager=os.environ.get("RM_BENCH_EAGER") == "1")
    vocab = llm.llm_engine.model_config.get_vocab_size()
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    res = {}
    for n in WORKLOADS:
        prompts = [{"prompt_token_ids": p} for p in workload(n, vocab)]
        llm.generate(prompts[:8], sp, use_tqdm=False)

        def once(prompts=prompts):
            llm.reset_prefix_cache()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        res[str(n)] = timed_runs(n, once)
    Path(out).write_text(json.dumps(res))


def timed_runs(n: int, once, repeats: int = REPEATS) -> dict[str, Any]:
    """``once()`` (returns the new tokens) ``repeats`` times; the median run's tokens/s is the figure."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        toks = once()
        runs.append((toks / (time.perf_counter() - t0), toks))
    rates = sorted(r for r, _ in runs)
    median = rates[len(rates) // 2]
    return {"requests": n, "new_tokens": runs[0][1], "tokens_per_s": median, "tokens_per_s_runs": [r for r, _ in runs],
            "seconds": runs[0][1] / median}


def engine_bench(model_dir: Path, util: float = 0.5) -> dict[str, Any]:
    from trainer.rollout.types import DecodingParams, RolloutRequest
    from trainer.rollout.vllm_colocate import VllmColocateEngine

    raw_out = model_dir.parent / "raw_vllm.json"
    env = {**os.environ, "VLLM_PLUGINS": ""}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    subprocess.run([sys.executable, "-m", "trainer.bench.vllm", "--raw", str(model_dir), str(util), str(raw_out)],
                   check=True, env=env)
    raw = json.loads(raw_out.read_text())
    engine = VllmColocateEngine(model_dir, [], max_model_len=1024, gpu_memory_utilization=util, dtype="bfloat16",
                                engine_kwargs={"skip_tokenizer_init": True,
                                               "enforce_eager": os.environ.get("RM_BENCH_EAGER") == "1"})
    params = DecodingParams(max_new_tokens=NEW_TOKENS)
    vocab = engine.llm.llm_engine.model_config.get_vocab_size()
    ours = {}
    try:
        for n in WORKLOADS:
            reqs = [RolloutRequest(f"b{i}", (), tuple(p)) for i, p in enumerate(workload(n, vocab))]
            engine.generate(reqs[:8], params)

            def once(reqs=reqs):
                engine.reset_prefix_cache()
                return sum(len(r.response_token_ids) for r in engine.generate(reqs, params))

            ours[str(n)] = timed_runs(n, once)
    finally:
        engine.close()
    ratio = {n: ours[n]["tokens_per_s"] / raw[n]["tokens_per_s"] for n in ours}
    return {"raw_vllm": raw, "engine": ours, "engine_over_raw_vllm": {**ratio, "min": min(ratio.values())}}


def sync_bench(model_dir: Path, repeats: int = 5) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.rollout.vllm_colocate import VllmColocateEngine

    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    out: dict[str, Any] = {}
    for variant in [v for v in os.environ.get("RM_BENCH_SYNC_VARIANTS", "plain,lora").split(",") if v]:
        lora = variant == "lora"
        engine = VllmColocateEngine(model_dir, [], max_model_len=1024, gpu_memory_utilization=0.25, dtype="bfloat16",
                                    enable_lora=lora, max_lora_rank=16,
                                    engine_kwargs={"skip_tokenizer_init": True, "enforce_eager": True})
        model = get_peft_model(learner, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                   init_lora_weights=False)) if lora else learner
        runs = []
        try:
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.sync_full(model)
                torch.cuda.synchronize()
                total = time.perf_counter() - t0
                t = engine.timings
                runs.append({"total_s": total, "check_s": t["sync_check_s"], "load_s": t["sync_load_s"],
                             "bytes": t["sync_bytes"]})
        finally:
            engine.close()
            if lora:
                model.unload()
        best = min(runs[1:] or runs, key=lambda r: r["total_s"])
        out[variant] = {"runs": runs, "gb_per_s_end_to_end": best["bytes"] / 1e9 / best["total_s"],
                        "check_fraction": best["check_s"] / best["total_s"], "bytes": best["bytes"]}
    if os.environ.get("RM_BENCH_SYNC_INBAND", "1") == "1":
        out["inband"] = inband_bench(model_dir, learner)
    return out


def inband_bench(model_dir: Path, learner) -> dict[str, Any]:
    """In-band full sync of ``learner`` to one ``serve --engine vllm`` on this GPU, over the HTTP body and through a
    shared directory (``--shm-dir`` / ``sync.shm_dir`` under ``/dev/shm``), with client and server phases."""
    import tempfile

    import httpx

    from trainer.launch.health import serve_subprocess
    from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine

    nbytes = sum(p.numel() * p.element_size() for p in learner.state_dict().values())
    shm_root = "/dev/shm" if Path("/dev/shm").is_dir() else None
    out: dict[str, Any] = {"bytes": nbytes, "phases": (
        "client encode_s = full weights copied into the payload (device to host); post_s = HTTP post until the "
        "answer; server read_s = body received (HTTP only), decode_s = payload to the GPU (one host-to-device "
        "copy), load_s = check + load into vLLM")}
    try:
        with tempfile.TemporaryDirectory(prefix="rm-bench-shm-", dir=shm_root) as shm_dir, \
                serve_subprocess("--engine", "vllm", "--model", str(model_dir), "--max-model-len", "1024",
                                 "--gpu-memory-utilization", "0.2", "--enforce-eager", "--dtype", "bfloat16",
                                 "--shm-dir", shm_dir, timeout_s=300) as (url, _, _):
            for variant, shm in (("http", None), ("shm", shm_dir)):
                client = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=300, transport="inband", shm_dir=shm)
                times, client_phases = [], []
                for _ in range(3):
                    t0 = time.perf_counter()
                    client.sync_full(learner)
                    times.append(time.perf_counter() - t0)
                    client_phases.append(dict(client.transport().last_push))
                client.close()
                endpoint = "rm/update_weights_shm" if shm else "rm/update_weights_inband"
                server_phases = [{k: u.get(k) for k in ("read_s", "decode_s", "load_s")}
                                 for u in httpx.get(f"{url}/rm/info/", timeout=30).json()["updates"]
                                 if u["endpoint"] == endpoint]
                out[variant] = {"seconds": times, "gb_per_s": nbytes / 1e9 / min(times),
                                "client_phases": client_phases, "server_phases": server_phases}
        out["gb_per_s"] = out["http"]["gb_per_s"]
        out["shm_gb_per_s"] = out["shm"]["gb_per_s"]
        return out
    except Exception as exc:  # noqa: BLE001 - recorded, the rest of the benchmark stands
        return {**out, "error": f"{type(exc).__name__}: {exc}"[-3000:]}


def step_bench(model_dir: Path, out_dir: Path, steps: int = 4) -> dict[str, Any]:
    from trainer.config.schema import validate_config
    from trainer.sft.run import run_training
    from trainer.telemetry import read_jsonl

    res = {}
    for backend in ("vllm", "hf"):
        rm: dict[str, Any] = {"rollout_backend": backend, "rollout_generate_batch_size": 8,
                              "decoding": {"max_new_tokens": 128, "temperature": 0.0}}
        if backend == "vllm":
            rm["vllm"] = {"mode": "colocate", "max_model_len": 2048, "sleep_level": 2, "gpu_memory_utilization": 0.3}
        else:
            rm["hf"] = {"cache_implementation": "static", "compile": True}
        cfg = {"model": {"path": str(model_dir), "torch_dtype": "bfloat16"},
               "data": {"synthetic": {"num_samples": 64, "seed": 0, "min_objects": 1, "max_objects": 3,
                                      "image_size": 64}},
               "training": {"output_dir": str(out_dir / backend), "max_steps": steps, "per_device_train_batch_size": 8,
                            "learning_rate": 1e-5, "logging_steps": 1, "seed": 0, "disable_tqdm": True, "bf16": True,
                            "report_to": ["jsonl"], "packing": True, "packing_length": 8192,
                            "gradient_checkpointing": True},
               "custom": {"extra": {"rollout_matching": rm}}}
        t0 = time.perf_counter()
        summary = run_training(validate_config(cfg))
        rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
        timed = rows[1:] or rows  # the first step pays start-up and compilation
        keys = sorted({k for r in timed for k in r if k.startswith("time/")})
        res[backend] = {"wall_s": time.perf_counter() - t0, "steps": len(rows),
                        "per_step": {k: sum(r.get(k, 0.0) for r in timed) / len(timed) for k in keys}}
    return res


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    eng = result.get("engine_bench", {})
    if "engine" in eng:
        ns = list(eng["engine"])
        x = range(len(ns))
        axes[0].bar([i - 0.2 for i in x], [eng["raw_vllm"][n]["tokens_per_s"] for n in ns], 0.4, label="vllm.LLM")
        axes[0].bar([i + 0.2 for i in x], [eng["engine"][n]["tokens_per_s"] for n in ns], 0.4, label="ours")
        axes[0].set_xticks(list(x), [f"{n} req" for n in ns])
        axes[0].set_title("new tokens/s (0.6B, 256 new)")
        axes[0].legend()
    sync = result.get("sync_bench", {})
    bars = {k: sync[k]["gb_per_s_end_to_end"] for k in ("plain", "lora") if k in sync}
    inband = sync.get("inband", {})
    bars.update({label: inband[key] for label, key in (("inband", "gb_per_s"), ("inband shm", "shm_gb_per_s"))
                 if key in inband})
    axes[1].bar(list(bars), list(bars.values()))
    axes[1].set_title("weight sync GB/s (0.6B, bf16)")
    step = result.get("step_bench", {})
    parts = ("rollout", "weight_sync", "target", "forward", "backward")
    colors = dict(zip(parts, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    for i, backend in enumerate(step):
        bottom = 0.0
        for part in parts:
            v = step[backend]["per_step"].get(f"time/{part}_s", 0.0)
            axes[2].bar(i, v, bottom=bottom, color=colors[part], label=part if i == 0 else None)
            bottom += v
    axes[2].set_xticks(range(len(step)), list(step))
    axes[2].set_title("stage-2 step split (s)")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(out: Path, only: str = "vllm") -> dict[str, Any]:
    """Run the vLLM benchmarks into ``out/vllm.json`` (merging into an existing file) and ``out/vllm.png``.
    ``only``: ``vllm`` (engine + sync), ``vllm-engine``, ``vllm-sync`` or ``vllm-step``; the JSON is written after
    each part."""
    if not torch.cuda.is_available():
        raise SystemExit("bench --only vllm needs a CUDA GPU and vLLM (see ../shared/tools/gpu-bundle)")
    work = Path(os.environ.get("RM_BENCH_WORK", "/tmp/rm-bench-vllm"))
    model_dir = save_random_model_dir(work / "qwen3-0.6b-random")
    path = out / "vllm.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    result.update({"device": device_name("cuda"), "torch": torch.__version__, "shape": "Qwen3-0.6B (random weights)"})
    try:
        import vllm

        result["vllm"] = vllm.__version__
    except ImportError:
        pass
    parts = {"vllm": ("engine", "sync"), "vllm-engine": ("engine",), "vllm-sync": ("sync",),
             "vllm-step": ("step",)}[only]
    for part in parts:
        t0 = time.perf_counter()
        print(f"bench vllm: {part} ...", flush=True)
        if part == "engine":
            result["engine_bench"] = engine_bench(model_dir)
            result["engine_over_raw_vllm"] = result["engine_bench"]["engine_over_raw_vllm"]
        elif part == "sync":
            fresh = sync_bench(model_dir)  # variants left out by RM_BENCH_SYNC_* keep their earlier records
            result["sync_bench"] = {**result.get("sync_bench", {}), **fresh}
            done = [k for k in ("plain", "lora") if k in fresh]
            result["colocate_sync_gb_s"] = {**result.get("colocate_sync_gb_s", {}),
                                            **{k: fresh[k]["gb_per_s_end_to_end"] for k in done}}
            result["sync_check_fraction"] = {**result.get("sync_check_fraction", {}),
                                             **{k: fresh[k]["check_fraction"] for k in done}}
        else:
            result["step_bench"] = step_bench(model_dir, work / "step")
        print(f"bench vllm: {part} done in {time.perf_counter() - t0:.1f} s", flush=True)
        path.write_text(json.dumps(result, indent=2))  # each part lands even if a later one runs out of time
        plot(result, out / "vllm.png")
    print(json.dumps({k: result.get(k) for k in ("engine_over_raw_vllm", "colocate_sync_gb_s", "sync_check_fraction")},
                     indent=1))
    return result


if __name__ == "__main__":
    if sys.argv[1] == "--raw":
        _raw_main(sys.argv[2], float(sys.argv[3]), sys.argv[4])
