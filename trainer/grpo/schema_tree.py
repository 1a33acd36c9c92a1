"""The summary schema tree, derived from a corpus of reference summaries (no hard-coded vocabulary).

For each category: ``required`` keys are those present in every reference entry of that category,
``allowed`` keys those present in any. ``score_schema_tree`` scores a predicted summary against it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.grpo.summary_format import KEY_CATEGORY, parse_answer, stat_entries

#: environment variable naming the training JSONL path(s) (``os.pathsep``-separated) the ms-swift plugin derives
#: the tree from; the learner launcher sets it from ``data.train_jsonl``.
SCHEMA_DATASET_ENV = "SUMMARY_SCHEMA_DATASET"
UNKNOWN_CATEGORY_PENALTY = 0.5
EXTRA_KEY_PENALTY = 0.1


@dataclass(frozen=True)
class SchemaTree:
    required: dict[str, frozenset[str]]
    allowed: dict[str, frozenset[str]]

    def to_json(self) -> dict[str, Any]:
        return {c: {"required": sorted(self.required[c]), "allowed": sorted(self.allowed[c])} for c in sorted(self.allowed)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SchemaTree:
        return cls({c: frozenset(v["required"]) for c, v in data.items()},
                   {c: frozenset(v["allowed"]) for c, v in data.items()})


def derive_schema_tree(summaries: Iterable[dict[str, Any] | None]) -> SchemaTree:
    """Required/allowed attribute keys per category over every ``统计`` entry of ``summaries``."""
    required: dict[str, set[str]] = {}
    allowed: dict[str, set[str]] = {}
    for summary in summaries:
        for entry in stat_entries(summary):
            cat = entry[KEY_CATEGORY]
            keys = {k for k in entry if k != KEY_CATEGORY}
            required[cat] = required[cat] & keys if cat in required else set(keys)
            allowed.setdefault(cat, set()).update(keys)
    return SchemaTree({c: frozenset(v) for c, v in required.items()}, {c: frozenset(v) for c, v in allowed.items()})


def schema_tree_from_jsonl(paths: Iterable[str | Path], ref_key: str = "summary_ref") -> SchemaTree:
    """Derive the tree from dataset JSONL files (the ``summary_ref`` of every row; irrelevant rows add nothing)."""
    summaries = []
    n_rows = 0
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from None
                n_rows += 1
                ref = row.get(ref_key)
                if isinstance(ref, str):
                    summaries.append(parse_answer(ref).summary)
    tree = derive_schema_tree(summaries)
    if not tree.allowed:
        raise ValueError(f"no categories found in the {ref_key!r} of {n_rows} row(s) of {list(map(str, paths))}; "
                         "summary.schema_tree needs a dataset with reference summaries")
    return tree


def score_schema_tree(summary: dict[str, Any] | None, tree: SchemaTree) -> float:
    """Mean required-key coverage over known-category entries, minus ``UNKNOWN_CATEGORY_PENALTY`` × the share
    of unknown-category entries and ``EXTRA_KEY_PENALTY`` per key outside ``allowed``; clipped to [-1, 1].
    A summary without entries scores 0."""
    entries = stat_entries(summary)
    if not entries:
        return 0.0
    coverage: list[float] = []
    unknown = extra = 0
    for entry in entries:
        cat = entry[KEY_CATEGORY]
        keys = {k for k in entry if k != KEY_CATEGORY}
        if cat not in tree.allowed:
            unknown += 1
            continue
        req = tree.required[cat]
        coverage.append(len(keys & req) / len(req) if req else 1.0)
        extra += len(keys - tree.allowed[cat])
    mean_cov = sum(coverage) / len(coverage) if coverage else 0.0
    score = mean_cov - UNKNOWN_CATEGORY_PENALTY * unknown / len(entries) - EXTRA_KEY_PENALTY * extra
    return max(-1.0, min(1.0, score))
