"""ms-swift plugin: registers every summary reward in ``swift.rewards.orms`` under its config name.

Loaded by ``swift rlhf --external_plugins <this file>`` (the learner launcher adds it) or by importing
``register_summary_rewards()``. Rows must carry ``summary_ref`` (and ``metadata.domain``); ms-swift passes
dataset columns to each reward as batched keyword arguments.

``summary.schema_tree`` derives its tree from the training corpus named by ``SUMMARY_SCHEMA_DATASET``
(JSONL paths separated by ``os.pathsep``), which the learner launcher sets from ``data.train_jsonl``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from swift.rewards import ORM, orms

try:
    import trainer  # noqa: F401
except ModuleNotFoundError:  # loaded by file path from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.grpo.rewards import REWARD_NAMES, REWARDS, RewardContext, reference_from_row
from trainer.grpo.schema_tree import SCHEMA_DATASET_ENV, schema_tree_from_jsonl
from trainer.grpo.summary_format import parse_answer


def schema_tree_context() -> RewardContext:
    paths = [p for p in os.environ.get(SCHEMA_DATASET_ENV, "").split(os.pathsep) if p]
    if not paths:
        raise RuntimeError(f"summary.schema_tree: set {SCHEMA_DATASET_ENV} to the training JSONL path(s) so the "
                           "schema tree can be derived from the corpus (the learner launcher does this)")
    return RewardContext(schema_tree=schema_tree_from_jsonl(paths))


class SummaryReward(ORM):
    """One summary reward; ``reward_name`` picks the pure scoring function."""

    reward_name: str = ""

    def __init__(self, args: Any = None, **kwargs: Any):
        super().__init__(args, **kwargs)
        self.context = schema_tree_context() if self.reward_name == "summary.schema_tree" else RewardContext()

    def __call__(self, completions: list[str], summary_ref: list[str] | None = None,
                 metadata: list[dict[str, Any]] | None = None, **kwargs: Any) -> list[float]:
        if summary_ref is None:
            raise KeyError(f"{self.reward_name}: dataset rows need a 'summary_ref' column")
        metas = metadata if metadata is not None else [None] * len(completions)
        fn = REWARDS[self.reward_name]
        return [float(fn(parse_answer(c), reference_from_row(r, m), self.context))
                for c, r, m in zip(completions, summary_ref, metas, strict=True)]


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace(".", "_").split("_")) + "Reward"


REWARD_CLASSES: dict[str, type[SummaryReward]] = {
    name: type(_class_name(name), (SummaryReward,), {"reward_name": name, "__module__": __name__})
    for name in REWARD_NAMES
}


def register_summary_rewards() -> None:
    """Put every summary reward class into ms-swift's ``orms`` registry (idempotent)."""
    orms.update(REWARD_CLASSES)


register_summary_rewards()
