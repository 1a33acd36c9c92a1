"""``training.deepspeed`` values the schema accepts: a preset name (as ms-swift accepts them) or a path to a DeepSpeed
JSON file. ``trainer.sft.deepspeed_config`` turns a valid value into what ``TrainingArguments`` takes."""

from __future__ import annotations

import os

PRESETS = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")


def problem(value: str) -> str | None:
    """Why ``value`` is not a usable ``training.deepspeed`` (None when it is)."""
    if value in PRESETS or os.path.isfile(value):
        return None
    return (f"{value!r} is neither a preset ({', '.join(PRESETS)}) nor an existing DeepSpeed JSON file "
            f"(paths are relative to the working directory)")
