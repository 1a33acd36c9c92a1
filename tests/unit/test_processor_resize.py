"""Coordinates survive the Qwen-VL image processor's resize: norm1000 bins are fractions of the displayed image,
and the processor (``smart_resize`` to multiples of patch x merge within min/max pixels, then a full-image
stretch) keeps every fraction, so a box drawn on the original lies on the same fraction of the processed grid
(within a patch). Checked on the real processor class (PIL backend, explicit sizes, no hub), un-patchifying its
``pixel_values`` back into an image; the aspect-ratio limit it enforces is the one ``data check`` reports."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from trainer.data.check import check_lines
from trainer.data.images import load_image
from trainer.data.objects import from_bin, to_bin
from trainer.data.records import MAX_ASPECT_RATIO, load_jsonl
from trainer.modeling.fixtures import build_tiny_image_processor

RED = (230, 20, 20)
QWEN3_VL = dict(patch_size=16, merge_size=2, temporal_patch_size=2)  # Qwen3-VL's patching
QWEN2_5_VL = dict(patch_size=14, merge_size=2, temporal_patch_size=2)


def processor(patching: dict, min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(**patching, size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def unpatchify(proc, pixel_values: np.ndarray, grid_thw) -> np.ndarray:
    """``pixel_values`` of one image back to an (H, W, 3) float image in [0, 1] (normalisation undone)."""
    _, gh, gw = (int(v) for v in grid_thw)
    ps, m, t = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    x = np.asarray(pixel_values).reshape(gh // m, gw // m, m, m, 3, t, ps, ps)[:, :, :, :, :, 0]
    x = x.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * ps, gw * ps)
    mean, std = np.asarray(proc.image_mean).reshape(3, 1, 1), np.asarray(proc.image_std).reshape(3, 1, 1)
    return (x * std + mean).transpose(1, 2, 0)


def red_fraction_box(img: np.ndarray) -> tuple[float, float, float, float]:
    """The red region's box as fractions of the image (pixel edges)."""
    mask = (img[..., 0] > 0.6) & (img[..., 1] < 0.4) & (img[..., 2] < 0.4)
    ys, xs = np.nonzero(mask)
    h, w = mask.shape
    return xs.min() / w, ys.min() / h, (xs.max() + 1) / w, (ys.max() + 1) / h


def painted(w: int, h: int, box: tuple[int, int, int, int]) -> Image.Image:
    img = Image.new("RGB", (w, h), (255, 255, 255))
    img.paste(RED, box)
    return img


@pytest.mark.parametrize("patching", [QWEN3_VL, QWEN2_5_VL], ids=["qwen3-vl", "qwen2.5-vl"])
@pytest.mark.parametrize("size, min_pixels, max_pixels", [
    ((333, 517), 64 * 64, 256 * 256),    # odd sides, downscaled
    ((517, 333), 128 * 128, 1024 * 1024),  # odd sides, within the bounds: rounded to multiples only
    ((61, 29), 256 * 256, 512 * 512),    # tiny, upscaled
    ((3999, 20), 64 * 64, 256 * 256),    # 200:1, the most the processor accepts
    ((1, 100), 32 * 32, 128 * 128),      # one pixel tall
])
def test_box_keeps_its_fraction_through_the_processor(patching, size, min_pixels, max_pixels):
    w, h = size
    box = (w * 3 // 10, h * 2 // 10, max(w * 3 // 10 + 1, w * 7 // 10), max(h * 2 // 10 + 1, h * 9 // 10))
    proc = processor(patching, min_pixels, max_pixels)
    out = proc(images=[painted(w, h, box)], return_tensors="np")
    grid = out["image_grid_thw"][0]
    factor = proc.patch_size * proc.merge_size
    rh, rw = smart_resize(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    assert (int(grid[1]) * proc.patch_size, int(grid[2]) * proc.patch_size) == (rh, rw)
    found = red_fraction_box(unpatchify(proc, out["pixel_values"], grid))
    bins = [to_bin(v, w if j % 2 == 0 else h) for j, v in enumerate(box)]
    tol = [proc.patch_size / rw, proc.patch_size / rh] * 2  # one patch of the processed grid
    for j, (k, got) in enumerate(zip(bins, found)):
        side = rw if j % 2 == 0 else rh
        expected = from_bin(k, side) / side  # the bin centre as a fraction: where a prediction of bin k lands
        assert abs(got - expected) <= tol[j] + 1 / 1000, (j, got, expected, tol[j])


def test_the_tiny_model_processor_keeps_boxes_too():
    proc = build_tiny_image_processor()
    w, h, box = 333, 517, (100, 103, 233, 465)
    out = proc(images=[painted(w, h, box)], return_tensors="np")
    found = red_fraction_box(unpatchify(proc, out["pixel_values"], out["image_grid_thw"][0]))
    expected = [box[0] / w, box[1] / h, box[2] / w, box[3] / h]
    assert np.allclose(found, expected, atol=proc.patch_size / min(out["image_grid_thw"][0][1:] * proc.patch_size))


def test_exif_rotated_photo_boxes_land_on_the_displayed_pixels(tmp_path):
    """A camera JPEG stored sideways with orientation 6: the record (displayed size and coordinates) and the
    processed pixels agree after ``load_image``; without the orientation they would not."""
    displayed = painted(300, 400, (30, 250, 120, 380))
    stored = displayed.transpose(Image.Transpose.ROTATE_90)  # what the sensor wrote; orientation 6 turns it back
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(tmp_path / "photo.jpg", exif=exif, quality=95)
    record = {"id": "p", "images": ["photo.jpg"], "width": 300, "height": 400,
              "objects": [{"desc": "red", "bbox_2d": [30, 250, 120, 380]}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(record) + "\n")
    (sample,) = load_jsonl(tmp_path / "d.jsonl")
    proc = build_tiny_image_processor()
    image = load_image(sample.images[0])
    assert image.size == (300, 400)
    out = proc(images=[image], return_tensors="np")
    found = red_fraction_box(unpatchify(proc, out["pixel_values"], out["image_grid_thw"][0]))
    x1, y1, x2, y2 = sample.objects[0].coords
    assert np.allclose(found, [x1 / 1000, y1 / 1000, (x2 + 1) / 1000, (y2 + 1) / 1000], atol=16 / 160 + 0.01)
    raw = proc(images=[Image.open(tmp_path / "photo.jpg").convert("RGB")], return_tensors="np")
    assert tuple(raw["image_grid_thw"][0]) != tuple(out["image_grid_thw"][0]), "stored pixels are sideways"


def test_aspect_ratio_limit_is_the_processors_and_data_check_reports_it(tmp_path):
    proc = processor(QWEN3_VL, 32 * 32, 256 * 256)
    proc(images=[Image.new("RGB", (MAX_ASPECT_RATIO * 20, 20))], return_tensors="np")  # 200:1 accepted
    with pytest.raises(ValueError, match="aspect ratio"):
        proc(images=[Image.new("RGB", (MAX_ASPECT_RATIO * 20 + 1, 20))], return_tensors="np")
    Image.new("RGB", (4001, 20)).save(tmp_path / "strip.png")
    Image.new("RGB", (4000, 20)).save(tmp_path / "ok.png")
    lines = [{"id": "ok", "images": ["ok.png"], "width": 4000, "height": 20, "objects": []},
             {"id": "strip", "images": ["strip.png"], "width": 4001, "height": 20, "objects": []}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    report = check_lines(tmp_path / "d.jsonl", tmp_path)
    assert report.counts == {"aspect_ratio": 1}
    (problem,) = report.examples["aspect_ratio"]
    assert problem.where == f"{tmp_path / 'd.jsonl'}:2" and "refuses more than 200:1" in problem.message
