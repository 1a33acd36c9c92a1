"""Summary GRPO rewards as pure functions: ``score(name, completion, reference, context) -> float``.

One score per completion. Content rewards are gated: they score 0 unless the reference is relevant and the
completion keeps the two-line contract with JSON that parses. ``swift_plugin`` wraps these as ms-swift ORMs.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.config.grpo import REWARD_NAMES as CONFIG_REWARD_NAMES
from trainer.grpo.schema_tree import SchemaTree, score_schema_tree
from trainer.grpo.summary_format import (
    DOMAINS,
    KEY_DATASET,
    KEY_GROUPS,
    KEY_NOTES,
    KEY_TEXT,
    ParsedAnswer,
    attribute_keys,
    attribute_paths,
    categories,
    facts,
    header_for,
    notes,
    ocr_texts,
    parse_answer,
)

TVERSKY_ALPHA = {"BBU": 0.3, "RRU": 0.6}
TVERSKY_BETA = 1.0
TEXT_SLACK = 2
TEXT_EXTRA_PENALTY = 0.1
NOTE_MATCH_RATIO = 0.8


@dataclass(frozen=True)
class Reference:
    """A dataset row's expectation: ``domain`` is ``None`` for an irrelevant image."""

    domain: str | None
    summary: dict[str, Any] | None

    @property
    def relevant(self) -> bool:
        return self.domain is not None


def reference_from_row(summary_ref: str, metadata: dict[str, Any] | None = None) -> Reference:
    """Build a ``Reference`` from a row's ``summary_ref`` text and ``metadata`` (``domain``: BBU|RRU|null)."""
    meta = metadata or {}
    parsed = parse_answer(summary_ref)
    if parsed.is_irrelevant:
        return Reference(None, None)
    domain = meta.get("domain") or parsed.header_domain
    if domain not in DOMAINS or parsed.summary is None:
        raise ValueError(f"summary_ref is neither the irrelevant line nor a valid {'/'.join(DOMAINS)} summary: "
                         f"{summary_ref[:80]!r}")
    return Reference(domain, parsed.summary)


@dataclass(frozen=True)
class RewardContext:
    schema_tree: SchemaTree | None = None


def _content_ok(p: ParsedAnswer, ref: Reference) -> bool:
    return ref.relevant and p.two_line_shape and p.parses


def _recall(pred: set, ref: set) -> float:
    return len(pred & ref) / len(ref) if ref else 1.0


def tversky(pred: Counter, ref: Counter, alpha: float, beta: float) -> float:
    """Tversky index on multisets: |P∩R| / (|P∩R| + α|P−R| + β|R−P|); 1.0 when both are empty."""
    keys = set(pred) | set(ref)
    inter = sum(min(pred[k], ref[k]) for k in keys)
    fp = sum(max(pred[k] - ref[k], 0) for k in keys)
    fn = sum(max(ref[k] - pred[k], 0) for k in keys)
    denom = inter + alpha * fp + beta * fn
    return 1.0 if denom == 0 else inter / denom


def r_format(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    return 1.0 if p.two_line_shape or p.is_irrelevant else 0.0


def r_header(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    if not ref.relevant:
        return -1.0 if p.has_header_like else 0.0
    return 1.0 if p.lines and p.lines[0] == header_for(ref.domain) else 0.0


def r_strict(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    return -1.0 if ref.relevant and not p.two_line_shape else 0.0


def r_parse(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    return -1.0 if ref.relevant and not p.parses else 0.0


def r_no_dup_keys(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    return -1.0 if p.duplicate_keys else 0.0


def r_dataset(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    return 1.0 if _content_ok(p, ref) and p.summary.get(KEY_DATASET) == ref.domain else 0.0


def r_category_recall(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    return _recall(categories(p.summary), categories(ref.summary)) if _content_ok(p, ref) else 0.0


def _content_exclusions(domain: str) -> frozenset[str]:
    return frozenset({KEY_NOTES, KEY_TEXT}) if domain == "BBU" else frozenset({KEY_NOTES})


def r_content_structured_tversky(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    if not _content_ok(p, ref):
        return 0.0
    excl = _content_exclusions(ref.domain)
    return tversky(facts(p.summary, excl), facts(ref.summary, excl), TVERSKY_ALPHA[ref.domain], TVERSKY_BETA)


def r_text_bbu(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    if ref.domain != "BBU" or not _content_ok(p, ref):
        return 0.0
    pred, want = ocr_texts(p.summary), ocr_texts(ref.summary)
    extra = max(0, len(pred) - (len(want) + TEXT_SLACK))
    return max(-1.0, _recall(pred, want) - TEXT_EXTRA_PENALTY * extra)


def r_notes_bbu(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    if ref.domain != "BBU" or not _content_ok(p, ref):
        return 0.0
    pred, want = notes(p.summary), notes(ref.summary)
    if not want:
        return -1.0 if pred else 0.0
    hit = sum(any(difflib.SequenceMatcher(None, w, q).ratio() >= NOTE_MATCH_RATIO for q in pred) for w in want)
    return hit / len(want)


def r_group_stats_presence(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    if ref.domain != "RRU" or not _content_ok(p, ref) or KEY_GROUPS not in ref.summary:
        return 0.0
    return 1.0 if KEY_GROUPS in p.summary else 0.0


def r_attr_key_recall(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    if not _content_ok(p, ref):
        return 0.0
    excl = frozenset({KEY_NOTES})
    return _recall(attribute_keys(p.summary, excl), attribute_keys(ref.summary, excl))


def r_attr_path_recall(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    if not _content_ok(p, ref):
        return 0.0
    shared = categories(p.summary) & categories(ref.summary)
    if not shared:
        return 0.0
    excl = frozenset({KEY_NOTES})
    pred = {x for x in attribute_paths(p.summary, excl) if x[0] in shared}
    want = {x for x in attribute_paths(ref.summary, excl) if x[0] in shared}
    return _recall(pred, want)


def r_schema_tree(p: ParsedAnswer, ref: Reference, ctx: RewardContext) -> float:
    if ctx.schema_tree is None:
        raise ValueError("summary.schema_tree needs a schema tree derived from the dataset (RewardContext.schema_tree)")
    return score_schema_tree(p.summary, ctx.schema_tree) if _content_ok(p, ref) else 0.0


RewardFn = Callable[[ParsedAnswer, Reference, RewardContext], float]

REWARDS: dict[str, RewardFn] = {
    "summary.format": r_format,
    "summary.header": r_header,
    "summary.strict": r_strict,
    "summary.parse": r_parse,
    "summary.no_dup_keys": r_no_dup_keys,
    "summary.dataset": r_dataset,
    "summary.category_recall": r_category_recall,
    "summary.content_structured_tversky": r_content_structured_tversky,
    "summary.text_bbu": r_text_bbu,
    "summary.notes_bbu": r_notes_bbu,
    "summary.group_stats_presence": r_group_stats_presence,
    "summary.attr_key_recall": r_attr_key_recall,
    "summary.attr_path_recall": r_attr_path_recall,
    "summary.schema_tree": r_schema_tree,
}
REWARD_NAMES: tuple[str, ...] = tuple(REWARDS)
if REWARD_NAMES != CONFIG_REWARD_NAMES:  # the schema validates rlhf.reward_funcs against its own list
    raise ImportError(f"trainer.config.grpo.REWARD_NAMES {CONFIG_REWARD_NAMES} != implemented rewards {REWARD_NAMES}")


def score(name: str, completion: str, reference: Reference, context: RewardContext | None = None) -> float:
    """Score one completion with the reward ``name`` (one of ``REWARD_NAMES``)."""
    if name not in REWARDS:
        raise KeyError(f"unknown summary reward {name!r}; known: {', '.join(REWARD_NAMES)}")
    return float(REWARDS[name](parse_answer(completion), reference, context or RewardContext()))
