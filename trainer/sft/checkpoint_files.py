"""Where a stage-2 run keeps its checkpoints, read by the trainer that writes them and by ``launch --resume auto``.

``<training.output_dir>/stage2/checkpoint-<step>/`` holds HF's checkpoint and each rank's rollout state
(``rank<i>-rollout_state.pt``), written last and atomically: a folder holding it for every rank is complete.
"""

from __future__ import annotations

import re
from pathlib import Path

#: where ``trainer.sft.run.run_training`` puts the stage-2 trainer's output under ``training.output_dir``
STAGE2_DIR = "stage2"
ROLLOUT_STATE = "rollout_state.pt"


def rollout_state_name(rank: int) -> str:
    """The file of ``rank``'s rollout state in a checkpoint folder."""
    return f"rank{rank}-{ROLLOUT_STATE}"


_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_folders(stage2_dir: str | Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders in ``stage2_dir``, newest step first (none when the folder is missing)."""
    root = Path(stage2_dir)
    if not root.is_dir():
        return []
    steps = [(int(m.group(1)), d) for d in root.iterdir() if d.is_dir() and (m := _CHECKPOINT.match(d.name))]
    return [d for _, d in sorted(steps, reverse=True)]
