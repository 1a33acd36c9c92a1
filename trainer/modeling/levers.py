"""The learner's model-level speed levers, applied once after the tuner (``trainer.sft.run.run_training``) and
recorded as the first row of ``metrics.jsonl`` (``phase: setup``), so every run says which ones ran:

- ``training.use_liger_kernel`` (``trainer.modeling.liger``): ``train/use_liger_kernel``;
- ``training.gradient_checkpointing_policy`` (``trainer.modeling.checkpointing``; ``auto`` resolved here):
  ``train/checkpointing_policy`` (full | selective | off), ``train/checkpointing_requested``,
  ``train/checkpointing_every_n_layers``, ``train/checkpointed_layers`` of ``train/decoder_layers``, and for ``auto``
  its estimates (``train/checkpointing_estimate_gib``, ``train/checkpointing_budget_gib``, and
  ``train/estimated_peak_gib``: what the plan commits plus the chosen policy's activations);
- ``training.optim`` (HF ``TrainingArguments.optim``): ``train/optim``;
- ``training.compile_decoder_layers``: ``train/compile_decoder_layers``, and the partitioner's activation memory
  budget that runs, ``train/compile_activation_memory_budget`` (``auto`` resolved with the checkpointing policy),
  beside ``train/compile_activation_memory_budget_requested`` (both null when the layers are not compiled);
- ``training.cpu_threads_per_rank`` (``trainer.sft.cpu_threads``, applied before the model loads):
  ``train/cpu_threads_per_rank`` (read back from torch) and ``train/cpu_threads_reason``;
- ``training.cpu_affinity`` (``trainer.sft.cpu_threads``, applied before the model loads): ``train/cpu_affinity``
  (the rank's CPUs, or null when not bound) and ``train/cpu_affinity_reason``;
- how the rank's idle OpenMP threads wait (``trainer.sft.cpu_threads.apply_omp_wait_policy``, before torch loads):
  ``train/omp_wait_policy`` (``PASSIVE``, the environment's value, or null: the runtime's default) and
  ``train/omp_wait_policy_reason``;
- the attention of packed rows (``training.packing``; ``training.packed_varlen_kernel`` on a CUDA GPU without
  flash-attn): ``train/packed_attention`` (``rm_varlen`` | ``rm_varlen_api`` | ``flash_attention_2`` | ``sdpa``; null
  without packing).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from trainer.modeling.checkpointing import checkpointed_decoder_layers, resolve_checkpointing, resolved_config
from trainer.modeling.compile import decoder_layers
from trainer.telemetry import JsonlWriter

log = logging.getLogger(__name__)


def apply_model_levers(cfg, model: torch.nn.Module, out: Path | None = None, world_size: int = 1,
                       device_bytes: float | None = None, packed_attention: str | None = None, cpu_threads=None,
                       cpu_affinity=None, omp_wait_policy=None):
    """Apply Liger (when on), resolve the checkpointing policy, write the ``setup`` metrics row under ``out`` (rank 0)
    and return ``(cfg with the policy that runs, the row)``. ``packed_attention``: the attention implementation the
    packed rows run (``trainer.packing.varlen_attention.choose_packed_attention``; the caller chooses it), recorded;
    ``cpu_threads``/``cpu_affinity``/``omp_wait_policy``: the ``trainer.sft.cpu_threads.CpuThreads``/``CpuAffinity``/
    ``OmpWaitPolicy`` in effect, recorded."""
    t = cfg.training
    row: dict[str, Any] = {"train/use_liger_kernel": t.use_liger_kernel, "train/optim": t.optim,
                           "train/compile_decoder_layers": t.compile_decoder_layers,

                           "train/packed_attention": packed_attention,
                           "train/cpu_threads_per_rank": cpu_threads.threads if cpu_threads else None,
                           "train/cpu_threads_reason": cpu_threads.reason if cpu_threads else None,
                           "train/cpu_affinity": cpu_affinity.cpu_list if cpu_affinity else None,
                           "train/cpu_affinity_reason": cpu_affinity.reason if cpu_affinity else None,
                           "train/omp_wait_policy": omp_wait_policy.policy if omp_wait_policy else None,
                           "train/omp_wait_policy_reason": omp_wait_policy.reason if omp_wait_policy else None}
    if t.use_liger_kernel:
        from trainer.modeling.liger import apply_liger_kernel

        applied = apply_liger_kernel(model)
        row["train/liger_swiglu_mlps"] = applied["swiglu_mlps"]
    choice = resolve_checkpointing(cfg, model, world_size, device_bytes)
    try:
        counted = (len(checkpointed_decoder_layers(model, choice.policy, choice.every_n_layers)),
                   len(decoder_layers(model)))
    except ValueError:  # no decoder layers found on this model: nothing to count
        counted = (None, None)
    row.update({"train/checkpointing_policy": choice.policy, "train/checkpointing_requested": t.checkpointing_policy,
                "train/checkpointing_every_n_layers": choice.every_n_layers,
                "train/checkpointed_layers": counted[0], "train/decoder_layers": counted[1],
                "train/compile_activation_memory_budget": choice.memory_budget,
                "train/compile_activation_memory_budget_requested": (t.compile_activation_memory_budget
                                                                     if t.compile_decoder_layers else None)})
    if choice.requested == "auto":
        row.update({"train/checkpointing_estimate_gib": choice.estimates_gib,
                    "train/checkpointing_budget_gib": choice.budget_gib,
                    "train/estimated_peak_gib": choice.estimated_peak_gib})
        log.info("gradient checkpointing auto: %s (%s)", choice.label, choice.reason)
    log.info("model levers: %s", row)
    if out is not None and int(os.environ.get("RANK", "0")) == 0:
        JsonlWriter(Path(out) / "metrics.jsonl").write({"phase": "setup", "step": 0, "time": time.time(), **row})
    return resolved_config(cfg, choice), row
