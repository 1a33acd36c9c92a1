"""The CPU recipe that opens ``docs/guides/own-data.md`` runs as written: its config saved where its first line says,
beside ``configs/demo.yaml``, and every command of its bash block, in order, from a working directory holding a few
records in the page's layout (``data/mine/``, written here as a user's would be). Then what the page says the run
wrote is there: stage-1 and stage-2 rows on one torch thread, the final model, the held-out metrics."""

from __future__ import annotations

import json
import random
import re
import shlex
import shutil
from pathlib import Path

from tests.cli_runs import torch_process_state_kept
from tests.docs.docs_helpers import REPO, blocks

PAGE = REPO / "docs" / "guides" / "own-data.md"
SECTION = "## On any machine first"
COLOURS = {"red square": (220, 40, 40), "blue square": (40, 60, 220), "green square": (40, 180, 60)}


def recipe() -> tuple[str, list[str]]:
    """``(the config block, the bash block's lines)`` of the page's CPU section."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(SECTION))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    inside = [b for b in blocks(PAGE) if start < b.line <= end]
    (config,) = [b.text for b in inside if b.lang == "yaml"]
    (bash,) = [b.text for b in inside if b.lang == "bash"]
    return config, [line for line in bash.splitlines() if line.strip()]


def write_records(root: Path, split: str, n: int, rng: random.Random) -> None:
    """``n`` records of 64 x 64 images with two coloured squares each, in the page's layout under ``root``."""
    from PIL import Image, ImageDraw

    (root / "images").mkdir(parents=True, exist_ok=True)
    with open(root / f"{split}.jsonl", "w") as f:
        for i in range(n):
            image = Image.new("RGB", (64, 64), "white")
            draw, objects = ImageDraw.Draw(image), []
            for desc in rng.sample(sorted(COLOURS), 2):
                x, y, side = rng.randint(0, 40), rng.randint(0, 40), rng.randint(10, 22)
                draw.rectangle([x, y, x + side, y + side], fill=COLOURS[desc])
                objects.append({"desc": desc, "bbox_2d": [x, y, x + side, y + side]})
            name = f"images/{split}-{i}.png"
            image.save(root / name)
            f.write(json.dumps({"id": f"{split}-{i}", "images": [name], "width": 64, "height": 64,
                                "objects": objects}) + "\n")


def test_the_page_opens_with_the_cpu_recipe():
    headings = [line for line in PAGE.read_text().splitlines() if line.startswith("## ")]
    assert headings[0].startswith(SECTION), headings[:2]
    config, lines = recipe()
    assert re.search(r"^\s*tiny:\s*vl\b", config, re.M) and re.search(r"^\s*cpu_threads_per_rank:\s*1\b", config, re.M)
    assert [shlex.split(line)[3] for line in lines] == ["data", "validate", "train", "eval"]


def test_the_cpu_recipe_runs_as_written(tmp_path, monkeypatch, capsys):
    from trainer.cli import main

    config, lines = recipe()
    saved_as = re.match(r"^#\s*(configs/[\w.-]+\.yaml)\s*$", config.splitlines()[0]).group(1)
    (tmp_path / "configs").mkdir()
    shutil.copy(REPO / "configs" / "demo.yaml", tmp_path / "configs" / "demo.yaml")
    (tmp_path / saved_as).write_text(config)
    rng = random.Random(0)
    write_records(tmp_path / "data" / "mine", "train", 8, rng)
    write_records(tmp_path / "data" / "mine", "val", 4, rng)
    monkeypatch.chdir(tmp_path)
    for line in lines:
        words = shlex.split(line, comments=True)
        assert words[:3] == ["python", "-m", "trainer"], f"the recipe runs only the trainer's commands: {line}"
        with torch_process_state_kept():
            rc = main(words[3:])
        assert rc == 0, f"`{line}` exited {rc}:\n{capsys.readouterr().err[-3000:]}"
    run = tmp_path / "runs" / "mine-cpu"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    setup = next(r for r in rows if r.get("phase") == "setup" and "train/cpu_threads_per_rank" in r)
    assert setup["train/cpu_threads_per_rank"] == 1
    stage1 = [r for r in rows if r.get("phase") == "stage1"]
    stage2 = [r for r in rows if r.get("phase") == "stage2" and "loss" in r]
    assert stage1[-1]["step"] == 4 and [r["step"] for r in stage2] == [1, 2], "4 warm-up steps, then 2 stage-2 steps"
    assert sum(r["rollout/gt"] for r in stage2) == 2 * 4 * 2, "every record's two objects reach the matcher"
    assert (run / "final" / "config.json").is_file()
    metrics = json.loads((run / "eval" / "final" / "metrics.json").read_text())
    assert metrics, "eval scored the held-out records"
