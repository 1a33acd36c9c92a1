"""Where a stage-2 run keeps its checkpoints, read by the trainer that writes them and by ``launch --resume auto``.

``<training.output_dir>/stage2/checkpoint-<step>/`` holds HF's checkpoint and each rank's rollout state
(``rank<i>-rollout_state.pt``), written last and atomically: a folder holding it for every rank is complete.
"""

from __future__ import annotations

#: where ``trainer.sft.run.run_training`` puts the stage-2 trainer's output under ``training.output_dir``
STAGE2_DIR = "stage2"
ROLLOUT_STATE = "rollout_state.pt"


def rollout_state_name(rank: int) -> str:
    """The file of ``rank``'s rollout state in a checkpoint folder."""
    return f"rank{rank}-{ROLLOUT_STATE}"
