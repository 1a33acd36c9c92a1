"""The summary answer format: a header line plus one strict-JSON line, or the fixed irrelevant line.

``parse_answer(text)`` never raises: it returns what holds and what does not (shape, header, JSON, duplicate
keys). ``facts`` and friends turn a parsed summary into the sets and multisets the rewards compare.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

DOMAINS = ("BBU", "RRU")
IRRELEVANT_LINE = "无关图片"
TASK = "SUMMARY"
KEY_DATASET = "dataset"
KEY_STATS = "统计"
KEY_CATEGORY = "类别"
KEY_TEXT = "文本"
KEY_NOTES = "备注"
KEY_GROUPS = "分组统计"

_HEADER = re.compile(r"<DOMAIN=(?P<domain>[^>]*)>, <TASK=(?P<task>[^>]*)>")
_HEADER_LIKE = re.compile(r"<DOMAIN=[^>]*>|<TASK=[^>]*>")


def header_for(domain: str) -> str:
    """The exact header line for ``domain`` (``BBU`` or ``RRU``)."""
    return f"<DOMAIN={domain}>, <TASK={TASK}>"


def render_answer(domain: str | None, summary: dict[str, Any] | None) -> str:
    """The reference answer text: the irrelevant line when ``domain`` is ``None``, else header + compact JSON."""
    if domain is None:
        return IRRELEVANT_LINE
    return header_for(domain) + "\n" + json.dumps(summary, ensure_ascii=False, separators=(", ", ": "))


class _DuplicateKeys:
    """``object_pairs_hook`` that records every key repeated within one JSON object (any depth)."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                self.found.append(key)
            seen.add(key)
        return dict(pairs)


@dataclass(frozen=True)
class ParsedAnswer:
    """What a completion is, judged against the format alone (no reference)."""

    text: str
    lines: tuple[str, ...]
    is_irrelevant: bool
    has_header_like: bool
    header_domain: str | None
    two_line_shape: bool
    json_text: str | None
    summary: dict[str, Any] | None
    json_error: str | None
    duplicate_keys: tuple[str, ...] = field(default_factory=tuple)

    @property
    def parses(self) -> bool:
        return self.summary is not None


def parse_answer(text: str) -> ParsedAnswer:
    """Parse one completion. Trailing whitespace/newlines are tolerated; nothing else is."""
    body = text.rstrip()
    lines = tuple(body.split("\n")) if body else ()
    is_irrelevant = body == IRRELEVANT_LINE
    has_header_like = any(_HEADER_LIKE.search(line) for line in lines)
    header_domain = None
    if lines:
        m = _HEADER.fullmatch(lines[0])
        if m and m.group("task") == TASK and m.group("domain") in DOMAINS:
            header_domain = m.group("domain")
    json_text = lines[1] if len(lines) >= 2 else None
    two_line_shape = (len(lines) == 2 and header_domain is not None and json_text is not None
                      and json_text.startswith("{") and json_text.endswith("}"))
    summary, error, dups = None, None, ()
    if json_text is not None:
        hook = _DuplicateKeys()
        try:
            loaded = json.loads(json_text, object_pairs_hook=hook)
        except (json.JSONDecodeError, RecursionError) as exc:
            error = str(exc)
        else:
            if isinstance(loaded, dict):
                summary, dups = loaded, tuple(hook.found)
            else:
                error = f"top level is {type(loaded).__name__}, not an object"
    return ParsedAnswer(body, lines, is_irrelevant, has_header_like, header_domain, two_line_shape,
                        json_text, summary, error, dups)


def normalize_text(s: str) -> str:
    """Compare-form of free text: NFKC, case-folded, without whitespace and punctuation."""
    s = unicodedata.normalize("NFKC", str(s)).casefold()
    return "".join(c for c in s if not (c.isspace() or unicodedata.category(c).startswith("P")))


def stat_entries(summary: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``统计`` entries that are mappings with a string ``类别``."""
    if not summary:
        return []
    stats = summary.get(KEY_STATS)
    if not isinstance(stats, list):
        return []
    return [e for e in stats if isinstance(e, dict) and isinstance(e.get(KEY_CATEGORY), str)]


def categories(summary: dict[str, Any] | None) -> set[str]:
    return {e[KEY_CATEGORY] for e in stat_entries(summary)}


def _is_count(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _value_counts(path: tuple[str, ...], value: Any, out: Counter) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if _is_count(v):
                out[(*path, str(k))] += max(float(v), 0.0)
            else:
                _value_counts((*path, str(k)), v, out)
    elif isinstance(value, list):
        for item in value:
            _value_counts(path, item, out)
    elif value is not None:
        out[(*path, str(value))] += 1.0


def facts(summary: dict[str, Any] | None, exclude_keys: frozenset[str] = frozenset()) -> Counter:
    """Multiset of (category, attribute path…, value) → count over ``统计`` (plus ``分组统计`` as its own root).

    Keys in ``exclude_keys`` (e.g. ``备注``, ``文本``) are left out at every level.
    """
    out: Counter = Counter()
    for entry in stat_entries(summary):
        cat = entry[KEY_CATEGORY]
        for key, value in entry.items():
            if key == KEY_CATEGORY or key in exclude_keys:
                continue
            _value_counts((cat, key), value, out)
    if summary and KEY_GROUPS in summary and KEY_GROUPS not in exclude_keys:
        _value_counts((KEY_GROUPS,), summary[KEY_GROUPS], out)
    return out


def attribute_keys(summary: dict[str, Any] | None, exclude_keys: frozenset[str] = frozenset()) -> set[tuple[str, str]]:
    """(category, attribute key) pairs over ``统计``."""
    return {(e[KEY_CATEGORY], k) for e in stat_entries(summary) for k in e
            if k != KEY_CATEGORY and k not in exclude_keys}


def _nested_paths(path: tuple[str, ...], value: Any, out: set[tuple[str, ...]]) -> None:
    out.add(path)
    if isinstance(value, dict) and value and not all(_is_count(v) for v in value.values()):
        for k, v in value.items():
            if not _is_count(v):
                _nested_paths((*path, str(k)), v, out)


def attribute_paths(summary: dict[str, Any] | None, exclude_keys: frozenset[str] = frozenset()) -> set[tuple[str, ...]]:
    """(category, key, sub-key, …) paths down to the value-count maps (values themselves excluded)."""
    out: set[tuple[str, ...]] = set()
    for entry in stat_entries(summary):
        for key, value in entry.items():
            if key != KEY_CATEGORY and key not in exclude_keys:
                _nested_paths((entry[KEY_CATEGORY], key), value, out)
    return out


def ocr_texts(summary: dict[str, Any] | None) -> set[str]:
    """Unique normalized OCR strings under ``统计[*].文本`` (a list of strings or a value → count map)."""
    out: set[str] = set()
    for entry in stat_entries(summary):
        value = entry.get(KEY_TEXT)
        items = value.keys() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        out.update(n for n in (normalize_text(t) for t in items if isinstance(t, str)) if n)
    return out


def notes(summary: dict[str, Any] | None) -> list[str]:
    """Normalized ``备注`` notes (non-empty strings)."""
    value = (summary or {}).get(KEY_NOTES)
    items = value if isinstance(value, list) else [value] if isinstance(value, str) else []
    return [n for n in (normalize_text(t) for t in items if isinstance(t, str)) if n]
