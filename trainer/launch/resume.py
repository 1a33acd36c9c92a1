"""``launch learner --resume auto``: the stage-2 checkpoint a (re)started learner resumes from.

A stage-2 run writes ``<training.output_dir>/stage2/checkpoint-<step>/``; each rank's rollout state
(``rank<i>-rollout_state.pt``) is written last and atomically, so a folder holding it for every rank is complete. The
newest complete folder is what ``trainer train --resume-from-checkpoint`` takes for an exact resume (model,
optimizer, RNG, data position, rollout and packing buffers; ledger rows past it are dropped and trained again).
"""

from __future__ import annotations

from pathlib import Path

from trainer.sft.checkpoint_files import STAGE2_DIR, checkpoint_folders, rollout_state_name


def complete(folder: Path, ranks: int) -> bool:
    """Every rank's rollout state is in ``folder`` (written last by each rank: the checkpoint is whole)."""
    return all((folder / rollout_state_name(rank)).is_file() for rank in range(ranks))


def latest_checkpoint(output_dir: str | Path, ranks: int) -> Path | None:
    """The newest complete ``checkpoint-<step>`` of ``output_dir``'s stage 2 for a run of ``ranks`` processes;
    ``None`` when there is none (a fresh start). Incomplete folders (a run killed while saving) are passed over."""
    return next((d for d in checkpoint_folders(Path(output_dir) / STAGE2_DIR) if complete(d, ranks)), None)
