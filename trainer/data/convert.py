"""``python -m trainer data import`` (COCO / LVIS JSON, ODVG JSONL → JSONL records) and ``data export``
(records → COCO ground truth; predictions → COCO results, optionally scored with ``COCOeval``).

The conversions are pure (``trainer.data.formats``); this module reads and writes the files. Exit status 2 with
one ``error:`` line naming the file and item when a source is malformed (nothing is written then).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.data.formats.coco import (
    CocoImportOptions,
    coco_dataset,
    coco_evaluate,
    coco_records,
    detection_results,
    given_categories,
)
from trainer.data.formats.common import (
    DEFAULT_TOLERANCE,
    SHOWN_IDS,
    ImportedRecord,
    ImportReport,
    SourceError,
    image_header,
    parse_pixel_records,
)
from trainer.data.formats.odvg import odvg_records, parse_label_map
from trainer.data.records import DatasetError


def load_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise SourceError(f"{path}: {what} not found")
    try:
        with path.open(encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        hint = "; one JSON object per line is JSONL (ODVG: --from odvg)" if exc.msg == "Extra data" else ""
        raise SourceError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}){hint}") from None


def write_records(records: Iterable[ImportedRecord], out: Path, base_dir: Path | None, missing: str,
                  report: ImportReport) -> None:
    """Stream ``records`` to ``out`` (through ``out.tmp``, renamed at the end: a failed import leaves no file).
    An emptied record is written only with ``report.keep_emptied`` (``ImportReport.admit``). ``missing``: a
    record whose image file does not exist is an error (after the pass, listing them), dropped or kept; each is
    listed in ``report.missing_images``. Images the importer refused as annotated on their stored pixels
    (``report.stored_pixels``) are an error after the pass, listing them."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            for rec in records:
                if not report.admit(rec):
                    continue
                if not rec.image.is_file():
                    report.missing_images.append(str(rec.image))
                    if missing == "drop":
                        continue
                fh.write(json.dumps(rec.to_json(base_dir), ensure_ascii=False) + "\n")
                report.add(rec)
        if report.stored_pixels:
            shown = "; ".join(report.stored_pixels[:SHOWN_IDS])
            more = f"; … {len(report.stored_pixels) - SHOWN_IDS} more" if len(report.stored_pixels) > SHOWN_IDS else ""
            raise SourceError(f"{len(report.stored_pixels)} EXIF-rotated images annotated on their stored, un-rotated "
                              f"pixels ({shown}{more}); training sees each image as displayed (EXIF orientation "
                              "applied): rotate those annotations to the displayed image and set its displayed "
                              "width/height, or remove the orientation tag from those files (exiftool "
                              "-Orientation=1 -n FILE) so they display as stored")
        if report.missing_images and missing == "error":
            shown = ", ".join(report.missing_images[:SHOWN_IDS])
            raise SourceError(f"{len(report.missing_images)} image files not found ({shown}"
                              f"{', …' if len(report.missing_images) > SHOWN_IDS else ''}); check --images, or "
                              "pass --missing-images drop (leave those records out) or keep (write them anyway: "
                              "data check and training fail on them until the files exist)")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def import_records(args: argparse.Namespace, report: ImportReport) -> None:
    source, images = Path(args.source), Path(args.images).resolve()
    if not images.is_dir():
        raise SourceError(f"--images {args.images}: not a folder")
    if args.clamp_tolerance < 0:
        raise SourceError(f"--clamp-tolerance must be >= 0 px, got {args.clamp_tolerance}")
    out = Path(args.out)
    base_dir = None if args.paths == "absolute" else out.resolve().parent
    if args.fmt == "odvg":
        for option, value in (("--geometry", args.geometry), ("--crowd", args.crowd), ("--names", args.names)):
            if value is not None:
                raise SourceError(f"{option} does not apply to ODVG (boxes with category names or phrases only)")
        label_map = (parse_label_map(load_json(Path(args.label_map), "label map"), args.label_map)
                     if args.label_map else None)
        if not source.is_file():
            raise SourceError(f"{source}: ODVG file not found")
        with source.open(encoding="utf-8") as fh:
            write_records(odvg_records(fh, str(source), images, report, label_map, args.clamp_tolerance,
                                       image_header), out, base_dir, args.missing_images, report)
        return
    if args.label_map:
        raise SourceError("--label-map is for --from odvg (COCO and LVIS name their categories)")
    lvis = args.fmt == "lvis"
    options = CocoImportOptions(args.geometry or "bbox", args.crowd or "skip", args.clamp_tolerance,
                                args.names or ("spaces" if lvis else "raw"))
    data = load_json(source, "annotation file")
    write_records(coco_records(data, str(source), images, options, report, lvis, image_header), out, base_dir,
                  args.missing_images, report)


def run_import(args: argparse.Namespace) -> int:
    report = ImportReport(f"{args.source} ({args.fmt}) → {args.out}", tolerance=args.clamp_tolerance,
                          keep_emptied=args.keep_emptied_as_negatives)
    try:
        import_records(args, report)
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


def _stats(stats: list[float]) -> str:
    names = {"AP": 0, "AP50": 1, "AP75": 2, "AR100": 8}
    return "  ".join(f"{k} {stats[i]:.3f}" if stats[i] >= 0 else f"{k} n/a" for k, i in names.items())


def export_coco(args: argparse.Namespace) -> None:
    gt, out = Path(args.file), Path(args.out)
    if not gt.is_file():
        raise SourceError(f"{gt}: records file not found")
    if args.evaluate and not args.predictions:
        raise SourceError("--evaluate needs --predictions PRED.jsonl")
    with gt.open(encoding="utf-8") as fh:
        records = list(parse_pixel_records(fh, str(gt)))
    categories = (given_categories(load_json(Path(args.categories), "categories file"), args.categories)
                  if args.categories else None)
    export = coco_dataset(records, categories, args.categories or "--categories")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(export.dataset, ensure_ascii=False) + "\n", encoding="utf-8")
    d = export.dataset
    print(f"exported {len(d['images'])} images, {len(d['annotations'])} annotations, {len(d['categories'])} "
          f"categories → {out}")
    if not args.predictions:
        return
    pred = Path(args.predictions)
    if not pred.is_file():
        raise SourceError(f"{pred}: predictions file not found")
    with pred.open(encoding="utf-8") as fh:
        results, agnostic, report = detection_results(fh, str(pred), export, {r.record_id: r for r in records})
    results_path = Path(args.results) if args.results else out.with_name(f"{out.stem}_results.json")
    results_path.write_text(json.dumps(results) + "\n", encoding="utf-8")
    print(report.summary())
    print(f"COCO results: {len(results)} detections → {results_path}")
    if args.evaluate:
        if not d["annotations"]:
            print("COCO box AP: undefined (the ground truth has no objects)")
            return
        none = [0.0] * 12
        print("COCO box AP (pycocotools COCOeval, pixel coordinates, all scores as given):")
        print("  by category:    " + _stats(coco_evaluate(d, results) if results else none))
        print("  class-agnostic: " + _stats(coco_evaluate(d, agnostic, use_cats=False) if agnostic else none))


def run_export(args: argparse.Namespace) -> int:
    try:
        export_coco(args)
    except (SourceError, DatasetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def register(data_subparsers: argparse._SubParsersAction) -> None:
    p = data_subparsers.add_parser(
        "import", help="COCO / LVIS instances JSON or ODVG JSONL → JSONL records (pixel coordinates)",
        description="Convert a detection dataset to JSONL records; prints what was skipped, clamped or dropped "
                    "(with source ids). Details: docs/guides/own-data.md.")
    p.add_argument("--from", dest="fmt", required=True, choices=["coco", "lvis", "odvg"])
    p.add_argument("source", metavar="SRC", help="instances JSON (coco, lvis) or ODVG JSONL")
    p.add_argument("--images", required=True, metavar="DIR",
                   help="folder the source's file names are relative to (COCO file_name, ODVG filename)")
    p.add_argument("--out", required=True, metavar="FILE.jsonl")
    p.add_argument("--geometry", choices=["bbox", "poly"], default=None,
                   help="bbox (default): every object a box; poly: one-part polygon segmentations as poly "
                        "(multi-part polygons and RLE masks stay boxes, counted)")
    p.add_argument("--crowd", choices=["skip", "keep"], default=None,
                   help="iscrowd annotations: skip (default, counted; an image with only crowds is then left out) "
                        "or keep as boxes")
    p.add_argument("--keep-emptied-as-negatives", action="store_true",
                   help="write images whose every annotation was skipped or dropped (crowd, degenerate, outside) "
                        "with objects: [], teaching that nothing is there; default: leave them out (listed)")
    p.add_argument("--names", choices=["raw", "spaces"], default=None,
                   help="category names as desc: raw (COCO default) or '_' → ' ' (LVIS default)")
    p.add_argument("--label-map", default=None, metavar="FILE.json",
                   help="ODVG detection: {\"0\": \"person\", ...} for instances without a category name")
    p.add_argument("--clamp-tolerance", type=float, default=DEFAULT_TOLERANCE, metavar="PX",
                   help="shapes at most this far outside the image are clamped, further ones dropped (default 1)")
    p.add_argument("--missing-images", choices=["error", "drop", "keep"], default="error",
                   help="a record whose image file is missing: error (default), drop it, or keep it")
    p.add_argument("--paths", choices=["relative", "absolute"], default="relative",
                   help="image paths relative to the output file's folder (default; leave data.image_root unset) "
                        "or absolute")
    p.set_defaults(func=run_import)

    e = data_subparsers.add_parser(
        "export", help="JSONL records → COCO ground truth (+ predictions → COCO results, --evaluate: COCOeval)",
        description="Write records as a COCO instances file; with --predictions (trainer eval's samples.jsonl, or "
                    "records with optional per-object score) also a COCO results file.")
    e.add_argument("--to", dest="fmt", required=True, choices=["coco"])
    e.add_argument("file", metavar="FILE.jsonl", help="ground-truth records")
    e.add_argument("--out", required=True, metavar="COCO.json")
    e.add_argument("--categories", default=None, metavar="COCO.json",
                   help="take category ids from this COCO/LVIS file (matched by name) instead of numbering descs")
    e.add_argument("--predictions", default=None, metavar="PRED.jsonl",
                   help="eval samples.jsonl (norm1000 bins) or pixel records of the same ids")
    e.add_argument("--results", default=None, metavar="RESULTS.json",
                   help="where the COCO results go (default: <out stem>_results.json beside --out)")
    e.add_argument("--evaluate", action="store_true",
                   help="print COCO box AP of the predictions against the exported ground truth")
    e.set_defaults(func=run_export)
