"""Strict, token-aligned parsing of a rollout (one streaming pass over the response tokens).

Each token's exact bytes are scanned by a JSON pushdown automaton; a coord token is consumed atomically as
a number value and its position recorded. Decisions (see ``docs/concepts/decisions.md``):

- Syntax: the response must be a prefix of one JSON object (coord tokens count as numbers). The first
  character that cannot continue valid JSON *breaks* the stream: everything from the enclosing object on is
  the dropped tail. The parser never raises and never repairs (no token is inserted).
- Semantics: a member ``"object_{n}": {...}`` at depth 1 is a predicted object, in appearance order. It is
  valid iff it has exactly one non-empty string ``desc``, exactly one geometry key (``bbox_2d`` with 4 coord
  tokens, or ``poly`` with an even count ≥ 6), no other keys, no nesting, no duplicate key. Invalid but
  syntactically complete objects stay in the prefix (no repair) and are counted by reason.
- Prefix cut: after the last ``}`` that closes a depth-2 object. End-of-turn / stop tokens and everything after
  them are stripped. The junction is the decision: the token that holds that ``}`` (``},`` continue, ``}}`` stop,
  or whatever the tokenizer fuses there) is not kept. The prefix ends before it, and its text up to the cut
  (``junction_text``, e.g. ``}``) starts the target's tail, which is tokenised as one string, so the decision token
  the model emits is the one the target teaches (with CE). No complete object → the prefix is empty and the
  junction is ``{``: the target is the whole answer, tokenised as stage 1 tokenises it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from trainer.data.objects import DetObject, GeometryKind

OBJECT_KEY = re.compile(r"object_([1-9][0-9]{0,6})")
WHITESPACE = b" \t\r\n"
NUMBER_CHARS = b"-+.0123456789eE"
LITERALS = (b"true", b"false", b"null")


@dataclass(frozen=True)
class ParseVocab:
    """What the parser needs from a tokenizer: exact bytes per id, coord ids → bins, stop ids, an encoder."""

    token_bytes: Sequence[bytes]
    coord_bin_by_id: Mapping[int, int]
    stop_ids: frozenset[int]
    special_ids: frozenset[int]
    encode: Callable[[str], list[int]]


@dataclass(frozen=True)
class ParsedObject:
    """A valid predicted object; ``coord_positions[i]`` is the response-token index of ``coords[i]``; ``rank`` its
    place among the complete depth-1 members (valid or not), ``cut`` the (token, byte offset) just after it."""

    index: int
    desc: str
    kind: GeometryKind
    coords: tuple[int, ...]
    coord_positions: tuple[int, ...]
    rank: int = 0
    cut: tuple[int, int] = (0, 0)

    def to_det(self) -> DetObject:
        return DetObject(self.desc, self.kind, self.coords)


@dataclass(frozen=True)
class ParseResult:
    """``prefix_token_ids`` are response tokens kept verbatim (a prefix of the response); ``junction_text`` is the
    text that follows them in the target (the cut token's text up to the cut, or ``{`` without a cut);
    ``prefix_last_char`` is the last character of prefix + junction (``}`` or ``{``). ``junction_fused``: the cut
    fell inside a token (the rollout's decision token also held the next character, ``,`` or ``}``)."""

    objects: tuple[ParsedObject, ...]
    invalid: Mapping[str, int]
    prefix_token_ids: tuple[int, ...]
    prefix_last_char: str
    max_object_index: int
    truncated: bool
    stopped: bool
    broken: bool
    num_response_tokens: int
    dropped_tail_tokens: int
    junction_text: str = "{"
    junction_fused: bool = False
    #: appearance ranks of the complete members that were invalid (the ranks ``ParsedObject.rank`` counts)
    invalid_ranks: tuple[int, ...] = ()
    #: the response up to its first stop token (what an earlier cut is taken from)
    response_ids: tuple[int, ...] = ()

    @property
    def num_invalid(self) -> int:
        return sum(self.invalid.values())

    @property
    def num_predicted(self) -> int:
        return len(self.objects) + self.num_invalid


@dataclass
class _Member:
    """A depth-1 member under construction."""

    key: str
    index: int | None
    problems: list[str] = field(default_factory=list)
    is_object: bool = False
    desc: list[str] = field(default_factory=list)
    geometry: list[str] = field(default_factory=list)
    coords: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    current_key: str | None = None


class _Break(Exception):
    """The stream stops being a valid JSON prefix here."""


class _Scanner:
    """JSON pushdown automaton with semantic hooks for depth-1 members and depth-2 object fields."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.expect = "top"
        self.in_string = False
        self.escape = False
        self.string_buf = bytearray()
        self.string_is_key = False
        self.scalar = bytearray()
        self.closed = False
        self.member: _Member | None = None
        self.pending_key: str | None = None
        self.finished: list[tuple[_Member, bool]] = []

    def _value_started(self, kind: str) -> None:
        """Semantic bookkeeping when a value of ``kind`` ('obj', 'arr', 'str', 'scalar', 'coord') starts."""
        depth = len(self.stack)
        if depth == 1:
            assert self.member is not None
            if kind == "obj":
                self.member.is_object = True
            else:
                self.member.problems.append("value_not_object")
        elif depth == 2 and self.member is not None and self.member.is_object:
            key = self.member.current_key
            if key == "desc":
                if kind != "str":
                    self.member.problems.append("desc_not_string")
            elif key in ("bbox_2d", "poly"):
                if kind != "arr":
                    self.member.problems.append("geometry_not_array")
            else:
                self.member.problems.append("extra_key")
        elif depth >= 3 and self.member is not None:
            in_geometry = depth == 3 and self.stack[2] == "arr" and self.member.current_key in ("bbox_2d", "poly")
            if not in_geometry or kind != "coord":
                self.member.problems.append("non_coord_in_geometry" if in_geometry else "nested_value")

    def _end_scalar(self) -> None:
        text = bytes(self.scalar)
        self.scalar.clear()
        if text in LITERALS:
            return
        try:
            float(text)
        except ValueError:
            raise _Break from None
        if not re.fullmatch(rb"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?", text):
            raise _Break

    def _after_value(self, closed_object: bool = False) -> None:
        if len(self.stack) == 1 and self.member is not None:
            self.finished.append((self.member, closed_object))
            self.member = None
        if not self.stack:
            self.closed = True
            self.expect = "done"
        else:
            self.expect = "obj_comma" if self.stack[-1] == "obj" else "arr_comma"

    def _open(self, kind: str) -> None:
        self._value_started(kind)
        self.stack.append(kind)
        self.expect = "key_or_end" if kind == "obj" else "value_or_end"

    def _close(self, kind: str) -> None:
        if not self.stack or self.stack[-1] != kind:
            raise _Break
        self.stack.pop()
        self._after_value(closed_object=kind == "obj" and len(self.stack) == 1)

    def feed_coord(self, bin_: int, position: int) -> None:
        if self.in_string or self.scalar or self.expect not in ("value", "value_or_end"):
            raise _Break
        self._value_started("coord")
        if self.member is not None and len(self.stack) == 3:
            self.member.coords.append(bin_)
            self.member.positions.append(position)
        self._after_value()

    def feed_byte(self, b: int) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
                self.string_buf.append(b)
            elif b == 0x5C:
                self.escape = True
                self.string_buf.append(b)
            elif b == 0x22:
                self.in_string = False
                self._end_string()
            elif b < 0x20:
                raise _Break
            else:
                self.string_buf.append(b)
            return
        if self.scalar:
            if b in NUMBER_CHARS or (0x61 <= b <= 0x7A):
                self.scalar.append(b)
                return
            self._end_scalar()
            self._after_value()
        if b in WHITESPACE:
            return
        e = self.expect
        if e == "top":
            if b != 0x7B:
                raise _Break
            self.stack.append("obj")
            self.expect = "key_or_end"
        elif e == "done":
            raise _Break
        elif e in ("key_or_end", "key"):
            if b == 0x22:
                self.in_string, self.string_is_key = True, True
                self.string_buf.clear()
            elif b == 0x7D and e == "key_or_end":
                self._close("obj")
            else:
                raise _Break
        elif e == "colon":
            if b != 0x3A:
                raise _Break
            self.expect = "value"
        elif e in ("value", "value_or_end"):
            if b == 0x7B:
                self._open("obj")
            elif b == 0x5B:
                self._open("arr")
            elif b == 0x22:
                self._value_started("str")
                self.in_string, self.string_is_key = True, False
                self.string_buf.clear()
            elif b == 0x5D and e == "value_or_end":
                self._close("arr")
            elif b in NUMBER_CHARS[:-2] or b in b"tfn":
                self._value_started("scalar")
                self.scalar.append(b)
            else:
                raise _Break
        elif e == "obj_comma":
            if b == 0x2C:
                self.expect = "key"
            elif b == 0x7D:
                self._close("obj")
            else:
                raise _Break
        elif e == "arr_comma":
            if b == 0x2C:
                self.expect = "value"
            elif b == 0x5D:
                self._close("arr")
            else:
                raise _Break

    def _end_string(self) -> None:
        try:
            text = json.loads(b'"' + bytes(self.string_buf) + b'"')
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _Break from None
        depth = len(self.stack)
        if self.string_is_key:
            self.expect = "colon"
            if depth == 1:
                m = OBJECT_KEY.fullmatch(text)
                self.member = _Member(key=text, index=int(m.group(1)) if m else None)
                if m is None:
                    self.member.problems.append("bad_key")
            elif depth == 2 and self.member is not None:
                self.member.current_key = text
                if text == "desc":
                    self.member.desc.append("")
                elif text in ("bbox_2d", "poly"):
                    self.member.geometry.append(text)
            return
        if depth == 2 and self.member is not None and self.member.current_key == "desc":
            self.member.desc[-1] = text
        self._after_value()


def _validate_member(m: _Member, seen: set[int]) -> tuple[ParsedObject | None, str | None]:
    if m.problems:
        return None, m.problems[0]
    if not m.is_object:
        return None, "value_not_object"
    if m.index in seen:
        return None, "duplicate_key"
    if len(m.desc) != 1 or not m.desc[0].strip():
        return None, "missing_desc" if not m.desc or not m.desc[0].strip() else "duplicate_desc"
    if len(m.geometry) != 1:
        return None, "no_geometry" if not m.geometry else "two_geometries"
    kind = m.geometry[0]
    n = len(m.coords)
    if kind == "bbox_2d" and n != 4:
        return None, "bbox_count"
    if kind == "poly" and (n < 6 or n % 2):
        return None, "poly_count"
    assert m.index is not None
    return ParsedObject(m.index, m.desc[0], kind, tuple(m.coords), tuple(m.positions)), None  # type: ignore[arg-type]


def _junction_start(ids: Sequence[int], pos: int, raw: bytes, vocab: ParseVocab) -> tuple[int, bytes]:
    """Where the junction starts and its bytes: the cut token, widened backwards over plain tokens while its bytes
    are not whole UTF-8 characters (a byte-level token may start inside one)."""
    start = pos
    while start > 0:
        try:
            raw.decode("utf-8")
            break
        except UnicodeDecodeError:
            prev = ids[start - 1]
            if prev in vocab.coord_bin_by_id or prev in vocab.special_ids:
                break
            start -= 1
            raw = vocab.token_bytes[prev] + raw
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raw = raw.decode("utf-8", errors="replace").encode("utf-8")
    return start, raw


def parse_rollout(response_ids: Sequence[int], vocab: ParseVocab) -> ParseResult:
    """Parse one rollout. Pure; never raises on any token sequence."""
    ids = list(response_ids)
    end = len(ids)
    stopped = False
    for i, t in enumerate(ids):
        if t in vocab.stop_ids:
            end, stopped = i, True
            break
    sc = _Scanner()
    cut: tuple[int, int] | None = None
    complete: list[tuple[_Member, tuple[int, int]]] = []
    after_cut: list[_Member] = []
    broken = False
    for pos in range(end):
        tid = ids[pos]
        try:
            if tid in vocab.coord_bin_by_id:
                sc.feed_coord(vocab.coord_bin_by_id[tid], pos)
                after_cut.extend(m for m, _ in sc.finished)
                sc.finished.clear()
                continue
            if tid in vocab.special_ids or tid < 0 or tid >= len(vocab.token_bytes):
                raise _Break
            data = vocab.token_bytes[tid]
            for off, b in enumerate(data):
                sc.feed_byte(b)
                for member, is_cut in sc.finished:
                    if is_cut:
                        cut = (pos, off + 1)
                        complete.extend((m, cut) for m in after_cut)
                        after_cut.clear()
                        complete.append((member, cut))
                    else:
                        after_cut.append(member)
                sc.finished.clear()
        except _Break:
            broken = True
            break
    objects: list[ParsedObject] = []
    invalid: Counter[str] = Counter()
    seen: set[int] = set()
    max_index = 0
    invalid_ranks: list[int] = []
    for rank, (member, member_cut) in enumerate(complete):
        obj, reason = _validate_member(member, seen)
        if member.index is not None:
            seen.add(member.index)
            max_index = max(max_index, member.index)
        if obj is not None:
            objects.append(replace(obj, rank=rank, cut=member_cut))
        else:
            invalid[reason or "invalid"] += 1
            invalid_ranks.append(rank)
    for member in after_cut:
        invalid[member.problems[0] if member.problems else "value_not_object"] += 1
    if sc.member is not None:
        invalid["malformed_object" if broken else "truncated_object"] += 1
    if cut is None:
        prefix: tuple[int, ...] = ()
        junction, fused, last, kept = "{", False, "{", 0
    else:
        pos, off = cut
        data = vocab.token_bytes[ids[pos]]
        start, raw = _junction_start(ids, pos, data[:off], vocab)
        prefix = tuple(ids[:start])
        junction, fused, last, kept = raw.decode("utf-8"), off < len(data), "}", pos + 1
    truncated = not sc.closed
    return ParseResult(
        objects=tuple(objects),
        invalid=dict(invalid),
        prefix_token_ids=prefix,
        prefix_last_char=last,
        max_object_index=max_index,
        truncated=truncated,
        stopped=stopped,
        broken=broken,
        num_response_tokens=len(ids),
        dropped_tail_tokens=len(ids) - kept,
        junction_text=junction,
        junction_fused=fused,
        invalid_ranks=tuple(invalid_ranks),
        response_ids=tuple(ids[:end]),
    )


def cut_before_rank(parse: ParseResult, rank: int, vocab: ParseVocab) -> ParseResult:
    """``parse`` as if the response had ended (open for appending) after its complete members ranked below ``rank``,
    all of them valid: the kept objects, their junction and numbering; the invalid counts stay those of the whole
    response. ``parse`` itself when nothing is dropped."""
    kept = tuple(o for o in parse.objects if o.rank < rank)
    if len(kept) == len(parse.objects) and all(r < rank for r in parse.invalid_ranks):
        return parse
    if any(r < rank for r in parse.invalid_ranks):
        raise ValueError(f"cut_before_rank({rank}): an invalid member ranks below the cut")
    ids = parse.response_ids
    if not kept:
        return replace(parse, objects=(), prefix_token_ids=(), prefix_last_char="{", max_object_index=0,
                       junction_text="{", junction_fused=False, dropped_tail_tokens=parse.num_response_tokens)
    pos, off = kept[-1].cut
    data = vocab.token_bytes[ids[pos]]
    start, raw = _junction_start(ids, pos, data[:off], vocab)
    return replace(parse, objects=kept, prefix_token_ids=tuple(ids[:start]), prefix_last_char="}",
                   max_object_index=max(o.index for o in kept), junction_text=raw.decode("utf-8"),
                   junction_fused=off < len(data), dropped_tail_tokens=parse.num_response_tokens - (pos + 1))
