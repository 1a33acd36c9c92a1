"""Deterministic synthetic detection data: images with coloured shapes and their ground truth.

``generate(out_dir, cfg)`` writes ``images/*.png`` and ``train.jsonl`` (the same record format users
supply) and returns the JSONL path. Same seed → byte-identical files. Each record also carries ``scene``,
a text rendering of the image (desc + coord tokens) so text-only models can learn the task.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

from trainer.data.objects import to_bin
from trainer.data.output_format import coord_token

#: the JSONL ``generate`` writes by default
SYNTHETIC_JSONL = "train.jsonl"
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle", "triangle")


def _scene_text(objects: list[dict], size: int) -> str:
    parts = []
    for o in objects:
        kind = "bbox_2d" if "bbox_2d" in o else "poly"
        coords = "".join(coord_token(to_bin(v, size)) for v in o[kind])
        parts.append(f"{o['desc']} {coords}")
    return "; ".join(parts)


def make_record(rng: random.Random, index: int, size: int, n_objects: int, poly_fraction: float) -> tuple[dict, Image.Image]:
    img = Image.new("RGB", (size, size), (245, 245, 245))
    draw = ImageDraw.Draw(img)
    objects: list[dict] = []
    for _ in range(n_objects):
        color = rng.choice(sorted(COLORS))
        shape = rng.choice(SHAPES)
        w = rng.randint(size // 8, size // 3)
        h = w if shape in ("square", "circle") else rng.randint(size // 8, size // 3)
        x1 = rng.randint(0, size - w - 1)
        y1 = rng.randint(0, size - h - 1)
        x2, y2 = x1 + w, y1 + h
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
             image_size: int = 64, poly_fraction: float = 0.0, filename: str = SYNTHETIC_JSONL) -> Path:
    """Write the synthetic dataset under ``out_dir``; returns the path of the JSONL (``filename``). Each file appears
    whole (written aside, then renamed). Under torchrun one rank per node calls this (``trainer.sft.run.load_samples``)."""
    if max_objects < min_objects:
        raise ValueError(f"max_objects ({max_objects}) < min_objects ({min_objects})")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(num_samples):
        record, img = make_record(rng, i, image_size, rng.randint(min_objects, max_objects), poly_fraction)
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
