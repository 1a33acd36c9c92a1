"""What to change when a stage-2 step runs out of GPU memory.

``TrainingOutOfMemory`` replaces torch's ``OutOfMemoryError`` raised inside a step (it is one, so ``except
torch.OutOfMemoryError`` still catches it): it names the phase that ran out (the innermost step phase the error passed
through: ``forward``, ``sync_collect``, ``generate``, ...), the optimizer step, the peak memory of each phase so far,
the device's size, and the settings that lower that phase's memory, with their config keys and current values, most
effective first. ``advice`` is pure: ``MemorySettings`` (the knobs, read once from the config) and a phase in, lines
out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

#: ``gradient_checkpointing_every_n_layers`` unset (``trainer.modeling.checkpointing.DEFAULT_EVERY_N``; this layer may
#: not import that one)
SELECTIVE_EVERY_N = 2

RM = "custom.extra.rollout_matching"

#: step phases (``trainer.sft.trainer.STEP_PHASES`` and their sub-phases) grouped by what holds memory in them
TRAIN_PHASES = frozenset({"forward", "backward"})
SYNC_PHASES = frozenset({"weight_sync", "sync_learner_check", "sync_collect", "sync_check", "sync_wake", "sync_load",
                         "sync_check_wait", "sync_identity", "sync_push", "sync_wait_decodes"})
ROLLOUT_PHASES = frozenset({"rollout", "generate", "wake", "sleep"})
#: a sleeping engine mapping its memory back (the KV cache before a decode, the weights in a sync)
WAKE_PHASES = frozenset({"wake", "sync_wake"})
#: ``optimizer.step()`` (AdamW's first call allocates its two states for every trained parameter)
OPTIMIZER_PHASES = frozenset({"optimizer"})


@dataclass(frozen=True)
class MemorySettings:
    """The settings that decide a stage-2 step's GPU memory."""

    tuner: str = "full"
    deepspeed: str | None = None
    packing: bool = False
    packing_length: int | None = None
    batch_size: int = 1
    batch_key: str = "training.per_device_train_batch_size"
    #: the checkpointing policy that runs: ``full``, ``off`` or ``selective/N`` (``auto`` resolved at start-up)
    checkpointing: str = "off"
    supervised_logits_only: bool = True
    logit_chunk_rows: int | None = 1024
    rollout_backend: str = "vllm"
    vllm_mode: str = "colocate"
    gpu_memory_utilization: float = 0.45
    sleep_level: int | str = 0
    enable_lora: bool = False
    sync_mode: str = "full"
    sync_transport: str = "auto"
    bucket_mb: int = 512
    offload: bool = False
    rollout_generate_batch_size: int = 1
    max_new_tokens: int = 0

    @property
    def colocate(self) -> bool:
        return self.rollout_backend == "vllm" and self.vllm_mode == "colocate"


def checkpointing_label(t) -> str:
    """The policy a (resolved) ``TrainingConfig`` runs: ``full``, ``off``, ``auto`` or ``selective/N``."""
    policy = t.checkpointing_policy
    return f"selective/{t.gradient_checkpointing_every_n_layers or SELECTIVE_EVERY_N}" if policy == "selective" else policy


def memory_settings(cfg, stage1: bool = False) -> MemorySettings:
    """``MemorySettings`` of a validated ``TrainConfig``'s stage 2 (``stage1``: of its teacher-forced warm-up, which
    packs as stage 2 does and never decodes)."""
    if stage1:
        return replace(memory_settings(cfg), batch_size=cfg.stage1.batch_size, batch_key="stage1.batch_size")
    t = cfg.training
    rm = cfg.custom.extra.rollout_matching
    if rm is None:
        return MemorySettings(tuner=cfg.tuner.train_type, deepspeed=t.deepspeed, packing=t.packing,
                              packing_length=t.packing_length, batch_size=t.per_device_train_batch_size,
                              checkpointing=checkpointing_label(t))
    v = rm.vllm
    return MemorySettings(
        tuner=cfg.tuner.train_type, deepspeed=t.deepspeed, packing=t.packing, packing_length=t.packing_length,
        batch_size=t.per_device_train_batch_size, checkpointing=checkpointing_label(t),
        supervised_logits_only=rm.loss.supervised_logits_only, logit_chunk_rows=rm.loss.logit_chunk_rows,
        rollout_backend=rm.rollout_backend, vllm_mode=v.mode,
        gpu_memory_utilization=v.gpu_memory_utilization, sleep_level=v.sleep_level, enable_lora=v.enable_lora,
        sync_mode=v.sync.mode, sync_transport=v.sync.transport, bucket_mb=v.sync.bucket_mb,
        offload=rm.offload.enabled, rollout_generate_batch_size=rm.rollout_generate_batch_size,
        max_new_tokens=rm.decoding.max_new_tokens)


def _train_advice(s: MemorySettings) -> list[str]:
    out = []
    if s.packing:
        out.append(f"training.packing_length (now {s.packing_length}): fewer tokens per packed forward; the "
                   "activations of every packed token are held until the backward")
    else:
        out.append(f"{s.batch_key} (now {s.batch_size}): fewer targets per padded forward (set "
                   "training.records_per_step to keep the records per optimizer step)")
    if s.checkpointing != "full":
        out.append(_checkpointing_line(s, "keep one input per layer, recompute the rest in the backward"))
    if not s.supervised_logits_only:
        out.append(f"{RM}.loss.supervised_logits_only: true (now false): logits only where a label or coord slot "
                   "is supervised, not over the whole vocabulary at every position")
    elif s.logit_chunk_rows is None or s.logit_chunk_rows > 1024:
        out.append(f"{RM}.loss.logit_chunk_rows: 1024 (now {s.logit_chunk_rows}): the loss holds that many rows of "
                   "full-vocabulary logits at a time instead of every supervised row's")
    out += _engine_kept_lines(s, "the forward and backward")
    if s.tuner == "full" and not s.deepspeed:
        out.append("tuner.train_type: lora (now full), or training.deepspeed: zero2_offload / zero3_offload: a full "
                   "fine-tune holds weights, gradients and AdamW's two states for every parameter")
    return out


def _engine_kept_lines(s: MemorySettings, through: str) -> list[str]:
    """What a colocated engine keeps on the GPU ``through`` a training phase at its sleep level, and the level that
    gives it back."""
    if not s.colocate:
        return []
    if s.sleep_level == 0:
        return [f"{RM}.vllm.sleep_level: 2 (now 0): the colocated engine keeps gpu_memory_utilization="
                f"{s.gpu_memory_utilization:g} of the GPU through {through}; asleep it gives it back"]
    if s.sleep_level == "kv_cache":
        return [f"{RM}.vllm.sleep_level: 2 (now kv_cache): the colocated engine keeps its weights on the GPU through "
                f"{through}; at 2 it gives them back too (each sync then maps them back before loading)"]
    return []


def _checkpointing_line(s: MemorySettings, why: str) -> str:
    return f"training.gradient_checkpointing_policy: full (now {s.checkpointing}): {why}"


def _wake_advice(s: MemorySettings) -> list[str]:
    """A sleeping colocated engine maps its pool back beside what the learner holds after its step: the learner's
    activations decide whether it fits."""
    if not (s.colocate and s.sleep_level):
        return []
    why = (f"the sleeping engine maps its pool (gpu_memory_utilization={s.gpu_memory_utilization:g}) back beside what "
           "the learner's backward left reserved")
    out = [_checkpointing_line(s, why)] if s.checkpointing != "full" else []
    if s.packing:
        out.append(f"training.packing_length (now {s.packing_length}): fewer activations per packed row, so less "
                   "held by the learner when the engine wakes")
    return out


def _sync_advice(s: MemorySettings) -> list[str]:
    out = []
    if s.tuner == "lora" and s.sync_mode != "adapter":
        out.append(f"{RM}.vllm.sync.mode: adapter with {RM}.vllm.enable_lora: true (now sync.mode {s.sync_mode}): the "
                   "merged sync materializes every LoRA-adapted weight once more; an adapter sync sends the LoRA "
                   "factors alone (decoding through vLLM's LoRA kernels is slower, docs/benchmarks)")
    elif s.tuner == "dora":
        out.append("DoRA always syncs merged weights (vLLM cannot serve DoRA): tuner.train_type: lora keeps the "
                   "adapter-sync option open")
    if s.colocate and s.sleep_level == 0:
        out.append(f"{RM}.vllm.sleep_level: 2 (now 0): the engine's KV cache stays allocated during the sync")
    if s.colocate and s.tuner == "full" and not s.deepspeed:
        out.append("training.deepspeed: zero2_offload / zero3_offload, or tuner.train_type: lora: the engine's weights "
                   "wake beside the learner's weights and optimizer state")
    if not s.colocate and s.sync_transport != "inband":
        out.append(f"{RM}.vllm.sync.bucket_mb (now {s.bucket_mb}): smaller NCCL buckets")
    return out


def _rollout_advice(s: MemorySettings) -> list[str]:
    out = []
    if s.colocate:
        out.append(f"{RM}.vllm.gpu_memory_utilization (now {s.gpu_memory_utilization:g}): the engine's pool (weights "
                   "+ KV cache) must fit beside what the learner keeps on the GPU while it decodes")
        if not s.offload:
            out.append(f"{RM}.offload.enabled: true (now false): the learner's parameters and optimizer state leave "
                       "the GPU while the engine decodes")
        if s.sleep_level == 0:
            out.append(f"{RM}.vllm.sleep_level: 2 (now 0): then the engine holds its pool only while it decodes")
    else:
        out.append(f"{RM}.rollout_generate_batch_size (now {s.rollout_generate_batch_size}) or "
                   f"{RM}.decoding.max_new_tokens (now {s.max_new_tokens}): HF generate keeps a KV cache for every "
                   "sequence of a batch")
    return out


def _optimizer_advice(s: MemorySettings) -> list[str]:
    out = []
    if s.tuner == "full":
        if not s.deepspeed:
            out.append("training.deepspeed: zero2 (now none): AdamW's two states and the gradients are sharded over "
                       "the data-parallel ranks; zero2_offload keeps the states in CPU memory")
        elif "offload" not in s.deepspeed:
            out.append(f"training.deepspeed: {s.deepspeed.split('_')[0]}_offload (now {s.deepspeed}): the optimizer "
                       "states live in CPU memory")
        out.append("tuner.train_type: lora (now full): optimizer states for the adapter's parameters only")
    out += _engine_kept_lines(s, "the optimizer step")
    return out


def advice(phase: str | None, s: MemorySettings) -> list[str]:
    """The settings that lower ``phase``'s GPU memory (``None``: outside any named phase, i.e. the backward and the
    optimizer step), most effective first; never empty."""
    if phase is None or phase in TRAIN_PHASES:
        out = _train_advice(s)
    elif phase in SYNC_PHASES:
        out = (_wake_advice(s) if phase in WAKE_PHASES else []) + _sync_advice(s)
    elif phase in ROLLOUT_PHASES:
        out = (_wake_advice(s) if phase in WAKE_PHASES else []) + _rollout_advice(s)
    elif phase in OPTIMIZER_PHASES:
        out = _optimizer_advice(s)
    else:
        out = []
    return out or [f"nothing in the configuration sizes the {phase} phase's memory: it ran out because the rest of the "
                   "step left too little; lower the largest phase below first (" + "; ".join(_train_advice(s)) + ")"]


class TrainingOutOfMemory(torch.OutOfMemoryError):
    """A stage-2 step ran out of GPU memory (module docstring); ``phase``, ``step`` and ``advice`` as fields."""

    def __init__(self, message: str, phase: str, step: int, lines: list[str]):
        super().__init__(message)
        self.phase, self.step, self.advice = phase, step, list(lines)

    def __reduce__(self):
        return type(self), (str(self), self.phase, self.step, self.advice)

    def with_checkpoint(self, checkpoint: str | None) -> TrainingOutOfMemory:
        where = (f"resume from {checkpoint} with the change (--resume-from-checkpoint latest)" if checkpoint
                 else "no checkpoint was written before this step")
        return TrainingOutOfMemory(f"{self}\nTraining stopped; {where}.", self.phase, self.step, self.advice)


def explain(exc: BaseException, phase: str | None, step: int, settings: MemorySettings,
            peaks_gib: Mapping[str, float], device_gib: float | None) -> TrainingOutOfMemory:
    """The ``TrainingOutOfMemory`` for torch's ``exc`` raised in ``phase`` (None: backward / optimizer step) of
    optimizer step ``step``; ``peaks_gib``: peak allocated GiB per phase so far this logging interval."""
    name = phase or "backward"
    lines = advice(phase, settings)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    peaks = ", ".join(f"{k} {v:.1f}" for k, v in sorted(peaks_gib.items(), key=lambda kv: -kv[1])[:8])
    device = f"{device_gib:.1f} GiB in all" if device_gib else "size unknown"
    message = (f"training step {step} ran out of GPU memory in {name}: {first}\n"
               f"GPU: {device}; peak allocated by phase so far: {peaks or 'none recorded'} GiB\n"
               "What to change, most effective first:\n" + "\n".join(f"  - {line}" for line in lines))
    return TrainingOutOfMemory(message, name, step, lines)
