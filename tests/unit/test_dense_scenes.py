"""Dense synthetic scenes (``SceneStyle``): object counts, sizes, overlap and clutter as configured, reproducible,
and the default scene drawn from the same random draws as before the style existed."""

from __future__ import annotations

import json
import random

import pytest
from PIL import Image

from trainer.config.schema import validate_config
from trainer.data.synthetic import CLUTTER_COLORS, COLORS, SceneStyle, generate, make_record
from trainer.data.synthetic import _covered as covered

DENSE = SceneStyle(min_object_px=18, max_object_px=56, max_overlap=0.25, clutter=12, varied_background=True)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_dense_scenes_hold_what_the_style_asks(tmp_path):
    path = generate(tmp_path, 24, seed=3, min_objects=10, max_objects=40, image_size=320, style=DENSE)
    recs = records(path)
    counts = [len(r["objects"]) for r in recs]
    assert all(n <= 40 for n in counts) and max(counts) >= 25 and min(counts) >= 5
    backgrounds = set()
    for r in recs:
        boxes = [tuple(o["bbox_2d"]) for o in r["objects"]]
        for x1, y1, x2, y2 in boxes:
            assert 18 <= x2 - x1 <= 56 and 18 <= y2 - y1 <= 56 and 0 <= x1 and x2 < 320 and y2 < 320
        for i, a in enumerate(boxes):
            assert all(covered(a, b) <= 0.25 for b in boxes[i + 1:])
        img = Image.open(tmp_path / r["images"][0]).convert("RGB")
        counts = img.getcolors(maxcolors=1 << 16)
        backgrounds.add(max(counts)[1])
        colours = {c for _, c in counts}
        assert colours & set(CLUTTER_COLORS), "clutter strokes are drawn"
        assert {o["desc"].split()[0] for o in r["objects"]} <= set(COLORS)
    assert len(backgrounds) > 3 and not backgrounds & {tuple(c) for c in COLORS.values()}, \
        "backgrounds vary between images"
    again = generate(tmp_path / "again", 24, seed=3, min_objects=10, max_objects=40, image_size=320, style=DENSE)
    assert again.read_bytes() == path.read_bytes()
    assert (tmp_path / "again" / recs[5]["images"][0]).read_bytes() == (tmp_path / recs[5]["images"][0]).read_bytes()


def test_the_default_scene_spends_the_same_draws_as_the_plain_one():
    """The default style draws colour, shape, size and place per object and nothing else: the record after it comes
    from the same generator state as a hand-rolled draw of the same sequence."""
    rng = random.Random(11)
    record, _ = make_record(rng, 0, 64, 3, 0.0)
    mirror = random.Random(11)
    expected = []
    for _ in range(3):
        color = mirror.choice(sorted(COLORS))
        shape = mirror.choice(("square", "circle", "triangle"))
        w = mirror.randint(64 // 8, 64 // 3)
        h = w if shape in ("square", "circle") else mirror.randint(64 // 8, 64 // 3)
        x1, y1 = mirror.randint(0, 64 - w - 1), mirror.randint(0, 64 - h - 1)
        if shape == "triangle":
            mirror.random()
        expected.append((f"{color} {shape}", [x1, y1, x1 + w, y1 + h]))
    got = sorted((o["desc"], o["bbox_2d"]) for o in record["objects"])
    assert got == sorted(expected)
    assert rng.random() == mirror.random()


@pytest.mark.parametrize("synthetic, fragment", [
    ({"image_size": 64, "min_object_px": 40, "max_object_px": 30}, "min_object_px..max_object_px"),
    ({"image_size": 64, "max_object_px": 63}, "< image_size - 1"),
    ({"max_overlap": 1.5}, "max_overlap"),
])
def test_object_sizes_that_cannot_fit_are_refused_at_load(synthetic, fragment):
    with pytest.raises(Exception, match=fragment):
        validate_config({"model": {"tiny": "vl"}, "data": {"synthetic": synthetic},
                         "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}})


def test_the_gpu_demo_config_asks_for_scenes_its_answers_fit():
    """Many objects on a 320 px image, and a token budget that holds the largest scene's answer (about 33 tokens an
    object with the embedded tokenizer), so an answer is cut only when it runs away."""
    from pathlib import Path

    from trainer.config.schema import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo_gpu.yaml")
    s = cfg.data.synthetic
    assert s.min_objects >= 4 and s.max_objects >= 16 and 256 <= s.image_size <= 448
    assert cfg.rollout_matching.decoding.max_new_tokens >= 34 * s.max_objects + 8
    assert s.clutter > 0 and s.max_overlap < 1.0 and s.varied_background and s.eval_num_samples >= 500
    assert cfg.rollout_matching.rollout_backend == "vllm" and cfg.rollout_matching.vllm.mode == "colocate"
