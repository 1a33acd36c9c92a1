"""JSONL detection records → validated ``Sample``s; every error names ``file:line`` and the field.

Record (one JSON object per line; coordinates in pixels of the image):
``{"id": "s1", "images": ["img/1.png"], "width": 640, "height": 480,
   "objects": [{"desc": "red square", "bbox_2d": [x1, y1, x2, y2]}, {"desc": "...", "poly": [x1, y1, ...]}],
   "scene": "optional text rendering of the image, used by text-only models"}``
``image`` (a single string) is accepted as a synonym of ``images``. An empty ``objects`` list is a valid
negative sample; a missing one is an error. Boxes must lie inside the image (x2 > x1, y2 > y1).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.data.objects import DetObject, to_bin

log = logging.getLogger(__name__)

KNOWN_KEYS = {"id", "images", "image", "width", "height", "objects", "scene"}


class DatasetError(ValueError):
    """A bad dataset record; the message starts with ``file:line``."""


@dataclass(frozen=True)
class Sample:
    sample_id: str
    images: tuple[str, ...]
    width: int
    height: int
    objects: tuple[DetObject, ...]
    scene: str | None = None


def _number_list(where: str, key: str, value: Any) -> list[float]:
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise DatasetError(f"{where}: {key} must be a list of numbers, got {value!r}")
    return [float(v) for v in value]


def _parse_object(where: str, i: int, raw: Any, width: int, height: int) -> DetObject:
    at = f"{where}: objects[{i}]"
    if not isinstance(raw, dict):
        raise DatasetError(f"{at} must be an object with desc and bbox_2d or poly, got {type(raw).__name__}")
    extra = set(raw) - {"desc", "bbox_2d", "poly"}
    if extra:
        raise DatasetError(f"{at}: unknown keys {sorted(extra)}; allowed: desc, bbox_2d, poly")
    desc = raw.get("desc")
    if not isinstance(desc, str) or not desc.strip():
        raise DatasetError(f"{at}.desc must be a non-empty string, got {desc!r}")
    if ("bbox_2d" in raw) == ("poly" in raw):
        raise DatasetError(f"{at}: needs exactly one of bbox_2d or poly")
    kind = "bbox_2d" if "bbox_2d" in raw else "poly"
    vals = _number_list(at, kind, raw[kind])
    if kind == "bbox_2d":
        if len(vals) != 4:
            raise DatasetError(f"{at}.bbox_2d needs 4 numbers [x1, y1, x2, y2], got {len(vals)}")
        x1, y1, x2, y2 = vals
        if not (x2 > x1 and y2 > y1):
            raise DatasetError(f"{at}.bbox_2d {vals} is degenerate: need x2 > x1 and y2 > y1")
    elif len(vals) < 6 or len(vals) % 2:
        raise DatasetError(f"{at}.poly needs an even count >= 6 of numbers, got {len(vals)}")
    xs, ys = vals[0::2], vals[1::2]
    if min(xs) < 0 or min(ys) < 0 or max(xs) > width or max(ys) > height:
        raise DatasetError(f"{at}.{kind} {vals} lies outside the {width}x{height} image; fix or drop the object")
    coords = tuple(to_bin(v, width if j % 2 == 0 else height) for j, v in enumerate(vals))
    return DetObject(desc=desc.strip(), kind=kind, coords=coords)


def parse_record(raw: Any, where: str, base_dir: Path | None, check_images: bool = True) -> Sample:
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: each line must be a JSON object, got {type(raw).__name__}")
    extra = set(raw) - KNOWN_KEYS
    if extra:
        raise DatasetError(f"{where}: unknown keys {sorted(extra)}; allowed: {sorted(KNOWN_KEYS)}")
    sample_id = raw.get("id", where)
    if not isinstance(sample_id, (str, int)):
        raise DatasetError(f"{where}: id must be a string or integer")
    images = raw.get("images", raw.get("image", []))
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise DatasetError(f"{where}: images must be a list of non-empty path strings, got {images!r}")
    resolved = []
    for p in images:
        path = Path(p) if base_dir is None or Path(p).is_absolute() else base_dir / p
        if check_images and not path.is_file():
            raise DatasetError(f"{where}: image not found: {path}")
        resolved.append(str(path))
    for key in ("width", "height"):
        v = raw.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise DatasetError(f"{where}: {key} must be a positive integer, got {v!r}")
    if "objects" not in raw:
        raise DatasetError(f"{where}: missing 'objects' (use [] for an image without objects)")
    objs = raw["objects"]
    if not isinstance(objs, list):
        raise DatasetError(f"{where}: objects must be a list, got {type(objs).__name__}")
    objects = tuple(_parse_object(where, i, o, raw["width"], raw["height"]) for i, o in enumerate(objs))
    scene = raw.get("scene")
    if scene is not None and not isinstance(scene, str):
        raise DatasetError(f"{where}: scene must be a string")
    return Sample(str(sample_id), tuple(resolved), raw["width"], raw["height"], objects, scene)


@dataclass
class LoadReport:
    """What loading did: kept samples, dropped lines (``file:line: reason``), negatives (no objects)."""

    kept: int = 0
    negatives: int = 0
    dropped: list[str] = field(default_factory=list)


def load_jsonl(path: str | Path, image_root: str | Path | None = None, check_images: bool = True,
               on_bad_record: str = "error", report: LoadReport | None = None) -> list[Sample]:
    """Load and validate every line. Blank lines are ignored; duplicate ids are bad records (ids key the ledger).

    ``on_bad_record="error"`` (default): every bad line is collected and one ``DatasetError`` lists them all
    (``file:line: reason``). ``"drop"``: bad lines are dropped, each logged and recorded in ``report.dropped``.
    """
    if on_bad_record not in ("error", "drop"):
        raise ValueError(f"on_bad_record must be 'error' or 'drop', got {on_bad_record!r}")
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    base = Path(image_root) if image_root else path.parent
    report = report if report is not None else LoadReport()
    samples: list[Sample] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                sample = parse_record(raw, where, base, check_images)
                if sample.sample_id in seen:
                    raise DatasetError(
                        f"{where}: duplicate id {sample.sample_id!r} (first at line {seen[sample.sample_id]})")
            except DatasetError as exc:
                report.dropped.append(str(exc))
                if on_bad_record == "drop":
                    log.warning("dropping bad record %s", exc)
                continue
            seen[sample.sample_id] = lineno
            samples.append(sample)
            report.negatives += not sample.objects
    report.kept = len(samples)
    if report.dropped and on_bad_record == "error":
        shown = "\n  ".join(report.dropped[:20])
        more = f"\n  … and {len(report.dropped) - 20} more" if len(report.dropped) > 20 else ""
        raise DatasetError(f"{shown}{more}\n{len(report.dropped)} bad record(s) in {path}; fix them or set "
                           "data.on_bad_record: drop to skip them (each drop is logged and counted)"
                           if len(report.dropped) > 1 else shown)
    if not samples:
        raise DatasetError(f"{path}: no valid records")
    return samples
