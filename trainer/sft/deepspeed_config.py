"""``training.deepspeed``: a preset name (``zero1``, ``zero2``, ``zero3``, ``zero2_offload``, ``zero3_offload``, as
ms-swift accepts them) or a path to a DeepSpeed JSON file. Presets become HF-style configs whose batch, accumulation,
precision and clipping fields are ``"auto"`` (filled from the training arguments by transformers)."""

from __future__ import annotations

from typing import Any

from trainer.config.deepspeed import PRESETS, problem  # noqa: F401 - problem re-exported for callers


def preset(name: str) -> dict[str, Any]:
    """The DeepSpeed config dict of a preset; ``ValueError`` naming the presets for anything else."""
    if name not in PRESETS:
        raise ValueError(f"unknown DeepSpeed preset {name!r}; use one of {', '.join(PRESETS)} or a JSON file path")
    stage = int(name[4])
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "stage3_gather_16bit_weights_on_model_save": True})
    else:
        zero.update({"allgather_partitions": True, "allgather_bucket_size": 5e8, "reduce_scatter": True})
    if name.endswith("_offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto", "zero_allow_untested_optimizer": True}


def resolve(value: str | None) -> dict[str, Any] | str | None:
    """What ``TrainingArguments(deepspeed=...)`` takes: a preset's dict, or the JSON path unchanged."""
    if value is None:
        return None
    return preset(value) if value in PRESETS else value
