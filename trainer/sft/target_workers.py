"""Stage-1 targets built in the data loader's worker processes, ahead of the step that trains them.

A ground-truth target needs no model: the prompt's tokens and pixels (tokenizer, image processor) and the answer's
tokens follow from the record alone. On a GPU that host work is a large share of a warm-up step (dense 320 px
scenes, 32 records, one H200: half of the step; with 4 workers the step was 1.8x shorter), so ``GroundTruthCollator``
runs it in
``stage1.target_workers`` worker processes while the device trains the previous batch, and the trainer takes the
targets as they come (``PreparedSample``). Same records, same targets: the workers change where they are built,
not what is trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from trainer.data.records import Sample
from trainer.matching.targets import TrainTarget
from trainer.sft.stage2 import Stage2Pipeline

#: the most workers ``auto`` starts per rank
AUTO_MAX_WORKERS = 4


@dataclass(frozen=True)
class PreparedSample:
    """A record with its ground-truth target (neither a tensor, a sequence nor a mapping: the accelerator's move to
    the device passes it through as it is)."""

    sample: Sample
    target: TrainTarget


@dataclass(frozen=True)
class GroundTruthCollator:
    """``collate(samples) -> [PreparedSample]``: the pipeline's ground-truth targets, in the records' order."""

    pipeline: Stage2Pipeline

    def __call__(self, batch: Sequence[Sample]) -> list[PreparedSample]:
        samples = list(batch)
        return [PreparedSample(s, t) for s, t in zip(samples, self.pipeline.ground_truth_targets(samples), strict=True)]


def split_prepared(inputs: Sequence[object]) -> tuple[list[Sample], list[TrainTarget] | None]:
    """A step's records and, when the loader built them, their targets (None: build them in the step)."""
    if inputs and all(isinstance(p, PreparedSample) for p in inputs):
        return [p.sample for p in inputs], [p.target for p in inputs]
    if any(isinstance(p, PreparedSample) for p in inputs):
        raise TypeError("a step mixes prepared and plain records")
    return list(inputs), None


def resolve_target_workers(setting: int | Literal["auto"], cuda: bool, local_world_size: int, cores: int) -> int:
    """``stage1.target_workers``: a count as given; ``auto``: none without a CUDA device (on a CPU the workers take
    the cores the training needs), else up to ``AUTO_MAX_WORKERS`` per rank, leaving the rank one of its share of
    ``cores`` (the node's usable cores split over ``local_world_size`` ranks; a rank bound to its own CPUs passes
    them with 1)."""
    if setting != "auto":
        return int(setting)
    if not cuda:
        return 0
    share = cores // max(local_world_size, 1)
    return max(0, min(AUTO_MAX_WORKERS, share - 1))
