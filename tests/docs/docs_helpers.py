"""The Markdown the docs tests read: README.md and docs/**/*.md, and their fenced code blocks.

A fenced block may be marked by an HTML comment on the line before its opening fence:
``<!-- fragment -->`` (a YAML piece of a config, not a whole one: it must still parse), ``<!-- chart-values -->``
(Helm values for ``charts/rollout-matching``: rendered with the chart), ``<!-- no-check -->`` (not checked)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!--\s*([a-z-]+)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every Markdown page under docs/ (the generated reference pages included: they are committed)."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` (``` or ~~~ fences, any indentation), with the marker on the line before it."""
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3)
        previous = lines[i - 1].strip() if i else ""
        mark = MARKER.match(previous)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        out.append(Block(path, i + 1, lang, "\n".join(body) + "\n", mark.group(1) if mark else None))
        i = j + 1
    return out


def all_blocks(lang: str) -> list[Block]:
    return [b for p in doc_files() for b in blocks(p) if b.lang == lang]


def mirror_repo(tmp_path: Path, exclude: frozenset[str] = frozenset({".git"})) -> Path:
    """A copy of the repository's layout under ``tmp_path / "repo"``: every top-level entry but ``exclude`` a symlink,
    ``configs/`` a real folder of symlinks, so a config saved there resolves ``extends`` exactly as in the repository
    and writes nothing into it."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in exclude | {"configs"}:
            (root / entry.name).symlink_to(entry)
    (root / "configs").mkdir()
    for entry in (REPO / "configs").iterdir():
        (root / "configs" / entry.name).symlink_to(entry)
    return root
