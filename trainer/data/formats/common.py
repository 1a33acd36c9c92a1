"""Imported records, the import report and the geometry rules every importer applies (pure: no files).

Geometry rules (``fit``), in this order: a box with ``x2 <= x1`` or ``y2 <= y1`` is *degenerate* (dropped); a
shape reaching more than ``tolerance`` px outside the image is *outside* (dropped: the image size or the
annotation is wrong); one outside by at most ``tolerance`` px is *clamped* into the image (kept); coordinates
are rounded to ``PRECISION`` decimals (0.01 px), and a shape that collapses doing so is *degenerate*. Every
dropped or changed shape is counted with its source id in the ``ImportReport`` — never silently.

An image whose every source annotation was skipped or dropped (crowd, degenerate, outside) is *emptied*: its record
is not written unless asked (``ImportReport.admit``), since ``objects: []`` would teach that nothing is there.
Emptied images are counted apart from images that had no annotations at all (true negatives, always written).

Image sizes (``source_size``, when the importer is given a header reader): annotations are taken as drawn on the
*displayed* image, the stored pixels with their EXIF orientation applied, as COCO tools and viewers show it and as
training loads it (``trainer.data.images``). A source ``width`` / ``height`` that is the stored size of an image
whose orientation swaps its sides (5-8, a phone photo taken upright) is written as the displayed size when every
annotation fits the displayed image, counted by id; when an annotation fits only the stored frame, the annotations
were drawn on the un-rotated pixels and the record is refused (the import writes nothing, ``write_records``). Any
other size that is not the image's is counted (``data check`` reports it). Images with any EXIF orientation are
counted.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.data.images import ORIENTATION_NAMES, ImageHeader, ImageRefError, read_header
from trainer.data.objects import GeometryKind
from trainer.data.records import DatasetError, parse_record

PRECISION = 2
DEFAULT_TOLERANCE = 1.0
SHOWN_IDS = 10

Outcome = Literal["ok", "clamped", "degenerate", "outside"]


class SourceError(ValueError):
    """A malformed source file; the message names the file, the item (``annotations[12] (id 345)``) and the fix."""


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_numbers(v: Any, count: int | None = None) -> bool:
    """A list of finite numbers (of exactly ``count`` items when given)."""
    return isinstance(v, list) and all(is_number(x) for x in v) and (count is None or len(v) == count)


def is_positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@dataclass(frozen=True)
class PixelObject:
    """One object in pixel coordinates: ``bbox_2d`` ``(x1, y1, x2, y2)`` or a ``poly`` ring ``(x1, y1, ...)``."""

    desc: str
    kind: GeometryKind
    coords: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {"desc": self.desc, self.kind: list(self.coords)}

    def bounds(self) -> tuple[float, float, float, float]:
        xs, ys = self.coords[0::2], self.coords[1::2]
        return min(xs), min(ys), max(xs), max(ys)


@dataclass(frozen=True)
class ImportedRecord:
    """One image and its objects; ``image`` is the image file (absolute after an import). ``emptied``: the source
    annotated the image but every annotation was skipped or dropped (``objects`` is empty)."""

    record_id: str
    image: Path
    width: int
    height: int
    objects: tuple[PixelObject, ...]
    emptied: bool = False

    def to_json(self, base_dir: Path | None) -> dict[str, Any]:
        """The JSONL record; its image path relative to ``base_dir`` (the output file's folder), where one exists."""
        return {"id": self.record_id, "images": [image_ref(self.image, base_dir)], "width": self.width,
                "height": self.height, "objects": [o.to_json() for o in self.objects]}


def image_ref(image: Path, base_dir: Path | None) -> str:
    """``image`` relative to ``base_dir`` (``records.load_jsonl`` resolves it against the JSONL's folder), or as is
    when ``base_dir`` is ``None`` or no relative path exists (another drive)."""
    if base_dir is None:
        return image.as_posix()
    try:
        return Path(os.path.relpath(image, base_dir)).as_posix()
    except ValueError:
        return image.as_posix()


@dataclass(frozen=True)
class Fitted:
    coords: tuple[float, ...] | None  # None: dropped
    outcome: Outcome


def fit(kind: GeometryKind, coords: Iterable[float], width: int, height: int,
        tolerance: float = DEFAULT_TOLERANCE) -> Fitted:
    """Apply the module's geometry rules to one shape in pixel coordinates."""
    vals = [float(v) for v in coords]
    xs, ys = vals[0::2], vals[1::2]
    if kind == "bbox_2d" and not (vals[2] > vals[0] and vals[3] > vals[1]):
        return Fitted(None, "degenerate")
    if min(xs) < -tolerance or min(ys) < -tolerance or max(xs) > width + tolerance or max(ys) > height + tolerance:
        return Fitted(None, "outside")
    clamped = [min(max(v, 0.0), float(width if i % 2 == 0 else height)) for i, v in enumerate(vals)]
    rounded = tuple(round(v, PRECISION) + 0.0 for v in clamped)
    rx, ry = rounded[0::2], rounded[1::2]
    if not (max(rx) > min(rx) and max(ry) > min(ry)):
        return Fitted(None, "degenerate")
    return Fitted(rounded, "clamped" if clamped != vals else "ok")


def _ids(ids: list[str]) -> str:
    if not ids:
        return ""
    shown = ", ".join(ids[:SHOWN_IDS])
    more = f", … {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else ""
    return f" ({shown}{more})"


@dataclass
class ImportReport:
    """What an import did. Lists hold source ids (COCO annotation ids, ``line N regions[i]`` for ODVG); the image
    lists (``empty_images``, ``emptied_dropped``, ``emptied_kept``) hold record ids. ``keep_emptied``: emptied
    images are written as negatives instead of dropped."""

    source: str
    tolerance: float = DEFAULT_TOLERANCE
    keep_emptied: bool = False
    records: int = 0
    objects: int = 0
    empty_images: list[str] = field(default_factory=list)
    emptied_dropped: list[str] = field(default_factory=list)
    emptied_kept: list[str] = field(default_factory=list)
    crowd_skipped: list[str] = field(default_factory=list)
    crowd_kept: list[str] = field(default_factory=list)
    rle_as_box: list[str] = field(default_factory=list)
    poly_as_box: list[str] = field(default_factory=list)
    clamped: list[str] = field(default_factory=list)
    degenerate: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    missing_images: list[str] = field(default_factory=list)
    exif_oriented: list[str] = field(default_factory=list)
    exif_displayed: list[str] = field(default_factory=list)
    size_differs: list[str] = field(default_factory=list)
    stored_pixels: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def keep(self, fitted: Fitted, item: str) -> bool:
        """Count ``fitted``'s outcome under ``item``; whether the shape is kept."""
        if fitted.outcome != "ok":
            getattr(self, fitted.outcome).append(item)
        return fitted.coords is not None

    def admit(self, record: ImportedRecord) -> bool:
        """Whether ``record`` is to be written: an emptied image only with ``keep_emptied``; counted by id."""
        if not record.emptied:
            return True
        (self.emptied_kept if self.keep_emptied else self.emptied_dropped).append(record.record_id)
        return self.keep_emptied

    def add(self, record: ImportedRecord) -> None:
        """Count a written record."""
        self.records += 1
        self.objects += len(record.objects)
        if not record.objects and not record.emptied:
            self.empty_images.append(record.record_id)

    def summary(self) -> str:
        t = f"{self.tolerance:g}"
        rows = [
            f"records written: {self.records}",
            f"objects: {self.objects}",
            f"images without annotations (kept, objects: []): {len(self.empty_images)}" + _ids(self.empty_images),
            "images emptied by filtering (every annotation skipped or dropped), not written "
            f"(--keep-emptied-as-negatives writes them): {len(self.emptied_dropped)}" + _ids(self.emptied_dropped),
            "images emptied by filtering, written as negatives (objects: []; they teach that nothing is there): "
            f"{len(self.emptied_kept)}" + _ids(self.emptied_kept),
            f"crowd annotations skipped (--crowd keep keeps them as boxes): {len(self.crowd_skipped)}"
            + _ids(self.crowd_skipped),
            f"crowd annotations kept as boxes: {len(self.crowd_kept)}" + _ids(self.crowd_kept),
            f"RLE masks imported as their boxes: {len(self.rle_as_box)}" + _ids(self.rle_as_box),
            f"polygons imported as boxes (multi-part, < 3 points or none; --geometry poly): {len(self.poly_as_box)}"
            + _ids(self.poly_as_box),
            f"clamped into the image (<= {t} px outside): {len(self.clamped)}" + _ids(self.clamped),
            f"dropped, degenerate (width or height <= 0): {len(self.degenerate)}" + _ids(self.degenerate),
            f"dropped, more than {t} px outside the image: {len(self.outside)}" + _ids(self.outside),
            f"missing image files: {len(self.missing_images)}" + _ids(self.missing_images),
            "images with an EXIF orientation (annotations taken as drawn on the displayed image, as training loads "
            f"it): {len(self.exif_oriented)}" + _ids(self.exif_oriented),
            "EXIF-rotated images the source sizes as stored, written with their displayed width/height: "
            f"{len(self.exif_displayed)}" + _ids(self.exif_displayed),
            "width/height unlike the image file's (data check lists them, --fix-geometry rescales): "
            f"{len(self.size_differs)}" + _ids(self.size_differs),
        ]
        return "\n".join([f"imported {self.source}", *(f"  {r}" for r in rows), *(f"  note: {n}" for n in self.notes)])


HeaderReader = Callable[[Path], ImageHeader | None]
Box = tuple[float, float, float, float]


def image_header(path: Path) -> ImageHeader | None:
    """``read_header``, or ``None`` for a missing or unreadable file (``write_records`` and ``data check`` report
    those)."""
    try:
        return read_header(path)
    except ImageRefError:
        return None


def source_size(record_id: str, image: Path, width: int, height: int, boxes: Callable[[], Sequence[tuple[str, Box]]],
                header: ImageHeader | None, tolerance: float, report: ImportReport) -> tuple[int, int] | None:
    """The width/height to write for an image the source sizes ``width`` x ``height``, given its file's ``header``
    (``None``: kept as is), or ``None`` when the record is refused (listed in ``report.stored_pixels``). ``boxes``:
    the ``(source id, (x1, y1, x2, y2))`` of the image's annotations, read only for an EXIF-rotated image the
    source sizes as stored. The module's docstring gives the rules."""
    if header is None:
        return width, height
    if header.orientation != 1:
        report.exif_oriented.append(record_id)
    shown = header.size
    if (width, height) == shown:
        return shown
    if header.transposed and (width, height) == (header.stored_width, header.stored_height):
        w, h = shown
        stored_only = [aid for aid, (x1, y1, x2, y2) in boxes()
                       if (x2 > w + tolerance or y2 > h + tolerance)
                       and x1 >= -tolerance and y1 >= -tolerance and x2 <= width + tolerance and y2 <= height + tolerance]
        if stored_only:
            shown_ids = ", ".join(stored_only[:SHOWN_IDS]) + (", …" if len(stored_only) > SHOWN_IDS else "")
            report.stored_pixels.append(
                f"id {record_id} ({image}: EXIF orientation {header.orientation} "
                f"({ORIENTATION_NAMES[header.orientation]}), stored {width}x{height}, displayed {w}x{h}; annotations "
                f"{shown_ids} fit only the stored frame)")
            return None
        report.exif_displayed.append(record_id)
        return shown
    report.size_differs.append(record_id)
    return width, height


def json_lines(lines: Iterable[str], source: str, error: type[Exception]) -> Iterator[tuple[int, str, Any]]:
    """``(line number, source:line, parsed JSON)`` for each non-blank line; a line that is not JSON raises ``error`` naming it."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            yield lineno, where, json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None


def parse_pixel_records(lines: Iterable[str], source: str) -> Iterator[ImportedRecord]:
    """Our JSONL records with their pixel coordinates (``records.load_jsonl`` keeps only norm1000 bins), each
    validated by ``records.parse_record`` (images not checked); ``DatasetError`` names ``file:line``."""
    seen: dict[str, int] = {}
    for lineno, where, raw in json_lines(lines, source, DatasetError):
        sample = parse_record(raw, where, None, check_images=False)
        if sample.sample_id in seen:
            raise DatasetError(f"{where}: duplicate id {sample.sample_id!r} (first at line {seen[sample.sample_id]})")
        seen[sample.sample_id] = lineno
        if len(sample.images) != 1:
            raise DatasetError(f"{where}: {len(sample.images)} images; COCO has one image per record")
        objects = tuple(PixelObject(o["desc"].strip(), "bbox_2d" if "bbox_2d" in o else "poly",
                                    tuple(float(v) for v in o.get("bbox_2d", o.get("poly"))))
                        for o in raw["objects"])
        yield ImportedRecord(sample.sample_id, Path(sample.images[0]), sample.width, sample.height, objects)
