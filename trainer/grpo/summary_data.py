"""Synthetic summary-GRPO dataset: BBU and RRU site images with reference summaries, plus irrelevant images.

Rows follow ms-swift's GRPO dataset format: ``messages`` (the user turn with ``<image>``), ``images``,
and extra columns the rewards read: ``summary_ref`` (the reference answer text) and ``metadata``
(``domain``: BBU | RRU | null, ``sample_id``). Deterministic for a given seed.

CLI: ``python -m trainer.grpo.summary_data OUT_DIR [--num-samples N] [--seed S]`` writes
``OUT_DIR/train.jsonl`` and ``OUT_DIR/images/*.png``.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.grpo.summary_format import (
    KEY_CATEGORY,
    KEY_DATASET,
    KEY_GROUPS,
    KEY_NOTES,
    KEY_STATS,
    KEY_TEXT,
    render_answer,
)

PROMPT = "<image>请按格式总结图中的设备信息。无关图片请回答“无关图片”。"


@dataclass(frozen=True)
class CategorySpec:
    """Attribute keys a category always carries (``required``) or sometimes does (``optional``)."""

    required: dict[str, tuple[str, ...]]
    optional: dict[str, tuple[str, ...]]
    nested: dict[str, dict[str, tuple[str, ...]]]
    ocr: bool = False


BBU_CATEGORIES: dict[str, CategorySpec] = {
    "BBU设备": CategorySpec({"品牌": ("华为", "中兴", "爱立信"), "可见性": ("完整", "部分")}, {},
                          {"安装": {"方向": ("水平", "竖直"), "固定": ("牢固", "松动")}}),
    "挡风板": CategorySpec({"安装状态": ("已安装", "缺失")}, {"可见性": ("完整", "部分")}, {}),
    "螺丝": CategorySpec({"状态": ("拧紧", "松动")}, {}, {}),
    "光纤": CategorySpec({"弯曲": ("正常", "过度")}, {"保护": ("有套管", "无套管")}, {}),
    "标签": CategorySpec({"可读性": ("清晰", "模糊")}, {}, {}, ocr=True),
    "接地线": CategorySpec({"连接": ("牢固", "松脱")}, {}, {}),
}
RRU_CATEGORIES: dict[str, CategorySpec] = {
    "RRU设备": CategorySpec({"品牌": ("华为", "中兴")}, {},
                          {"安装": {"方向": ("竖直", "倾斜"), "抱杆": ("是", "否")}}),
    "紧固件": CategorySpec({"状态": ("齐全", "缺失")}, {}, {}),
    "接地线": CategorySpec({"连接": ("牢固", "松脱")}, {"颜色": ("黄绿", "黑色")}, {}),
    "尾纤": CategorySpec({"防水": ("已处理", "未处理")}, {}, {}),
    "标签": CategorySpec({"可读性": ("清晰", "模糊")}, {}, {}),
}
BBU_NOTES = ("机柜门未关闭", "部分区域被线缆遮挡", "拍摄角度过斜")
OCR_WORDS = ("BBU-01", "ODF-3", "GND", "FIBER-A2", "PWR-48V", "CPRI-1", "5G-NR", "SN:7731")
DOMAIN_COLORS = {"BBU": (40, 60, 110), "RRU": (90, 110, 50), None: (200, 200, 200)}


def _counts(rng: random.Random, values: tuple[str, ...], n: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for _ in range(n):
        v = rng.choice(values)
        out[v] = out.get(v, 0) + 1
    return out


def _entry(rng: random.Random, cat: str, spec: CategorySpec) -> tuple[dict[str, Any], int]:
    n = rng.randint(1, 3)
    entry: dict[str, Any] = {KEY_CATEGORY: cat}
    for key, values in spec.required.items():
        entry[key] = _counts(rng, values, n)
    for key, values in spec.optional.items():
        if rng.random() < 0.5:
            entry[key] = _counts(rng, values, n)
    for key, sub in spec.nested.items():
        if rng.random() < 0.7:
            entry[key] = {sk: _counts(rng, vals, n) for sk, vals in sub.items()}
    if spec.ocr:
        entry[KEY_TEXT] = sorted(rng.sample(OCR_WORDS, rng.randint(1, 3)))
    return entry, n


def make_summary(rng: random.Random, domain: str) -> dict[str, Any]:
    """One reference summary for ``domain`` (BBU | RRU)."""
    table = BBU_CATEGORIES if domain == "BBU" else RRU_CATEGORIES
    cats = sorted(rng.sample(sorted(table), rng.randint(1, min(4, len(table)))))
    entries, sizes = zip(*(_entry(rng, c, table[c]) for c in cats))
    summary: dict[str, Any] = {KEY_DATASET: domain, KEY_STATS: list(entries)}
    if domain == "BBU" and rng.random() < 0.4:
        summary[KEY_NOTES] = sorted(rng.sample(BBU_NOTES, rng.randint(1, 2)))
    if domain == "RRU" and rng.random() < 0.6:
        groups = rng.randint(1, 2)
        summary[KEY_GROUPS] = {f"{g + 1}组": {c: max(1, n // groups) for c, n in zip(cats, sizes)}
                               for g in range(groups)}
    return summary


def generate_rows(num_samples: int, seed: int = 0, irrelevant_fraction: float = 0.15) -> list[dict[str, Any]]:
    """Row specs without images: ``sample_id``, ``domain`` (None = irrelevant), ``summary``, ``summary_ref``."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_samples):
        domain = None if rng.random() < irrelevant_fraction else rng.choice(("BBU", "RRU"))
        summary = make_summary(rng, domain) if domain else None
        rows.append({"sample_id": f"summary-{seed}-{i:05d}", "domain": domain, "summary": summary,
                     "summary_ref": render_answer(domain, summary)})
    return rows


def draw_image(path: Path, domain: str | None, seed: int, size: int = 64) -> None:
    """A deterministic ``size`` x ``size`` PNG: a domain-coloured background with a few boxes (scaled with ``size``;
    at the default 64 px the same image as always)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size), DOMAIN_COLORS[domain])
    draw = ImageDraw.Draw(img)
    k = max(1, size // 64)
    for _ in range(rng.randint(1, 4)):
        x0, y0 = rng.randrange(size - 8 * k), rng.randrange(size - 8 * k)
        draw.rectangle([x0, y0, x0 + k * rng.randint(4, 20), y0 + k * rng.randint(4, 20)],
                       fill=tuple(rng.randrange(256) for _ in range(3)))
    img.save(path, format="PNG")


def write_dataset(out_dir: str | Path, num_samples: int = 64, seed: int = 0,
                  irrelevant_fraction: float = 0.15, image_size: int = 64) -> Path:
    """Write ``out_dir/train.jsonl`` (absolute image paths) and the ``image_size``-pixel square images; returns the
    JSONL path."""
    out = Path(out_dir).resolve()
    (out / "images").mkdir(parents=True, exist_ok=True)
    jsonl = out / "train.jsonl"
    with jsonl.open("w", encoding="utf-8") as fh:
        for i, spec in enumerate(generate_rows(num_samples, seed, irrelevant_fraction)):
            image = out / "images" / f"{spec['sample_id']}.png"
            draw_image(image, spec["domain"], seed * 1_000_003 + i, image_size)
            row = {"messages": [{"role": "user", "content": PROMPT}], "images": [str(image)],
                   "summary_ref": spec["summary_ref"],
                   "metadata": {"domain": spec["domain"], "sample_id": spec["sample_id"]}}
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return jsonl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.grpo.summary_data", description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--irrelevant-fraction", type=float, default=0.15)
    p.add_argument("--image-size", type=int, default=64, help="square images of this many pixels a side")
    args = p.parse_args(argv)
    print(write_dataset(args.out_dir, args.num_samples, args.seed, args.irrelevant_fraction, args.image_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
