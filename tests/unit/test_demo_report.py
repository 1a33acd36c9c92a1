"""The demo's ``REPORT.md`` and ``losses.png`` from synthetic ``metrics.jsonl`` rows (no model): each held-out
metric before → after with which direction is better, a verdict on F1@0.5 against the seeds' spread recorded for
the config, every figure naming its source (training rollouts or held-out images), and the held-out panel's axis
scaled to its values. The recorded spread is the one the benchmarks page and its record give."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from trainer.demo import (
    DEFAULT_CONFIG,
    SEED_SPREADS,
    SeedSpread,
    data_limits,
    losses_figure,
    plot_losses,
    seed_spread,
    summarise,
    verdict,
)

REPO = Path(__file__).resolve().parents[2]
SPREAD = SEED_SPREADS[DEFAULT_CONFIG]


def eval_row(step: int, f1: float, ap: float, parse: float) -> dict:
    return {"phase": "eval", "step": step, "eval/f1@50": f1, "eval/ap": ap, "eval/ap50": ap * 5,
            "eval/recall@50": f1 + 0.01, "eval/parse_failure_rate": parse, "eval/num_samples": 200.0,
            "eval/precision@50": f1 - 0.01}


def metrics(tmp_path: Path, before: tuple[float, float, float], after: tuple[float, float, float]) -> Path:
    rows = [{"phase": "stage1", "step": s, "loss": 3.0 - s / 10, "loss/ce": 2.0} for s in (10, 20)]
    rows.append(eval_row(0, *before))
    for step in (1, 2):
        rows.append({"phase": "stage2", "step": step, "loss": 1.5 - step / 10, "loss/ce": 1.0,
                     "rollout/valid_pred": 9, "rollout/invalid_pred": 1, "rollout/matched": 4, "rollout/gt": 10,
                     "rollout/fn_appended": 6, "rollout/fp": 5, "time/step_s": 2.0, "time/rollout_s": 1.0,
                     "time/forward_s": 0.5, "time/backward_s": 0.5})
    rows.append(eval_row(2, *after))
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def report(tmp_path: Path, before, after, config=DEFAULT_CONFIG) -> str:
    return summarise(metrics(tmp_path, before, after), 10.0, config).markdown()


def test_each_metric_reads_before_to_after_with_the_better_direction(tmp_path):
    text = report(tmp_path, (0.102, 0.002, 0.0), (0.098, 0.003, 0.075))
    assert "- F1@0.5: 0.102 → 0.098 (-0.004; higher is better)\n" in text
    assert "- AP 0.50:0.95: 0.002 → 0.003 (+0.001; higher is better)\n" in text
    assert "- parse-failure rate: 0.0% → 7.5% (+7.5 points; lower is better)\n" in text
    assert "negative is better" not in text
    shown = report(tmp_path, (0.1016, 0.0022, 0.0), (0.0976, 0.0025, 0.0))
    assert "- AP 0.50:0.95: 0.002 → 0.003 (+0.001; higher is better)\n" in shown, "the change of the shown values"
    assert "- parse-failure rate: 0.0% → 0.0% (+0.0 points; lower is better)\n" in shown


def test_the_verdict_is_judged_against_the_seeds_spread(tmp_path):
    within = report(tmp_path, (0.102, 0.002, 0.0), (0.098, 0.003, 0.0))
    assert (f"F1@0.5 -0.004: within the spread of 3 seeds (±{SPREAD.sd:.3f}; {SPREAD.source}): "
            "no gain shown.") in within
    gain = report(tmp_path, (0.102, 0.002, 0.0), (0.302, 0.003, 0.0))
    assert f"F1@0.5 +0.200: beyond the spread of 3 seeds (±{SPREAD.sd:.3f}; " in gain and gain.count(": a gain.") == 1
    loss = report(tmp_path, (0.202, 0.002, 0.0), (0.052, 0.003, 0.0))
    assert "F1@0.5 -0.150: beyond the spread of 3 seeds" in loss and ": a loss." in loss
    assert "no gain shown" not in gain + loss


def test_a_config_without_a_recorded_spread_says_the_change_cannot_be_judged(tmp_path):
    other = REPO / "configs" / "demo_gpu.yaml"
    assert seed_spread(other) is None
    text = report(tmp_path, (0.102, 0.002, 0.0), (0.152, 0.003, 0.0), config=other)
    assert (f"F1@0.5 +0.050: no seed spread is recorded for this config, so this change cannot be told from "
            f"seed-to-seed variation; run it at 3 seeds (`python -m trainer demo --config {other} --seed N`, "
            "N = 0, 1, 2) to judge it.") in text
    assert "a gain" not in text


def test_the_spread_is_found_by_the_config_file_however_it_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert seed_spread("configs/demo.yaml") is SPREAD
    assert seed_spread(REPO / "configs" / ".." / "configs" / "demo.yaml") is SPREAD
    copy = tmp_path / "demo.yaml"
    copy.write_text(DEFAULT_CONFIG.read_text())
    assert seed_spread(copy) is None, "a copy may be edited: no spread is claimed for it"


def test_every_figure_names_its_source(tmp_path):
    text = report(tmp_path, (0.102, 0.002, 0.0), (0.098, 0.003, 0.0))
    rollouts = text.index("## Stage-2 training rollouts (training images, all 2 steps)")
    held_out = text.index("## Held-out evaluation (200 held-out images, greedy): before vs after stage 2")
    section = text[rollouts:held_out]
    assert "- valid-object rate of the rollouts: 90.0%" in section
    assert "- rollout objects: matched 8 / GT 20, FN appended 12, FP 10" in section
    assert "- training loss on their targets: first 1.400 → last 1.300" in section
    assert "Stage 2's change on the held-out images:" in text[held_out:]
    fig = losses_figure([json.loads(line) for line in metrics(tmp_path, (0.1, 0.0, 0.0), (0.1, 0.0, 0.0))
                         .read_text().splitlines()])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["stage-1 training losses", "stage-2 training losses",
                      "stage-2 training rollouts (objects per step)",
                      "held-out images (200, greedy; step 0 = after stage 1)"]


def test_the_held_out_axis_is_scaled_to_its_points(tmp_path):
    path = metrics(tmp_path, (0.102, 0.002, 0.0), (0.098, 0.003, 0.0))
    fig = losses_figure([json.loads(line) for line in path.read_text().splitlines()])
    lo, hi = fig.axes[3].get_ylim()
    drawn = [0.102, 0.002, 0.010, 0.112, 0.0, 0.098, 0.003, 0.015, 0.108, 0.0]
    assert (lo, hi) == pytest.approx(data_limits(drawn))
    assert lo < 0.0 and 0.112 < hi < 0.13, "the points fill the axis, not a 0-1 span"
    assert data_limits([0.5, 0.5]) == pytest.approx((0.495, 0.505)), "a flat line keeps a visible span"
    assert data_limits([float("nan")]) == (0.0, 1.0)
    plot_losses(path, tmp_path / "losses.png")
    assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verdict_without_a_config_names_the_plain_command():
    assert "`python -m trainer demo --seed N`" in verdict(0.1, None)
    assert verdict(0.008, SeedSpread(3, 0.0, 0.008, "x")).endswith("within the spread of 3 seeds (±0.008; x): "
                                                                    "no gain shown.")


def test_the_recorded_spread_is_the_benchmarks_record_and_page():
    """The constant is the sample mean and sd of the three default-config seeds in docs/benchmarks/demo.json, and
    the page's mean ± sd row."""
    record = json.loads((REPO / "docs" / "benchmarks" / "demo.json").read_text())
    seeds = [r for r in record["records"] if re.fullmatch(r"demo-seed\d", r["name"])]
    changes = [r["after"]["f1@0.5"] - r["before"]["f1@0.5"] for r in seeds]
    assert len(changes) == SPREAD.seeds == 3
    assert round(statistics.mean(changes), 3) == SPREAD.mean and round(statistics.stdev(changes), 3) == SPREAD.sd
    page = (REPO / "docs" / "benchmarks" / "index.md").read_text(encoding="utf-8")
    sign = "−" if SPREAD.mean < 0 else "+"
    rows = [line for line in page.splitlines() if line.startswith("| mean ± sd |")]
    assert any(f"| **{sign}{abs(SPREAD.mean):.3f} ± {SPREAD.sd:.3f}** |" in row for row in rows)
