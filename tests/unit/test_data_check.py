"""``data check``: every problem of a records file in one pass (counts by kind, ``file:line`` examples, exit status),
``--fix-geometry``, the loader refusing what the check reports with the same message, and images as cameras write
them (EXIF orientation, colour modes) converted the way training sees them."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image, ImageOps

from trainer.cli import main
from trainer.data.check import check_lines, fix_record, format_report
from trainer.data.images import ImageHeader, ImageRefError, load_image, read_header
from trainer.data.records import DatasetError, LoadReport, index_jsonl, load_jsonl


def exif_rotated(path: Path, stored: tuple[int, int], orientation: int = 6) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.new("RGB", stored, (200, 30, 30)).save(path, exif=exif)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_orientation_after_image_data(path: Path, stored: tuple[int, int], orientation: int, xmp: bool = False) -> None:
    """An RGB PNG written chunk by chunk, its orientation after IDAT (an eXIf chunk, or XMP in an iTXt chunk);
    black with one red pixel at the stored top-right corner."""
    w, h = stored
    pixels = np.zeros((h, w, 3), dtype=np.uint8)
    pixels[0, w - 1] = (255, 0, 0)
    if xmp:
        text = f'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="{orientation}"/></x:xmpmeta>'
        tail = png_chunk(b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + text.encode())
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        tail = png_chunk(b"eXIf", exif.tobytes()[len(b"Exif\x00\x00"):])  # eXIf holds the TIFF block
    path.write_bytes(b"\x89PNG\r\n\x1a\n"
                     + png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + png_chunk(b"IDAT", zlib.compress(b"".join(b"\x00" + row.tobytes() for row in pixels)))
                     + tail + png_chunk(b"IEND", b""))


def write_images(root: Path) -> None:
    Image.new("RGB", (100, 50)).save(root / "a.png")
    exif_rotated(root / "rot.jpg", (40, 30))  # stored 40x30, displayed 30x40
    Image.new("RGBA", (100, 50)).save(root / "rgba.png")
    Image.new("L", (100, 50)).save(root / "grey.png")
    Image.new("CMYK", (100, 50)).save(root / "cmyk.jpg")
    Image.new("P", (100, 50)).save(root / "pal.png")
    Image.fromarray(np.full((50, 100), 40000, dtype=np.uint16)).save(root / "g16.png")
    Image.new("F", (100, 50)).save(root / "float.tif")


def rec(rid: str, image: str, w: int = 100, h: int = 50, objects: list | None = None) -> str:
    objs = [{"desc": "cat", "bbox_2d": [5, 5, 20, 20]}] if objects is None else objects
    return json.dumps({"id": rid, "images": [image], "width": w, "height": h, "objects": objs})


LINES = [
    rec("good", "a.png"),                                              # 1
    rec("rot-stored", "rot.jpg", 40, 30, [{"desc": "cat", "bbox_2d": [1, 2, 25, 28]}]),  # 2 stored size: swap
    rec("rot-displayed", "rot.jpg", 30, 40),                           # 3 warning only
    rec("half", "a.png", 50, 25),                                      # 4 scaled x2: rescale
    rec("other-aspect", "a.png", 80, 50),                              # 5 refused by --fix-geometry
    rec("rgba", "rgba.png"),                                           # 6
    rec("grey", "grey.png"),                                           # 7
    "",                                                                # 8 blank
    rec("cmyk", "cmyk.jpg"),                                           # 9
    rec("pal", "pal.png"),                                             # 10
    rec("g16", "g16.png"),                                             # 11
    rec("float", "float.tif"),                                         # 12 mode F: error
    rec("missing", "missing.png"),                                     # 13
    rec("bad-box", "a.png", objects=[{"desc": "cat", "bbox_2d": [30, 5, 20, 20]},
                                     {"desc": "dog", "bbox_2d": [5, 5, 120, 20]},
                                     {"desc": "tri", "poly": [1, 2, 3, 4, 5]}]),  # 14: three problems
    rec("good", "a.png"),                                              # 15 duplicate id
    rec("no-desc", "a.png", objects=[{"desc": " ", "bbox_2d": [5, 5, 20, 20]}]),  # 16
    "{not json",                                                       # 17
]

EXPECTED_COUNTS = {
    "size_mismatch": 3, "exif_orientation": 1, "colour_mode_unsupported": 1, "image_missing": 1,
    "degenerate_box": 1, "out_of_bounds": 1, "poly_count": 1, "duplicate_id": 1, "empty_desc": 1, "invalid_json": 1,
    "colour_mode:RGBA": 1, "colour_mode:L": 1, "colour_mode:CMYK": 1, "colour_mode:P": 1, "colour_mode:I;16": 1,
}


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    write_images(tmp_path)
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    return path


def test_every_problem_counted_in_one_pass_with_file_and_line(dataset):
    report = check_lines(dataset, dataset.parent, max_examples=2)
    assert report.counts == EXPECTED_COUNTS
    assert report.records == 16 and report.valid == 7  # 1, 3, 6, 7, 9, 10, 11 (15 is a valid duplicate)
    assert (report.total("error"), report.total("warning"), report.total("info")) == (11, 1, 5)
    assert [p.where for p in report.examples["size_mismatch"]] == [f"{dataset}:2", f"{dataset}:4"], "first two"
    stored, scaled = (p.message for p in report.examples["size_mismatch"])
    assert "40x30 are the stored size of an image with EXIF orientation 6" in stored and "30x40" in stored
    assert "declares 50x25 but the image is 100x50 (scaled x2)" in scaled and "--fix-geometry" in scaled
    assert str(report.examples["duplicate_id"][0]) == f"{dataset}:15: duplicate id 'good' (first at line 1)"
    assert report.examples["colour_mode_unsupported"][0].where == f"{dataset}:12"
    assert report.examples["image_missing"][0].message == f"image not found: {dataset.parent / 'missing.png'}"
    assert report.examples["exif_orientation"][0].severity == "warning"
    assert all(p.where == f"{dataset}:14" for k in ("degenerate_box", "out_of_bounds", "poly_count")
               for p in report.examples[k])


def test_cli_exit_status_and_report(dataset, capsys):
    assert main(["data", "check", str(dataset), "--max-examples", "1"]) == 1
    out = capsys.readouterr().out
    assert "16 records, 7 without errors; 11 errors, 1 warnings, 5 notes" in out
    assert "  size_mismatch: 3 (" in out and "… and 2 more" in out
    assert f"    {dataset}:17: not valid JSON" in out
    assert "colour_mode:I;16: 1" in out and "16-bit grey scaled to 8 bits" in out
    clean = dataset.with_name("clean.jsonl")
    clean.write_text("\n".join(LINES[i] for i in (0, 2, 5, 6, 8, 9, 10)) + "\n")  # warnings and notes only
    assert main(["data", "check", str(clean)]) == 0
    assert "no errors: training keeps every record" in capsys.readouterr().out
    assert main(["data", "check", str(dataset.with_name("nope.jsonl"))]) == 2


def test_fix_geometry_swaps_rescales_and_refuses_per_record(dataset, capsys):
    out = dataset.with_name("fixed.jsonl")
    assert main(["data", "check", str(dataset), "--fix-geometry", str(out)]) == 1, "other errors remain"
    printed = capsys.readouterr().out
    assert f"{dataset}:2: width/height 40x30 → 30x40" in printed and "coordinates kept" in printed
    assert f"{dataset}:4: width/height 50x25 → 100x50" in printed and "coordinates scaled by 2 (x) and 2 (y)" in printed
    assert f"{dataset}:5: refused: the record declares 80x50 but the image is 100x50, another aspect ratio" in printed
    assert "2 records fixed (1 EXIF-rotated sizes swapped, 1 rescaled), 1 refused" in printed
    src, fixed = dataset.read_text().splitlines(), out.read_text().splitlines()
    assert len(fixed) == len(src) and fixed[7] == "" and fixed[16] == "{not json", "line for line"
    assert json.loads(fixed[1])["width"] == 30 and json.loads(fixed[1])["height"] == 40
    assert json.loads(fixed[1])["objects"] == json.loads(src[1])["objects"]
    half = json.loads(fixed[3])
    assert (half["width"], half["height"], half["objects"][0]["bbox_2d"]) == (100, 50, [10, 10, 40, 40])
    assert fixed[4] == src[4] and fixed[0] == src[0]
    assert check_lines(out, out.parent).counts.get("size_mismatch") == 1, "only the refused record is left"


def test_fix_geometry_alone_gives_a_clean_file(tmp_path, capsys):
    write_images(tmp_path)
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join([LINES[0], LINES[1], LINES[3]]) + "\n")
    assert main(["data", "check", str(src), "--fix-geometry", str(tmp_path / "out.jsonl")]) == 0
    assert "out.jsonl: 3 records, no errors" in capsys.readouterr().out
    assert [s.width for s in load_jsonl(tmp_path / "out.jsonl")] == [100, 30, 100]


def test_fix_geometry_refuses_rotated_boxes_drawn_on_the_stored_pixels():
    header = ImageHeader(40, 30, "RGB", 6)
    raw = {"id": "x", "images": ["r.jpg"], "width": 40, "height": 30,
           "objects": [{"desc": "cat", "bbox_2d": [2, 2, 38, 10]}]}  # x up to 38 > displayed width 30
    fix = fix_record(raw, "f:7", (header,))
    assert fix.action == "refused" and fix.record is None and "objects [0] lie outside the displayed 30x40" in str(fix)
    assert fix_record({**raw, "width": 30, "height": 40}, "f:7", (header,)) is None, "nothing to fix"


@pytest.mark.parametrize("loader", [load_jsonl, index_jsonl])
def test_training_load_refuses_a_size_mismatch_with_the_check_message(dataset, loader):
    path = dataset.with_name("one.jsonl")
    path.write_text(LINES[0] + "\n" + LINES[3] + "\n")
    (problem,) = check_lines(path, path.parent).examples["size_mismatch"]
    with pytest.raises(DatasetError) as exc:
        loader(path)
    assert str(exc.value).startswith(f"{problem}; fix it (`python -m trainer data check {path}` lists every problem)")
    assert str(problem).startswith(f"{path}:2: images[0] ") and "\n" not in str(exc.value)


def test_training_run_loads_through_the_index_with_the_same_errors(dataset, tmp_path):
    from trainer.sft.run import load_samples

    data = SimpleNamespace(synthetic=None, train_jsonl=str(dataset), image_root=None, on_bad_record="error")
    cfg = SimpleNamespace(data=data, training=SimpleNamespace(output_dir=str(tmp_path / "run")))
    with pytest.raises(DatasetError) as exc:
        load_samples(cfg)
    check = check_lines(dataset, dataset.parent)
    assert str(exc.value).startswith("9 bad records, the first: ") and "\n" not in str(exc.value)
    assert str(check.examples["size_mismatch"][0]) in str(exc.value)
    data.on_bad_record = "drop"
    samples = load_samples(cfg)
    assert [s.sample_id for s in samples] == ["good", "rot-displayed", "rgba", "grey", "cmyk", "pal", "g16"]
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["kept"] == 7 and len(report["dropped"]) == 9
    assert f"{dataset}:15: duplicate id 'good' (first at line 1)" in report["dropped"]
    assert report["notes"] == {"exif_orientation": 1, "colour_mode:RGBA": 1, "colour_mode:L": 1,
                               "colour_mode:CMYK": 1, "colour_mode:P": 1, "colour_mode:I;16": 1}


def test_check_keeps_what_training_keeps_duplicates_among_valid_records_notes_of_kept_ones(tmp_path):
    Image.new("RGB", (100, 50)).save(tmp_path / "a.png")
    Image.new("L", (100, 50)).save(tmp_path / "grey.png")
    Image.new("RGBA", (100, 50)).save(tmp_path / "rgba.png")
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([
        rec("x", "a.png", objects=[{"desc": "cat", "bbox_2d": [5, 5, 120, 20]}]),  # 1 error: not the first 'x'
        rec("x", "a.png"),  # 2 kept
        rec("y", "grey.png"),  # 3 kept, note colour_mode:L
        rec("y", "rgba.png"),  # 4 duplicate of 3: dropped, its colour_mode:RGBA is no note of training's
        rec("x", "missing.png"),  # 5 error: no duplicate either
    ]) + "\n")
    check = check_lines(path, tmp_path)
    report = LoadReport()
    kept = index_jsonl(path, on_bad_record="drop", report=report)
    assert [s.sample_id for s in kept] == ["x", "y"] and check.valid == report.kept == 2
    assert check.counts["duplicate_id"] == 1
    assert str(check.examples["duplicate_id"][0]) == f"{path}:4: duplicate id 'y' (first at line 3)"
    assert "keeps 2 of 5 records" in format_report(check)
    assert report.notes == {"colour_mode:L": 1}, "notes of kept records only"
    assert report.dropped_ids == ["x", "y", "x"] and report.dropped[1].startswith(f"{path}:4: duplicate id")
    eager = LoadReport()
    assert load_jsonl(path, on_bad_record="drop", report=eager) == list(kept) and eager == report


def test_header_is_read_without_decoding_and_orientation_swaps_the_size(tmp_path):
    exif_rotated(tmp_path / "r.jpg", (40, 30), 6)
    exif_rotated(tmp_path / "flip.jpg", (40, 30), 3)
    h = read_header(tmp_path / "r.jpg")
    assert (h.stored_width, h.stored_height, h.orientation, h.size, h.mode) == (40, 30, 6, (30, 40), "RGB")
    assert read_header(tmp_path / "flip.jpg").size == (40, 30), "180° keeps the size"
    assert load_image(str(tmp_path / "r.jpg")).size == (30, 40), "pixels are turned upright on load"
    (tmp_path / "junk.png").write_bytes(b"not an image")
    with pytest.raises(ImageRefError, match="cannot be read as an image"):
        read_header(tmp_path / "junk.png")


@pytest.mark.parametrize("xmp", [False, True], ids=["eXIf", "XMP"])
def test_png_orientation_after_the_image_data_is_read_as_the_loader_applies_it(tmp_path, xmp):
    path = tmp_path / "late.png"
    png_orientation_after_image_data(path, (40, 30), 6, xmp)
    with Image.open(path) as im:
        assert Image.Image.getexif(im).get(0x0112) is None, "the orientation is not in the header"
    header = read_header(path)
    assert (header.stored_width, header.stored_height, header.orientation, header.size) == (40, 30, 6, (30, 40))
    img = load_image(str(path))
    assert img.size == header.size
    assert img.getpixel((29, 39)) == (255, 0, 0), "stored top-right, turned 90° clockwise: bottom-right"
    with Image.open(path) as im:
        assert ImageOps.exif_transpose(im).tobytes() == img.tobytes(), "as PIL shows it once decoded"
    records = tmp_path / "d.jsonl"
    records.write_text(rec("shown", "late.png", 30, 40) + "\n" + rec("stored", "late.png", 40, 30) + "\n")
    check = check_lines(records, tmp_path)
    assert check.counts == {"exif_orientation": 1, "size_mismatch": 1}
    assert check.examples["size_mismatch"][0].where == f"{records}:2"
    assert [s.sample_id for s in load_jsonl(records, on_bad_record="drop")] == ["shown"]


def test_colour_modes_become_rgb_properly(tmp_path):
    rgba = Image.new("RGBA", (4, 2), (0, 0, 0, 0))
    rgba.putpixel((0, 0), (10, 200, 30, 255))
    rgba.save(tmp_path / "rgba.png")
    img = load_image(str(tmp_path / "rgba.png"))
    assert img.mode == "RGB" and img.getpixel((1, 1)) == (255, 255, 255) and img.getpixel((0, 0)) == (10, 200, 30)
    Image.fromarray(np.array([[0, 32768, 65535]], dtype=np.uint16)).save(tmp_path / "g16.png")
    assert [load_image(str(tmp_path / "g16.png")).getpixel((x, 0)) for x in range(3)] == [
        (0, 0, 0), (128, 128, 128), (255, 255, 255)], "scaled, not clipped at 255"
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 0, 0, 255])
    pal.putpixel((1, 0), 1)
    pal.save(tmp_path / "pal.png", transparency=0)
    assert list(load_image(str(tmp_path / "pal.png")).getdata()) == [(255, 255, 255), (0, 0, 255)]
    Image.new("CMYK", (2, 2), (0, 255, 255, 0)).save(tmp_path / "c.jpg", quality=100)
    r, g, b = load_image(str(tmp_path / "c.jpg")).getpixel((0, 0))
    assert r > 200 and g < 50 and b < 50
    Image.new("LA", (2, 2), (90, 0)).save(tmp_path / "la.png")
    assert load_image(str(tmp_path / "la.png")).getpixel((0, 0)) == (255, 255, 255)
    Image.new("F", (2, 2)).save(tmp_path / "f.tif")
    with pytest.raises(ImageRefError, match="colour mode F cannot be converted to RGB"):
        load_image(str(tmp_path / "f.tif"))
