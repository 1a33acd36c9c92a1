"""``python -m trainer data check FILE.jsonl``: every problem of a records file in one pass, as training sees it.

The checks are the loader's own (``trainer.data.records.check_record``, same messages): JSON and record schema,
image files (missing, unreadable, header size vs the declared ``width`` / ``height`` after EXIF orientation, the
processor's aspect-ratio limit, colour modes), boxes and polygons, empty descs, and duplicate ids. What training
keeps is decided by the loader's own rule too (``records.select_records``: duplicate ids among valid records
only), so ``valid`` is the count training keeps with ``data.on_bad_record: drop``. Problems are counted by kind
with the first examples of each (``file:line: what is wrong; what to do``). Errors make the exit status 1;
warnings (an EXIF-rotated image whose declared size is the displayed one) and notes (colour modes converted to
RGB) do not.

``--fix-geometry OUT`` writes a copy (same lines, same order) where each record's width/height become its image's
displayed size: the stored size of an EXIF-rotated image is swapped (coordinates kept: they refer to the displayed
image), a uniformly scaled size has its coordinates rescaled to the image; a size of another aspect ratio is
refused (the record is copied unchanged and named). OUT is then checked; the exit status is OUT's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.data.images import ImageHeader, ImageRefError, read_header
from trainer.data.records import (
    HeaderReader,
    Problem,
    ScannedLine,
    Severity,
    same_aspect,
    select_records,
)

#: what each kind of problem means (``colour_mode:MODE`` kinds are notes, one per mode)
KIND_HELP = {
    "invalid_json": "lines that are not valid JSON",
    "record_schema": "records with a missing, unknown or mistyped field",
    "object_schema": "objects with unknown keys or a malformed bbox_2d / poly",
    "empty_desc": "objects without a desc",
    "degenerate_box": "boxes with x2 <= x1 or y2 <= y1",
    "poly_count": "polygons with an odd count or fewer than 3 points",
    "out_of_bounds": "boxes / polygons outside the declared image size",
    "duplicate_id": "ids seen on an earlier valid line (ids key the training ledger)",
    "image_missing": "image files not found",
    "image_unreadable": "image files that cannot be read as images",
    "size_mismatch": "declared width/height differ from the image's displayed size (--fix-geometry)",
    "aspect_ratio": "images the Qwen-VL image processor refuses (aspect ratio above 200:1)",
    "colour_mode_unsupported": "images in a colour mode that cannot be converted to RGB",
    "exif_orientation": "images with an EXIF orientation (trained on the displayed image)",
}
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")
SEVERITY_TITLES = {"error": "errors (training refuses these records)", "warning": "warnings",
                   "info": "notes (colour modes converted to RGB on load)"}


@dataclass
class CheckReport:
    """Counts of problems by kind, the first ``max_examples`` of each, how many records were seen, and how many
    are valid: the records training keeps (``records.select_records``)."""

    path: str
    max_examples: int = 3
    records: int = 0
    valid: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    severities: dict[str, Severity] = field(default_factory=dict)
    examples: dict[str, list[Problem]] = field(default_factory=dict)

    def add(self, problem: Problem) -> None:
        n = self.counts.get(problem.kind, 0)
        self.counts[problem.kind] = n + 1
        self.severities[problem.kind] = problem.severity
        if n < self.max_examples:
            self.examples.setdefault(problem.kind, []).append(problem)

    def total(self, severity: Severity) -> int:
        return sum(n for kind, n in self.counts.items() if self.severities[kind] == severity)

    @property
    def ok(self) -> bool:
        return self.total("error") == 0


def check_lines(path: Path, base_dir: Path | None, headers: HeaderReader | None = read_header,
                max_examples: int = 3) -> CheckReport:
    """Check every record of ``path`` (image paths relative to ``base_dir``) in one streaming pass, then its ids,
    by training's rule (``records.select_records``)."""
    report = CheckReport(str(path), max_examples)

    def seen(scanned: ScannedLine) -> None:
        report.records += 1
        for p in scanned.check.problems:
            report.add(p)

    selection = select_records(path, base_dir, headers, on_line=seen)
    for line in selection.dropped:
        if line.problem.kind == "duplicate_id":
            report.add(line.problem)
    report.valid = len(selection.offsets)
    return report


def format_report(report: CheckReport) -> str:
    """The report as printed: totals, then per severity each kind's count, meaning and first examples."""
    head = (f"checked {report.path}: {report.records} records, {report.valid} without errors; "
            f"{report.total('error')} errors, {report.total('warning')} warnings, {report.total('info')} notes")
    out = [head]
    for severity in SEVERITIES:
        kinds = sorted((k for k in report.counts if report.severities[k] == severity),
                       key=lambda k: (-report.counts[k], k))
        if not kinds:
            continue
        out.append(f"{SEVERITY_TITLES[severity]}:")
        for kind in kinds:
            meaning = KIND_HELP.get(kind, "")
            out.append(f"  {kind}: {report.counts[kind]}" + (f" ({meaning})" if meaning else ""))
            shown = report.examples.get(kind, [])[:1 if severity == "info" else None]
            out.extend(f"    {p}" for p in shown)
            if report.counts[kind] > len(shown):
                out.append(f"    … and {report.counts[kind] - len(shown)} more")
    if report.ok:
        out.append("no errors: training keeps every record")
    else:
        out.append(f"training refuses this file (or, with data.on_bad_record: drop, keeps {report.valid} of "
                   f"{report.records} records); fix the errors above")
    return "\n".join(out)


FixAction = Literal["swapped", "rescaled", "refused"]


@dataclass(frozen=True)
class Fix:
    """What ``--fix-geometry`` did to one record: ``record`` is the corrected one (``None`` when refused)."""

    where: str
    action: FixAction
    message: str
    record: dict[str, Any] | None = None

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def _scaled(objects: Any, sx: float, sy: float) -> Any:
    if not isinstance(objects, list):
        return objects
    out = []
    for o in objects:
        if isinstance(o, dict):
            o = dict(o)
            for key in ("bbox_2d", "poly"):
                vals = o.get(key)
                if isinstance(vals, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
                    o[key] = [round(v * (sx if j % 2 == 0 else sy), 2) for j, v in enumerate(vals)]
        out.append(o)
    return out


def _outside(objects: Any, width: int, height: int) -> list[int]:
    bad = []
    for i, o in enumerate(objects if isinstance(objects, list) else []):
        vals = next((o[k] for k in ("bbox_2d", "poly") if isinstance(o, dict) and isinstance(o.get(k), list)), [])
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            continue
        xs, ys = vals[0::2], vals[1::2]
        if vals and (min(xs) < 0 or min(ys) < 0 or max(xs) > width or max(ys) > height):
            bad.append(i)
    return bad


def fix_record(raw: Any, where: str, headers: tuple[ImageHeader | None, ...]) -> Fix | None:
    """The geometry fix of one record given its images' headers, or ``None`` when there is nothing to fix (size
    right, or the record / images too broken to tell: ``data check`` reports those)."""
    if not isinstance(raw, dict) or not headers or any(h is None for h in headers):
        return None
    width, height = raw.get("width"), raw.get("height")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (width, height)):
        return None
    sizes = {h.size for h in headers}
    if len(sizes) > 1:
        return Fix(where, "refused", f"refused: the record's images differ in size ({sorted(sizes)}); one width/"
                                     "height cannot describe them: split the record")
    (w, h), header = sizes.pop(), headers[0]
    if (w, h) == (width, height):
        return None
    if header.transposed and (width, height) == (header.stored_width, header.stored_height):
        outside = _outside(raw.get("objects"), w, h)
        if outside:
            return Fix(where, "refused",
                       f"refused: {width}x{height} is the stored size of an image with EXIF orientation "
                       f"{header.orientation}, but objects {outside} lie outside the displayed {w}x{h} image: they "
                       "were drawn on the stored (un-rotated) pixels; rotate them to the displayed image or re-annotate")
        return Fix(where, "swapped",
                   f"width/height {width}x{height} → {w}x{h}: the stored size of an image with EXIF orientation "
                   f"{header.orientation}, replaced by its displayed size; coordinates kept (they refer to the "
                   "displayed image)", {**raw, "width": w, "height": h})
    if same_aspect(width, height, w, h):
        sx, sy = w / width, h / height
        return Fix(where, "rescaled",
                   f"width/height {width}x{height} → {w}x{h} (the image, scaled x{sx:.4g}); coordinates scaled by "
                   f"{sx:.4g} (x) and {sy:.4g} (y)",
                   {**raw, "width": w, "height": h, "objects": _scaled(raw.get("objects"), sx, sy)})
    return Fix(where, "refused",
               f"refused: the record declares {width}x{height} but the image is {w}x{h}, another aspect ratio: its "
               "coordinates cannot be rescaled; fix width/height and the coordinates by hand")


def _resolved(raw: dict[str, Any], base_dir: Path | None) -> list[Path] | None:
    images = raw.get("images", raw.get("image"))
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not images or not all(isinstance(p, str) and p for p in images):
        return None
    return [Path(p) if base_dir is None or os.path.isabs(p) else base_dir / p for p in images]


def _headers(paths: Iterable[Path], reader: HeaderReader) -> tuple[ImageHeader | None, ...]:
    out = []
    for p in paths:
        try:
            out.append(reader(p))
        except ImageRefError:
            out.append(None)
    return tuple(out)


def fix_geometry(path: Path, out: Path, base_dir: Path | None, headers: HeaderReader = read_header,
                 on_fix: Callable[[Fix], None] = lambda fix: None) -> list[Fix]:
    """Write ``out``: ``path`` line for line, each fixable record corrected (``fix_record``); every other line
    (blank, invalid, refused, right) unchanged. Written through ``out.tmp`` and renamed at the end."""
    fixes: list[Fix] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with path.open("rb") as src, tmp.open("wb") as dst:
            for lineno, line in enumerate(src, start=1):
                fix = None
                if line.strip():
                    try:
                        raw = json.loads(line)
                    except ValueError:
                        raw = None
                    paths = _resolved(raw, base_dir) if isinstance(raw, dict) else None
                    if paths is not None:
                        fix = fix_record(raw, f"{path}:{lineno}", _headers(paths, headers))
                if fix is None:
                    dst.write(line)
                    continue
                fixes.append(fix)
                on_fix(fix)
                if fix.record is None:
                    dst.write(line)
                else:
                    end = b"\n" if line.endswith(b"\n") else b""
                    dst.write(json.dumps(fix.record, ensure_ascii=False).encode() + end)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return fixes


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        print(f"error: {path}: dataset file not found", file=sys.stderr)
        return 2
    if args.max_examples < 0:
        print("error: --max-examples must be >= 0", file=sys.stderr)
        return 2
    base = Path(args.image_root) if args.image_root else path.parent
    report = check_lines(path, base, max_examples=args.max_examples)
    print(format_report(report))
    if not args.fix_geometry:
        return 0 if report.ok else 1
    out = Path(args.fix_geometry)
    if out.resolve() == path.resolve():
        print("error: --fix-geometry must name a new file, not the checked one", file=sys.stderr)
        return 2
    print(f"fix-geometry → {out}:")
    fixes = fix_geometry(path, out, base, on_fix=lambda fix: print(f"  {fix}"))
    done = {a: sum(f.action == a for f in fixes) for a in ("swapped", "rescaled", "refused")}
    print(f"  {done['swapped'] + done['rescaled']} records fixed ({done['swapped']} EXIF-rotated sizes swapped, "
          f"{done['rescaled']} rescaled), {done['refused']} refused (copied unchanged)")
    if out.parent.resolve() != base.resolve():
        print(f"  note: image paths stay relative to {base}: train with data.image_root: {base}, or keep {out.name} "
              f"beside {path.name}")
    fixed = check_lines(out, base, max_examples=args.max_examples)
    print(format_report(fixed) if not fixed.ok else
          f"checked {out}: {fixed.records} records, no errors ({fixed.total('warning')} warnings)")
    return 0 if fixed.ok else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check", help="every problem of a records file in one pass (exit 1 on errors)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("file", metavar="FILE.jsonl")
    p.add_argument("--image-root", default=None,
                   help="folder image paths are relative to (data.image_root; default: the file's folder)")
    p.add_argument("--max-examples", type=int, default=3, help="examples shown per kind of problem (default 3)")
    p.add_argument("--fix-geometry", metavar="OUT.jsonl", default=None,
                   help="write a copy with width/height set to each image's displayed size (coordinates rescaled "
                        "when the declared size was a uniform scale); then check it")
    p.set_defaults(func=run)
