"""``training.deepspeed`` values the schema accepts: a preset name (as ms-swift accepts them) or a path to a DeepSpeed
JSON file. ``trainer.sft.deepspeed_config`` turns a valid value into what ``TrainingArguments`` takes."""

from __future__ import annotations

import os

PRESETS = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
STAGES = (0, 1, 2, 3)


def problem(value: str) -> str | None:
    """Why ``value`` is not a usable ``training.deepspeed`` (None when it is): not a preset nor a file, or a JSON
    file that is not a JSON object or whose ``zero_optimization.stage`` is not a ZeRO stage (``zero_stage``)."""
    if value in PRESETS:
        return None
    if not os.path.isfile(value):
        return (f"{value!r} is neither a preset ({', '.join(PRESETS)}) nor an existing DeepSpeed JSON file "
                f"(paths are relative to the working directory)")
    try:
        zero_stage(value)
    except ValueError as exc:
        return str(exc)
    return None


def zero_stage(value: str) -> int | None:
    """The ZeRO stage a ``training.deepspeed`` preset or JSON file selects (None: a file that names none). A stage
    written as a float with an integral value (``3.0``) is that stage; any other value that is not one of
    ``STAGES`` (``2.5``, ``"3"``, ``true``) raises a one-line ``ValueError`` naming the file and the key."""
    if value in PRESETS:
        return int(value[4])
    import json

    try:
        with open(value, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{value}: not a readable DeepSpeed JSON file ({type(exc).__name__}: {exc})") from exc
    zero = cfg.get("zero_optimization") if isinstance(cfg, dict) else None
    if not isinstance(cfg, dict) or not isinstance(zero, dict | None):
        what = "the file" if not isinstance(cfg, dict) else "zero_optimization"
        raise ValueError(f"{value}: {what} is not a JSON object")
    stage = (zero or {}).get("stage")
    if stage is None:
        return None
    if isinstance(stage, int | float) and not isinstance(stage, bool) and stage in STAGES:
        return int(stage)
    raise ValueError(f"{value}: zero_optimization.stage is {json.dumps(stage)}, not a ZeRO stage (one of "
                     f"{', '.join(map(str, STAGES))}, a number)")
