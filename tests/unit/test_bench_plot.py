"""``python -m trainer bench plot``: the published PNGs are redrawn from the JSON records beside them, and each bar is
a record's number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.bench import plots

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def _records(name: str) -> dict:
    return json.loads((DOCS / name).read_text())


def test_every_published_png_is_redrawn_from_its_json(tmp_path):
    from PIL import Image

    written = plots.plot_all(DOCS, tmp_path)
    assert sorted(p.name for p in written) == sorted(plots.FIGURES)
    for png in plots.FIGURES:
        published, redrawn = Image.open(DOCS / png), Image.open(tmp_path / png)
        assert published.size == redrawn.size, png  # the committed figure is this code's drawing of these records


def test_the_layouts_bars_are_the_records_samples_per_gpu():
    import matplotlib.pyplot as plt

    data = _records("layouts.json")
    fig = plots.layouts_figure(data)
    widths = [bar.get_width() for bar in fig.axes[0].patches]
    plt.close(fig)
    assert widths == [r["trained_samples_per_s_per_gpu"] for r in data["records"]]
    for r in data["records"]:
        assert r["trained_samples_per_s_per_gpu"] == pytest.approx(r["trained_samples_per_s"] / r["gpus"], abs=1e-3)


def test_the_trl_bars_are_both_steps_of_each_paired_record():
    import matplotlib.pyplot as plt

    data = _records("scale.json")
    paired = [r for r in data["records"] if r.get("trl")]
    fig = plots.trl_figure(data)
    heights = [bar.get_height() for bar in fig.axes[0].patches]
    plt.close(fig)
    assert {r["size"] for r in paired} == {"2b", "4b", "8b"}
    assert heights == [r["step_wall_s"] for r in paired] + [r["trl"]["step_wall_s"] for r in paired]


def test_the_demo_bars_are_the_held_out_metrics_before_and_after_stage_2():
    import matplotlib.pyplot as plt

    rec = _records("demo.json")["records"][0]
    fig = plots.demo_figure({"records": [rec]})
    heights = [bar.get_height() for bar in fig.axes[0].patches]
    plt.close(fig)
    keys = [k for k, _ in plots.DEMO_METRICS]
    assert heights == [rec["before"][k] for k in keys] + [rec["after"][k] for k in keys]
    assert rec["name"] == "demo-seed0" and rec["command"] == "make demo"
    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "index.md").read_text(encoding="utf-8")
    assert f"| 0 (`make demo`) | `until_first_error` (default) | {rec['before']['f1@0.5']:.3f} → " \
           f"{rec['after']['f1@0.5']:.3f} |" in page, "the figures the demo page quotes"


def test_every_published_record_names_its_date_machine_versions_and_command():
    for name in ("layouts.json", "scale.json", "vllm_rollout.json", "packing.json", "demo.json"):
        for r in _records(name)["records"]:
            assert r["date"].startswith("2026-") and r["machine"] and r["torch"] and r["command"], (name, r["name"])
            assert "session" not in json.dumps(r).lower(), (name, r["name"])
