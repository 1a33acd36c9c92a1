"""Dataset start-up at a million records: the eager loader (a list of ``Sample``s) vs the line-offset index.

Generates a records file in a temporary folder (``RECORDS`` records, 10-30 objects each, 20 on average, one in ten
a polygon; each record points at one of ``IMAGES`` JPEG files of camera-like sizes, so every record's image header
is read and checked as training does) and measures, in a fresh subprocess per variant (so peak RSS is that
variant's alone): start-up (load + every check), peak RSS (``ru_maxrss``) and the RSS before loading (the
interpreter + imports), and the time to read random records afterwards.

* ``eager``: ``records.load_jsonl`` — every record kept as a ``Sample`` (the loader training used before);
* ``index``: ``records.index_jsonl`` — the same checks in one streaming pass; per record only its offset, length,
  line and id hash; records parsed when read (what training uses now);
* ``index, no image headers``: ``index_jsonl(check_images=False)`` — what the header checks cost.

Writes ``data.json`` and ``data.png``::

    python -m trainer bench --only data            # 1,000,000 records (minutes)
    python -m trainer bench --only data --quick    # 2,000 records
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RECORDS = 1_000_000
QUICK_RECORDS = 2_000
IMAGES = 64
SIZES = ((640, 480), (480, 640), (1024, 768), (800, 600), (1280, 720), (1920, 1080))
DESCS = ("person", "car", "bicycle", "traffic light", "dog", "cat", "chair", "cup", "bottle", "potted plant",
         "backpack", "umbrella", "handbag", "bench", "truck", "bus", "book", "clock", "laptop", "dining table")
VARIANTS = (("eager", "load_jsonl", True), ("index", "index_jsonl", True),
            ("index, no image headers", "index_jsonl", False))
READS = 2_000


def _object(rng: random.Random, w: int, h: int) -> dict[str, Any]:
    bw, bh = rng.uniform(8, w / 3), rng.uniform(8, h / 3)
    x1, y1 = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
    desc = rng.choice(DESCS)
    if rng.random() < 0.1:
        n = rng.randint(3, 6)
        poly = [round(v, 2) for _ in range(n) for v in (rng.uniform(x1, x1 + bw), rng.uniform(y1, y1 + bh))]
        return {"desc": desc, "poly": poly}
    return {"desc": desc, "bbox_2d": [round(x1, 2), round(y1, 2), round(x1 + bw, 2), round(y1 + bh, 2)]}


def generate(folder: Path, records: int, seed: int = 0) -> Path:
    """``folder/images/*.jpg`` (``IMAGES`` files) and ``folder/train.jsonl`` (``records`` records); returns the JSONL."""
    from PIL import Image

    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    sizes = []
    for k in range(IMAGES):
        w, h = SIZES[k % len(SIZES)]
        Image.new("RGB", (w, h), (rng.randrange(256), rng.randrange(256), rng.randrange(256))).save(
            folder / "images" / f"{k:03d}.jpg", quality=80)
        sizes.append((w, h))
    path = folder / "train.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for i in range(records):
            k = i % IMAGES
            w, h = sizes[k]
            objects = [_object(rng, w, h) for _ in range(rng.randint(10, 30))]
            fh.write(json.dumps({"id": f"rec-{i:07d}", "images": [f"images/{k:03d}.jpg"], "width": w, "height": h,
                                 "objects": objects}) + "\n")
    return path


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(loader: str, path: str, check_images: bool) -> dict[str, Any]:
    """In this process: start-up of ``loader`` on ``path``, peak RSS, and µs per random record read."""
    from trainer.data import records

    baseline = _rss_mb()
    t0 = time.perf_counter()
    data = getattr(records, loader)(path, check_images=check_images)
    startup = time.perf_counter() - t0
    peak = _rss_mb()
    rng = random.Random(1)
    picks = [rng.randrange(len(data)) for _ in range(READS)]
    t0 = time.perf_counter()
    ids = [data[i].sample_id for i in picks]
    read_us = (time.perf_counter() - t0) / READS * 1e6
    assert ids == [f"rec-{i:07d}" for i in picks], "records are read back by their id"
    return {"records": len(data), "startup_s": round(startup, 2), "peak_rss_mb": round(peak, 1),
            "baseline_rss_mb": round(baseline, 1), "dataset_rss_mb": round(peak - baseline, 1),
            "bytes_per_record": round((peak - baseline) * 2**20 / len(data)), "read_us_per_record": round(read_us, 1)}


def measure_in_subprocess(loader: str, path: Path, check_images: bool) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "trainer.bench.data", loader, str(path), str(int(check_images))],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if "error" not in r]
    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, key, label in ((axes[0], "startup_s", "start-up (load + checks), s"),
                           (axes[1], "peak_rss_mb", "peak RSS, MiB")):
        values = [r[key] for r in rows]
        bars = ax.barh(names, values, color=["tab:red", "tab:green", "tab:olive"][:len(rows)])
        ax.bar_label(bars, labels=[f"{v:,.1f}" for v in values], padding=3, fontsize=8)
        ax.set_xlabel(label)
        ax.invert_yaxis()
        ax.margins(x=0.25)
    fig.suptitle(f"{result['records']:,} records ({result['objects_per_record']:.1f} objects each, "
                 f"{result['file_mb']:,.0f} MB JSONL), {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out_dir: str | Path, quick: bool = False, records: int | None = None) -> dict[str, Any]:
    """Generate the records, measure every variant in its own subprocess, write ``data.json`` / ``data.png``."""
    n = records or (QUICK_RECORDS if quick else RECORDS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = generate(Path(tmp), n)
        gen_s = time.perf_counter() - t0
        with path.open("rb") as fh:
            objects = sum(line.count(b'"desc"') for line in fh)
        result: dict[str, Any] = {
            "records": n, "objects_per_record": objects / n, "file_mb": path.stat().st_size / 1e6,
            "images": IMAGES, "generate_s": round(gen_s, 1), "reads": READS,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "results": []}
        for variant, loader, check_images in VARIANTS:
            r = {"variant": variant, **measure_in_subprocess(loader, path, check_images)}
            result["results"].append(r)
            print(f"data: {variant:24s} " + (f"start-up {r['startup_s']:8.2f} s  peak RSS {r['peak_rss_mb']:9.1f} MiB "
                                             f"(dataset {r['dataset_rss_mb']:.1f})  read {r['read_us_per_record']} "
                                             "µs/record" if "error" not in r else f"error: {r['error']}"), flush=True)
    (out / "data.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "data.png")
    return result


if __name__ == "__main__":
    loader_name, jsonl, check = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    print(json.dumps(measure(loader_name, jsonl, check)))
