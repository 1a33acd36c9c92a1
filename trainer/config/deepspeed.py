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


def zero_stage(value: str) -> int | None:
    """The ZeRO stage a valid ``training.deepspeed`` value selects (None: a JSON file that names none)."""
    if value in PRESETS:
        return int(value[4])
    import json

    with open(value, encoding="utf-8") as fh:
        stage = (json.load(fh).get("zero_optimization") or {}).get("stage")
    return int(stage) if isinstance(stage, int | float | str) and str(stage).isdigit() else None
