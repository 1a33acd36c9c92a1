"""Deterministic synthetic detection data: images with coloured shapes and their ground truth.

``generate(out_dir, ...)`` writes ``images/*.png`` and ``train.jsonl`` (the same record format users
supply) and returns the JSONL path. Same seed → byte-identical files. Each record also carries ``scene``,
a text rendering of the image (desc + coord tokens) so text-only models can learn the task.

``SceneStyle`` says how a scene looks: the default is the CPU demo's (objects 1/8-1/3 of the side, a plain
background); dense scenes for a GPU detector set the object sizes in pixels, bound the overlap between objects and
draw unannotated clutter on a varied background.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from trainer.data.objects import to_bin
from trainer.data.output_format import coord_token

#: the JSONL ``generate`` writes by default
SYNTHETIC_JSONL = "train.jsonl"
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle", "triangle")
CLUTTER_COLORS = ((150, 150, 150), (170, 140, 110), (120, 130, 140))


@dataclass(frozen=True)
class SceneStyle:
    """How a synthetic scene looks (``COLORS`` x ``SHAPES``). ``min_object_px``/``max_object_px``: an object's side
    in pixels (None: 1/8 and 1/3 of the image); ``max_overlap``: the largest share of either box that the other may
    cover, checked against every earlier object (one that cannot be placed in 20 draws is left out; 1.0: no bound);
    ``clutter``: unannotated grey strokes and dots per image; ``varied_background``: a random light background per
    image. The default draws exactly what the CPU demo always drew, from the same random draws."""

    min_object_px: int | None = None
    max_object_px: int | None = None
    max_overlap: float = 1.0
    clutter: int = 0
    varied_background: bool = False

    def sizes(self, size: int) -> tuple[int, int]:
        lo = self.min_object_px if self.min_object_px is not None else size // 8
        hi = self.max_object_px if self.max_object_px is not None else size // 3
        if not 1 <= lo <= hi < size - 1:
            raise ValueError(f"object sizes {lo}..{hi} px do not fit a {size} px image")
        return lo, hi


def scene_style(cfg) -> SceneStyle:
    """The ``SceneStyle`` of a ``data.synthetic`` config section."""
    return SceneStyle(cfg.min_object_px, cfg.max_object_px, cfg.max_overlap, cfg.clutter,
                      cfg.varied_background)


def _covered(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    """The largest share of either box that the other covers (1.0: one holds the other)."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    return iw * ih / min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))


def _draw_clutter(rng: random.Random, draw: ImageDraw.ImageDraw, size: int, n: int) -> None:
    for _ in range(n):
        color = rng.choice(CLUTTER_COLORS)
        x, y = rng.randint(0, size - 1), rng.randint(0, size - 1)
        if rng.random() < 0.5:
            dx, dy = rng.randint(-size // 4, size // 4), rng.randint(-size // 4, size // 4)
            draw.line([x, y, x + dx, y + dy], fill=color, width=rng.randint(1, 2))
        else:
            r = rng.randint(1, 3)
            draw.ellipse([x - r, y - r, x + r, y + r], fill=color)


def _scene_text(objects: list[dict], size: int) -> str:
    parts = []
    for o in objects:
        kind = "bbox_2d" if "bbox_2d" in o else "poly"
        coords = "".join(coord_token(to_bin(v, size)) for v in o[kind])
        parts.append(f"{o['desc']} {coords}")
    return "; ".join(parts)


def make_record(rng: random.Random, index: int, size: int, n_objects: int, poly_fraction: float,
                style: SceneStyle = SceneStyle()) -> tuple[dict, Image.Image]:
    background = (245, 245, 245)
    if style.varied_background:
        background = tuple(rng.randint(215, 250) for _ in range(3))
    img = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(img)
    lo, hi = style.sizes(size)
    if style.clutter:
        _draw_clutter(rng, draw, size, style.clutter // 2)
    objects: list[dict] = []
    boxes: list[tuple[int, int, int, int]] = []
    for _ in range(n_objects):
        color = rng.choice(sorted(COLORS))
        shape = rng.choice(SHAPES)
        for _attempt in range(20 if style.max_overlap < 1.0 else 1):
            w = rng.randint(lo, hi)
            h = w if shape in ("square", "circle") else rng.randint(lo, hi)
            x1 = rng.randint(0, size - w - 1)
            y1 = rng.randint(0, size - h - 1)
            box = (x1, y1, x1 + w, y1 + h)
            if style.max_overlap >= 1.0 or all(_covered(box, b) <= style.max_overlap for b in boxes):
                break
        else:
            continue
        boxes.append(box)
        x1, y1, x2, y2 = box
        desc = f"{color} {shape}"
        if shape == "circle":
            draw.ellipse([x1, y1, x2, y2], fill=COLORS[color])
        elif shape == "triangle":
            draw.polygon([(x1 + w / 2, y1), (x2, y2), (x1, y2)], fill=COLORS[color])
        else:
            draw.rectangle([x1, y1, x2, y2], fill=COLORS[color])
        if shape == "triangle" and rng.random() < poly_fraction:
            objects.append({"desc": desc, "poly": [x1 + w // 2, y1, x2, y2, x1, y2]})
        else:
            objects.append({"desc": desc, "bbox_2d": [x1, y1, x2, y2]})
    if style.clutter:
        _draw_clutter(rng, draw, size, style.clutter - style.clutter // 2)
    objects.sort(key=lambda o: ((o.get("bbox_2d") or o["poly"])[1], (o.get("bbox_2d") or o["poly"])[0]))
    record = {
        "id": f"syn-{index:06d}",
        "images": [f"images/{index:06d}.png"],
        "width": size,
        "height": size,
        "objects": objects,
        "scene": _scene_text(objects, size),
    }
    return record, img


def generate(out_dir: str | Path, num_samples: int, seed: int = 0, min_objects: int = 1, max_objects: int = 4,
             image_size: int = 64, poly_fraction: float = 0.0, filename: str = SYNTHETIC_JSONL,
             style: SceneStyle = SceneStyle()) -> Path:
    """Write the synthetic dataset under ``out_dir``; returns the path of the JSONL (``filename``). Each file appears
    whole (written aside, then renamed). Under torchrun one rank per node calls this (``trainer.sft.run.load_samples``)."""
    if max_objects < min_objects:
        raise ValueError(f"max_objects ({max_objects}) < min_objects ({min_objects})")
    style.sizes(image_size)
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(num_samples):
        record, img = make_record(rng, i, image_size, rng.randint(min_objects, max_objects), poly_fraction, style)
        _write_atomic(out / record["images"][0], lambda fh, img=img: img.save(fh, format="PNG"))
        lines.append(json.dumps(record, ensure_ascii=False))
    path = out / filename
    _write_atomic(path, lambda fh: fh.write(("\n".join(lines) + "\n").encode("utf-8")))
    return path


def _write_atomic(path: Path, write) -> None:
    """``write(fh)`` into a private temporary file beside ``path``, then rename it into place: a reader (another
    node's rank on a shared filesystem) sees the old file or the whole new one, never half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        write(fh)
    os.replace(tmp, path)
