"""COCO and LVIS instance JSON → ``ImportedRecord``s; records → COCO ground truth; predictions → COCO results.

Import (``coco_records``), one record per entry of ``images`` (in file order; id: the image id as a string;
images without annotations are kept with ``objects: []``; an image whose every annotation is skipped or dropped is
``emptied``, see ``trainer.data.formats.common``), one object per annotation (in file order):

- ``desc`` is the category ``name``; with ``names="spaces"`` (the LVIS default) ``_`` becomes a space
  (``teddy_bear`` → ``teddy bear``).
- ``bbox`` ``[x, y, w, h]`` → ``bbox_2d`` ``[x, y, x + w, y + h]``; an annotation without ``bbox`` takes its
  segmentation's box (polygons: min/max; RLE: ``pycocotools.mask.toBbox``).
- ``iscrowd``: skipped by default (``crowd="skip"``), or kept as boxes (``"keep"``); counted either way.
- ``geometry="poly"``: a one-part polygon segmentation (>= 3 points) → ``poly``. Multi-part polygons (an
  instance split by occlusion), polygons with < 3 points and missing ones are imported as the annotation's box
  (never split: one annotation stays one object, so object counts and matching keep COCO's instances). RLE masks
  are imported as their boxes in either geometry (no contour tracing). All of these are counted with their ids.
- the geometry rules of ``trainer.data.formats.common`` (clamp <= ``tolerance`` px, drop degenerate / outside).
- ``width`` / ``height``: the image's *displayed* size (EXIF orientation applied, as training loads it); an
  EXIF-rotated photo the source sizes as stored gets its displayed size when its annotations fit it, and is refused
  when they fit only the stored frame (``trainer.data.formats.common.source_size``).

LVIS is COCO-shaped: images may carry ``coco_url`` instead of ``file_name`` (the image is looked up as
``<split>/<file>`` under the images folder, else ``<file>``); ``not_exhaustive_category_ids``,
``neg_category_ids`` and category ``synonyms`` have no place in the records and are reported, not carried.

Export (``coco_dataset``) writes the records as a COCO ground truth (image ids: the record ids when all are
integers, else 1..N in file order; categories: the sorted descs as ids 1..N, or the ids of a given COCO category
list). ``detection_results`` turns predictions into a COCO results list; ``coco_evaluate`` runs ``COCOeval``.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal, NoReturn
from urllib.parse import urlparse

from trainer.data.formats.common import (
    DEFAULT_TOLERANCE,
    PRECISION,
    HeaderReader,
    ImportedRecord,
    ImportReport,
    PixelObject,
    SourceError,
    fit,
    is_number,
    is_numbers,
    is_positive_int,
    json_lines,
    source_size,
)
from trainer.data.objects import NUM_BINS


@dataclass(frozen=True)
class CocoImportOptions:
    geometry: Literal["bbox", "poly"] = "bbox"
    crowd: Literal["skip", "keep"] = "skip"
    tolerance: float = DEFAULT_TOLERANCE
    names: Literal["raw", "spaces"] = "raw"


def _is_id(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and bool(v))


def _is_rle(seg: Any) -> bool:
    return isinstance(seg, dict)


def validate_coco(data: Any, source: str, lvis: bool = False) -> None:
    """Raise ``SourceError`` naming the first malformed item (``annotations[12] (id 345): ...``)."""

    def fail(item: str, message: str) -> NoReturn:
        raise SourceError(f"{source}: {item}: {message}; fix or remove it")

    if not isinstance(data, dict):
        raise SourceError(f"{source}: the top level must be a JSON object with images, annotations and categories")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise SourceError(f"{source}: '{key}' must be a list (a COCO instances file has images, annotations "
                              f"and categories), got {type(data.get(key)).__name__}")
    cats: set[Any] = set()
    for i, c in enumerate(data["categories"]):
        if not isinstance(c, dict) or not _is_id(c.get("id")):
            fail(f"categories[{i}]", "must be an object with an integer id and a name")
        if c["id"] in cats:
            fail(f"categories[{i}] (id {c['id']})", "duplicate category id")
        if not isinstance(c.get("name"), str) or not c["name"].strip():
            fail(f"categories[{i}] (id {c['id']})", f"name must be a non-empty string, got {c.get('name')!r}")
        cats.add(c["id"])
    images: set[Any] = set()
    for i, img in enumerate(data["images"]):
        if not isinstance(img, dict) or not _is_id(img.get("id")):
            fail(f"images[{i}]", "must be an object with an integer id, width, height and file_name")
        item = f"images[{i}] (id {img['id']})"
        if img["id"] in images:
            fail(item, "duplicate image id")
        for key in ("width", "height"):
            if not is_positive_int(img.get(key)):
                fail(item, f"{key} must be a positive integer, got {img.get(key)!r}")
        name = img.get("file_name", img.get("coco_url") if lvis else None)
        if not isinstance(name, str) or not name:
            fail(item, "file_name must be a non-empty string" + (" (or coco_url)" if lvis else ""))
        images.add(img["id"])
    anns: set[Any] = set()
    for i, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict) or not _is_id(ann.get("id")):
            fail(f"annotations[{i}]", "must be an object with an integer id, image_id, category_id and bbox")
        item = f"annotations[{i}] (id {ann['id']})"
        if ann["id"] in anns:
            fail(item, "duplicate annotation id")
        anns.add(ann["id"])
        if ann.get("image_id") not in images:
            fail(item, f"image_id {ann.get('image_id')!r} is not in images")
        if ann.get("category_id") not in cats:
            fail(item, f"category_id {ann.get('category_id')!r} is not in categories")
        if ann.get("iscrowd", 0) not in (0, 1):
            fail(item, f"iscrowd must be 0 or 1, got {ann.get('iscrowd')!r}")
        if "bbox" in ann and not is_numbers(ann["bbox"], 4):
            fail(item, f"bbox must be 4 numbers [x, y, w, h], got {ann['bbox']!r}")
        seg = ann.get("segmentation")
        if _is_rle(seg):
            counts, size = seg.get("counts"), seg.get("size")
            if not (isinstance(counts, str) or is_numbers(counts)) or not (
                    isinstance(size, list) and len(size) == 2 and all(is_positive_int(v) for v in size)):
                fail(item, "segmentation RLE must have counts (a string or a list of integers) and size [h, w]")
        elif seg is not None and not (isinstance(seg, list) and all(
                is_numbers(p) and p and len(p) % 2 == 0 for p in seg)):
            fail(item, "segmentation must be a list of polygons [x1, y1, x2, y2, ...] (even counts) or an RLE "
                       "object {counts, size}")
        if "bbox" not in ann and not seg:
            fail(item, "needs a bbox [x, y, w, h] or a segmentation")


def coco_index(data: Mapping[str, Any]) -> Any:
    """A ``pycocotools`` ``COCO`` over an already loaded (and validated) dataset."""
    from pycocotools.coco import COCO

    with contextlib.redirect_stdout(io.StringIO()):
        index = COCO()
        index.dataset = dict(data)
        index.createIndex()
    return index


def segmentation_box(seg: Any) -> tuple[float, float, float, float]:
    """``(x1, y1, x2, y2)`` of a polygon list or an RLE mask (``pycocotools.mask.toBbox``)."""
    if _is_rle(seg):
        from pycocotools import mask

        rle = mask.frPyObjects(seg, *seg["size"]) if isinstance(seg["counts"], list) else seg
        x, y, w, h = (float(v) for v in mask.toBbox(rle))
        return x, y, x + w, y + h
    xs = [v for part in seg for v in part[0::2]]
    ys = [v for part in seg for v in part[1::2]]
    return min(xs), min(ys), max(xs), max(ys)


def annotation_box(ann: Mapping[str, Any]) -> tuple[float, float, float, float]:
    if "bbox" in ann:
        x, y, w, h = ann["bbox"]
        return x, y, x + w, y + h
    return segmentation_box(ann["segmentation"])


def annotation_object(ann: Mapping[str, Any], desc: str, width: int, height: int, options: CocoImportOptions,
                      report: ImportReport) -> PixelObject | None:
    """One annotation as an object, or ``None`` (skipped crowd, degenerate, outside); counted in ``report``."""
    aid = str(ann["id"])
    seg = ann.get("segmentation")
    tag: list[str] | None = None
    if ann.get("iscrowd", 0):
        if options.crowd == "skip":
            report.crowd_skipped.append(aid)
            return None
        tag = report.crowd_kept
    elif _is_rle(seg):
        tag = report.rle_as_box
    elif options.geometry == "poly":
        if seg and len(seg) == 1 and len(seg[0]) >= 6:
            fitted = fit("poly", seg[0], width, height, options.tolerance)
            return PixelObject(desc, "poly", fitted.coords) if report.keep(fitted, aid) else None
        tag = report.poly_as_box
    fitted = fit("bbox_2d", annotation_box(ann), width, height, options.tolerance)
    if not report.keep(fitted, aid):
        return None
    if tag is not None:
        tag.append(aid)
    return PixelObject(desc, "bbox_2d", fitted.coords)


def display_name(name: str, names: str) -> str:
    return " ".join(name.replace("_", " ").split()) if names == "spaces" else name.strip()


def image_path(img: Mapping[str, Any], images_dir: Path) -> Path:
    """``file_name`` under ``images_dir``; for LVIS (``coco_url`` only) ``<split>/<file>``, else ``<file>``."""
    if "file_name" in img:
        return images_dir / img["file_name"]
    parts = PurePosixPath(urlparse(img["coco_url"]).path).parts[-2:]
    nested, flat = images_dir.joinpath(*parts), images_dir / parts[-1]
    return flat if not nested.is_file() and flat.is_file() else nested


def coco_notes(data: Mapping[str, Any], names: Mapping[Any, str], options: CocoImportOptions, lvis: bool) -> list[str]:
    """What the import does not carry, or changes, that the summary should say."""
    notes = []
    raw = {c["id"]: c["name"] for c in data["categories"]}
    if options.names == "spaces" and any(names[k] != raw[k].strip() for k in raw):
        example = next(f"{raw[k]} → {names[k]}" for k in raw if names[k] != raw[k].strip())
        notes.append(f"category names: '_' → ' ' (e.g. {example}); --names raw keeps them")
    by_name: dict[str, list[Any]] = {}
    for k, n in names.items():
        by_name.setdefault(n, []).append(k)
    shared = {n: ids for n, ids in by_name.items() if len(ids) > 1}
    if shared:
        notes.append(f"categories sharing a name (their objects get the same desc): {shared}")
    if lvis:
        partial = sum(bool(img.get("not_exhaustive_category_ids")) for img in data["images"])
        notes.append(f"LVIS: {partial} images list not_exhaustive_category_ids; unannotated instances of those "
                     "categories will count as false positives in training and eval")
        notes.append("LVIS: neg_category_ids and category synonyms are not carried (the records have no field "
                     "for them); desc is the category name")
    return notes


def coco_records(data: Any, source: str, images_dir: Path, options: CocoImportOptions, report: ImportReport,
                 lvis: bool = False, headers: HeaderReader | None = None) -> Iterator[ImportedRecord]:
    """Validate ``data`` (a loaded COCO/LVIS instances file), then yield one record per image. ``headers``: reads
    each image file's header (``None`` for a missing one) to size the record as displayed (``source_size``; a
    refused image is left out and listed in ``report.stored_pixels``); ``None``: the source's sizes, files unread."""
    validate_coco(data, source, lvis)
    index = coco_index(data)
    names = {cid: display_name(c["name"], options.names) for cid, c in index.cats.items()}
    report.notes.extend(coco_notes(data, names, options, lvis))
    for img in data["images"]:
        anns = index.imgToAnns[img["id"]]
        path = image_path(img, images_dir)
        size = (img["width"], img["height"]) if headers is None else source_size(
            str(img["id"]), path, img["width"], img["height"],
            lambda anns=anns: [(str(a["id"]), annotation_box(a)) for a in anns], headers(path), options.tolerance,
            report)
        if size is None:
            continue
        objects = tuple(o for o in (annotation_object(a, names[a["category_id"]], *size, options, report)
                                    for a in anns) if o is not None)
        yield ImportedRecord(str(img["id"]), path, *size, objects, emptied=bool(anns) and not objects)


@dataclass(frozen=True)
class CocoExport:
    dataset: dict[str, Any]
    image_ids: dict[str, int]  # record id → COCO image id
    category_ids: dict[str, int]  # desc → COCO category id


def polygon_area(coords: Sequence[float]) -> float:
    xs, ys = coords[0::2], coords[1::2]
    return abs(sum(xs[i] * ys[i - 1] - xs[i - 1] * ys[i] for i in range(len(xs)))) / 2


def given_categories(data: Any, source: str) -> list[dict[str, Any]]:
    """The ``categories`` list of a COCO/LVIS file (for ``coco_dataset``), validated."""
    cats = data.get("categories") if isinstance(data, dict) else None
    if not isinstance(cats, list) or not cats:
        raise SourceError(f"{source}: needs a non-empty 'categories' list of {{id, name}} (a COCO instances file)")
    for i, c in enumerate(cats):
        if not isinstance(c, dict) or not _is_id(c.get("id")) or not isinstance(c.get("name"), str):
            raise SourceError(f"{source}: categories[{i}] must be an object with an integer id and a name")
    return cats


def export_categories(descs: Iterable[str], given: Sequence[Mapping[str, Any]] | None = None,
                      given_source: str = "--categories") -> tuple[list[dict[str, Any]], dict[str, int]]:
    """COCO categories and ``desc → id``: the sorted descs as 1..N, or the ``given`` list's ids, matched by name
    (or by name with ``_`` as spaces, as the LVIS import writes them)."""
    descs = sorted(set(descs))
    if given is None:
        return [{"id": i, "name": d} for i, d in enumerate(descs, start=1)], {d: i for i, d in
                                                                            enumerate(descs, start=1)}
    by_name: dict[str, int] = {}
    for c in given:
        by_name.setdefault(display_name(c["name"], "spaces"), c["id"])
        by_name.setdefault(c["name"], c["id"])
    missing = [d for d in descs if d not in by_name]
    if missing:
        raise SourceError(f"{given_source}: no category named {missing[:10]}"
                          f"{f' (and {len(missing) - 10} more)' if len(missing) > 10 else ''}; add them, or leave "
                          "out --categories to number the descs 1..N")
    return [dict(c) for c in given], {d: by_name[d] for d in descs}


def coco_box(x1: float, y1: float, x2: float, y2: float) -> list[float]:
    return [round(x1, PRECISION), round(y1, PRECISION), round(x2 - x1, PRECISION), round(y2 - y1, PRECISION)]


def coco_dataset(records: Sequence[ImportedRecord], categories: Sequence[Mapping[str, Any]] | None = None,
                 categories_source: str = "--categories") -> CocoExport:
    """The records as a COCO ground truth (``file_name``: the record's image path as written in the JSONL)."""
    rids = [r.record_id for r in records]
    numeric = all(r.isdigit() and str(int(r)) == r for r in rids)
    image_ids = {rid: int(rid) if numeric else i for i, rid in enumerate(rids, start=1)}
    cats, cat_ids = export_categories((o.desc for r in records for o in r.objects), categories, categories_source)
    images, anns = [], []
    for r in records:
        images.append({"id": image_ids[r.record_id], "file_name": r.image.as_posix(), "width": r.width,
                       "height": r.height, "record_id": r.record_id})
        for o in r.objects:
            bbox = coco_box(*o.bounds())
            ann = {"id": len(anns) + 1, "image_id": image_ids[r.record_id], "category_id": cat_ids[o.desc],
                   "bbox": bbox, "area": round(bbox[2] * bbox[3], PRECISION), "iscrowd": 0}
            if o.kind == "poly":
                ann["segmentation"] = [list(o.coords)]
                ann["area"] = round(polygon_area(o.coords), PRECISION)
            anns.append(ann)
    return CocoExport({"images": images, "annotations": anns, "categories": cats}, image_ids, cat_ids)


def bins_to_pixels(bounds: Sequence[int], width: int, height: int) -> tuple[float, float, float, float]:
    """A norm1000 box (bins ``x1..x2`` inclusive, as ``trainer.evaluation.metrics.coco_box`` counts them) → the
    pixel box its bins cover: ``[x1 / 1000 * W, (x2 + 1) / 1000 * W)``."""
    x1, y1, x2, y2 = bounds
    return (x1 * width / NUM_BINS, y1 * height / NUM_BINS, (x2 + 1) * width / NUM_BINS,
            (y2 + 1) * height / NUM_BINS)


@dataclass
class PredictionReport:
    rows: int = 0
    detections: int = 0
    rows_in_bins: int = 0
    unknown_desc: dict[str, int] = field(default_factory=dict)
    without_row: int = 0

    def summary(self) -> str:
        lines = [f"prediction rows: {self.rows} ({self.rows_in_bins} eval samples.jsonl rows in norm1000 bins, "
                 f"{self.rows - self.rows_in_bins} pixel records); detections: {self.detections}; ground-truth "
                 f"records without a prediction row: {self.without_row}"]
        if self.unknown_desc:
            top = ", ".join(f"{d!r} x{n}" for d, n in sorted(self.unknown_desc.items(), key=lambda x: -x[1])[:10])
            lines.append(f"detections whose desc is no ground-truth category (left out of the results; counted in "
                         f"the class-agnostic AP): {sum(self.unknown_desc.values())} ({top})")
        return "\n".join(lines)


def _prediction_box(o: Any, where: str, in_bins: bool) -> tuple[str, tuple[float, ...], float]:
    if not isinstance(o, dict) or not isinstance(o.get("desc"), str) or not o["desc"].strip():
        raise SourceError(f"{where}: must be an object with a non-empty desc and bbox_2d or poly")
    if ("bbox_2d" in o) == ("poly" in o):
        raise SourceError(f"{where}: needs exactly one of bbox_2d or poly")
    coords = o.get("bbox_2d", o.get("poly"))
    count = 4 if "bbox_2d" in o else None
    if not is_numbers(coords, count) or len(coords) < 4 or len(coords) % 2 or (
            in_bins and not all(isinstance(v, int) and 0 <= v < NUM_BINS for v in coords)):
        kind = "bins (integers 0..999)" if in_bins else "pixel numbers"
        raise SourceError(f"{where}: {'bbox_2d' if count else 'poly'} must be {count or 'an even count of'} {kind}, "
                          f"got {coords!r}")
    score = o.get("score", 1.0)
    if not is_number(score):
        raise SourceError(f"{where}: score must be a number, got {score!r}")
    xs, ys = coords[0::2], coords[1::2]
    return o["desc"].strip(), (min(xs), min(ys), max(xs), max(ys)), float(score)


def detection_results(lines: Iterable[str], source: str, export: CocoExport,
                      records: Mapping[str, ImportedRecord]) -> tuple[list[dict], list[dict], PredictionReport]:
    """COCO results from predictions: eval ``samples.jsonl`` rows (``sample_id``, ``prediction`` in norm1000
    bins → ``bins_to_pixels``) or pixel records (``id``, ``objects``; optional per-object ``score``, default
    1.0). Returns the results whose desc is a category, the class-agnostic results (every detection, under some
    valid category id) and a report. A poly counts as its box (COCO box AP, as ``trainer eval``)."""
    report = PredictionReport()
    results: list[dict] = []
    agnostic: list[dict] = []
    fallback = min(export.category_ids.values(), default=1)
    seen: set[str] = set()
    for _, where, raw in json_lines(lines, source, SourceError):
        if isinstance(raw, dict) and isinstance(raw.get("prediction"), list) and "sample_id" in raw:
            in_bins, rid, objs, key = True, str(raw["sample_id"]), raw["prediction"], "prediction"
        elif isinstance(raw, dict) and isinstance(raw.get("objects"), list) and "id" in raw:
            in_bins, rid, objs, key = False, str(raw["id"]), raw["objects"], "objects"
        else:
            raise SourceError(f"{where}: expected an eval samples.jsonl row (sample_id, prediction) or a record "
                              "(id, objects)")
        if rid not in records:
            raise SourceError(f"{where}: id {rid!r} is not in the ground-truth file; predictions must come from "
                              "the same split")
        if rid in seen:
            raise SourceError(f"{where}: a second prediction row for id {rid!r}")
        seen.add(rid)
        rec = records[rid]
        report.rows += 1
        report.rows_in_bins += in_bins
        for j, o in enumerate(objs):
            desc, bounds, score = _prediction_box(o, f"{where}: {key}[{j}]", in_bins)
            box = bins_to_pixels(bounds, rec.width, rec.height) if in_bins else bounds
            det = {"image_id": export.image_ids[rid], "bbox": coco_box(*box), "score": score}
            cid = export.category_ids.get(desc)
            if cid is None:
                report.unknown_desc[desc] = report.unknown_desc.get(desc, 0) + 1
            else:
                results.append({**det, "category_id": cid})
            agnostic.append({**det, "category_id": fallback if cid is None else cid})
            report.detections += 1
    report.without_row = len(records) - len(seen)
    return results, agnostic, report


def coco_evaluate(dataset: Mapping[str, Any], results: Sequence[Mapping[str, Any]], use_cats: bool = True) -> list[float]:
    """``pycocotools`` ``COCOeval`` (iouType ``bbox``) of non-empty ``results`` against a COCO ground truth: its 12
    stats (AP, AP50, AP75, AP small/medium/large, AR1, AR10, AR100, AR small/medium/large; -1 where undefined).
    ``use_cats=False`` ignores categories (class-agnostic)."""
    from pycocotools.cocoeval import COCOeval

    if not results:
        raise ValueError("no detection results to evaluate")
    ground = coco_index({**dataset, "annotations": [dict(a) for a in dataset.get("annotations", [])]})
    with contextlib.redirect_stdout(io.StringIO()):
        detected = ground.loadRes([dict(r) for r in results])
        ev = COCOeval(ground, detected, "bbox")
        ev.params.useCats = int(use_cats)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return [float(v) for v in ev.stats]
