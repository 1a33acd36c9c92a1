"""Stage-2 at real Qwen3-VL sizes on one GPU (``python -m trainer bench --only scale``; ``docs/benchmarks/scale.json``).

Random-weight **Qwen3-VL** models at the published 2B / 4B / 8B shapes (``transformers.Qwen3VLConfig``, vision tower
included, built on the GPU, no download) run whole stage-2 steps through the product's own path
(``trainer.sft.run.run_training``): vLLM colocate rollouts (sleep level 2: the engine gives its memory back between
rollouts), parse / match / targets, weight sync, a packed forward + backward with gradient checkpointing, the optimizer
step. Inputs are realistic: synthetic 1024x1024 detection images (1024 visual tokens after the 2x2 merge) with 40-80
objects each, so the ground-truth answer that stage 2 trains on is 1-2k tokens. Random weights never stop and never
parse, so every rollout runs to ``decoding.max_new_tokens`` (the worst case of a real run) and every target is built
from the ground truth, as stage 2 does for an unparseable rollout.

Per configuration: seconds per phase (``time/<phase>_s``; ``step_s`` is HF's ``training_step``: weight sync, rollout,
targets, forward, backward; ``optimizer_s`` the optimizer step after it, in no phase before issue 37; ``step_wall_s``
one optimizer step's end to the next, everything: the figure compared with TRL's), peak GPU memory per phase
(``mem/<phase>_peak_gib``),
the weight sync split into its parts (``sync_parts_s``: learner check, collect + LoRA merge, update check, wake,
load) and the sleep + wake + sync price per step (``sleep_wake_sync_s``), rollout tokens/s, trained tokens/s, and
fwd+bwd MFU and HFU (``fwd_bwd_flops``; the record's ``flop_count`` names the count): MFU counts model FLOPs, 6 per
trainable and 4 per frozen language-model weight per token (a LoRA/DoRA base does no weight-gradient matmuls; its
adapter's own parameters count 6), causal attention, and the frozen vision tower's forward at 2 (lm_head excluded: a
conservative figure); HFU adds the gradient-checkpointing recompute, one more forward of every block. A
configuration that runs out of memory is recorded with the phase it was in and the setting that makes it fit.
``--quick``: the tiny Qwen3-VL on the CPU with the HF backend, so CI runs the bench's code path.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import shutil
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from trainer.bench.models import device_name, peak_bf16_tflops

#: published Qwen3-VL-{2B,4B,8B}-Instruct ``config.json`` dimensions (text model / vision tower).
QWEN3_VL_TEXT = {
    "2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
               num_key_value_heads=8, head_dim=128),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
}
QWEN3_VL_VISION = {
    "2b": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
               deepstack_visual_indexes=[5, 11, 17]),
    "4b": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
               deepstack_visual_indexes=[5, 11, 17]),
    "8b": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
               deepstack_visual_indexes=[8, 16, 24]),
}
TIED = {"2b": True, "4b": True, "8b": False}
VOCAB = 151936
#: the tiny shape's head counts divide by 1, 2 and 4, so that vLLM TP groups of those sizes can serve it
TINY_TEXT = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=64)
TINY_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                   deepstack_visual_indexes=[0])


@dataclass(frozen=True)
class ScaleRun:
    """One configuration of the bench: model size, tuner, vLLM sleep level and memory share."""

    size: str
    tuner: str = "full"  # full | lora | dora
    lora_rank: int = 64
    #: 0, 1, 2 (vLLM's levels) or ``kv_cache`` (``RM_BENCH_SCALE_SLEEP``: the KV cache alone sleeps, the weights stay
    #: mapped; name ``-sleepkv``)
    sleep_level: int | str = 2
    gpu_memory_utilization: float = 0.3
    batch: int = 8
    steps: int = 3
    max_new_tokens: int = 1536
    image_size: int = 1024
    min_objects: int = 40
    max_objects: int = 80
    #: LoRA/DoRA learners: False = merged full sync into an engine without LoRA kernels (``sync.mode: full``, what
    #: TRL does); True = adapter sync into an engine with ``enable_lora`` (``sync.mode: adapter``)
    vllm_lora: bool = False
    #: ``training.compile_decoder_layers`` for the teacher-forced step (``RM_BENCH_SCALE_COMPILE=1``, or ``0,1``
    #: for eager and compiled in one call; name suffix ``-compiled``)
    compile_layers: bool = False
    #: the stage-2 step whose forward + backward runs under torch.profiler (``RM_BENCH_SCALE_PROFILE=N``; 0: none);
    #: the profiled step is left out of the per-step means
    profile_step: int = 0
    #: ``loss.logit_chunk_rows`` (``RM_BENCH_SCALE_LOGIT_CHUNK``: a row count, or ``none`` for every supervised row
    #: at once, name suffix ``-allrows``); the default is the config's own
    logit_chunk_rows: int | None = 1024
    #: ``vllm.sync.merge_precision`` (``RM_BENCH_SCALE_MERGE``; ``float32`` adds the name suffix ``-mergef32``)
    merge_precision: str = "weight_dtype"
    #: ``training.use_liger_kernel`` (``RM_BENCH_SCALE_LIGER=1``, name suffix ``-liger``)
    liger: bool = False
    #: ``training.gradient_checkpointing_policy`` (``RM_BENCH_SCALE_CKPT``: full | selective | off | auto; suffix
    #: ``-ckpt<policy>`` unless full, what every earlier row ran)
    checkpointing: str = "full"
    #: ``training.optim`` (``RM_BENCH_SCALE_OPTIM``: adamw_torch_fused, the default, or adamw_torch, suffix
    #: ``-unfusedadam``)
    optim: str = "adamw_torch_fused"
    #: ``vllm.sync.prewake`` (``RM_BENCH_SCALE_PREWAKE``: 0, the default since session 15, or 1, suffix ``-prewake``;
    #: session 15's records named ``-noprewake`` ran with it off when on was the default)
    prewake: bool = False
    #: ``vllm.sync.recorded_load`` (``RM_BENCH_SCALE_RECLOAD``: 0, the default, or 1, suffix ``-recload``)
    recorded_load: bool = False
    #: ``training.packing_length`` (``RM_BENCH_SCALE_PACKING``: comma-separated token counts; suffix ``-pack<n>``
    #: unless 16384, what every earlier row ran)
    packing_length: int = 16384
    #: ``vllm.pixels_during_decode`` (``RM_BENCH_SCALE_PIXELS``: 0, the default, or 1, suffix ``-pixels``): the
    #: training pixels made on a thread while vLLM decodes (GPU runs only: the CPU ``--quick`` run decodes with HF)
    pixels_during_decode: bool = False
    #: ``training.phase_timing`` (``RM_BENCH_SCALE_PHASE_TIMING``: events, the default since session 21, or sync,
    #: suffix ``-phasesync``: the device synchronized after every row's forward, as every record before session 21)
    phase_timing: str = "events"
    #: ``training.host_vision_metadata`` (``RM_BENCH_SCALE_HOST_VISION``: 1, the default since session 21, or 0,
    #: suffix ``-devicevision``: the vision encoder derives its metadata from a grid on the GPU, as every record before)
    host_vision_metadata: bool = True
    #: ``training.packed_varlen_kernel`` (``RM_BENCH_SCALE_VARLEN``: op, the default since session 24, or api, suffix
    #: ``-varlenapi``: torch's public varlen_attn with K/V repeated and a graph break per compiled layer, as every
    #: record before)
    varlen_kernel: str = "op"
    #: ``training.compile_activation_memory_budget`` (``RM_BENCH_SCALE_MEMBUDGET``: 1, the default, a fraction or
    #: auto, suffix ``-membudget<b>``; needs compiled layers and a policy other than full, auto the policy auto: other
    #: combinations are left out, with a line saying so)
    activation_memory_budget: float | str = 1.0
    #: ``vllm.sync.overlap_wake`` (``RM_BENCH_SCALE_OVERLAPWAKE``: 0, the default, or 1, suffix ``-overlapwake``; not
    #: with prewake: that combination is left out, with a line saying so)
    overlap_wake: bool = False
    #: ``vllm.sync.merge_into_engine`` (``RM_BENCH_SCALE_MERGEIN``: 0, the default, or 1, suffix ``-mergein``; needs
    #: recorded_load, a LoRA tuner, sleep level 2 and no overlap_wake: other combinations are left out, with a line)
    merge_into_engine: bool = False
    #: ``training.freeze_heap_after_first_step`` (``RM_BENCH_SCALE_GCFREEZE``: 1, the default since session 28, or 0,
    #: suffix ``-nofreeze``: the heap frozen only before training, as every record before)
    freeze_heap_after_first_step: bool = True

    @property
    def name(self) -> str:
        tuner = self.tuner if self.tuner == "full" else f"{self.tuner}{self.lora_rank}"
        served = "-vllmlora" if self.vllm_lora else ""
        compiled = "-compiled" if self.compile_layers else ""
        chunks = "-allrows" if self.logit_chunk_rows is None else (
            "" if self.logit_chunk_rows == 1024 else f"-chunk{self.logit_chunk_rows}")
        merge = "-mergef32" if self.merge_precision == "float32" else ""
        levers = ("-liger" if self.liger else "") + (
            "" if self.checkpointing == "full" else f"-ckpt{self.checkpointing}") + (
            "-unfusedadam" if self.optim == "adamw_torch" else "") + ("-prewake" if self.prewake else "") + (
            "-recload" if self.recorded_load else "") + (
            "" if self.packing_length == 16384 else f"-pack{self.packing_length}") + (
            "-pixels" if self.pixels_during_decode else "") + ("-phasesync" if self.phase_timing == "sync" else "") + (
            "" if self.host_vision_metadata else "-devicevision") + (
            "" if self.varlen_kernel == "op" else f"-varlen{self.varlen_kernel}") + (
            "" if self.activation_memory_budget == 1.0 else f"-membudget{self.activation_memory_budget}") + (
            "-overlapwake" if self.overlap_wake else "") + ("-mergein" if self.merge_into_engine else "") + (
            "" if self.freeze_heap_after_first_step else "-nofreeze")
        sleep = "kv" if self.sleep_level == "kv_cache" else self.sleep_level
        return (f"{self.size}-{tuner}{served}-sleep{sleep}-util{self.gpu_memory_utilization:g}{compiled}"
                f"{chunks}{merge}{levers}")


#: the configurations of issue 30 on one 80 GB H100 (``RM_BENCH_SCALE`` picks some by name prefix, e.g. ``2b,8b-lora``)
RUNS = (
    ScaleRun("2b", "full", gpu_memory_utilization=0.3),
    ScaleRun("4b", "full", gpu_memory_utilization=0.2),
    ScaleRun("8b", "lora", sleep_level=2, gpu_memory_utilization=0.35),
    ScaleRun("8b", "lora", sleep_level=2, gpu_memory_utilization=0.35, vllm_lora=True),
    ScaleRun("8b", "lora", sleep_level=1, gpu_memory_utilization=0.35),
    ScaleRun("8b", "dora", sleep_level=2, gpu_memory_utilization=0.35),
)
QUICK = ScaleRun("tiny", "full", batch=2, steps=1, max_new_tokens=8, image_size=64, min_objects=2, max_objects=4)


def vl_config(size: str):
    """``Qwen3VLConfig`` of a published size (or ``tiny``), with the embedded tokenizer's special-token ids."""
    from transformers import Qwen3VLConfig

    from trainer.modeling.fixtures import (
        IM_END,
        IMAGE_PAD,
        PAD_TOKEN,
        VIDEO_PAD,
        VISION_END,
        VISION_START,
        tiny_tokenizer,
    )

    tok = tiny_tokenizer()
    tiny = size == "tiny"
    text = {**(TINY_TEXT if tiny else QWEN3_VL_TEXT[size]), "vocab_size": len(tok) if tiny else VOCAB,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "pad_token_id": tok.convert_tokens_to_ids(PAD_TOKEN), "eos_token_id": tok.convert_tokens_to_ids(IM_END),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0 if tiny else 5_000_000.0,
                                "mrope_section": [12, 10, 10] if tiny else [24, 20, 20], "mrope_interleaved": True}}
    vision = {**(TINY_VISION if tiny else QWEN3_VL_VISION[size]), "patch_size": 16, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_position_embeddings": 64 if tiny else 2304}
    return Qwen3VLConfig(text_config=text, vision_config=vision,
                         image_token_id=tok.convert_tokens_to_ids(IMAGE_PAD),
                         video_token_id=tok.convert_tokens_to_ids(VIDEO_PAD),
                         vision_start_token_id=tok.convert_tokens_to_ids(VISION_START),
                         vision_end_token_id=tok.convert_tokens_to_ids(VISION_END),
                         tie_word_embeddings=True if tiny else TIED[size])


def save_random_vl_model(out: Path, size: str, device: str) -> tuple[Path, dict[str, float]]:
    """A random-weight Qwen3-VL model directory (weights drawn on ``device``, bf16 on a GPU), with the embedded
    tokenizer and a Qwen3-VL image processor (16 px patches, 2x2 merge; up to 4096x4096 pixels). Returns the
    directory and the build / save seconds."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration

    from trainer.modeling.fixtures import tiny_tokenizer

    times: dict[str, float] = {}
    if (out / ".complete").is_file():
        return out, times
    t0 = time.perf_counter()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(vl_config(size), dtype=dtype)
    model.generation_config.eos_token_id = None
    if device != "cpu":
        torch.cuda.synchronize()
    times["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 32 * 32, "longest_edge": 4096 * 4096}).save_pretrained(out)
    times["save_s"] = time.perf_counter() - t0
    del model
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    (out / ".complete").write_text(size)
    return out, times


@functools.cache
def _meta_model(size: str):
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        return Qwen3VLForConditionalGeneration._from_config(vl_config(size))


def param_counts(size: str) -> dict[str, int]:
    """Parameters of the language model's blocks (no embeddings / lm_head) and of the vision tower."""
    model = _meta_model(size)
    blocks = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and "visual" not in n)
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    total = sum(p.numel() for p in model.parameters())
    return {"text_blocks": blocks, "vision": vision, "total": total}


def adapter_params(size: str, rank: int) -> int:
    """Parameters of a rank-``rank`` LoRA on the linears the product adapts in a multimodal model with a frozen
    vision tower (``trainer.modeling.loading.LANGUAGE_PROJECTIONS``): rank x (in + out) per linear."""
    from trainer.modeling.loading import LANGUAGE_PROJECTIONS

    return sum(rank * (m.in_features + m.out_features) for n, m in _meta_model(size).named_modules()
               if isinstance(m, torch.nn.Linear) and re.fullmatch(LANGUAGE_PROJECTIONS, n))


#: what ``fwd_bwd_flops`` counts, written into every bench record beside ``mfu`` / ``hfu``
FLOP_COUNT = ("mfu: model FLOPs of the forward + backward / fwd+bwd seconds / peak: per language-model block weight and "
              "token 2 forward + 4 backward when trained, 2 + 2 when frozen (LoRA/DoRA base), 6 per adapter "
              "parameter; causal attention 6 * layers * heads * head_dim * s^2 per segment; frozen vision tower "
              "forward only; lm_head: vocab * hidden per logit row (the supervised rows the objective projects, "
              "tokens/ce + tokens/coord), 6 when it trains (full fine-tune), 4 when frozen (LoRA/DoRA). mfu_blocks: "
              "the same without the lm_head (every record before session 26). hfu: model FLOPs + the "
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
    head_params = _meta_model(size).config.text_config.vocab_size * text["hidden_size"]
    head = (6 if tuner == "full" else 4) * head_params * logit_rows
    recompute = float(checkpointing) * (2 * (trained + frozen) * tokens + attn_fwd) + 2 * head_params * logit_rows
    return {"model": blocks_model + head, "hardware": blocks_model + head + recompute, "model_blocks": blocks_model,
            "lm_head": head, "logit_rows": logit_rows, "trained_params": trained, "frozen_block_params": frozen,
            "checkpointing": checkpointing}


def stage2_config(run: ScaleRun, model_dir: Path, out_dir: Path, backend: str) -> dict[str, Any]:
    rm: dict[str, Any] = {"rollout_backend": backend, "rollout_generate_batch_size": run.batch,
                          "decoding": {"max_new_tokens": run.max_new_tokens, "temperature": 0.0}}
    if backend == "vllm":
        rm["vllm"] = {"mode": "colocate", "max_model_len": 4096, "sleep_level": run.sleep_level,
                      "gpu_memory_utilization": run.gpu_memory_utilization}
    cfg: dict[str, Any] = {
        "model": {"path": str(model_dir), "torch_dtype": "bfloat16" if backend == "vllm" else "float32"},
        "data": {"synthetic": {"num_samples": run.batch * (run.steps + 1), "seed": 0, "min_objects": run.min_objects,
                               "max_objects": run.max_objects, "image_size": run.image_size}},
        "training": {"output_dir": str(out_dir), "max_steps": run.steps, "per_device_train_batch_size": run.batch,
                     "learning_rate": 1e-5, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                     "bf16": backend == "vllm", "report_to": ["jsonl"], "packing": True,
                     "packing_length": run.packing_length,
                     "gradient_checkpointing": True},
        "custom": {"extra": {"rollout_matching": rm}},
    }
    rm["loss"] = {"logit_chunk_rows": run.logit_chunk_rows}
    if backend == "vllm":
        rm["vllm"]["sync"] = {"merge_precision": run.merge_precision, "prewake": run.prewake,
                              "recorded_load": run.recorded_load, "overlap_wake": run.overlap_wake,
                              "merge_into_engine": run.merge_into_engine}
        rm["vllm"]["pixels_during_decode"] = run.pixels_during_decode
    if run.compile_layers:
        cfg["training"]["compile_decoder_layers"] = True
    if run.liger:
        cfg["training"]["use_liger_kernel"] = True
    if run.checkpointing != "full":
        cfg["training"]["gradient_checkpointing_policy"] = run.checkpointing
    if run.optim != "adamw_torch_fused":
        cfg["training"]["optim"] = run.optim
    cfg["training"]["phase_timing"] = run.phase_timing
    cfg["training"]["host_vision_metadata"] = run.host_vision_metadata
    cfg["training"]["packed_varlen_kernel"] = run.varlen_kernel
    cfg["training"]["freeze_heap_after_first_step"] = run.freeze_heap_after_first_step
    if run.activation_memory_budget != 1.0:
        cfg["training"]["compile_activation_memory_budget"] = run.activation_memory_budget
    if run.profile_step:
        cfg["training"]["profile_steps"] = [run.profile_step]
    if run.tuner != "full" and backend == "vllm" and run.vllm_lora:
        rm["vllm"]["enable_lora"] = True
        rm["vllm"]["sync"]["mode"] = "adapter"
    if run.tuner != "full":
        cfg["tuner"] = {"train_type": run.tuner, "lora_rank": run.lora_rank, "lora_alpha": 2 * run.lora_rank}
    return cfg


def fresh_output_dir(out_dir: Path) -> Path:
    """``out_dir`` emptied: the trainer appends to ``metrics.jsonl``, so a run of the same name earlier on the same
    machine (a second device call, session 18) would have its steps read into this run's means."""
    shutil.rmtree(out_dir, ignore_errors=True)
    return out_dir


def run_one(run: ScaleRun, work: Path, device: str) -> dict[str, Any]:
    from trainer.config.schema import validate_config
    from trainer.memory.oom import TrainingOutOfMemory, advice, memory_settings
    from trainer.sft.run import run_training
    from trainer.telemetry import read_jsonl

    rec: dict[str, Any] = {"config": asdict(run), "name": run.name}
    model_dir, build = save_random_vl_model(work / f"qwen3-vl-{run.size}-random", run.size, device)
    rec["model_build"] = build
    out_dir = fresh_output_dir(work / "runs" / run.name)
    backend = "vllm" if device != "cpu" else "hf"
    cfg = stage2_config(run, model_dir, out_dir, backend)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        summary = run_training(validate_config(cfg))
    except Exception as exc:  # noqa: BLE001 - recorded with the phase; the other configurations still run
        tb = traceback.format_exc()
        rows = list(read_jsonl(out_dir / "metrics.jsonl")) if (out_dir / "metrics.jsonl").is_file() else []
        rec.update(error=f"{type(exc).__name__}: {str(exc)[:600]}", traceback=tb[-4000:], steps_logged=len(rows))
        if isinstance(exc, TrainingOutOfMemory):  # the trainer named the phase and what to change
            rec.update(oom_phase=exc.phase, advice=exc.advice)
        elif isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            phase = next((ph for ph in ("generate", "rollout", "weight_sync", "forward", "backward") if ph in tb),
                         "engine start")  # outside a step (model load, vLLM start): the vLLM share is the lever
            rec.update(oom_phase=phase, advice=advice(phase if phase != "engine start" else "generate",
                                                      memory_settings(validate_config(cfg))))
        gc.collect()
        if device != "cpu":
            torch.cuda.empty_cache()
        return rec
    rec["wall_s"] = time.perf_counter() - t0
    profiled = out_dir / "stage2" / "profile"
    if run.profile_step and (profiled / f"step{run.profile_step}_train.json").is_file():
        rec["profile"] = json.loads((profiled / f"step{run.profile_step}_train.json").read_text())
    if run.profile_step and (profiled / f"step{run.profile_step}_weight_sync.json").is_file():
        rec["profile_weight_sync"] = json.loads((profiled / f"step{run.profile_step}_weight_sync.json").read_text())
    setup = next((r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "setup"), {})
    rec["levers"] = {k.removeprefix("train/"): v for k, v in setup.items() if k.startswith("train/")}
    rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
    rec.update(summarise_steps(run, rows, device,
                               recomputed_fraction(rec["levers"], cfg["training"]["gradient_checkpointing"]),
                               peak_tflops=peak_bf16_tflops(device_name(device))))
    return rec


def logit_rows(metrics: dict[str, Any]) -> float:
    """The rows the objective projected through the LM head in a step's metrics row: its supervised CE rows and coord
    slots (``tokens/ce`` + ``tokens/coord``; 0 in a row without them)."""
    return float(metrics.get("tokens/ce", 0.0)) + float(metrics.get("tokens/coord", 0.0))


#: the phases inside HF's ``training_step`` (``time/step_s``); ``time/backward_s`` is the backward plus HF's
#: bookkeeping inside ``training_step``, never the optimizer step (``time/optimizer_s``, after it)
TRAINING_STEP_PHASES = ("weight_sync", "rollout", "target", "forward", "backward")


def summarise_steps(run: ScaleRun, rows: list[dict[str, Any]], device: str,
                    checkpointing: bool | float, peak_tflops: float | None = None) -> dict[str, Any]:
    """The record's timing fields from the stage-2 metrics rows (one per optimizer step; means leave out the first
    step, which pays CUDA-graph capture, compilation and first allocations, and a profiled step).

    ``step_s``: HF's ``training_step`` (``split``: each of ``TRAINING_STEP_PHASES`` as a share of it);
    ``optimizer_s``: clipping + ``optimizer.step()`` + scheduler + ``zero_grad``, after ``training_step``;
    ``step_wall_s``: one optimizer step's end to the next, everything (``wall_split``: the training_step phases, the
    ``optimizer`` and ``other`` (logging, callbacks, data loading) as shares of it). Metrics written before the
    trainer timed the optimizer give ``None`` for both and no ``wall_split``. ``timed_steps``: each step the means
    cover, with its own forward + backward seconds, wall time, tokens, rows and MFU, so the spread behind a mean is
    in the record (session 17: the same 4B configuration gave 27.9 % and 33.6 % MFU in two calls, one step apart by
    30 %, the other within 1 %). MFU / HFU divide by ``peak_tflops``, the card's dense BF16 peak
    (``models.peak_bf16_tflops``; ``None``, on the CPU or a card without a known peak, leaves them out)."""
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
    on_gpu = bool(fb_s) and device != "cpu" and bool(peak_tflops)
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
    sleep-mode engine per step (issue 30's 0.15 s target at 8B, level 2)."""
    sync = avg.get("time/weight_sync_s", 0.0)
    parts = {p: avg[f"time/{p}_s"] for p in SYNC_PARTS if f"time/{p}_s" in avg}
    if not sync:
        return {}
    out: dict[str, Any] = {"sync_parts_s": {**parts, "unaccounted": max(0.0, sync - sum(parts.values()))}}
    if "time/sleep_s" in avg:
        out["sleep_wake_sync_s"] = avg["time/sleep_s"] + avg.get("time/wake_s", 0.0) + sync
    return out


def run_isolated(run: ScaleRun, work: Path) -> dict[str, Any]:
    """``run_one`` on the GPU in a child process, so that its memory (learner, sleeping vLLM pools, the caching
    allocator) is gone before the next configuration or the TRL side starts; then TRL on the same inputs."""
    import subprocess
    import sys

    rec_path = work / "runs" / f"{run.name}.json"
    rec_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "trainer.bench.scale", "--one", json.dumps(asdict(run)), str(work), str(rec_path)]
    proc = subprocess.run(cmd, env={**os.environ, "VLLM_PLUGINS": ""})
    if proc.returncode or not rec_path.is_file():
        return {"config": asdict(run), "name": run.name, "error": f"the bench child exited {proc.returncode}"}
    rec = json.loads(rec_path.read_text())
    if "per_step" in rec and os.environ.get("RM_BENCH_TRL", "1") == "1":
        model_dir = work / f"qwen3-vl-{run.size}-random"
        rec["trl"] = trl_side_by_side(run, model_dir, work / "runs" / run.name / "data" / "train.jsonl", work, rec)
    return rec


def trl_side_missing(env: Mapping[str, str | None]) -> str | None:
    """Why TRL's side (``RM_BENCH_TRL``, on by default for GPU runs) could not run here, said before any of ours runs
    (a GPU call once spent its whole scale run to learn that ``trl`` was not installed), or None: the packages
    ``trainer.bench.trl_peer`` imports, ``liger_kernel`` too unless ``RM_BENCH_TRL_LIGER=0``."""
    import importlib.util

    from trainer.extras import EXTRAS

    if env.get("RM_BENCH_TRL", "1") != "1":
        return None
    liger_module, liger_install = EXTRAS["liger"]
    liger = liger_module.partition(".")[0]
    wanted = ["trl", "peft"] + ([] if env.get("RM_BENCH_TRL_LIGER") == "0" else [liger])
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"RM_BENCH_TRL=1 (the default) runs TRL's GRPOTrainer beside each run, but {', '.join(missing)} "
            "cannot be imported here: install them (trl==0.29.1 as locks/cpu-test.txt pins it; on a GPU bundle, on "
            "its build line), or set RM_BENCH_TRL=0 for our side alone"
            + ("" if liger not in missing else f" (Liger: {liger_install}; RM_BENCH_TRL_LIGER=0: TRL without it)"))


def trl_side_by_side(run: ScaleRun, model_dir: Path, data: Path, work: Path, ours: dict[str, Any]) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same model, records, batch, lengths and vLLM share (``trainer.bench.trl_peer``, its own
    process), and the ratios TRL / ours per phase (> 1: we are faster)."""
    import subprocess
    import sys

    out = work / "runs" / f"{run.name}-trl.json"
    cmd = [sys.executable, *trl_peer_args(run, model_dir, data, out, os.environ.get("RM_BENCH_TRL_LIGER"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_PLUGINS": ""})
    if proc.returncode or not out.is_file():
        return {"error": f"trl_peer exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"}
    trl = json.loads(out.read_text())
    trl["trl_over_ours"] = trl_over_ours(trl, ours)
    return trl


def trl_peer_args(run: ScaleRun, model_dir: Path, data: Path, out: Path, liger: str | None) -> list[str]:
    """``python -m trainer.bench.trl_peer`` arguments for ``run``'s work. TRL runs with ``use_liger_kernel`` (its
    kernels and fused GRPO loss, what issue 37 compares against) whatever our side's levers are; ``liger``
    (``RM_BENCH_TRL_LIGER``) ``0`` turns that off, ``None`` / ``1`` keep it."""
    if liger not in (None, "", "0", "1"):
        raise SystemExit(f"RM_BENCH_TRL_LIGER={liger!r}: 1 (the default: TRL with use_liger_kernel) or 0")
    return ["-m", "trainer.bench.trl_peer", str(model_dir), str(data), str(out), "--steps", str(run.steps),
            "--batch", str(run.batch), "--max-new-tokens", str(run.max_new_tokens), "--vllm-util",
            str(run.gpu_memory_utilization), "--lora-rank", str(run.lora_rank if run.tuner != "full" else 0)] + (
        [] if liger == "0" else ["--liger"])


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


@dataclass(frozen=True)
class PlotRow:
    """One run as the plot draws it: ``label`` (the run's name, with its session and card where the record has
    them, so that records of one name from different sessions stay apart), ``split_s`` (seconds per step of each
    of ``PLOT_STEP_PARTS``), ``trl_step_wall_s`` (TRL's step on the same card in the same
    call, None where it did not run) and ``peak_gib`` (torch's peak per phase of ``PLOT_MEMORY_PHASES``)."""

    label: str
    split_s: dict[str, float]
    trl_step_wall_s: float | None
    peak_gib: dict[str, float]


PLOT_MEMORY_PHASES = ("rollout", "weight_sync", "forward", "backward")
#: the stacked parts of a plotted step: HF's training_step phases, then the optimizer step outside it
PLOT_STEP_PARTS = (*TRAINING_STEP_PHASES, "optimizer")


def plot_rows(result: dict[str, Any]) -> list[PlotRow]:
    """The plotted rows of a ``scale.json``, in file order; records without per-step metrics are left out."""
    rows = []
    for r in result["runs"]:
        if "per_step" not in r:
            continue
        session = r.get("session")
        where = ["" if session is None else f"s{session}" if isinstance(session, int) else f"session {session}",
                 str(r.get("call", "")), str(r.get("gpu", ""))]
        tag = " ".join(w for w in where if w)
        trl = r.get("trl") or {}
        rows.append(PlotRow(
            label=f"{r['name']} ({tag})" if tag else r["name"],
            split_s={p: float(r["per_step"].get(f"time/{p}_s", 0.0)) for p in PLOT_STEP_PARTS},
            trl_step_wall_s=trl.get("step_wall_s"),
            peak_gib={p: float(r["peak_gib"].get(f"mem/{p}_peak_gib", 0.0)) for p in PLOT_MEMORY_PHASES}))
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    """Horizontal bars, one line per run (names stay readable however many runs the file holds): the step split
    with TRL's step on the same card marked beside it, and torch's peak memory per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plot_rows(result)
    n = max(len(rows), 1)
    fig, axes = plt.subplots(1, 2, figsize=(16, 1.6 + 0.34 * n), sharey=True)
    ys = list(range(len(rows)))
    for j, part in enumerate(PLOT_STEP_PARTS):
        left = [sum(row.split_s[q] for q in PLOT_STEP_PARTS[:j]) for row in rows]
        axes[0].barh(ys, [row.split_s[part] for row in rows], left=left, color=f"C{j}", label=part)
    trl = [(y, row.trl_step_wall_s) for y, row in zip(ys, rows) if row.trl_step_wall_s]
    if trl:
        axes[0].scatter([t for _, t in trl], [y for y, _ in trl], marker="D", color="black", zorder=3,
                        label="TRL GRPOTrainer step (same card, same call)")
    axes[0].set_yticks(ys, [row.label for row in rows], fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("seconds per stage-2 step (means of the timed steps)")
    axes[0].set_title("step split")
    axes[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.9 / n - 0.06), ncol=4)
    height = 0.8 / len(PLOT_MEMORY_PHASES)
    for j, part in enumerate(PLOT_MEMORY_PHASES):
        axes[1].barh([y - 0.4 + (j + 0.5) * height for y in ys], [row.peak_gib[part] for row in rows], height,
                     label=part)
    axes[1].set_xlabel("peak GiB (torch allocator)")
    axes[1].set_title("peak GPU memory per phase")
    axes[1].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.9 / n - 0.06), ncol=4)
    fig.suptitle(f"stage-2 at Qwen3-VL sizes, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def selected(names: str | None) -> list[ScaleRun]:
    if not names:
        return list(RUNS)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    runs = [r for r in RUNS if any(r.name.startswith(w) for w in wanted)]
    if not runs:
        raise SystemExit(f"RM_BENCH_SCALE={names!r} matches none of {[r.name for r in RUNS]}")
    return runs


def logit_and_merge_knobs(chunk: str | None, merge: str | None) -> dict[str, Any]:
    """``ScaleRun`` overrides from ``RM_BENCH_SCALE_LOGIT_CHUNK`` (a row count or ``none``) and
    ``RM_BENCH_SCALE_MERGE`` (``weight_dtype`` | ``float32``); unset: nothing overridden."""
    out: dict[str, Any] = {}
    if chunk:
        if chunk.lower() == "none":
            out["logit_chunk_rows"] = None
        elif chunk.isdigit() and int(chunk) > 0:
            out["logit_chunk_rows"] = int(chunk)
        else:
            raise SystemExit(f"RM_BENCH_SCALE_LOGIT_CHUNK={chunk!r}: a positive row count, or none (every row at once)")
    if merge:
        from trainer.sync.weights import MERGE_PRECISIONS

        if merge not in MERGE_PRECISIONS:
            raise SystemExit(f"RM_BENCH_SCALE_MERGE={merge!r}: one of {', '.join(MERGE_PRECISIONS)}")
        out["merge_precision"] = merge
    return out


def recomputed_fraction(levers: dict[str, Any], default: bool) -> bool | float:
    """The fraction of the decoder layers a run recomputed in its backward, from its ``setup`` metrics row
    (``train/checkpointed_layers`` of ``train/decoder_layers``, ``levers`` without the prefix); ``default`` (the
    config's bool) without one."""
    done, layers = levers.get("checkpointed_layers"), levers.get("decoder_layers")
    if done is None or not layers:
        return default
    return True if done == layers else done / layers


def _on(v: str) -> bool:
    return v == "1"


#: each lever knob: the environment variable, the ``ScaleRun`` field it sets, the values it takes (the first is the
#: default) and how a value becomes the field's
LEVERS: dict[str, tuple[str, tuple[str, ...], Callable[[str], Any]]] = {
    "RM_BENCH_SCALE_LIGER": ("liger", ("0", "1"), _on),  # training.use_liger_kernel
    "RM_BENCH_SCALE_CKPT": ("checkpointing", ("full", "selective", "off", "auto"), str),  # gradient_checkpointing_policy
    "RM_BENCH_SCALE_OPTIM": ("optim", ("adamw_torch_fused", "adamw_torch"), str),  # training.optim
    "RM_BENCH_SCALE_PREWAKE": ("prewake", ("0", "1"), _on),  # vllm.sync.prewake
    "RM_BENCH_SCALE_COMPILE": ("compile_layers", ("0", "1"), _on),  # training.compile_decoder_layers
    "RM_BENCH_SCALE_RECLOAD": ("recorded_load", ("0", "1"), _on),  # vllm.sync.recorded_load
    "RM_BENCH_SCALE_SLEEP": ("sleep_level", ("2", "1", "0", "kv_cache"),  # vllm.sleep_level, replacing the run's own
                             lambda v: int(v) if v.isdigit() else v),
    "RM_BENCH_SCALE_PIXELS": ("pixels_during_decode", ("0", "1"), _on),  # vllm.pixels_during_decode
    "RM_BENCH_SCALE_PHASE_TIMING": ("phase_timing", ("events", "sync"), str),  # training.phase_timing
    "RM_BENCH_SCALE_HOST_VISION": ("host_vision_metadata", ("1", "0"), _on),  # training.host_vision_metadata
    "RM_BENCH_SCALE_VARLEN": ("varlen_kernel", ("op", "api"), str),  # training.packed_varlen_kernel
    "RM_BENCH_SCALE_MEMBUDGET": ("activation_memory_budget", ("1", "0.7", "0.6", "0.5", "0.4", "0.3", "auto"),
                                 lambda v: v if v == "auto" else float(v)),  # compile_activation_memory_budget
    "RM_BENCH_SCALE_OVERLAPWAKE": ("overlap_wake", ("0", "1"), _on),  # vllm.sync.overlap_wake
    "RM_BENCH_SCALE_MERGEIN": ("merge_into_engine", ("0", "1"), _on),  # vllm.sync.merge_into_engine
    "RM_BENCH_SCALE_GCFREEZE": ("freeze_heap_after_first_step", ("1", "0"), _on),  # freeze_heap_after_first_step
}


def lever_knobs(env: Mapping[str, str | None]) -> list[dict[str, Any]]:
    """``ScaleRun`` overrides from the ``LEVERS`` variables set in ``env``: each takes one value or a comma-separated
    list, and every combination runs (``RM_BENCH_SCALE_LIGER=0,1`` measures Liger beside the default in one call).
    None set: ``[{}]``, nothing overridden."""
    import itertools

    axes: list[list[tuple[str, Any]]] = []
    for name, (field, allowed, convert) in LEVERS.items():
        value = env.get(name)
        if not value:
            continue
        values = [v.strip() for v in value.split(",") if v.strip()]
        if not values or any(v not in allowed for v in values):
            raise SystemExit(f"{name}={value!r}: one or more (comma-separated) of {', '.join(allowed)}")
        axes.append([(field, convert(v)) for v in dict.fromkeys(values)])
    return [dict(combo) for combo in itertools.product(*axes)]


def refused_combination(run: ScaleRun) -> str | None:
    """Why ``run`` cannot run, or None when it can: the problems ``validate_config`` finds in its stage-2 config (the
    config's own rules, in its words), or a lever with nothing to act on here (``merge_into_engine`` beside a full
    fine-tune or an adapter sync: no LoRA merge)."""
    from trainer.config.errors import ConfigErrors
    from trainer.config.schema import validate_config

    try:
        validate_config(stage2_config(run, Path("model"), Path("out"), "vllm"))
    except ConfigErrors as e:
        return "; ".join(str(err) for err in e.errors)
    if run.merge_into_engine and (run.tuner == "full" or run.vllm_lora):
        return ("vllm.sync.merge_into_engine has no LoRA merge to write in a full fine-tune or an adapter sync; "
                "leave RM_BENCH_SCALE_MERGEIN off for it")
    return None


def with_levers(runs: list[ScaleRun], knobs: list[dict[str, Any]]) -> list[ScaleRun]:
    """Each run once per ``lever_knobs`` combination, in that order; a combination its config would refuse
    (``refused_combination``) is left out with a printed line, and none left at all is refused."""
    out = []
    reasons = []
    for run in (replace(r, **k) for r in runs for k in knobs):
        reason = refused_combination(run)
        if reason is None:
            out.append(run)
        else:
            reasons.append(reason)
            print(f"[scale] {run.name}: left out: {reason}")
    if runs and knobs and not out:
        raise SystemExit(f"no run left: {'; '.join(dict.fromkeys(reasons))}")
    return out


def with_utilisations(runs: list[ScaleRun], utils: str | None) -> list[ScaleRun]:
    """Each run once per ``gpu_memory_utilization`` of the comma-separated ``utils`` (``RM_BENCH_SCALE_UTILS``, for
    the memory table: model x tuner x sleep level x utilisation), in that order; ``runs`` as they are without."""
    if not utils:
        return runs
    try:
        values = [float(u) for u in utils.split(",") if u.strip()]
    except ValueError:
        raise SystemExit(f"RM_BENCH_SCALE_UTILS={utils!r}: comma-separated fractions of the GPU, e.g. 0.25,0.45") from None
    bad = [u for u in values if not 0.0 < u < 1.0]
    if bad or not values:
        raise SystemExit(f"RM_BENCH_SCALE_UTILS={utils!r}: every value must be a fraction in (0, 1), got {bad or utils}")
    return [replace(r, gpu_memory_utilization=u) for r in runs for u in values]


def with_packing_lengths(runs: list[ScaleRun], lengths: str | None) -> list[ScaleRun]:
    """Each run once per ``training.packing_length`` of the comma-separated ``lengths`` (``RM_BENCH_SCALE_PACKING``:
    shorter rows hold fewer activations, so a cheaper checkpointing policy may fit), in that order; ``runs`` as
    they are without."""
    if not lengths:
        return runs
    values = [v.strip() for v in lengths.split(",") if v.strip()]
    if not values or not all(v.isdigit() and int(v) >= 1024 for v in values):
        raise SystemExit(f"RM_BENCH_SCALE_PACKING={lengths!r}: comma-separated token counts >= 1024, e.g. 16384,8192")
    return [replace(r, packing_length=int(v)) for r in runs for v in dict.fromkeys(values)]


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    """Run the configurations into ``out/scale.json`` (merged by name into an existing file) and ``scale.png``;
    the JSON is written after each configuration."""
    device = "cuda" if torch.cuda.is_available() and not quick else "cpu"
    if device == "cpu" and not quick:
        raise SystemExit("bench --only scale needs a CUDA GPU and vLLM; `--quick` runs the tiny Qwen3-VL on the CPU")
    missing = trl_side_missing(os.environ) if device == "cuda" else None
    if missing:
        raise SystemExit(missing)
    work = Path(os.environ.get("RM_BENCH_WORK", "/tmp/rm-bench-scale"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("scale_quick.json" if quick else "scale.json")
    result = json.loads(path.read_text()) if path.is_file() and not quick else {"runs": []}
    result.update(device=device_name(device), torch=torch.__version__)
    try:
        import vllm

        result["vllm"] = vllm.__version__
    except ImportError:
        pass
    steps = int(os.environ.get("RM_BENCH_SCALE_STEPS", "0"))
    profile_step = int(os.environ.get("RM_BENCH_SCALE_PROFILE", "0"))
    knobs = logit_and_merge_knobs(os.environ.get("RM_BENCH_SCALE_LOGIT_CHUNK"), os.environ.get("RM_BENCH_SCALE_MERGE"))
    runs = [QUICK] if quick else with_utilisations(selected(os.environ.get("RM_BENCH_SCALE")),
                                                   os.environ.get("RM_BENCH_SCALE_UTILS"))
    runs = with_levers(runs, lever_knobs(os.environ))
    runs = with_packing_lengths(runs, os.environ.get("RM_BENCH_SCALE_PACKING"))
    for cfg in runs:
        cfg = replace(cfg, steps=steps) if steps else cfg
        cfg = replace(cfg, profile_step=profile_step, **knobs)
        if cfg.profile_step > cfg.steps:
            raise SystemExit(f"RM_BENCH_SCALE_PROFILE={cfg.profile_step} is past the run's {cfg.steps} steps")
        print(f"bench scale: {cfg.name} ...", flush=True)
        rec = run_one(cfg, work, device) if device == "cpu" else run_isolated(cfg, work)
        print(json.dumps({k: rec.get(k) for k in ("name", "step_s", "optimizer_s", "step_wall_s", "split", "peak_gib",
                                                  "mfu", "hfu", "timed_steps", "error")}),
              flush=True)
        print(json.dumps({k: rec.get(k) for k in ("sync_parts_s", "sleep_wake_sync_s")}), flush=True)
        print(json.dumps({"levers": rec.get("levers")}), flush=True)
        if "profile" in rec:
            p = rec["profile"]
            print(json.dumps({"profile_busy_fraction": p["busy_fraction"], "profile_wall_s": p["wall_s"],
                              "host_self_s": p.get("host_self_s"), "launches": p.get("launches"),
                              "launches_per_row": p.get("launches", 0) / p["rows"] if p.get("rows") else None,
                              "by_category_s": p["by_category_s"],
                              "host_syncs": [(g["calls"], g["frames"][:3]) for g in p.get("host_syncs", [])[:8]],
                              "top": [(k["name"][:70], round(k["seconds"], 4)) for k in p["top"][:12]]}), flush=True)
        if "profile_weight_sync" in rec:
            p = rec["profile_weight_sync"]
            print(json.dumps({"sync_profile_wall_s": p["wall_s"], "busy_fraction": p["busy_fraction"],
                              "by_category_s": p["by_category_s"], "host_to_device": p.get("host_to_device", [])[:4],
                              "host_to_device_ops": p.get("host_to_device_ops", [])[:4],
                              "top": [(k["name"][:70], round(k["seconds"], 4)) for k in p["top"][:12]]}), flush=True)
        print(json.dumps({"trl_step_wall_s": rec.get("trl", {}).get("step_wall_s"),
                          "trl_optimizer_s": rec.get("trl", {}).get("optimizer_s"),
                          "trl_over_ours": rec.get("trl", {}).get("trl_over_ours"),
                          "trl_error": rec.get("trl", {}).get("error", "")[-1500:]}), flush=True)
        result["runs"] = [r for r in result["runs"] if r.get("name") != rec["name"]] + [rec]
        path.write_text(json.dumps(result, indent=2))
        plot(result, path.with_suffix(".png"))
        gc.collect()
    return result


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--one"]:  # the child of run_isolated
        one = ScaleRun(**json.loads(sys.argv[2]))
        Path(sys.argv[4]).write_text(json.dumps(run_one(one, Path(sys.argv[3]), "cuda"), indent=2))
