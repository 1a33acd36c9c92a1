"""``data import`` of EXIF-rotated photos (real JPEGs written with an Orientation tag): annotations are taken as
drawn on the displayed image, which is what training loads; a source that sizes such an image as stored is written
with the displayed size when its annotations fit it, and refused (naming the id, the file and what to do; nothing
written) when they fit only the stored frame. ``data check`` then passes the written records."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from tests.unit.test_preflight import fragments_in_order
from trainer.cli import main
from trainer.data.images import load_image
from trainer.data.records import load_jsonl

ROW = "error: 1 EXIF-rotated images annotated on their stored, un-rotated pixels (id 7 (…): …)"
TROUBLESHOOTING = Path(__file__).resolve().parents[2] / "docs" / "guides" / "troubleshooting.md"
STORED = (40, 30)  # the sensor's landscape pixels; orientation 6 displays them as a 30 x 40 portrait


def jpeg(path: Path, size: tuple[int, int], orientation: int | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", size, (200, 60, 40))
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    image.save(path, format="JPEG", exif=exif)
    return path


def coco(tmp_path: Path, images: list[dict], annotations: list[dict]) -> Path:
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": [{"id": 1, "name": "cup"}]}))
    return path


def box(aid: int, image_id: int, x: float, y: float, w: float, h: float) -> dict:
    return {"id": aid, "image_id": image_id, "category_id": 1, "bbox": [x, y, w, h], "iscrowd": 0}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_photo_sized_as_stored_is_written_with_its_displayed_size(tmp_path, capsys):
    images = tmp_path / "images"
    jpeg(images / "phone.jpg", STORED, 6)
    jpeg(images / "plain.jpg", (50, 20), None)
    # the cup stands in the displayed portrait: y up to 38 lies beyond the stored height of 30
    src = coco(tmp_path, [{"id": 1, "file_name": "phone.jpg", "width": 40, "height": 30},
                          {"id": 2, "file_name": "plain.jpg", "width": 50, "height": 20}],
               [box(11, 1, 5, 10, 20, 28), box(12, 2, 1, 1, 10, 10)])
    out = tmp_path / "train.jsonl"
    rc, printed, err = run(capsys, "data", "import", "--from", "coco", str(src), "--images", str(images),
                           "--out", str(out))
    assert rc == 0, err
    phone, plain = rows(out)
    assert (phone["width"], phone["height"]) == (30, 40) and (plain["width"], plain["height"]) == (50, 20)
    assert phone["objects"] == [{"desc": "cup", "bbox_2d": [5.0, 10.0, 25.0, 38.0]}], "not clamped to 40x30"
    assert ("  images with an EXIF orientation (annotations taken as drawn on the displayed image, as training "
            "loads it): 1 (1)\n") in printed
    assert ("  EXIF-rotated images the source sizes as stored, written with their displayed width/height: 1 (1)\n"
            in printed)
    assert "  dropped, more than 1 px outside the image: 0\n" in printed
    assert load_image(str(images / "phone.jpg")).size == (30, 40), "training loads the displayed pixels"
    rc, report, err = run(capsys, "data", "check", str(out))
    assert rc == 0, report + err
    assert [(s.width, s.height) for s in load_jsonl(out)] == [(30, 40), (50, 20)]


def test_annotations_drawn_on_the_stored_pixels_are_refused_by_id_and_file(tmp_path, capsys):
    images = tmp_path / "images"
    jpeg(images / "phone.jpg", STORED, 6)
    # x up to 38 fits the stored 40 x 30 frame only: drawn on the un-rotated pixels
    src = coco(tmp_path, [{"id": 7, "file_name": "phone.jpg", "width": 40, "height": 30}],
               [box(71, 7, 2, 2, 36, 8), box(72, 7, 1, 1, 5, 5)])
    out = tmp_path / "train.jsonl"
    rc, printed, err = run(capsys, "data", "import", "--from", "coco", str(src), "--images", str(images),
                           "--out", str(out))
    assert rc == 2 and printed == ""
    (line,) = err.splitlines()
    assert line.startswith("error: 1 EXIF-rotated images annotated on their stored, un-rotated pixels (id 7 (")
    assert (f"{images / 'phone.jpg'}: EXIF orientation 6 (rotated 90° clockwise), stored 40x30, displayed 30x40; "
            "annotations 71 fit only the stored frame)") in line
    assert "remove the orientation tag" in line and "rotate those annotations to the displayed image" in line
    assert not out.exists() and not out.with_name("train.jsonl.tmp").exists()
    assert f"`{ROW}`" in TROUBLESHOOTING.read_text(encoding="utf-8") and fragments_in_order(ROW, line)


def test_a_photo_sized_as_displayed_is_kept_and_counted(tmp_path, capsys):
    images = tmp_path / "images"
    jpeg(images / "phone.jpg", STORED, 8)
    jpeg(images / "upside.jpg", STORED, 3)
    jpeg(images / "scaled.jpg", (50, 20), None)
    src = coco(tmp_path, [{"id": 1, "file_name": "phone.jpg", "width": 30, "height": 40},
                          {"id": 2, "file_name": "upside.jpg", "width": 40, "height": 30},
                          {"id": 3, "file_name": "scaled.jpg", "width": 100, "height": 40}],
               [box(11, 1, 5, 10, 20, 28), box(21, 2, 1, 1, 30, 20), box(31, 3, 10, 10, 60, 20)])
    out = tmp_path / "train.jsonl"
    rc, printed, err = run(capsys, "data", "import", "--from", "coco", str(src), "--images", str(images),
                           "--out", str(out))
    assert rc == 0, err
    assert [(r["width"], r["height"]) for r in rows(out)] == [(30, 40), (40, 30), (100, 40)]
    assert "displayed image, as training loads it): 2 (1, 2)\n" in printed
    assert "written with their displayed width/height: 0\n" in printed
    assert ("  width/height unlike the image file's (data check lists them, --fix-geometry rescales): 1 (3)\n"
            in printed)


def test_odvg_sizes_a_stored_photo_as_displayed_too(tmp_path, capsys):
    images = tmp_path / "images"
    jpeg(images / "phone.jpg", STORED, 6)
    src = tmp_path / "o.odvg.jsonl"
    src.write_text(json.dumps({"filename": "phone.jpg", "width": 40, "height": 30, "detection": {"instances": [
        {"bbox": [5, 10, 25, 38], "category": "cup"}]}}) + "\n")
    out = tmp_path / "train.jsonl"
    rc, printed, err = run(capsys, "data", "import", "--from", "odvg", str(src), "--images", str(images),
                           "--out", str(out))
    assert rc == 0, err
    (row,) = rows(out)
    assert (row["width"], row["height"]) == (30, 40) and row["objects"][0]["bbox_2d"] == [5.0, 10.0, 25.0, 38.0]
    assert "written with their displayed width/height: 1 (phone.jpg)\n" in printed
