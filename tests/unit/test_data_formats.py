"""``data import`` (COCO / LVIS / ODVG → records) and ``data export`` (records → COCO, predictions → COCO results)
on fixtures written here: tiny PNGs and hand-made annotation files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.cli import main
from trainer.data.formats.coco import bins_to_pixels, coco_evaluate
from trainer.data.formats.common import Fitted, fit
from trainer.data.records import load_jsonl

ROOT = Path(__file__).resolve().parents[2]


def png(path: Path, width: int, height: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), (90, 120, 200)).save(path)


def rle_counts(height: int, width: int, rows: slice, cols: slice) -> str:
    from pycocotools import mask

    m = np.zeros((height, width), dtype=np.uint8, order="F")
    m[rows, cols] = 1
    return mask.encode(m)["counts"].decode()


def coco_fixture(root: Path) -> tuple[Path, Path]:
    """Four images (one without annotations, one whose annotations are all skipped or dropped) and annotations
    covering every rule; returns (json, images dir)."""
    images = root / "images"
    for name, (w, h) in {"a.png": (100, 80), "sub/b.png": (64, 48), "c.png": (50, 50), "d.png": (40, 40)}.items():
        png(images / name, w, h)
    data = {
        "images": [{"id": 1, "file_name": "a.png", "width": 100, "height": 80},
                   {"id": 2, "file_name": "sub/b.png", "width": 64, "height": 48},
                   {"id": 3, "file_name": "c.png", "width": 50, "height": 50},
                   {"id": 4, "file_name": "d.png", "width": 40, "height": 40}],
        "categories": [{"id": 1, "name": "cat"}, {"id": 7, "name": "teddy bear"}],
        "annotations": [
            {"id": 101, "image_id": 1, "category_id": 1, "bbox": [10, 20, 30, 40], "iscrowd": 0,
             "segmentation": [[10, 20, 40, 20, 40, 60, 10, 60]]},
            {"id": 102, "image_id": 1, "category_id": 7, "bbox": [50.5, 10.25, 20, 30], "iscrowd": 0,
             "segmentation": [[50.5, 10.25, 60, 10.25, 60, 20], [61, 30, 70.5, 30, 70.5, 40.25]]},
            {"id": 103, "image_id": 1, "category_id": 1, "bbox": [0, 0, 100, 80], "iscrowd": 1,
             "segmentation": {"counts": rle_counts(80, 100, slice(0, 80), slice(0, 100)), "size": [80, 100]}},
            {"id": 104, "image_id": 1, "category_id": 1, "iscrowd": 0,  # no bbox: RLE's box via pycocotools
             "segmentation": {"counts": rle_counts(80, 100, slice(5, 15), slice(60, 80)), "size": [80, 100]}},
            {"id": 105, "image_id": 2, "category_id": 7, "bbox": [40.5, 10, 24, 20]},  # 0.5 px past the right edge
            {"id": 106, "image_id": 2, "category_id": 1, "bbox": [5, 5, 0, 10]},  # zero width
            {"id": 107, "image_id": 2, "category_id": 1, "bbox": [30, 30, 50, 10]},  # 16 px past the right edge
            {"id": 108, "image_id": 4, "category_id": 1, "bbox": [0, 0, 40, 30], "iscrowd": 1},  # image 4: a crowd
            {"id": 109, "image_id": 4, "category_id": 7, "bbox": [35, 5, 20, 10]},  # and one 15 px outside
        ],
    }
    path = root / "instances.json"
    path.write_text(json.dumps(data))
    return path, images


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def import_(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["data", "import", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_coco_import_boxes_with_every_rule_counted(tmp_path, capsys):
    src, images = coco_fixture(tmp_path / "coco")
    out = tmp_path / "data" / "train.jsonl"
    rc, printed, _ = import_(capsys, "--from", "coco", str(src), "--images", str(images), "--out", str(out))
    assert rc == 0
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == ["1", "2", "3"]
    assert rows[0]["images"] == ["../coco/images/a.png"] and rows[1]["images"] == ["../coco/images/sub/b.png"]
    assert rows[0]["objects"] == [{"desc": "cat", "bbox_2d": [10.0, 20.0, 40.0, 60.0]},
                                  {"desc": "teddy bear", "bbox_2d": [50.5, 10.25, 70.5, 40.25]},
                                  {"desc": "cat", "bbox_2d": [60.0, 5.0, 80.0, 15.0]}]
    assert rows[1]["objects"] == [{"desc": "teddy bear", "bbox_2d": [40.5, 10.0, 64.0, 30.0]}]
    assert rows[2]["objects"] == [] and (rows[2]["width"], rows[2]["height"]) == (50, 50)
    for line in ("records written: 3", "objects: 4", "images without annotations (kept, objects: []): 1 (3)",
                 "images emptied by filtering (every annotation skipped or dropped), not written "
                 "(--keep-emptied-as-negatives writes them): 1 (4)",
                 "crowd annotations skipped (--crowd keep keeps them as boxes): 2 (103, 108)",
                 "crowd annotations kept as boxes: 0", "RLE masks imported as their boxes: 1 (104)",
                 "clamped into the image (<= 1 px outside): 1 (105)",
                 "dropped, degenerate (width or height <= 0): 1 (106)",
                 "dropped, more than 1 px outside the image: 2 (107, 109)", "missing image files: 0"):
        assert f"  {line}\n" in printed, (line, printed)
    samples = load_jsonl(out)  # the records loader resolves the images against the file's folder
    assert [len(s.objects) for s in samples] == [3, 1, 0]
    assert Path(samples[1].images[0]).resolve() == (images / "sub" / "b.png").resolve()


def test_coco_import_polygons_and_kept_crowd(tmp_path, capsys):
    src, images = coco_fixture(tmp_path)
    out = tmp_path / "poly.jsonl"
    rc, printed, _ = import_(capsys, "--from", "coco", str(src), "--images", str(images), "--out", str(out),
                             "--geometry", "poly", "--crowd", "keep", "--paths", "absolute")
    assert rc == 0
    first = read_jsonl(out)[0]
    assert first["images"] == [str((images / "a.png").resolve())]
    assert first["objects"] == [
        {"desc": "cat", "poly": [10.0, 20.0, 40.0, 20.0, 40.0, 60.0, 10.0, 60.0]},
        {"desc": "teddy bear", "bbox_2d": [50.5, 10.25, 70.5, 40.25]},  # two-part polygon: its box
        {"desc": "cat", "bbox_2d": [0.0, 0.0, 100.0, 80.0]},  # crowd kept
        {"desc": "cat", "bbox_2d": [60.0, 5.0, 80.0, 15.0]},  # RLE: its box
    ]
    assert "crowd annotations kept as boxes: 2 (103, 108)" in printed
    assert read_jsonl(out)[3]["objects"] == [{"desc": "cat", "bbox_2d": [0.0, 0.0, 40.0, 30.0]}], "not emptied"
    assert "polygons imported as boxes (multi-part, < 3 points or none; --geometry poly): 2 (102, 105)" in printed


def test_images_emptied_by_filtering_are_left_out_unless_kept_as_negatives(tmp_path, capsys):
    src, images = coco_fixture(tmp_path)
    out = tmp_path / "kept.jsonl"
    rc, printed, _ = import_(capsys, "--from", "coco", str(src), "--images", str(images), "--out", str(out),
                             "--keep-emptied-as-negatives")
    assert rc == 0
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == ["1", "2", "3", "4"] and rows[3]["objects"] == []
    assert "images without annotations (kept, objects: []): 1 (3)\n" in printed, "counted apart"
    assert ("images emptied by filtering, written as negatives (objects: []; they teach that nothing is there): "
            "1 (4)\n") in printed
    assert "written as negatives (objects: []; they teach that nothing is there): 0\n" not in printed

    img = tmp_path / "img"
    png(img / "x.png", 60, 40)
    odvg = tmp_path / "o.odvg.jsonl"
    odvg.write_text("\n".join(json.dumps(line) for line in [
        {"filename": "x.png", "height": 40, "width": 60, "detection": {"instances": [
            {"bbox": [70, 0, 90, 10], "category": "person"}]}},  # outside: the line is emptied
        {"filename": "x.png", "height": 40, "width": 60, "detection": {"instances": []}},
    ]) + "\n")
    rc, printed, _ = import_(capsys, "--from", "odvg", str(odvg), "--images", str(img), "--out", str(out))
    assert rc == 0 and [r["id"] for r in read_jsonl(out)] == ["x.png#2"]
    assert "images without annotations (kept, objects: []): 1 (x.png#2)\n" in printed
    assert "not written (--keep-emptied-as-negatives writes them): 1 (x.png)\n" in printed


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d["annotations"][1].update(bbox=[1, 2]), "annotations[1] (id 102): bbox must be 4 numbers"),
    (lambda d: d["annotations"][4].update(image_id=99), "annotations[4] (id 105): image_id 99 is not in images"),
    (lambda d: d["annotations"][0].update(category_id=5), "annotations[0] (id 101): category_id 5 is not in"),
    (lambda d: d["annotations"][2].update(id=101), "annotations[2] (id 101): duplicate annotation id"),
    (lambda d: d["annotations"][0].update(segmentation=[[1, 2, 3]]), "annotations[0] (id 101): segmentation"),
    (lambda d: d["images"][1].pop("height"), "images[1] (id 2): height must be a positive integer"),
    (lambda d: d["categories"][1].update(name=""), "categories[1] (id 7): name must be a non-empty string"),
    (lambda d: d.pop("annotations"), "'annotations' must be a list"),
])
def test_malformed_coco_names_the_item_and_writes_nothing(tmp_path, capsys, mutate, fragment):
    src, images = coco_fixture(tmp_path)
    data = json.loads(src.read_text())
    mutate(data)
    src.write_text(json.dumps(data))
    out = tmp_path / "out.jsonl"
    rc, _, err = import_(capsys, "--from", "coco", str(src), "--images", str(images), "--out", str(out))
    assert rc == 2 and fragment in err, err
    assert not out.exists() and not out.with_name("out.jsonl.tmp").exists()


def test_missing_images_error_by_default_then_drop(tmp_path, capsys):
    src, images = coco_fixture(tmp_path)
    (images / "c.png").unlink()
    out = tmp_path / "out.jsonl"
    rc, _, err = import_(capsys, "--from", "coco", str(src), "--images", str(images), "--out", str(out))
    assert rc == 2 and "1 image files not found" in err and "c.png" in err and not out.exists()
    rc, printed, _ = import_(capsys, "--from", "coco", str(src), "--images", str(images), "--out", str(out),
                             "--missing-images", "drop")
    assert rc == 0 and [r["id"] for r in read_jsonl(out)] == ["1", "2"] and "missing image files: 1" in printed


def test_lvis_urls_names_and_notes(tmp_path, capsys):
    images = tmp_path / "coco"
    png(images / "val2017" / "000000000001.png", 40, 30)
    png(images / "000000000002.png", 40, 30)  # not under its split folder: found directly under --images
    data = {
        "images": [{"id": 1, "width": 40, "height": 30, "coco_url": "http://x/val2017/000000000001.png",
                    "not_exhaustive_category_ids": [3], "neg_category_ids": [4]},
                   {"id": 2, "width": 40, "height": 30, "coco_url": "http://x/train2017/000000000002.png",
                    "not_exhaustive_category_ids": [], "neg_category_ids": []}],
        "categories": [{"id": 3, "name": "teddy_bear", "synonyms": ["teddy_bear"]},
                       {"id": 4, "name": "bow_(weapon)", "synonyms": ["bow"]}],
        "annotations": [{"id": 9, "image_id": 1, "category_id": 3, "bbox": [1, 2, 3, 4],
                         "segmentation": [[1, 2, 4, 2, 4, 6]]},
                        {"id": 10, "image_id": 2, "category_id": 4, "bbox": [5, 5, 10, 10],
                         "segmentation": [[5, 5, 15, 5, 15, 15]]}],
    }
    src = tmp_path / "lvis_val.json"
    src.write_text(json.dumps(data))
    out = tmp_path / "lvis.jsonl"
    rc, printed, _ = import_(capsys, "--from", "lvis", str(src), "--images", str(images), "--out", str(out))
    assert rc == 0
    rows = read_jsonl(out)
    assert [r["images"][0] for r in rows] == ["coco/val2017/000000000001.png", "coco/000000000002.png"]
    assert [r["objects"][0]["desc"] for r in rows] == ["teddy bear", "bow (weapon)"]
    assert "teddy_bear → teddy bear" in printed and "1 images list not_exhaustive_category_ids" in printed
    rc, _, _ = import_(capsys, "--from", "lvis", str(src), "--images", str(images), "--out", str(out),
                       "--names", "raw")
    assert rc == 0 and read_jsonl(out)[1]["objects"][0]["desc"] == "bow_(weapon)"


def odvg_fixture(root: Path) -> Path:
    for name in ("x.png", "y.png"):
        png(root / "img" / name, 60, 40)
    lines = [
        {"filename": "x.png", "height": 40, "width": 60, "detection": {"instances": [
            {"bbox": [1, 2, 11, 12], "label": 0, "category": "person"},
            {"bbox": [20, 5, 30, 15], "label": 2},  # no category: the label map names it
            {"bbox": [30, 5, 30, 15], "label": 0, "category": "person"}]}},  # zero width
        {"filename": "y.png", "height": 40, "width": 60, "grounding": {"caption": "two dogs near a tree", "regions": [
            {"bbox": [[0, 0, 10, 10], [10, 10, 20, 20.5]], "phrase": "two dogs", "tokens_positive": [[0, 8]]},
            {"bbox": [30, 0, 60.4, 40], "phrase": "a tree", "tokens_positive": [[14, 20]]}]}},
        {"filename": "y.png", "height": 40, "width": 60, "grounding": {"caption": "nothing", "regions": []}},
    ]
    path = root / "train.odvg.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_odvg_detection_and_grounding(tmp_path, capsys):
    src = odvg_fixture(tmp_path)
    label_map = tmp_path / "label_map.json"
    label_map.write_text(json.dumps({"0": "person", "2": "car"}))
    out = tmp_path / "odvg.jsonl"
    rc, printed, _ = import_(capsys, "--from", "odvg", str(src), "--images", str(tmp_path / "img"), "--out",
                             str(out), "--label-map", str(label_map))
    assert rc == 0
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == ["x.png", "y.png", "y.png#2"]
    assert rows[0]["objects"] == [{"desc": "person", "bbox_2d": [1.0, 2.0, 11.0, 12.0]},
                                  {"desc": "car", "bbox_2d": [20.0, 5.0, 30.0, 15.0]}]
    assert rows[1]["objects"] == [{"desc": "two dogs", "bbox_2d": [0.0, 0.0, 10.0, 10.0]},
                                  {"desc": "two dogs", "bbox_2d": [10.0, 10.0, 20.0, 20.5]},
                                  {"desc": "a tree", "bbox_2d": [30.0, 0.0, 60.0, 40.0]}]
    assert rows[2]["objects"] == []
    assert "dropped, degenerate (width or height <= 0): 1 (line 1 instances[2])" in printed
    assert "clamped into the image (<= 1 px outside): 1 (line 2 regions[1])" in printed
    assert "1 lines repeat an earlier filename" in printed and "2 grounding captions are not carried" in printed
    assert len(load_jsonl(out)) == 3

    rc, _, err = import_(capsys, "--from", "odvg", str(src), "--images", str(tmp_path / "img"), "--out", str(out))
    assert rc == 2 and f"{src}:1: detection.instances[1]: no category name and label 2 has no name" in err
    assert "--label-map" in err


def test_coco_export_round_trips_through_import(tmp_path, capsys):
    src, images = coco_fixture(tmp_path / "coco")
    first = tmp_path / "data" / "first.jsonl"
    assert import_(capsys, "--from", "coco", str(src), "--images", str(images), "--out", str(first),
                   "--geometry", "poly")[0] == 0
    exported = tmp_path / "data" / "coco.json"
    assert main(["data", "export", "--to", "coco", str(first), "--out", str(exported)]) == 0
    coco = json.loads(exported.read_text())
    assert [i["id"] for i in coco["images"]] == [1, 2, 3], "integer record ids stay the COCO image ids"
    assert [c["name"] for c in coco["categories"]] == ["cat", "teddy bear"]
    poly = next(a for a in coco["annotations"] if "segmentation" in a)
    assert poly["bbox"] == [10.0, 20.0, 30.0, 40.0] and poly["area"] == 1200.0
    again = tmp_path / "data" / "again.jsonl"
    assert import_(capsys, "--from", "coco", str(exported), "--images", str(first.parent), "--out", str(again),
                   "--geometry", "poly")[0] == 0
    a, b = read_jsonl(first), read_jsonl(again)
    assert [r["id"] for r in a] == [r["id"] for r in b] and [r["images"] for r in a] == [r["images"] for r in b]
    for ra, rb in zip(a, b):
        assert [o["desc"] for o in ra["objects"]] == [o["desc"] for o in rb["objects"]]
        for oa, ob in zip(ra["objects"], rb["objects"]):
            assert set(oa) == set(ob)
            kind = "poly" if "poly" in oa else "bbox_2d"
            assert oa[kind] == pytest.approx(ob[kind], abs=0.011)

    # categories from the source file keep its ids (7 for teddy bear)
    assert main(["data", "export", "--to", "coco", str(first), "--out", str(exported), "--categories", str(src)]) == 0
    coco = json.loads(exported.read_text())
    assert {a["category_id"] for a in coco["annotations"]} == {1, 7}


def test_ground_truth_as_predictions_scores_ap_one(tmp_path, capsys):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    src, images = coco_fixture(tmp_path)
    records = tmp_path / "gt.jsonl"
    assert import_(capsys, "--from", "coco", str(src), "--images", str(images), "--out", str(records))[0] == 0
    gt, res = tmp_path / "coco.json", tmp_path / "res.json"
    assert main(["data", "export", "--to", "coco", str(records), "--out", str(gt), "--predictions", str(records),
                 "--results", str(res), "--evaluate"]) == 0
    printed = capsys.readouterr().out
    assert "by category:    AP 1.000  AP50 1.000  AP75 1.000" in printed
    ground = COCO(str(gt))
    ev = COCOeval(ground, ground.loadRes(str(res)), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    assert ev.stats[0] == pytest.approx(1.0)
    assert all(r["score"] == 1.0 for r in json.loads(res.read_text()))

    rows = read_jsonl(records)
    rows[0]["objects"][0]["bbox_2d"] = [10.0, 20.0, 40.0, 45.0]  # 15 of 40 px short: IoU 0.625
    rows[0]["objects"][1]["desc"] = "zebra"
    shifted = tmp_path / "pred.jsonl"
    shifted.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["data", "export", "--to", "coco", str(records), "--out", str(gt), "--predictions", str(shifted),
                 "--evaluate"]) == 0
    printed = capsys.readouterr().out
    assert "detections whose desc is no ground-truth category" in printed and "'zebra' x1" in printed
    assert "by category:    AP 1.000" not in printed and (tmp_path / "coco_results.json").is_file()


def test_eval_samples_rows_convert_bins_to_pixel_edges(tmp_path):
    from trainer.data.objects import DetObject
    from trainer.evaluation.metrics import SamplePrediction, evaluate_samples, sample_record

    png(tmp_path / "a.png", 200, 100)
    records = tmp_path / "gt.jsonl"
    records.write_text(json.dumps({"id": "img-a", "images": ["a.png"], "width": 200, "height": 100,
                                   "objects": [{"desc": "cat", "bbox_2d": [20, 20, 60, 40]}]}) + "\n")
    gt = (DetObject("cat", "bbox_2d", (100, 200, 299, 399)),)
    pred = SamplePrediction("img-a", gt, gt)
    metrics, evals = evaluate_samples([pred])
    (tmp_path / "samples.jsonl").write_text(json.dumps(sample_record(pred, evals[0])) + "\n")
    assert main(["data", "export", "--to", "coco", str(records), "--out", str(tmp_path / "coco.json"),
                 "--predictions", str(tmp_path / "samples.jsonl")]) == 0
    results = json.loads((tmp_path / "coco_results.json").read_text())
    assert results == [{"image_id": 1, "bbox": [20.0, 20.0, 40.0, 20.0], "score": 1.0, "category_id": 1}]
    assert bins_to_pixels((0, 0, 999, 999), 640, 480) == (0.0, 0.0, 640.0, 480.0)
    assert metrics.coco.ap == pytest.approx(1.0), "trainer eval's AP goes through the same coco_evaluate"


def test_geometry_rules():
    assert fit("bbox_2d", [0, 0, 10, 10], 10, 10).outcome == "ok"
    assert fit("bbox_2d", [-1.0, 0, 11.0, 10], 10, 10) == Fitted((0.0, 0.0, 10.0, 10.0), "clamped")
    assert fit("bbox_2d", [-1.01, 0, 5, 5], 10, 10).outcome == "outside"
    assert fit("bbox_2d", [0, 0, 5, 5], 10, 10, tolerance=0).outcome == "ok"
    assert fit("bbox_2d", [0, 0, 10.5, 5], 10, 10, tolerance=0).outcome == "outside"
    assert fit("bbox_2d", [3, 3, 3.004, 5], 10, 10).outcome == "degenerate", "collapses when rounded to 0.01 px"
    assert fit("bbox_2d", [10.5, 3, 10.8, 5], 10, 10).outcome == "degenerate", "clamped onto the edge"
    assert fit("poly", [1, 1, 5, 1, 9, 1], 10, 10).outcome == "degenerate", "no height"
    assert fit("poly", [1.234, 1, 5, 1, 3, 4.5678], 10, 10).coords == (1.23, 1.0, 5.0, 1.0, 3.0, 4.57)


def test_coco_evaluate_is_class_aware_unless_told():
    dataset = {"images": [{"id": 1, "width": 10, "height": 10}],
               "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5], "area": 25,
                                "iscrowd": 0}],
               "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]}
    wrong_class = [{"image_id": 1, "category_id": 2, "bbox": [0, 0, 5, 5], "score": 1.0}]
    assert coco_evaluate(dataset, wrong_class)[0] == 0.0
    assert coco_evaluate(dataset, wrong_class, use_cats=False)[0] == pytest.approx(1.0)
    assert dataset["annotations"][0] == {"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5],
                                         "area": 25, "iscrowd": 0}, "the caller's dataset is not modified"
    assert wrong_class == [{"image_id": 1, "category_id": 2, "bbox": [0, 0, 5, 5], "score": 1.0}]


def test_cli_subprocess(tmp_path):
    src, images = coco_fixture(tmp_path)
    out = tmp_path / "cli.jsonl"
    proc = subprocess.run([sys.executable, "-m", "trainer", "data", "import", "--from", "coco", str(src), "--images",
                           str(images), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "records written: 3" in proc.stdout and len(read_jsonl(out)) == 3


def test_options_that_do_not_apply_and_foreign_predictions_are_errors(tmp_path, capsys):
    src, images = coco_fixture(tmp_path)
    records = tmp_path / "gt.jsonl"
    odvg = odvg_fixture(tmp_path)
    assert import_(capsys, "--from", "coco", str(src), "--images", str(images), "--out", str(records))[0] == 0
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "999", "objects": []}) + "\n")
    cases = [
        (["import", "--from", "odvg", str(odvg), "--images", str(images), "--out", str(tmp_path / "o.jsonl"),
          "--geometry", "poly"], "--geometry does not apply to ODVG"),
        (["import", "--from", "coco", str(src), "--images", str(images), "--out", str(tmp_path / "o.jsonl"),
          "--label-map", str(src)], "--label-map is for --from odvg"),
        (["import", "--from", "coco", str(records), "--images", str(images), "--out", str(tmp_path / "o.jsonl")],
         "(ODVG: --from odvg)"),
        (["export", "--to", "coco", str(records), "--out", str(tmp_path / "c.json"), "--evaluate"],
         "--evaluate needs --predictions"),
        (["export", "--to", "coco", str(records), "--out", str(tmp_path / "c.json"), "--predictions", str(other)],
         f"{other}:1: id '999' is not in the ground-truth file"),
        (["export", "--to", "coco", str(records), "--out", str(tmp_path / "c.json"), "--categories", str(odvg)],
         "not valid JSON"),
    ]
    for argv, fragment in cases:
        assert main(["data", *argv]) == 2, argv
        assert fragment in capsys.readouterr().err, argv
    assert not (tmp_path / "o.jsonl").exists()
