"""What a benchmark run measured, from the files the trainer wrote: its metrics rows and every rank's ledger.

``measure``: trained samples/s (ledger rows of every rank after the warm-up step over the timed steps' wall time),
per-phase means, the ledger check and the learner's settings as it logged them; ``summarise_steps``: the step split,
peak memory per phase, the weight sync's parts and the forward + backward's MFU / HFU (``fwd_bwd_flops``,
``FLOP_COUNT``); ``recompiles_after_first_step``; ``trl_over_ours``: TRL's step against ours. Pure functions over
rows and files; the runner (``trainer.bench.runner``) calls them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.bench.models import (
    QWEN3_VL_TEXT,
    QWEN3_VL_VISION,
    TINY_TEXT,
    TINY_VISION,
    adapter_params,
    meta_model,
    param_counts,
)
from trainer.telemetry import read_jsonl


@dataclass(frozen=True)
class Work:
    """What one learner rank did per optimizer step, from a variant's validated config: a random Qwen3-VL of ``size``
    (``trainer.bench.models``), ``batch`` records rolled out and trained, images of ``image_size`` px, ``tuner`` with
    ``lora_rank``, rollouts of ``max_new_tokens``, and the step profiled (0: none; left out of the means)."""

    size: str
    batch: int
    image_size: int
    tuner: str = "full"
    lora_rank: int = 0
    max_new_tokens: int = 0
    profile_step: int = 0


FLOP_COUNT = ("mfu: model FLOPs of the forward + backward / fwd+bwd seconds / peak: per language-model block weight and "
              "token 2 forward + 4 backward when trained, 2 + 2 when frozen (LoRA/DoRA base), 6 per adapter "
              "parameter; causal attention 6 * layers * heads * head_dim * s^2 per segment; frozen vision tower "
              "forward only; lm_head: vocab * hidden per logit row (the supervised rows the objective projects, "
              "tokens/ce + tokens/coord), 6 when it trains (full fine-tune), 4 when frozen (LoRA/DoRA). mfu_blocks: "
              "the same without the lm_head. hfu: model FLOPs + the "
              "gradient-checkpointing recompute (one more forward of every block) + the chunked objective's "
              "recompute of each logit row's projection; the recompute a compiled layer does under "
              "training.compile_activation_memory_budget < 1 (levers.compile_activation_memory_budget) is not in it")


def fwd_bwd_flops(size: str, tokens: float, samples: float, patches_per_image: int, tuner: str = "full",
                  lora_rank: int = 0, checkpointing: bool | float = False, logit_rows: float = 0.0
                  ) -> dict[str, float]:
    """FLOPs of one packed forward + backward over ``tokens`` in ``samples`` segments of equal length:
    ``model`` (what MFU counts) and ``hardware`` (what HFU counts; ``model`` plus the recompute of every block's
    forward when ``checkpointing``), with the parameter counts behind them.

    A language-model block weight costs 2 per token forward, 2 for the input gradient and, when it trains, 2 for its
    weight gradient: 6 per trained, 4 per frozen parameter-token. ``tuner`` ``lora`` / ``dora``: the blocks are
    frozen and the adapter (``adapter_params``) trains at 6 (DoRA's weight-norm work is per step, not per token).
    Causal attention: 2 * L * heads * head_dim * s^2 forward, twice that backward. The frozen vision tower: forward
    only, 2 per parameter per patch and full attention 4 * depth * hidden * P^2 per image. ``checkpointing`` may be
    the fraction of the blocks recomputed (selective checkpointing, ``recomputed_fraction``). The LM head projects
    ``logit_rows`` rows (the supervised positions, full vocabulary): 2 forward + 2 input gradient + 2 weight gradient
    per head parameter and row when it trains (full fine-tune), 4 when frozen; the chunked objective recomputes each
    row's projection in its backward (``hardware`` only). ``model_blocks``: ``model`` without the head."""
    if tuner not in ("full", "lora", "dora"):
        raise ValueError(f"tuner {tuner!r}: one of full, lora, dora")
    if tuner != "full" and lora_rank <= 0:
        raise ValueError(f"tuner {tuner!r} needs lora_rank > 0, got {lora_rank}")
    text = TINY_TEXT if size == "tiny" else QWEN3_VL_TEXT[size]
    vision = TINY_VISION if size == "tiny" else QWEN3_VL_VISION[size]
    counts = param_counts(size)
    blocks = counts["text_blocks"]
    adapter = adapter_params(size, lora_rank) if tuner != "full" else 0
    trained, frozen = (blocks, 0) if tuner == "full" else (adapter, blocks)
    seg = tokens / max(samples, 1)
    attn_fwd = 2 * text["num_hidden_layers"] * text["num_attention_heads"] * text["head_dim"] * seg * seg * samples
    vis = samples * (2 * counts["vision"] * patches_per_image
                     + 4 * vision["depth"] * vision["hidden_size"] * patches_per_image ** 2)
    blocks_model = 6 * trained * tokens + 4 * frozen * tokens + 3 * attn_fwd + vis
    head_params = meta_model(size).config.text_config.vocab_size * text["hidden_size"]
    head = (6 if tuner == "full" else 4) * head_params * logit_rows
    recompute = float(checkpointing) * (2 * (trained + frozen) * tokens + attn_fwd) + 2 * head_params * logit_rows
    return {"model": blocks_model + head, "hardware": blocks_model + head + recompute, "model_blocks": blocks_model,
            "lm_head": head, "logit_rows": logit_rows, "trained_params": trained, "frozen_block_params": frozen,
            "checkpointing": checkpointing}


def logit_rows(metrics: dict[str, Any]) -> float:
    """The rows the objective projected through the LM head in a step's metrics row: its supervised CE rows and coord
    slots (``tokens/ce`` + ``tokens/coord``; 0 in a row without them)."""
    return float(metrics.get("tokens/ce", 0.0)) + float(metrics.get("tokens/coord", 0.0))


#: the phases inside HF's ``training_step`` (``time/step_s``); ``time/backward_s`` is the backward plus HF's
#: bookkeeping inside ``training_step``, never the optimizer step (``time/optimizer_s``, after it)
TRAINING_STEP_PHASES = ("weight_sync", "rollout", "target", "forward", "backward")


def summarise_steps(run: Work, rows: list[dict[str, Any]], checkpointing: bool | float,
                    peak_tflops: float | None = None) -> dict[str, Any]:
    """The record's timing fields from the stage-2 metrics rows (one per optimizer step; means leave out the first
    step, which pays CUDA-graph capture, compilation and first allocations, and a profiled step).

    ``step_s``: HF's ``training_step`` (``split``: each of ``TRAINING_STEP_PHASES`` as a share of it);
    ``optimizer_s``: clipping + ``optimizer.step()`` + scheduler + ``zero_grad``, after ``training_step``;
    ``step_wall_s``: one optimizer step's end to the next, everything (``wall_split``: the training_step phases, the
    ``optimizer`` and ``other`` (logging, callbacks, data loading) as shares of it). Metrics written before the
    trainer timed the optimizer give ``None`` for both and no ``wall_split``. ``timed_steps``: each step the means
    cover, with its own forward + backward seconds, wall time, tokens, rows and MFU, so the spread behind a mean is
    in the record. MFU / HFU divide by ``peak_tflops``, the card's dense BF16 peak (``models.peak_bf16_tflops``;
    ``None``, on the CPU or a card without a known peak, leaves them out)."""
    numbered = [(i + 1, r) for i, r in enumerate(rows) if i > 0 and i + 1 != run.profile_step] or \
        list(enumerate(rows, 1))
    timed = [r for _, r in numbered]
    avg = {k: sum(r.get(k, 0.0) for r in timed) / len(timed) for k in sorted({k for r in timed for k in r})
           if isinstance(timed[0].get(k), (int, float))}
    peaks = {k: max(r.get(k, 0.0) for r in rows) for k in sorted({k for r in rows for k in r})
             if k.startswith("mem/") or k in ("gpu_mem_peak_gib", "gpu_mem_reserved_gib", "gpu_mem_device_used_gib")}
    step_s = avg.get("time/step_s", 0.0)
    step_wall_s = avg.get("time/step_wall_s")
    optimizer_s = avg.get("time/optimizer_s")
    tokens = avg.get("batch/tokens", 0.0)
    patches = (run.image_size // 16) ** 2
    flops = fwd_bwd_flops(run.size, tokens, run.batch, patches, run.tuner, run.lora_rank, checkpointing=checkpointing,
                          logit_rows=logit_rows(avg))
    fb_s = avg.get("time/forward_s", 0.0) + avg.get("time/backward_s", 0.0)
    on_gpu = bool(fb_s) and bool(peak_tflops)
    generated = run.batch * run.max_new_tokens
    wall_split: dict[str, float] = {}
    if step_wall_s:
        wall_split = {p: avg.get(f"time/{p}_s", 0.0) / step_wall_s for p in TRAINING_STEP_PHASES}
        wall_split["optimizer"] = (optimizer_s or 0.0) / step_wall_s
        wall_split["other"] = max(0.0, step_wall_s - step_s - (optimizer_s or 0.0)) / step_wall_s
    timed_steps = [{"step": n, "fwd_bwd_s": r.get("time/forward_s", 0.0) + r.get("time/backward_s", 0.0),
                    "step_wall_s": r.get("time/step_wall_s"), "tokens": r.get("batch/tokens", 0.0),
                    "rows": r.get("batch/rows_per_step"), "logit_rows": logit_rows(r)} for n, r in numbered]
    for t in timed_steps:
        f = fwd_bwd_flops(run.size, t["tokens"], run.batch, patches, run.tuner, run.lora_rank,
                          checkpointing=checkpointing, logit_rows=t["logit_rows"])["model"]
        t["mfu"] = f / t["fwd_bwd_s"] / 1e12 / peak_tflops if on_gpu and t["fwd_bwd_s"] else None
    return dict(
        steps=len(rows), per_step={k: v for k, v in avg.items() if k.startswith(("time/", "batch/", "rollout/", "tokens/"))},
        timed_steps=timed_steps,
        peak_gib=peaks, step_s=step_s, optimizer_s=optimizer_s, step_wall_s=step_wall_s,
        rollout_tokens_per_s=generated / avg["time/generate_s"] if avg.get("time/generate_s") else None,
        train_tokens_per_s=tokens / fb_s if fb_s else None,
        fwd_bwd_tflops=flops["model"] / fb_s / 1e12 if fb_s else None,
        mfu=flops["model"] / fb_s / 1e12 / peak_tflops if on_gpu else None,
        mfu_blocks=flops["model_blocks"] / fb_s / 1e12 / peak_tflops if on_gpu else None,
        hfu=flops["hardware"] / fb_s / 1e12 / peak_tflops if on_gpu else None, peak_tflops=peak_tflops,
        flops=flops, flop_count=FLOP_COUNT,
        split={p: avg.get(f"time/{p}_s", 0.0) / step_s for p in TRAINING_STEP_PHASES} if step_s else {},
        wall_split=wall_split,
        **sync_breakdown(avg),
    )


#: the sub-phases of a colocate ``weight_sync`` (``telemetry.phase``), in the order they run
SYNC_PARTS = ("sync_learner_check", "sync_collect", "sync_check", "sync_wake", "sync_check_wait", "sync_load")


def sync_breakdown(avg: dict[str, float]) -> dict[str, Any]:
    """From a step's mean ``time/*_s``: ``sync_parts_s`` (each sub-phase of the weight sync, plus ``unaccounted``:
    the sync's wall time outside them), and ``sleep_wake_sync_s`` = the engine's sleep after decoding + its wake
    before decoding + the weight sync (which wakes the weights): the whole price of sharing the GPU with a
    sleep-mode engine per step."""
    sync = avg.get("time/weight_sync_s", 0.0)
    parts = {p: avg[f"time/{p}_s"] for p in SYNC_PARTS if f"time/{p}_s" in avg}
    if not sync:
        return {}
    out: dict[str, Any] = {"sync_parts_s": {**parts, "unaccounted": max(0.0, sync - sum(parts.values()))}}
    if "time/sleep_s" in avg:
        out["sleep_wake_sync_s"] = avg["time/sleep_s"] + avg.get("time/wake_s", 0.0) + sync
    return out


def recomputed_fraction(levers: dict[str, Any], default: bool) -> bool | float:
    """The fraction of the decoder layers a run recomputed in its backward, from its ``setup`` metrics row
    (``train/checkpointed_layers`` of ``train/decoder_layers``, ``levers`` without the prefix); ``default`` (the
    config's bool) without one."""
    done, layers = levers.get("checkpointed_layers"), levers.get("decoder_layers")
    if done is None or not layers:
        return default
    return True if done == layers else done / layers


def trl_over_ours(trl: dict[str, Any], ours: dict[str, Any]) -> dict[str, float | None]:
    """TRL seconds / ours per part (> 1: we are faster; ``None`` where a side lacks the figure).

    ``step_wall``: one optimizer step's end to the next on both sides (``step_wall_s``: everything, the ratio to
    quote); ``training_step``: HF's ``training_step`` on both sides (generation, sync, forward, backward; no optimizer
    on either side: the ratio published under ``step`` before ``step_wall`` existed); ``generate``; ``weight_sync``;
    ``train_fwd_bwd``: TRL's ``training_step`` less its ``_prepare_inputs`` (generation, sync, rewards) against our
    forward + backward (no optimizer on either side; published as ``train_fwd_bwd_opt`` before, a wrong name);
    ``optimizer``: the optimizer step (``optimizer_s``); ``train_tokens``: the tokens TRL's loss ran over (prompt +
    completion, no padding) against the tokens of our step's packed rows (``batch/tokens``): the two sides train
    different sequences (TRL: prompt + sampled completion; ours: prompt + the rebuilt target), so
    ``train_fwd_bwd_per_token`` divides each side's forward + backward seconds by its own tokens;
    ``step_wall_range``: ``[lowest, highest]`` ratio any timed step of TRL's makes with any timed step of ours (TRL's
    first step left out as its mean leaves it out; ours: ``timed_steps``), so a ratio of means that sits on a
    target is published with the spread behind it (``None`` without per-step wall times on both sides)."""
    blocks = {k.split(".", 1)[-1]: v for k, v in trl.get("blocks_s", {}).items()}  # "GRPOTrainerSubclass.vLLM.generate"
    step = ours.get("per_step", {})
    trl_generate = blocks.get("vLLM.generate", 0.0)
    trl_sync = blocks.get("sync_weights", 0.0)
    trl_train = trl["step_s"] - blocks.get("_prepare_inputs", trl_generate + trl_sync)
    ours_train = step.get("time/forward_s", 0.0) + step.get("time/backward_s", 0.0)

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return {
        "step_wall": ratio(trl.get("step_wall_s"), ours.get("step_wall_s")),
        "training_step": ratio(trl["step_s"], ours.get("step_s")),
        "generate": ratio(trl_generate, step.get("time/generate_s")),
        "weight_sync": ratio(trl_sync, step.get("time/weight_sync_s")),
        "train_fwd_bwd": ratio(trl_train, ours_train),
        "optimizer": ratio(trl.get("optimizer_s"), ours.get("optimizer_s")),
        "train_tokens": ratio(trl.get("train_tokens"), step.get("batch/tokens")),
        "train_fwd_bwd_per_token": ratio(ratio(trl_train, trl.get("train_tokens")),
                                         ratio(ours_train, step.get("batch/tokens"))),
        "step_wall_range": step_wall_range(trl.get("step_wall_s_runs") or [], ours.get("timed_steps") or []),
    }


def step_wall_range(trl_walls: list[float], ours_timed: list[dict[str, Any]]) -> list[float] | None:
    """``[min TRL step / max our step, max TRL step / min our step]`` over the steps each side's mean covers (TRL's
    ``step_wall_s_runs`` less its first, as ``trl_peer.steady_mean``; ours: ``timed_steps``)."""
    theirs = [w for w in trl_walls[1:] if w]
    ours = [t["step_wall_s"] for t in ours_timed if t.get("step_wall_s")]
    if not theirs or not ours:
        return None
    return [min(theirs) / max(ours), max(theirs) / min(ours)]


def stage2_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stage-2 optimizer-step rows among a metrics file's rows."""
    return [r for r in rows if r.get("phase") == "stage2" and "loss" in r]


def _jsonl(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(x) for p in paths for x in p.read_text().splitlines() if x.strip()]


#: the per-step means a record keeps
MEANS = ("time/step_s", "time/step_wall_s", "time/weight_sync_s", "time/rollout_s", "time/generate_s", "time/encode_s",
         "time/pixels_during_decode_s", "time/target_s", "time/forward_s", "time/backward_s", "time/optimizer_s",
         "rollout/samples", "rollout/staleness_mean", "batch/rows_per_step", "batch/fill", "batch/filler_rows",
         "packing/carried", "gc/pause_s", "gc/gen2_collections")


def measure(run_dir: Path, records_per_step: int, first_step: int = 1) -> dict[str, Any]:
    """Throughput and per-step means of a finished run (rank 0's ``metrics.jsonl``, every rank's ledger and carry
    under ``stage2/``), over the steps after ``first_step`` (the warm-up steps up to it are left out).
    ``ledger.unaccounted``: records the steps took that no rank trained or still carries (0 when none was lost)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = stage2_steps(rows)
    if len(steps) <= first_step:
        raise RuntimeError(f"{len(steps)} steps logged; need more than {first_step} to measure")
    ledger = _jsonl(sorted((run_dir / "stage2").glob("ledger*.jsonl")))
    carried = [r["sample_id"] for r in _jsonl(sorted((run_dir / "stage2").glob("carried*.jsonl")))]
    start, end = steps[first_step - 1]["time"], steps[-1]["time"]
    trained = sum(1 for r in ledger if r["step"] >= first_step)
    timed = steps[first_step:]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    setup = next((r for r in rows if r.get("phase") == "setup"), {})
    ids = [r["sample_id"] for r in ledger]
    return {
        "window": [start, end], "steps_measured": len(timed), "trained_samples": trained,
        "trained_samples_per_s": trained / (end - start) if end > start else None,
        "step_wall_s": (end - start) / len(timed),
        "ledger": {"rows": len(ids), "duplicated": len(ids) - len(set(ids)), "carried": len(carried),
                   "carried_and_trained": len(set(carried) & set(ids)),
                   "unaccounted": records_per_step * len(steps) - len(ids) - len(carried)},
        "means": {k: mean(k) for k in MEANS},
        "learner_peak_gib": max((r.get("mem/step_peak_gib", 0.0) for r in steps), default=None),
        "learner": {k.removeprefix("train/"): v for k, v in setup.items() if k.startswith("train/")},
        "recompiles_after_first_step": recompiles_after_first_step(steps),
    }


def recompiles_after_first_step(steps: list[dict[str, Any]]) -> float | None:
    """``compile/recompiles_after_first_step`` of the last step that logged it: the graphs Dynamo compiled after the
    first optimizer step, counted from the second step on and summed over the ranks by the trainer. ``None`` when no
    step logged it (an eager run, or a trainer without the metric): unknown, not 0."""
    values = [r["compile/recompiles_after_first_step"] for r in steps if "compile/recompiles_after_first_step" in r]
    return values[-1] if values else None
