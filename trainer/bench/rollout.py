"""Rollout benchmarks (pure functions; no pydantic, no CLI): HF-backend batching and rollout-buffer M-steps.

``rollout_batching_bench``: new tokens/s of ``HFRolloutEngine`` for per-sample decoding (batch 1) vs microbatches
(``rollout_generate_batch_size``), with the dynamic KV cache and with the static cache + compiled decoding. Random
Qwen3 weights (default: Qwen3-0.6B shapes), random prompt ids, and no stop ids, so every request decodes exactly
``max_new_tokens`` (checked). Per-sample decoding is timed on a subset of the requests: tokens/s is a rate, and
batch-1 decoding of every request would dominate the run. Each variant's first call (compile, CUDA-graph capture,
allocator warm-up) is excluded from the timed run and reported as ``warmup_s``.

``rollout_buffer_bench``: optimizer steps/s of the real ``RolloutMatchingTrainer`` (HF rollouts, stage-2 targets,
forward/backward, AdamW) with ``rollout_buffer.m_steps`` 1, 2, 4; synthetic samples, embedded tokenizer.

``run_rollout_benches(out_dir, quick)`` runs both and writes ``rollout.json`` and ``rollout.png``. GPU run::

    python -m trainer bench --only rollout   # or: from trainer.bench.rollout import run_rollout_benches
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from trainer.bench.models import QWEN3_0_6B, device_name, random_qwen3, sync
from trainer.rollout.hf import HFRolloutEngine
from trainer.rollout.types import DecodingParams, RolloutRequest


def random_requests(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[RolloutRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = tuple(rng.randrange(1, vocab) for _ in range(rng.randint(min_len, max_len)))
        out.append(RolloutRequest(f"r{i}", (), ids))
    return out


def time_engine(engine: HFRolloutEngine, requests: Sequence[RolloutRequest], params: DecodingParams,
                warmup: Sequence[RolloutRequest], device: str) -> dict[str, Any]:
    """Warm-up call (excluded), then one timed ``generate`` over ``requests``; new tokens/s over the timed call."""
    sync(device)
    start = time.perf_counter()
    engine.generate(warmup, params)
    sync(device)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    results = engine.generate(requests, params)
    sync(device)
    seconds = time.perf_counter() - start
    new_tokens = sum(len(r.response_token_ids) for r in results)
    calls = -(-len(requests) // engine.batch_size)
    return {"requests": len(requests), "new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_s": new_tokens / seconds, "warmup_s": warmup_s,
            # the warm-up is one full-length call: what it took beyond a timed call is compile/capture/first-use cost
            "one_time_s": max(0.0, warmup_s - seconds / calls),
            "all_full_length": all(len(r.response_token_ids) == params.max_new_tokens for r in results),
            "calls": calls}


def rollout_batching_bench(device: str = "cuda", dtype: torch.dtype | None = None, *, n_requests: int = 64,
                           per_sample_requests: int = 8, batch_sizes: Sequence[int] = (16, 64),
                           prompt_len: tuple[int, int] = (256, 512), max_new_tokens: int = 256,
                           variants: Sequence[str] = ("dynamic", "static_compiled"), prompt_pad_multiple: int = 64,
                           seed: int = 0, **shape: int) -> dict[str, Any]:
    """New tokens/s of per-sample vs batched HF rollouts for each cache variant.

    ``variants``: ``dynamic`` (HF default), ``static`` (static cache, eager), ``static_compiled`` (static cache +
    ``torch.compile`` of the decoding step, mode reduce-overhead). ``shape`` overrides the Qwen3-0.6B dimensions.
    Returns ``{"config": ..., "runs": [{variant, batch_size, tokens_per_s, speedup_vs_per_sample, ...}]}``.
    """
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model = random_qwen3(shape, device=device, dtype=dtype, seed=seed)
    vocab = model.config.vocab_size
    requests = random_requests(n_requests, *prompt_len, vocab=vocab, seed=seed)
    longest = max(requests, key=lambda r: len(r.prompt_token_ids))
    params = DecodingParams(max_new_tokens=max_new_tokens)
    runs = []
    for variant in variants:
        knobs: dict[str, Any] = {"dynamic": {},
                                 "static": {"cache_implementation": "static", "prompt_pad_multiple": prompt_pad_multiple},
                                 "static_compiled": {"cache_implementation": "static", "compile": True,
                                                     "prompt_pad_multiple": prompt_pad_multiple}}[variant]
        per_sample_rate = None
        for bs in (1, *batch_sizes):
            engine = HFRolloutEngine(model, 0, (), bs, **knobs)
            subset = requests[:per_sample_requests] if bs == 1 else requests
            # the warm-up batch holds the longest prompt, so the static cache is sized once for the whole run
            run = time_engine(engine, subset, params, [longest] * bs, device)
            per_sample_rate = run["tokens_per_s"] if bs == 1 else per_sample_rate
            runs.append({"variant": variant, "batch_size": bs, **run,
                         "speedup_vs_per_sample": run["tokens_per_s"] / per_sample_rate})
            print(f"[rollout batching] {variant:>15} bs={bs:<3} {run['tokens_per_s']:9.1f} new tok/s "
                  f"(x{runs[-1]['speedup_vs_per_sample']:.2f} vs per-sample; {run['requests']} requests in "
                  f"{run['seconds']:.1f}s; warm-up {run['warmup_s']:.1f}s, one-time {run['one_time_s']:.1f}s)", flush=True)
    dynamic_rate = {r["batch_size"]: r["tokens_per_s"] for r in runs if r["variant"] == "dynamic"}
    for r in runs:
        r["speedup_vs_dynamic_same_batch"] = (r["tokens_per_s"] / dynamic_rate[r["batch_size"]]
                                              if r["batch_size"] in dynamic_rate else None)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"config": {"device": device_name(device), "dtype": str(dtype), "model": {**QWEN3_0_6B, **shape},
                       "n_requests": n_requests, "per_sample_requests": per_sample_requests,
                       "prompt_len_range": list(prompt_len), "max_new_tokens": max_new_tokens,
                       "stop_ids": "none (every request decodes max_new_tokens)", "decoding": "greedy",
                       "prompt_pad_multiple": prompt_pad_multiple, "torch": torch.__version__,
                       "transformers": __import__("transformers").__version__},
            "runs": runs}


class _TimedEngine:
    """Pass-through engine wrapper that accumulates ``generate`` wall time and calls."""

    def __init__(self, engine: HFRolloutEngine, device: str):
        self.engine = engine
        self.device = device
        self.seconds = 0.0
        self.calls = 0

    def generate(self, requests, params):
        sync(self.device)
        start = time.perf_counter()
        out = self.engine.generate(requests, params)
        sync(self.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    def close(self) -> None:
        self.engine.close()


class TrainClock(TrainerCallback):
    """Wall time from the start of the training loop (model, optimizer and dataloader ready) to its end."""

    def __init__(self, device: str):
        self.device = device
        self.start = self.seconds = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        sync(self.device)
        self.start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        sync(self.device)
        self.seconds = time.perf_counter() - self.start


def rollout_buffer_bench(device: str = "cpu", *, model_size: str | dict[str, int] = "tiny",
                         m_steps: Sequence[int] = (1, 2, 4), steps: int = 8, batch_size: int = 4,
                         max_new_tokens: int = 64, rollout_batch_size: int | None = None,
                         seed: int = 0) -> dict[str, Any]:
    """Optimizer steps/s of ``RolloutMatchingTrainer`` (HF rollouts) for each ``rollout_buffer.m_steps``.

    ``model_size``: ``"tiny"`` (the embedded 2-layer test model) or Qwen3 dims (``hidden_size``,
    ``num_hidden_layers``, …) built with the embedded tokenizer's vocabulary. Each ``m`` gets a freshly built model
    (same seed) and runs ``steps`` optimizer steps (a multiple of every ``m``) after one untimed m=1 run; the
    clock covers the training loop only (``on_train_begin`` → ``on_train_end``), not trainer/optimizer setup.
    """
    from transformers import TrainingArguments

    from trainer.data.records import load_jsonl
    from trainer.data.synthetic import generate
    from trainer.losses.objective import LossWeights
    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.modeling.fixtures import build_tiny_model, tiny_tokenizer
    from trainer.modeling.prompts import PromptEncoder
    from trainer.sft.stage2 import Stage2Pipeline
    from trainer.sft.trainer import RolloutMatchingTrainer, SampleDataset

    if any(steps % m for m in m_steps):
        raise ValueError(f"steps={steps} must be a multiple of every m_steps {list(m_steps)}")
    tok = tiny_tokenizer()
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32

    def make_model():
        if model_size == "tiny":
            model, _ = build_tiny_model("text", seed=seed)
            model = model.to(device=device, dtype=dtype)
        else:
            model = random_qwen3({**dict(model_size), "vocab_size": len(tok)}, device=device, dtype=dtype, seed=seed,
                                 max_position_embeddings=4096)
            model.config.pad_token_id = model.generation_config.pad_token_id = tok.pad_token_id
        return model.train()

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-buffer-"))
    samples = load_jsonl(generate(work / "data", steps * batch_size, seed=seed, max_objects=3))
    pipeline = Stage2Pipeline(PromptEncoder(tok))
    stops = sorted(stop_token_ids(tok))

    def train(m: int, n_steps: int, data) -> tuple[float, _TimedEngine, Any]:
        model = make_model()
        engine = _TimedEngine(HFRolloutEngine(model, tok.pad_token_id, stops, rollout_batch_size or batch_size),
                              device)
        args = TrainingArguments(output_dir=str(work / f"m{m}-{n_steps}"), max_steps=n_steps,
                                 per_device_train_batch_size=batch_size, learning_rate=1e-5,
                                 lr_scheduler_type="constant", logging_steps=10**6, save_strategy="no",
                                 report_to=[], remove_unused_columns=False, disable_tqdm=True, seed=seed,
                                 use_cpu=not cuda, dataloader_num_workers=0)
        clock = TrainClock(device)
        trainer = RolloutMatchingTrainer(model=model, args=args, train_dataset=SampleDataset(data),
                                         pipeline=pipeline, engine=engine,
                                         decoding=DecodingParams(max_new_tokens=max_new_tokens),
                                         loss_weights=LossWeights(), target_source="rollout",
                                         rollout_buffer_m_steps=m, processing_class=tok, callbacks=[clock])
        trainer.train()
        return clock.seconds, engine, trainer

    train(1, steps, samples)  # untimed warm-up run (allocator, kernels, first-call overheads)
    runs = []
    for m in m_steps:
        seconds, engine, trainer = train(m, steps, samples)
        assert trainer.state.global_step == steps
        runs.append({"m_steps": m, "optimizer_steps": steps, "seconds": seconds, "steps_per_s": steps / seconds,
                     "rollout_calls": engine.calls, "rollout_s": engine.seconds,
                     "rollout_fraction": engine.seconds / seconds,
                     "phase_s": {k: round(v, 4) for k, v in sorted(trainer.timers.seconds.items())}})
        print(f"[rollout buffer] m_steps={m}: {steps / seconds:.3f} optimizer steps/s ({engine.calls} rollouts, "
              f"{engine.seconds:.1f}s of {seconds:.1f}s decoding)", flush=True)
    base = runs[0]["steps_per_s"]
    for r in runs:
        r["speedup_vs_first"] = r["steps_per_s"] / base
    dims = "tiny (embedded 2-layer, hidden 128)" if model_size == "tiny" else dict(model_size)
    return {"config": {"device": device_name(device), "dtype": str(dtype), "model": dims, "vocab": len(tok),
                       "batch_size": batch_size, "rollout_generate_batch_size": rollout_batch_size or batch_size,
                       "max_new_tokens": max_new_tokens, "gradient_accumulation_steps": 1,
                       "data": "synthetic detection samples (text prompts)"},
            "runs": runs}


def plot(results: dict[str, Any], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batching, buffer = results["rollout_batching"], results["rollout_buffer"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    variants = list(dict.fromkeys(r["variant"] for r in batching["runs"]))
    sizes = list(dict.fromkeys(r["batch_size"] for r in batching["runs"]))
    width = 0.8 / len(variants)
    for k, v in enumerate(variants):
        rates = {r["batch_size"]: r["tokens_per_s"] for r in batching["runs"] if r["variant"] == v}
        xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(sizes))]
        bars = ax1.bar(xs, [rates.get(s, 0.0) for s in sizes], width=width, label=v)
        ax1.bar_label(bars, fmt="%.0f", fontsize=7)
    ax1.set_xticks(range(len(sizes)), [f"batch {s}" + (" (per-sample)" if s == 1 else "") for s in sizes])
    ax1.set_ylabel("new tokens / s")
    cfg = batching["config"]
    ax1.set_title(f"HF rollouts, {cfg['max_new_tokens']} new tok, prompts {cfg['prompt_len_range'][0]}-"
                  f"{cfg['prompt_len_range'][1]} ({cfg['device']})", fontsize=9)
    ax1.legend(fontsize=8)
    ms = [r["m_steps"] for r in buffer["runs"]]
    bars = ax2.bar([str(m) for m in ms], [r["steps_per_s"] for r in buffer["runs"]], color="tab:green")
    ax2.bar_label(bars, fmt="%.2f", fontsize=8)
    ax2.set_xlabel("rollout_buffer.m_steps")
    ax2.set_ylabel("optimizer steps / s")
    ax2.set_title(f"stage-2 trainer with rollout buffer ({buffer['config']['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def run_rollout_benches(out_dir: str | Path = "docs/benchmarks", quick: bool = False,
                        device: str | None = None) -> dict[str, Any]:
    """Both benchmarks; writes ``rollout.json`` and ``rollout.png`` under ``out_dir``.

    ``quick``: CPU smoke sizes (a 2-layer Qwen3, short prompts; well under a minute). Full: Qwen3-0.6B shapes on
    CUDA, 64 requests of 256-512 prompt tokens, 256 new tokens; per-sample on 4 requests; batches 16 and 64;
    dynamic cache vs static cache + compile; then the trainer with m_steps 1/2/4 on a 4-layer hidden-1024 Qwen3.
    """
    device = device or ("cuda" if torch.cuda.is_available() and not quick else "cpu")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if quick:
        batching = rollout_batching_bench(device, n_requests=16, per_sample_requests=4, batch_sizes=(4, 16),
                                          prompt_len=(24, 48), max_new_tokens=16, variants=("dynamic", "static"),
                                          prompt_pad_multiple=16, hidden_size=128, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                          intermediate_size=256, vocab_size=2048)
        buffer = rollout_buffer_bench(device, model_size="tiny", steps=4, batch_size=2, max_new_tokens=24)
    else:
        batching = rollout_batching_bench(device, per_sample_requests=4)
        buffer = rollout_buffer_bench(device, model_size=dict(hidden_size=1024, num_hidden_layers=4,
                                                              num_attention_heads=8, num_key_value_heads=4,
                                                              head_dim=128, intermediate_size=3072),
                                      steps=8, batch_size=8, max_new_tokens=256)
    results = {"quick": quick, "rollout_batching": batching, "rollout_buffer": buffer}
    (out / "rollout.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "rollout.png")
    return results
