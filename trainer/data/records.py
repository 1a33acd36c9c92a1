"""JSONL detection records → validated ``Sample``s; every problem names ``file:line`` and the field.

Record (one JSON object per line; coordinates in pixels of the displayed image):
``{"id": "s1", "images": ["img/1.png"], "width": 640, "height": 480,
   "objects": [{"desc": "red square", "bbox_2d": [x1, y1, x2, y2]}, {"desc": "...", "poly": [x1, y1, ...]}],
   "scene": "optional text rendering of the image, used by text-only models"}``
``image`` (a single string) is accepted as a synonym of ``images``. An empty ``objects`` list is a valid
negative sample; a missing one is an error. Boxes must lie inside the image (x2 > x1, y2 > y1).

``width`` / ``height`` are those of every image of the record *as displayed*: the stored pixels with their EXIF
orientation applied (``trainer.data.images``); loading checks them against each image's header (no pixels
decoded) and refuses a record whose image has another size, since its coordinates would be normalised to the
wrong size.

One validator, ``check_record``, collects every ``Problem`` of a record; ``data check`` reports them all, the
loaders drop the lines with an error, or raise one ``DatasetError`` of one line (``bad_records_message``: the
count, the first line's error and what to do). One rule, ``select_records``, decides what training
keeps: a line with an error is dropped, and so is a valid record whose id an earlier *valid* record has; warnings
and notes are counted over the kept records only. ``index_jsonl`` (training) and ``data check`` apply it;
``load_jsonl`` builds a list of ``Sample``s by the same rule; ``index_jsonl`` keeps only line offsets and parses a
record when it is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from trainer.data.images import COLOUR_MODES, ORIENTATION_NAMES, ImageHeader, ImageRefError, read_header
from trainer.data.objects import DetObject, to_bin

log = logging.getLogger(__name__)

KNOWN_KEYS = {"id", "images", "image", "width", "height", "objects", "scene"}
OBJECT_KEYS = {"desc", "bbox_2d", "poly"}
#: the Qwen2/2.5/3-VL image processor (``smart_resize``) refuses images whose long side exceeds this × the short one
MAX_ASPECT_RATIO = 200
FIX_HINT = "python -m trainer data check FILE --fix-geometry OUT"

Severity = Literal["error", "warning", "info"]
HeaderReader = Callable[[Path], ImageHeader]


class DatasetError(ValueError):
    """A bad dataset record; the message starts with ``file:line``."""


@dataclass(frozen=True)
class Problem:
    """One finding about a record. ``str()`` is ``file:line: message``; the message says what to do."""

    where: str
    kind: str
    message: str
    severity: Severity = "error"

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass(frozen=True)
class Sample:
    sample_id: str
    images: tuple[str, ...]
    width: int
    height: int
    objects: tuple[DetObject, ...]
    scene: str | None = None


@dataclass(frozen=True)
class RecordCheck:
    """What ``check_record`` found: the sample (``None`` when there is an error or it was not asked for), every
    problem in record order, the id (``None`` when invalid), the object count and each image's header
    (``None`` when not read or unreadable)."""

    sample: Sample | None
    problems: tuple[Problem, ...]
    sample_id: str | None = None
    num_objects: int = 0
    headers: tuple[ImageHeader | None, ...] = ()

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    @property
    def first_error(self) -> Problem | None:
        return next((p for p in self.problems if p.severity == "error"), None)


_PLAIN_NUMBERS = frozenset({int, float})


def _numbers(value: Any) -> bool:
    """A list of numbers (``bool`` is not one)."""
    if type(value) is not list:
        return isinstance(value, list) and _numbers(list(value))
    if _PLAIN_NUMBERS.issuperset(map(type, value)):
        return True
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def _geometry(where: str, at: str, kind: str, value: Any, width: int | None, height: int | None,
              out: list[Problem]) -> bool:
    """Whether a ``bbox_2d`` / ``poly`` has the right shape (bounds problems are still collected)."""
    if not _numbers(value):
        out.append(Problem(where, "object_schema", f"{at}: {kind} must be a list of numbers, got {value!r}"))
        return False
    n = len(value)
    if kind == "bbox_2d":
        if n != 4:
            out.append(Problem(where, "object_schema", f"{at}.bbox_2d needs 4 numbers [x1, y1, x2, y2], got {n}"))
            return False
        x1, y1, x2, y2 = value
        if not (x2 > x1 and y2 > y1):
            out.append(Problem(where, "degenerate_box",
                               f"{at}.bbox_2d {[float(v) for v in value]} is degenerate: need x2 > x1 and y2 > y1"))
        xs, ys = (x1, x2), (y1, y2)
    elif n < 6 or n % 2:
        out.append(Problem(where, "poly_count", f"{at}.poly needs an even count >= 6 of numbers, got {n}"))
        return False
    else:
        xs, ys = value[0::2], value[1::2]
    if width is not None and height is not None and (
            min(xs) < 0 or min(ys) < 0 or max(xs) > width or max(ys) > height):
        out.append(Problem(where, "out_of_bounds", f"{at}.{kind} {[float(v) for v in value]} lies outside the "
                                                   f"{width}x{height} image; fix or drop the object"))
    return True


def _check_object(where: str, i: int, raw: Any, width: int | None, height: int | None,
                  out: list[Problem], build: bool) -> DetObject | None:
    if not isinstance(raw, dict):
        out.append(Problem(where, "object_schema",
                           f"objects[{i}] must be an object with desc and bbox_2d or poly, got {type(raw).__name__}"))
        return None
    before = len(out)
    if not OBJECT_KEYS.issuperset(raw):
        out.append(Problem(where, "object_schema",
                           f"objects[{i}]: unknown keys {sorted(raw.keys() - OBJECT_KEYS)}; allowed: desc, bbox_2d, poly"))
    desc = raw.get("desc")
    if not isinstance(desc, str) or not desc.strip():
        out.append(Problem(where, "empty_desc", f"objects[{i}].desc must be a non-empty string, got {desc!r}"))
    has_box, has_poly = "bbox_2d" in raw, "poly" in raw
    if has_box == has_poly:
        out.append(Problem(where, "object_schema", f"objects[{i}]: needs exactly one of bbox_2d or poly"))
        return None
    kind = "bbox_2d" if has_box else "poly"
    shaped = _geometry(where, f"objects[{i}]", kind, raw[kind], width, height, out)
    if not build or not shaped or len(out) > before or width is None or height is None:
        return None
    coords = tuple(to_bin(float(v), width if j % 2 == 0 else height) for j, v in enumerate(raw[kind]))
    return DetObject(desc=desc.strip(), kind=kind, coords=coords)


def size_problems(where: str, i: int, path: str, header: ImageHeader, width: int, height: int) -> list[Problem]:
    """The record's declared ``width`` x ``height`` against image ``i``'s header: mismatch (naming the cause when
    it is the stored size of an EXIF-rotated image or a uniform scale), the processor's aspect-ratio limit,
    colour mode (info, or an error when it cannot be converted) and EXIF orientation (a warning)."""
    at = f"images[{i}] {path}"
    w, h = header.size
    out: list[Problem] = []
    exif = f"EXIF orientation {header.orientation} ({ORIENTATION_NAMES[header.orientation]})"
    if (w, h) != (width, height):
        if header.transposed and (width, height) == (header.stored_width, header.stored_height):
            msg = (f"{at}: width/height {width}x{height} are the stored size of an image with {exif}, displayed (and "
                   f"trained on) as {w}x{h}; coordinates refer to the displayed image: set width {w}, height {h} "
                   f"(`{FIX_HINT}` does) if they were drawn on it")
        elif same_aspect(width, height, w, h):
            msg = (f"{at}: the record declares {width}x{height} but the image is {w}x{h} (scaled x{w / width:.4g}); "
                   f"coordinates would be normalised to the wrong size: fix width/height and the coordinates "
                   f"(`{FIX_HINT}` rescales them)")
        else:
            shown = f" after its {exif}" if header.orientation != 1 else ""
            msg = (f"{at}: the record declares {width}x{height} but the image is {w}x{h}{shown}; coordinates would "
                   f"be normalised to the wrong size: fix width/height (and the coordinates if they were drawn on "
                   f"another image)")
        out.append(Problem(where, "size_mismatch", msg))
    elif header.orientation != 1:
        out.append(Problem(where, "exif_orientation",
                           f"{at}: {exif}: trained on the displayed {w}x{h} image, which the record's size matches; "
                           "its coordinates must refer to the displayed image too", "warning"))
    if max(w, h) > MAX_ASPECT_RATIO * min(w, h):
        out.append(Problem(where, "aspect_ratio",
                           f"{at}: {w}x{h} has an aspect ratio of {max(w, h) / min(w, h):.0f}:1; the Qwen-VL image "
                           f"processor refuses more than {MAX_ASPECT_RATIO}:1: crop or pad the image (and shift the "
                           "coordinates), or drop the record"))
    if header.mode not in COLOUR_MODES:
        out.append(Problem(where, "colour_mode_unsupported",
                           f"{at}: colour mode {header.mode} cannot be converted to RGB; save the image as 8-bit RGB"))
    elif header.mode != "RGB":
        out.append(Problem(where, f"colour_mode:{header.mode}",
                           f"{at}: colour mode {header.mode}: {COLOUR_MODES[header.mode]}", "info"))
    return out


def same_aspect(w1: int, h1: int, w2: int, h2: int) -> bool:
    """Whether ``w2 x h2`` is ``w1 x h1`` scaled uniformly (each side within 1 px of rounding)."""
    return abs(w2 - w1 * h2 / h1) <= 1 and abs(h2 - h1 * w2 / w1) <= 1


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def check_record(raw: Any, where: str, base_dir: Path | None, headers: HeaderReader | None = read_header,
                 build: bool = True) -> RecordCheck:
    """Every problem of one record, in record order. ``headers``: reads each image's header (``None``: image paths
    are not touched). ``build``: also build the ``Sample`` (when there is no error)."""
    if not isinstance(raw, dict):
        return RecordCheck(None, (Problem(where, "record_schema",
                                          f"each line must be a JSON object, got {type(raw).__name__}"),))
    out: list[Problem] = []
    extra = raw.keys() - KNOWN_KEYS
    if extra:
        out.append(Problem(where, "record_schema", f"unknown keys {sorted(extra)}; allowed: {sorted(KNOWN_KEYS)}"))
    sample_id = raw.get("id", where)
    if not isinstance(sample_id, (str, int)) or isinstance(sample_id, bool):
        out.append(Problem(where, "record_schema", "id must be a string or integer"))
        sample_id = None
    images = raw.get("images", raw.get("image", []))
    if isinstance(images, str):
        images = [images]
    resolved: list[str] = []
    read: list[ImageHeader | None] = []
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        out.append(Problem(where, "record_schema",
                           f"images must be a list of non-empty path strings, got {images!r}"))
    else:
        for p in images:
            path = Path(p) if base_dir is None or os.path.isabs(p) else base_dir / p
            resolved.append(str(path))
            if headers is None:
                continue
            try:
                read.append(headers(path))
            except ImageRefError as exc:
                missing = not path.is_file()
                out.append(Problem(where, "image_missing" if missing else "image_unreadable",
                                   f"image not found: {path}" if missing else f"{exc}; replace or drop the image"))
                read.append(None)
    width, height = raw.get("width"), raw.get("height")
    for key, v in (("width", width), ("height", height)):
        if not _positive_int(v):
            out.append(Problem(where, "record_schema", f"{key} must be a positive integer, got {v!r}"))
    if not (_positive_int(width) and _positive_int(height)):
        width = height = None
    else:
        for i, header in enumerate(read):
            if header is not None:
                out.extend(size_problems(where, i, resolved[i], header, width, height))
    objects: list[DetObject | None] = []
    objs = raw.get("objects")
    if "objects" not in raw:
        out.append(Problem(where, "record_schema", "missing 'objects' (use [] for an image without objects)"))
    elif not isinstance(objs, list):
        out.append(Problem(where, "record_schema", f"objects must be a list, got {type(objs).__name__}"))
    else:
        objects = [_check_object(where, i, o, width, height, out, build) for i, o in enumerate(objs)]
    scene = raw.get("scene")
    if scene is not None and not isinstance(scene, str):
        out.append(Problem(where, "record_schema", "scene must be a string"))
    problems = tuple(out)
    sid = None if sample_id is None else str(sample_id)
    sample = None
    if build and not any(p.severity == "error" for p in problems):
        sample = Sample(sid, tuple(resolved), width, height, tuple(objects), scene)
    return RecordCheck(sample, problems, sid, len(objects), tuple(read))


def parse_record(raw: Any, where: str, base_dir: Path | None, check_images: bool = True) -> Sample:
    """The record as a ``Sample``; ``DatasetError`` with its first problem (``check_images``: read each image's
    header and check it against the record)."""
    result = check_record(raw, where, base_dir, read_header if check_images else None)
    if result.sample is None:
        raise DatasetError(str(result.first_error))
    return result.sample


@dataclass
class LoadReport:
    """What loading did: kept samples, dropped lines (``file:line: reason``) and the id of each (``dropped_ids``,
    in the same order; ``None`` when the line has none to read), negatives (no objects), and the counts of
    warnings / notes by kind (EXIF orientation, colour modes converted to RGB) over the kept records."""

    kept: int = 0
    negatives: int = 0
    dropped: list[str] = field(default_factory=list)
    dropped_ids: list[str | None] = field(default_factory=list)
    notes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ScannedLine:
    """One non-blank line of a JSONL file: its 1-based number, byte offset and length, and what was found."""

    lineno: int
    offset: int
    length: int
    check: RecordCheck


def parse_line(line: bytes | str, where: str, base_dir: Path | None, headers: HeaderReader | None,
               build: bool = True) -> RecordCheck:
    """``check_record`` of one JSONL line (not valid JSON / UTF-8 is a problem too)."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        return RecordCheck(None, (Problem(where, "invalid_json",
                                          f"not valid JSON ({exc.msg} at column {exc.colno})"),))
    except UnicodeDecodeError as exc:
        return RecordCheck(None, (Problem(where, "invalid_json",
                                          f"not valid UTF-8 (byte {exc.start}); save the file as UTF-8"),))
    return check_record(raw, where, base_dir, headers, build)


def scan_jsonl(path: Path, base_dir: Path | None, headers: HeaderReader | None,
               build: bool = True) -> Iterator[ScannedLine]:
    """Every non-blank line of ``path``, checked, in one streaming pass (blank lines are skipped)."""
    offset = 0
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            n = len(line)
            if line.strip():
                yield ScannedLine(lineno, offset, n, parse_line(line, f"{path}:{lineno}", base_dir, headers, build))
            offset += n


def _open_dataset(path: str | Path, image_root: str | Path | None, on_bad_record: str) -> tuple[Path, Path]:
    if on_bad_record not in ("error", "drop"):
        raise ValueError(f"on_bad_record must be 'error' or 'drop', got {on_bad_record!r}")
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    return path, Path(image_root) if image_root else path.parent


def _note(report: LoadReport, check: RecordCheck) -> None:
    for p in check.problems:
        report.notes[p.kind] = report.notes.get(p.kind, 0) + 1


def _drop(report: LoadReport, message: str, on_bad_record: str, sample_id: str | None) -> None:
    report.dropped.append(message)
    report.dropped_ids.append(sample_id)
    if on_bad_record == "drop":
        log.warning("dropping bad record %s", message)


def bad_records_message(path: Path, dropped: Sequence[str]) -> str:
    """One line for the bad records of ``path`` (``file:line: reason`` each, at least one): the reason of the only
    one, or the count and the first one's, then what to do."""
    n = len(dropped)
    hint = (f"fix {'it' if n == 1 else 'them'} (`python -m trainer data check {path}` lists every problem) or set "
            "data.on_bad_record: drop to train on the rest (each drop is logged and counted)")
    if n == 1:
        return f"{dropped[0]}; {hint}"
    return f"{n} bad records, the first: {dropped[0]}; {hint}"


def _finish(path: Path, report: LoadReport, on_bad_record: str) -> None:
    """``DatasetError`` in one line: bad records under ``on_bad_record="error"``, or no record kept."""
    if report.dropped and on_bad_record == "error":
        raise DatasetError(bad_records_message(path, report.dropped))
    if not report.kept and report.dropped:
        raise DatasetError(f"{path}: no valid records, all {len(report.dropped)} were dropped as bad "
                           f"(data.on_bad_record: drop); `python -m trainer data check {path}` lists their problems")
    if not report.kept:
        raise DatasetError(f"{path}: no records (the file has no non-blank line): write one JSON record per line "
                           "(`python -m trainer data import` writes them from COCO, LVIS or ODVG)")


def duplicate_message(sample_id: str, first_line: int) -> str:
    return f"duplicate id {sample_id!r} (first at line {first_line})"


def load_jsonl(path: str | Path, image_root: str | Path | None = None, check_images: bool = True,
               on_bad_record: str = "error", report: LoadReport | None = None) -> list[Sample]:
    """Load and validate every line into a list. Blank lines are ignored; duplicate ids are bad records (ids key
    the ledger). ``check_images``: each image's header is read and checked against the record.

    ``on_bad_record="error"`` (default): every bad line is collected (``report.dropped``: ``file:line: reason``)
    and one ``DatasetError`` of one line names their count, the first one and what to do (``bad_records_message``).
    ``"drop"``: bad lines are dropped, each logged and recorded in ``report.dropped``.
    """
    path, base = _open_dataset(path, image_root, on_bad_record)
    report = report if report is not None else LoadReport()
    samples: list[Sample] = []
    seen: dict[str, int] = {}
    for scanned in scan_jsonl(path, base, read_header if check_images else None):
        check, where = scanned.check, f"{path}:{scanned.lineno}"
        sample = check.sample
        if sample is None:
            _drop(report, str(check.first_error), on_bad_record, check.sample_id)
            continue
        if sample.sample_id in seen:
            _drop(report, f"{where}: {duplicate_message(sample.sample_id, seen[sample.sample_id])}", on_bad_record,
                  sample.sample_id)
            continue
        _note(report, check)
        seen[sample.sample_id] = scanned.lineno
        samples.append(sample)
        report.negatives += not sample.objects
    report.kept = len(samples)
    _finish(path, report, on_bad_record)
    return samples


def id_hash(sample_id: str) -> int:
    """A stable 64-bit hash of a record id (the same in every process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little", signed=True)


def duplicates(hashes: Sequence[int], id_at: Callable[[int], str]) -> list[tuple[int, int]]:
    """``(later, first)`` position pairs of equal ids, ``later`` ascending; ``hashes[i]`` is ``id_hash`` of the
    id at position ``i`` and ``id_at(i)`` reads that id back (only for positions whose hashes collide)."""
    import numpy as np

    h = np.frombuffer(hashes, dtype=np.int64) if isinstance(hashes, array) else np.asarray(hashes, dtype=np.int64)
    if len(h) < 2:
        return []
    order = np.argsort(h, kind="stable")
    sorted_h = h[order]
    same = np.flatnonzero(sorted_h[1:] == sorted_h[:-1])
    if not len(same):
        return []
    out: list[tuple[int, int]] = []
    groups: dict[int, list[int]] = {}
    for k in same:
        groups.setdefault(int(sorted_h[k]), []).extend((int(order[k]), int(order[k + 1])))
    for positions in groups.values():
        first: dict[str, int] = {}
        for pos in sorted(set(positions)):
            sid = id_at(pos)
            if sid in first:
                out.append((pos, first[sid]))
            else:
                first[sid] = pos
    return sorted(out)


class JsonlDataset(Sequence):
    """The valid records of a JSONL file as a sequence of ``Sample``s, each parsed from the file when read.

    Holds per record only its byte offset and length, line number and id hash (24 bytes); reads use ``os.pread``
    on a descriptor opened per process (safe in forked / spawned data-loader workers). A record whose id no
    longer matches the index (the file changed since) raises ``DatasetError``.
    """

    def __init__(self, path: Path, base_dir: Path | None, offsets: array, lengths: array, lines: array,
                 hashes: array):
        self.path, self.base_dir = path, base_dir
        self.offsets, self.lengths, self.lines, self.hashes = offsets, lengths, lines, hashes
        self._fd: int | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def _read(self, i: int) -> bytes:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return os.pread(self._fd, self.lengths[i], self.offsets[i])

    def record(self, i: int) -> Any:
        """The raw JSON object of record ``i``."""
        return json.loads(self._read(i))

    def where(self, i: int) -> str:
        return f"{self.path}:{self.lines[i]}"

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        if not isinstance(i, int):
            i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} of {len(self)}")
        where = self.where(i)
        result = parse_line(self._read(i), where, self.base_dir, None)
        if result.sample is None or id_hash(result.sample.sample_id) != self.hashes[i]:
            raise DatasetError(f"{where}: the file changed since it was indexed ({result.first_error or 'another id'});"
                               " restart the run (records are read from the file during training)")
        return result.sample

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None, "_pid": None}

    def __del__(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)


class DroppedLine(NamedTuple):
    """A line training drops: its number, id (``None`` when it has none to read) and the reason (its first error,
    or ``duplicate_id``)."""

    lineno: int
    sample_id: str | None
    problem: Problem


@dataclass
class Selection:
    """What ``select_records`` keeps of a file: per kept record (file order) its byte offset, length, line number
    and id hash; the dropped lines in line order; the warnings / notes of the kept records by kind; how many kept
    records have no objects."""

    offsets: array
    lengths: array
    lines: array
    hashes: array
    dropped: list[DroppedLine]
    notes: dict[str, int]
    negatives: int


def select_records(path: Path, base_dir: Path | None, headers: HeaderReader | None,
                   on_line: Callable[[ScannedLine], None] | None = None) -> Selection:
    """The records training keeps, in one streaming pass: a line with an error is dropped; a valid record whose id
    an earlier valid record has is dropped as a duplicate (found after the pass from 64-bit id hashes, each
    collision read back). ``on_line`` sees every scanned line. Per record only offsets, hashes and a 2-byte code
    of its problem kinds are held."""
    offsets, lengths, lines, hashes = array("q"), array("i"), array("i"), array("q")
    kinds, negative = array("H"), array("b")
    kind_codes: dict[tuple[str, ...], int] = {}
    dropped: list[DroppedLine] = []
    for scanned in scan_jsonl(path, base_dir, headers, build=False):
        if on_line is not None:
            on_line(scanned)
        check = scanned.check
        if not check.ok:
            dropped.append(DroppedLine(scanned.lineno, check.sample_id, check.first_error))
            continue
        offsets.append(scanned.offset)
        lengths.append(scanned.length)
        lines.append(scanned.lineno)
        hashes.append(id_hash(check.sample_id))
        kinds.append(kind_codes.setdefault(tuple(sorted(p.kind for p in check.problems)), len(kind_codes)))
        negative.append(check.num_objects == 0)
    later: set[int] = set()
    if len(hashes) > 1:
        with path.open("rb") as fh:
            def id_at(i: int) -> str:
                raw = json.loads(os.pread(fh.fileno(), lengths[i], offsets[i]))
                return str(raw.get("id", f"{path}:{lines[i]}"))

            for dup, first in duplicates(hashes, id_at):
                sid = id_at(dup)
                later.add(dup)
                dropped.append(DroppedLine(lines[dup], sid, Problem(f"{path}:{lines[dup]}", "duplicate_id",
                                                                    duplicate_message(sid, lines[first]))))
    keep = [k for k in range(len(offsets)) if k not in later]
    if later:
        offsets, lengths, lines, hashes = (array(a.typecode, (a[k] for k in keep))
                                           for a in (offsets, lengths, lines, hashes))
    by_code = {code: kind_set for kind_set, code in kind_codes.items()}
    notes = Counter(kind for k in keep for kind in by_code[kinds[k]])
    return Selection(offsets, lengths, lines, hashes, sorted(dropped, key=lambda d: d.lineno), dict(notes),
                     sum(negative[k] for k in keep))


def index_jsonl(path: str | Path, image_root: str | Path | None = None, check_images: bool = True,
                on_bad_record: str = "error", report: LoadReport | None = None) -> JsonlDataset:
    """``load_jsonl``'s checks and errors in one streaming pass that keeps no record (``select_records``): a
    ``JsonlDataset`` of the records training keeps."""
    path, base = _open_dataset(path, image_root, on_bad_record)
    report = report if report is not None else LoadReport()
    selection = select_records(path, base, read_header if check_images else None)
    for line in selection.dropped:
        _drop(report, str(line.problem), on_bad_record, line.sample_id)
    for kind, n in selection.notes.items():
        report.notes[kind] = report.notes.get(kind, 0) + n
    report.negatives += selection.negatives
    dataset = JsonlDataset(path, base, selection.offsets, selection.lengths, selection.lines, selection.hashes)
    report.kept = len(dataset)
    _finish(path, report, on_bad_record)
    return dataset
