"""ODVG JSONL (GroundingDINO / mm-grounding-dino) → ``ImportedRecord``s.

One line per image: ``{"filename", "height", "width"}`` and exactly one of

- ``"detection": {"instances": [{"bbox": [x1, y1, x2, y2], "label": int, "category": str}]}``: ``desc`` is
  ``category``, else the label map's name for ``label`` (the ``label_map_file`` of mmdet: ``{"0": "person"}``);
- ``"grounding": {"caption": str, "regions": [{"bbox": box or [box, ...], "phrase": str}]}``: ``desc`` is the
  phrase, one object per box (a phrase naming several boxes gives several objects with that phrase). The caption
  is not carried (the records have no caption field).

Boxes are pixel ``x1y1x2y2`` on the displayed image (EXIF orientation applied; ``width`` / ``height`` as for COCO,
``trainer.data.formats.common.source_size``) and go through ``trainer.data.formats.common.fit``; a line whose every box is
dropped is ``emptied`` (not written by default). Record ids are the filename; a filename seen again (several
captions of one image) gets ``#2``, ``#3``, … and is reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trainer.data.formats.common import (
    DEFAULT_TOLERANCE,
    HeaderReader,
    ImportedRecord,
    ImportReport,
    PixelObject,
    SourceError,
    fit,
    is_numbers,
    is_positive_int,
    json_lines,
    source_size,
)


def parse_label_map(raw: Any, source: str) -> dict[int, str]:
    """``{"0": "person", ...}`` (or a list, index = label) → ``{0: "person"}``."""
    items = enumerate(raw) if isinstance(raw, list) else raw.items() if isinstance(raw, dict) else None
    if items is None:
        raise SourceError(f"{source}: a label map must be a JSON object {{\"0\": \"person\", ...}} or a list of names")
    out: dict[int, str] = {}
    for k, v in items:
        try:
            label = int(k)
        except (TypeError, ValueError):
            raise SourceError(f"{source}: label {k!r} is not an integer") from None
        if not isinstance(v, str) or not v.strip():
            raise SourceError(f"{source}: label {k!r} must map to a non-empty name, got {v!r}")
        out[label] = v.strip()
    return out


def _boxes(raw: Any) -> list[Any] | None:
    """A region's ``bbox``: one box or a list of boxes → list of boxes (``None``: malformed)."""
    if is_numbers(raw, 4):
        return [raw]
    if isinstance(raw, list) and raw and all(is_numbers(b, 4) for b in raw):
        return list(raw)
    return None


def _detection_objects(det: Any, where: str, tag: str,
                       label_map: Mapping[int, str] | None) -> Iterator[tuple[str, Any, str]]:
    if not isinstance(det, dict) or not isinstance(det.get("instances", []), list):
        raise SourceError(f"{where}: detection must be an object with an 'instances' list")
    for i, inst in enumerate(det.get("instances", [])):
        at = f"{where}: detection.instances[{i}]"
        if not isinstance(inst, dict) or not is_numbers(inst.get("bbox"), 4):
            raise SourceError(f"{at}: bbox must be 4 numbers [x1, y1, x2, y2], got "
                              f"{inst.get('bbox') if isinstance(inst, dict) else inst!r}")
        desc = inst.get("category")
        if not (isinstance(desc, str) and desc.strip()):
            label = inst.get("label")
            label = int(label) if isinstance(label, str) and label.isdigit() else label
            if label_map is None or not isinstance(label, int) or label not in label_map:
                hint = "pass --label-map FILE.json ({\"0\": \"person\", ...})" if label_map is None else \
                    "add it to the --label-map file"
                raise SourceError(f"{at}: no category name and label {label!r} has no name; {hint}")
            desc = label_map[label]
        yield desc.strip(), inst["bbox"], f"{tag} instances[{i}]"


def _grounding_objects(gr: Any, where: str, tag: str) -> Iterator[tuple[str, Any, str]]:
    if not isinstance(gr, dict) or not isinstance(gr.get("regions", []), list):
        raise SourceError(f"{where}: grounding must be an object with a 'regions' list")
    for i, region in enumerate(gr.get("regions", [])):
        at = f"{where}: grounding.regions[{i}]"
        if not isinstance(region, dict) or not isinstance(region.get("phrase"), str) or not region["phrase"].strip():
            raise SourceError(f"{at}: needs a non-empty phrase")
        boxes = _boxes(region.get("bbox"))
        if boxes is None:
            raise SourceError(f"{at}: bbox must be [x1, y1, x2, y2] or a list of such boxes, got "
                              f"{region.get('bbox')!r}")
        for j, box in enumerate(boxes):
            suffix = f"[{j}]" if len(boxes) > 1 else ""
            yield region["phrase"].strip(), box, f"{tag} regions[{i}]{suffix}"


def odvg_records(lines: Iterable[str], source: str, images_dir: Path, report: ImportReport,
                 label_map: Mapping[int, str] | None = None, tolerance: float = DEFAULT_TOLERANCE,
                 headers: HeaderReader | None = None) -> Iterator[ImportedRecord]:
    """One record per non-blank line; ``SourceError`` names ``file:line`` and the item. ``headers``: as for
    ``coco_records`` (each image sized as displayed, ``trainer.data.formats.common.source_size``)."""
    seen: dict[str, int] = {}
    repeats = captions = 0
    for lineno, where, raw in json_lines(lines, source, SourceError):
        if not isinstance(raw, dict) or not isinstance(raw.get("filename"), str) or not raw["filename"]:
            raise SourceError(f"{where}: needs a filename (and height, width, detection or grounding)")
        for key in ("width", "height"):
            if not is_positive_int(raw.get(key)):
                raise SourceError(f"{where}: {key} must be a positive integer, got {raw.get(key)!r}")
        if ("detection" in raw) == ("grounding" in raw):
            raise SourceError(f"{where}: needs exactly one of detection or grounding")
        width, height = raw["width"], raw["height"]
        if "detection" in raw:
            shapes = list(_detection_objects(raw["detection"], where, f"line {lineno}", label_map))
        else:
            shapes = list(_grounding_objects(raw["grounding"], where, f"line {lineno}"))
            captions += bool(raw["grounding"].get("caption"))
        name = raw["filename"]
        seen[name] = seen.get(name, 0) + 1
        repeats += seen[name] > 1
        rid = name if seen[name] == 1 else f"{name}#{seen[name]}"
        path = images_dir / name
        if headers is not None:
            size = source_size(rid, path, width, height, lambda shapes=shapes: [(i, tuple(b)) for _, b, i in shapes],
                               headers(path), tolerance, report)
            if size is None:
                continue
            width, height = size
        objects = []
        for desc, box, item in shapes:
            fitted = fit("bbox_2d", box, width, height, tolerance)
            if report.keep(fitted, item):
                objects.append(PixelObject(desc, "bbox_2d", fitted.coords))
        yield ImportedRecord(rid, path, width, height, tuple(objects), emptied=bool(shapes) and not objects)
    if repeats:
        report.notes.append(f"{repeats} lines repeat an earlier filename (ids get #2, #3, …)")
    if captions:
        report.notes.append(f"{captions} grounding captions are not carried (desc is each region's phrase)")
