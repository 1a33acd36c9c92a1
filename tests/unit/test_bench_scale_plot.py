"""The scale plot's rows: one per run with per-step metrics, labelled so that records of one name from different
sessions stay apart, TRL's step where it ran, and a plot that writes with many runs."""

from trainer.bench.scale import PLOT_MEMORY_PHASES, TRAINING_STEP_PHASES, plot, plot_rows


def _record(name, **extra):
    per_step = {f"time/{p}_s": 0.1 * (i + 1) for i, p in enumerate((*TRAINING_STEP_PHASES, "optimizer"))}
    peaks = {f"mem/{p}_peak_gib": 10.0 + i for i, p in enumerate(PLOT_MEMORY_PHASES)}
    return {"name": name, "per_step": per_step, "peak_gib": peaks, **extra}


def test_rows_keep_sessions_apart_and_carry_trl():
    result = {"device": "X", "runs": [
        _record("4b-full", session=19, call="call1", gpu="gpu1", trl={"step_wall_s": 14.3}),
        _record("4b-full", session=20, call="call2", gpu="gpu0"),
        {"name": "stopped-before-its-first-step"},
        _record("2b-full"),
        _record("8b-lora", session="before 15"),
    ]}
    rows = plot_rows(result)
    assert [r.label for r in rows] == ["4b-full (s19 call1 gpu1)", "4b-full (s20 call2 gpu0)", "2b-full",
                                     "8b-lora (session before 15)"]
    assert [r.trl_step_wall_s for r in rows] == [14.3, None, None, None]
    assert rows[0].split_s["optimizer"] == 0.1 * 6 and rows[0].split_s["weight_sync"] == 0.1
    assert rows[1].peak_gib == {p: 10.0 + i for i, p in enumerate(PLOT_MEMORY_PHASES)}


def test_plot_writes_a_figure_that_grows_with_the_runs(tmp_path):
    from PIL import Image

    few = {"device": "X", "runs": [_record(f"run-{i}", trl={"step_wall_s": 1.0}) for i in range(3)]}
    many = {"device": "X", "runs": [_record(f"run-{i}", session=20) for i in range(30)]}
    plot(few, tmp_path / "few.png")
    plot(many, tmp_path / "many.png")
    assert Image.open(tmp_path / "many.png").height > Image.open(tmp_path / "few.png").height
