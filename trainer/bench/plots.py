"""The headline figures of ``docs/benchmarks/`` drawn from their JSON records (``python -m trainer bench plot``).

``layouts.png``: trained samples/s per GPU of each layout record, annotated with its ratio to the same-machine
baseline; ``trl.png``: our stage-2 step beside TRL's GRPOTrainer step per size and card; ``demo.png``: the CPU demo's
held-out metrics after the stage-1 warm-up and after stage 2. Each ``*_figure`` takes the parsed JSON and returns a
matplotlib figure whose bars are the records' numbers; ``plot_all`` writes the PNGs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEMO_METRICS = (("f1@0.5", "F1 @ IoU 0.5"), ("precision@0.5", "precision @ 0.5"), ("recall@0.5", "recall @ 0.5"),
                ("ap", "AP 0.50:0.95"), ("ap50", "AP50"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _where(rec: dict[str, Any]) -> str:
    return f"{rec['machine']}, {rec['date']}"


def _card(machine: str) -> str:
    """``2 x NVIDIA H200`` -> ``2xH200``; ``1 x NVIDIA H100 80GB HBM3`` -> ``1xH100``."""
    count, _, name = machine.partition(" x ")
    return f"{count}x{name.removeprefix('NVIDIA ').split()[0]}" if name else machine


def layouts_figure(data: dict[str, Any]):
    """One horizontal bar per record: trained samples/s per GPU, labelled with the layout, machine and date."""
    plt = _pyplot()
    recs = data["records"]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.3 * len(recs)))
    ys = list(range(len(recs)))
    ax.barh(ys, [r["trained_samples_per_s_per_gpu"] for r in recs], color="tab:blue")
    for y, r in zip(ys, recs):
        ratio = r.get("per_gpu_vs_baseline")
        note = "" if ratio is None or r["baseline"] == r["name"] else f"  {ratio:.2f}x the baseline per GPU"
        ax.text(r["trained_samples_per_s_per_gpu"], y, note, va="center", fontsize=7)
    ax.set_yticks(ys, [f"{r['name']} ({_card(r['machine'])}, {r['date']})" for r in recs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.3 * max(r["trained_samples_per_s_per_gpu"] for r in recs))
    ax.set_xlabel("trained samples / s per GPU (random Qwen3-VL-2B, 1024 px images; 1,024-token rollouts, *-preset: "
                  "the preset's own 2,048)")
    ax.set_title("stage-2 layouts")
    fig.tight_layout()
    return fig


def trl_figure(data: dict[str, Any]):
    """Per record with a TRL side: our step wall time beside TRL's, with TRL / ours written above."""
    plt = _pyplot()
    recs = [r for r in data["records"] if r.get("trl")]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(recs)), 4))
    xs = list(range(len(recs)))
    ax.bar([x - 0.2 for x in xs], [r["step_wall_s"] for r in recs], 0.4, label="ours", color="tab:blue")
    ax.bar([x + 0.2 for x in xs], [r["trl"]["step_wall_s"] for r in recs], 0.4, label="TRL GRPOTrainer",
           color="tab:orange")
    for x, r in zip(xs, recs):
        ax.text(x, r["trl"]["step_wall_s"], f"{r['trl']['trl_over_ours']['step_wall']:.2f}x", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(xs, [f"{r['size'].upper()} {r['tuner']}\n{_card(r['machine'])}\n{r['date']}"
                       for r in recs], fontsize=7)
    ax.set_ylabel("seconds per optimizer step (lower is faster)")
    ax.set_title("one stage-2 step, ours beside TRL (same card, model, records, lengths)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def demo_figure(data: dict[str, Any]):
    """The demo record's held-out metrics before and after stage 2."""
    plt = _pyplot()
    rec = data["records"][0]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = list(range(len(DEMO_METRICS)))
    for shift, side, color in ((-0.2, "before", "tab:gray"), (0.2, "after", "tab:green")):
        ax.bar([x + shift for x in xs], [rec[side][k] for k, _ in DEMO_METRICS], 0.4, label=rec[side]["label"],
               color=color)
    ax.set_xticks(xs, [label for _, label in DEMO_METRICS], fontsize=8)
    ax.set_title(f"CPU demo, held-out ({_where(rec)})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


FIGURES = {"layouts.png": ("layouts.json", layouts_figure), "trl.png": ("scale.json", trl_figure),
           "demo.png": ("demo.json", demo_figure)}


def plot_all(records_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Every figure of ``FIGURES`` from the JSON records in ``records_dir`` into ``out_dir`` (default: the same)."""
    plt = _pyplot()
    src = Path(records_dir)
    out = Path(out_dir or src)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for png, (records, draw) in FIGURES.items():
        fig = draw(json.loads((src / records).read_text()))
        fig.savefig(out / png, dpi=100, metadata={"Software": None})
        plt.close(fig)
        written.append(out / png)
    return written
