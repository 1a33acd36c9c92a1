"""Dataset records (file:line errors), the synthetic generator, and the one output serialiser."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from PIL import Image

from trainer.data.objects import DetObject, from_bin, to_bin
from trainer.data.output_format import serialize_append, serialize_objects
from trainer.data.records import DatasetError, load_jsonl
from trainer.data.synthetic import generate


def write_jsonl(tmp_path: Path, lines: list[str]) -> Path:
    Image.new("RGB", (100, 50)).save(tmp_path / "img.png")
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = {"id": "a", "images": ["img.png"], "width": 100, "height": 50,
        "objects": [{"desc": "cat", "bbox_2d": [10, 5, 60, 40]}]}


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({**GOOD, "images": ["missing.png"]}), "image not found"),
        (json.dumps({**GOOD, "objects": [{"desc": "cat", "bbox_2d": [10, 5, 160, 40]}]}), "outside the 100x50 image"),
        (json.dumps({**GOOD, "objects": [{"desc": "", "bbox_2d": [10, 5, 60, 40]}]}), "objects[0].desc"),
        (json.dumps({**GOOD, "objects": [{"desc": "c", "bbox_2d": [60, 5, 10, 40]}]}), "degenerate"),
        (json.dumps({**GOOD, "objects": [{"desc": "c", "poly": [1, 2, 3, 4]}]}), "poly needs an even count >= 6"),
        (json.dumps({**GOOD, "objects": [{"desc": "c"}]}), "exactly one of bbox_2d or poly"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "objects"}), "missing 'objects'"),
        (json.dumps({**GOOD, "width": 0}), "width must be a positive integer"),
        (json.dumps({**GOOD, "colour": 1}), "unknown keys ['colour']"),
    ],
)
def test_bad_records_report_file_and_line(tmp_path, line, fragment):
    p = write_jsonl(tmp_path, [json.dumps(GOOD | {"id": "first"}), "", line])
    with pytest.raises(DatasetError) as exc:
        load_jsonl(p)
    assert str(exc.value).startswith(f"{p}:3:") and fragment in str(exc.value)


def test_duplicate_ids_rejected(tmp_path):
    p = write_jsonl(tmp_path, [json.dumps(GOOD), json.dumps(GOOD)])
    with pytest.raises(DatasetError, match=r":2: duplicate id 'a' \(first at line 1\)"):
        load_jsonl(p)


def test_pixels_convert_to_norm1000_bins(tmp_path):
    s = load_jsonl(write_jsonl(tmp_path, [json.dumps(GOOD)]))[0]
    assert s.objects[0] == DetObject("cat", "bbox_2d", (100, 100, 600, 800))
    assert to_bin(100, 100) == 999 and to_bin(0, 100) == 0
    assert abs(from_bin(to_bin(37.3, 640), 640) - 37.3) <= 640 / 1000


def test_synthetic_generator_is_deterministic_and_valid(tmp_path):
    a = generate(tmp_path / "a", 12, seed=5, poly_fraction=0.5)
    b = generate(tmp_path / "b", 12, seed=5, poly_fraction=0.5)
    assert a.read_bytes() == b.read_bytes()
    for img in sorted((tmp_path / "a" / "images").iterdir()):
        assert hashlib.sha256(img.read_bytes()).digest() == hashlib.sha256((tmp_path / "b" / "images" / img.name).read_bytes()).digest()
    samples = load_jsonl(a)
    assert len(samples) == 12 and all(s.scene for s in samples)
    assert any(o.kind == "poly" for s in samples for o in s.objects)
    assert generate(tmp_path / "c", 12, seed=6).read_bytes() != a.read_bytes()


def test_serialiser_append_rules():
    objs = [DetObject("a", "bbox_2d", (1, 2, 3, 4))]
    assert serialize_append(objs, 3, "}").startswith(', "object_3"')
    assert serialize_append(objs, 1, "{").startswith('"object_1"')
    assert serialize_append([], 1, "}") == "}"
    with pytest.raises(ValueError, match="not append-ready"):
        serialize_append(objs, 1, "]")
    assert json.loads(serialize_objects([]).replace("<|", "").replace("|>", "")) == {}


def test_all_bad_lines_reported_at_once_or_dropped_and_counted(tmp_path, caplog):
    from trainer.data.records import LoadReport

    lines = [json.dumps(GOOD), "{oops", json.dumps({**GOOD, "id": "b", "width": -1}), json.dumps({**GOOD, "id": "c"}),
             json.dumps({**GOOD, "id": "n", "objects": []})]
    p = write_jsonl(tmp_path, lines)
    with pytest.raises(DatasetError) as exc:
        load_jsonl(p)
    msg = str(exc.value)
    assert msg.startswith(f"2 bad records, the first: {p}:2: not valid JSON") and "\n" not in msg
    assert msg.endswith(f"fix them (`python -m trainer data check {p}` lists every problem) or set "
                        "data.on_bad_record: drop to train on the rest (each drop is logged and counted)")
    report = LoadReport()
    with caplog.at_level("WARNING"):
        samples = load_jsonl(p, on_bad_record="drop", report=report)
    assert [s.sample_id for s in samples] == ["a", "c", "n"]
    assert report.kept == 3 and report.negatives == 1 and len(report.dropped) == 2
    assert sum("dropping bad record" in r.message for r in caplog.records) == 2
